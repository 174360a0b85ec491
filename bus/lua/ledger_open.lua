-- KEYS: goal books. ARGV: token budget, pool key prefix, dollar budget (micro-USD, 0 = none),
--       tenant ('' = none), then pool name/budget pairs.
-- Creates the goal's books (and each pool's on first use) unless they exist. Returns 1 if created.
if redis.call('HSETNX', KEYS[1], 'budget', ARGV[1]) == 0 then return 0 end
local names = {}
for i = 5, #ARGV, 2 do
  redis.call('HSETNX', ARGV[2] .. ARGV[i], 'budget', ARGV[i + 1])
  names[#names + 1] = ARGV[i]
end
redis.call('HSET', KEYS[1], 'pools', table.concat(names, '\n'), 'reserved', 0, 'spent', 0)
if ARGV[3] ~= '0' then redis.call('HSET', KEYS[1], 'budget_micro', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'tenant', ARGV[4]) end
return 1

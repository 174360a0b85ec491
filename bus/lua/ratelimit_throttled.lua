-- KEYS: bucket hash. ARGV: rpm, itpm, otpm, retry after (s), penalty seconds, penalty factor.
local t = now()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local blocked = math.max(tonumber(redis.call('HGET', KEYS[1], 'blocked_until') or 0), t + tonumber(ARGV[4]))
redis.call('HSET', KEYS[1], 'blocked_until', string.format('%.6f', blocked),
           'penalty_until', string.format('%.6f', t + tonumber(ARGV[5])), 'factor', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'throttled', 1)
store(KEYS[1], t, {0, 0, 0})
return 1

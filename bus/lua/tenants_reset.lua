-- KEYS: tenant settings. ARGV: pool key prefix, tenant name.
-- Starts the current period afresh: its spend (every kind, cost, per model) goes to zero, and is
-- added to `before_reset_spent` / `before_reset_cost`; open reservations stay held and settle
-- normally, so `reserved` and `open` are untouched and the books still balance. The goals' grants
-- are reported (and end) first, so the spend they hold is counted before the reset.
report_all(KEYS[1] .. ':grants', true)
local period = redis.call('HGET', KEYS[1], 'period')
local name = 'tenant:' .. ARGV[2] .. ':' .. period_label(period, now())
local key = ARGV[1] .. name
local h = redis.call('HGETALL', key)
if #h == 0 then return name end
local spent, cost = 0, 0
for i = 1, #h, 2 do
  local field = h[i]
  if field == 'spent' then spent = tonumber(h[i + 1]) end
  if field == 'cost_micro_usd' then cost = tonumber(h[i + 1]) end
  if field == 'spent' or field == 'cost_micro_usd' or string.sub(field, 1, 6) == 'spent_'
     or string.sub(field, 1, 2) == 'm:' or field == 'calls' or field == 'overrun' then
    redis.call('HDEL', key, field)
  end
end
redis.call('HSET', key, 'spent', 0)
redis.call('HINCRBY', key, 'before_reset_spent', spent)
redis.call('HINCRBY', key, 'before_reset_cost', cost)
redis.call('HINCRBY', key, 'resets', 1)
return name

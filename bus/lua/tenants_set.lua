-- KEYS: tenant settings, tenants set. ARGV: period, budget tokens, budget micro-USD, max running
-- ('' = unchanged for each). Returns the settings after the change.
-- Every grant of the tenant's goals (`<settings>:grants`) ends here: each is reported to its pool,
-- so the next call of every goal decides on the pool under the new settings.
local f = {'period', 'budget_tokens', 'budget_micro', 'max_running'}
for i, field in ipairs(f) do
  if ARGV[i] ~= '' then redis.call('HSET', KEYS[1], field, ARGV[i]) end
end
redis.call('HSETNX', KEYS[1], 'period', 'none')
report_all(KEYS[1] .. ':grants', true)
redis.call('SADD', KEYS[2], ARGV[5])
return redis.call('HGETALL', KEYS[1])

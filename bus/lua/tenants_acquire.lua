-- KEYS: running slots zset, tenant settings. ARGV: member, slot ttl (s).
-- Returns {1, running} when the member holds a slot (taken or renewed), {0, running, limit} when full.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now))
local limit = tonumber(redis.call('HGET', KEYS[2], 'max_running') or 0) or 0
local exp = string.format('%.6f', now + tonumber(ARGV[2]))
-- Without a limit there is nothing to count (every attempt of every executor passes here).
if limit <= 0 or redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], exp, ARGV[1])
  return {1}
end
return {0, redis.call('ZCARD', KEYS[1]), limit}

-- KEYS: lease, leases zset. ARGV: epoch, ttl_ms, now_ms, member. Returns 1, or 0 if the lease was lost.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
local expires = tonumber(ARGV[3]) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'expires_ms', expires)
redis.call('ZADD', KEYS[2], expires, ARGV[4])
return 1

-- KEYS: lease, leases zset. ARGV: epoch, member. The attempt is over: nobody needs to resume it.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'expires_ms', 0, 'holder', '')
redis.call('ZREM', KEYS[2], ARGV[2])
return 1

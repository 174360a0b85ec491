-- KEYS: lease, leases zset. ARGV: epoch, member, watchdog time (ms). The holder gives the attempt up
-- unfinished (its worker is shutting down, or its job will be re-run later): the epoch moves on, so
-- any late write or renewal of the old holder fails, and the lease is free now so that the next
-- `execute` job takes it at once; the watchdogs resume it at the given time if no such job comes.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'expires_ms', 0, 'holder', '')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1

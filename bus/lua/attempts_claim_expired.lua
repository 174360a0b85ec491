-- Claims an expired lease for resumption so that only one watchdog re-enqueues it per period.
-- KEYS: leases zset. ARGV: member, now_ms, new score. Returns 1 if claimed.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1

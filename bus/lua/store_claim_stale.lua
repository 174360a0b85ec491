-- The supervisor claims a goal whose last progress is older than its bound, so that one planner
-- worker (of many) examines it per bound. KEYS: active index. ARGV: goal id, cutoff, now.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1

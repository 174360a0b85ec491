-- KEYS: goal hash, goal index, submitted index, goal stream, global stream, active-goal index
-- ARGV: goal id, record JSON, state, created score, updated_at, event JSON, maxlen
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'record', ARGV[2], 'plan_version', '0', 'replans', '0',
           'updated_at', ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('ZADD', KEYS[6], ARGV[4], ARGV[1])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', tonumber(ARGV[7]) * 10, '*', 'e', ARGV[6])
return 1

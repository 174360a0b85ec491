-- KEYS: requests hash, decisions hash, inbox, goal stream, global stream
-- ARGV: call id, decision, inbox member, event JSON, maxlen
-- Returns 'ok' | 'decided' (an earlier decision stands; nothing written) | 'missing'
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 'decided' end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 'missing' end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[4])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', tonumber(ARGV[5]) * 10, '*', 'e', ARGV[4])
return 'ok'

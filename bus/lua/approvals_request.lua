-- KEYS: requests hash, decisions hash, inbox, goal stream, global stream
-- ARGV: call id, request JSON, inbox member, now (ms), event JSON, maxlen
-- Returns 1 if the request is new, 0 if it was already pending or already decided (nothing written):
-- an executor resumed while the call still waits asks again, and must not add a second event.
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'e', ARGV[5])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', tonumber(ARGV[6]) * 10, '*', 'e', ARGV[5])
return 1

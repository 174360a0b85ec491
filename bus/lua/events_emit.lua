-- KEYS: goal stream, global stream. ARGV: event JSON, maxlen. Returns the goal stream position.
-- A script rather than MULTI/EXEC: the same atomic pair of appends in three commands instead of four.
local pos = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', tonumber(ARGV[2]) * 10, '*', 'e', ARGV[1])
return pos

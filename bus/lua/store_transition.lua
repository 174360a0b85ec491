-- KEYS: entity hash, goal stream, global stream, a sorted set to leave on any move, active-goal index
-- ARGV: target, allowed sources (comma-separated), expected attempt ('' = any), event JSON ('' = none),
--       maxlen, member to remove from KEYS[4] ('' = none), goal id, progress score ('remove' = the goal
--       ended: leave the active index), then field/value pairs to set.
-- Returns {'ok', previous} | {'same', state} | {'missing'} | {'illegal', current} | {'stale', attempt}
-- One read and one write of the record (a script's cost is mostly its redis.call count).
local h = redis.call('HMGET', KEYS[1], 'state', 'attempt')
local cur = h[1]
if not cur then return {'missing'} end
if ARGV[3] ~= '' then
  local att = h[2] or '0'
  if att ~= ARGV[3] then return {'stale', att} end
end
if cur == ARGV[1] then return {'same', cur} end
local allowed = false
for s in string.gmatch(ARGV[2], '[^,]+') do
  if s == cur then allowed = true end
end
if not allowed then return {'illegal', cur} end
local fields = {'state', ARGV[1]}
for i = 9, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
if ARGV[6] ~= '' then redis.call('ZREM', KEYS[4], ARGV[6]) end
if ARGV[8] == 'remove' then
  redis.call('ZREM', KEYS[5], ARGV[7])
else
  redis.call('ZADD', KEYS[5], 'XX', ARGV[8], ARGV[7])
end
-- ARGV[4]: the events of this move, one compact JSON per line (what caused it first, then the state event).
for e in string.gmatch(ARGV[4], '[^\n]+') do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'e', e)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', tonumber(ARGV[5]) * 10, '*', 'e', e)
end
return {'ok', cur}

-- KEYS: lease, pending, [goal stream, global stream]. ARGV: epoch, event JSON ('' = none), stream
-- maxlen, then field/value pairs. Returns 1, or 0 if the lease was lost (nothing written).
-- The event (a tool call's audit record) is appended with the outcome it reports: one round trip.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
local pairs = {}
for i = 4, #ARGV do pairs[#pairs + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(pairs))
if ARGV[2] ~= '' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[2])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', tonumber(ARGV[3]) * 10, '*', 'e', ARGV[2])
end
return 1

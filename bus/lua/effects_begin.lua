-- KEYS: effects hash. ARGV: key, record JSON. Claims the call unless an earlier one did it (or may
-- have): returns nil when claimed, else the earlier record's JSON.
local st = redis.call('HGET', KEYS[1], 'state:' .. ARGV[1])
if st and st ~= 'failed' then return redis.call('HGET', KEYS[1], ARGV[1]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'state:' .. ARGV[1], 'started')
return false

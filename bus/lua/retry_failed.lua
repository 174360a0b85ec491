-- KEYS: the goal's ledger books. ARGV: now (ms). Returns when the current trouble began (ms).
local since = redis.call('HGET', KEYS[1], 'trouble_since')
if since and since ~= '0' then return tonumber(since) end
redis.call('HSET', KEYS[1], 'trouble_since', ARGV[1])
return tonumber(ARGV[1])

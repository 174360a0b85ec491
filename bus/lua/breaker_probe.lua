-- KEYS: the model's breaker hash. ARGV: cooldown. Claims the half-open probe: 1 if this caller got it.
-- The claim holds for one cool-down: a prober that died frees it then (its failure re-opens at once).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local h = redis.call('HMGET', KEYS[1], 'open_until', 'probe')
local open_until, probe = tonumber(h[1] or '0'), tonumber(h[2] or '0')
if open_until == 0 or now < open_until or (probe > 0 and now - probe < tonumber(ARGV[1])) then return 0 end
redis.call('HSET', KEYS[1], 'probe', string.format('%.6f', now))
return 1

-- KEYS: the model's breaker hash. ARGV: failures, window, cooldown.
-- Returns {opened (0/1), open_until}.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local h = redis.call('HMGET', KEYS[1], 'count', 'since', 'open_until')
local count, since, open_until = tonumber(h[1] or '0'), tonumber(h[2] or '0'), tonumber(h[3] or '0')
local failures, window, cooldown = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl = math.ceil((window + cooldown) * 2000)
if open_until > 0 then
  if now < open_until then return {0, tostring(open_until)} end
  -- half-open: the probe (or a call that began before the breaker opened) failed: open again
  open_until = now + cooldown
  redis.call('HSET', KEYS[1], 'count', '0', 'since', string.format('%.6f', now), 'open_until',
             string.format('%.6f', open_until))
  redis.call('HDEL', KEYS[1], 'probe')
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {1, tostring(open_until)}
end
if now - since > window then count = 0; since = now end
count = count + 1
if count >= failures then
  open_until = now + cooldown
  redis.call('HSET', KEYS[1], 'count', '0', 'since', string.format('%.6f', now), 'open_until',
             string.format('%.6f', open_until))
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {1, tostring(open_until)}
end
redis.call('HSET', KEYS[1], 'count', tostring(count), 'since', string.format('%.6f', since))
redis.call('PEXPIRE', KEYS[1], ttl)
return {0, '0'}

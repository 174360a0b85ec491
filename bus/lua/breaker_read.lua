-- KEYS: breaker hashes. Returns {now, then count, open_until, probe of each}.
local t = redis.call('TIME')
local out = {t[1] .. '.' .. string.format('%06d', tonumber(t[2]))}
for _, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 'count', 'open_until', 'probe')
  out[#out + 1] = h[1] or '0'
  out[#out + 1] = h[2] or '0'
  out[#out + 1] = h[3] or '0'
end
return out

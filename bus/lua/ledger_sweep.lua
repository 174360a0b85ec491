-- KEYS: open hash, expiry zset, [books to read]. ARGV: sweep batch.
-- Forfeits expired reservations, then returns {number swept, field, value, ...} of KEYS[3].
local out = {sweep(KEYS[1], KEYS[2], now(), tonumber(ARGV[1]))}
if KEYS[3] then
  for _, v in ipairs(redis.call('HGETALL', KEYS[3])) do out[#out + 1] = v end
end
return out

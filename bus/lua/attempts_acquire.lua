-- KEYS: lease, leases zset, results hash. ARGV: holder, ttl_ms, now_ms, member, result field.
-- Returns {'ok', epoch, started_ms, stored result or ''} or {'held', epoch}. The attempt's stored
-- result comes back with the lease (a re-run finds it without another round trip).
local h = redis.call('HMGET', KEYS[1], 'expires_ms', 'holder', 'epoch', 'started_ms')
local exp = tonumber(h[1] or '0')
if exp > tonumber(ARGV[3]) and h[2] ~= ARGV[1] then
  return {'held', h[3] or '0'}
end
local epoch = tonumber(h[3] or '0') + 1
local started = h[4] or ARGV[3]
local expires = tonumber(ARGV[3]) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'epoch', epoch, 'holder', ARGV[1], 'expires_ms', expires, 'started_ms', started)
redis.call('ZADD', KEYS[2], expires, ARGV[4])
return {'ok', tostring(epoch), started, redis.call('HGET', KEYS[3], ARGV[5]) or ''}

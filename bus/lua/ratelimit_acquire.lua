-- KEYS: bucket hash, queue zset, goal books (its `tenant` field names the tenant when ARGV[2] is '').
-- ARGV: waiter id, tenant, input, output, rpm, itpm, otpm, stale after.
-- Returns {'ok', waited_since} | {'wait', seconds}
local t = now()
local caps = {tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])}
local alive = KEYS[2] .. ':alive'
local id, tenant = ARGV[1], ARGV[2]
if tenant == '' then tenant = redis.call('HGET', KEYS[3], 'tenant') or 'default' end
if not redis.call('ZSCORE', KEYS[2], id) then
  local vt = tonumber(redis.call('HGET', KEYS[1], 'vt') or 0)
  local last = tonumber(redis.call('HGET', KEYS[1], 'last:' .. tenant) or 0)
  local score = math.max(vt, last) + 1
  redis.call('ZADD', KEYS[2], score, id)
  redis.call('HSET', KEYS[1], 'last:' .. tenant, score, 'since:' .. id, string.format('%.6f', t))
end
redis.call('ZADD', alive, string.format('%.6f', t), id)
-- Drop waiters that stopped polling (their worker died), so they cannot block the queue.
local stale = redis.call('ZRANGEBYSCORE', alive, '-inf', string.format('%.6f', t - tonumber(ARGV[8])))
for _, s in ipairs(stale) do
  redis.call('ZREM', KEYS[2], s)
  redis.call('ZREM', alive, s)
  redis.call('HDEL', KEYS[1], 'since:' .. s)
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
if head ~= id then return {'wait', 'queue'} end
local blocked = tonumber(redis.call('HGET', KEYS[1], 'blocked_until') or 0)
if blocked > t then return {'wait', string.format('%.6f', blocked - t)} end
local levels, factor = refill(KEYS[1], t, caps)
local need = {1, tonumber(ARGV[3]), tonumber(ARGV[4])}
local wait = 0
for i = 1, 3 do
  if caps[i] > 0 then
    local cap = caps[i] * factor
    -- A call larger than a whole bucket waits for a full bucket (it could never pass otherwise).
    local n = math.min(need[i], cap)
    if levels[i] < n then wait = math.max(wait, (n - levels[i]) * 60 / cap) end
  end
end
store(KEYS[1], t, levels)
if wait > 0 then return {'wait', string.format('%.6f', wait)} end
for i = 1, 3 do
  if caps[i] > 0 then levels[i] = levels[i] - need[i] end
end
store(KEYS[1], t, levels)
local score = redis.call('ZSCORE', KEYS[2], id)
redis.call('ZREM', KEYS[2], id)
redis.call('ZREM', alive, id)
redis.call('HSET', KEYS[1], 'vt', score)
local since = redis.call('HGET', KEYS[1], 'since:' .. id) or string.format('%.6f', t)
redis.call('HDEL', KEYS[1], 'since:' .. id)
return {'ok', string.format('%.6f', t - tonumber(since))}

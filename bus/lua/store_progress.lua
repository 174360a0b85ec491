-- The state and attempt of each task hash in KEYS, in one round trip and one consistent view: the
-- critic asks this of every task of a plan at each review (whether all results are in, whether all
-- are accepted), and whole records cost it about three times the client CPU (bench/RESULTS.md).
-- Returns {state1, attempt1, state2, attempt2, ...}: false, false for a task without a record.
-- A key that holds no hash, or a hash without a state, is an error naming its place in KEYS
-- ('task record <i>: ...'), so the caller can name the key.
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.pcall('HMGET', key, 'state', 'attempt')
  if v.err then return redis.error_reply('ERR task record ' .. i .. ': ' .. v.err) end
  if not v[1] and redis.call('EXISTS', key) == 1 then
    return redis.error_reply('ERR task record ' .. i .. ': no state field')
  end
  out[2 * i - 1] = v[1]
  out[2 * i] = v[2]
end
return out

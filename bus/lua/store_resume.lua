-- Resume a failed or budget_exhausted goal (the only ways out of those states; the state machine's
-- table keeps them final for every other writer). Accepted (`done`) tasks stay; every other task of
-- the goal that had not ended for good goes back to `pending`, to be dispatched as a new attempt.
-- KEYS: goal hash, task-id set, goal stream, global stream, active index, provider-trouble key (of
--       an earlier version; the clock is now the ledger's `trouble_since`, ended here too), goal
--       ledger, then arq result keys of the goal-level jobs to forget (their outcome is void).
-- ARGV: updated_at, event JSON (its state is patched in), maxlen, task-key prefix, goal id, now,
--       new budget ('' = unchanged), task states reset to pending, resumable goal states, terminal
--       goal states (each comma-separated)
-- Returns {'ok', previous, target, resumes} | {'same', state} | {'illegal', state} | {'missing'}
--       | {'budget', spent}
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing'} end
local function listed(csv, state)
  for s in string.gmatch(csv, '[^,]+') do if s == state then return true end end
  return false
end
if not listed(ARGV[9], cur) then
  if listed(ARGV[10], cur) then return {'illegal', cur} end
  return {'same', cur}
end
if ARGV[7] ~= '' then
  local spent = tonumber(redis.call('HGET', KEYS[7], 'spent') or '0')
  local reserved = tonumber(redis.call('HGET', KEYS[7], 'reserved') or '0')
  if tonumber(ARGV[7]) <= spent + reserved then return {'budget', tostring(spent + reserved)} end
  redis.call('HSET', KEYS[7], 'budget', ARGV[7])
  redis.call('HSET', KEYS[1], 'budget_tokens', ARGV[7])
end
local target = 'running'
if (redis.call('HGET', KEYS[1], 'plan_version') or '0') == '0' then target = 'planning' end
local resumes = redis.call('HINCRBY', KEYS[1], 'resumes', 1)
redis.call('HSET', KEYS[1], 'state', target, 'replans', '0', 'updated_at', ARGV[1])
redis.call('HDEL', KEYS[1], 'reason')
local reset = {}
for s in string.gmatch(ARGV[8], '[^,]+') do reset[s] = true end
for _, tid in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local tkey = ARGV[4] .. tid
  local ts = redis.call('HGET', tkey, 'state')
  if ts and reset[ts] then
    redis.call('HSET', tkey, 'state', 'pending', 'reason', 'goal resumed', 'updated_at', ARGV[1])
  end
end
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[5])
redis.call('DEL', KEYS[6])
redis.call('HDEL', KEYS[7], 'trouble_since')
for i = 8, #KEYS do redis.call('DEL', KEYS[i]) end
local event = string.gsub(ARGV[2], '__TARGET__', target)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'e', event)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', tonumber(ARGV[3]) * 10, '*', 'e', event)
return {'ok', cur, target, tostring(resumes)}

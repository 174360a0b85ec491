-- Cancel a goal and every task of it that has not ended, in one step.
-- KEYS: goal hash, task-id set, goal stream, global stream, submitted index, active-goal index
-- ARGV: goal sources (comma-separated), task terminal states (comma-separated), reason, updated_at,
--       event JSON, maxlen, task-key prefix, goal id
-- The task keys are derived in the script from the id set: taskloom targets a single Redis (or
-- Sentinel), never Cluster, which arq does not support either.
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return {'missing'} end
if cur == 'cancelled' then return {'same', cur} end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == cur then allowed = true end end
if not allowed then return {'illegal', cur} end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'reason', ARGV[3], 'updated_at', ARGV[4])
redis.call('ZREM', KEYS[5], ARGV[8])
redis.call('ZREM', KEYS[6], ARGV[8])
local terminal = {}
for s in string.gmatch(ARGV[2], '[^,]+') do terminal[s] = true end
local n = 0
for _, tid in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local tkey = ARGV[7] .. tid
  local ts = redis.call('HGET', tkey, 'state')
  if ts and not terminal[ts] then
    redis.call('HSET', tkey, 'state', 'cancelled', 'reason', ARGV[3], 'updated_at', ARGV[4])
    n = n + 1
  end
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'e', ARGV[5])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', tonumber(ARGV[6]) * 10, '*', 'e', ARGV[5])
return {'ok', cur, tostring(n)}

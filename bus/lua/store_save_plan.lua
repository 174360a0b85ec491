-- KEYS: goal hash, plan key, task-id set, goal stream, global stream
-- ARGV: expected current version, plan JSON, updated_at, event JSON, maxlen, task-key prefix,
--       terminal goal states (comma-separated), then task ids. New task ids get a pending task
--       hash; existing ones are left to the caller.
-- Returns {'ok', version} | {'stale', current} | {'missing'} | {'ended', state}
local cur = redis.call('HGET', KEYS[1], 'plan_version')
if not cur then return {'missing'} end
-- An ended goal takes no new plan (a cancel may land between the planner's read and this write).
local st = redis.call('HGET', KEYS[1], 'state')
for s in string.gmatch(ARGV[7], '[^,]+') do
  if s == st then return {'ended', st} end
end
if cur ~= ARGV[1] then return {'stale', cur} end
local v = tonumber(cur) + 1
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'plan_version', tostring(v), 'updated_at', ARGV[3])
for i = 8, #ARGV do
  local tkey = ARGV[6] .. ARGV[i]
  if redis.call('EXISTS', tkey) == 0 then
    redis.call('HSET', tkey, 'state', 'pending', 'attempt', '0', 'plan_version', tostring(v),
               'updated_at', ARGV[3])
    redis.call('SADD', KEYS[3], ARGV[i])
  end
end
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[4])
redis.call('XADD', KEYS[5], 'MAXLEN', '~', tonumber(ARGV[5]) * 10, '*', 'e', ARGV[4])
return {'ok', tostring(v)}

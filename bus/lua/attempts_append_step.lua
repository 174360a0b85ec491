-- KEYS: lease, steps, pending, task record. ARGV: epoch, expected index, step JSON, '1' to read the
-- task. Appends the step only at its index (a duplicate append is a no-op) and clears the pending
-- step. Returns {1 appended | 2 already there, the task's state, its attempt} (state '' when not
-- read), or {0} when the lease was lost. The task's state rides along for the check before the next
-- model call (cancelled? moved on to another attempt?), which then needs no read of its own.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return {0} end
local status = 2
if redis.call('LLEN', KEYS[2]) <= tonumber(ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('DEL', KEYS[3])
  status = 1
end
if ARGV[4] ~= '1' then return {status, '', '0'} end
local task = redis.call('HMGET', KEYS[4], 'state', 'attempt')
return {status, task[1] or '', task[2] or '0'}

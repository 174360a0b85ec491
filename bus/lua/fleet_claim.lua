-- arq 0.28's pick-up of one job (`Worker.start_jobs`: WATCH the in-progress mark, EXISTS it, ZSCORE
-- the job, then MULTI PSETEX EXEC), as one atomic script.
-- KEYS: the job's in-progress mark, the queue.
-- ARGV: the job id, now in ms, the mark's TTL in ms.
-- Returns the job's score, or nil when it must not start here (already in progress, no longer
-- queued, or not due yet).
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return false end
redis.call('SET', KEYS[1], '1', 'PX', ARGV[3])
return score

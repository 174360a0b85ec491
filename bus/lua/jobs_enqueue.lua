-- arq's `ArqRedis.enqueue_job` (0.28), plus the supervisor's driver record and the wake-up, as one
-- script: one round trip instead of five (WATCH, EXISTS, MULTI...EXEC, HSET, XADD), two commands
-- fewer, and the driver record can no longer be missing for a queued job. The job key and queue
-- entry are exactly what arq writes (tests/test_arq_internals.py fails if arq's enqueue changes).
-- KEYS: job key, result key, queue, drivers hash, wake stream
-- ARGV: job id, serialized job, expiry (ms), score (ms), driver slot, driver record, wake ('1'/'0'), wake maxlen
-- Returns 1 if enqueued, 0 if a job or result with this id exists (nothing written).
if redis.call('EXISTS', KEYS[1], KEYS[2]) > 0 then return 0 end
redis.call('PSETEX', KEYS[1], ARGV[3], ARGV[2])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[4], ARGV[5], ARGV[6]) end
if ARGV[7] == '1' then redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[8], '*', 'job', ARGV[1]) end
return 1

-- bench.ledger's stand-in for an attempt's step write, the write an executor's held settle rides on
-- (bus.attempts.AttemptStore): one field of one hash set.
-- KEYS: the hash. ARGV: the value.
redis.call('HSET', KEYS[1], 'step', ARGV[1])
return 1

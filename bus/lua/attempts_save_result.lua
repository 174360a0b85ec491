-- KEYS: lease, results hash. ARGV: epoch, field, result JSON. Returns 1 stored, 2 already there, 0 lost.
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 1 then return 1 end
return 2

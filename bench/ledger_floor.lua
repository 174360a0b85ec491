-- bench.ledger's floor: the least one script can do for a held pair of the ledger's reserve and
-- settle (read and write a goal's books, move a reservation in the expiry set), with no decision.
-- KEYS: a goal's books (hash), an expiry set. ARGV: the reservation's entry, its expiry (epoch s).
local g = redis.call('HMGET', KEYS[1], 'budget', 'spent', 'reserved', 'open', 'calls', 'spent_input',
                     'spent_output', 'spent_cache_read', 'cost_micro_usd', 'reserved_micro')
redis.call('HSET', KEYS[1], 'spent', 1, 'reserved', 2, 'open', 3, 'calls', 4, 'spent_input', 5,
           'spent_output', 6, 'spent_cache_read', 7, 'cost_micro_usd', 8, 'reserved_micro', 9, 'served', 10)
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return {'ok', ARGV[2], ARGV[1]}

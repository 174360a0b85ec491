-- KEYS: open hash, expiry zset.
-- ARGV: reservation's expiry entry (`Reservation.entry`, or its id), mode ('settle' | 'release' | 'forfeit'
--       | 'unknown'), end the goal's provider trouble ('1'/'0': its clock `trouble_since` is set to 0 in
--       the same write as the goal's books, so a successful call ends it without a command of its own),
--       a field and value to write to the goal's books in that same write ('' '' for none: the model
--       that served a role, `served:<role>`), then for 'settle': input, output, cache read, cache
--       write tokens, cost, unpriced (0/1).
-- Returns 1 if the reservation was open (and is now closed), 2 if so and the served model of the role
-- changed (the first call of the role, or a failover), 0 if it was already closed.
return close_argv(KEYS[1], KEYS[2], ARGV, 1, #ARGV)

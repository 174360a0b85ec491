-- KEYS: open hash, expiry zset.
-- ARGV: the number of closes n, then each close as a count c and c arguments (ledger_close.lua's ARGV).
-- Returns each close's reply (0, 1, 2), or an error's text when that close failed.
local closed = close_many(KEYS[1], KEYS[2], ARGV, 1)
return closed

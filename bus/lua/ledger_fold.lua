-- The header of a reserve that first closes reservations whose settles were held back
-- (`Ledger.settle_later`): the closes, then ledger_reserve.lua, in one atomic step.
-- KEYS: goal books, open hash, expiry zset (the reserve's).
-- ARGV: the number of closes n, then each close as a count c and c arguments (ledger_close.lua's
--       ARGV), then the reserve's arguments.
-- Returns {closes, the reserve's reply}: closes[i] is the i-th close's reply (0, 1, 2), or an
-- error's text when that close failed (its reservation stays open, forfeited when it expires).
local closed, next_arg = close_many(KEYS[2], KEYS[3], ARGV, 1)
local A = {unpack(ARGV, next_arg)}  -- one table made at its size, not grown an argument at a time
local function reply(r) return {closed, r} end

-- The header of a reserve on its own (ledger_reserve.lua): its arguments are ARGV, its reply is as is.
local A = ARGV
local function reply(r) return r end

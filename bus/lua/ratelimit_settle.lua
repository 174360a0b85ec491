-- KEYS: bucket hash. ARGV: rpm, itpm, otpm, input back, output back. Gives back unused tokens.
local t = now()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local levels, factor = refill(KEYS[1], t, caps)
levels[2] = math.min(caps[2] * factor, levels[2] + tonumber(ARGV[4]))
levels[3] = math.min(caps[3] * factor, levels[3] + tonumber(ARGV[5]))
store(KEYS[1], t, levels)
return 1

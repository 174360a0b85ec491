-- KEYS: bucket hash. ARGV: rpm, itpm, otpm, then remaining requests, input, output (-1 = unknown).
local t = now()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local levels = refill(KEYS[1], t, caps)
for i = 1, 3 do
  local r = tonumber(ARGV[3 + i])
  if r >= 0 and caps[i] > 0 and r < levels[i] then levels[i] = r end
end
store(KEYS[1], t, levels)
return 1

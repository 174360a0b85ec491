-- Shared: refill the three buckets to now. Levels are floats in the hash; `cap` is the minute's
-- allowance scaled by the penalty factor while a penalty lasts.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function refill(key, t, caps)
  local h = redis.call('HMGET', key, 'req', 'in', 'out', 'ts', 'penalty_until', 'factor')
  local factor = 1
  if tonumber(h[5] or 0) > t then factor = tonumber(h[6] or 1) end
  local last = tonumber(h[4] or t)
  local levels = {}
  for i = 1, 3 do
    local cap = caps[i] * factor
    local level = tonumber(h[i] or cap)
    levels[i] = math.min(cap, level + math.max(0, t - last) * cap / 60)
  end
  return levels, factor
end

local function store(key, t, levels)
  redis.call('HSET', key, 'req', levels[1], 'in', levels[2], 'out', levels[3], 'ts', string.format('%.6f', t))
end

-- Runs after a header that defines `A` (its arguments) and `reply` (what it returns):
-- ledger_reserve_args.lua (a reserve of its own: A = ARGV) or ledger_fold.lua (closes first).
-- KEYS: goal books, open hash, expiry zset.
-- A: reservation id, input estimate, max_tokens, min output, ttl, input and output price
--       (micro-USD per million tokens, the dearest input rate), pool key prefix, sweep batch,
--       model ('-' = none), priced (1/0), tenant key prefix, and a hint of the current UTC day: its
--       label (YYYY-MM-DD) and first second (epoch), from the worker's clock. The hint is used only
--       when Redis's own clock falls inside that day; otherwise the label is computed here.
-- Returns {'ok', max_tokens, amount, expires_at, pools, worst cost, tenant pool name, spent permille,
--         expiry entry} (max_tokens, amount, worst cost and permille as integers, the rest strings)
--       | {'missing'} | {'refused', pool name or '', unit, budget, spent, reserved, requested}
local t = now()
local inp, maxt, minr = tonumber(A[2]), tonumber(A[3]), tonumber(A[4])
local pin, pout, priced = tonumber(A[6]), tonumber(A[7]), A[11] == '1'
local function num(v) return tonumber(v or 0) or 0 end
local function limit(v) local x = num(v); if x > 0 then return x end return nil end

-- Most output tokens with ceil((inp * pin + out * pout) / 1e6) <= h (micro-USD of headroom), or
-- -1 when not even the input fits. Exact in doubles: past the first test, h * 1e6 is below the
-- call's worst case, a number of at most ~1e14.
local function usd_out(h)
  if h * 1000000 >= inp * pin + maxt * pout then return maxt end
  local rest = h * 1000000 - inp * pin
  if rest < 0 then return -1 end
  if pout == 0 then return maxt end
  local o = math.floor(rest / pout)
  while o > 0 and inp * pin + o * pout > h * 1000000 do o = o - 1 end
  return o
end

-- Tokens and micro-USD a grant sets aside beyond the call that takes it: GRANT_CALLS calls' worth,
-- but never more than a quarter of what the pool has left (shared among the goals holding grants),
-- so other goals of the tenant still find room (and, when they do not, take back what grants hold
-- unused: at most RECLAIM of them per call).
local GRANT_CALLS = 16
local RECLAIM = 32

-- Reads the books this call draws from and decides how many output tokens it gets: returns the
-- goal's fields, the books, the tenant pool (key, name, new), the output tokens and the limiter
-- (books, unit), the highest spent fraction, and the goal's grant when the call is to be made
-- under it; nil when the goal has no books. `slow`: the tenant's pool itself is read and decides,
-- rather than the goal's grant.
local function decide(slow)
  local g = redis.call('HMGET', KEYS[1], 'budget', 'spent', 'reserved', 'pools', 'tenant', 'budget_micro',
                       'cost_micro_usd', 'reserved_micro', 'open', 'tg')
  if not g[1] then return nil end

  -- Every set of books this call draws from: tb/ub are the token and micro-USD budgets (nil = no
  -- limit of that unit), ts/us spent, tr/ur reserved.
  -- `raw` keeps the fields as read (reserved, open, reserved_micro), to write the new values back.
  local books = {}
  local function add(key, name, tb, ts, tr, ub, us, ur, raw)
    books[#books + 1] = {key = key, name = name, tb = tb, ts = ts, tr = tr, ub = ub, us = us, ur = ur, raw = raw}
  end
  add(KEYS[1], '', num(g[1]), num(g[2]), num(g[3]), limit(g[6]), num(g[7]), num(g[8]), {g[3], g[9], g[8]})
  for name in string.gmatch(g[4] or '', '[^\n]+') do
    local key = A[8] .. name
    local p = redis.call('HMGET', key, 'budget', 'spent', 'reserved', 'budget_micro', 'cost_micro_usd',
                         'reserved_micro', 'open')
    -- A missing pool has token budget 0: it refuses.
    add(key, name, num(p[1]), num(p[2]), num(p[3]), limit(p[4]), num(p[5]), num(p[6]), {p[3], p[7], p[6]})
  end
  local tkey, tname, tnew, gr, frac = '-', '', false, nil, 0
  if g[5] then
    gr = grant_of(g[10])
    if not slow and gr and gr[10] ~= '' and t < gr[7] then
      -- The goal's grant: what it holds less the calls in flight under it and their spend since the
      -- last report. Only the tenant's limited units are checked (`units`).
      tkey, tname, frac = gr[10], gr[12], gr[9] / 1000
      local free = gr[1] - (num(g[3]) - gr[3]) - (num(g[2]) - gr[5])
      local free_m = gr[2] - (num(g[8]) - gr[4]) - (num(g[7]) - gr[6])
      local units = gr[8]
      add(KEYS[1], tname, string.find(units, 't', 1, true) and free or nil, 0, 0,
          string.find(units, 'u', 1, true) and free_m or nil, 0, 0, nil)
      books[#books].grant = true
    else
      -- The tenant's pool of the current period (UTC calendar); its limits are the tenant's settings
      -- as they are now (a grant taken under older settings was reported when they changed).
      local c = redis.call('HMGET', A[12] .. g[5], 'period', 'budget_tokens', 'budget_micro')
      -- The label from the hint saves the calendar arithmetic (a tenth of the tenant path's extra).
      local label, day0 = 'all', tonumber(A[14])
      if c[1] == 'day' or c[1] == 'month' then
        if day0 and t >= day0 and t < day0 + 86400 and #A[13] == 10 then
          label = c[1] == 'day' and A[13] or string.sub(A[13], 1, 7)
        else
          label = period_label(c[1], t)
        end
      end
      tname = 'tenant:' .. g[5] .. ':' .. label
      tkey = A[8] .. tname
      local p = redis.call('HMGET', tkey, 'spent', 'reserved', 'cost_micro_usd', 'reserved_micro', 'budget', 'open')
      tnew = not p[5]
      add(tkey, tname, limit(c[2]), num(p[1]), num(p[2]), limit(c[3]), num(p[3]), num(p[4]), {p[2], p[6], p[4]})
      books[#books].pool = {period = c[1], units = (limit(c[2]) and 't' or '') .. (limit(c[3]) and 'u' or '')}
    end
  end

  -- The limiter is the books that leave the fewest output tokens; the goal wins ties, so a refusal
  -- names a pool only when the pool is tighter. clamp_output() in Python is the token rule.
  local out, lim, unit = maxt, books[1], 'tokens'
  for _, b in ipairs(books) do
    if b.tb then
      if b.tb > 0 and not b.grant then frac = math.max(frac, b.ts / b.tb) end
      local o = math.min(maxt, b.tb - b.ts - b.tr - inp)
      if o < out then out, lim, unit = o, b, 'tokens' end
    end
    if b.ub then
      if not b.grant then frac = math.max(frac, b.us / b.ub) end
      local o = priced and usd_out(b.ub - b.us - b.ur) or -1
      if o < out then out, lim, unit = o, b, priced and 'usd' or 'unpriced' end
    end
  end
  return g, books, tkey, tname, tnew, out, lim, unit, frac, gr
end

local g, books, tkey, tname, tnew, out, lim, unit, frac, gr = decide(false)
if not g then return reply({'missing'}) end
-- Expired reservations (their holders died) are forfeited only when they could matter: when this
-- call cannot have its full max_tokens. Then they are swept, and the call decided again. A call
-- with room to spare costs no sweep; `Ledger.sweep`, every snapshot and the supervisor's rounds
-- sweep too.
if out < maxt and sweep(KEYS[2], KEYS[3], t, tonumber(A[9])) > 0 then
  g, books, tkey, tname, tnew, out, lim, unit, frac, gr = decide(false)
end
local holders = g[5] and A[12] .. g[5] .. ':grants'
-- The slow path: a tenant's goal whose grant cannot carry this call (none yet, its period over, or
-- too little left) decides on the tenant's pool itself.
if g[5] and (lim.grant or books[#books].pool ~= nil) then
  if gr and gr[10] ~= '' then
    -- The grant is reported first: its spend reaches the pool and what it holds unused goes back,
    -- so the pool decides on every token it has. A grant of another period ends here.
    report(KEYS[1], gr[10] ~= tkey, holders)
    g, books, tkey, tname, tnew, out, lim, unit, frac, gr = decide(true)
  elseif not gr then
    -- The books' first grant: what they counted before it is not the grant's to report.
    local fields = {'reserved', 'reserved_micro', 'spent', 'cost_micro_usd'}
    for _, c in ipairs(REPORTED) do fields[#fields + 1] = c end
    for f in pairs(KIND_OF) do fields[#fields + 1] = f end
    local cur = redis.call('HMGET', KEYS[1], unpack(fields))
    local args = {'tg', grant_text({0, 0, num(cur[1]), num(cur[2]), num(cur[3]), num(cur[4]), 0, '-', 0, '', '', '', '1'})}
    for i = 5, #fields do
      if cur[i] then args[#args + 1] = 't0:' .. fields[i]; args[#args + 1] = cur[i] end
    end
    redis.call('HSET', KEYS[1], unpack(args))
    gr = grant_of(args[2])
  end
  -- Still short: what the other goals' grants of the tenant hold unused is taken back, from at most
  -- RECLAIM of them (picked at random) so that one call's work stays bounded however many goals run.
  if out < maxt then
    local reclaimed = false
    for _, other in ipairs(redis.call('SRANDMEMBER', holders, RECLAIM)) do
      if other ~= KEYS[1] and report(other, false, holders, true) then reclaimed = true end
    end
    if reclaimed then g, books, tkey, tname, tnew, out, lim, unit, frac, gr = decide(true) end
  end
end
local floor = math.max(1, math.min(maxt, minr))
if out < floor then
  redis.call('HINCRBY', KEYS[1], 'refusals', 1)
  if lim.name ~= '' then redis.call('HINCRBY', lim.key, 'refusals', 1) end
  if unit == 'tokens' then
    return reply({'refused', lim.name, unit, tostring(lim.tb), tostring(lim.ts), tostring(lim.tr), tostring(inp + floor)})
  end
  return reply({'refused', lim.name, unit, tostring(lim.ub), tostring(lim.us), tostring(lim.ur),
                tostring(math.ceil((inp * pin + floor * pout) / 1000000))})
end

local amount = inp + out
local fcost = math.ceil((inp * pin + out * pout) / 1000000)
-- One HSET per book from the values read above (HINCRBY per field cost a command each). A book
-- listed twice (a goal naming its tenant's pool as a pool too) is read afresh the second time.
-- The tenant's pool: on the slow path it sets aside this call and the grant beyond it (its `open`
-- and spend come with the goal's reports); under a grant it is not touched at all.
local written, goal_extra = {}, nil
for _, b in ipairs(books) do
  if b.pool then
    -- With others holding grants too, each takes less (a quarter of what is left, shared among the
    -- holders), so a pool near its end books (nearly) every call itself, as without grants.
    local share = 4 * (redis.call('SCARD', holders) + 1)
    local function extra(h, per_call)
      if not h then return GRANT_CALLS * per_call end
      return math.max(0, math.min(GRANT_CALLS * per_call, math.floor((h - per_call) / share)))
    end
    local xt = extra(b.tb and b.tb - b.ts - b.tr, amount)
    local xm = extra(b.ub and b.ub - b.us - b.ur, fcost)
    local args = {'reserved', int_of(b.raw[1], b.key, 'reserved') + amount + xt,
                  'reserved_micro', int_of(b.raw[3], b.key, 'reserved_micro') + fcost + xm}
    if tnew then
      -- A new period's books: `budget` 0 marks them as existing (the limits live in the tenant's settings).
      args[#args + 1] = 'budget'
      args[#args + 1] = '0'
      args[#args + 1] = 'period_started'
      args[#args + 1] = string.format('%.3f', t)
    end
    redis.call('HSET', b.key, unpack(args))
    written[b.key] = true
    -- The grant now holds, beyond what it held in flight, this call and `xt`/`xm` more. Its
    -- fraction spent is the pool's as of now (the degrade switch reads it until the next grant).
    -- The grant's model: this call's, unless calls of the model it has are still in flight under it.
    if gr[1] == 0 and gr[2] == 0 or gr[11] == '' then gr[11] = A[10] end
    gr[1], gr[2] = gr[1] + amount + xt, gr[2] + fcost + xm
    gr[7], gr[8], gr[10], gr[12] = period_end(b.pool.period, t), b.pool.units == '' and '-' or b.pool.units, tkey, tname
    local pf = b.ub and b.us / b.ub or 0
    if b.tb and b.tb > 0 then pf = math.max(pf, b.ts / b.tb) end
    gr[9] = math.floor(pf * 1000)
    goal_extra = {'tg', grant_text(gr)}
    redis.call('SADD', holders, KEYS[1])
  end
end
for _, b in ipairs(books) do
  if b.grant or b.pool then
    -- nothing more: written above, or the goal's grant (its books are written below)
  elseif written[b.key] then
    local fields, delta = {'reserved', 'open'}, {amount, 1}
    if fcost ~= 0 then fields[3], delta[3] = 'reserved_micro', fcost end
    add_all(b.key, fields, delta)
  else
    -- One HSET from the values read (numbers: exact, ledger_lib), its arguments written out: the
    -- tables and loop that built them cost more than the command.
    written[b.key] = true
    local key, raw = b.key, b.raw
    local reserved, open = int_of(raw[1], key, 'reserved') + amount, int_of(raw[2], key, 'open') + 1
    local extra = key == KEYS[1] and goal_extra
    if fcost == 0 and not extra then
      redis.call('HSET', key, 'reserved', reserved, 'open', open)
    else
      local micro = int_of(raw[3], key, 'reserved_micro') + fcost
      if not extra then
        redis.call('HSET', key, 'reserved', reserved, 'open', open, 'reserved_micro', micro)
      else
        redis.call('HSET', key, 'reserved', reserved, 'open', open, 'reserved_micro', micro, extra[1], extra[2])
      end
    end
  end
end
if tnew then
  redis.call('ZADD', A[12] .. g[5] .. ':periods', string.format('%.6f', t), tname)
end
-- A call of a tenant's goal is made under its grant: '@' (the grant's model) or '#' (another model),
-- the grant's number and the pool's key in its record.
if tkey ~= '-' then tkey = (A[10] == gr[11] and '@' or '#') .. gr[13] .. '|' .. tkey end
local rec = {A[1], KEYS[1], tostring(amount), tostring(fcost), A[10], tkey}
for _, b in ipairs(books) do
  if b.key ~= KEYS[1] and not b.pool then rec[#rec + 1] = b.key end
end
local expires = t + tonumber(A[5])
local member = table.concat(rec, '\n')
local expires_at = string.format('%.6f', expires)
redis.call('ZADD', KEYS[3], expires_at, member)
-- Integers as numbers (Redis replies with them as integers): a tostring is a C sprintf each, about a
-- microsecond of Redis's time on a slow core. The expiry keeps its string, a float.
return reply({'ok', out, amount, expires_at, g[4] or '', fcost, tname, math.floor(frac * 1000), member})

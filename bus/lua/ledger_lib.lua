-- Shared by every script. A reservation's expiry entry is `id \n goal key \n amount \n forfeit cost \n
-- model \n tenant pool key \n pool key...` (model and tenant pool are '-' when there is none).
-- `close` takes one open reservation off the books (the goal's, the tenant period pool's, each pool's):
--   'settle'  spent += the reported usage (by kind), cost += the priced usage;
--   'release' nothing spent;
--   'forfeit' / 'expire' / 'unknown'  spent_unknown += the full amount, cost += the worst-case cost
--   ('unknown': the call succeeded but its reply carried no usage; counted as `usage_unknown`).
-- Every book also gives back the worst-case cost it held (`reserved_micro`). The tenant period pool
-- also keeps the spend per model (`m:<model>:<kind>`), for `taskloom ledger --tenant`, and its
-- settled tokens by kind only there (no `spent_input`...: their sums are read instead).
-- It returns false when the id is not open: closing is idempotent.
local function lines(s)
  local out = {}
  for part in string.gmatch(s, '[^\n]+') do out[#out + 1] = part end
  return out
end

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local SETTLED = {'spent_input', 'spent_output', 'spent_cache_read', 'spent_cache_write', 'cost_micro_usd',
                 'unpriced'}
local KINDS = {'input', 'output', 'cache_read', 'cache_write', 'cost'}

-- Numbers are passed to redis.call as they are: Redis writes a number argument with 17 significant
-- digits (never Lua's 14), so an integer below 2^53 is written exactly, and no string.format per
-- field is paid for (~0.4 us each).
-- Add `delta[i]` to the integer field `fields[i]` of hash `key`, for every i, in two commands (one
-- HMGET, one HSET) whatever the number of fields: a script's cost is mostly its redis.call count,
-- and one HINCRBY per field made a settle cost ~25 commands. Exact like HINCRBY for integers up to
-- 2^53 (token counts and micro-USD stay far below), and like HINCRBY it refuses a field that holds
-- no integer.
local function int_of(v, key, field)
  if not v then return 0 end
  local n = tonumber(v)
  if not n or n % 1 ~= 0 then error('hash value is not an integer: ' .. key .. ' ' .. field) end
  return n
end

-- `extra`: more field/value pairs to write in the same HSET. `watch`, `watch2`: fields read in the
-- same HMGET (before the write); their values are returned.
local function add_all(key, fields, delta, extra, watch, watch2)
  local n = #fields
  if n == 0 then return nil end
  local w1, w2 = n, n
  if watch then w1 = w1 + 1; w2 = w1; fields[w1] = watch end
  if watch2 then w2 = w2 + 1; fields[w2] = watch2 end
  local cur = redis.call('HMGET', key, unpack(fields))
  -- Made at a size that holds a settle's fields (a table grown an entry at a time is rebuilt at
  -- every power of two); unpack() below takes only what was written.
  local args = {false, false, false, false, false, false, false, false, false, false, false, false, false, false,
                false, false, false, false, false, false, false, false, false, false}
  for i = 1, n do
    local field = fields[i]
    args[2 * i - 1] = field
    args[2 * i] = int_of(cur[i], key, field) + delta[i]
  end
  local m = 2 * n
  if extra then
    for _, v in ipairs(extra) do m = m + 1; args[m] = v end
  end
  redis.call('HSET', key, unpack(args, 1, m))
  return watch and cur[w1], watch2 and cur[w2]
end

-- The fields a close changes in one book, and by how much. `model`: the book keeps the spend per
-- model, as `<mprefix><model>:<kind>`; `totals`: it keeps its settled tokens by kind too (a goal's
-- books do; the tenant period pool keeps them per model only).
local function changes(amount, fcost, mode, u, model, mprefix, totals)
  local fields, delta, n = {'reserved', 'open'}, {-amount, -1}, 2
  if fcost ~= 0 then n = n + 1; fields[n] = 'reserved_micro'; delta[n] = -fcost end
  if mode == 'release' then
    n = n + 1; fields[n] = 'releases'; delta[n] = 1
  elseif mode == 'settle' then
    n = n + 1; fields[n] = 'calls'; delta[n] = 1
    -- A book that keeps the spend per model (the tenant period pool) keeps its tokens by kind only
    -- there: its totals by kind are their sums (LedgerSnapshot.from_hash), and four fields fewer
    -- in the settle cut the tenant path's extra by about a tenth.
    for i = totals and 1 or 5, 6 do
      if u[i] ~= 0 then n = n + 1; fields[n] = SETTLED[i]; delta[n] = u[i] end
    end
    local total = u[1] + u[2] + u[3] + u[4]
    n = n + 1; fields[n] = 'spent'; delta[n] = total
    if total > amount then n = n + 1; fields[n] = 'overrun'; delta[n] = total - amount end
    if model then
      local prefix = mprefix .. model .. ':'
      for i = 1, 5 do
        if u[i] ~= 0 then n = n + 1; fields[n] = prefix .. KINDS[i]; delta[n] = u[i] end
      end
    end
  else
    n = n + 1; fields[n] = 'calls'; delta[n] = 1
    n = n + 1; fields[n] = 'spent_unknown'; delta[n] = amount
    n = n + 1; fields[n] = 'spent'; delta[n] = amount
    n = n + 1; fields[n] = 'cost_micro_usd'; delta[n] = fcost
    n = n + 1; fields[n] = mode == 'expire' and 'expired' or mode == 'unknown' and 'usage_unknown' or 'forfeits'
    delta[n] = 1
    if model then
      n = n + 1; fields[n] = mprefix .. model .. ':unknown'; delta[n] = amount
      n = n + 1; fields[n] = mprefix .. model .. ':cost'; delta[n] = fcost
    end
  end
  return fields, delta
end

-- Closes one reservation in the books at `key` (see `changes`); returns the value `watch` (a field
-- name, or nil) held before the write.
local function book(key, amount, fcost, mode, u, model, extra, watch)
  local fields, delta = changes(amount, fcost, mode, u, model, 'm:', not model)
  return add_all(key, fields, delta, extra, watch)
end

-- A goal of a tenant holds a grant from the tenant's period pool (`reserve`, slow path): tokens and
-- micro-USD the pool set aside for it in one go, so that its calls reserve and settle in the goal's
-- books alone. Its record is the goal's field `tg`, one value a line:
--   1-2 the grant in tokens and micro-USD (held by the pool: free + in flight + spent since the last
--       report), 3-4 the goal's tokens and micro-USD reserved outside the grant (calls made before
--       it), 5-6 the goal's spent tokens and micro-USD already reported to the pool, 7 the end of the
--       pool's period (epoch seconds), 8 the units the tenant limits ('t', 'u', 'tu' or '-'), 9 the
--       pool's spent permille when granted, 10 the pool's key ('' when the grant has ended), 11 its
--       model (the model of its calls whose spend per model is not kept apart), 12 the pool's name,
--       13 its number (one more each time a grant ends: a call's record names the grant it was made
--       under, '@<number>|<pool key>', so a call of an ended grant is known as such).
-- Its other counters already reported are `t0:<field>`. A call of another model ('#' in its record,
-- not '@') keeps its spend per model apart until reported, as `tm:<model>:<kind>`; the grant's own
-- model's is what the goal's totals by kind grew by, less those. `report` hands all of it to the pool.
local GRANT = '^([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)$'
local function grant_of(tg)
  if not tg then return nil end
  local a = {string.match(tg, GRANT)}
  if #a ~= 13 then error('grant record is damaged: ' .. tg) end
  for i = 1, 7 do a[i] = tonumber(a[i]) end
  a[9] = tonumber(a[9])
  return a
end

local function grant_text(a)
  return string.format('%.17g\n%.17g\n%.17g\n%.17g\n%.17g\n%.17g\n%.17g\n%s\n%.17g\n%s\n%s\n%s\n%s',
                       a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13])
end

-- The goal's counters a grant reports to the pool as they grow (`t0:<field>`: the value reported).
local REPORTED = {'open', 'calls', 'releases', 'unpriced', 'overrun', 'spent_unknown', 'usage_unknown',
                  'forfeits', 'expired'}
-- A literal, not a loop over REPORTED: every script of the ledger runs this file's definitions on
-- every call, and nine inserts into an empty table (each growing it) cost more than the rest of
-- the definitions together (about 5 µs of Redis's time per call on a 2-core Intel Xeon).
local IS_REPORTED = {open = true, calls = true, releases = true, unpriced = true, overrun = true,
                     spent_unknown = true, usage_unknown = true, forfeits = true, expired = true}
local BASE = {reserved = 3, reserved_micro = 4, spent = 5, cost_micro_usd = 6}
-- The goal's totals by kind, whose growth (`t0:<field>`: as reported) is the grant's model's spend.
local KIND_OF = {spent_input = 'input', spent_output = 'output', spent_cache_read = 'cache_read',
                 spent_cache_write = 'cache_write'}

-- A close that was booked on the pool itself (its grant had ended, or an older worker made the
-- call): its changes to the goal's books (`fields`, `delta`) move the baselines too, so the goal
-- never reports them a second time, and what it wrote as unreported spend per model is taken back.
local function unreport(gkey, tg, fields, delta)
  local gr = grant_of(tg)
  local f2, d2 = {}, {}
  for i = 1, #delta do
    local field, d = fields[i], delta[i]
    local slot = BASE[field]
    if slot then
      gr[slot] = gr[slot] + d
    elseif IS_REPORTED[field] or KIND_OF[field] then
      f2[#f2 + 1] = 't0:' .. field; d2[#d2 + 1] = d
    elseif string.sub(field, 1, 3) == 'tm:' then
      f2[#f2 + 1] = field; d2[#d2 + 1] = -d
    end
  end
  if #f2 == 0 then
    redis.call('HSET', gkey, 'tg', grant_text(gr))
  else
    add_all(gkey, f2, d2, {'tg', grant_text(gr)})
  end
end

local function num0(v) return tonumber(v or 0) or 0 end

-- Reports the goal's grant to its pool: the growth of its counters, its spend (tokens, micro-USD,
-- per model), and gives back what the grant holds beyond the calls in flight under it. `detach`:
-- the grant ends; its calls in flight stay held by the pool, each closed there on its own. Returns
-- false when the goal holds no grant. Idempotent: a second report has nothing to add. `reclaim`: only
-- for what the grant holds beyond its calls in flight; a grant holding nothing more is left as it is
-- (read in one short HMGET: a goal short of room may look at many grants).
local function report(gkey, detach, holders, reclaim)
  if reclaim then
    local q = redis.call('HMGET', gkey, 'tg', 'reserved', 'reserved_micro', 'spent', 'cost_micro_usd')
    local gr = grant_of(q[1])
    if not gr or gr[10] == '' then
      redis.call('SREM', holders, gkey)
      return false
    end
    if gr[1] == num0(q[2]) - gr[3] + num0(q[4]) - gr[5] and gr[2] == num0(q[3]) - gr[4] + num0(q[5]) - gr[6] then
      return false  -- it holds its calls in flight and their spend, nothing unused
    end
  end
  local h = redis.call('HGETALL', gkey)
  local v = {}
  for i = 1, #h, 2 do v[h[i]] = h[i + 1] end
  local gr = grant_of(v.tg)
  if not gr or gr[10] == '' then
    if holders then redis.call('SREM', holders, gkey) end
    return false
  end
  local res, res_m, spent, cost = num0(v.reserved), num0(v.reserved_micro), num0(v.spent), num0(v.cost_micro_usd)
  local inflight, inflight_m = res - gr[3], res_m - gr[4]
  local pf = {'reserved', 'reserved_micro', 'spent', 'cost_micro_usd'}
  local pd = {inflight - gr[1], inflight_m - gr[2], spent - gr[5], cost - gr[6]}
  local gargs, dels = {}, {}
  for _, c in ipairs(REPORTED) do
    local now_c = num0(v[c])
    local d = now_c - num0(v['t0:' .. c])
    if d ~= 0 then
      pf[#pf + 1] = c; pd[#pd + 1] = d
      gargs[#gargs + 1] = 't0:' .. c; gargs[#gargs + 1] = now_c
    end
  end
  -- Spend per model: the calls of other models kept theirs apart; the grant's model's is the rest.
  local main = {unknown = num0(v.spent_unknown) - num0(v['t0:spent_unknown']), cost = cost - gr[6]}
  for f, kind in pairs(KIND_OF) do
    local now_c = num0(v[f])
    main[kind] = now_c - num0(v['t0:' .. f])
    gargs[#gargs + 1] = 't0:' .. f; gargs[#gargs + 1] = now_c
  end
  for k, x in pairs(v) do
    if string.sub(k, 1, 3) == 'tm:' then
      local d = tonumber(x)
      local kind = string.match(k, ':([^:]*)$')
      if d ~= 0 then
        pf[#pf + 1] = 'm:' .. string.sub(k, 4); pd[#pd + 1] = d
        main[kind] = (main[kind] or 0) - d
      end
      dels[#dels + 1] = k
    end
  end
  for kind, d in pairs(main) do
    if d ~= 0 then pf[#pf + 1] = 'm:' .. gr[11] .. ':' .. kind; pd[#pd + 1] = d end
  end
  add_all(gr[10], pf, pd)
  if detach then
    gr = {0, 0, res, res_m, spent, cost, 0, '-', 0, '', '', '', tostring(tonumber(gr[13]) + 1)}
  else
    gr[1], gr[2], gr[5], gr[6] = inflight, inflight_m, spent, cost
  end
  gargs[#gargs + 1] = 'tg'; gargs[#gargs + 1] = grant_text(gr)
  redis.call('HSET', gkey, unpack(gargs))
  if #dels > 0 then redis.call('HDEL', gkey, unpack(dels)) end
  if holders and gr[1] == 0 and gr[2] == 0 then redis.call('SREM', holders, gkey) end
  return true
end

-- Reports every grant of a tenant's goals (`holders`: the set of their books' keys); returns how many.
local function report_all(holders, detach)
  local n = 0
  for _, gkey in ipairs(redis.call('SMEMBERS', holders)) do
    if report(gkey, detach, holders) then n = n + 1 end
  end
  return n
end

-- `member` is the reservation's entry in the expiry set: its id, then its record (kept in the
-- member itself, so opening and closing a reservation each touch one key less). A member that is a
-- bare id keeps its record in the open hash instead (older workers wrote that form): both close.
-- `goal_extra`: field/value pairs written to the goal's books with the same HSET.
local function close(open_key, expiry_key, member, mode, u, goal_extra, watch)
  if redis.call('ZREM', expiry_key, member) == 0 then return false end
  local f = lines(member)
  if #f == 1 then
    local rec = redis.call('HGET', open_key, member)
    if not rec then return false end
    redis.call('HDEL', open_key, member)
    f = lines(member .. '\n' .. rec)
  end
  local amount, fcost = tonumber(f[3]), tonumber(f[4])
  local tp = f[6]
  -- '@' or '#', the grant's number, '|', the pool key: made under the goal's tenant grant; '#': of
  -- another model than the grant's, its spend per model kept apart in the goal's books until reported.
  local c1 = string.byte(tp, 1)
  local granted = c1 == 64 or c1 == 35
  local fields, delta = changes(amount, fcost, mode, u, c1 == 35 and f[5] or nil, 'tm:', true)
  -- `watch` {field, value}: whether the goal's books held another value in that field before (read
  -- in the books' own HMGET), as the grant record is.
  local before, tg = add_all(f[2], fields, delta, goal_extra, watch and watch[1], tp ~= '-' and 'tg' or nil)
  local changed = watch and before ~= watch[2]
  if granted then
    local bar = string.find(tp, '|', 2, true)
    local number = string.sub(tp, 2, bar - 1)
    tp = string.sub(tp, bar + 1)
    if not (tg and string.sub(tg, -#number - 1) == '\n' .. number and string.find(tg, '\n' .. tp .. '\n', 1, true)) then
      book(tp, amount, fcost, mode, u, f[5])  -- its grant has ended: closed on the pool itself
      unreport(f[2], tg, fields, delta)
    end
  elseif tp ~= '-' then
    book(tp, amount, fcost, mode, u, f[5])  -- an older worker's call, made on the pool itself
    if tg then unreport(f[2], tg, fields, delta) end
  end
  for i = 7, #f do book(f[i], amount, fcost, mode, u, nil) end
  if changed then return 2 end
  return 1
end

-- One close from its arguments `a[first..last]` (ledger_close.lua's ARGV): 1 or 2 if it closed the
-- reservation (2: the role's served model changed), 0 if it was closed already.
local function close_argv(open_key, expiry_key, a, first, last)
  local u
  if last - first == 10 then  -- a settle's six numbers, in one table made at its size
    u = {tonumber(a[first + 5]), tonumber(a[first + 6]), tonumber(a[first + 7]), tonumber(a[first + 8]),
         tonumber(a[first + 9]), tonumber(a[first + 10])}
  else
    u = {}
    for i = first + 5, last do u[#u + 1] = tonumber(a[i]) end
  end
  local extra, watch = nil, nil
  if a[first + 2] == '1' then extra = {'trouble_since', '0'} end
  if a[first + 3] ~= '' then
    extra = extra or {}
    extra[#extra + 1] = a[first + 3]; extra[#extra + 1] = a[first + 4]
    watch = {a[first + 3], a[first + 4]}
  end
  return close(open_key, expiry_key, a[first], a[first + 1], u, extra, watch) or 0
end

-- Closes listed in `a` from `first`: their number n, then each as a count c and c arguments of
-- `close_argv`. Each runs on its own (pcall): one that fails (books that hold no number) is
-- reported as its error's text, and the others still close. Returns the replies and the index of
-- the first argument after the closes.
local function close_many(open_key, expiry_key, a, first)
  local replies, i = {}, first + 1
  for _ = 1, tonumber(a[first]) do
    local c = tonumber(a[i])
    local ok, r = pcall(close_argv, open_key, expiry_key, a, i + 1, i + c)
    if not ok then r = 'error: ' .. tostring(type(r) == 'table' and r.err or r) end
    replies[#replies + 1] = r
    i = i + c + 1
  end
  return replies, i
end

local function sweep(open_key, expiry_key, t, limit)
  local members = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', string.format('%.6f', t), 'LIMIT', 0, limit)
  for _, member in ipairs(members) do close(open_key, expiry_key, member, 'expire', nil) end
  return #members
end

-- UTC calendar date of epoch seconds `t` (H. Hinnant's civil_from_days; bus.tenants.period_label
-- is the same rule in Python).
local function civil(t)
  local z = math.floor(t / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function period_label(period, t)
  if period == 'day' then return string.format('%04d-%02d-%02d', civil(t)) end
  if period == 'month' then
    local y, m = civil(t)
    return string.format('%04d-%02d', y, m)
  end
  return 'all'
end

-- Days since the epoch of a UTC calendar date (H. Hinnant's days_from_civil).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- The first second after the period `t` falls in (a grant of that period's pool ends then).
local function period_end(period, t)
  if period == 'day' then return (math.floor(t / 86400) + 1) * 86400 end
  if period == 'month' then
    local y, m = civil(t)
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    return days_from_civil(y, m, 1) * 86400
  end
  return 1e15
end

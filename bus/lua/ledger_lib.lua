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
  if not n or n ~= math.floor(n) then error('hash value is not an integer: ' .. key .. ' ' .. field) end
  return n
end

-- `extra`: more field/value pairs to write in the same HSET. `watch`: a field read in the same HMGET
-- (before the write); its value is returned.
local function add_all(key, fields, delta, extra, watch)
  local n = #fields
  if n == 0 then return nil end
  if watch then fields[n + 1] = watch end
  local cur = redis.call('HMGET', key, unpack(fields))
  local args = {}
  for i = 1, n do
    local field = fields[i]
    args[2 * i - 1] = field
    args[2 * i] = int_of(cur[i], key, field) + delta[i]
  end
  if extra then
    for _, v in ipairs(extra) do args[#args + 1] = v end
  end
  redis.call('HSET', key, unpack(args))
  if watch then return cur[n + 1] end
  return nil
end

-- Returns the value `watch` (a field name, or nil) held before the write. The fields and their
-- changes are listed inline: a closure per call and a call per field cost ~15% of a book.
-- `reserved`, `open` and `calls` (or `releases`) are always written (as HINCRBY by 0 would create
-- them); a usage kind only once it is used.
local function book(key, amount, fcost, mode, u, model, extra, watch)
  local fields, delta, n = {'reserved', 'open'}, {-amount, -1}, 2
  if fcost ~= 0 then n = n + 1; fields[n] = 'reserved_micro'; delta[n] = -fcost end
  if mode == 'release' then
    n = n + 1; fields[n] = 'releases'; delta[n] = 1
  elseif mode == 'settle' then
    n = n + 1; fields[n] = 'calls'; delta[n] = 1
    -- A book that keeps the spend per model (the tenant period pool) keeps its tokens by kind only
    -- there: its totals by kind are their sums (LedgerSnapshot.from_hash), and four fields fewer
    -- in the settle cut the tenant path's extra by about a tenth.
    for i = model and 5 or 1, 6 do
      if u[i] ~= 0 then n = n + 1; fields[n] = SETTLED[i]; delta[n] = u[i] end
    end
    local total = u[1] + u[2] + u[3] + u[4]
    n = n + 1; fields[n] = 'spent'; delta[n] = total
    if total > amount then n = n + 1; fields[n] = 'overrun'; delta[n] = total - amount end
    if model then
      local prefix = 'm:' .. model .. ':'
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
      n = n + 1; fields[n] = 'm:' .. model .. ':unknown'; delta[n] = amount
      n = n + 1; fields[n] = 'm:' .. model .. ':cost'; delta[n] = fcost
    end
  end
  return add_all(key, fields, delta, extra, watch)
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
  -- `watch` {field, value}: whether the goal's books held another value in that field before (read
  -- in the books' own HMGET).
  local before = book(f[2], amount, fcost, mode, u, nil, goal_extra, watch and watch[1])
  local changed = watch and before ~= watch[2]
  if f[6] ~= '-' then book(f[6], amount, fcost, mode, u, f[5]) end
  for i = 7, #f do book(f[i], amount, fcost, mode, u, nil) end
  if changed then return 2 end
  return 1
end

-- One close from its arguments `a[first..last]` (ledger_close.lua's ARGV): 1 or 2 if it closed the
-- reservation (2: the role's served model changed), 0 if it was closed already.
local function close_argv(open_key, expiry_key, a, first, last)
  local u = {}
  for i = first + 5, last do u[#u + 1] = tonumber(a[i]) end
  local extra, watch = {}, nil
  if a[first + 2] == '1' then extra = {'trouble_since', '0'} end
  if a[first + 3] ~= '' then
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

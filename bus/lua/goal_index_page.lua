-- KEYS: goal index
-- ARGV: max score ('+inf' or the cursor's score), cursor id ('' = none), states (comma-separated,
--       '' = any), limit, scan cap, goal key prefix (Keys.goal(''))
-- Returns {ids, last score, last id} (last = '' when the index is exhausted)
local want = nil
if ARGV[3] ~= '' then
  want = {}
  for s in string.gmatch(ARGV[3], '[^,]+') do want[s] = true end
end
local limit, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
local cur_score = nil
if ARGV[2] ~= '' then cur_score = tonumber(ARGV[1]) end
local out, seen, offset = {}, 0, 0
while true do
  local rows = redis.call('ZREVRANGEBYSCORE', KEYS[1], ARGV[1], '-inf', 'WITHSCORES', 'LIMIT', offset, 100)
  if #rows == 0 then return {out, '', ''} end
  for i = 1, #rows, 2 do
    local id, score = rows[i], rows[i + 1]
    -- Equal scores come in reverse id order: skip the cursor and everything before it.
    if not (cur_score and tonumber(score) == cur_score and id >= ARGV[2]) then
      seen = seen + 1
      local st = redis.call('HGET', ARGV[6] .. id, 'state')
      if st and (not want or want[st]) then out[#out + 1] = id end
      if #out >= limit or seen >= cap then
        -- The last entry of the index: no cursor, so a reader knows there is nothing more.
        if i + 1 >= #rows and #rows < 200 then return {out, '', ''} end
        return {out, score, id}
      end
    end
  end
  offset = offset + 100
end

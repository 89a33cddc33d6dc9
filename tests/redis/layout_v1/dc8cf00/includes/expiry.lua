--[[ expiry: speculative entries added with a ttl (see the README, "Speculative entries").
  <ns>:sx is a sorted set: member = 8-byte request key .. 4-byte entry id, score = the deadline
  in ms of the server clock (TIME). A (key, id) pair past its deadline is never returned: readers
  filter it out, and the add script reclaims due pairs a bounded number per call. The set's
  first member bounds the work: while its deadline is in the future nothing needs filtering. ]]
--@include layout
--@include id_lists
--@include hash_chunks

-- Most due (key, id) pairs the add script reclaims per call.
local SWEEP_PER_CALL = 512

-- The server clock in ms.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- nil when no pair of the set sx is past its deadline, else a function (h, ids) -> ids
-- without the ids expired under request key h.
local function expiry_filter(sx)
  local first = redis.call('ZRANGE', sx, 0, 0, 'WITHSCORES')
  if #first == 0 then return nil end
  local now = now_ms()
  if tonumber(first[2]) > now then return nil end
  return function(h, ids)
    local gone = nil
    for j = 1, #ids, ID_WIDTH do
      local id = string.sub(ids, j, j + ID_WIDTH - 1)
      local d = redis.call('ZSCORE', sx, h .. id)
      if d and tonumber(d) <= now then
        gone = gone or {}
        gone[id] = true
      end
    end
    if gone == nil then return ids end
    return (list_without(ids, gone, ID_WIDTH))
  end
end

-- The due members of sx (at most SWEEP_PER_CALL), read-only.
local function due_pairs(sx, now)
  return redis.call('ZRANGEBYSCORE', sx, '-inf', tostring(now), 'LIMIT', 0, SWEEP_PER_CALL)
end

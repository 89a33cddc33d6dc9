--[[ runs: chain runs, request keys stored together in chain order (the spec: kvredis.redis.layout).
  A run is a HASH <ns>:c:<4-byte run id> with two fields:
    k  its request keys in chain order (8 bytes each, at most RUN_MAX, no key twice)
    r  its ranges: consecutive positions holding the same entry ids, in order, each
       u16 last position | u16 number of ids | the ids (4 bytes each, oldest added first);
       a range of no ids is a hole (a key no longer held through this run)
  A request key held through a run has, in its request bucket, the 6-byte ref u32 run id |
  u16 position (1-based) instead of an id list; a hole has no ref. Id lists are multiples of 4
  bytes, so a 6-byte value is a ref. The last position of a run is never a hole (trailing holes
  are cut off), and a run without held positions is deleted. ]]
--@include layout

local REF_WIDTH = 6
local RUN_ID_WIDTH = 4
-- Most request keys of one run; fewer new consecutive keys than RUN_MIN stay inline.
local RUN_MAX = 1024
local RUN_MIN = 8
-- Appending keys to a run rewrites its key list whole. A run of more than RUN_APPEND_MAX keys
-- is extended only by at least 1/RUN_APPEND_SHARE of its length in new keys (a prefill
-- chunk); fewer start a run of their own after it (one-block decode events), so an append
-- costs what its keys cost, not what the run it follows holds.
local RUN_APPEND_MAX = 256
local RUN_APPEND_SHARE = 8
local MAX_RUN_ID = 4294967295
-- The work limits of a call (includes/writes, includes/walk) count a run read as its ranges
-- plus this (the commands reading it, and its rewrite when written).
local RUN_READ_COST = 4

-- The run key prefix "<ns>:c:" (chain runs) from the request bucket prefix "<ns>:r:".
local function run_prefix(rprefix)
  return string.sub(rprefix, 1, -3) .. 'c:'
end

local function is_ref(value)
  return #value == REF_WIDTH
end

local function ref_make(rid, pos)
  return rid .. struct.pack('>I2', pos)
end

-- (run id, position) of a ref.
local function ref_parse(value)
  return string.sub(value, 1, 4), struct.unpack('>I2', value, 5)
end

-- The ranges of a run as an array of {e = last position, ids = id list ('' for a hole)}; nil
-- when the encoding is malformed.
local function ranges_parse(r)
  local out, at, n = {}, 1, #r
  while at <= n do
    if at + 3 > n then return nil end
    local e, c = struct.unpack('>I2I2', r, at)
    local stop = at + 4 + c * ID_WIDTH
    if stop - 1 > n then return nil end
    out[#out + 1] = {e = e, ids = string.sub(r, at + 4, stop - 1)}
    at = stop
  end
  return out
end

local function ranges_encode(ranges)
  local parts = {}
  for i, rg in ipairs(ranges) do
    parts[i] = struct.pack('>I2I2', rg.e, #rg.ids / ID_WIDTH) .. rg.ids
  end
  return table.concat(parts)
end

-- Index of the range holding position pos (binary search), or nil past the end.
local function range_at(ranges, pos)
  local lo, hi = 1, #ranges
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if ranges[mid].e < pos then lo = mid + 1 else hi = mid end
  end
  if lo <= #ranges and ranges[lo].e >= pos then return lo end
  return nil
end

-- Append positions up to e holding ids to the ranges out (merged with the last range when it
-- holds the same ids).
local function ranges_push(out, e, ids)
  local last = out[#out]
  if last and last.ids == ids then last.e = e else out[#out + 1] = {e = e, ids = ids} end
end

-- The ranges with positions set to new id lists (changes: position -> ids, '' for a hole);
-- adjacent ranges of equal ids merge. O(ranges + changes log changes).
local function ranges_apply(ranges, changes)
  local ps = {}
  for p in pairs(changes) do ps[#ps + 1] = p end
  table.sort(ps)
  local out = {}
  local start, ci = 1, 1
  for _, rg in ipairs(ranges) do
    local s = start
    while ci <= #ps and ps[ci] <= rg.e do
      local p = ps[ci]
      if p > s then ranges_push(out, p - 1, rg.ids) end
      ranges_push(out, p, changes[p])
      s = p + 1
      ci = ci + 1
    end
    if s <= rg.e then ranges_push(out, rg.e, rg.ids) end
    start = rg.e + 1
  end
  return out
end

-- The ranges without trailing holes, and the number of positions left.
local function ranges_trim(ranges)
  while #ranges > 0 and ranges[#ranges].ids == '' do ranges[#ranges] = nil end
  local n = #ranges > 0 and ranges[#ranges].e or 0
  return ranges, n
end

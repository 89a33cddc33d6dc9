#!lua flags=no-writes,allow-cross-slot-keys
--[[ score: longest-prefix score of every (pod, data-parallel rank) over a chain of request keys,
  computed in Redis, one part of the chain per call (the client sends a long chain in parts:
  kvredis.redis.ops). Each rank of a pod is scored on its own (a request runs on one rank, and
  only its copies are reused; a pod's score is its best rank's, which the client takes): a
  (pod, rank) earns, for each consecutive key from the first, the highest weight among its tiers
  holding that key, and drops out at the first key it does not hold; the walk ends when none is
  left. Scores are summed in key order (bit-identical to kvredis.scoring.LongestPrefixScorer),
  across parts too: a later part starts from the scores the earlier ones reached, and only for
  the (pod, rank)s whose stamps (includes/stamps) still hold: one whose pod lost an entry since
  an earlier part read it keeps the score it had, so the parts never credit more than the pod
  held at once.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi    KEYS[3] <ns>:pp    KEYS[4] <ns>:sx (gate key of
              the expiring buckets, includes/expiry)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] bucket bits
  ARGV[4]     f, the number of pods in the filter (0 = all pods); ARGV[5..4+f] the pod ids
  ARGV[5+f]   w, the number of tier weights; then w x (tier, weight as a decimal float)
  ARGV[6+f+2w] weight of a tier without an entry in the map
  ARGV[7+f+2w] the request keys of this part, in chain order (hash blob)
  ARGV[8+f+2w] 1 when keys of the chain follow this part, else 0 (absent: 0)
  ARGV[9+f+2w] c, the (pod, rank)s still in the race when the chain's earlier parts ended (0, or
              absent, for the chain's first part), then c x (pod id, rank, its score so far as
              a decimal float that reads back as the same double, e.g. "%.17g", its stamp)
  Expiring speculative entries (includes/expiry) count while live, as in lookup.
  Returns     array: [1] how many keys of this part the walk got through, [2] 1 when it stopped
              at its work limit (includes/walk) before the part's end, else 0; then five per
              (pod, rank): pod id, rank (integer), score ("%.17g"), 1 while it still holds every
              key walked else 0, its stamp (includes/stamps; "" unless it is still in and the
              chain goes on: ARGV[8+f+2w] is 1 or the walk was cut), for the (pod, rank)s of the
              chain's first key in order of appearance (for a later part: the c given, in their
              order; one whose stamp no longer holds is out, with the score given). The chain
              goes on past this part only while one is left and the walk reached the part's end
              (or stopped at its work limit)
  Errors      KVREDIS_STALE for a generation not the namespace's, KVREDIS_INVALID for
              malformed keys or arguments (counts, weights, the hash blob, the flag, ranks,
              scores, stamps)
  Complexity  O(part keys / keys per run) calls (the walk: includes/walk; O(part keys) while
              an expiring entry may be live), O(ranges x (pod, rank)s) additions when the
              weights are multiples of 2^-10 (else O(part keys x (pod, rank)s)); each distinct
              id list is weighed once; one HMGET of stamps when a part is carried or carries on ]]
--@include entries
--@include expiry
--@include walk
--@include args
--@include stamps

-- The largest data-parallel rank of an entry (kvredis.types.MAX_DP_RANK).
local MAX_DP_RANK = 2147483647

keys_arg(KEYS, 4)
check_gen(KEYS[1], ARGV[1])
local rbucket = bucket_namer(ARGV[2], ARGV[3])
local pods, at = pod_filter_arg(ARGV, 4)
local nw = int_arg(ARGV[at], 'tier weight count', 0, math.max(0, math.floor((#ARGV - at - 2) / 2)))
local weights = {}
for i = 1, nw do
  weights[ARGV[at + 2 * i - 1]] = num_arg(ARGV[at + 2 * i], 'weight of tier ' .. i)
end
local default_weight = num_arg(ARGV[at + 2 * nw + 1], 'weight of an unlisted tier')
local chain = blob_arg(ARGV[at + 2 * nw + 2], HASH_WIDTH, 'request keys')
local allowed = pods and pods_ids(KEYS[3], pods)
local deadlines = {}   -- expiring id -> its earliest deadline among the keys walked
local expiring = expiring_reader(KEYS[4], ARGV[3], deadlines)

-- A (pod, rank) is a slot: the rank as 4 bytes big-endian, then the pod id.
local defs = {}   -- id -> {slot, weight}, or false for an id without definition
local function def(id)
  local d = defs[id]
  if d == nil then
    local enc = redis.call('HGET', KEYS[2], id)
    if enc then
      local n = struct.unpack('>I4', enc)
      local m = struct.unpack('>I4', enc, 5 + n)
      local rank = #enc == 17 + n + m and string.sub(enc, 14 + n + m) or '\0\0\0\0'
      d = {rank .. string.sub(enc, 5, 4 + n), weights[string.sub(enc, 9 + n, 8 + n + m)] or
        default_weight}
    else
      d = false
    end
    defs[id] = d
  end
  return d
end

local weighed = {}   -- id list -> {slots = array, best = slot -> highest weight}
local function weigh(ids)
  local w = weighed[ids]
  if w then return w end
  w = {slots = {}, best = {}}
  for j = 1, #ids, ID_WIDTH do
    local id = string.sub(ids, j, j + ID_WIDTH - 1)
    if allowed == nil or allowed[id] then
      local d = def(id)
      if d then
        local slot, weight = d[1], d[2]
        local best = w.best[slot]
        if best == nil then
          w.slots[#w.slots + 1] = slot
          w.best[slot] = weight
        elseif weight > best then
          w.best[slot] = weight
        end
      end
    end
  end
  weighed[ids] = w
  return w
end

-- s plus n times b, as adding b n times one by one gives it (bit-identical with the client's
-- scorer); in one step when every partial sum is exact: s and b multiples of 2^-10 (1.0, 0.5,
-- ...) and the sums below 2^42 in magnitude. O(1) per range then, else O(n).
local EXACT = 2 ^ 52
local function add_n(s, b, n)
  local sb, bb = s * 1024, b * 1024
  if bb == math.floor(bb) and sb == math.floor(sb)
      and (math.abs(s) + n * math.abs(b)) * 1024 < EXACT then
    return s + n * b
  end
  for _ = 1, n do s = s + b end
  return s
end

local order, scores, active = {}, {}, {}
local first, previous = true, nil
local at_more = at + 2 * nw + 3
local more = int_arg(ARGV[at_more] or '0', 'more keys flag', 0, 1) == 1
local carried = at_more + 1
local nc = int_arg(ARGV[carried] or '0', 'slots carried over', 0,
  math.max(0, math.floor((#ARGV - carried) / 4)))
local carried_stamps = {}   -- slot -> the stamp it came with
local versions = {}   -- pod -> its stamp version (includes/stamps), read once per call
local now = clock()
if nc > 0 then
  first = false
  local pods, seen = {}, {}
  for i = 1, nc do
    local a = carried + 4 * (i - 1)
    local pod = ARGV[a + 1]
    local rank = int_arg(ARGV[a + 2], 'rank of pod ' .. pod, 0, MAX_DP_RANK)
    local text = ARGV[a + 3]
    local s = num_arg(text, 'score of slot ' .. i, true)
    local stamp = ARGV[a + 4]
    if type(stamp) ~= 'string' then fail('INVALID', 'stamp of pod ' .. pod .. ' is missing') end
    local slot = struct.pack('>I4', rank) .. pod
    order[i], scores[slot], carried_stamps[slot] = slot, s, stamp
    if not seen[pod] then
      seen[pod] = true
      pods[#pods + 1] = pod
    end
  end
  versions = stamp_versions(KEYS[1], pods)
  for i = 1, nc do
    local slot = order[i]
    if stamp_holds(carried_stamps[slot], versions[string.sub(slot, 5)], now) then
      active[#active + 1] = slot
    end
  end
end
local walked = 0
local cut = nil
if first or #active > 0 then
  cut = walk_chain(chain, rbucket, run_prefix(ARGV[2]), expiring, function(ids, n)
    walked = walked + n
    local w = weigh(ids)
    local best = w.best
    if ids == previous then
      -- the same holders as the previous keys: every active slot holds these keys too
      for _, slot in ipairs(active) do scores[slot] = add_n(scores[slot], best[slot], n) end
      return true
    end
    local still = {}
    if first then
      first = false
      for _, slot in ipairs(w.slots) do
        order[#order + 1] = slot
        scores[slot] = add_n(best[slot], best[slot], n - 1)
        still[#still + 1] = slot
      end
    else
      for _, slot in ipairs(active) do
        local b = best[slot]
        if b then
          scores[slot] = add_n(scores[slot], b, n)
          still[#still + 1] = slot
        end
      end
    end
    active = still
    previous = ids
    return #still > 0
  end)
end
-- a walk cut at its work limit stopped before key `cut`: the keys before it were walked
if cut then walked = cut - 1 end
local live = {}
for _, slot in ipairs(active) do live[slot] = true end
-- Stamps of the slots still in, when the chain goes on: their pods' versions, and the earliest
-- deadline of the expiring entries of each that the walk met.
local stamps = {}
if (more or cut) and #active > 0 then
  local pods, seen, until_ = {}, {}, {}
  for id, d in pairs(deadlines) do
    local def_ = defs[id]
    if def_ then
      local slot = def_[1]
      if live[slot] and (not until_[slot] or d < until_[slot]) then until_[slot] = d end
    end
  end
  for _, slot in ipairs(active) do
    local pod = string.sub(slot, 5)
    if versions[pod] == nil and not seen[pod] then
      seen[pod] = true
      pods[#pods + 1] = pod
    end
  end
  for pod, version in pairs(stamp_versions(KEYS[1], pods)) do versions[pod] = version end
  for _, slot in ipairs(active) do
    stamps[slot] = stamp_make(versions[string.sub(slot, 5)], until_[slot], carried_stamps[slot])
  end
end
local out = {walked, cut and 1 or 0}
for _, slot in ipairs(order) do
  out[#out + 1] = string.sub(slot, 5)
  out[#out + 1] = struct.unpack('>I4', slot)
  out[#out + 1] = string.format('%.17g', scores[slot])
  out[#out + 1] = live[slot] and 1 or 0
  out[#out + 1] = stamps[slot] or ''
end
return out

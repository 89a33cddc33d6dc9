#!lua flags=no-writes,allow-cross-slot-keys
--[[ score: longest-prefix score of every pod over a chain of request keys, computed in Redis,
  one part of the chain per call (the client sends a long chain in parts: kvredis.redis.ops).
  A pod earns, for each consecutive key from the first, the highest weight among its tiers
  holding that key, and drops out at the first key it does not hold; the walk ends when no pod
  is left. Scores are summed in key order (bit-identical to kvredis.scoring.LongestPrefixScorer),
  across parts too: a later part starts from the scores the earlier ones reached.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi    KEYS[3] <ns>:pp    KEYS[4] <ns>:sx (gate key of
              the expiring buckets, includes/expiry)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] bucket bits
  ARGV[4]     f, the number of pods in the filter (0 = all pods); ARGV[5..4+f] the pod ids
  ARGV[5+f]   w, the number of tier weights; then w x (tier, weight as a decimal float)
  ARGV[6+f+2w] weight of a tier without an entry in the map
  ARGV[7+f+2w] the request keys of this part, in chain order (hash blob)
  ARGV[8+f+2w] c, the pods still in the race when the chain's earlier parts ended (0, or
              absent, for the chain's first part), then c x (pod id, its score so far as a
              decimal float that reads back as the same double, e.g. "%.17g")
  Expiring speculative entries (includes/expiry) count while live, as in lookup.
  Returns     array: [1] how many keys of this part the walk got through, [2] 1 when it stopped
              at its work limit (includes/walk) before the part's end, else 0; then triples pod
              id, score ("%.17g"), 1 while the pod still holds every key walked else 0, for the
              pods of the chain's first key in order of appearance (for a later part: the c pods
              given, in their order). The chain goes on past this part only while a pod is left
              and the walk reached the part's end (or stopped at its work limit)
  Errors      KVREDIS_STALE for a generation not the namespace's, KVREDIS_INVALID for
              malformed keys or arguments (counts, weights, scores, the hash blob)
  Complexity  O(part keys / keys per run) calls (the walk: includes/walk; O(part keys) while
              an expiring entry may be live), O(ranges x pods) additions when the weights are
              multiples of 2^-10 (else O(part keys x pods)); each distinct id
              list is weighed once ]]
--@include entries
--@include expiry
--@include walk
--@include args

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
local expiring = expiring_reader(KEYS[4], ARGV[3])

local defs = {}   -- id -> {pod, weight}, or false for an id without definition
local function def(id)
  local d = defs[id]
  if d == nil then
    local enc = redis.call('HGET', KEYS[2], id)
    if enc then
      d = {entry_pod(enc), weights[entry_tier(enc)] or default_weight}
    else
      d = false
    end
    defs[id] = d
  end
  return d
end

local weighed = {}   -- id list -> {pods = array, best = pod -> highest weight}
local function weigh(ids)
  local w = weighed[ids]
  if w then return w end
  w = {pods = {}, best = {}}
  for j = 1, #ids, ID_WIDTH do
    local id = string.sub(ids, j, j + ID_WIDTH - 1)
    if allowed == nil or allowed[id] then
      local d = def(id)
      if d then
        local pod, weight = d[1], d[2]
        local best = w.best[pod]
        if best == nil then
          w.pods[#w.pods + 1] = pod
          w.best[pod] = weight
        elseif weight > best then
          w.best[pod] = weight
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
local carried = at + 2 * nw + 3
local nc = int_arg(ARGV[carried] or '0', 'pods carried over', 0,
  math.max(0, math.floor((#ARGV - carried) / 2)))
if nc > 0 then
  first = false
  for i = 1, nc do
    local pod = ARGV[carried + 2 * i - 1]
    local text = ARGV[carried + 2 * i]
    local s = num_arg(text, 'score of pod ' .. i, true)
    order[i], active[i], scores[pod] = pod, pod, s
  end
end
local walked = 0
local cut = walk_chain(chain, rbucket, run_prefix(ARGV[2]), expiring, function(ids, n)
  walked = walked + n
  local w = weigh(ids)
  local best = w.best
  if ids == previous then
    -- the same holders as the previous keys: every active pod holds these keys too
    for _, pod in ipairs(active) do scores[pod] = add_n(scores[pod], best[pod], n) end
    return true
  end
  local still = {}
  if first then
    first = false
    for _, pod in ipairs(w.pods) do
      order[#order + 1] = pod
      scores[pod] = add_n(best[pod], best[pod], n - 1)
      still[#still + 1] = pod
    end
  else
    for _, pod in ipairs(active) do
      local b = best[pod]
      if b then
        scores[pod] = add_n(scores[pod], b, n)
        still[#still + 1] = pod
      end
    end
  end
  active = still
  previous = ids
  return #still > 0
end)
-- a walk cut at its work limit stopped before key `cut`: the keys before it were walked
if cut then walked = cut - 1 end
local live = {}
for _, pod in ipairs(active) do live[pod] = true end
local out = {walked, cut and 1 or 0}
for _, pod in ipairs(order) do
  out[#out + 1] = pod
  out[#out + 1] = string.format('%.17g', scores[pod])
  out[#out + 1] = live[pod] and 1 or 0
end
return out

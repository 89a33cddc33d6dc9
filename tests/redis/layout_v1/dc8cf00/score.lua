#!lua flags=no-writes,allow-cross-slot-keys
--[[ score: longest-prefix score of every pod over a chain of request keys, computed in Redis.
  A pod earns, for each consecutive key from the first, the highest weight among its tiers
  holding that key, and drops out at the first key it does not hold; the walk ends when no pod
  is left. Scores are summed in key order (bit-identical to kvredis.scoring.LongestPrefixScorer).
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi    KEYS[3] <ns>:pp    KEYS[4] <ns>:sx
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] bucket bits
  ARGV[4]     f, the number of pods in the filter (0 = all pods); ARGV[5..4+f] the pod ids
  ARGV[5+f]   w, the number of tier weights; then w x (tier, weight as a decimal float)
  ARGV[6+f+2w] weight of a tier without an entry in the map
  ARGV[7+f+2w] the request keys in chain order (hash blob)
  Expired speculative entries (includes/expiry) are left out.
  Returns     flat array pod id, score ("%.17g"), ... in order of first appearance
  Complexity  O(scored keys x entries per key); each distinct id list is weighed once ]]
--@include entries
--@include expiry
check_gen(KEYS[1], ARGV[1])
local rbucket = bucket_namer(ARGV[2], ARGV[3])
local nf = tonumber(ARGV[4])
local allowed = nil
if nf > 0 then
  local pods = {}
  for i = 1, nf do pods[i] = ARGV[4 + i] end
  allowed = pods_ids(KEYS[3], pods)
end
local at = 5 + nf
local nw = tonumber(ARGV[at])
local weights = {}
for i = 1, nw do weights[ARGV[at + 2 * i - 1]] = tonumber(ARGV[at + 2 * i]) end
local default_weight = tonumber(ARGV[at + 2 * nw + 1])
local chain = ARGV[at + 2 * nw + 2]
local unexpired = expiry_filter(KEYS[4])

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

local order, scores, active = {}, {}, {}
local first, previous = true, nil
for i = 1, #chain, HASH_WIDTH do
  local h = string.sub(chain, i, i + HASH_WIDTH - 1)
  local ids = redis.call('HGET', rbucket(h), h)
  if not ids then break end
  if unexpired then
    ids = unexpired(h, ids)
    if ids == '' then break end
  end
  local w = weigh(ids)
  local left = 0
  if ids == previous then
    -- the same holders as the previous key: every active pod holds this key too
    for _, pod in ipairs(active) do scores[pod] = scores[pod] + w.best[pod] end
    left = #active
  elseif first then
    first = false
    for _, pod in ipairs(w.pods) do
      order[#order + 1] = pod
      scores[pod] = w.best[pod]
      active[#active + 1] = pod
    end
    left = #active
  else
    local still = {}
    for _, pod in ipairs(active) do
      local weight = w.best[pod]
      if weight then
        scores[pod] = scores[pod] + weight
        still[#still + 1] = pod
      end
    end
    active = still
    left = #still
  end
  if left == 0 then break end
  previous = ids
end
local out = {}
for _, pod in ipairs(order) do
  out[#out + 1] = pod
  out[#out + 1] = string.format('%.17g', scores[pod])
end
return out

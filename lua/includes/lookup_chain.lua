--[[ lookup_chain: the lookup of one namespace's chain (lookup.lua, and lookup_shards.lua for the
  shards of a cluster namespace that one node holds). Reply shape: see lookup.lua. ]]
--@include entries
--@include expiry
--@include walk
--@include stamps

-- The list with only the items in set.
local function list_only(list, set, width)
  local kept, dropped = {}, false
  for i = 1, #list, width do
    local item = string.sub(list, i, i + width - 1)
    if set[item] then kept[#kept + 1] = item else dropped = true end
  end
  if not dropped then return list end
  return table.concat(kept)
end

-- The most definitions of the ids right above the client's floor one reply carries (besides
-- those of the ids it holds), so a reply stays small while a client learns the dictionary.
local DEFINITIONS_PER_CALL = 256

-- The stamps part of a lookup reply (includes/stamps): a flat array of pod id, stamp: first
-- the carried pods (array of {pod, stamp}) in order, each with its new stamp, or "" when its
-- stamp no longer holds; then, when fresh, the other pods of the hit ids (hits: a set), with
-- theirs. deadlines: expiring id -> its earliest deadline the walk met.
local function lookup_stamps(meta_key, pi_key, carried, hits, fresh, deadlines)
  local out = {}
  local pods, known = {}, {}
  for _, c in ipairs(carried) do
    if not known[c[1]] then
      known[c[1]] = c[2]
      pods[#pods + 1] = c[1]
    end
  end
  local ncarried = #pods
  local until_ = {}
  local ids = {}
  for id in pairs(hits) do ids[#ids + 1] = id end
  if #ids > 0 then
    local encs = hmget(pi_key, ids)
    for i = 1, #ids do
      local enc = encs[i]
      if enc then
        local pod = entry_pod(enc)
        if known[pod] == nil then
          known[pod] = false
          if fresh then pods[#pods + 1] = pod end
        end
        local d = deadlines[ids[i]]
        if d and (not until_[pod] or d < until_[pod]) then until_[pod] = d end
      end
    end
  end
  local versions = stamp_versions(meta_key, pods)
  local now = clock()
  for i, pod in ipairs(pods) do
    local stamp = ''
    if i > ncarried then
      stamp = stamp_make(versions[pod], until_[pod], nil)
    elseif stamp_holds(known[pod], versions[pod], now) then
      stamp = stamp_make(versions[pod], until_[pod], known[pod])
    end
    out[#out + 1] = pod
    out[#out + 1] = stamp
  end
  return out
end

-- The continuation arguments of a lookup from position at of args (a script passes its own
-- arguments): the "more keys follow" flag (absent: 0), then c and c x (pod id, stamp) (absent:
-- 0). Returns the flag (a boolean) and the carried pods (array of {pod, stamp}); checked.
local function lookup_continuation(args, at)
  local more = int_arg(args[at] or '0', 'more keys flag', 0, 1) == 1
  local nc = int_arg(args[at + 1] or '0', 'pods carried over', 0,
    math.max(0, math.floor((#args - at - 1) / 2)))
  local carried = {}
  for i = 1, nc do
    local pod, stamp = args[at + 2 * i], args[at + 2 * i + 1]
    if type(pod) ~= 'string' or type(stamp) ~= 'string' then
      fail('INVALID', 'stamp ' .. i .. ' carried over is missing')
    end
    carried[i] = {pod, stamp}
  end
  return more, carried
end

-- meta: the namespace's {gen, next_id} (already checked against the client's generation);
-- meta_key, pi_key, pp_key, sx_key: its keys; rprefix, bits: its request buckets; floor: the
-- id up to which the client knows every definition; pods: nil or the pod names of the filter;
-- chain: the request keys in chain order (hash blob); more: whether keys of the chain follow;
-- carried: array of {pod, stamp} from the chain's earlier parts; spent: nil, or the walk work
-- shared by the walks of one call (includes/walk).
local function lookup_chain(meta, meta_key, pi_key, pp_key, sx_key, rprefix, bits, floor, pods,
                            chain, more, carried, spent)
  local rbucket = bucket_namer(rprefix, bits)
  local want_defs = tonumber(meta[2] or '0') > floor
  local upto = math.min(tonumber(meta[2] or '0'), floor + DEFINITIONS_PER_CALL)
  if upto < floor then upto = floor end
  local allowed = nil
  if pods then allowed = pods_ids(pp_key, pods) end
  local deadlines = {}
  local expiring = expiring_reader(sx_key, bits, deadlines)
  local out = {upto, {}, {}}
  local seen_lists, seen, unknown = {}, {}, {}
  for n = floor + 1, upto do
    local id = struct.pack('>I4', n)
    seen[id] = true
    unknown[#unknown + 1] = id
  end
  local filtered = {}
  local hit_lists = {}
  local last = nil
  local cut = walk_chain(chain, rbucket, run_prefix(rprefix), expiring, function(ids, n)
    if allowed then
      local kept = filtered[ids]
      if kept == nil then
        kept = list_only(ids, allowed, ID_WIDTH)
        filtered[ids] = kept
      end
      ids = kept
      if ids == '' then return false end
    end
    if last and out[#out] == ids then
      out[#out - 1] = out[#out - 1] + n
    else
      out[#out + 1] = n
      out[#out + 1] = ids
    end
    last = true
    hit_lists[ids] = true
    if want_defs and not seen_lists[ids] then
      seen_lists[ids] = true
      for j = 1, #ids, ID_WIDTH do
        local id = string.sub(ids, j, j + ID_WIDTH - 1)
        if not seen[id] then
          seen[id] = true
          if struct.unpack('>I4', id) > upto then unknown[#unknown + 1] = id end
        end
      end
    end
    return true
  end, spent)
  if #unknown > 0 then
    local defs = hmget(pi_key, unknown)
    local flat = out[2]
    for i = 1, #unknown do
      flat[#flat + 1] = unknown[i]
      -- "" for an id without definition (reclaimed: see reclaim.lua); the client skips it
      flat[#flat + 1] = defs[i] or ''
    end
  end
  if more or cut or #carried > 0 then
    local hits = {}
    if more or cut then
      for ids in pairs(hit_lists) do list_set(ids, ID_WIDTH, hits) end
    end
    out[3] = lookup_stamps(meta_key, pi_key, carried, hits, more or cut, deadlines)
  end
  if cut then out[#out + 1] = cut end
  return out
end

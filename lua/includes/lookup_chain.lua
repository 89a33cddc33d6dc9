--[[ lookup_chain: the lookup of one namespace's chain (lookup.lua, and lookup_shards.lua for the
  shards of a cluster namespace that one node holds). Reply shape: see lookup.lua. ]]
--@include entries
--@include expiry
--@include walk

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

-- meta: the namespace's {gen, next_id} (already checked against the client's generation);
-- pi_key, pp_key, sx_key: its keys; rprefix, bits: its request buckets; floor: the id up to
-- which the client knows every definition; pods: nil or the pod names of the filter; chain: the
-- request keys in chain order (hash blob); spent: nil, or the walk work shared by the walks of
-- one call (includes/walk).
local function lookup_chain(meta, pi_key, pp_key, sx_key, rprefix, bits, floor, pods, chain,
                            spent)
  local rbucket = bucket_namer(rprefix, bits)
  local want_defs = tonumber(meta[2] or '0') > floor
  local upto = math.min(tonumber(meta[2] or '0'), floor + DEFINITIONS_PER_CALL)
  if upto < floor then upto = floor end
  local allowed = nil
  if pods then allowed = pods_ids(pp_key, pods) end
  local expiring = expiring_reader(sx_key, bits)
  local out = {upto, {}}
  local seen_lists, seen, unknown = {}, {}, {}
  for n = floor + 1, upto do
    local id = struct.pack('>I4', n)
    seen[id] = true
    unknown[#unknown + 1] = id
  end
  local filtered = {}
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
  if cut then out[#out + 1] = cut end
  return out
end

--[[ entries: the entry encoding and the namespace's entry dictionary (<ns>:pe, <ns>:pi, <ns>:pp).
    entry    u32 len | pod id | u32 len | tier | u8 flags (1 speculative, 2 has_group, 4 has rank) |
             u32 group [| u32 data-parallel rank, present with flag 4 only]
    entry id 4-byte big-endian unsigned integer, allocated from <ns>:meta next_id, never reused;
             <ns>:pi also holds the fields next_id and bucket_bits (see namespace.lua) ]]
--@include layout
--@include id_lists
--@include hash_chunks

local MAX_ENTRY_ID = 4294967295

-- Whether enc is a well-formed entry encoding.
local function entry_ok(enc)
  if type(enc) ~= 'string' or #enc < 13 then return false end
  local n = struct.unpack('>I4', enc)
  if #enc < 13 + n then return false end
  local m = struct.unpack('>I4', enc, 5 + n)
  if #enc == 13 + n + m then return bit.band(string.byte(enc, 9 + n + m), 4) == 0 end
  return #enc == 17 + n + m and bit.band(string.byte(enc, 9 + n + m), 4) == 4
end

local function entry_pod(enc)
  local n = struct.unpack('>I4', enc)
  return string.sub(enc, 5, 4 + n)
end

-- The tier of an entry encoding.
local function entry_tier(enc)
  local n = struct.unpack('>I4', enc)
  local m = struct.unpack('>I4', enc, 5 + n)
  return string.sub(enc, 9 + n, 8 + n + m)
end

-- Whether enc encodes a speculative entry (flags bit 1).
local function entry_speculative(enc)
  local n = struct.unpack('>I4', enc)
  local m = struct.unpack('>I4', enc, 5 + n)
  return bit.band(string.byte(enc, 9 + n + m), 1) == 1
end

-- Defining entries new to the namespace (only calls that store such entries need it, so the
-- functions are created on use). Returns {allocate_ids = ..., define_entries = ...,
-- read_pods = ...}.
local function entry_definitions()
  -- Ids for the new entries encs (none of them in <ns>:pe), read-only: the next free ids
  -- after <ns>:meta next_id, skipping ids already defined (a meta record recreated under
  -- existing ids). Fails KVREDIS_LAYOUT when the id space cannot hold them. Returns the ids
  -- and the new next_id.
  local function allocate_ids(k, encs)
    local n = tonumber(redis.call('HGET', k.meta, 'next_id') or '0')
    local ids = {}
    for i = 1, #encs do
      local id
      repeat
        n = n + 1
        if n > MAX_ENTRY_ID then fail('LAYOUT', 'entry id space exhausted') end
        id = struct.pack('>I4', n)
      until redis.call('HEXISTS', k.pi, id) == 0
      ids[i] = id
    end
    return ids, n
  end

  -- Define the new entries encs with the ids allocate_ids gave (next_id its second result)
  -- and record them under their pods. pods_lists holds the pods' current id lists (read
  -- before the first write: read_pods). k holds the keys meta, pe, pi, pp and the bucket bits.
  local function define_entries(k, encs, ids, next_id, pod_lists)
    if #encs == 0 then return end
    local added = {}
    for i = 1, #encs do
      redis.call('HSET', k.pi, ids[i], encs[i])
      redis.call('HSET', k.pe, encs[i], ids[i])
      local pod = entry_pod(encs[i])
      if not added[pod] then added[pod] = {} end
      table.insert(added[pod], ids[i])
    end
    for pod, list in pairs(added) do
      redis.call('HSET', k.pp, pod, (pod_lists[pod] or '') .. table.concat(list))
    end
    redis.call('HSET', k.meta, 'next_id', tostring(next_id))
    -- The high-water mark, bucket bits and expiry mode, from which a lost <ns>:meta heals.
    redis.call('HSET', k.pi, 'next_id', tostring(next_id), 'bucket_bits', k.bits,
      'expiry', k.xs.fields and 'field' or 'key')
  end

  -- The current id lists of the pods of encs (pod -> list or false), read before any write.
  local function read_pods(pp_key, encs)
    local out = {}
    for i = 1, #encs do
      local pod = entry_pod(encs[i])
      if out[pod] == nil then out[pod] = redis.call('HGET', pp_key, pod) or false end
    end
    return out
  end
  return {allocate_ids = allocate_ids, define_entries = define_entries, read_pods = read_pods}
end

-- The set of ids of the pods named in pods (array of pod ids), read from the pod records.
local function pods_ids(pp_key, pods)
  local set = {}
  local lists = hmget(pp_key, pods)
  for i = 1, #lists do
    if lists[i] then list_set(lists[i], ID_WIDTH, set) end
  end
  return set
end

-- The set of ids of the speculative entries of the pods named in pods (array of pod ids).
local function pods_speculative_ids(pp_key, pi_key, pods)
  local ids = {}
  for id in pairs(pods_ids(pp_key, pods)) do ids[#ids + 1] = id end
  local set = {}
  if #ids == 0 then return set end
  local defs = hmget(pi_key, ids)
  for i = 1, #ids do
    if defs[i] and entry_speculative(defs[i]) then set[ids[i]] = true end
  end
  return set
end

--[[ entries: the entry encoding and the namespace's entry dictionary (<ns>:pe, <ns>:pi, <ns>:pp).
    entry    u32 len | pod id | u32 len | tier | u8 flags (1 speculative, 2 has_group) | u32 group
    entry id 4-byte big-endian unsigned integer, allocated from <ns>:meta next_id, never reused ]]
--@include layout
--@include id_lists
--@include hash_chunks

local MAX_ENTRY_ID = 4294967295

-- Whether enc is a well-formed entry encoding.
local function entry_ok(enc)
  if type(enc) ~= 'string' or #enc < 13 then return false end
  local n = struct.unpack('>I4', enc)
  if #enc < 13 + n then return false end
  return #enc == 13 + n + struct.unpack('>I4', enc, 5 + n)
end

local function entry_pod(enc)
  local n = struct.unpack('>I4', enc)
  return string.sub(enc, 5, 4 + n)
end

local function entry_tier(enc)
  local n = struct.unpack('>I4', enc)
  local m = struct.unpack('>I4', enc, 5 + n)
  return string.sub(enc, 9 + n, 8 + n + m)
end

-- Fail KVREDIS_LAYOUT unless count more ids can be allocated.
local function check_id_space(meta_key, count)
  if count > 0 and tonumber(redis.call('HGET', meta_key, 'next_id') or '0') + count > MAX_ENTRY_ID then
    fail('LAYOUT', 'entry id space exhausted')
  end
end

-- Allocate an id for a new entry (not in <ns>:pe) and record it under its pod. k holds the keys
-- meta, pe, pi, pp.
local function intern(k, enc)
  local id
  while true do
    local n = redis.call('HINCRBY', k.meta, 'next_id', 1)
    -- Only reachable past check_id_space when <ns>:meta was recreated under existing ids.
    if n > MAX_ENTRY_ID then fail('LAYOUT', 'entry id space exhausted') end
    id = struct.pack('>I4', n)
    -- HSETNX: an id already defined (namespace meta lost and recreated) is never redefined.
    if redis.call('HSETNX', k.pi, id, enc) == 1 then break end
  end
  redis.call('HSET', k.pe, enc, id)
  local pod = entry_pod(enc)
  redis.call('HSET', k.pp, pod, (redis.call('HGET', k.pp, pod) or '') .. id)
  return id
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

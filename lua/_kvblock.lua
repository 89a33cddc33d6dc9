--[[ _kvblock: shared functions of the kvblock layout, pasted into the command scripts that
  include it (line `--@include _kvblock`); not a command on its own.
  Encodings
    entry id      4-byte big-endian unsigned integer, allocated from <ns>:meta next_id, never reused
    id list       concatenated entry ids, oldest added first (values of <ns>:r:* and <ns>:pp)
    hash          8-byte big-endian block hash (fields of <ns>:r:* and <ns>:e:*)
    hash list     concatenated hashes, most recent last (values of <ns>:e:*)
    hash blob     concatenated hashes, how the client passes many hashes in one argument
    entry         u32 len | pod id | u32 len | tier | u8 flags (1 speculative, 2 has_group) | u32 group
  Bucket of a hash h: its low `bits` bits, named <prefix><suffix> where the suffix is those bits
    as ceil(bits / 8) big-endian bytes (binary), i.e. the last bytes of h with the top one masked.
    kvredis.redis_core computes the same in Python. The scripts build bucket key names from the
    hashes they are given or read (see the README, "Key layout", for what that means in a cluster).
  Hashes stay strings here: they never become Lua numbers. ]]

local ID_WIDTH = 4
local HASH_WIDTH = 8
local CHUNK = 2000

local function fail(code, message)
  error({err = 'KVREDIS_' .. code .. ' ' .. message})
end

-- Every command checks the namespace generation first: a client whose cached layout (bucket bits,
-- entry ids) belongs to an earlier incarnation of the namespace gets KVREDIS_STALE and reloads.
local function check_gen(meta_key, gen)
  local current = redis.call('HGET', meta_key, 'gen')
  if current ~= gen then
    fail('STALE', 'namespace layout changed or was removed; reload it')
  end
end

-- Position (1-based) of item in a list of fixed-width items, or nil.
local function list_find(list, item, width)
  local start = 1
  while true do
    local pos = string.find(list, item, start, true)
    if not pos then return nil end
    if (pos - 1) % width == 0 then return pos end
    start = pos + 1
  end
end

-- The list without the items in set; returns the new list and how many items were removed.
local function list_without(list, set, width)
  local kept, removed = nil, 0
  for i = 1, #list, width do
    local item = string.sub(list, i, i + width - 1)
    if set[item] then
      if not kept then kept = {string.sub(list, 1, i - 1)} end
      removed = removed + 1
    elseif kept then
      kept[#kept + 1] = item
    end
  end
  if not kept then return list, 0 end
  return table.concat(kept), removed
end

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

-- A function h -> bucket key name, for one key prefix and bucket bit count.
local function bucket_namer(prefix, bits)
  local nbytes = math.ceil(bits / 8)
  local partial = bits % 8
  if partial == 0 then
    local from = 9 - nbytes
    return function(h) return prefix .. string.sub(h, from) end
  end
  local mask, top = 2 ^ partial - 1, 9 - nbytes
  return function(h)
    return prefix .. string.char(bit.band(string.byte(h, top), mask)) .. string.sub(h, top + 1)
  end
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

-- HMGET in chunks (unpack stays small); returns the values in order, false for missing fields.
local function hmget(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local reply = redis.call('HMGET', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #reply do out[#out + 1] = reply[j] end
  end
  return out
end

local function hdel(key, fields)
  for i = 1, #fields, CHUNK do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
  end
end

-- pairs is a flat field, value, field, value, ... array
local function hset(key, pairs_)
  for i = 1, #pairs_, CHUNK do
    redis.call('HSET', key, unpack(pairs_, i, math.min(i + CHUNK - 1, #pairs_)))
  end
end

-- The set of ids of the pods named in pods (array of pod ids), read from the pod records.
local function pods_ids(pp_key, pods)
  local set = {}
  local lists = hmget(pp_key, pods)
  for i = 1, #lists do
    local list = lists[i]
    if list then
      for j = 1, #list, ID_WIDTH do set[string.sub(list, j, j + ID_WIDTH - 1)] = true end
    end
  end
  return set
end

-- The id of an encoded entry, allocating one (and recording it under its pod) if it is new.
local function intern(k, enc)
  local id = redis.call('HGET', k.pe, enc)
  if id then return id end
  while true do
    local n = redis.call('HINCRBY', k.meta, 'next_id', 1)
    if n >= 4294967296 then fail('LAYOUT', 'entry id space exhausted') end
    id = struct.pack('>I4', n)
    -- HSETNX: an id already defined (namespace meta lost and recreated) is never redefined.
    if redis.call('HSETNX', k.pi, id, enc) == 1 then break end
  end
  redis.call('HSET', k.pe, enc, id)
  local pod = entry_pod(enc)
  redis.call('HSET', k.pp, pod, (redis.call('HGET', k.pp, pod) or '') .. id)
  return id
end

-- Store the ids (list and set form) under one request key. Entries already held move to the
-- most recently added end, as in the embedded index.
local function add_ids(bucket, field, ids, set)
  local current = redis.call('HGET', bucket, field)
  local value = ids
  if current then
    if current == ids then return end
    value = list_without(current, set, ID_WIDTH) .. ids
  end
  redis.call('HSET', bucket, field, value)
end

-- Record engine key -> request key (most recent last, at most cap request keys per engine key).
local function map_engine(bucket, efield, rfield, cap)
  local current = redis.call('HGET', bucket, efield)
  if not current then
    redis.call('HSET', bucket, efield, rfield)
    return
  end
  if string.sub(current, -HASH_WIDTH) == rfield then return end
  local pos = list_find(current, rfield, HASH_WIDTH)
  if pos then
    current = string.sub(current, 1, pos - 1) .. string.sub(current, pos + HASH_WIDTH)
  elseif #current >= cap * HASH_WIDTH then
    current = string.sub(current, HASH_WIDTH + 1)
  end
  redis.call('HSET', bucket, efield, current .. rfield)
end

-- Remove the ids in set from one request key, deleting the field once empty.
-- Returns the ids left ('' when none, nil when the key held nothing) and how many were removed.
local function remove_ids(bucket, field, set)
  local current = redis.call('HGET', bucket, field)
  if not current then return nil, 0 end
  local left, removed = list_without(current, set, ID_WIDTH)
  if removed > 0 then
    if left == '' then
      redis.call('HDEL', bucket, field)
    else
      redis.call('HSET', bucket, field, left)
    end
  end
  return left, removed
end

-- Evict by engine key: remove the ids from every request key it maps to; drop the mapping once
-- none of those request keys holds any entry. Request bucket names are built here because the
-- request keys are only known once the mapping is read inside this atomic step.
local function evict_engine(k, bucket, efield, set)
  local refs = redis.call('HGET', bucket, efield)
  if not refs then return 0 end
  local held, removed = false, 0
  for i = 1, #refs, HASH_WIDTH do
    local rfield = string.sub(refs, i, i + HASH_WIDTH - 1)
    local left, n = remove_ids(k.rbucket(rfield), rfield, set)
    removed = removed + n
    if left and left ~= '' then held = true end
  end
  if not held then redis.call('HDEL', bucket, efield) end
  return removed
end

--[[ Run nops ops encoded in ARGV from position pos (see the op program in apply_batch.lua).
  ents is the array of encoded entries the ops refer to by 1-based index. Returns entries removed. ]]
local function run_ops(k, ents, pos, nops, cap)
  local ids = {}
  local function entry_id(j, create)
    local id = ids[j]
    if id then return id end
    if create then
      id = intern(k, ents[j])
    elseif id == nil then
      id = redis.call('HGET', k.pe, ents[j])
    end
    ids[j] = id
    return id
  end
  local removed = 0
  for _ = 1, nops do
    local op = ARGV[pos]
    if op == 'A' then
      local nent = tonumber(ARGV[pos + 1])
      local list, set = {}, {}
      for j = 1, nent do
        local id = entry_id(tonumber(ARGV[pos + 1 + j]), true)
        if not set[id] then
          set[id] = true
          list[#list + 1] = id
        end
      end
      local value = table.concat(list)
      local req, pairs_ = ARGV[pos + 2 + nent], ARGV[pos + 3 + nent]
      pos = pos + 4 + nent
      for i = 1, #req, HASH_WIDTH do
        local rfield = string.sub(req, i, i + HASH_WIDTH - 1)
        add_ids(k.rbucket(rfield), rfield, value, set)
      end
      for i = 1, #pairs_, 2 * HASH_WIDTH do
        local efield = string.sub(pairs_, i, i + HASH_WIDTH - 1)
        map_engine(k.ebucket(efield), efield, string.sub(pairs_, i + HASH_WIDTH, i + 2 * HASH_WIDTH - 1), cap)
      end
    elseif op == 'R' or op == 'E' then
      local field, nent = ARGV[pos + 1], tonumber(ARGV[pos + 2])
      local set = {}
      for j = 1, nent do
        local id = entry_id(tonumber(ARGV[pos + 2 + j]), false)
        if id then set[id] = true end
      end
      pos = pos + 3 + nent
      if op == 'R' then
        local _, n = remove_ids(k.rbucket(field), field, set)
        removed = removed + n
      else
        removed = removed + evict_engine(k, k.ebucket(field), field, set)
      end
    else
      fail('INVALID', 'unknown op ' .. tostring(op))
    end
  end
  return removed
end

-- The namespace context of the write scripts: fixed keys from KEYS, prefixes and bits from ARGV
-- (ARGV[2] request bucket prefix, ARGV[3] engine bucket prefix, ARGV[4] bucket bits).
local function write_context(meta, pe, pi, pp)
  local bits = tonumber(ARGV[4])
  return {meta = meta, pe = pe, pi = pi, pp = pp,
          rbucket = bucket_namer(ARGV[2], bits), ebucket = bucket_namer(ARGV[3], bits)}
end

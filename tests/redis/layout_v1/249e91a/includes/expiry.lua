--[[ expiry: speculative entries added with a ttl (see the README, "Speculative entries").
  They live apart from the request buckets, in expiring buckets <ns>:s:<bucket> (named like the
  request buckets; the prefix is the name of the gate key <ns>:sx without its last letter):
  field = 8-byte request key, value = items of 12 bytes, a 4-byte entry id and its 8-byte
  big-endian deadline (ms of the server clock, TIME), most recently added last. An entry id is
  held under a request key either in its request bucket (no deadline) or here, never both.
  The server deletes them by itself: with hash field expiry (<ns>:meta expiry = "field": Valkey
  9, Redis 7.4+) each field expires at its latest deadline (HPEXPIREAT); otherwise (expiry
  "key" or absent) each expiring bucket key expires at the latest deadline of its fields
  (PEXPIREAT), and every write to a bucket drops the past-due items of all its fields. The gate
  key <ns>:sx (a string: the namespace's latest deadline) expires at that deadline: while it is
  absent no expiring entry can be live and readers read nothing more. Readers drop items past
  their deadline, so an expired entry is never returned, also before the server deleted it. ]]
--@include layout
--@include id_lists

local ITEM_WIDTH = 12
local TWO_32 = 4294967296

-- The server clock in ms.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function item_deadline(items, j)
  local hi, lo = struct.unpack('>I4I4', items, j + ID_WIDTH)
  return hi * TWO_32 + lo
end

local function item(id, deadline)
  return id .. struct.pack('>I4I4', math.floor(deadline / TWO_32), deadline % TWO_32)
end

-- A function h -> expiring bucket key name (sx is the gate key <ns>:sx, bits the bucket bits).
local function expiring_namer(sx, bits)
  return bucket_namer(string.sub(sx, 1, -2) .. ':', bits)
end

-- The items of a value without those past due at now and those whose id is in drop (a set,
-- or nil); returns the items left, how many ids of drop were removed, and the latest deadline
-- left (0 when none).
local function items_without(items, now, drop)
  local kept, removed, latest = {}, 0, 0
  for j = 1, #items, ITEM_WIDTH do
    local id = string.sub(items, j, j + ID_WIDTH - 1)
    local d = item_deadline(items, j)
    if drop and drop[id] then
      removed = removed + 1
    elseif d > now then
      kept[#kept + 1] = string.sub(items, j, j + ITEM_WIDTH - 1)
      if d > latest then latest = d end
    end
  end
  return table.concat(kept), removed, latest
end

-- Read path: nil while no expiring entry can be live (the gate key sx is absent: one EXISTS per
-- call), else a function (h, ids) -> the ids of request key h: ids (its request-bucket list, or
-- nil) followed by its expiring ids that are not past due; nil when it holds none.
local function expiring_reader(sx, bits)
  if redis.call('EXISTS', sx) == 0 then return nil end
  local now = now_ms()
  local sbucket = expiring_namer(sx, bits)
  return function(h, ids)
    local items = redis.call('HGET', sbucket(h), h)
    if not items then return ids end
    local live = {}
    for j = 1, #items, ITEM_WIDTH do
      if item_deadline(items, j) > now then
        live[#live + 1] = string.sub(items, j, j + ID_WIDTH - 1)
      end
    end
    if #live == 0 then return ids end
    return (ids or '') .. table.concat(live)
  end
end

-- Write path: a staging area for the expiring buckets of one script call (reads first, writes
-- in expiring_flush). meta is <ns>:meta (its field "expiry" picks the mode), sx the gate key.
-- .live tells whether any expiring entry may be live (the gate key exists). A gate that is not
-- a number (a foreign key: kvredis check reports it) counts as absent; the next ttl replaces it.
local function expiring_stage(meta, sx, bits)
  local gate = redis.pcall('GET', sx)
  if type(gate) == 'table' then gate = false end
  return {sx = sx, sbucket = expiring_namer(sx, bits), now = now_ms(),
          fields = redis.call('HGET', meta, 'expiry') == 'field',
          live = gate ~= false, gate = tonumber(gate or '0') or 0,
          values = {}, orig = {}, order = {}, loaded = {}, latest = 0}
end

local function stage_field(xs, bucket, h, value)
  xs.orig[h] = value
  xs.values[h] = value and (items_without(value, xs.now)) or ''
  xs.order[#xs.order + 1] = bucket
  xs.order[#xs.order + 1] = h
end

-- The staged items of request key h (past-due ones left out). Without field expiry the whole
-- bucket is read (once), so that the write drops the past-due items of all its fields.
local function expiring_get(xs, h)
  local v = xs.values[h]
  if v ~= nil then return v end
  local bucket = xs.sbucket(h)
  if xs.fields then
    stage_field(xs, bucket, h, redis.call('HGET', bucket, h) or false)
  else
    if not xs.loaded[bucket] then
      xs.loaded[bucket] = true
      local all = redis.call('HGETALL', bucket)
      for j = 1, #all, 2 do
        if #all[j] == HASH_WIDTH and #all[j + 1] % ITEM_WIDTH == 0 then
          stage_field(xs, bucket, all[j], all[j + 1])
        end
      end
    end
    if xs.values[h] == nil then stage_field(xs, bucket, h, false) end
  end
  return xs.values[h]
end

-- Remove the ids in set from request key h's expiring entries; returns how many were removed.
local function expiring_remove(xs, h, set)
  local left, removed = items_without(expiring_get(xs, h), xs.now, set)
  xs.values[h] = left
  return removed
end

-- Give the ids (array) a deadline under request key h (replacing an earlier one).
local function expiring_add(xs, h, ids, deadline)
  local set = {}
  for _, id in ipairs(ids) do set[id] = true end
  local left = items_without(expiring_get(xs, h), xs.now, set)
  local out = {left}
  for _, id in ipairs(ids) do out[#out + 1] = item(id, deadline) end
  xs.values[h] = table.concat(out)
  if deadline > xs.latest then xs.latest = deadline end
end

-- Write the staged changes with their expiry, then move the gate key's deadline forward.
local function expiring_flush(xs)
  local order, values, orig = xs.order, xs.values, xs.orig
  local bucket_latest, changed = {}, {}
  for i = 1, #order, 2 do
    local bucket, h = order[i], order[i + 1]
    local value = values[h]
    local _, _, latest = items_without(value, xs.now)
    bucket_latest[bucket] = math.max(bucket_latest[bucket] or 0, latest)
    if value ~= (orig[h] or '') then
      changed[bucket] = true
      if value == '' then
        redis.call('HDEL', bucket, h)
      else
        redis.call('HSET', bucket, h, value)
        if xs.fields then
          redis.call('HPEXPIREAT', bucket, string.format('%.0f', latest), 'FIELDS', 1, h)
        end
      end
    end
  end
  if not xs.fields then
    for bucket in pairs(changed) do
      if bucket_latest[bucket] > 0 then
        redis.call('PEXPIREAT', bucket, string.format('%.0f', bucket_latest[bucket]))
      end
    end
  end
  if xs.latest > xs.gate then
    redis.call('SET', xs.sx, string.format('%.0f', xs.latest), 'PXAT',
      string.format('%.0f', xs.latest))
  end
end

-- One page of a pod clear over expiring buckets: remove the ids in set (and the past-due items)
-- from every field of the keys; returns the ids removed and the fields examined.
local function clear_expiring(meta, keys, set)
  local fields = redis.call('HGET', meta, 'expiry') == 'field'
  local now = now_ms()
  local removed, examined = 0, 0
  for _, key in ipairs(keys) do
    local all = {}
    if redis.call('TYPE', key)['ok'] == 'hash' then all = redis.call('HGETALL', key) end
    examined = examined + #all / 2
    local latest_all = 0
    local rewrote = false
    for j = 1, #all, 2 do
      local h, value = all[j], all[j + 1]
      if #h == HASH_WIDTH and #value % ITEM_WIDTH == 0 then
        local left, n, latest = items_without(value, now, set)
        removed = removed + n
        if latest > latest_all then latest_all = latest end
        if left ~= value then
          rewrote = true
          if left == '' then
            redis.call('HDEL', key, h)
          else
            redis.call('HSET', key, h, left)
            if fields then
              redis.call('HPEXPIREAT', key, string.format('%.0f', latest), 'FIELDS', 1, h)
            end
          end
        end
      end
    end
    if rewrote and not fields and latest_all > 0 then
      redis.call('PEXPIREAT', key, string.format('%.0f', latest_all))
    end
  end
  return removed, examined
end

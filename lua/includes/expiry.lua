--[[ expiry: speculative entries added with a ttl (docs/design/expiry.md).
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
  their deadline, so an expired entry is never returned, also before the server deleted it.
  Most calls find no expiring entry live: the functions over items, and the write stage's
  operations, are only created (expiry_items, expiring_open) by a call that needs them. ]]
--@include layout
--@include id_lists

local ITEM_WIDTH = 12

-- The functions over items, created on first use: now_ms() (the server clock in ms),
-- item_deadline(items, j), item(id, deadline) and items_without(items, now, drop) (the items
-- without those past due at now and those whose id is in drop, a set or nil; returns the
-- items left, how many ids of drop were removed, the latest deadline left, 0 when none, and
-- the latest deadline of the removed ones, 0 when none).
local function expiry_items()
  local TWO_32 = 4294967296
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
  local function items_without(items, now, drop)
    local kept, removed, latest, dropped = {}, 0, 0, 0
    for j = 1, #items, ITEM_WIDTH do
      local id = string.sub(items, j, j + ID_WIDTH - 1)
      local d = item_deadline(items, j)
      if drop and drop[id] then
        removed = removed + 1
        if d > dropped then dropped = d end
      elseif d > now then
        kept[#kept + 1] = string.sub(items, j, j + ITEM_WIDTH - 1)
        if d > latest then latest = d end
      end
    end
    return table.concat(kept), removed, latest, dropped
  end
  return {now_ms = now_ms, item_deadline = item_deadline, item = item,
          items_without = items_without}
end

-- A function h -> expiring bucket key name (sx is the gate key <ns>:sx, bits the bucket bits).
local function expiring_namer(sx, bits)
  return bucket_namer(string.sub(sx, 1, -2) .. ':', bits)
end

-- Whether request keys hold live expiring entries: nil while none can be live (the gate key sx
-- is absent), else a function h -> true when request key h holds an expiring entry whose
-- deadline is not past (server clock; bits: the bucket bits). One HGET per key asked.
local function expiring_holder(sx, bits)
  if redis.call('EXISTS', sx) == 0 then return nil end
  local x = expiry_items()
  local item_deadline = x.item_deadline
  local now = x.now_ms()
  local sbucket = expiring_namer(sx, bits)
  return function(h)
    local items = redis.call('HGET', sbucket(h), h)
    if not items or #items % ITEM_WIDTH ~= 0 then return false end
    for j = 1, #items, ITEM_WIDTH do
      if item_deadline(items, j) > now then return true end
    end
    return false
  end
end

-- Write path: a staging area for the expiring buckets of one script call (reads first, writes
-- in expiring_flush). meta is <ns>:meta (its field "expiry" picks the mode), sx the gate key.
-- .live tells whether any expiring entry may be live (the gate key exists). A gate that is not
-- a number (a foreign key: kvredis check reports it) counts as absent; the next ttl replaces it.
-- Any other error is raised: in a cluster a gate this node cannot read now (its slot is being
-- migrated: "non local key") is not an absent one.
-- Only the gate is read here: a call that stores no ttl while no expiring entry is live never
-- needs the rest, which expiring_open reads (the clock and the mode) before the stage is used.
local function expiring_stage(meta, sx, bits)
  local gate = redis.pcall('GET', sx)
  if type(gate) == 'table' then
    if not string.find(tostring(gate.err), 'WRONGTYPE', 1, true) then error(gate) end
    gate = false
  end
  return {meta = meta, sx = sx, bits = bits, live = gate ~= false,
          gate = tonumber(gate or '0') or 0, latest = 0}
end

-- Make the stage xs ready for use (once): the server clock (xs.now), the expiry mode
-- (xs.fields: hash field expiry), the staging tables, and its operations:
--   xs.remove(h, set)          remove the ids in set from request key h's expiring entries;
--                              returns how many were removed
--   xs.add(h, ids, deadline)   give the ids (array) a deadline under request key h (replacing
--                              an earlier one); returns whether one of them had a later one
--   xs.holds(h)                whether request key h holds a live expiring entry (as staged)
-- Returns xs.
local function expiring_open(xs)
  if xs.now ~= nil then return xs end
  local x = expiry_items()
  local items_without, item = x.items_without, x.item
  local now = x.now_ms()
  local fields = redis.call('HGET', xs.meta, 'expiry') == 'field'
  local sbucket = expiring_namer(xs.sx, xs.bits)
  local values, orig, order, loaded = {}, {}, {}, {}
  xs.now, xs.fields, xs.items_without = now, fields, items_without
  xs.values, xs.orig, xs.order = values, orig, order

  local function stage_field(bucket, h, value)
    orig[h] = value
    values[h] = value and (items_without(value, now)) or ''
    order[#order + 1] = bucket
    order[#order + 1] = h
  end

  -- The staged items of request key h (past-due ones left out). Without field expiry the
  -- whole bucket is read (once), so that the write drops the past-due items of all its fields.
  local function get(h)
    local v = values[h]
    if v ~= nil then return v end
    local bucket = sbucket(h)
    if fields then
      stage_field(bucket, h, redis.call('HGET', bucket, h) or false)
    else
      if not loaded[bucket] then
        loaded[bucket] = true
        local all = redis.call('HGETALL', bucket)
        for j = 1, #all, 2 do
          if #all[j] == HASH_WIDTH and #all[j + 1] % ITEM_WIDTH == 0 then
            stage_field(bucket, all[j], all[j + 1])
          end
        end
      end
      if values[h] == nil then stage_field(bucket, h, false) end
    end
    return values[h]
  end

  function xs.remove(h, set)
    local left, removed = items_without(get(h), now, set)
    values[h] = left
    return removed
  end

  function xs.add(h, ids, deadline)
    local set = {}
    for _, id in ipairs(ids) do set[id] = true end
    local left, _, _, before = items_without(get(h), now, set)
    local out = {left}
    for _, id in ipairs(ids) do out[#out + 1] = item(id, deadline) end
    values[h] = table.concat(out)
    if deadline > xs.latest then xs.latest = deadline end
    return before > deadline
  end

  function xs.holds(h)
    return get(h) ~= ''
  end
  return xs
end

-- Write the staged changes with their expiry, then move the gate key's deadline forward.
local function expiring_flush(xs)
  if xs.now == nil then return end
  local order, values, orig, items_without = xs.order, xs.values, xs.orig, xs.items_without
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

--[[ writes: the index writes on request and engine buckets (set semantics, idempotent), staged.
  Every function reads and writes through a staging area `st` (new_stage): reads see the staged
  values, writes only stage. A script reads everything it needs first, so a foreign key of the
  wrong type fails the call (WRONGTYPE) before anything is written; flush_stage then writes. ]]
--@include layout
--@include id_lists

-- A staging area: per bucket kind (r, e) the values read or staged by field (a field names its
-- bucket, so the field alone is the key), and the changed (bucket, field) pairs in order.
local function new_stage()
  return {r = {}, e = {}, order = {}, orig = {}}
end

local function stage_get(st, kind, bucket, field)
  local values = st[kind]
  local v = values[field]
  if v == nil then
    v = redis.call('HGET', bucket, field) or false
    values[field] = v
    local order = st.order
    local n = #order
    order[n + 1] = bucket
    order[n + 2] = field
    order[n + 3] = kind
    st.orig[(n + 3) / 3] = v
  end
  return v
end

-- Stage a value (false deletes the field); the field must have been read with stage_get.
local function stage_put(st, kind, bucket, field, value)
  st[kind][field] = value
end

-- Write every staged change.
local function flush_stage(st)
  local order, orig = st.order, st.orig
  for i = 1, #order, 3 do
    local field = order[i + 1]
    local value = st[order[i + 2]][field]
    if value ~= orig[(i + 2) / 3] then
      if value then
        redis.call('HSET', order[i], field, value)
      else
        redis.call('HDEL', order[i], field)
      end
    end
  end
end

-- Store the ids (list and set form) under one request key. Entries already held move to the
-- most recently added end, as in the embedded index.
local function add_ids(st, bucket, field, ids, set)
  local current = stage_get(st, 'r', bucket, field)
  local value = ids
  if current then
    if current == ids then return end
    value = list_without(current, set, ID_WIDTH) .. ids
  end
  stage_put(st, 'r', bucket, field, value)
end

-- Record engine key -> request key (most recent last, at most cap request keys per engine key).
local function map_engine(st, bucket, efield, rfield, cap)
  local current = stage_get(st, 'e', bucket, efield)
  if not current then
    stage_put(st, 'e', bucket, efield, rfield)
    return
  end
  if string.sub(current, -HASH_WIDTH) == rfield then return end
  local pos = list_find(current, rfield, HASH_WIDTH)
  if pos then
    current = string.sub(current, 1, pos - 1) .. string.sub(current, pos + HASH_WIDTH)
  elseif #current >= cap * HASH_WIDTH then
    current = string.sub(current, HASH_WIDTH + 1)
  end
  stage_put(st, 'e', bucket, efield, current .. rfield)
end

-- Remove the ids in set from one request key, deleting the field once empty.
-- Returns the ids left ('' when none, nil when the key held nothing) and how many were removed.
local function remove_ids(st, bucket, field, set)
  local current = stage_get(st, 'r', bucket, field)
  if not current then return nil, 0 end
  local left, removed = list_without(current, set, ID_WIDTH)
  if removed > 0 then stage_put(st, 'r', bucket, field, left ~= '' and left) end
  return left, removed
end

-- Evict by engine key: remove the ids from every request key it maps to; drop the mapping once
-- none of those request keys holds any entry. Request bucket names are built here (rbucket, a
-- bucket_namer) because the request keys are only known once the mapping is read inside this
-- atomic step.
local function evict_engine(st, rbucket, bucket, efield, set)
  local refs = stage_get(st, 'e', bucket, efield)
  if not refs then return 0 end
  local held, removed = false, 0
  for i = 1, #refs, HASH_WIDTH do
    local rfield = string.sub(refs, i, i + HASH_WIDTH - 1)
    local left, n = remove_ids(st, rbucket(rfield), rfield, set)
    removed = removed + n
    if left and left ~= '' then held = true end
  end
  if not held then stage_put(st, 'e', bucket, efield, false) end
  return removed
end

--[[ writes: the index writes on request and engine buckets (set semantics, idempotent), staged.
  Every function reads and writes through a staging area `st` (new_stage): reads see the staged
  values, writes only stage. A script reads everything it needs first, so a foreign key of the
  wrong type fails the call (WRONGTYPE) before anything is written; flush_stage then writes. ]]
--@include layout
--@include id_lists

local function new_stage()
  return {values = {}, order = {}}
end


local function stage_get(st, bucket, field)
  local b = st.values[bucket]
  if b then
    local v = b[field]
    if v ~= nil then return v end
  else
    b = {}
    st.values[bucket] = b
  end
  local v = redis.call('HGET', bucket, field) or false
  b[field] = v
  return v
end

-- Stage a value (false deletes the field); the field must have been read with stage_get.
local function stage_put(st, bucket, field, value)
  local b = st.values[bucket]
  if b[field] == value then return end
  b[field] = value
  local seen = st.seen or {}
  st.seen = seen
  local bf = bucket .. field
  if not seen[bf] then
    seen[bf] = true
    st.order[#st.order + 1] = {bucket, field}
  end
end

-- Write every staged change.
local function flush_stage(st)
  for _, bf in ipairs(st.order) do
    local value = st.values[bf[1]][bf[2]]
    if value then
      redis.call('HSET', bf[1], bf[2], value)
    else
      redis.call('HDEL', bf[1], bf[2])
    end
  end
end

-- Store the ids (list and set form) under one request key. Entries already held move to the
-- most recently added end, as in the embedded index.
local function add_ids(st, bucket, field, ids, set)
  local current = stage_get(st, bucket, field)
  local value = ids
  if current then
    if current == ids then return end
    value = list_without(current, set, ID_WIDTH) .. ids
  end
  stage_put(st, bucket, field, value)
end

-- Record engine key -> request key (most recent last, at most cap request keys per engine key).
local function map_engine(st, bucket, efield, rfield, cap)
  local current = stage_get(st, bucket, efield)
  if not current then
    stage_put(st, bucket, efield, rfield)
    return
  end
  if string.sub(current, -HASH_WIDTH) == rfield then return end
  local pos = list_find(current, rfield, HASH_WIDTH)
  if pos then
    current = string.sub(current, 1, pos - 1) .. string.sub(current, pos + HASH_WIDTH)
  elseif #current >= cap * HASH_WIDTH then
    current = string.sub(current, HASH_WIDTH + 1)
  end
  stage_put(st, bucket, efield, current .. rfield)
end

-- Remove the ids in set from one request key, deleting the field once empty.
-- Returns the ids left ('' when none, nil when the key held nothing) and how many were removed.
local function remove_ids(st, bucket, field, set)
  local current = stage_get(st, bucket, field)
  if not current then return nil, 0 end
  local left, removed = list_without(current, set, ID_WIDTH)
  if removed > 0 then stage_put(st, bucket, field, left ~= '' and left) end
  return left, removed
end

-- Evict by engine key: remove the ids from every request key it maps to; drop the mapping once
-- none of those request keys holds any entry. Request bucket names are built here (rbucket, a
-- bucket_namer) because the request keys are only known once the mapping is read inside this
-- atomic step.
local function evict_engine(st, rbucket, bucket, efield, set)
  local refs = stage_get(st, bucket, efield)
  if not refs then return 0 end
  local held, removed = false, 0
  for i = 1, #refs, HASH_WIDTH do
    local rfield = string.sub(refs, i, i + HASH_WIDTH - 1)
    local left, n = remove_ids(st, rbucket(rfield), rfield, set)
    removed = removed + n
    if left and left ~= '' then held = true end
  end
  if not held then stage_put(st, bucket, efield, false) end
  return removed
end

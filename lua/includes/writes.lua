--[[ writes: the index writes on request and engine buckets (set semantics, idempotent). ]]
--@include layout
--@include id_lists

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
-- none of those request keys holds any entry. Request bucket names are built here (rbucket, a
-- bucket_namer) because the request keys are only known once the mapping is read inside this
-- atomic step.
local function evict_engine(rbucket, bucket, efield, set)
  local refs = redis.call('HGET', bucket, efield)
  if not refs then return 0 end
  local held, removed = false, 0
  for i = 1, #refs, HASH_WIDTH do
    local rfield = string.sub(refs, i, i + HASH_WIDTH - 1)
    local left, n = remove_ids(rbucket(rfield), rfield, set)
    removed = removed + n
    if left and left ~= '' then held = true end
  end
  if not held then redis.call('HDEL', bucket, efield) end
  return removed
end

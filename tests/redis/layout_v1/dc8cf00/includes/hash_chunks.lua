--[[ hash_chunks: HMGET / HDEL / HSET of many fields, in chunks so that unpack stays small. ]]

local CHUNK = 2000

-- The values of fields in order, false for missing fields.
local function hmget(key, fields)
  local out = {}
  for i = 1, #fields, CHUNK do
    local reply = redis.call('HMGET', key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #reply do out[#out + 1] = reply[j] end
  end
  return out
end

-- cmd key items..., in chunks (a command that takes many members: HDEL, ZREM, ...)
local function call_chunked(cmd, key, items)
  for i = 1, #items, CHUNK do
    redis.call(cmd, key, unpack(items, i, math.min(i + CHUNK - 1, #items)))
  end
end

local function hdel(key, fields)
  call_chunked('HDEL', key, fields)
end

-- pairs_ is a flat field, value, field, value, ... array
local function hset(key, pairs_)
  for i = 1, #pairs_, CHUNK do
    redis.call('HSET', key, unpack(pairs_, i, math.min(i + CHUNK - 1, #pairs_)))
  end
end

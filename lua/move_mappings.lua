#!lua flags=allow-cross-slot-keys
--[[ move_mappings: copy engine -> request key mappings of a cluster namespace being converted from
  the key layout (kvredis-cluster/1) to the pod layout into a shard (kvredis.redis.cluster.migrate),
  as older than the shard's own: a mapping the shard holds keeps its request keys last (most
  recent), the copied ones go before them, at most cap in all (the most recent kept).
  KEYS[1]     <ns>:meta
  ARGV[1]     namespace generation    ARGV[2] engine bucket prefix "<ns>:e:"    ARGV[3] bucket bits
  ARGV[4]     most request keys kept per engine key
  ARGV[5..]   pairs: 8-byte engine key, its request keys as the old shard held them (hash blob,
              most recent last)
  Errors      KVREDIS_INVALID for malformed arguments, before the first write; KVREDIS_STALE
  Returns     the number of mappings written
  Complexity  O(pairs x request keys per mapping) ]]
--@include layout
--@include id_lists
keys_arg(KEYS, 1)
check_gen(KEYS[1], ARGV[1])
local ebucket = bucket_namer(ARGV[2], ARGV[3])
local cap = int_arg(ARGV[4], 'request keys per engine key', 1, 2147483647)
if (#ARGV - 4) % 2 ~= 0 then fail('INVALID', 'engine keys and mappings must come in pairs') end
local fields, lists = {}, {}
for i = 5, #ARGV, 2 do
  fields[#fields + 1] = blob_arg(ARGV[i], HASH_WIDTH, 'engine key', 1)
  lists[#lists + 1] = blob_arg(ARGV[i + 1], HASH_WIDTH, 'mapping')
end
local written = 0
for i, field in ipairs(fields) do
  local bucket = ebucket(field)
  local own = redis.call('HGET', bucket, field) or ''
  local mine = {}
  list_set(own, HASH_WIDTH, mine)
  local older = {}
  local old = lists[i]
  for j = 1, #old, HASH_WIDTH do
    local key = string.sub(old, j, j + HASH_WIDTH - 1)
    if not mine[key] then
      mine[key] = true
      older[#older + 1] = key
    end
  end
  if #older > 0 then
    local merged = table.concat(older) .. own
    if #merged > cap * HASH_WIDTH then merged = string.sub(merged, -cap * HASH_WIDTH) end
    redis.call('HSET', bucket, field, merged)
    written = written + 1
  end
end
return written

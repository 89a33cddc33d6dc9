#!lua flags=allow-oom,allow-cross-slot-keys
--[[ unmap: drop engine -> request mappings that still hold exactly the given request keys (a
  compare-and-delete; the cluster index calls it once the request keys, which live in other
  shards, were found to hold no entry).
  KEYS[1]     <ns>:meta
  ARGV[1]     namespace generation    ARGV[2] engine bucket prefix "<ns>:e:"    ARGV[3] bucket bits
  ARGV[4..]   pairs: 8-byte engine key, the mapping as it was read (request keys hash blob)
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Returns     the number of mappings dropped (a mapping changed since it was read is kept)
  Complexity  O(pairs) ]]
--@include layout
keys_arg(KEYS, 1)
check_gen(KEYS[1], ARGV[1])
local ebucket = bucket_namer(ARGV[2], ARGV[3])
if (#ARGV - 3) % 2 ~= 0 then fail('INVALID', 'engine keys and mappings must come in pairs') end
local fields, expected = {}, {}
for i = 4, #ARGV, 2 do
  fields[#fields + 1] = blob_arg(ARGV[i], HASH_WIDTH, 'engine key', 1)
  expected[#expected + 1] = blob_arg(ARGV[i + 1], HASH_WIDTH, 'mapping')
end
local dropped = 0
for i, field in ipairs(fields) do
  local bucket = ebucket(field)
  if redis.call('HGET', bucket, field) == expected[i] then
    redis.call('HDEL', bucket, field)
    dropped = dropped + 1
  end
end
return dropped

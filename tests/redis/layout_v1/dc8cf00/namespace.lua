#!lua flags=allow-cross-slot-keys
--[[ namespace: create the namespace's meta record if it does not exist, and return it; the
  first client fixes the layout version, bucket bits and generation, every later one adopts them.
  A meta record lost on its own (a stray DEL, an eviction) heals here: the entry dictionary keeps
  the id high-water mark and the bucket bits (fields "next_id" and "bucket_bits" of <ns>:pi), and
  the new record takes them over, so ids are never reused and existing buckets stay reachable.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi
  ARGV[1]     layout version   ARGV[2] bucket bits   ARGV[3] a fresh random generation token
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Returns     [layout version, bucket bits, generation] as stored (the generation is a
              "dropping:..." tombstone while a drop is in progress: see drop.lua)
  Complexity  O(1) ]]
--@include args
text_arg(ARGV[1], 'layout version')
int_arg(ARGV[2], 'bucket bits', 1, 24)
text_arg(ARGV[3], 'generation')
local current = redis.call('HMGET', KEYS[1], 'layout', 'bucket_bits', 'gen')
if current[1] or current[2] or current[3] then return current end
local kept = redis.call('HMGET', KEYS[2], 'bucket_bits', 'next_id')
local bits = kept[1] or ARGV[2]
redis.call('HSET', KEYS[1], 'layout', ARGV[1], 'bucket_bits', bits, 'gen', ARGV[3])
if kept[2] then redis.call('HSET', KEYS[1], 'next_id', kept[2]) end
return {ARGV[1], bits, ARGV[3]}

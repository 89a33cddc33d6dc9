#!lua flags=allow-cross-slot-keys
--[[ namespace: create the namespace's meta record if it does not exist, and return it; the
  first client fixes the layout version, bucket bits and generation, every later one adopts them.
  KEYS[1]     <ns>:meta
  ARGV[1]     layout version   ARGV[2] bucket bits   ARGV[3] a fresh random generation token
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Returns     [layout version, bucket bits, generation] as stored
  Complexity  O(1) ]]
--@include args
text_arg(ARGV[1], 'layout version')
int_arg(ARGV[2], 'bucket bits', 1, 24)
text_arg(ARGV[3], 'generation')
local current = redis.call('HMGET', KEYS[1], 'layout', 'bucket_bits', 'gen')
if current[1] or current[2] or current[3] then return current end
redis.call('HSET', KEYS[1], 'layout', ARGV[1], 'bucket_bits', ARGV[2], 'gen', ARGV[3])
return {ARGV[1], ARGV[2], ARGV[3]}

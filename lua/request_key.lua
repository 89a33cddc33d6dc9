#!lua flags=no-writes,allow-cross-slot-keys
--[[ request_key: the request key most recently mapped to an engine key.
  KEYS[1]     <ns>:meta
  ARGV[1]     namespace generation    ARGV[2] engine bucket prefix "<ns>:e:"
  ARGV[3]     bucket bits             ARGV[4] the 8-byte engine key
  Returns     the 8-byte request key, or nil when the engine key has no mapping
  Errors      KVREDIS_STALE for a generation not the namespace's, KVREDIS_INVALID for an engine
              key not 8 bytes
  Complexity  O(1) ]]
--@include layout
keys_arg(KEYS, 1)
check_gen(KEYS[1], ARGV[1])
local field = blob_arg(ARGV[4], HASH_WIDTH, 'engine key', 1)
local refs = redis.call('HGET', bucket_namer(ARGV[2], ARGV[3])(field), field)
if not refs then return false end
return string.sub(refs, -HASH_WIDTH)

#!lua flags=allow-cross-slot-keys
--[[ namespace: create the namespace's meta record if it does not exist, and return it; the
  first client fixes the layout version, bucket bits and generation, every later one adopts them.
  A meta record lost on its own (a stray DEL, an eviction) heals here: the entry dictionary keeps
  the id and run id high-water marks and the bucket bits (fields "next_id", "next_run" and
  "bucket_bits" of <ns>:pi), and the new record takes them over, so ids are never reused and
  existing buckets stay reachable. The expiry mode of speculative entries with a ttl (field
  "expiry": "field" for hash field expiry, "key" for expiring bucket keys; see includes/expiry)
  is fixed the same way, so every client of the namespace writes them alike. The record also
  keeps (field "api") the highest protocol version of the function library of a client that
  created the namespace or loaded its library since: a client of an older api never loads its
  library into a server without one while this names a newer api (kvredis.redis.functions).
  And (field "scheme") the block key scheme of the keys the namespace holds, "<hash algo>:<block
  size>:<hash seed>", recorded by its first writer that knows it (kvredis.hashing.config): every
  client that computes keys checks it against its own.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi
  ARGV[1]     layout version   ARGV[2] bucket bits   ARGV[3] a fresh random generation token
  ARGV[4]     expiry mode of a new namespace: "field" when the server has hash field expiry
              (HPEXPIREAT), else "key" (absent: "key")
  ARGV[5]     optional: the caller's protocol (api) version, recorded when higher than the
              record's (an existing record too)
  ARGV[6]     optional: the caller's block key scheme, recorded when the record holds none
              (an existing record too)
  Errors      KVREDIS_INVALID for malformed keys or arguments, before the first write
  Returns     [layout version, bucket bits, generation] as stored (the generation is a
              "dropping:..." tombstone while a drop is in progress: see drop.lua)
  Complexity  O(1) ]]
--@include args
keys_arg(KEYS, 2)
text_arg(ARGV[1], 'layout version')
int_arg(ARGV[2], 'bucket bits', 1, 24)
text_arg(ARGV[3], 'generation')
if ARGV[4] ~= nil and ARGV[4] ~= 'field' and ARGV[4] ~= 'key' then
  fail('INVALID', 'expiry mode must be "field" or "key", got ' .. tostring(ARGV[4]))
end
local api = ARGV[5] and int_arg(ARGV[5], 'api', 1, 2147483647)
local scheme = ARGV[6] and text_arg(ARGV[6], 'block key scheme')
local current = redis.call('HMGET', KEYS[1], 'layout', 'bucket_bits', 'gen', 'api', 'scheme')
local recorded, recorded_scheme = tonumber(current[4] or '0') or 0, current[5]
current[5], current[4] = nil, nil
if current[1] or current[2] or current[3] then
  if api and api > recorded then redis.call('HSET', KEYS[1], 'api', tostring(api)) end
  if scheme and not recorded_scheme then redis.call('HSET', KEYS[1], 'scheme', scheme) end
  return current
end
local kept = redis.call('HMGET', KEYS[2], 'bucket_bits', 'next_id', 'expiry', 'next_run')
local bits = kept[1] or ARGV[2]
local expiry = kept[3] or (ARGV[4] == 'field' and 'field' or 'key')
redis.call('HSET', KEYS[1], 'layout', ARGV[1], 'bucket_bits', bits, 'gen', ARGV[3],
  'expiry', expiry)
if kept[2] then redis.call('HSET', KEYS[1], 'next_id', kept[2]) end
if kept[4] then redis.call('HSET', KEYS[1], 'next_run', kept[4]) end
if api then redis.call('HSET', KEYS[1], 'api', tostring(api)) end
if scheme then redis.call('HSET', KEYS[1], 'scheme', scheme) end
return {ARGV[1], bits, ARGV[3]}

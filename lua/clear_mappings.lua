#!lua flags=allow-oom,allow-cross-slot-keys
--[[ clear_mappings: drop the engine -> request mappings of one batch of engine buckets whose
  request keys all hold no entry, neither in their request buckets nor as live expiring entries
  (includes/expiry) (the second pass of clear; the client pages the namespace with
  SCAN MATCH <ns>:e:* and calls this once per page).
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:sx, the gate key of the expiring buckets
  KEYS[3..]   engine bucket keys of this page
  ARGV[1]     namespace generation    ARGV[2] request bucket prefix "<ns>:r:"    ARGV[3] bucket bits
  Returns     [mappings dropped, work done (fields examined + request keys probed)]
  Complexity  O(mappings of the page's buckets x request keys per mapping). Request (and
              expiring) bucket names are built here from the mapped request keys (they are
              data, not arguments). Keys or fields without the shape of an engine bucket are
              left alone.
  Errors      KVREDIS_INVALID for a malformed prefix or bucket bits, before the first write ]]
--@include layout
--@include hash_chunks
--@include expiry
keys_arg(KEYS, 2, true)
check_gen(KEYS[1], ARGV[1])
local rbucket = bucket_namer(ARGV[2], ARGV[3])
-- nil while no expiring entry can be live
local expiring = expiring_holder(KEYS[2], ARGV[3])
local dropped, examined = 0, 0
for i = 3, #KEYS do
  local all = {}
  if redis.call('TYPE', KEYS[i])['ok'] == 'hash' then all = redis.call('HGETALL', KEYS[i]) end
  local dels = {}
  examined = examined + #all / 2
  for j = 1, #all, 2 do
    local refs = all[j + 1]
    local held = #all[j] ~= HASH_WIDTH or #refs == 0 or #refs % HASH_WIDTH ~= 0
    local p = 1
    while not held and p <= #refs do
      local rfield = string.sub(refs, p, p + HASH_WIDTH - 1)
      held = redis.call('HEXISTS', rbucket(rfield), rfield) == 1 or
        (expiring ~= nil and expiring(rfield))
      p = p + HASH_WIDTH
      examined = examined + 1
    end
    if not held then dels[#dels + 1] = all[j] end
  end
  if #dels > 0 then
    if #dels * 2 == #all then redis.call('DEL', KEYS[i]) else hdel(KEYS[i], dels) end
    dropped = dropped + #dels
  end
end
return {dropped, examined}

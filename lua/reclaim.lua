#!lua flags=allow-oom,allow-cross-slot-keys
--[[ reclaim: delete the definitions of a cleared pod's retired entries from the entry dictionary
  (the last step of clear, once no bucket, run or expiring bucket holds them: retire.lua took
  them out of <ns>:pe and <ns>:pp before the clear's passes, so no write stored them since).
  Entry ids are never reused (<ns>:meta next_id only grows), so an id a client has cached keeps
  meaning the entry it was defined as; adding the entry again interns it under a new id.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe    KEYS[3] <ns>:pi    KEYS[4] <ns>:pr
  ARGV[1]     namespace generation    ARGV[2] the pod id
  ARGV[3]     the pod's entry ids to reclaim (id list, as retire.lua returned them)
  Errors      KVREDIS_INVALID for a malformed id list, before the first write
  Returns     number of definitions deleted; the ids leave the pod's retired list in <ns>:pr
              (when it empties, the clear has ended: the pod's stamps hold again,
              includes/stamps)
  Complexity  O(ids + the pod's retired list) ]]
--@include entries
--@include stamps
keys_arg(KEYS, 4)
check_gen(KEYS[1], ARGV[1])
local pod = text_arg(ARGV[2], 'pod id')
local ids = blob_arg(ARGV[3], ID_WIDTH, 'entry ids')
local list = {}
for i = 1, #ids, ID_WIDTH do list[#list + 1] = string.sub(ids, i, i + ID_WIDTH - 1) end
local encs = hmget(KEYS[3], list)
local owners = hmget(KEYS[2], (function()
  local out = {}
  for i = 1, #list do out[i] = encs[i] or '' end
  return out
end)())
local retired = redis.call('HGET', KEYS[4], pod)
local deleted = 0
for i = 1, #list do
  if encs[i] then
    redis.call('HDEL', KEYS[3], list[i])
    if owners[i] == list[i] then redis.call('HDEL', KEYS[2], encs[i]) end
    deleted = deleted + 1
  end
end
if retired then
  local left = list_without(retired, list_set(ids, ID_WIDTH), ID_WIDTH)
  if left == '' then
    redis.call('HDEL', KEYS[4], pod)
    stamp_cleared(KEYS[1], pod)
  elseif left ~= retired then
    redis.call('HSET', KEYS[4], pod, left)
  end
end
return deleted

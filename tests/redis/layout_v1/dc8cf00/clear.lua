#!lua flags=allow-oom,allow-cross-slot-keys
--[[ clear: remove a pod's entry ids from one batch of request buckets (the client pages the
  namespace with SCAN MATCH <ns>:r:* and calls this once per page: bounded work per call).
  KEYS[1]     <ns>:meta    KEYS[2..] request bucket keys of this page
  ARGV[1]     namespace generation
  ARGV[2]     the pod's entry ids (id list, as stored in <ns>:pp)
  Returns     [pairs (request key, entry) removed, fields examined]; request keys left empty
              are deleted (the client sizes its next page from the fields examined)
  Errors      KVREDIS_INVALID for a malformed id list, before the first write
  Complexity  O(fields of the page's buckets x entries per key). Keys or fields that do not have
              the shape of a request bucket (not a hash, field not 8 bytes) are left alone. ]]
--@include layout
--@include id_lists
--@include hash_chunks
check_gen(KEYS[1], ARGV[1])
local set = list_set(blob_arg(ARGV[2], ID_WIDTH, 'entry ids'), ID_WIDTH)
local removed, examined = 0, 0
for i = 2, #KEYS do
  local all = {}
  if redis.call('TYPE', KEYS[i])['ok'] == 'hash' then all = redis.call('HGETALL', KEYS[i]) end
  local dels, sets = {}, {}
  examined = examined + #all / 2
  for j = 1, #all, 2 do
    local left, n = all[j + 1], 0
    if #all[j] == HASH_WIDTH and #left % ID_WIDTH == 0 then
      left, n = list_without(left, set, ID_WIDTH)
    end
    if n > 0 then
      removed = removed + n
      if left == '' then
        dels[#dels + 1] = all[j]
      else
        sets[#sets + 1] = all[j]
        sets[#sets + 1] = left
      end
    end
  end
  if #dels > 0 and #dels * 2 == #all then
    redis.call('DEL', KEYS[i])
  else
    if #dels > 0 then hdel(KEYS[i], dels) end
    if #sets > 0 then hset(KEYS[i], sets) end
  end
end
return {removed, examined}

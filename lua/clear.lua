#!lua flags=allow-oom,allow-cross-slot-keys
--[[ clear: remove a pod's entry ids from one batch of request buckets (the client pages the
  namespace with SCAN MATCH <ns>:r:* and calls this once per page: bounded work per call), or
  of expiring buckets (SCAN MATCH <ns>:s:*, includes/expiry: past-due items go too).
  KEYS[1]     <ns>:meta    KEYS[2..] request (or expiring) bucket keys of this page
  ARGV[1]     namespace generation
  ARGV[2]     the pod's entry ids (id list, as stored in <ns>:pp)
  ARGV[3]     "s" when the keys are expiring buckets, else absent or ""
  Returns     [pairs (request key, entry) removed, fields examined]; request keys left empty
              are deleted (the client sizes its next page from the fields examined)
  Errors      KVREDIS_INVALID for malformed keys or arguments, before the first write
  Complexity  O(fields of the page's buckets x entries per key). Keys or fields that do not have
              the shape of a request bucket (not a hash, field not 8 bytes) are left alone. ]]
--@include layout
--@include id_lists
--@include hash_chunks
--@include expiry

-- One page of a pod clear over expiring buckets: remove the ids in set (and the past-due items)
-- from every field of the keys from position first on; returns the ids removed and the fields
-- examined.
local function clear_expiring(meta, keys, first, set)
  local fields = redis.call('HGET', meta, 'expiry') == 'field'
  local x = expiry_items()
  local items_without = x.items_without
  local now = x.now_ms()
  local removed, examined = 0, 0
  for k = first, #keys do
    local key = keys[k]
    local all = {}
    if redis.call('TYPE', key)['ok'] == 'hash' then all = redis.call('HGETALL', key) end
    examined = examined + #all / 2
    local latest_all = 0
    local rewrote = false
    for j = 1, #all, 2 do
      local h, value = all[j], all[j + 1]
      if #h == HASH_WIDTH and #value % ITEM_WIDTH == 0 then
        local left, n, latest = items_without(value, now, set)
        removed = removed + n
        if latest > latest_all then latest_all = latest end
        if left ~= value then
          rewrote = true
          if left == '' then
            redis.call('HDEL', key, h)
          else
            redis.call('HSET', key, h, left)
            if fields then
              redis.call('HPEXPIREAT', key, string.format('%.0f', latest), 'FIELDS', 1, h)
            end
          end
        end
      end
    end
    if rewrote and not fields and latest_all > 0 then
      redis.call('PEXPIREAT', key, string.format('%.0f', latest_all))
    end
  end
  return removed, examined
end

keys_arg(KEYS, 1, true)
check_gen(KEYS[1], ARGV[1])
local set = list_set(blob_arg(ARGV[2], ID_WIDTH, 'entry ids'), ID_WIDTH)
if ARGV[3] ~= nil and ARGV[3] ~= 's' and ARGV[3] ~= '' then
  fail('INVALID', 'the bucket kind must be "s" or "", got ' .. tostring(ARGV[3]))
end
if ARGV[3] == 's' then return {clear_expiring(KEYS[1], KEYS, 2, set)} end
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

#!lua flags=allow-oom,allow-cross-slot-keys
--[[ retire: the first step of clear: the pod's entry ids are retired, atomically, before any
  bucket is touched. Their definitions stay in <ns>:pi (readers keep decoding them until the
  clear removed them), but <ns>:pe no longer points to them and <ns>:pp no longer lists them:
  from here on an add of the pod's entries, racing the clear, interns them under new ids, which
  the clear neither removes nor reclaims. The retired ids wait in <ns>:pr until reclaim.lua
  deletes their definitions; ids an earlier clear retired and did not reclaim (it was
  interrupted) are retired again with the pod's current ones, so running clear again finishes it.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe    KEYS[3] <ns>:pi    KEYS[4] <ns>:pp
  KEYS[5]     <ns>:pr
  ARGV[1]     namespace generation    ARGV[2] the pod id
  ARGV[3]     optional: the ids to retire (id list; a clear of some tiers or one data-parallel
              rank: the pod's ids whose definitions it matches); without it, every id of the pod
  Returns     the pod's retired ids (id list: the ids the clear removes from every bucket and
              run, then reclaims; with ARGV[3], those of them ARGV[3] lists), "" when none;
              when some, the pod's stamps stop holding until reclaim.lua ends the clear
              (includes/stamps)
  Errors      KVREDIS_INVALID for an empty pod id, KVREDIS_LAYOUT for a malformed stored id
              list; both before the first write
  Complexity  O(the pod's ids) ]]
--@include entries
--@include stamps
keys_arg(KEYS, 5)
check_gen(KEYS[1], ARGV[1])
local pod = text_arg(ARGV[2], 'pod id')
local only = ARGV[3] and blob_arg(ARGV[3], ID_WIDTH, 'entry ids')
local current = redis.call('HGET', KEYS[4], pod) or ''
local retired = redis.call('HGET', KEYS[5], pod) or ''
if #current % ID_WIDTH ~= 0 or #retired % ID_WIDTH ~= 0 then
  fail('LAYOUT', 'malformed id list of pod ' .. pod .. ' (kvredis check --repair fixes it)')
end
local keep = ''
if only then
  local wanted = list_set(only, ID_WIDTH)
  keep = list_without(current, wanted, ID_WIDTH)
  current = list_without(current, list_set(keep, ID_WIDTH), ID_WIDTH)
end
local function result(ids)
  if only then
    local wanted, out = list_set(only, ID_WIDTH), {}
    for i = 1, #ids, ID_WIDTH do
      local id = string.sub(ids, i, i + ID_WIDTH - 1)
      if wanted[id] then out[#out + 1] = id end
    end
    ids = table.concat(out)
  end
  -- the clear removes these (reclaim.lua ends it): no stamp of the pod holds meanwhile
  if ids ~= '' then stamp_clearing(KEYS[1], pod) end
  return ids
end
if current == '' then return result(retired) end
local list = {}
for i = 1, #current, ID_WIDTH do list[#list + 1] = string.sub(current, i, i + ID_WIDTH - 1) end
local encs = hmget(KEYS[3], list)
local defined, owners = {}, {}
for i = 1, #list do
  if encs[i] then
    defined[#defined + 1] = encs[i]
    owners[#owners + 1] = list[i]
  end
end
local pe_ids = hmget(KEYS[2], defined)
local gone = {}
for i = 1, #defined do
  if pe_ids[i] == owners[i] then gone[#gone + 1] = defined[i] end
end
if #gone > 0 then hdel(KEYS[2], gone) end
local fresh = list_without(current, list_set(retired, ID_WIDTH), ID_WIDTH)
retired = retired .. fresh
redis.call('HSET', KEYS[5], pod, retired)
if keep == '' then
  redis.call('HDEL', KEYS[4], pod)
else
  redis.call('HSET', KEYS[4], pod, keep)
end
return result(retired)

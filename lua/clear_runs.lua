#!lua flags=allow-oom,allow-cross-slot-keys
--[[ clear_runs: remove a pod's entry ids from one batch of runs (the first pass of clear; the
  client pages the namespace with SCAN MATCH <ns>:c:* and calls this once per page).
  KEYS[1]     <ns>:meta    KEYS[2..] run keys of this page
  ARGV[1]     namespace generation
  ARGV[2]     the pod's entry ids (id list, as stored in <ns>:pp)
  ARGV[3]     request bucket prefix "<ns>:r:"    ARGV[4] bucket bits
  Returns     [pairs (request key, entry) removed, positions examined]; positions left without
              ids lose their request key's ref (holes), trailing holes are cut off and a run
              left without held positions is deleted (includes/runs)
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Complexity  O(ranges of the page's runs x entries per range + positions emptied). Keys that
              do not have the shape of a run are left alone. Request bucket names are built here
              from the run's keys (they are data, not arguments). ]]
--@include runs
--@include id_lists
keys_arg(KEYS, 1, true)
check_gen(KEYS[1], ARGV[1])
local set = list_set(blob_arg(ARGV[2], ID_WIDTH, 'entry ids'), ID_WIDTH)
local rbucket = bucket_namer(ARGV[3], ARGV[4])
local removed, examined = 0, 0
local plans = {}
for i = 2, #KEYS do
  local rec = {}
  if redis.call('TYPE', KEYS[i])['ok'] == 'hash' then rec = redis.call('HMGET', KEYS[i], 'k', 'r') end
  local ranges = rec[1] and rec[2] and ranges_parse(rec[2])
  if ranges and #ranges > 0 and ranges[#ranges].e * HASH_WIDTH == #rec[1] then
    examined = examined + #ranges
    local kept, unref, start, changed = {}, {}, 1, false
    for _, rg in ipairs(ranges) do
      local left, n = rg.ids, 0
      if left ~= '' then left, n = list_without(left, set, ID_WIDTH) end
      if n > 0 then
        changed = true
        removed = removed + n * (rg.e - start + 1)
        if left == '' then
          local rid = string.sub(KEYS[i], -RUN_ID_WIDTH)
          for p = start, rg.e do
            local field = string.sub(rec[1], (p - 1) * HASH_WIDTH + 1, p * HASH_WIDTH)
            -- only the key's own ref to this position goes (never a record of another kind)
            if redis.call('HGET', rbucket(field), field) == ref_make(rid, p) then
              unref[#unref + 1] = field
            end
          end
        end
      end
      local last = kept[#kept]
      if last and last.ids == left then last.e = rg.e else kept[#kept + 1] = {e = rg.e, ids = left} end
      start = rg.e + 1
    end
    if changed then
      local n
      kept, n = ranges_trim(kept)
      examined = examined + #unref
      plans[#plans + 1] = {key = KEYS[i], keys = rec[1], ranges = kept, n = n, unref = unref}
    end
  end
end
for _, p in ipairs(plans) do
  for _, field in ipairs(p.unref) do redis.call('HDEL', rbucket(field), field) end
  if p.n == 0 then
    redis.call('DEL', p.key)
  else
    redis.call('HSET', p.key, 'k', string.sub(p.keys, 1, p.n * HASH_WIDTH),
      'r', ranges_encode(p.ranges))
  end
end
return {removed, examined}

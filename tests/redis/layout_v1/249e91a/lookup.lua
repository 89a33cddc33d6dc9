#!lua flags=no-writes,allow-cross-slot-keys
--[[ lookup: walk a prefix chain of request keys and return their entry ids until the first miss.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi    KEYS[3] <ns>:pp    KEYS[4] <ns>:sx (gate key of
              the expiring buckets, includes/expiry)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] bucket bits
  ARGV[4]     highest entry id (decimal) up to which the client knows every definition
  ARGV[5]     f, the number of pods in the filter (0 = all pods); ARGV[6..5+f] the pod ids
  ARGV[6+f]   the request keys in chain order (hash blob)
  Returns     array: [1] the id up to which the client now knows every definition (the
              client's one plus at most 256 of the ids allocated after it); [2] flat (id, encoded
              entry) definitions of those ids and of hit ids above them ("" for an id whose
              definition was reclaimed); [3..] one id list per
              hit key, in chain order (filtered); the walk stops at the first key with no
              (filtered) entry: keys after the miss are never read; expired speculative
              entries (includes/expiry) are left out
  Complexity  O(hit keys x entries per key) ]]
--@include entries
--@include expiry
local meta = redis.call('HMGET', KEYS[1], 'gen', 'next_id')
if meta[1] ~= ARGV[1] then fail('STALE', 'namespace layout changed or was removed; reload it') end
local rbucket = bucket_namer(ARGV[2], ARGV[3])
local floor = tonumber(ARGV[4])
local want_defs = tonumber(meta[2] or '0') > floor
local upto = math.min(tonumber(meta[2] or '0'), floor + 256)
if upto < floor then upto = floor end
local nf = tonumber(ARGV[5])
local allowed = nil
if nf > 0 then
  local pods = {}
  for i = 1, nf do pods[i] = ARGV[5 + i] end
  allowed = pods_ids(KEYS[3], pods)
end
local chain = ARGV[6 + nf]
local expiring = expiring_reader(KEYS[4], ARGV[3])
local out = {upto, {}}
local seen_lists, seen, unknown = {}, {}, {}
for n = floor + 1, upto do
  local id = struct.pack('>I4', n)
  seen[id] = true
  unknown[#unknown + 1] = id
end
for i = 1, #chain, HASH_WIDTH do
  local h = string.sub(chain, i, i + HASH_WIDTH - 1)
  local ids = redis.call('HGET', rbucket(h), h)
  if expiring then ids = expiring(h, ids) end
  if not ids then break end
  if allowed then
    ids = list_only(ids, allowed, ID_WIDTH)
    if ids == '' then break end
  end
  out[#out + 1] = ids
  if want_defs and not seen_lists[ids] then
    seen_lists[ids] = true
    for j = 1, #ids, ID_WIDTH do
      local id = string.sub(ids, j, j + ID_WIDTH - 1)
      if not seen[id] then
        seen[id] = true
        if struct.unpack('>I4', id) > upto then unknown[#unknown + 1] = id end
      end
    end
  end
end
if #unknown > 0 then
  local defs = hmget(KEYS[2], unknown)
  local flat = out[2]
  for i = 1, #unknown do
    flat[#flat + 1] = unknown[i]
    -- "" for an id without definition (reclaimed: see reclaim.lua); the client skips it
    flat[#flat + 1] = defs[i] or ''
  end
end
return out

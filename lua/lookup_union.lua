#!lua flags=no-writes,allow-cross-slot-keys
--[[ lookup_union: lookup.lua for several shards of a pod-placed cluster namespace
  (kvredis.redis.cluster) that live on this node, in one call, each shard's walk going on past
  its own misses up to a position the client gives. A key's entries are spread over the shards
  of the pods holding it, so the chain ends at the first key no shard holds: the client merges
  the shards' replies key by key and asks again, from where each shard stopped, until every
  shard stopped at the same key (kvredis.redis.cluster.reads).
  KEYS        the first shard's <shard>:meta, :pi, :pp, :sx (they route the call to this node;
              every shard given must live on this node: see lookup_shards.lua)
  ARGV[1]     f, the number of pods in the filter (0 = all pods); ARGV[2..1+f] the pod ids
  ARGV[2+f]   the request keys of the chain, in chain order (hash blob)
  ARGV[3+f..] per shard: <shard>:meta, :pi, :pp, :sx, namespace generation, request bucket
              prefix, bucket bits, highest entry id the client knows every definition of,
              from, upto: the shard walks the chain from position `from` (1-based), passes
              over the keys it does not hold before position `upto` (probing each for a record
              of its own, and walking on from the next that has one), and stops at the first
              key at or after `upto` it does not hold; then 1 when the client reads the chain
              in more than one step (the reply carries the stamps of the pods it read: see
              includes/stamps), else 0, and c and c x (pod id, stamp) carried from the shard's
              earlier steps (lookup.lua's); 12 + 2c arguments. A shard with from = n + 1 walks
              nothing and only checks the stamps carried (an empty chain: n = 0)
  Returns     one reply per shard, in order: "STALE" for a shard whose generation is not the
              client's, else [1] the id up to which the client now knows every definition,
              [2] flat (id, encoded entry) definitions (as lookup.lua's), [3] how the walk
              ended: 0 at a key it does not hold, 1 at the work limit (the key not walked yet:
              the client walks on from it), 2 at the chain's end, [4] that key's position
              (n + 1 at the end), [5] the stamps (flat pod id, stamp, as lookup.lua's: the
              carried pods first, "" where a stamp no longer holds), then pairs: the position
              of a run of hit keys and lookup.lua's (n, id list) pairs for it, in chain order
  Errors      KVREDIS_INVALID for a malformed pod filter, chain, stamps or argument count
  Complexity  the sum of lookup.lua's over the shards (their walks share one work limit), plus
              one probe per key passed over, at most PROBE_LIMIT per call ]]
--@include lookup_chain
--@include layout
--@include args
-- Keys a call passes over by probing them one by one, over all its shards: past them the shard
-- stops as at the work limit (the client asks again from there).
local PROBE_LIMIT = 4096
keys_arg(KEYS, 4)
local pods, at = pod_filter_arg(ARGV, 1)
local chain = blob_arg(ARGV[at], HASH_WIDTH, 'request keys')
local shards = {}
local a = at
while a < #ARGV do
  if #ARGV - a < 12 then fail('INVALID', 'lookup_union wants 12 + 2c arguments per shard') end
  local more, carried = lookup_continuation(ARGV, a + 11)
  shards[#shards + 1] = {a, more, carried}
  a = a + 12 + 2 * #carried
end
local nkeys = #chain / HASH_WIDTH
local spent = {work = 0}    -- the walks of every shard share one work limit (includes/walk)
local probes = 0

local function key_at(p)
  return string.sub(chain, (p - 1) * HASH_WIDTH + 1, p * HASH_WIDTH)
end

-- The walk of one shard (its arguments from position a + 1 on; more, carried: its
-- continuation). The stamps of one call hold throughout it (a script is atomic), so the walk's
-- pieces pass them on: the stamps of the last piece, after the carried pods that broke in the
-- first, are the shard's.
local function walk_shard(a, more, carried)
  local meta_key = ARGV[a + 1]
  local meta = read_meta(meta_key, ARGV[a + 5])
  if not meta then return 'STALE' end
  local pi_key, pp_key, sx_key = ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local rprefix, bits = ARGV[a + 6], ARGV[a + 7]
  local floor = int_arg(ARGV[a + 8], 'definitions floor', 0, MAX_ENTRY_ID)
  local from = int_arg(ARGV[a + 9], 'from', 1, nkeys + 1)
  local upto = int_arg(ARGV[a + 10], 'upto', 1, nkeys + 1)
  local rbucket = bucket_namer(rprefix, bits)
  local expiring = expiring_reader(sx_key, bits)
  local out = {floor, {}, 2, nkeys + 1, {}}
  local defs = out[2]
  local broken = {}  -- the carried pods whose stamps broke: reported first
  local first = true
  local function step(piece)
    local r = lookup_chain(meta, meta_key, pi_key, pp_key, sx_key, rprefix, bits, floor, pods,
      piece, more, carried, spent)
    floor = math.max(floor, r[1])
    out[1] = floor
    for j = 1, #r[2] do defs[#defs + 1] = r[2][j] end
    local stamps = r[3]
    local next_carried = {}
    for j = 1, #stamps - 1, 2 do
      if stamps[j + 1] == '' then
        if first then
          broken[#broken + 1] = stamps[j]
          broken[#broken + 1] = ''
        end
      else
        next_carried[#next_carried + 1] = {stamps[j], stamps[j + 1]}
      end
    end
    if more or #carried > 0 or #stamps > 0 then
      local flat = {}
      for j = 1, #broken do flat[#flat + 1] = broken[j] end
      for _, c in ipairs(next_carried) do
        flat[#flat + 1] = c[1]
        flat[#flat + 1] = c[2]
      end
      out[5] = flat
    end
    carried = next_carried
    first = false
    return r
  end
  local pos = from
  if pos > nkeys then step('') end  -- nothing to walk: the carried stamps checked
  while pos <= nkeys do
    local piece = pos == 1 and chain or string.sub(chain, (pos - 1) * HASH_WIDTH + 1)
    local r = step(piece)
    local pairs_, hits = {}, 0
    for j = 4, #r - 1, 2 do
      pairs_[#pairs_ + 1] = r[j]
      pairs_[#pairs_ + 1] = r[j + 1]
      hits = hits + r[j]
    end
    if hits > 0 then
      out[#out + 1] = pos
      out[#out + 1] = pairs_
    end
    if (#r - 3) % 2 == 1 then  -- cut at the work limit before the piece's key r[#r]
      out[3], out[4] = 1, pos + r[#r] - 1
      return out
    end
    local miss = pos + hits
    if miss > nkeys then return out end
    if miss >= upto then
      out[3], out[4] = 0, miss
      return out
    end
    -- pass over the miss: the next key before upto with a record of its own, else upto
    local q = miss + 1
    while q < upto do
      if probes >= PROBE_LIMIT then
        out[3], out[4] = 1, q
        return out
      end
      probes = probes + 1
      local h = key_at(q)
      -- HGET, not HEXISTS: a router's ACL allows the commands of the single-server reads only
      if redis.call('HGET', rbucket(h), h) or (expiring and expiring(h, nil)) then
        break
      end
      q = q + 1
    end
    pos = q
  end
  return out
end

local out = {}
for s, shard in ipairs(shards) do
  out[s] = walk_shard(shard[1], shard[2], shard[3])
end
return out

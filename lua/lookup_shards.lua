#!lua flags=no-writes,allow-cross-slot-keys
--[[ lookup_shards: lookup.lua for several shards of a cluster namespace that live on this node,
  in one call (each shard is a namespace of its own in its own slot: kvredis.redis.cluster).
  KEYS        the first shard's <shard>:meta, :pi, :pp, :sx (they route the call to this node;
              a script may declare the keys of one slot only, so the shards' keys come as
              arguments, and allow-cross-slot-keys lets it reach them: every shard given must
              live on this node)
  ARGV[1]     f, the number of pods in the filter (0 = all pods); ARGV[2..1+f] the pod ids
  ARGV[2+f..] per shard: <shard>:meta, :pi, :pp, :sx, namespace generation, request bucket
              prefix, bits, highest entry id the client knows every definition of, the shard's
              request keys in chain order (hash blob), 1 when more of the shard's keys follow
              these (else 0), c and c x (pod id, stamp) carried from the shard's earlier parts
              (lookup.lua); 11 + 2c arguments
  Returns     one reply per shard, in order: lookup.lua's reply for the shard's keys (ending
              with the position of the first key not walked when the walk stopped at the work
              limit, which the shards' walks share: the client walks that shard on), or the
              string "STALE" for a shard whose generation is not the client's (the client
              reloads that shard; the other shards' replies stand)
  Errors      KVREDIS_INVALID for a malformed pod filter or shard arguments (a stale shard is a
              reply, not an error)
  Complexity  the sum of lookup.lua's over the shards, their run work bounded together ]]
--@include lookup_chain
--@include args
keys_arg(KEYS, 4)
local pods, after = pod_filter_arg(ARGV, 1)
local shards = {}
local a = after
while a <= #ARGV do
  if #ARGV - a < 10 then fail('INVALID', 'lookup_shards wants 11 + 2c arguments per shard') end
  local more, carried = lookup_continuation(ARGV, a + 9)
  shards[#shards + 1] = {a, more, carried}
  a = a + 11 + 2 * #carried
end
local out = {}
local spent = {work = 0}  -- the walks of every shard share one work limit (includes/walk)
for s, shard in ipairs(shards) do
  local b = shard[1] - 1
  local known = int_arg(ARGV[b + 8], 'known entry id', 0, MAX_ENTRY_ID)
  local chain = blob_arg(ARGV[b + 9], HASH_WIDTH, 'request keys')
  bucket_namer(ARGV[b + 6], ARGV[b + 7])
  local meta = read_meta(ARGV[b + 1], ARGV[b + 5])
  if not meta then
    out[s] = 'STALE'
  else
    out[s] = lookup_chain(meta, ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 6],
      ARGV[b + 7], known, pods, chain, shard[2], shard[3], spent)
  end
end
return out

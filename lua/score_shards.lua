#!lua flags=no-writes,allow-cross-slot-keys
--[[ score_shards: score.lua, unchanged, for several shards of a pod-placed cluster namespace
  (kvredis.redis.cluster) that live on this node, in one call. Every pod lives in one shard, so
  each shard's reply scores its own pods, and the client merges the replies by union.
  KEYS        the first shard's <shard>:meta, :pi, :pp, :sx (they route the call to this node;
              a script may declare the keys of one slot only, so the shards' keys come as
              arguments, and allow-cross-slot-keys lets it reach them: every shard given must
              live on this node)
  ARGV[1]     s, the number of shards
  ARGV[2..]   per shard: m, then m arguments: <shard>:meta, :pi, :pp, :sx, namespace
              generation, request bucket prefix, bucket bits, then 1 when keys of the chain
              follow this part (else 0), c and c x (pod id, rank, score so far, stamp): the
              (pod, rank)s of this shard carried over from the chain's earlier parts (c = 0
              for the chain's first part; see score.lua)
  then        score.lua's ARGV from its pod filter on, the same for every shard: f and f pod
              ids, w and w x (tier, weight), the weight of a tier without one, the request keys
              of this part (hash blob)
  Returns     one reply per shard, in order: score.lua's reply for the shard, or the error that
              stopped it as a string (KVREDIS_STALE for a shard whose generation is not the
              client's: the client reloads that shard; the other shards' replies stand)
  Errors      KVREDIS_INVALID for a malformed shard count or argument count (a malformed
              argument of one shard is that shard's reply)
  Complexity  the sum of score.lua's over the shards (each shard's walk has its own work
              limit: a call does at most the shards' count times one walk's work); a shard that
              holds no record of the chain's first key (and no expiring entry that may be live)
              costs three reads: its reply is score.lua's for it, [0, 0], without running it ]]
--@command score
--@include args
keys_arg(KEYS, 4)
local s = int_arg(ARGV[1], 'shard count', 1, #ARGV)
local starts, pos = {}, 2
for i = 1, s do
  local m = int_arg(ARGV[pos], 'shard argument count', 9, #ARGV - pos)
  starts[i] = {pos + 1, m}
  pos = pos + m + 1
end
if pos > #ARGV then fail('INVALID', 'score_shards wants the pod filter, weights and keys') end
-- the arguments every shard shares, checked once (score.lua checks them again where it runs)
local _, at = pod_filter_arg(ARGV, pos)
local nw = int_arg(ARGV[at], 'weight count', 0, math.floor((#ARGV - at) / 2))
for i = 1, nw do
  if not tonumber(ARGV[at + 2 * i]) then fail('INVALID', 'weight ' .. i .. ' must be a number') end
end
if not tonumber(ARGV[at + 2 * nw + 1]) then fail('INVALID', 'the default weight must be a number') end
local chain = blob_arg(ARGV[at + 2 * nw + 2], HASH_WIDTH, 'request keys')
local first = string.sub(chain, 1, HASH_WIDTH)

-- Whether a shard's score is surely empty: its generation is the client's, no expiring entry
-- of it may be live, and it holds no record of the chain's first key (score.lua would stop
-- there, walking nothing). A stale shard runs score.lua, which says so.
local function holds_nothing(meta, sx, rprefix, bits, gen, carried)
  if first == '' or carried ~= '0' then return false end
  if redis.call('HGET', meta, 'gen') ~= gen then return false end
  if redis.call('EXISTS', sx) == 1 then return false end
  -- HGET, not HEXISTS: a router's ACL allows the commands of the single-server reads only
  return not redis.call('HGET', bucket_namer(rprefix, bits)(first), first)
end

local out = {}
for i = 1, s do
  local a, m = starts[i][1], starts[i][2]
  if holds_nothing(ARGV[a], ARGV[a + 3], ARGV[a + 5], ARGV[a + 6], ARGV[a + 4], ARGV[a + 8]) then
    out[i] = {0, 0}
  else
    local keys = {ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]}
    local args = {ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]}
    for j = pos, #ARGV do args[#args + 1] = ARGV[j] end
    for j = a + 7, a + m - 1 do args[#args + 1] = ARGV[j] end
    local ok, reply = pcall(command_score, keys, args)
    if ok then
      out[i] = reply
    else
      out[i] = type(reply) == 'table' and reply.err or tostring(reply)
    end
  end
end
return out

#!lua flags=allow-cross-slot-keys
--[[ move_pairs: store (request key, entry) pairs another shard held in a cluster namespace being
  converted from the key layout (kvredis-cluster/1) to the pod layout (kvredis.redis.cluster.migrate),
  unless an evict or clear of their pods reached this shard since the mover read them: each pod
  has a counter in <shard>:mv that a client converting alongside raises (after its evict of the
  pairs' old copies, before its evict here); the mover read the counters before the pairs, and
  passes them: a pod whose counter moved since has its pairs read again, so a pair evicted while
  it was on its way is never stored again.
  KEYS[1]     <ns>:meta   KEYS[2] <ns>:pe   KEYS[3] <ns>:pi   KEYS[4] <ns>:pp   KEYS[5] <ns>:sx
  KEYS[6]     <ns>:mv, the pods' counters (HASH pod id -> integer)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits    ARGV[5] most request keys kept per engine key
  ARGV[6]     ttl in ms of the speculative entries the ops store (0: none)
  ARGV[7]     p, then p x (pod id, its counter as the mover read it, "" for none)
  ARGV[8+2p]  the program (n, n entries, number of ops, the ops: add ops only, see
              includes/program)
  Returns     the pods whose counter moved (nothing is written then), or an empty array once
              every op is applied
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_STALE for a generation not the
              namespace's; as apply_batch.lua's ops, all before the first write
  Complexity  O(p) reads, then as the ops (add.lua's) ]]
--@include program
keys_arg(KEYS, 6)
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], KEYS[5])
local cap = int_arg(ARGV[5], 'request keys per engine key', 1, 2147483647)
local ms = int_arg(ARGV[6], 'ttl ms', 0, 2592000000)
local np = int_arg(ARGV[7], 'pod count', 0, math.floor((#ARGV - 7) / 2))
local moved = {}
for i = 1, np do
  local pod, seen = ARGV[6 + 2 * i], ARGV[7 + 2 * i]
  if type(pod) ~= 'string' or type(seen) ~= 'string' then
    fail('INVALID', 'pod ' .. i .. ' and its counter are missing')
  end
  if (redis.call('HGET', KEYS[6], pod) or '') ~= seen then moved[#moved + 1] = pod end
end
local program = read_program(ARGV, 8 + 2 * np, nil, {A = true})
if #moved > 0 then return moved end
run_program(k, program, cap, ms)
return {}

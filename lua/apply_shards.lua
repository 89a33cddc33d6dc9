#!lua flags=allow-cross-slot-keys
--[[ apply_shards: apply_batch.lua (and add.lua's ttl) for several shards of a cluster namespace
  that live on this node, in one call: each shard's part is an op program of its own, fenced by
  the shard's own watermark (each shard is a namespace of its own in its own slot:
  kvredis.redis.cluster).
  KEYS        the first shard's <shard>:meta, :pe, :pi, :pp, :wm, :wp, :sx (they route the call
              to this node; a script may declare the keys of one slot only, so the shards' keys
              come as arguments, and allow-cross-slot-keys lets it reach them: every shard given
              must live on this node)
  ARGV[1]     most request keys kept per engine key
  ARGV[2]     stream name, "" for unfenced parts    ARGV[3] epoch, ARGV[4] seq, ARGV[5] token
              (as in apply_batch.lua)
  ARGV[6..]   the parts, each: m, then m arguments: <shard>:meta, :pe, :pi, :pp, :wm, :wp, :sx,
              namespace generation, request bucket prefix, engine bucket prefix, bucket bits,
              ttl in ms of its speculative entries (0: none), part, parts, then the program (n,
              n entries, number of ops, the ops: see includes/program); parts of one shard come
              in order
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Returns     "STALE" and nothing written when a part's shard generation is not the client's;
              else one reply per part: 1 applied (or already applied by this token), 0 skipped,
              or the error that stopped the part before its first write (KVREDIS_LAYOUT for a
              malformed stored watermark or an exhausted id space, KVREDIS_BUDGET for a part
              whose chain-run ranges, added to those of the parts before it, are too many,
              WRONGTYPE for a foreign key, "... non local key ..." for a shard whose slot
              this node does not serve now: moved or being migrated):
              the other shards' parts are applied, as separate calls would be, and the shard's
              later parts are skipped
  Complexity  the sum of the parts' (see apply_batch.lua), their run work bounded together ]]
--@include program
--@include fence
keys_arg(KEYS, 7)
local cap = int_arg(ARGV[1], 'request keys per engine key', 1, 2147483647)
local stream, epoch, seq, token = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if stream ~= '' then fence_args(epoch, seq, token) end
local parts_in = {}
local pos = 6
while pos <= #ARGV do
  local m = int_arg(ARGV[pos], 'part length', 16, #ARGV - pos)
  local sub = {}
  for i = 1, m do sub[i] = ARGV[pos + i] end
  parts_in[#parts_in + 1] = sub
  pos = pos + m + 1
end
for _, a in ipairs(parts_in) do
  if redis.call('HGET', a[1], 'gen') ~= a[8] then return 'STALE' end
end
local work = {}
for i, a in ipairs(parts_in) do
  local parts = int_arg(a[14], 'parts', 1, 2147483647)
  bucket_namer(a[9], a[11])
  bucket_namer(a[10], a[11])
  work[i] = {
    ms = int_arg(a[12], 'ttl ms', 0, 2592000000),
    part = int_arg(a[13], 'part', 1, parts),
    parts = parts,
    program = read_program(a, 15, nil, {A = true, R = true, E = true}),
  }
end
local out, failed = {}, {}
local spent = {work = 0}  -- the run work of every part of this call (includes/writes)
for i, w in ipairs(work) do
  local a = parts_in[i]
  local verdict = 'apply'
  if failed[a[1]] then
    verdict = 'skip'  -- a part after a failed part of its shard
  elseif stream ~= '' then
    verdict = fence_open(a[5], a[6], stream, epoch, seq, token, w.part, w.parts)
  end
  out[i] = verdict == 'skip' and 0 or 1
  if verdict == 'apply' then
    -- the context reads the expiry gate: after the parts before it wrote
    local ok, err = pcall(function()
      local k = write_context(a[1], a[2], a[3], a[4], a[9], a[10], a[11], a[7])
      k.spent = spent
      run_program(k, w.program, cap, w.ms)
    end)
    if ok then
      if stream ~= '' then fence_close(a[5], a[6], stream, epoch, seq, token, w.part, w.parts) end
    else
      -- run_program reads and checks all it touches before its first write: the part wrote
      -- nothing; the other shards' parts go on, as separate calls would
      failed[a[1]] = true
      out[i] = type(err) == 'table' and err.err or tostring(err)
    end
  end
end
return out

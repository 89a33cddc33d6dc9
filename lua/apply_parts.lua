#!lua flags=allow-cross-slot-keys
--[[ apply_parts: apply_batch.lua (and add.lua's ttl) for the parts of several batches on several
  shards of a pod-placed cluster namespace (kvredis.redis.cluster) that live on this node, in
  one call, in order: each part is an op program of one shard, fenced by its own stream's
  watermark in its shard (each shard is a namespace of its own in its own slot).
  KEYS        the first part's <shard>:meta, :pe, :pi, :pp, :wm, :wp, :sx (they route the call to
              this node; every shard given must live on this node: see apply_shards.lua)
  ARGV[1]     most request keys kept per engine key
  ARGV[2..]   the parts, each: m, then m arguments: <shard>:meta, :pe, :pi, :pp, :wm, :wp, :sx,
              namespace generation, request bucket prefix, engine bucket prefix, bucket bits,
              ttl in ms of its speculative entries (0: none), stream ("" for an unfenced
              part), epoch, seq, token (as in apply_batch.lua), part, parts, batch (a number
              ordering the call's batches), decides (1 when the part's verdict is its batch's:
              a skipped deciding part stops the later batches of its stream in this call),
              then the program (n, n entries, number of ops, the ops: see includes/program);
              the parts of one shard's batch come in order
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Returns     one reply per part: 1 applied (or already applied by this token), 0 skipped by
              its fence, -1 not run (an earlier part of its shard failed in this call, or an
              earlier batch of its stream was not applied), or the error that stopped the part
              before its first write (KVREDIS_STALE for a shard whose generation is not the
              client's, KVREDIS_LAYOUT, KVREDIS_BUDGET for a part whose chain-run ranges, added
              to those of the parts before it, are too many, WRONGTYPE for a foreign key,
              "... non local key ..." for a shard whose slot this node does not serve now):
              the other shards' parts are applied, as separate calls would be
  Complexity  the sum of the parts' (see apply_batch.lua), their run work bounded together ]]
--@include program
--@include fence
keys_arg(KEYS, 7)
local cap = int_arg(ARGV[1], 'request keys per engine key', 1, 2147483647)
-- a part's arguments: 1-7 its shard's keys, then these
local GEN, RPREFIX, EPREFIX, BITS, MS, STREAM, EPOCH, SEQ, TOKEN = 8, 9, 10, 11, 12, 13, 14, 15, 16
local PART, PARTS, BATCH, DECIDES, PROGRAM = 17, 18, 19, 20, 21
local parts_in = {}
local pos = 2
while pos <= #ARGV do
  local m = int_arg(ARGV[pos], 'part length', PROGRAM + 1, #ARGV - pos)
  local a = {}
  for i = 1, m do a[i] = ARGV[pos + i] end
  parts_in[#parts_in + 1] = a
  pos = pos + m + 1
end
local work = {}
for i, a in ipairs(parts_in) do
  local parts = int_arg(a[PARTS], 'parts', 1, 2147483647)
  bucket_namer(a[RPREFIX], a[BITS])
  bucket_namer(a[EPREFIX], a[BITS])
  if a[STREAM] ~= '' then fence_args(a[EPOCH], a[SEQ], a[TOKEN]) end
  work[i] = {
    ms = int_arg(a[MS], 'ttl ms', 0, 2592000000),
    part = int_arg(a[PART], 'part', 1, parts),
    parts = parts,
    batch = int_arg(a[BATCH], 'batch', 0, 2147483647),
    decides = int_arg(a[DECIDES], 'decides', 0, 1) == 1,
    program = read_program(a, PROGRAM, nil, {A = true, R = true, E = true}),
  }
end
local out = {}
local failed = {}    -- shard meta key -> true once a part of the shard failed
local stopped = {}   -- stream -> the batch from which on its parts are not applied
local spent = {work = 0}  -- the run work of every part of this call (includes/writes)
for i, w in ipairs(work) do
  local a = parts_in[i]
  local stream = a[STREAM]
  local verdict = 'apply'
  if failed[a[1]] or (stream ~= '' and stopped[stream] and w.batch > stopped[stream]) then
    verdict = 'not run'
  elseif redis.call('HGET', a[1], 'gen') ~= a[GEN] then
    verdict = 'stale'
  elseif stream ~= '' then
    verdict = fence_open(a[5], a[6], stream, a[EPOCH], a[SEQ], a[TOKEN], w.part, w.parts)
  end
  if verdict == 'apply' then
    -- the context reads the expiry gate: after the parts before it wrote
    local ok, err = pcall(function()
      local k = write_context(a[1], a[2], a[3], a[4], a[RPREFIX], a[EPREFIX], a[BITS], a[7])
      k.spent = spent
      run_program(k, w.program, cap, w.ms)
    end)
    if ok then
      if stream ~= '' then
        fence_close(a[5], a[6], stream, a[EPOCH], a[SEQ], a[TOKEN], w.part, w.parts)
      end
      out[i] = 1
    else
      -- run_program reads and checks all it touches before its first write: the part wrote
      -- nothing; the other shards' parts go on, as separate calls would
      verdict = 'failed'
      out[i] = type(err) == 'table' and err.err or tostring(err)
    end
  elseif verdict == 'done' then
    out[i] = 1
  elseif verdict == 'skip' then
    out[i] = 0
  elseif verdict == 'stale' then
    out[i] = 'KVREDIS_STALE namespace layout changed or was removed; reload it'
  else
    out[i] = -1
  end
  if verdict == 'failed' or verdict == 'stale' then failed[a[1]] = true end
  if stream ~= '' and w.decides and verdict ~= 'apply' and verdict ~= 'done' then
    if not stopped[stream] or w.batch < stopped[stream] then stopped[stream] = w.batch end
  end
end
return out

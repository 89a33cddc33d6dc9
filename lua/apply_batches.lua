#!lua flags=allow-cross-slot-keys
--[[ apply_batches: apply several batches (each an ordered list of add/evict ops, fenced by its
  stream's watermark as in apply_batch.lua, or unfenced) in one atomic step: what an ingester
  sends for the engine batches queued for it, of one stream or of many, so that a one-block
  decode batch does not pay a whole call. Batches apply in order, each as apply_batch would
  apply it alone as one part: a fenced batch applies only if its (epoch, seq) is greater than
  its stream's stored watermark (as stored before this call, or as an earlier batch of the same
  stream in this call left it), and the watermark advances with it. Once a batch of a stream is
  not applied, the later batches of that stream in this call are not applied either (their
  sender sequences them again). Every batch's ops run through one write stage, so a chain run
  several batches extend is read and written once.
  KEYS[1]     <ns>:meta   KEYS[2] <ns>:pe   KEYS[3] <ns>:pi   KEYS[4] <ns>:pp   KEYS[5] <ns>:wm
  KEYS[6]     <ns>:sx (gate key of the expiring buckets: includes/expiry)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits                        ARGV[5] most request keys kept per engine key
  ARGV[6]     n, the number of encoded entries; ARGV[7..6+n] the entries (see includes/entries),
              shared by every batch
  ARGV[7+n]   b, the number of batches, then b batches, each:
                stream name ("" for an unfenced batch), epoch, seq (decimal integers >= -1,
                compared as decimal strings), token (hex: random, the same when the call is
                sent again), number of ops, the ops as in apply_batch.lua ("A", "P", "R", "E")
  Stored      <ns>:wm field stream = "epoch:seq:token" of the stream's last batch applied
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_LAYOUT for a malformed stored
              watermark or when the entry id space cannot hold the new entries, KVREDIS_BUDGET
              when the ops reach too many chain-run ranges (includes/writes: the client sends
              the batches one by one instead), WRONGTYPE for a foreign key in the namespace;
              all before the first write
  Returns     array of b integers: 1 if the batch applied (also when its token had already
              applied it: a resent call), 0 if skipped
  Complexity  sum of the applied ops' costs (see add.lua and evict.lua) plus one watermark read
              per stream; the client keeps every call within a fixed work budget ]]
--@include program
--@include fence
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], KEYS[6])
local cap = int_arg(ARGV[5], 'request keys per engine key', 1, 2147483647)
local ents, pos = read_entries(ARGV, 6)
local nbatches = int_arg(ARGV[pos], 'batch count', 0, #ARGV - pos)
pos = pos + 1
local tags = {A = true, R = true, E = true}
local batches = {}
for b = 1, nbatches do
  local stream, epoch, seq, token = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3]
  if type(stream) ~= 'string' then fail('INVALID', 'batch ' .. b .. ' has no stream name') end
  if stream ~= '' then fence_args(epoch, seq, token) end
  local nops = int_arg(ARGV[pos + 4], 'op count', 0, #ARGV - pos - 4)
  local ops
  ops, pos = read_ops(ARGV, pos + 5, nops, #ents, tags)
  batches[b] = {stream = stream, epoch = epoch, seq = seq, token = token, ops = ops}
end
if pos ~= #ARGV + 1 then fail('INVALID', (#ARGV + 1 - pos) .. ' arguments after the last batch') end
-- The fences, read (once per stream) and decided before any write.
local verdicts, ops, marks, stopped = {}, {}, {}, {}
for b, batch in ipairs(batches) do
  local stream, verdict = batch.stream, 'apply'
  if stream ~= '' then
    if stopped[stream] then
      verdict = 'skip'
    else
      local mark = marks[stream]
      if mark == nil then mark = redis.call('HGET', KEYS[5], stream) or false end
      verdict = fence_compare(mark or nil, batch.epoch, batch.seq, batch.token)
      if verdict == 'skip' then
        stopped[stream] = true
      else
        marks[stream] = batch.epoch .. ':' .. batch.seq .. ':' .. batch.token
      end
    end
  end
  verdicts[b] = verdict == 'skip' and 0 or 1
  if verdict == 'apply' then
    for _, op in ipairs(batch.ops) do ops[#ops + 1] = op end
  end
end
run_program(k, {ents = ents, ops = ops}, cap, 0)
for stream, mark in pairs(marks) do redis.call('HSET', KEYS[5], stream, mark) end
return verdicts

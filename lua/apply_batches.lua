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
  ARGV[7+n]   s, the number of streams, then s stream names
  ARGV[8+n+s] the batches, all in one binary string (includes/program, read_blob_batches):
              per batch its stream (0 for an unfenced batch), its mark "epoch:seq:token"
              (epoch, seq: decimal integers >= -1, compared as decimal strings; token: hex,
              random, the same when the call is sent again) and its ops ("A", "P", "R", "E",
              evicts of several keys in one op)
  Stored      <ns>:wm field stream = "epoch:seq:token" of the stream's last batch applied
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_LAYOUT for a malformed stored
              watermark or when the entry id space cannot hold the new entries, KVREDIS_BUDGET
              when the ops reach too many chain-run ranges or units of work (includes/writes:
              the client sends the batches one by one instead), WRONGTYPE for a foreign key in
              the namespace; all before the first write
  Returns     array of one integer per batch: 1 if the batch applied (also when its token had already
              applied it: a resent call), 0 if skipped
  Complexity  sum of the applied ops' costs (see add.lua and evict.lua) plus one watermark read
              per stream; the client keeps every call within a fixed work budget ]]
--@include program
--@include fence
keys_arg(KEYS, 6)
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], KEYS[6])
local cap = int_arg(ARGV[5], 'request keys per engine key', 1, 2147483647)
local ents, pos = read_entries(ARGV, 6)
local nstreams = int_arg(ARGV[pos], 'stream count', 0, #ARGV - pos)
local streams = {}
for s = 1, nstreams do
  streams[s] = {name = text_arg(ARGV[pos + s], 'stream name')}
end
pos = pos + nstreams + 1
if #ARGV ~= pos then
  fail('INVALID', 'expected the batches in argument ' .. pos .. ' and nothing after it')
end
local batches = read_blob_batches(ARGV[pos], #ents, nstreams)
-- The fences, read (once per stream) and decided before any write.
local verdicts, ops = {}, {}
for b, batch in ipairs(batches) do
  local st, verdict = streams[batch.stream], 'apply'
  if st then
    if st.stopped then
      verdict = 'skip'
    else
      if st.epoch == nil then
        local stored = redis.call('HGET', KEYS[5], st.name)
        st.epoch = false
        if stored then st.epoch, st.seq, st.token = mark_parts(stored) end
      end
      verdict = fence_order(st.epoch or nil, st.seq, st.token, batch.epoch, batch.seq, batch.token)
      if verdict == 'skip' then
        st.stopped = true
      else
        st.epoch, st.seq, st.token, st.mark = batch.epoch, batch.seq, batch.token, batch.mark
      end
    end
  end
  verdicts[b] = verdict == 'skip' and 0 or 1
  if verdict == 'apply' then
    for _, op in ipairs(batch.ops) do ops[#ops + 1] = op end
  end
end
run_program(k, {ents = ents, ops = ops}, cap, 0)
for _, st in ipairs(streams) do
  if st.mark then redis.call('HSET', KEYS[5], st.name, st.mark) end
end
return verdicts

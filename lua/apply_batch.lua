#!lua flags=allow-cross-slot-keys
--[[ apply_batch: apply an ordered list of add/evict ops, fenced by a per-stream watermark: the
  ops run only if the batch's (epoch, seq) is greater than the stored one, and the stored
  watermark advances in the same step. A batch too large for one call's work budget comes in
  parts (1..parts, in order, each its own call); part i applies only after parts 1..i-1 of the
  same batch (stream, epoch, seq, token) and the watermark advances with the last part only.
  Until then <ns>:wp records how far the batch got: a part sent again (its reply was lost) is
  recognised and not applied twice; the same batch sent again under another token (a publisher
  replaying it after a crash) starts over from part 1, which re-applies set operations only.
  KEYS[1]     <ns>:meta   KEYS[2] <ns>:pe   KEYS[3] <ns>:pi   KEYS[4] <ns>:pp   KEYS[5] <ns>:wm
  KEYS[6]     <ns>:wp     KEYS[7] <ns>:sx (gate key of the expiring buckets: includes/expiry)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits                        ARGV[5] most request keys kept per engine key
  ARGV[6]     stream name, "" for an unfenced batch
  ARGV[7]     epoch, ARGV[8] seq: decimal integers >= -1 (compared as decimal strings)
  ARGV[9]     token: random, the same for every part and every resend of this call (hex)
  ARGV[10]    part, ARGV[11] parts: this call's part number and the batch's number of parts
  ARGV[12]    n, the number of encoded entries; ARGV[13..12+n] the entries (see includes/entries)
  ARGV[13+n]  number of ops, then the ops, each one of
                "A", nent, nent x entry index, request keys (hash blob),
                     engine/request key pairs (hash blob: engine key, request key, ...)
                "P", 8-byte parent key, then as "A" (the keys follow the parent key in their
                     chain: they may join its run, includes/writes)
                "R", 8-byte request key, nent, nent x entry index
                "E", 8-byte engine key, first, nent, nent x entry index
              (entry indexes are 1-based into the entries above)
  Stored      <ns>:wm field stream = "epoch:seq:token"; <ns>:wp field stream =
              "epoch:seq:token:part" while a batch in parts is under way
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_LAYOUT for a malformed stored
              watermark or when the entry id space cannot hold the new entries, KVREDIS_BUDGET
              when the ops (more than one, one add op of several request keys, or one evict by
              engine key) reach too many chain-run ranges (includes/writes: the client splits
              the part and numbers the batch's parts anew under the same token), WRONGTYPE for
              a foreign key in the namespace; all before the first write
  Returns     1 if applied (also when this token already applied it), 0 if skipped (the stream
              already reached this watermark, or another sender took the batch over)
  Complexity  sum of the ops' costs (see add.lua and evict.lua); the client keeps every call
              within a fixed work budget ]]
--@include program
--@include fence
keys_arg(KEYS, 7)
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], KEYS[7])
local cap = int_arg(ARGV[5], 'request keys per engine key', 1, 2147483647)
local stream, epoch, seq, token = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local parts = int_arg(ARGV[11], 'parts', 1, 2147483647)
local part = int_arg(ARGV[10], 'part', 1, parts)
if stream ~= '' then fence_args(epoch, seq, token) end
local program = read_program(ARGV, 12, nil, {A = true, R = true, E = true})
if stream ~= '' then
  local verdict = fence_open(KEYS[5], KEYS[6], stream, epoch, seq, token, part, parts)
  if verdict == 'skip' then return 0 end
  if verdict == 'done' then return 1 end
end
run_program(k, program, cap, 0)
if stream ~= '' then fence_close(KEYS[5], KEYS[6], stream, epoch, seq, token, part, parts) end
return 1

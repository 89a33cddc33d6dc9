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
  KEYS[6]     <ns>:wp     KEYS[7] <ns>:sx (speculative entries' deadlines: includes/expiry)
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
                "R", 8-byte request key, nent, nent x entry index
                "E", 8-byte engine key, nent, nent x entry index
              (entry indexes are 1-based into the entries above)
  Stored      <ns>:wm field stream = "epoch:seq:token"; <ns>:wp field stream =
              "epoch:seq:token:part" while a batch in parts is under way
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_LAYOUT for a malformed stored
              watermark or when the entry id space cannot hold the new entries, WRONGTYPE for a
              foreign key in the namespace; all before the first write
  Returns     1 if applied (also when this token already applied it), 0 if skipped (the stream
              already reached this watermark, or another sender took the batch over)
  Complexity  sum of the ops' costs (see add.lua and evict.lua); the client keeps every call
              within a fixed work budget ]]
--@include program

-- A decimal integer string without leading zeros (the form Python's str(int) gives).
local function dec_arg(value, what)
  if type(value) ~= 'string' or not (value == '0' or string.find(value, '^%-?[1-9]%d*$')) then
    fail('INVALID', what .. ' must be a decimal integer, got ' .. tostring(value))
  end
  return value
end

-- Compare two decimal integer strings (optional leading "-", no leading zeros).
local function cmp_dec(a, b)
  local na, nb = string.sub(a, 1, 1) == '-', string.sub(b, 1, 1) == '-'
  if na ~= nb then return na and -1 or 1 end
  local sign = 1
  if na then
    sign = -1
    a, b = string.sub(a, 2), string.sub(b, 2)
  end
  if #a ~= #b then return (#a < #b and -1 or 1) * sign end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return (x < y and -1 or 1) * sign end
  end
  return 0
end

check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4])
local cap = int_arg(ARGV[5], 'request keys per engine key', 1, 2147483647)
local stream, epoch, seq, token = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local parts = int_arg(ARGV[11], 'parts', 1, 2147483647)
local part = int_arg(ARGV[10], 'part', 1, parts)
if stream ~= '' then
  dec_arg(epoch, 'epoch')
  dec_arg(seq, 'seq')
  if type(token) ~= 'string' or not string.find(token, '^%x+$') then
    fail('INVALID', 'token must be hex digits, got ' .. tostring(token))
  end
end
local program = read_program(ARGV, 12, nil, {A = true, R = true, E = true})
local mark = epoch .. ':' .. seq
if stream ~= '' then
  local stored = redis.call('HGET', KEYS[5], stream)
  if stored then
    local colon = string.find(stored, ':', 1, true)
    if not colon then fail('LAYOUT', 'malformed watermark ' .. stored) end
    local rest = string.sub(stored, colon + 1)
    local colon2 = string.find(rest, ':', 1, true)
    local stored_seq = colon2 and string.sub(rest, 1, colon2 - 1) or rest
    local c = cmp_dec(epoch, string.sub(stored, 1, colon - 1))
    if c == 0 then c = cmp_dec(seq, stored_seq) end
    if c < 0 then return 0 end
    -- The same watermark: applied already, by this very call (a lost reply) or by another.
    if c == 0 then return (colon2 and string.sub(rest, colon2 + 1) == token) and 1 or 0 end
  end
  if parts > 1 then
    local pending = redis.call('HGET', KEYS[6], stream)
    local done = 0
    local prefix = mark .. ':' .. token .. ':'
    if pending and string.sub(pending, 1, #prefix) == prefix then
      done = tonumber(string.sub(pending, #prefix + 1)) or 0
    end
    if part <= done then return 1 end
    if part ~= done + 1 then return 0 end
  end
end
run_program(k, program, cap, {sx = KEYS[7], ms = 0, now = now_ms()})
if stream ~= '' then
  if part == parts then
    redis.call('HSET', KEYS[5], stream, mark .. ':' .. token)
    if parts > 1 then redis.call('HDEL', KEYS[6], stream) end
  else
    redis.call('HSET', KEYS[6], stream, mark .. ':' .. token .. ':' .. part)
  end
end
return 1

#!lua flags=allow-cross-slot-keys
--[[ apply_batch: apply an ordered list of add/evict ops atomically, fenced by a per-stream
  watermark: the ops run only if the batch's (epoch, seq) is greater than the stored one, and the
  stored watermark advances in the same step.
  KEYS[1]     <ns>:meta   KEYS[2] <ns>:pe   KEYS[3] <ns>:pi   KEYS[4] <ns>:pp   KEYS[5] <ns>:wm
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits                        ARGV[5] most request keys kept per engine key
  ARGV[6]     stream name, "" for an unfenced batch
  ARGV[7]     epoch, ARGV[8] seq: decimal integers >= -1 (compared as decimal strings)
  ARGV[9]     n, the number of encoded entries; ARGV[10..9+n] the entries (see includes/entries)
  ARGV[10+n]  number of ops, then the ops, each one of
                "A", nent, nent x entry index, request keys (hash blob),
                     engine/request key pairs (hash blob: engine key, request key, ...)
                "R", 8-byte request key, nent, nent x entry index
                "E", 8-byte engine key, nent, nent x entry index
              (entry indexes are 1-based into the entries above)
  Stored      <ns>:wm field stream = "epoch:seq"
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_LAYOUT for a malformed stored
              watermark or when the entry id space cannot hold the new entries; all before the
              first write
  Returns     1 if applied, 0 if skipped (the stream already reached this watermark)
  Complexity  sum of the ops' costs (see add.lua and evict.lua) ]]
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
local stream, epoch, seq = ARGV[6], ARGV[7], ARGV[8]
if stream ~= '' then
  dec_arg(epoch, 'epoch')
  dec_arg(seq, 'seq')
end
local program = read_program(ARGV, 9, nil, {A = true, R = true, E = true})
if stream ~= '' then
  local stored = redis.call('HGET', KEYS[5], stream)
  if stored then
    local colon = string.find(stored, ':', 1, true)
    if not colon then fail('LAYOUT', 'malformed watermark ' .. stored) end
    local c = cmp_dec(epoch, string.sub(stored, 1, colon - 1))
    if c == 0 then c = cmp_dec(seq, string.sub(stored, colon + 1)) end
    if c <= 0 then return 0 end
  end
end
run_program(k, program, cap)
if stream ~= '' then redis.call('HSET', KEYS[5], stream, epoch .. ':' .. seq) end
return 1

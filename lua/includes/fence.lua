--[[ fence: the per-stream watermark of apply_batch.lua: whether a call applies a batch (or one
  of its parts), and the watermark advancing with the batch's last part (see apply_batch.lua for
  the protocol and what <ns>:wm and <ns>:wp hold). ]]
--@include args

-- A decimal integer string without leading zeros (the form Python's str(int) gives).
local function dec_arg(value, what)
  if type(value) ~= 'string' or not (value == '0' or string.find(value, '^%-?[1-9]%d*$')) then
    fail('INVALID', what .. ' must be a decimal integer, got ' .. tostring(value))
  end
  return value
end

-- Compare two decimal integer strings (optional leading "-", no leading zeros): -1, 0 or 1.
-- Numbers of one sign and length compare as strings (byte order is digit order).
local function cmp_dec(a, b)
  if a == b then return 0 end
  local na, nb = string.byte(a, 1) == 45, string.byte(b, 1) == 45
  if na ~= nb then return na and -1 or 1 end
  local sign = na and -1 or 1
  if #a ~= #b then return (#a < #b and -1 or 1) * sign end
  return (a < b and -1 or 1) * sign
end

-- Check the fence of a fenced call (stream ~= ''): epoch, seq and token.
local function fence_args(epoch, seq, token)
  dec_arg(epoch, 'epoch')
  dec_arg(seq, 'seq')
  if type(token) ~= 'string' or not string.find(token, '^%x+$') then
    fail('INVALID', 'token must be hex digits, got ' .. tostring(token))
  end
end

-- A stored watermark "epoch:seq[:token]" taken apart: epoch, seq, token (nil when absent);
-- fails KVREDIS_LAYOUT when malformed.
local function mark_parts(stored)
  local colon = string.find(stored, ':', 1, true)
  if not colon then fail('LAYOUT', 'malformed watermark ' .. stored) end
  local colon2 = string.find(stored, ':', colon + 1, true)
  if colon2 then
    return string.sub(stored, 1, colon - 1), string.sub(stored, colon + 1, colon2 - 1),
      string.sub(stored, colon2 + 1)
  end
  return string.sub(stored, 1, colon - 1), string.sub(stored, colon + 1), nil
end

-- How a batch (epoch, seq, token) compares with a watermark taken apart (mark_parts; epoch nil:
-- none stored): 'apply' (the batch is newer), 'done' (this very token stored it: a lost reply) or
-- 'skip' (the stream is at or past the batch, applied by another call).
local function fence_order(stored_epoch, stored_seq, stored_token, epoch, seq, token)
  if not stored_epoch then return 'apply' end
  local c = cmp_dec(epoch, stored_epoch)
  if c == 0 then c = cmp_dec(seq, stored_seq) end
  if c < 0 then return 'skip' end
  if c > 0 then return 'apply' end
  -- The same watermark: applied already, by this very call (a lost reply) or by another.
  return stored_token == token and 'done' or 'skip'
end

-- fence_order against a stored watermark string (nil: none stored).
local function fence_compare(stored, epoch, seq, token)
  if not stored then return 'apply' end
  local se, ss, stoken = mark_parts(stored)
  return fence_order(se, ss, stoken, epoch, seq, token)
end

-- Whether part `part` of `parts` of the batch (epoch, seq, token) applies: 'apply', 'done' (this
-- very call applied it already: a lost reply) or 'skip' (the stream is at or past the batch, or
-- another sender took it over).
local function fence_open(wm_key, wp_key, stream, epoch, seq, token, part, parts)
  local verdict = fence_compare(redis.call('HGET', wm_key, stream), epoch, seq, token)
  if verdict ~= 'apply' then return verdict end
  if parts > 1 then
    local pending = redis.call('HGET', wp_key, stream)
    local done = 0
    local prefix = epoch .. ':' .. seq .. ':' .. token .. ':'
    if pending and string.sub(pending, 1, #prefix) == prefix then
      done = tonumber(string.sub(pending, #prefix + 1)) or 0
    end
    if part <= done then return 'done' end
    if part ~= done + 1 then return 'skip' end
  end
  return 'apply'
end

-- After part `part` applied: the watermark advances with the last part; until then <ns>:wp
-- records how far the batch got.
local function fence_close(wm_key, wp_key, stream, epoch, seq, token, part, parts)
  local mark = epoch .. ':' .. seq
  if part == parts then
    redis.call('HSET', wm_key, stream, mark .. ':' .. token)
    if parts > 1 then redis.call('HDEL', wp_key, stream) end
  else
    redis.call('HSET', wp_key, stream, mark .. ':' .. token .. ':' .. part)
  end
end

--[[ args: total checks of a call's keys and arguments; each returns the checked value or fails
  KVREDIS_INVALID naming what was wrong, whatever the input (a missing argument, any bytes):
  a malformed call never reaches a Lua error or a long loop. ]]
--@include errors

-- A value as a short printable text, for error messages.
local function shown(value)
  if type(value) ~= 'string' then return tostring(value) end
  if #value > 40 then value = string.sub(value, 1, 40) .. '...' end
  return string.format('%q', value)
end

-- An integer given in decimal (optional '-', digits only: no sign '+', spaces, hex, exponent,
-- inf or nan), in [min, max].
local function int_arg(value, what, min, max)
  local n = nil
  if type(value) == 'string' and #value <= 20 and string.find(value, '^%-?%d+$') then
    n = tonumber(value)
  elseif type(value) == 'number' and value == math.floor(value) then
    n = value
  end
  if not n or n < min or n > max then
    fail('INVALID', what .. ' must be an integer in [' .. string.format('%.0f', min) .. ', '
      .. string.format('%.0f', max) .. '], got ' .. shown(value))
  end
  return n
end

-- A decimal number ("1.0", "-0.5", "1e+300", "%.17g" text): finite, or with infinite_ok also
-- "inf" and "-inf" (what "%.17g" gives for an infinite double); never nan, hex or spaces.
local function num_arg(value, what, infinite_ok)
  local n = nil
  if type(value) == 'string' and #value <= 64 then
    if string.find(value, '^%-?%d*%.?%d*[eE]?[%-+]?%d*$') and string.find(value, '^%-?%.?%d') then
      n = tonumber(value)
    elseif infinite_ok and (value == 'inf' or value == '-inf') then
      n = value == 'inf' and math.huge or -math.huge
    end
  end
  if not n or n ~= n or (not infinite_ok and (n == math.huge or n == -math.huge)) then
    fail('INVALID', what .. ' must be a ' .. (infinite_ok and '' or 'finite ')
      .. 'decimal number, got ' .. shown(value))
  end
  return n
end

-- A non-empty string.
local function text_arg(value, what)
  if type(value) ~= 'string' or value == '' then
    fail('INVALID', what .. ' must be a non-empty string, got ' .. shown(value))
  end
  return value
end

-- A string of fixed-width items (hash blob, id list); with count, exactly that many items.
local function blob_arg(value, width, what, count)
  if type(value) ~= 'string' or #value % width ~= 0 or (count and #value ~= count * width) then
    fail('INVALID', what .. ' must be ' .. (count or 'n') .. ' x ' .. width .. ' bytes, got '
      .. (type(value) == 'string' and #value .. ' bytes' or tostring(value)))
  end
  return value
end

-- The call's keys (a script passes its own): exactly n, or with more at least n.
local function keys_arg(keys, n, more)
  if #keys < n or (not more and #keys > n) then
    fail('INVALID', (more and 'at least ' or '') .. n .. ' keys expected, got ' .. #keys)
  end
  return keys
end

-- A pod filter given as f, then f pod ids, from position at of args (a script passes its own
-- arguments): returns the pod ids (nil for f = 0: every pod) and the position after them.
local function pod_filter_arg(args, at)
  local nf = int_arg(args[at], 'pod count', 0, math.max(0, #args - at))
  if nf == 0 then return nil, at + 1 end
  local pods = {}
  for i = 1, nf do
    local pod = args[at + i]
    if type(pod) ~= 'string' then fail('INVALID', 'pod id ' .. i .. ' of the filter is missing') end
    pods[i] = pod
  end
  return pods, at + 1 + nf
end

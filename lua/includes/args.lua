--[[ args: checks of script arguments; each returns the checked value or fails KVREDIS_INVALID. ]]
--@include errors

-- An integer given in decimal, in [min, max].
local function int_arg(value, what, min, max)
  local n = tonumber(value)
  if not n or n ~= math.floor(n) or n < min or n > max then
    fail('INVALID', what .. ' must be an integer in [' .. min .. ', ' .. max .. '], got '
      .. tostring(value))
  end
  return n
end

-- A non-empty string.
local function text_arg(value, what)
  if type(value) ~= 'string' or value == '' then
    fail('INVALID', what .. ' must be a non-empty string, got ' .. tostring(value))
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

-- A pod filter given as f, then f pod ids, from position at of args (a script passes its own
-- arguments): returns the pod ids (nil for f = 0: every pod) and the position after them.
local function pod_filter_arg(args, at)
  local nf = int_arg(args[at], 'pod count', 0, #args - at)
  if nf == 0 then return nil, at + 1 end
  local pods = {}
  for i = 1, nf do
    local pod = args[at + i]
    if type(pod) ~= 'string' then fail('INVALID', 'pod id ' .. i .. ' of the filter is missing') end
    pods[i] = pod
  end
  return pods, at + 1 + nf
end

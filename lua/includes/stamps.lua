--[[ stamps: what keeps a read in parts true. A chain longer than one call is read (looked up,
  scored) in several calls, and writes come between them; merging the parts must never credit a
  pod with keys it did not hold all at once. A write that only adds cannot do that (what an
  earlier part read is still held when a later part reads), so only what takes a pod's entries
  away leaves a trace, once per call and pod:
    <ns>:meta field removals         the namespace's removal sequence (only grows)
    <ns>:meta field removed:<pod>    removals' value at the pod's latest write that removed one
                                     of its entries (an evict, a confirmation replacing its
                                     speculative entries, a speculative entry given a deadline
                                     or an earlier one), "c" and such a value while a clear of
                                     the pod is under way (retire.lua to reclaim.lua)
    <ns>:meta field cleared          grows when a clear ends and removed:<pod> is deleted
  Expiring entries leave without a write: a read records the earliest deadline of the pod's live
  expiring entries it returned.
  A stamp (text) is a pod's state as one call read it: "<version>@<deadline>", the version the
  pod's removed:<pod> ("g<cleared>" without the field; no stamp during a clear), the deadline
  in server ms, "" when the read returned no expiring entry of the pod; "" is no stamp. A later
  call checks a stamp: it holds while the pod's version is the same and the deadline is ahead,
  so no entry of the pod an earlier part read has left since: the pod held what every part read
  at once, at the time of the latest. ]]
--@include entries

local STAMP_PREFIX = 'removed:'

-- pod -> its version as a stamp without deadline ("<version>@"; false during a clear), for the
-- pods of the array pods: one HMGET of meta.
local function stamp_versions(meta, pods)
  local out = {}
  if #pods == 0 then return out end
  local fields = {'cleared'}
  for i = 1, #pods do fields[i + 1] = STAMP_PREFIX .. pods[i] end
  local got = hmget(meta, fields)
  local absent = 'g' .. (got[1] or '0') .. '@'
  for i = 1, #pods do
    local v = got[i + 1]
    if not v then
      v = absent
    elseif string.sub(v, 1, 1) == 'c' then
      v = false
    else
      v = v .. '@'
    end
    out[pods[i]] = v
  end
  return out
end

-- The deadline of a stamp: nil when it has none, false when the stamp is malformed.
local function stamp_deadline(stamp)
  local at = string.find(stamp, '@', 1, true)
  if not at or at == 1 then return false end
  if at == #stamp then return nil end
  local deadline = tonumber(string.sub(stamp, at + 1))
  if not deadline or deadline ~= deadline then return false end
  return deadline
end

-- Whether a carried stamp still holds, given the pod's version now (as stamp_versions gives it)
-- and the server clock now (ms; a function, asked only when the stamp has a deadline). Fails
-- KVREDIS_INVALID for a stamp no function made.
local function stamp_holds(stamp, version, now)
  if stamp == '' then return false end
  if version and stamp == version then return true end  -- the same version, no deadline
  local deadline = stamp_deadline(stamp)
  if deadline == false then fail('INVALID', 'malformed stamp ' .. tostring(stamp)) end
  if not version or string.sub(stamp, 1, #version) ~= version then return false end
  return deadline ~= nil and deadline > now()
end

-- A stamp of a pod at version (as stamp_versions gives it; false: none, "") whose returned
-- expiring entries end at the earliest at deadline (nil: none), kept no later than the carried
-- stamp's deadline (carried: nil for a pod new to the read).
local function stamp_make(version, deadline, carried)
  if not version then return '' end
  if carried and carried ~= version then
    local before = stamp_deadline(carried)
    if before and (not deadline or before < deadline) then deadline = before end
  end
  if not deadline then return version end
  return version .. string.format('%.0f', deadline)
end

-- The server clock in ms, asked once, on first use.
local function clock()
  local now = nil
  return function()
    if not now then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    return now
  end
end

-- Write path: note the entries (encodings) whose copies a call removes, into the set marks.
local function stamp_mark(marks, ents, indexes)
  for i = 1, #indexes do marks[ents[indexes[i]]] = true end
end

-- The next value of a counter field of meta (read and written with HGET and HSET, which every
-- role that writes may run).
local function stamp_next(meta, field)
  return tonumber(redis.call('HGET', meta, field) or '0') + 1
end

-- Write path, once per call after its writes: a new version for every pod of the entries in
-- marks (a set of encodings, see stamp_mark). Nothing when marks is empty.
local function stamp_removals(meta, marks)
  if next(marks) == nil then return end
  local n = string.format('%.0f', stamp_next(meta, 'removals'))
  local pods = {}
  for enc in pairs(marks) do pods[entry_pod(enc)] = true end
  local args = {'removals', n}
  for pod in pairs(pods) do
    args[#args + 1] = STAMP_PREFIX .. pod
    args[#args + 1] = n
  end
  hset(meta, args)
end

-- A clear of the pod begins (retire.lua): no stamp of it holds until it ends.
local function stamp_clearing(meta, pod)
  local n = string.format('%.0f', stamp_next(meta, 'removals'))
  redis.call('HSET', meta, 'removals', n, STAMP_PREFIX .. pod, 'c' .. n)
end

-- A clear of the pod ended (reclaim.lua): its field goes; every stamp of a pod without one
-- changes with cleared, so a stamp read before the field went never holds after it.
local function stamp_cleared(meta, pod)
  if redis.call('HDEL', meta, STAMP_PREFIX .. pod) == 1 then
    redis.call('HSET', meta, 'cleared', string.format('%.0f', stamp_next(meta, 'cleared')))
  end
end

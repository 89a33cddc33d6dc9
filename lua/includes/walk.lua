--[[ walk: the read path of lookup and score: a chain of request keys, in order, to the first key
  no entry holds. A key stored inline costs one HGET; a key held through a run (includes/runs)
  costs one HGET and one HMGET of the run, after which the run's following keys are compared
  with the chain's following keys as bytes and their entry ids are read from the run's ranges,
  without a call per key. The walk is exact: a key counts as held only where its own record
  (inline ids, or the run position its ref names) holds ids, or where it holds live expiring
  entries (includes/expiry; a key held only by those has no request-bucket record). While an
  expiring entry may be live (the gate key exists), every key also costs one HGET of its
  expiring bucket, run keys included; otherwise a run costs one call whatever its length. ]]
--@include runs
--@include expiry

-- The most run work (ranges parsed, RUN_READ_COST more per run) one walk does: past it the walk
-- stops before the key whose run would exceed it, once at least one key was walked, and says
-- so (the client walks on from there in its next call). One run always fits.
local WALK_WORK_LIMIT = 8192

-- Read path: nil while no expiring entry can be live (the gate key sx is absent: one EXISTS per
-- call), else a function (h, ids) -> the ids of request key h: ids (its request-bucket list, or
-- nil) followed by its expiring ids that are not past due; nil when it holds none. With
-- deadlines (a table), it also records there, per expiring id returned, its earliest deadline
-- (includes/stamps).
local function expiring_reader(sx, bits, deadlines)
  if redis.call('EXISTS', sx) == 0 then return nil end
  local x = expiry_items()
  local item_deadline = x.item_deadline
  local now = x.now_ms()
  local sbucket = expiring_namer(sx, bits)
  return function(h, ids)
    local items = redis.call('HGET', sbucket(h), h)
    if not items then return ids end
    local live = {}
    for j = 1, #items, ITEM_WIDTH do
      local d = item_deadline(items, j)
      if d > now then
        local id = string.sub(items, j, j + ID_WIDTH - 1)
        live[#live + 1] = id
        if deadlines then
          local before = deadlines[id]
          if not before or d < before then deadlines[id] = d end
        end
      end
    end
    if #live == 0 then return ids end
    return (ids or '') .. table.concat(live)
  end
end

-- Whether the run's keys (keys blob) from byte a + 1 equal the chain's from byte b + 1, over len
-- bytes. The run's span is found in the chain in place (plain string.find anchored where it must
-- start): only the run's side is cut out as a new string, and not even that when the span is
-- the run's whole key list (the common case: a chain entering a run at its first key and going
-- past its end). Lua hashes every byte of every new string, so cutting both sides would cost
-- two such hashes per run. The needle is the run's own keys (stored by writers), never the
-- caller's chain, so a mismatch at b + 1 costs one pass of memchr over the chain's rest.
local function span_equal(keys, a, chain, b, len)
  local needle = (a == 0 and len == #keys) and keys or string.sub(keys, a + 1, a + len)
  return string.find(chain, needle, b + 1, true) == b + 1
end

-- How many keys of the run (keys blob) from position pos equal the chain's keys from index i
-- (both 1-based), at most limit: one comparison when the whole span matches. Else the first
-- differing key is searched from the matched prefix on, each step comparing only keys not yet
-- known to match: spans doubling in length until one differs, then halving inside it. The
-- bytes compared (and cut out: span_equal) stay about twice the matched keys, whereas spans
-- from the start would hash the matched prefix again at every step.
local function run_match(keys, pos, chain, i, limit)
  local a, b = (pos - 1) * HASH_WIDTH, (i - 1) * HASH_WIDTH
  if span_equal(keys, a, chain, b, limit * HASH_WIDTH) then return limit end
  local lo, hi = 0, limit - 1   -- lo keys match for sure, hi at most
  local step = 1
  while lo < hi do
    local n, from = math.min(step, hi - lo), lo * HASH_WIDTH
    if not span_equal(keys, a + from, chain, b + from, n * HASH_WIDTH) then
      hi = lo + n - 1
      break
    end
    lo = lo + n
    step = step * 2
  end
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    local from = lo * HASH_WIDTH
    if span_equal(keys, a + from, chain, b + from, mid * HASH_WIDTH - from) then
      lo = mid
    else
      hi = mid - 1
    end
  end
  return lo
end

-- Walk the chain (hash blob). rbucket names request buckets, cprefix is the run key prefix.
-- expiring is nil or the reader of the expiring entries (expiring_reader above),
-- a function (h, ids or nil) -> ids or nil: with it, every key's ids are its request-bucket or
-- run ids followed by its live expiring ids, and a key without any record of its own is still
-- a hit when it holds live expiring ids; without it (no expiring entry can be live), keys of
-- one run range are visited together.
-- visit(ids, n) is called for each group of n consecutive chain keys holding the same
-- (non-empty) ids, in order; it returns false to stop the walk. Returns the position of the
-- first key not walked when the walk stopped at WALK_WORK_LIMIT, else nil. spent (optional)
-- is {work = n}, shared by the walks of one call so that their work adds up.
local function walk_chain(chain, rbucket, cprefix, expiring, visit, spent)
  local nkeys = #chain / HASH_WIDTH
  local runs = {}
  spent = spent or {work = 0}
  local i = 1
  -- A key without ids of its own (no record, or a ref that does not resolve): a hit only
  -- through its live expiring ids.
  local function own_only(h)
    local ids = expiring and expiring(h, nil)
    return ids and ids ~= '' and visit(ids, 1)
  end
  while i <= nkeys do
    local at = (i - 1) * HASH_WIDTH
    local h = string.sub(chain, at + 1, at + HASH_WIDTH)
    local v = redis.call('HGET', rbucket(h), h)
    if not v or not is_ref(v) then
      if expiring then v = expiring(h, v) end
      if not v or v == '' or not visit(v, 1) then return end
      i = i + 1
    else
      local rid, pos = ref_parse(v)
      local run = runs[rid]
      if run == nil then
        local rec = redis.call('HMGET', cprefix .. rid, 'k', 'r')
        run = false
        if rec[1] and rec[2] then
          local ranges = ranges_parse(rec[2])
          if ranges then run = {keys = rec[1], ranges = ranges} end
          spent.work = spent.work + RUN_READ_COST + (ranges and #ranges or 0)
          if spent.work > WALK_WORK_LIMIT and i > 1 then return i end
        end
        runs[rid] = run
      end
      local n, r = 0, nil
      if run then
        local limit = math.min(#run.keys / HASH_WIDTH - pos + 1, nkeys - i + 1)
        n = limit > 0 and run_match(run.keys, pos, chain, i, limit) or 0
        r = n > 0 and range_at(run.ranges, pos)
      end
      local p, last = pos, pos + n - 1
      while r and p <= last do
        local rg = run.ranges[r]
        local ids = rg.ids
        -- a hole: the key is not held through this run (it may be held on its own)
        if ids == '' then break end
        local e = math.min(rg.e, last)
        if expiring then
          for q = p, e do
            local kq = string.sub(run.keys, (q - 1) * HASH_WIDTH + 1, q * HASH_WIDTH)
            if not visit(expiring(kq, ids), 1) then return end
          end
        elseif not visit(ids, e - p + 1) then
          return
        end
        p = e + 1
        r = r + 1
      end
      if p == pos then
        -- the ref names no held position of a run matching the chain here
        if not own_only(h) then return end
        i = i + 1
      else
        i = i + (p - pos)
      end
    end
  end
end

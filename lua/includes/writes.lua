--[[ writes: the index writes on request and engine buckets (set semantics, idempotent), staged.
  Every function reads and writes through a staging area `st` (new_stage): reads see the staged
  values, writes only stage. A script reads everything it needs first, so a foreign key of the
  wrong type fails the call (WRONGTYPE) before anything is written; flush_stage then writes. ]]
--@include runs
--@include id_lists

-- A staging area: per bucket kind (r, e) the values read or staged by field (a field names its
-- bucket, so the field alone is the key), and per kind the (bucket, field) pairs read, in order
-- (rorder, eorder: bucket, field, ...), with the values read (rorig, eorig) and their counts. A
-- request key held through a run reads as the ids of its run position (where: field -> its
-- ref); runs: run id -> {ranges, n, changes = position -> ids, keys once read} or false;
-- prev: field -> the request key before it in the add op that first stored it (new keys only);
-- chain: new first keys of add ops whose parent key (held) they follow;
-- spent.work: the run ranges read so far by the call (spent may be shared by the stages of
-- one call), each run counting RUN_READ_COST more; limit: the most work allowed (nil: no
-- limit); op, key: how many ops, and keys of the op after them, the caller (includes/program)
-- has staged whole.
local function new_stage(cprefix, limit, spent)
  return {r = {}, e = {}, rorder = {}, rorig = {}, nr = 0, eorder = {}, eorig = {}, ne = 0,
          where = {}, runs = {}, prev = {}, chain = {}, cprefix = cprefix,
          spent = spent or {work = 0}, limit = limit, op = 0, key = 0}
end

-- The most run work (ranges read, see new_stage) of a call the client can split: a run is
-- read, parsed and rewritten whole, so this bounds what the runs a call reaches cost (about
-- 1.4 us per range on a small machine). One run (at most RUN_MAX ranges) always fits.
local RUN_WORK_LIMIT = 4096

-- Count units of work a call does besides reading runs (the request keys an evict by engine
-- key reaches, the mapping lists rewritten) into the stage's work; fails KVREDIS_BUDGET, before
-- any write, past the stage's work limit (as stage_run does for runs).
local function stage_work(st, units)
  local spent = st.spent
  spent.work = spent.work + units
  if st.limit and spent.work > st.limit then
    fail('BUDGET', st.op .. ' ' .. st.key .. ' the ops reach more than ' .. st.limit ..
      ' units of work in all; send fewer ops or keys per call')
  end
end

-- The run rid as staged (read on first use), or false when absent or malformed. Only the
-- ranges are read: the keys (a long string) are read by run_keys when a write needs them, or
-- with the ranges when keys_too (a caller that will likely extend the run: one call, not two).
-- Fails KVREDIS_BUDGET, before any write, once the runs read exceed the stage's work limit;
-- the message starts with the ops and keys staged whole (st.op, st.key), which fit a call.
local function stage_run(st, rid, keys_too)
  local run = st.runs[rid]
  if run == nil then
    run = false
    local key = st.cprefix .. rid
    local r, keys
    if keys_too then
      local both = redis.call('HMGET', key, 'r', 'k')
      r, keys = both[1], both[2]
    else
      r = redis.call('HGET', key, 'r')
    end
    local ranges = r and ranges_parse(r)
    local spent = st.spent
    spent.work = spent.work + RUN_READ_COST + (ranges and #ranges or 0)
    if st.limit and spent.work > st.limit then
      fail('BUDGET', st.op .. ' ' .. st.key .. ' the keys reach chain runs of more than ' ..
        st.limit .. ' ranges in all; send fewer ops or keys per call')
    end
    local n = ranges and #ranges > 0 and ranges[#ranges].e or 0
    if keys_too then
      if n > 0 and keys and #keys == n * HASH_WIDTH then
        run = {ranges = ranges, n = n, changes = {}, keys = keys}
      end
    elseif n > 0 and redis.call('HSTRLEN', key, 'k') == n * HASH_WIDTH then
      run = {ranges = ranges, n = n, changes = {}}
    end
    st.runs[rid] = run
  end
  return run
end

-- The request keys of a staged run (hash blob), read on first use.
local function run_keys(st, rid, run)
  local keys = run.keys
  if keys == nil then
    keys = redis.call('HGET', st.cprefix .. rid, 'k')
    run.keys = keys
  end
  return keys
end

-- The staged value of a field (read on first use); a request key held through a run reads as
-- its position's ids (its run read with its keys when keys_too: see stage_run).
local function stage_get(st, kind, bucket, field, keys_too)
  local values = st[kind]
  local v = values[field]
  if v == nil then
    v = redis.call('HGET', bucket, field) or false
    local n
    if kind == 'r' then
      if v and #v == REF_WIDTH then
        local ref = v
        local rid, pos = ref_parse(ref)
        local run = stage_run(st, rid, keys_too)
        local r = run and pos >= 1 and range_at(run.ranges, pos)
        v = false
        if r and run.ranges[r].ids ~= '' then
          v = run.ranges[r].ids
          st.where[field] = ref
        end
      end
      n = st.nr + 1
      st.nr = n
      st.rorder[2 * n - 1], st.rorder[2 * n], st.rorig[n] = bucket, field, v
    else
      n = st.ne + 1
      st.ne = n
      st.eorder[2 * n - 1], st.eorder[2 * n], st.eorig[n] = bucket, field, v
    end
    values[field] = v
  end
  return v
end

-- Stage a value (false deletes the field); the field must have been read with stage_get.
local function stage_put(st, kind, bucket, field, value)
  st[kind][field] = value
end

-- The ranges of consecutive positions from first of the id lists values[1..n].
local function ranges_of(values, first)
  local out = {}
  for j, ids in ipairs(values) do ranges_push(out, first + j - 1, ids) end
  return out
end

-- Everything flush_stage writes, computed without writing: changed runs, new keys grouped into
-- runs (a new key follows the key before it in its add op, or the op's parent key, when that
-- key ends a group or a run; groups of fewer than RUN_MIN keys extending no run stay inline,
-- unless they continue a stored chain: their op's parent key is held, so the chain's later
-- appends have a run to join; a group extending a run of more than RUN_APPEND_MAX keys by
-- fewer than 1/RUN_APPEND_SHARE of them becomes a run of its own after it), run ids allocated
-- from <ns>:meta next_run (KVREDIS_LAYOUT when exhausted), and the bucket of every changed
-- request key (bucket: field -> bucket key name). k holds meta.
local function plan_stage(st, k)
  local order, orig, r, where = st.rorder, st.rorig, st.r, st.where
  local bucket = {}
  local plan = {inline = {}, unref = {}, groups = {}, nruns = 0, bucket = bucket}
  local fresh = nil
  for n = 1, st.nr do
    local field = order[2 * n]
    local value = r[field]
    local was = orig[n]
    if value ~= was then
      bucket[field] = order[2 * n - 1]
      local w = where[field]
      if w then
        local rid, pos = ref_parse(w)
        st.runs[rid].changes[pos] = value or ''
        if not value then plan.unref[#plan.unref + 1] = field end
      elseif value and not was then
        fresh = fresh or {}
        fresh[#fresh + 1] = field
      else
        plan.inline[#plan.inline + 1] = field
      end
    end
  end
  for _, run in pairs(st.runs) do
    if run and next(run.changes) then
      run.ranges, run.newn = ranges_trim(ranges_apply(run.ranges, run.changes))
    end
  end
  -- A key alone so far is its own group_of marker (no table): most fresh keys of small ops
  -- start no run.
  local inline = plan.inline
  if fresh then
    local group_of, alone = {}, {}
    for _, field in ipairs(fresh) do
      local p = st.prev[field]
      local g = p and group_of[p]
      if p and g == p then
        g = {keys = {p}}
        plan.groups[#plan.groups + 1] = g
        group_of[p] = g
      end
      if g and g.keys[#g.keys] == p then
        g.keys[#g.keys + 1] = field
        group_of[field] = g
      else
        local w = p and where[p]
        local rid, pos, run = nil, nil, nil
        if w then
          rid, pos = ref_parse(w)
          run = st.runs[rid]
        end
        if run and pos == run.n and (run.newn or run.n) == run.n and not run.extended
            and run.n < RUN_MAX then
          g = {keys = {field}, run = rid}
          run.extended = g
          plan.groups[#plan.groups + 1] = g
          group_of[field] = g
        elseif st.chain[field] then
          g = {keys = {field}, chained = true}
          plan.groups[#plan.groups + 1] = g
          group_of[field] = g
        else
          group_of[field] = field
          alone[#alone + 1] = field
        end
      end
    end
    for _, field in ipairs(alone) do
      if group_of[field] == field then inline[#inline + 1] = field end
    end
  end
  for _, g in ipairs(plan.groups) do
    local run = g.run and st.runs[g.run]
    if run and run.n > RUN_APPEND_MAX and #g.keys * RUN_APPEND_SHARE < run.n then
      -- too few keys to rewrite a long run for: a run of their own after it
      g.run, g.chained = nil, true
    end
    if not g.run and not g.chained and #g.keys < RUN_MIN then
      for _, field in ipairs(g.keys) do inline[#inline + 1] = field end
      g.keys = {}
    else
      local room = g.run and RUN_MAX - st.runs[g.run].n or 0
      plan.nruns = plan.nruns + math.ceil(math.max(0, #g.keys - room) / RUN_MAX)
    end
  end
  if plan.nruns > 0 then
    local n = tonumber(redis.call('HGET', k.meta, 'next_run') or '0')
    plan.rids = {}
    for j = 1, plan.nruns do
      local rid
      repeat
        n = n + 1
        if n > MAX_RUN_ID then fail('LAYOUT', 'run id space exhausted') end
        rid = struct.pack('>I4', n)
      until redis.call('EXISTS', st.cprefix .. rid) == 0
      plan.rids[j] = rid
    end
    plan.next_run = n
  end
  return plan
end

-- Write every staged change, as planned by plan_stage.
local function flush_stage(st, k, plan)
  plan = plan or plan_stage(st, k)
  local r, bucket = st.r, plan.bucket
  for _, field in ipairs(plan.inline) do
    local value = r[field]
    if value then
      redis.call('HSET', bucket[field], field, value)
    else
      redis.call('HDEL', bucket[field], field)
    end
  end
  for _, field in ipairs(plan.unref) do redis.call('HDEL', bucket[field], field) end
  -- new runs, and runs extended by new keys
  local nextrid = 1
  for _, g in ipairs(plan.groups) do
    local j = 1
    while j <= #g.keys do
      local rid, run, first
      if g.run and j == 1 then
        rid, run = g.run, st.runs[g.run]
        first = run.n + 1
      else
        rid = plan.rids[nextrid]
        nextrid = nextrid + 1
        first = 1
      end
      local upto = math.min(#g.keys, j + RUN_MAX - first)
      local keys, values = {}, {}
      for q = j, upto do
        local field = g.keys[q]
        keys[#keys + 1] = field
        values[#values + 1] = r[field]
        redis.call('HSET', bucket[field], field, ref_make(rid, first + q - j))
      end
      local ranges = ranges_of(values, first)
      if run then
        for _, rg in ipairs(ranges) do ranges_push(run.ranges, rg.e, rg.ids) end
        run.keys = run_keys(st, rid, run) .. table.concat(keys)
        run.n = first + #keys - 1
        run.newn = run.n
        run.rewrite = true
      else
        redis.call('HSET', st.cprefix .. rid, 'k', table.concat(keys), 'r', ranges_encode(ranges))
      end
      j = upto + 1
    end
  end
  for rid, run in pairs(st.runs) do
    if run and run.newn then
      if run.newn == 0 then
        redis.call('DEL', st.cprefix .. rid)
      elseif run.rewrite or run.newn < run.n then
        -- (string.sub of a whole string would hash all of it once more to find it interned)
        local keys = run_keys(st, rid, run)
        if #keys ~= run.newn * HASH_WIDTH then keys = string.sub(keys, 1, run.newn * HASH_WIDTH) end
        redis.call('HSET', st.cprefix .. rid, 'k', keys, 'r', ranges_encode(run.ranges))
      else
        redis.call('HSET', st.cprefix .. rid, 'r', ranges_encode(run.ranges))
      end
    end
  end
  if plan.next_run then
    redis.call('HSET', k.meta, 'next_run', tostring(plan.next_run))
    if k.pi then redis.call('HSET', k.pi, 'next_run', tostring(plan.next_run)) end
  end
  -- engine mappings
  local order, orig, e = st.eorder, st.eorig, st.e
  for n = 1, st.ne do
    local field = order[2 * n]
    local value = e[field]
    if value ~= orig[n] then
      if value then
        redis.call('HSET', order[2 * n - 1], field, value)
      else
        redis.call('HDEL', order[2 * n - 1], field)
      end
    end
  end
end

-- Store the ids (list and set form) under one request key. Entries already held move to the
-- most recently added end, as in the embedded index. prev is the request key before it in its
-- add op (nil for the first), which lets new consecutive keys be stored as one run.
local function add_ids(st, bucket, field, ids, set, prev)
  local current = stage_get(st, 'r', bucket, field)
  if prev and not current and st.prev[field] == nil and not st.where[field] then
    st.prev[field] = prev
  end
  local value = ids
  if current then
    if current == ids then return end
    value = list_without(current, set, ID_WIDTH) .. ids
  end
  stage_put(st, 'r', bucket, field, value)
end

-- Record engine key -> request key (most recent last, at most cap request keys per engine key).
local function map_engine(st, bucket, efield, rfield, cap)
  local current = stage_get(st, 'e', bucket, efield)
  if not current then
    stage_put(st, 'e', bucket, efield, rfield)
    return
  end
  if string.sub(current, -HASH_WIDTH) == rfield then return end
  stage_work(st, math.floor(#current / (16 * HASH_WIDTH)))
  local pos = list_find(current, rfield, HASH_WIDTH)
  if pos then
    current = string.sub(current, 1, pos - 1) .. string.sub(current, pos + HASH_WIDTH)
  elseif #current >= cap * HASH_WIDTH then
    current = string.sub(current, HASH_WIDTH + 1)
  end
  stage_put(st, 'e', bucket, efield, current .. rfield)
end

-- Remove the ids in set from one request key, deleting the field once empty.
-- Returns the ids left ('' when none, nil when the key held nothing) and how many were removed.
local function remove_ids(st, bucket, field, set)
  local current = stage_get(st, 'r', bucket, field)
  if not current then return nil, 0 end
  local left, removed = list_without(current, set, ID_WIDTH)
  if removed > 0 then stage_put(st, 'r', bucket, field, left ~= '' and left) end
  return left, removed
end

-- Evict by engine key: remove the ids from the request keys it maps to after the first
-- `first` (the client evicted those by request key); drop the mapping once none of its request
-- keys holds any entry (the first `first` are checked for a record, without reading their
-- runs), live expiring entries included: timed is nil while none can be live, else a function
-- h -> whether request key h still holds one (the caller removed the evicted ones first).
-- Request bucket names are built here (rbucket, a bucket_namer) because the request keys are
-- only known once the mapping is read inside this atomic step.
local function evict_engine(st, rbucket, bucket, efield, set, first, timed)
  local refs = stage_get(st, 'e', bucket, efield)
  if not refs then return 0 end
  local held, removed = false, 0
  for j = 1, #refs / HASH_WIDTH do
    local rfield = string.sub(refs, (j - 1) * HASH_WIDTH + 1, j * HASH_WIDTH)
    if j > first then
      st.key = j - first - 1
      if j > first + 1 then stage_work(st, 1) end
      local left, m = remove_ids(st, rbucket(rfield), rfield, set)
      removed = removed + m
      if left and left ~= '' then held = true end
    elseif not held then
      local staged = st.r[rfield]
      if staged == nil then
        held = redis.call('HEXISTS', rbucket(rfield), rfield) == 1
      else
        held = staged and true or false
      end
    end
    if not held and timed and timed(rfield) then held = true end
  end
  if not held then stage_put(st, 'e', bucket, efield, false) end
  return removed
end

--[[ program: the op program of add, evict and apply_batch: read and check it whole, then run it.
  Arguments, from a position pos of the script's ARGV:
    n, then n encoded entries (see entries)
    [number of ops, when the caller does not fix it]
    the ops, each one of
      "A", nent, nent x entry index, request keys (hash blob),
           engine/request key pairs (hash blob: engine key, request key, ...)
      "P", 8-byte parent key, then as "A": an add whose first request key follows the parent
           key in its chain (its keys join the run the parent key ends: includes/writes)
      "R", 8-byte request key, nent, nent x entry index
      "E", 8-byte engine key, first, nent, nent x entry index: the engine key's request keys
           after its first `first` lose the entries, and the mapping is dropped once none of
           its request keys holds an entry, live expiring entries included (first 0: the
           whole evict by engine key; the client evicts the first ones by request key when
           one call cannot take them all)
    (entry indexes are 1-based into the entries; nothing may follow the last op)
  read_program checks all of it without writing; run_program checks that the entry id space can
  hold the new entries, then runs the ops in order. ]]
--@include entries
--@include writes
--@include expiry
--@include stamps

-- The keys and bucket namers the ops write through; sx is the gate key of the expiring
-- buckets (includes/expiry), read here, before any write. A caller running several programs
-- in one call sets k.spent to one table for all of them: their run work adds up
-- (includes/writes).
local function write_context(meta, pe, pi, pp, rprefix, eprefix, bits, sx)
  local rbucket, ebucket = bucket_namer(rprefix, bits), bucket_namer(eprefix, bits)
  return {meta = meta, pe = pe, pi = pi, pp = pp, bits = bits, cprefix = run_prefix(rprefix),
          rbucket = rbucket, ebucket = ebucket, xs = expiring_stage(meta, sx, bits)}
end

local function entry_indexes(args, pos, nent, nents)
  local out = {}
  for j = 1, nent do out[j] = int_arg(args[pos + j - 1], 'entry index', 1, nents) end
  return out
end

-- The entries and ops in args from pos, checked; nops nil reads the op count from args; tags is
-- the set of op letters allowed. Returns {ents = encoded entries, ops = parsed ops}.
local function read_program(args, pos, nops, tags)
  local nents = int_arg(args[pos], 'entry count', 0, #args - pos)
  local ents = {}
  for i = 1, nents do
    ents[i] = args[pos + i]
    if not entry_ok(ents[i]) then fail('INVALID', 'malformed entry encoding ' .. i) end
  end
  pos = pos + nents + 1
  if nops == nil then
    nops = int_arg(args[pos], 'op count', 0, #args - pos)
    pos = pos + 1
  end
  local ops = {}
  for o = 1, nops do
    local tag = args[pos]
    if not (tags[tag] or tag == 'P' and tags.A) then
      fail('INVALID', 'unknown op ' .. tostring(tag) .. ' (op ' .. o .. ')')
    end
    local op = {tag = tag}
    if tag == 'P' then
      op.tag, op.parent = 'A', blob_arg(args[pos + 1], HASH_WIDTH, 'parent key', 1)
      pos = pos + 1
    end
    if op.tag == 'A' then
      local nent = int_arg(args[pos + 1], 'op entry count', 0, #args - pos)
      op.ents = entry_indexes(args, pos + 2, nent, nents)
      op.req = blob_arg(args[pos + 2 + nent], HASH_WIDTH, 'request keys')
      op.pairs = blob_arg(args[pos + 3 + nent], 2 * HASH_WIDTH, 'engine/request key pairs')
      pos = pos + 4 + nent
    else
      op.field = blob_arg(args[pos + 1], HASH_WIDTH, 'evict key', 1)
      if tag == 'E' then
        op.first = int_arg(args[pos + 2], 'first request key', 0, 2147483647)
        pos = pos + 1
      end
      local nent = int_arg(args[pos + 2], 'op entry count', 0, #args - pos)
      op.ents = entry_indexes(args, pos + 3, nent, nents)
      pos = pos + 3 + nent
    end
    ops[o] = op
  end
  if pos ~= #args + 1 then fail('INVALID', (#args + 1 - pos) .. ' arguments after the last op') end
  return {ents = ents, ops = ops}
end

-- The speculative ids of the pods an add op adds a confirmed entry of, or nil when none (spec
-- caches pod -> set of speculative ids).
local function confirmed_pods_speculative(k, ents, op, spec)
  local out = nil
  for _, j in ipairs(op.ents) do
    local enc = ents[j]
    if not entry_speculative(enc) then
      local pod = entry_pod(enc)
      local set = spec[pod]
      if set == nil then
        set = pods_speculative_ids(k.pp, k.pi, {pod})
        spec[pod] = set
      end
      for id in pairs(set) do
        out = out or {}
        out[id] = true
      end
    end
  end
  return out
end

-- Run a program read by read_program through the context k (write_context); cap is the most
-- request keys kept per engine key (add ops); ms the ttl in ms of the speculative entries the
-- add ops store (0 for none: then they are stored without deadline). Everything is read (and
-- staged) before the first write, so a call that fails (a foreign key of the wrong type, the id
-- space exhausted, the run work limit of includes/writes exceeded) writes nothing. Returns the
-- (request key, entry) pairs removed.
local function run_program(k, program, cap, ms)
  local ents, ops = program.ents, program.ops
  -- Entry ids: from <ns>:pe, or allocated (read-only) for entries an add op stores.
  local ids, new = {}, {}
  local function lookup_id(j)
    local enc = ents[j]
    local id = ids[enc]
    if id == nil then
      id = redis.call('HGET', k.pe, enc) or false
      ids[enc] = id
    end
    return id
  end
  for _, op in ipairs(ops) do
    if op.tag == 'A' then
      for _, j in ipairs(op.ents) do
        if not lookup_id(j) and ids[ents[j]] == false then
          new[#new + 1] = ents[j]
          ids[ents[j]] = 0
        end
      end
    end
  end
  local defs, new_ids, next_id, pod_lists = nil, {}, nil, nil
  if #new > 0 then
    defs = entry_definitions()
    new_ids, next_id = defs.allocate_ids(k, new)
    for i = 1, #new do ids[new[i]] = new_ids[i] end
    pod_lists = defs.read_pods(k.pp, new)
  end
  -- The expiring buckets are only read (and the clock only asked) when a ttl is stored, an
  -- expiring entry may be live, or new entries record the expiry mode.
  -- A call of several ops, of one add op of several request keys or of one evict by engine
  -- key (the client evicts its request keys one by one) can be split by the client: its run
  -- work is limited (KVREDIS_BUDGET before any write, or past the call's shared work); one
  -- key's is bounded.
  local one = ops[1]
  local splittable = #ops > 1 or (one and (one.tag == 'E' or
    one.tag == 'A' and #one.req > HASH_WIDTH))
  local st, xs = new_stage(k.cprefix, splittable and RUN_WORK_LIMIT or nil, k.spent), k.xs
  if ms > 0 or xs.live or #new > 0 then expiring_open(xs) end
  local removed = 0
  local spec = nil
  local rbucket = k.rbucket
  local marks = {}  -- entries whose copies this call takes away (includes/stamps)
  for o, op in ipairs(ops) do
    st.op, st.key = o - 1, 0
    local set = {}
    if op.tag == 'A' then
      -- With a ttl the speculative entries get a deadline (and leave the request bucket);
      -- the others are stored without one.
      local list, timed, timed_set = {}, nil, nil
      for _, j in ipairs(op.ents) do
        local id = ids[ents[j]]
        if ms > 0 and entry_speculative(ents[j]) then
          timed, timed_set = timed or {}, timed_set or {}
          if not timed_set[id] then
            timed_set[id] = true
            timed[#timed + 1] = id
          end
        elseif not set[id] then
          set[id] = true
          list[#list + 1] = id
        end
      end
      -- While expiring entries may be live, a confirmed entry replaces its pod's expiring
      -- speculative entries, and speculative entries added again without a ttl stop expiring.
      local untimed = nil
      if xs.live and ms == 0 then
        spec = spec or {}
        untimed = confirmed_pods_speculative(k, ents, op, spec)
        for _, j in ipairs(op.ents) do
          if entry_speculative(ents[j]) then
            untimed = untimed or {}
            untimed[ids[ents[j]]] = true
          end
        end
      end
      local value, req, pairs_ = table.concat(list), op.req, op.pairs
      local deadline = ms > 0 and xs.now + ms
      local parent = op.parent
      local prev = parent
      local taken = false
      for i = 1, #req, HASH_WIDTH do
        local rfield = string.sub(req, i, i + HASH_WIDTH - 1)
        local bucket = rbucket(rfield)
        st.key = (i - 1) / HASH_WIDTH
        if value ~= '' then
          add_ids(st, bucket, rfield, value, set, prev)
          -- A new first key following a held parent key continues a stored chain: read the
          -- parent's record (its ref names the run it may end).
          if i == 1 and parent and st.prev[rfield] == parent
              and stage_get(st, 'r', rbucket(parent), parent, true) then
            st.chain[rfield] = true
          end
          prev = rfield
        end
        if timed then
          local _, moved = remove_ids(st, bucket, rfield, timed_set)
          if xs.add(rfield, timed, deadline) or moved > 0 then taken = true end
        elseif untimed then
          if xs.remove(rfield, untimed) > 0 then taken = true end
        end
      end
      if taken then stamp_mark(marks, ents, op.ents) end
      for i = 1, #pairs_, 2 * HASH_WIDTH do
        local efield = string.sub(pairs_, i, i + HASH_WIDTH - 1)
        local rfield = string.sub(pairs_, i + HASH_WIDTH, i + 2 * HASH_WIDTH - 1)
        map_engine(st, k.ebucket(efield), efield, rfield, cap)
      end
    else
      local before = removed
      for _, j in ipairs(op.ents) do
        local id = lookup_id(j)
        if id and id ~= 0 then set[id] = true end
      end
      if op.tag == 'R' then
        local _, n = remove_ids(st, k.rbucket(op.field), op.field, set)
        removed = removed + n
        if xs.live then removed = removed + xs.remove(op.field, set) end
      else
        local ebucket = k.ebucket(op.field)
        if xs.live then
          local refs = stage_get(st, 'e', ebucket, op.field) or ''
          for i = op.first * HASH_WIDTH + 1, #refs, HASH_WIDTH do
            removed = removed + xs.remove(string.sub(refs, i, i + HASH_WIDTH - 1), set)
          end
        end
        removed = removed + evict_engine(st, k.rbucket, ebucket, op.field, set, op.first,
          xs.live and xs.holds or nil)
      end
      if removed > before then stamp_mark(marks, ents, op.ents) end
    end
  end
  local plan = plan_stage(st, k)
  if #new > 0 then defs.define_entries(k, new, new_ids, next_id, pod_lists) end
  flush_stage(st, k, plan)
  expiring_flush(xs)
  stamp_removals(k.meta, marks)
  return removed
end

--[[ program: the op program of add, evict and apply_batch: read and check it whole, then run it.
  Arguments, from a position pos of the script's ARGV:
    n, then n encoded entries (see entries)
    [number of ops, when the caller does not fix it]
    the ops, each one of
      "A", nent, nent x entry index, request keys (hash blob),
           engine/request key pairs (hash blob: engine key, request key, ...)
      "P", 8-byte parent key, then as "A": an add whose first request key follows the parent
           key in its chain (its keys may join the run the parent key ends: includes/writes)
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
--@include fence
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

-- The n encoded entries of args from pos (n, then the entries), checked. Returns the entries
-- and the position after them.
local function read_entries(args, pos)
  local nents = int_arg(args[pos], 'entry count', 0, #args - pos)
  local ents = {}
  for i = 1, nents do
    ents[i] = args[pos + i]
    if not entry_ok(ents[i]) then fail('INVALID', 'malformed entry encoding ' .. i) end
  end
  return ents, pos + nents + 1
end

-- nops ops of args from pos, checked (nents: how many entries their indexes may name; tags: the
-- set of op letters allowed). Returns the parsed ops and the position after them.
local function read_ops(args, pos, nops, nents, tags)
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
  return ops, pos
end

-- The batches of apply_batches.lua, all in one binary string (one argument: a call of many
-- small batches pays no per-argument conversion), checked. nents: how many entries the ops may
-- name; nstreams: how many streams the batches may name. Each batch:
--   u16 stream (1-based among the call's streams; 0: an unfenced batch),
--   u8 length l, l bytes of mark "epoch:seq:token" (fenced batches; l = 0 otherwise),
--   u16 number of ops, then the ops, each:
--     u8 tag, u16 entry count c, c x u16 entry index (1-based, <= nents), then for tag
--     "A": u32 n, n request keys (8 bytes each), u32 m, m engine/request key pairs (16 bytes)
--     "P": the 8-byte parent key, then as "A"
--     "R", "E": u32 n, n keys (8 bytes each), each evicted in turn (request or engine keys)
-- Integers are big-endian. Returns the batches: {stream = number or nil, mark, epoch, seq,
-- token, ops} (ops as read_ops gives them; multi-key evicts have keys, not field). Ops naming
-- the same entries share one ents table (most do).
local function read_blob_batches(blob, nents, nstreams)
  if type(blob) ~= 'string' then fail('INVALID', 'batches must be a string') end
  local batches, len, pos = {}, #blob, 1
  local entsets = {}
  local b, a1, a2, a3, a4 = 0
  while pos <= len do
    b = b + 1
    if pos + 4 > len then fail('INVALID', 'batch ' .. b .. ' is cut short') end
    a1, a2, a3 = string.byte(blob, pos, pos + 2)
    local stream, ml = a1 * 256 + a2, a3
    if stream > nstreams or (stream > 0) ~= (ml > 0) then
      fail('INVALID', 'batch ' .. b .. ': stream ' .. stream .. ' with a mark of ' .. ml .. ' bytes')
    end
    local batch = {stream = nil, mark = nil, epoch = nil, seq = nil, token = nil, ops = nil}
    if stream > 0 then
      local mark = string.sub(blob, pos + 3, pos + 2 + ml)
      local epoch, seq, token = string.match(mark, '^(%-?%d+):(%-?%d+):(%x+)$')
      if not epoch or #mark ~= ml then
        fail('INVALID', 'batch ' .. b .. ': mark must be epoch:seq:token, got ' .. mark)
      end
      dec_arg(epoch, 'epoch')
      dec_arg(seq, 'seq')
      batch.stream, batch.mark, batch.epoch, batch.seq, batch.token = stream, mark, epoch, seq,
        token
    end
    pos = pos + 3 + ml
    if pos + 1 > len then fail('INVALID', 'batch ' .. b .. ' is cut short') end
    a1, a2 = string.byte(blob, pos, pos + 1)
    local nops = a1 * 256 + a2
    pos = pos + 2
    local ops = {}
    for o = 1, nops do
      if pos + 2 > len then fail('INVALID', 'batch ' .. b .. ' ends inside op ' .. o) end
      local tag = string.sub(blob, pos, pos)
      a1, a2 = string.byte(blob, pos + 1, pos + 2)
      local stop = pos + 2 + 2 * (a1 * 256 + a2)
      if stop > len then fail('INVALID', 'batch ' .. b .. ' ends inside op ' .. o) end
      local key = string.sub(blob, pos + 3, stop)
      local ents = entsets[key]
      if not ents then
        ents = {}
        for at = 1, #key, 2 do
          a1, a2 = string.byte(key, at, at + 1)
          local e = a1 * 256 + a2
          if e < 1 or e > nents then
            fail('INVALID', 'batch ' .. b .. ': entry index ' .. e .. ' out of range')
          end
          ents[#ents + 1] = e
        end
        entsets[key] = ents
      end
      pos = stop + 1
      local parent = nil
      if tag == 'P' then
        parent = string.sub(blob, pos, pos + HASH_WIDTH - 1)
        pos = pos + HASH_WIDTH
      elseif tag ~= 'A' and tag ~= 'R' and tag ~= 'E' then
        fail('INVALID', 'batch ' .. b .. ': unknown op ' .. string.format('%q', tag))
      end
      -- one list of hashes (R, E), or the request keys and the pairs (A)
      local list, list2
      for width = HASH_WIDTH, (tag == 'A' or tag == 'P') and 2 * HASH_WIDTH or HASH_WIDTH,
          HASH_WIDTH do
        if pos + 3 > len then fail('INVALID', 'batch ' .. b .. ' ends inside op ' .. o) end
        a1, a2, a3, a4 = string.byte(blob, pos, pos + 3)
        local stop2 = pos + 3 + (((a1 * 256 + a2) * 256 + a3) * 256 + a4) * width
        if stop2 > len then fail('INVALID', 'batch ' .. b .. ' ends inside op ' .. o) end
        list2 = string.sub(blob, pos + 4, stop2)
        list = list or list2
        pos = stop2 + 1
      end
      if tag == 'R' or tag == 'E' then
        ops[o] = {tag = tag, ents = ents, keys = list, first = 0}
      else
        ops[o] = {tag = 'A', ents = ents, parent = parent, req = list, pairs = list2}
      end
    end
    batch.ops = ops
    batches[b] = batch
  end
  return batches
end

-- The entries and ops in args from pos, checked; nops nil reads the op count from args; tags is
-- the set of op letters allowed. Returns {ents = encoded entries, ops = parsed ops}.
local function read_program(args, pos, nops, tags)
  local ents
  ents, pos = read_entries(args, pos)
  if nops == nil then
    nops = int_arg(args[pos], 'op count', 0, #args - pos)
    pos = pos + 1
  end
  local ops
  ops, pos = read_ops(args, pos, nops, #ents, tags)
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
    one.tag == 'A' and #one.req > HASH_WIDTH or one.keys and #one.keys > HASH_WIDTH))
  local st, xs = new_stage(k.cprefix, splittable and RUN_WORK_LIMIT or nil, k.spent), k.xs
  if ms > 0 or xs.live or #new > 0 then expiring_open(xs) end
  local removed = 0
  local spec = nil
  local rbucket, ebucket = k.rbucket, k.ebucket
  local rvals, evals, sprev = st.r, st.e, st.prev
  local marks = {}  -- entries whose copies this call takes away (includes/stamps)
  -- Without a ttl, the ids an add op stores depend on its entry indexes only, and the ops of
  -- one call share their entry index tables (read_blob_batches): op.ents -> {set, value}.
  local stored = {}
  for o, op in ipairs(ops) do
    st.op, st.key = o - 1, 0
    local set
    if op.tag == 'A' then
      -- With a ttl the speculative entries get a deadline (and leave the request bucket);
      -- the others are stored without one.
      local value, timed, timed_set = nil, nil, nil
      local known = ms == 0 and stored[op.ents]
      if known then
        set, value = known[1], known[2]
      else
        local list = {}
        set = {}
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
        value = table.concat(list)
        if ms == 0 then stored[op.ents] = {set, value} end
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
      local req, pairs_ = op.req, op.pairs
      local deadline = ms > 0 and xs.now + ms
      local parent = op.parent
      local prev = parent
      local taken = false
      for i = 1, #req, HASH_WIDTH do
        local rfield = string.sub(req, i, i + HASH_WIDTH - 1)
        st.key = (i - 1) / HASH_WIDTH
        if value ~= '' then
          -- add_ids (includes/writes), inline: the ids join the key's, moved to the end
          local current = rvals[rfield]
          if current == nil then current = stage_get(st, 'r', rbucket(rfield), rfield) end
          if not current then
            if prev and sprev[rfield] == nil and not st.where[rfield] then sprev[rfield] = prev end
            rvals[rfield] = value
          elseif current ~= value then
            rvals[rfield] = list_without(current, set, ID_WIDTH) .. value
          end
          -- A new first key following a held parent key continues a stored chain: read the
          -- parent's record (its ref names the run it may end).
          if i == 1 and parent and sprev[rfield] == parent then
            local held = rvals[parent]
            if held == nil then held = stage_get(st, 'r', rbucket(parent), parent) end
            if held then st.chain[rfield] = true end
          end
          prev = rfield
        end
        if timed then
          local _, moved = remove_ids(st, rbucket(rfield), rfield, timed_set)
          if xs.add(rfield, timed, deadline) or moved > 0 then taken = true end
        elseif untimed then
          if xs.remove(rfield, untimed) > 0 then taken = true end
        end
      end
      if taken then stamp_mark(marks, ents, op.ents) end
      for i = 1, #pairs_, 2 * HASH_WIDTH do
        local efield = string.sub(pairs_, i, i + HASH_WIDTH - 1)
        local rfield = string.sub(pairs_, i + HASH_WIDTH, i + 2 * HASH_WIDTH - 1)
        -- map_engine (includes/writes), its first mapping inline
        local current = evals[efield]
        if current == nil then current = stage_get(st, 'e', ebucket(efield), efield) end
        if current then
          map_engine(st, ebucket(efield), efield, rfield, cap)
        else
          evals[efield] = rfield
        end
      end
    else
      local before = removed
      set = {}
      for _, j in ipairs(op.ents) do
        local id = lookup_id(j)
        if id and id ~= 0 then set[id] = true end
      end
      local keys = op.keys or op.field
      for at = 1, #keys, HASH_WIDTH do
        local field = op.keys and string.sub(keys, at, at + HASH_WIDTH - 1) or keys
        if op.keys then st.key = (at - 1) / HASH_WIDTH end
        if op.tag == 'R' then
          local _, n = remove_ids(st, k.rbucket(field), field, set)
          removed = removed + n
          if xs.live then removed = removed + xs.remove(field, set) end
        else
          local ebucket = k.ebucket(field)
          if xs.live then
            local refs = stage_get(st, 'e', ebucket, field) or ''
            for i = op.first * HASH_WIDTH + 1, #refs, HASH_WIDTH do
              removed = removed + xs.remove(string.sub(refs, i, i + HASH_WIDTH - 1), set)
            end
          end
          removed = removed + evict_engine(st, k.rbucket, ebucket, field, set, op.first,
            xs.live and xs.holds or nil)
        end
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

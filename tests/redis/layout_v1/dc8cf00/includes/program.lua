--[[ program: the op program of add, evict and apply_batch: read and check it whole, then run it.
  Arguments, from a position pos of the script's ARGV:
    n, then n encoded entries (see entries)
    [number of ops, when the caller does not fix it]
    the ops, each one of
      "A", nent, nent x entry index, request keys (hash blob),
           engine/request key pairs (hash blob: engine key, request key, ...)
      "R", 8-byte request key, nent, nent x entry index
      "E", 8-byte engine key, nent, nent x entry index
    (entry indexes are 1-based into the entries; nothing may follow the last op)
  read_program checks all of it without writing; run_program checks that the entry id space can
  hold the new entries, then runs the ops in order. ]]
--@include entries
--@include writes
--@include expiry

-- The keys and bucket namers the ops write through.
local function write_context(meta, pe, pi, pp, rprefix, eprefix, bits)
  return {meta = meta, pe = pe, pi = pi, pp = pp, bits = bits,
          rbucket = bucket_namer(rprefix, bits), ebucket = bucket_namer(eprefix, bits)}
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
    if not tags[tag] then fail('INVALID', 'unknown op ' .. tostring(tag) .. ' (op ' .. o .. ')') end
    local op = {tag = tag}
    if tag == 'A' then
      local nent = int_arg(args[pos + 1], 'op entry count', 0, #args - pos)
      op.ents = entry_indexes(args, pos + 2, nent, nents)
      op.req = blob_arg(args[pos + 2 + nent], HASH_WIDTH, 'request keys')
      op.pairs = blob_arg(args[pos + 3 + nent], 2 * HASH_WIDTH, 'engine/request key pairs')
      pos = pos + 4 + nent
    else
      op.field = blob_arg(args[pos + 1], HASH_WIDTH, 'evict key', 1)
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
-- request keys kept per engine key (add ops). ttl, for the add scripts only, is nil or
-- {sx = <ns>:sx, ms = ttl in ms (0 for none), now = server clock in ms}: due expired pairs are
-- reclaimed (a bounded number) and the entries added get their deadline. Everything is read
-- (and staged) before the first write, so a call that fails (a foreign key of the wrong type,
-- the id space exhausted) writes nothing. Returns the (request key, entry) pairs removed.
local function run_program(k, program, cap, ttl)
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
  local new_ids, next_id, pod_lists = {}, nil, nil
  if #new > 0 then
    new_ids, next_id = allocate_ids(k, new)
    for i = 1, #new do ids[new[i]] = new_ids[i] end
    pod_lists = read_pods(k.pp, new)
  end
  local st = new_stage()
  local removed = 0
  local spec = {}
  local due, deadlines, undated = {}, {}, {}
  local timed = ttl and redis.call('ZCARD', ttl.sx) > 0
  if timed then
    due = due_pairs(ttl.sx, ttl.now)
    for _, m in ipairs(due) do
      local rfield = string.sub(m, 1, HASH_WIDTH)
      remove_ids(st, k.rbucket(rfield), rfield, {[string.sub(m, HASH_WIDTH + 1)] = true})
    end
  end
  for _, op in ipairs(ops) do
    local set = {}
    if op.tag == 'A' then
      local list = {}
      for _, j in ipairs(op.ents) do
        local id = ids[ents[j]]
        if not set[id] then
          set[id] = true
          list[#list + 1] = id
        end
      end
      -- With expiring entries in the namespace, a confirmed entry replaces its pod's expiring
      -- speculative entries, and speculative entries added again without a ttl stop expiring.
      local replaceable = timed and confirmed_pods_speculative(k, ents, op, spec)
      local own = {}
      if ttl and (ttl.ms > 0 or timed) then
        for _, j in ipairs(op.ents) do
          if entry_speculative(ents[j]) then own[#own + 1] = ids[ents[j]] end
        end
      end
      local value, req, pairs_ = table.concat(list), op.req, op.pairs
      for i = 1, #req, HASH_WIDTH do
        local rfield = string.sub(req, i, i + HASH_WIDTH - 1)
        local without = set
        if replaceable then
          for id in pairs(replaceable) do
            if not set[id] and redis.call('ZSCORE', ttl.sx, rfield .. id) then
              if without == set then
                without = {}
                for s_id in pairs(set) do without[s_id] = true end
              end
              without[id] = true
              undated[#undated + 1] = rfield .. id
            end
          end
        end
        add_ids(st, k.rbucket(rfield), rfield, value, without)
        for _, id in ipairs(own) do
          if ttl.ms > 0 then
            deadlines[#deadlines + 1] = tostring(ttl.now + ttl.ms)
            deadlines[#deadlines + 1] = rfield .. id
          else
            undated[#undated + 1] = rfield .. id
          end
        end
      end
      for i = 1, #pairs_, 2 * HASH_WIDTH do
        local efield = string.sub(pairs_, i, i + HASH_WIDTH - 1)
        local rfield = string.sub(pairs_, i + HASH_WIDTH, i + 2 * HASH_WIDTH - 1)
        map_engine(st, k.ebucket(efield), efield, rfield, cap)
      end
    else
      for _, j in ipairs(op.ents) do
        local id = lookup_id(j)
        if id and id ~= 0 then set[id] = true end
      end
      if op.tag == 'R' then
        local _, n = remove_ids(st, k.rbucket(op.field), op.field, set)
        removed = removed + n
      else
        removed = removed + evict_engine(st, k.rbucket, k.ebucket(op.field), op.field, set)
      end
    end
  end
  if #new > 0 then define_entries(k, new, new_ids, next_id, pod_lists) end
  flush_stage(st)
  if #due > 0 then call_chunked('ZREM', ttl.sx, due) end
  if #undated > 0 then call_chunked('ZREM', ttl.sx, undated) end
  if #deadlines > 0 then call_chunked('ZADD', ttl.sx, deadlines) end
  return removed
end

--[[ walk: the read path of lookup and score: a chain of request keys, in order, to the first key
  no entry holds. A key stored inline costs one HGET; a key held through a run (includes/runs)
  costs one HGET and one HMGET of the run, after which the run's following keys are compared
  with the chain's following keys as bytes and their entry ids are read from the run's ranges,
  without a call per key. The walk is exact: a key counts as held only where its own record
  (inline ids, or the run position its ref names) holds ids. ]]
--@include runs

-- Walk the chain (hash blob). rbucket names request buckets, sprefix is the run key prefix.
-- filter is nil or a function (h, ids) -> ids applied to every key on its own (the expiry
-- filter: includes/expiry); without it, keys of one run range are visited together.
-- visit(ids, n) is called for each group of n consecutive chain keys holding the same
-- (non-empty) ids, in order; it returns false to stop the walk.
local function walk_chain(chain, rbucket, sprefix, filter, visit)
  local nkeys = #chain / HASH_WIDTH
  local runs = {}
  local i = 1
  while i <= nkeys do
    local at = (i - 1) * HASH_WIDTH
    local h = string.sub(chain, at + 1, at + HASH_WIDTH)
    local v = redis.call('HGET', rbucket(h), h)
    if not v then return end
    if not is_ref(v) then
      if filter then v = filter(h, v) end
      if v == '' or not visit(v, 1) then return end
      i = i + 1
    else
      local rid, pos = ref_parse(v)
      local run = runs[rid]
      if run == nil then
        local rec = redis.call('HMGET', sprefix .. rid, 'k', 'r')
        run = false
        if rec[1] and rec[2] then
          local ranges = ranges_parse(rec[2])
          if ranges then run = {keys = rec[1], ranges = ranges} end
        end
        runs[rid] = run
      end
      if not run then return end
      local limit = math.min(#run.keys / HASH_WIDTH - pos + 1, nkeys - i + 1)
      local n = limit > 0 and run_match(run.keys, pos, chain, i, limit) or 0
      local r = n > 0 and range_at(run.ranges, pos)
      if not r then return end
      local p, last = pos, pos + n - 1
      while p <= last do
        local rg = run.ranges[r]
        local ids = rg.ids
        -- a hole: the key is not held through this run (it may be held on its own)
        if ids == '' then break end
        local e = math.min(rg.e, last)
        if filter then
          for q = p, e do
            local kq = string.sub(run.keys, (q - 1) * HASH_WIDTH + 1, q * HASH_WIDTH)
            local left = filter(kq, ids)
            if left == '' or not visit(left, 1) then return end
          end
        elseif not visit(ids, e - p + 1) then
          return
        end
        p = e + 1
        r = r + 1
      end
      if p == pos then return end
      i = i + (p - pos)
    end
  end
end

#!lua flags=allow-cross-slot-keys
--[[ migrate: convert a namespace of layout kvredis-kvblock/1 to this layout in place, online.
  Layout /1 stored what /2 stores, with two differences: no chain runs (every request key has its
  own record in its request bucket, which /2 reads as it is: see kvredis.redis.layout), and, in
  the releases before the expiring buckets, the speculative entries with a ttl were held in the
  request buckets like the others, their deadlines in a sorted set <ns>:sx (member: 8-byte
  request key .. 4-byte entry id, score: deadline in ms). Layout /1 releases with the expiring
  buckets already stored them as /2 does.
  "begin" (atomic) fences out /1 clients and makes the namespace /2: a fresh generation (every
  /1 client's next call fails its generation check, and its reload refuses the /2 record), the
  layout version, the expiry mode of a namespace that has none (also copied to <ns>:pi), and a
  sorted set <ns>:sx renamed to <ns>:mx, the pairs still to convert; while any is left,
  <ns>:meta holds migrating = the layout converted from and migrate_total = the pairs at the
  start. It converts a first page of pairs too (a namespace with few is converted in this one
  atomic call). "page" converts the next pairs of <ns>:mx (in deadline order): an entry id still in its request key's
  record leaves it and, before its deadline, moves to the expiring bucket with that deadline
  (includes/expiry); a past-due one is dropped (/1 readers no longer returned it); the pairs
  leave <ns>:mx, and the last page removes the two meta fields. Each call leaves every record
  in a form /2 reads, so /2 readers and writers run throughout; <ns>:mx itself is the cursor,
  so a migration cut short goes on where it stopped.
  Request bucket names are built here from the request keys read from <ns>:mx (the design needs
  it; a /1 namespace is never in a cluster, and the script refuses nothing for that reason).
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi    KEYS[3] <ns>:sx    KEYS[4] <ns>:mx
  ARGV[1]     "begin" or "page"
  begin:      ARGV[2] the layout converted from   ARGV[3] the layout converted to
              ARGV[4] a fresh random generation token
              ARGV[5] expiry mode for a namespace without one ("field" or "key")
              ARGV[6] request bucket prefix "<ns>:r:"   ARGV[7] most pairs to convert (0..10000)
  page:       ARGV[2] the generation "begin" returned   ARGV[3] request bucket prefix
              "<ns>:r:"   ARGV[4] bucket bits   ARGV[5] most pairs to convert (1..10000)
  Returns     begin: [state, generation, pairs left, pairs at the start, pairs moved to
              expiring buckets, pairs dropped] where state is
              "begun" (this call converted the record), "resume" (a migration is under way,
              or pairs are left in <ns>:mx; with no pair left, this call ends it),
              "current" (already this layout, nothing to do), "missing" (no meta record),
              "dropping" (a drop is under way) or "other" (another layout: generation is then
              that layout's version);
              page: [pairs moved to expiring buckets, pairs dropped (past due, or the entry no
              longer held there), pairs left]
  Errors      KVREDIS_INVALID for malformed arguments; KVREDIS_LAYOUT when <ns>:sx or <ns>:mx
              holds another type of value or <ns>:meta no valid bucket bits (begin);
              KVREDIS_STALE (page) when the generation changed
              (a drop, or another layout); all before the first write
  Complexity  O(pairs converted x entries per key) ]]
--@include expiry

keys_arg(KEYS, 4)
local meta, pi, sx, mx = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local mode = ARGV[1]

local function key_type(key)
  local t = redis.call('TYPE', key)
  return type(t) == 'table' and t.ok or t
end

-- Convert the first `count` pairs of mx (checked arguments: rbucket names request buckets,
-- bits is the bucket bit count); returns pairs moved, pairs dropped, pairs left.
local function convert(rbucket, bits, count)
  local todo = count > 0 and redis.call('ZRANGE', mx, 0, count - 1, 'WITHSCORES') or {}
  local moved, dropped = 0, 0
  if #todo > 0 then
    local xs = expiring_open(expiring_stage(meta, sx, bits))
    local done = {}
    for j = 1, #todo, 2 do
      local member, deadline = todo[j], tonumber(todo[j + 1])
      done[#done + 1] = member
      local h, id = string.sub(member, 1, HASH_WIDTH), string.sub(member, HASH_WIDTH + 1)
      local bucket = rbucket(h)
      local ids = #member == HASH_WIDTH + ID_WIDTH and redis.call('HGET', bucket, h)
      -- a record of a multiple of 4 bytes is an id list; a 6-byte run ref (a /2 writer stored
      -- the key anew since) does not hold the /1 pair any more
      local at = ids and #ids % ID_WIDTH == 0 and list_find(ids, id, ID_WIDTH)
      if at then
        local left = string.sub(ids, 1, at - 1) .. string.sub(ids, at + ID_WIDTH)
        if left == '' then
          redis.call('HDEL', bucket, h)
        else
          redis.call('HSET', bucket, h, left)
        end
      end
      if at and deadline and deadline > xs.now then
        xs.add(h, {id}, deadline)
        moved = moved + 1
      else
        dropped = dropped + 1
      end
    end
    expiring_flush(xs)
    for i = 1, #done, 1000 do
      redis.call('ZREM', mx, unpack(done, i, math.min(i + 999, #done)))
    end
  end
  local left = redis.call('ZCARD', mx)
  if left == 0 then redis.call('HDEL', meta, 'migrating', 'migrate_total') end
  return moved, dropped, left
end

if mode == 'begin' then
  local from, to = text_arg(ARGV[2], 'source layout'), text_arg(ARGV[3], 'target layout')
  local gen = text_arg(ARGV[4], 'generation')
  local expiry = ARGV[5]
  if expiry ~= 'field' and expiry ~= 'key' then
    fail('INVALID', 'expiry mode must be "field" or "key", got ' .. tostring(expiry))
  end
  text_arg(ARGV[6], 'request bucket prefix')
  local count = int_arg(ARGV[7], 'pairs per call', 0, 10000)
  local current = redis.call('HMGET', meta, 'layout', 'gen', 'expiry', 'migrating',
    'migrate_total', 'bucket_bits')
  if not current[1] then return {'missing', '', 0, 0, 0, 0} end
  if current[2] and string.sub(current[2], 1, 9) == 'dropping:' then
    return {'dropping', current[2], 0, 0, 0, 0}
  end
  if current[1] == to then
    local left = key_type(mx) == 'zset' and redis.call('ZCARD', mx) or 0
    if left == 0 then
      if not current[4] then return {'current', current[2] or '', 0, 0, 0, 0} end
      -- nothing left (e.g. a namespace restored from a dump taken during a migration): done
      redis.call('HDEL', meta, 'migrating', 'migrate_total')
    elseif not current[4] then
      -- pairs left but no record of the migration (a meta record lost and healed): go on
      current[5] = tostring(left)
      redis.call('HSET', meta, 'migrating', from, 'migrate_total', current[5])
    end
    return {'resume', current[2] or '', left, tonumber(current[5] or left) or left, 0, 0}
  end
  if current[1] ~= from then return {'other', current[1], 0, 0, 0, 0} end
  local bits = current[6]
  local nbits = tonumber(bits)
  if not (nbits and nbits >= MIN_BUCKET_BITS and nbits <= MAX_BUCKET_BITS) then
    fail('LAYOUT', meta .. ' holds no valid bucket_bits (' .. tostring(bits) .. ')')
  end
  local rbucket = bucket_namer(ARGV[6], bits)
  local pairs_type = key_type(sx)
  if pairs_type ~= 'zset' and pairs_type ~= 'string' and pairs_type ~= 'none' then
    fail('LAYOUT', sx .. ' holds a ' .. pairs_type .. ', neither the deadlines of layout ' .. from
      .. ' (a sorted set) nor the gate of ' .. to .. ' (a string)')
  end
  if key_type(mx) ~= 'none' then
    fail('LAYOUT', mx .. ' exists although no migration is under way (a foreign key?)')
  end
  local total = 0
  if pairs_type == 'zset' then
    total = redis.call('ZCARD', sx)
    redis.call('RENAME', sx, mx)
  end
  redis.call('HSET', meta, 'layout', to, 'gen', gen)
  if not current[3] then
    redis.call('HSET', meta, 'expiry', expiry)
    redis.call('HSET', pi, 'expiry', expiry)
  end
  if total == 0 then return {'begun', gen, 0, 0, 0, 0} end
  redis.call('HSET', meta, 'migrating', from, 'migrate_total', tostring(total))
  local moved, dropped, left = convert(rbucket, bits, count)
  return {'begun', gen, left, total, moved, dropped}
end

if mode == 'page' then
  local gen = text_arg(ARGV[2], 'generation')
  local rbucket = bucket_namer(ARGV[3], ARGV[4])
  local count = int_arg(ARGV[5], 'pairs per call', 1, 10000)
  check_gen(meta, gen)
  local mx_type = key_type(mx)
  if mx_type ~= 'zset' and mx_type ~= 'none' then
    fail('LAYOUT', mx .. ' holds a ' .. mx_type .. ', not the pairs of a migration')
  end
  local moved, dropped, left = convert(rbucket, ARGV[4], count)
  return {moved, dropped, left}
end

fail('INVALID', 'unknown migrate step ' .. tostring(mode))

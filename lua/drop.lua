#!lua flags=allow-oom,allow-cross-slot-keys
--[[ drop: delete a namespace in steps, fenced by a tombstone in <ns>:meta.
  "begin" replaces the generation in <ns>:meta with the tombstone "dropping:<token>" (or joins the
  drop already in progress): from then on every client of the old generation gets KVREDIS_STALE,
  nothing writes to the namespace, and a reloading client finishes the drop before it creates
  the next incarnation. "page" deletes one page of the namespace's keys (the client pages them
  with SCAN MATCH and keeps only the keys of this namespace), only while the tombstone is in
  place; "end" deletes <ns>:meta if it still holds the tombstone. A drop may be finished by any
  client (a dropper that dies leaves the tombstone, and the next client to load the namespace
  ends it); once one has ended it and a new incarnation exists, the others' pages do nothing.
  KEYS[1]     <ns>:meta    KEYS[2..] ("page") keys of this namespace to delete
  ARGV[1]     "begin", "page" or "end"
  ARGV[2]     begin: a fresh random token; page and end: the tombstone
  Returns     begin: the tombstone; page: keys deleted, or -1 once the tombstone is gone;
              end: 1 if this call deleted <ns>:meta, else 0
  Errors      KVREDIS_INVALID for malformed arguments
  Complexity  O(keys of the page + their fields) ]]
--@include args
keys_arg(KEYS, 1, true)
local mode, token = ARGV[1], text_arg(ARGV[2], 'token')
local gen = redis.call('HGET', KEYS[1], 'gen')
if mode == 'begin' then
  if gen and string.sub(gen, 1, 9) == 'dropping:' then return gen end
  local tombstone = 'dropping:' .. token
  redis.call('HSET', KEYS[1], 'gen', tombstone)
  return tombstone
end
if mode == 'page' then
  if gen ~= token then return -1 end
  local deleted = 0
  for i = 2, #KEYS, 1000 do
    deleted = deleted + redis.call('UNLINK', unpack(KEYS, i, math.min(i + 999, #KEYS)))
  end
  return deleted
end
if mode == 'end' then
  if gen ~= token then return 0 end
  return redis.call('DEL', KEYS[1])
end
fail('INVALID', 'unknown drop step ' .. tostring(mode))

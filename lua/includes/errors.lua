--[[ errors: failing a call with a KVREDIS_<CODE> error reply, and the namespace generation check.
  Codes and their Python exceptions: kvredis.errors.LUA_ERROR_CODES (a test keeps them in step).
    INVALID  malformed arguments (checked before the first write, so a refused call writes nothing)
    LAYOUT   the namespace holds data this script cannot work with
    STALE    the namespace was recreated since the client loaded it
    BUDGET   the call would do more work than one call may (before the first write); the text
             starts with how many ops, and keys of the op after them, fit; the client sends the
             ops in calls of that size ]]

local function fail(code, message)
  error({err = 'KVREDIS_' .. code .. ' ' .. message})
end

-- Every command checks the namespace generation first: a client whose cached layout (bucket bits,
-- entry ids) belongs to an earlier incarnation of the namespace gets KVREDIS_STALE and reloads.
local function fail_stale()
  fail('STALE', 'namespace layout changed or was removed; reload it')
end

local function check_gen(meta_key, gen)
  if type(gen) ~= 'string' then fail('INVALID', 'the namespace generation is missing') end
  if redis.call('HGET', meta_key, 'gen') ~= gen then fail_stale() end
end

-- The meta record's gen and next_id, or nil when its gen is not the client's (a stale client:
-- one shard of a cluster call answers "STALE", a single-server call fails as check_gen does).
local function read_meta(meta_key, gen)
  if type(gen) ~= 'string' then fail('INVALID', 'the namespace generation is missing') end
  local meta = redis.call('HMGET', meta_key, 'gen', 'next_id')
  if meta[1] ~= gen then return nil end
  return meta
end

--[[ errors: failing a call with a KVREDIS_<CODE> error reply, and the namespace generation check.
  Codes and their Python exceptions: kvredis.errors.LUA_ERROR_CODES (a test keeps them in step).
    INVALID  malformed arguments (checked before the first write, so a refused call writes nothing)
    LAYOUT   the namespace holds data this script cannot work with
    STALE    the namespace was recreated since the client loaded it ]]

local function fail(code, message)
  error({err = 'KVREDIS_' .. code .. ' ' .. message})
end

-- Every command checks the namespace generation first: a client whose cached layout (bucket bits,
-- entry ids) belongs to an earlier incarnation of the namespace gets KVREDIS_STALE and reloads.
local function check_gen(meta_key, gen)
  if redis.call('HGET', meta_key, 'gen') ~= gen then
    fail('STALE', 'namespace layout changed or was removed; reload it')
  end
end

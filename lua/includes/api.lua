--[[ api: the protocol version check every function of the kvredis library makes first
  (kvredis.redis.functions builds it into each function; EVALSHA scripts are content-addressed
  and need none). The last argument of every call (of every function but kvredis_version) is
  the protocol version its caller speaks, "kvredis-api:<n>"; a call of another version, or one
  without it, fails KVREDIS_VERSION before anything is read or written, so a call is refused,
  never read with a meaning its caller did not give it. The function then sees its arguments
  without it. ]]
--@include errors

-- Check and take off the last of args (a function passes its own arguments): it must be marker, the
-- version of this library; library is the library's description, for the error message.
local function api_arg(args, marker, library)
  local n = #args
  local got = args[n]
  if got ~= marker then
    local said = 'no protocol version (its last argument must be "kvredis-api:<n>")'
    if type(got) == 'string' and #got <= 32 and string.find(got, '^kvredis%-api:%d+$') then
      said = got
    end
    fail('VERSION', 'the call speaks ' .. said .. ', the function library speaks ' .. marker
      .. ' (' .. library .. '): a client of another kvredis api; it keeps to EVALSHA or reloads '
      .. 'the library (docs/protocol.md, "Versions")')
  end
  args[n] = nil
end

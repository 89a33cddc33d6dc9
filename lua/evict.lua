#!lua flags=allow-oom,allow-cross-slot-keys
--[[ evict: remove exact pod entries from one request key, or from every request key an engine
  key maps to; empty request keys are deleted, and the engine mapping is dropped once none of
  its request keys holds any entry (live expiring entries included), all in this one atomic
  step.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe
  KEYS[3]     <ns>:sx, the gate key of the expiring buckets (includes/expiry): evicted entries
              leave them too
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits
  ARGV[5]     n, the number of encoded entries; ARGV[6..5+n] the entries (see includes/entries)
  ARGV[6+n]   number of ops, then the ops, each "R", the 8-byte request key, nent, nent x entry
              index; or "E", the 8-byte engine key, first, nent, nent x entry index
              (includes/program: one op, or the evicts by request key an evict by engine key
              refused as over budget became)
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_BUDGET when an evict by engine
              key's request keys reach too many chain-run ranges (includes/writes: the client
              evicts them by request key); both before the first write
  Returns     number of (request key, entry) pairs removed
  Complexity  O(request keys mapped x entries per key); entries never added are ignored ]]
--@include program
keys_arg(KEYS, 3)
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], nil, nil, ARGV[2], ARGV[3], ARGV[4], KEYS[3])
return run_program(k, read_program(ARGV, 5, nil, {R = true, E = true}), nil, 0)

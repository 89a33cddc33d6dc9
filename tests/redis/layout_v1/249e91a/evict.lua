#!lua flags=allow-oom,allow-cross-slot-keys
--[[ evict: remove exact pod entries from one request key, or from every request key an engine
  key maps to; empty request keys are deleted, and the engine mapping is dropped once none of
  its request keys holds any entry, all in this one atomic step.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe
  KEYS[3]     <ns>:sx, the gate key of the expiring buckets (includes/expiry): evicted entries
              leave them too
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits
  ARGV[5]     n, the number of encoded entries; ARGV[6..5+n] the entries (see includes/entries)
  ARGV[6+n..] one op: "R" (request key) or "E" (engine key), the 8-byte key, nent,
              nent x entry index
  Errors      KVREDIS_INVALID for malformed arguments, before the first write
  Returns     number of (request key, entry) pairs removed
  Complexity  O(request keys mapped x entries per key); entries never added are ignored ]]
--@include program
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], nil, nil, ARGV[2], ARGV[3], ARGV[4], KEYS[3])
return run_program(k, read_program(ARGV, 5, 1, {R = true, E = true}), nil, 0)

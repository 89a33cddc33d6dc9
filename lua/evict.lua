#!lua flags=allow-cross-slot-keys
--[[ evict: remove exact pod entries from one request key, or from every request key an engine
  key maps to; empty request keys are deleted, and the engine mapping is dropped once none of
  its request keys holds any entry, all in this one atomic step.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits                        ARGV[5] unused (the add ops' mapping cap)
  ARGV[6]     n, the number of encoded entries; ARGV[7..6+n] the entries (see _kvblock)
  ARGV[7+n..] one op: "R" (request key) or "E" (engine key), the 8-byte key, nent,
              nent x entry index
  Returns     number of (request key, entry) pairs removed
  Complexity  O(request keys mapped x entries per key); entries never added are ignored ]]
--@include _kvblock
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2])
local n = tonumber(ARGV[6])
local ents = {}
for i = 1, n do ents[i] = ARGV[6 + i] end
return run_ops(k, ents, 7 + n, 1, tonumber(ARGV[5]))

#!lua flags=allow-cross-slot-keys
--[[ add: store pod entries under request keys and record engine -> request key mappings.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe    KEYS[3] <ns>:pi    KEYS[4] <ns>:pp
  ARGV[1]     namespace generation (KVREDIS_STALE if it differs from <ns>:meta gen)
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits                        ARGV[5] most request keys kept per engine key
  ARGV[6]     n, the number of encoded entries; ARGV[7..6+n] the entries (see _kvblock)
  ARGV[7+n..] one op: "A", nent, nent x entry index, request keys (hash blob),
              engine/request key pairs (hash blob: engine key, request key, ...)
  Returns     0
  Complexity  O(request keys x entries per key + mappings); new entries are interned once ]]
--@include _kvblock
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4])
local n = tonumber(ARGV[6])
local ents = {}
for i = 1, n do ents[i] = ARGV[6 + i] end
return run_ops(k, ents, 7 + n, 1, tonumber(ARGV[5]))

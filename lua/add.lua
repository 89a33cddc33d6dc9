#!lua flags=allow-cross-slot-keys
--[[ add: store pod entries under request keys and record engine -> request key mappings.
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pe    KEYS[3] <ns>:pi    KEYS[4] <ns>:pp
  KEYS[5]     <ns>:sx, the gate key of the expiring buckets (includes/expiry)
  ARGV[1]     namespace generation (KVREDIS_STALE if it differs from <ns>:meta gen)
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] engine bucket prefix "<ns>:e:"
  ARGV[4]     bucket bits                        ARGV[5] most request keys kept per engine key
  ARGV[6]     ttl in ms of the added (speculative) entries, 0 for none
  ARGV[7]     n, the number of encoded entries; ARGV[8..7+n] the entries (see includes/entries)
  ARGV[8+n..] one op: "A", nent, nent x entry index, request keys (hash blob),
              engine/request key pairs (hash blob: engine key, request key, ...); or "P",
              8-byte parent key (the key before the first one in the chain), then as "A"
  Errors      KVREDIS_INVALID for malformed arguments, KVREDIS_LAYOUT when the entry id space
              cannot hold the new entries, KVREDIS_BUDGET when the request keys (more than one)
              reach too many chain-run ranges (includes/writes); all before the first write
  Also        with a ttl the entries go to the expiring buckets (includes/expiry); a confirmed
              entry replaces its pod's expiring speculative entries under the keys it is added to
  Returns     0
  Complexity  O(request keys x entries per key + mappings); new entries are interned once;
              without hash field expiry, each expiring bucket written is read whole ]]
--@include program
keys_arg(KEYS, 5)
check_gen(KEYS[1], ARGV[1])
local k = write_context(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[4], KEYS[5])
local cap = int_arg(ARGV[5], 'request keys per engine key', 1, 2147483647)
local ms = int_arg(ARGV[6], 'ttl ms', 0, 2592000000)
local program = read_program(ARGV, 7, 1, {A = true})
return run_program(k, program, cap, ms)

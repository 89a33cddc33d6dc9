#!lua flags=no-writes,allow-cross-slot-keys
--[[ lookup: walk a prefix chain of request keys and return their entry ids until the first miss;
  a long chain comes in parts (one call each), and the stamps each part returns keep the parts
  true together (includes/stamps).
  KEYS[1]     <ns>:meta    KEYS[2] <ns>:pi    KEYS[3] <ns>:pp    KEYS[4] <ns>:sx (gate key of
              the expiring buckets, includes/expiry)
  ARGV[1]     namespace generation
  ARGV[2]     request bucket prefix "<ns>:r:"    ARGV[3] bucket bits
  ARGV[4]     highest entry id (decimal) up to which the client knows every definition
  ARGV[5]     f, the number of pods in the filter (0 = all pods); ARGV[6..5+f] the pod ids
  ARGV[6+f]   the request keys in chain order (hash blob)
  ARGV[7+f]   1 when keys of the chain follow these, else 0 (absent: 0)
  ARGV[8+f]   c, the pods the chain's earlier parts returned (0, or absent, for the first
              part), then c x (pod id, its stamp as the earlier parts replied it)
  Returns     array: [1] the id up to which the client now knows every definition (the
              client's one plus at most 256 of the ids allocated after it); [2] flat (id, encoded
              entry) definitions of those ids and of hit ids above them ("" for an id whose
              definition was reclaimed); [3] stamps (includes/stamps), flat (pod id, stamp): the
              c pods given, each with its new stamp or "" when it lost an entry since (the
              client drops that pod from this part on), then, when the chain goes on
              (ARGV[7+f] is 1, or the walk was cut), every other pod of the hit ids with its
              stamp; empty for a chain read in one call; [4..] pairs (n, id list): the next n
              hit keys of the chain hold these (filtered) ids, in chain order; the walk
              (includes/walk) stops at the first key with no (filtered) entry: keys after the
              miss are never read; expiring speculative entries (includes/expiry) count while
              live: a key held only by them is a hit; a walk stopped by its work limit
              (includes/walk: the chain's keys reach many fragmented runs) ends the array with
              one more element, the position of the first key not walked: the client walks on
              from there
  Complexity  O(hit keys / keys per run + distinct id lists x entries per list) calls and
              list work, plus O(hit keys) bytes compared; O(hit keys) calls while an expiring
              entry may be live (one EXISTS of the gate key otherwise); with stamps, one HMGET
              of the hit ids' definitions and one of the pods' stamps
  Errors      KVREDIS_STALE for a generation not the namespace's, KVREDIS_INVALID for a malformed
              pod filter, flag, c or stamp ]]
--@include lookup_chain
--@include args
keys_arg(KEYS, 4)
local meta = read_meta(KEYS[1], ARGV[1]) or fail_stale()
local known = int_arg(ARGV[4], 'known entry id', 0, MAX_ENTRY_ID)
local pods, at = pod_filter_arg(ARGV, 5)
local chain = blob_arg(ARGV[at], HASH_WIDTH, 'request keys')
local more, carried = lookup_continuation(ARGV, at + 1)
return lookup_chain(meta, KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], ARGV[3], known, pods,
  chain, more, carried)

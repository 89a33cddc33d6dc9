#!lua flags=no-writes
--[[ ping: do nothing and return 1; the floor of one EVALSHA round trip, used by health checks
  and benchmarks.
  KEYS        none
  ARGV        none
  Returns     integer 1
  Errors      none
  Complexity  O(1) ]]
return 1

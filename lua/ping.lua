--[[ ping: a no-op script, the floor of any script round trip (used by benchmarks and health checks).
  KEYS        none
  ARGV        none
  Returns     1
  Complexity  O(1) ]]
return 1

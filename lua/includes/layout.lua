--[[ layout: the widths of ids and hashes, and bucket key names (the spec: kvredis.redis.layout).
  Bucket of a hash h: its low `bits` bits, named <prefix><suffix> where the suffix is those bits
  as ceil(bits / 8) big-endian bytes (binary), i.e. the last bytes of h with the top one masked.
  The scripts build bucket key names from the hashes they are given or read (see
  docs/design/key-layout.md, and docs/design/cluster.md for what that means in a cluster).
  Hashes stay strings: they never become Lua numbers. ]]
--@include args

local ID_WIDTH = 4
local HASH_WIDTH = 8
local MIN_BUCKET_BITS = 1
local MAX_BUCKET_BITS = 24

-- A function h -> bucket key name, for one key prefix and a bucket bit count (decimal, in
-- MIN_BUCKET_BITS..MAX_BUCKET_BITS).
local function bucket_namer(prefix, bits_arg)
  text_arg(prefix, 'bucket prefix')
  local bits = int_arg(bits_arg, 'bucket bits', MIN_BUCKET_BITS, MAX_BUCKET_BITS)
  local nbytes = math.ceil(bits / 8)
  local partial = bits % 8
  if partial == 0 then
    local from = 9 - nbytes
    return function(h) return prefix .. string.sub(h, from) end
  end
  local mask, top = 2 ^ partial - 1, 9 - nbytes
  return function(h)
    return prefix .. string.char(bit.band(string.byte(h, top), mask)) .. string.sub(h, top + 1)
  end
end

package main

// Block keys (docs/protocol.md, "Block keys"): the two schemes of kvredis, chained from a
// model's root over the full blocks of a prompt's token ids.

import (
	"encoding/binary"
	"fmt"
)

// scheme is how block keys are computed: what a kvredis namespace records in the "scheme" field
// of <ns>:meta as "<algo>:<block size>:<hash seed>".
type scheme struct {
	algo      string
	blockSize int
	seed      string
}

func (s scheme) text() string { return fmt.Sprintf("%s:%d:%s", s.algo, s.blockSize, s.seed) }

func (s scheme) String() string {
	return fmt.Sprintf("%s (block size %d, hash seed '%s')", s.algo, s.blockSize, s.seed)
}

// blockKeys are the request keys of the full blocks of tokens, chained from the model's root.
func (s scheme) blockKeys(model string, tokens []uint64) ([]uint64, error) {
	switch s.algo {
	case "xxh3_64":
		return xxh3Keys(s.seed, model, tokens, s.blockSize), nil
	case "fnv64a_cbor":
		return fnvKeys(s.seed, model, tokens, s.blockSize), nil
	}
	return nil, fmt.Errorf("unknown hash algorithm %q (xxh3_64 or fnv64a_cbor)", s.algo)
}

// ---- xxh3_64 (kvredis's default; kvredis/hashing/xxh3.py) ----

// xxh3Root is XXH3(pad4("KVRXXH3\x01" u32(bs) u32(len S) S u32(len N) N) "RR", seed 0), all
// integers little-endian.
func xxh3Root(seed, model string, blockSize int) uint64 {
	msg := []byte("KVRXXH3\x01")
	msg = binary.LittleEndian.AppendUint32(msg, uint32(blockSize))
	msg = binary.LittleEndian.AppendUint32(msg, uint32(len(seed)))
	msg = append(msg, seed...)
	msg = binary.LittleEndian.AppendUint32(msg, uint32(len(model)))
	msg = append(msg, model...)
	for len(msg)%4 != 0 {
		msg = append(msg, 0)
	}
	return xxh3(append(msg, 'R', 'R'), 0)
}

// xxh3Keys chains XXH3(the block's token ids as u32 little-endian, seed = parent key).
func xxh3Keys(seed, model string, tokens []uint64, blockSize int) []uint64 {
	parent := xxh3Root(seed, model, blockSize)
	var keys []uint64
	block := make([]byte, 4*blockSize)
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		for i, t := range tokens[start : start+blockSize] {
			binary.LittleEndian.PutUint32(block[4*i:], uint32(t))
		}
		parent = xxh3(block, parent)
		keys = append(keys, parent)
	}
	return keys
}

// ---- fnv64a_cbor (llm-d's Go token processor; kvredis/hashing/fnv_cbor.py) ----

const (
	fnvOffset = 0xcbf29ce484222325
	fnvPrime  = 0x100000001b3
)

func fnv1a64(data []byte) uint64 {
	h := uint64(fnvOffset)
	for _, b := range data {
		h ^= uint64(b)
		h *= fnvPrime
	}
	return h
}

// cborHead appends the shortest CBOR head of major type major with argument v.
func cborHead(out []byte, major byte, v uint64) []byte {
	mt := major << 5
	switch {
	case v < 24:
		return append(out, mt|byte(v))
	case v <= 0xff:
		return append(out, mt|24, byte(v))
	case v <= 0xffff:
		return append(out, mt|25, byte(v>>8), byte(v))
	case v <= 0xffffffff:
		return append(out, mt|26, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	out = append(out, mt|27)
	return binary.BigEndian.AppendUint64(out, v)
}

// fnvRoot is H(FNV-1a-64(seed), null, model): canonical CBOR [parent, null, model].
func fnvRoot(seed, model string) uint64 {
	buf := []byte{0x83}
	buf = cborHead(buf, 0, fnv1a64([]byte(seed)))
	buf = append(buf, 0xf6)
	buf = cborHead(buf, 3, uint64(len(model)))
	buf = append(buf, model...)
	return fnv1a64(buf)
}

// fnvKeys chains H(parent, tokens, null) over the full blocks of tokens.
func fnvKeys(seed, model string, tokens []uint64, blockSize int) []uint64 {
	parent := fnvRoot(seed, model)
	var keys []uint64
	for start := 0; start+blockSize <= len(tokens); start += blockSize {
		buf := []byte{0x83}
		buf = cborHead(buf, 0, parent)
		buf = cborHead(buf, 4, uint64(blockSize))
		for _, t := range tokens[start : start+blockSize] {
			buf = cborHead(buf, 0, t)
		}
		buf = append(buf, 0xf6)
		parent = fnv1a64(buf)
		keys = append(keys, parent)
	}
	return keys
}

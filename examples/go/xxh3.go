package main

// XXH3-64 (64-bit XXH3 with a seed), standard library only, written from the XXH3 format
// specification (xxHash's doc/xxhash_spec.md): inputs of 0-16, 17-128 and 129-240 bytes are
// mixed directly, longer ones through eight 64-bit accumulators over 64-byte stripes, scrambled
// after every 1024-byte block. tests/examples checks it against the xxhash library digest for
// digest on every length class, and its block keys byte for byte against Python's.

import (
	"encoding/binary"
	"encoding/hex"
	"math/bits"
)

const (
	prime32_1 = 0x9E3779B1
	prime32_2 = 0x85EBCA77
	prime32_3 = 0xC2B2AE3D
	prime64_1 = 0x9E3779B185EBCA87
	prime64_2 = 0xC2B2AE3D27D4EB4F
	prime64_3 = 0x165667B19E3779F9
	prime64_4 = 0x85EBCA77C2B2AE63
	prime64_5 = 0x27D4EB2F165667C5
	primeMx1  = 0x165667919E3779F9
	primeMx2  = 0x9FB21C651E98DF25
)

// kSecret is XXH3's default secret (192 bytes).
var kSecret = mustHex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f" +
	"cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c" +
	"3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8" +
	"a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364" +
	"eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e" +
	"2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")

func mustHex(s string) []byte {
	out, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return out
}

func le64(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }
func le32(b []byte) uint32 { return binary.LittleEndian.Uint32(b) }

// mulFold64 is the 128-bit product of a and b, its two halves xored.
func mulFold64(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

func xxh64Avalanche(h uint64) uint64 {
	h ^= h >> 33
	h *= prime64_2
	h ^= h >> 29
	h *= prime64_3
	return h ^ h>>32
}

func xxh3Avalanche(h uint64) uint64 {
	h ^= h >> 37
	h *= primeMx1
	return h ^ h>>32
}

func rrmxmx(h uint64, n uint64) uint64 {
	h ^= bits.RotateLeft64(h, 49) ^ bits.RotateLeft64(h, 24)
	h *= primeMx2
	h ^= (h >> 35) + n
	h *= primeMx2
	return h ^ h>>28
}

func mix16(in, secret []byte, seed uint64) uint64 {
	return mulFold64(le64(in)^(le64(secret)+seed), le64(in[8:])^(le64(secret[8:])-seed))
}

// xxh3 is XXH3_64bits_withSeed(data, seed).
func xxh3(data []byte, seed uint64) uint64 {
	n := len(data)
	s := kSecret
	switch {
	case n == 0:
		return xxh64Avalanche(seed ^ le64(s[56:]) ^ le64(s[64:]))
	case n <= 3:
		combined := uint32(data[0])<<16 | uint32(data[n>>1])<<24 | uint32(data[n-1]) | uint32(n)<<8
		flip := uint64(le32(s)^le32(s[4:])) + seed
		return xxh64Avalanche(uint64(combined) ^ flip)
	case n <= 8:
		seed ^= uint64(bits.ReverseBytes32(uint32(seed))) << 32
		in64 := uint64(le32(data[n-4:])) + uint64(le32(data))<<32
		flip := (le64(s[8:]) ^ le64(s[16:])) - seed
		return rrmxmx(in64^flip, uint64(n))
	case n <= 16:
		lo := le64(data) ^ ((le64(s[24:]) ^ le64(s[32:])) + seed)
		hi := le64(data[n-8:]) ^ ((le64(s[40:]) ^ le64(s[48:])) - seed)
		acc := uint64(n) + bits.ReverseBytes64(lo) + hi + mulFold64(lo, hi)
		return xxh3Avalanche(acc)
	case n <= 128:
		acc := uint64(n) * prime64_1
		if n > 32 {
			if n > 64 {
				if n > 96 {
					acc += mix16(data[48:], s[96:], seed) + mix16(data[n-64:], s[112:], seed)
				}
				acc += mix16(data[32:], s[64:], seed) + mix16(data[n-48:], s[80:], seed)
			}
			acc += mix16(data[16:], s[32:], seed) + mix16(data[n-32:], s[48:], seed)
		}
		acc += mix16(data, s, seed) + mix16(data[n-16:], s[16:], seed)
		return xxh3Avalanche(acc)
	case n <= 240:
		acc := uint64(n) * prime64_1
		for i := 0; i < 8; i++ {
			acc += mix16(data[16*i:], s[16*i:], seed)
		}
		acc = xxh3Avalanche(acc)
		for i := 8; i < n/16; i++ {
			acc += mix16(data[16*i:], s[16*(i-8)+3:], seed)
		}
		acc += mix16(data[n-16:], s[136-17:], seed)
		return xxh3Avalanche(acc)
	}
	if seed != 0 { // the long hash reads a secret derived from the seed
		custom := make([]byte, len(s))
		for i := 0; i < len(s); i += 16 {
			binary.LittleEndian.PutUint64(custom[i:], le64(s[i:])+seed)
			binary.LittleEndian.PutUint64(custom[i+8:], le64(s[i+8:])-seed)
		}
		s = custom
	}
	return xxh3Long(data, s)
}

func accumulate512(acc *[8]uint64, in, secret []byte) {
	for i := 0; i < 8; i++ {
		v := le64(in[8*i:])
		k := v ^ le64(secret[8*i:])
		acc[i^1] += v
		acc[i] += uint64(uint32(k)) * (k >> 32)
	}
}

func xxh3Long(data, secret []byte) uint64 {
	acc := [8]uint64{prime32_3, prime64_1, prime64_2, prime64_3, prime64_4, prime32_2, prime64_5, prime32_1}
	n := len(data)
	stripes := (len(secret) - 64) / 8 // per block
	block := 64 * stripes
	blocks := (n - 1) / block
	for b := 0; b < blocks; b++ {
		for i := 0; i < stripes; i++ {
			accumulate512(&acc, data[b*block+64*i:], secret[8*i:])
		}
		last := secret[len(secret)-64:]
		for i := range acc {
			a := acc[i]
			a ^= a >> 47
			a ^= le64(last[8*i:])
			acc[i] = a * prime32_1
		}
	}
	for i := 0; i < ((n-1)-block*blocks)/64; i++ {
		accumulate512(&acc, data[blocks*block+64*i:], secret[8*i:])
	}
	accumulate512(&acc, data[n-64:], secret[len(secret)-64-7:])
	result := uint64(n) * prime64_1
	for i := 0; i < 4; i++ {
		result += mulFold64(acc[2*i]^le64(secret[11+16*i:]), acc[2*i+1]^le64(secret[11+16*i+8:]))
	}
	return xxh3Avalanche(result)
}

"""Independent references for the hashing tests, and the small builders the tests share.

The reference implementations are written from the published definitions (the byte layouts in
the docstrings of ``kvredis.hashing.xxh3`` and ``kvredis.hashing.fnv_cbor``, and the llm-d
``kvblock`` definition of ``fnv64a_cbor``), not from the implementation: a straightforward
recursive CBOR encoder, a byte-at-a-time FNV-1a, and ``struct``-built xxh3 messages hashed with
the ``xxhash.xxh3_64`` object.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
import xxhash
from hypothesis import strategies as st

from kvredis.features import BlockExtraFeatures, MMHash
from kvredis.hashing import HASH_ALGOS, ChunkedTokenDatabase, TokenProcessorConfig


def ref_cbor(obj: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of None/uint/str/list/dict."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * size):
                return bytes([major << 5 | info]) + n.to_bytes(size, "big")
        raise AssertionError(n)

    if obj is None:
        return b"\xf6"
    if isinstance(obj, int):
        assert obj >= 0
        return head(0, obj)
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return head(3, len(raw)) + raw
    if isinstance(obj, list):
        return head(4, len(obj)) + b"".join(ref_cbor(item) for item in obj)
    if isinstance(obj, dict):
        pairs = sorted(
            ((ref_cbor(k), ref_cbor(v)) for k, v in obj.items()),
            key=lambda kv: (len(kv[0]), kv[0]),
        )
        return head(5, len(pairs)) + b"".join(k + v for k, v in pairs)
    raise AssertionError(type(obj))


def ref_fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) % 2**64
    return h


def ref_fnv_h(parent: int, tokens: list[int] | None, extra: object) -> int:
    return ref_fnv1a64(ref_cbor([parent, tokens, extra]))


def u32(x: int) -> bytes:
    return struct.pack("<I", x)


def pad4(b: bytes) -> bytes:
    return b + b"\x00" * ((4 - len(b) % 4) % 4)


def ref_root(algo: str, model: str, *, block_size: int = 16, seed: str = "") -> int:
    if algo == "fnv64a_cbor":
        return ref_fnv_h(ref_fnv1a64(seed.encode()), None, model)
    s, n = seed.encode(), model.encode()
    root_msg = pad4(b"KVRXXH3\x01" + u32(block_size) + u32(len(s)) + s + u32(len(n)) + n) + b"RR"
    return xxhash.xxh3_64(root_msg, seed=0).intdigest()


def ref_keys(
    algo: str,
    tokens: Sequence[int],
    model: str,
    *,
    block_size: int = 16,
    seed: str = "",
    parent: int = 0,
    extra: Sequence[Sequence[str] | None] | None = None,
) -> list[int]:
    """Block keys by the definitions, one block at a time."""
    n_blocks = len(tokens) // block_size
    blocks = [list(tokens[i * block_size : (i + 1) * block_size]) for i in range(n_blocks)]
    extras: list[Sequence[str] | None] = list(extra) if extra is not None else [None] * n_blocks
    keys = []
    prev = parent or ref_root(algo, model, block_size=block_size, seed=seed)
    if algo == "fnv64a_cbor":
        for toks, ids in zip(blocks, extras, strict=True):
            prev = ref_fnv_h(prev, toks, [{"Hash": i} for i in ids] if ids else None)
            keys.append(prev)
        return keys
    for toks, ids in zip(blocks, extras, strict=True):
        msg = b"".join(u32(t) for t in toks)
        if ids:
            e = b"".join(u32(len(i.encode())) + i.encode() for i in ids)
            msg = pad4(msg + e) + u32(len(ids)) + u32(block_size) + b"M"
        prev = xxhash.xxh3_64(msg, seed=prev).intdigest()
        keys.append(prev)
    return keys


def features(extra: Sequence[Sequence[str] | None]) -> list[BlockExtraFeatures | None]:
    return [None if ids is None else BlockExtraFeatures([MMHash(i) for i in ids]) for ids in extra]


def db(algo: str, block_size: int = 16, seed: str = "") -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(
        TokenProcessorConfig(block_size_tokens=block_size, hash_seed=seed, hash_algo=algo)
    )


algos = pytest.mark.parametrize("algo", HASH_ALGOS)

WIDTHS = [0, 23, 24, 255, 256, 65535, 65536, 4294967295]  # every CBOR integer width

token_ids = st.one_of(
    st.integers(0, 23), st.integers(0, 255), st.integers(0, 65535), st.integers(0, 2**32 - 1)
)
identifiers = st.lists(st.text(max_size=6), min_size=1, max_size=3)

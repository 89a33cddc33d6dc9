"""Cache salt: mixed into the chain root of both schemes, byte for byte as documented."""

from __future__ import annotations

import pytest
import xxhash

from kvredis.errors import InvalidInputError
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.hashing.fnv_cbor import cbor_encode, fnv1a64
from kvredis.indexer import Indexer
from kvredis.memory import InMemoryIndex
from kvredis.types import PodEntry

ALGOS = ["xxh3_64", "fnv64a_cbor"]
TOKENS = list(range(64))


def db(algo: str, block_size: int = 16, seed: str = "") -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(
        TokenProcessorConfig(block_size_tokens=block_size, hash_algo=algo, hash_seed=seed)
    )


def test_xxh3_salted_root_bytes() -> None:
    # magic | 02000000: bs 2 | 00000000: seed "" | 01000000 6d: "m" | 02000000 7331: "s1" |
    # 00: pad to 4 | "RS"
    root = b"KVRXXH3\x01" + bytes.fromhex("0200000000000000010000006d02000000733100")
    assert db("xxh3_64", 2).root_key("m", cache_salt="s1") == xxhash.xxh3_64_intdigest(
        root + b"RS", 0
    )


def test_fnv_salted_root_bytes() -> None:
    payload = bytearray(b"\x83")
    cbor_encode(fnv1a64(b"seed"), payload)
    cbor_encode(None, payload)
    cbor_encode(["llama", "s1"], payload)
    assert db("fnv64a_cbor", seed="seed").root_key("llama", cache_salt="s1") == fnv1a64(payload)


@pytest.mark.parametrize("algo", ALGOS)
def test_salt_isolates_chains(algo: str) -> None:
    p = db(algo)
    plain = p.tokens_to_kv_block_keys(0, TOKENS, "m")
    s1 = p.tokens_to_kv_block_keys(0, TOKENS, "m", cache_salt="s1")
    s2 = p.tokens_to_kv_block_keys(0, TOKENS, "m", cache_salt="s2")
    assert len({*plain, *s1, *s2}) == 12
    assert p.tokens_to_kv_block_keys(0, TOKENS, "m", cache_salt="s1") == s1
    # The empty salt is no salt (vLLM and SGLang ignore it too).
    assert p.tokens_to_kv_block_keys(0, TOKENS, "m", cache_salt="") == plain
    # Chaining still holds: the salt lives in the root only.
    assert p.tokens_to_kv_block_keys(s1[1], TOKENS[32:], "m") == s1[2:]
    # A salt cannot be moved between model names or into them.
    assert p.root_key("ms", cache_salt="1") != p.root_key("m", cache_salt="s1")


@pytest.mark.parametrize("algo", ALGOS)
def test_salt_with_a_parent_is_refused(algo: str) -> None:
    with pytest.raises(InvalidInputError, match="cache_salt applies to the chain root"):
        db(algo).tokens_to_kv_block_keys(5, TOKENS, "m", cache_salt="s1")
    with pytest.raises(InvalidInputError, match="cache_salt must be a str"):
        db(algo).tokens_to_kv_block_keys(0, TOKENS, "m", cache_salt=1)  # type: ignore[arg-type]


def test_indexer_takes_the_salt() -> None:
    index = InMemoryIndex()
    p = db("xxh3_64")
    indexer = Indexer(index, p)
    salted = indexer.compute_block_keys(TOKENS, "m", cache_salt="s1")
    assert salted == p.tokens_to_kv_block_keys(0, TOKENS, "m", cache_salt="s1")
    assert indexer.compute_block_keys(TOKENS, "m") != salted
    index.add(None, salted, [PodEntry("pod-a", "gpu")])
    assert indexer.score_tokens(TOKENS, "m", cache_salt="s1") == {"pod-a": 4.0}
    assert indexer.score_tokens(TOKENS, "m") == {}

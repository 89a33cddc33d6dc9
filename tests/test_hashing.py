"""Token processor: golden vectors, reference implementations, chain properties, validation.

The reference implementations below are written from the published definitions (the module
docstring of ``kvredis.hashing`` and the llm-d ``kvblock`` definition of ``fnv64a_cbor``), not
from the implementation: a straightforward recursive CBOR encoder, a byte-at-a-time FNV-1a, and
``struct``-built xxh3 messages hashed with the ``xxhash.xxh3_64`` object.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from array import array
from collections.abc import Sequence

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis import hashing
from kvredis.errors import ConfigError, InvalidInputError
from kvredis.features import BlockExtraFeatures, MMHash
from kvredis.hashing import (
    HASH_ALGOS,
    ChunkedTokenDatabase,
    TokenProcessor,
    TokenProcessorConfig,
)

# ---------------------------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------------------------


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

# ---------------------------------------------------------------------------------------------
# the references themselves, against published vectors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "encoded"),
    [  # RFC 8949 appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
        (18446744073709551615, "1bffffffffffffffff"),
        (None, "f6"),
        ("", "60"),
        ("a", "6161"),
        ("IETF", "6449455446"),
        ("\u00fc", "62c3bc"),
        ([], "80"),
        ([1, [2, 3], [4, 5]], "8301820203820405"),
        (list(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
        ({"a": 1, "b": [2, 3]}, "a26161016162820203"),
        # canonical key order: shorter keys first
        ({"bb": 1, "a": 2}, "a2616102626262" + "01"),
        ([7, [1, 2, 3], None], "8307830102" + "03f6"),
    ],
)
def test_reference_cbor_matches_published_vectors(value: object, encoded: str) -> None:
    assert ref_cbor(value).hex() == encoded


def test_implementation_cbor_encoder_matches_reference() -> None:
    values: list[object] = [
        0,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        2**64 - 1,
        None,
        "",
        "a" * 23,
        "\u00e9" * 200,
        [],
        [1, [2, [3, None]]],
        list(range(300)),
        {"Hash": "img"},
        {"b": 1, "aa": 2, "a": 3, "ab": {"z": None}},
    ]
    for value in values:
        out = bytearray()
        hashing._cbor_encode(value, out)
        assert bytes(out) == ref_cbor(value), value
    for bad in (-1, 2**64, True, 1.5, b"x", {1: 2}):
        with pytest.raises(InvalidInputError):
            hashing._cbor_encode(bad, bytearray())


@pytest.mark.parametrize(
    ("data", "digest"),
    [(b"", 0xCBF29CE484222325), (b"a", 0xAF63DC4C8601EC8C), (b"foobar", 0x85944171F73967E8)],
)
def test_reference_fnv1a64_matches_published_vectors(data: bytes, digest: int) -> None:
    assert ref_fnv1a64(data) == digest


# ---------------------------------------------------------------------------------------------
# golden vectors (derived with the references above; both the implementation and the
# references must keep producing them)
# ---------------------------------------------------------------------------------------------

WIDTHS = [0, 23, 24, 255, 256, 65535, 65536, 4294967295]  # every CBOR integer width

GOLDEN: dict[str, dict[str, list[int]]] = {
    "fnv64a_cbor": {
        "root": [17515353698173365712],
        "plain": [9540012594951042066, 16921089685996993662],
        "seeded": [9813823192409008620, 682745025325898328],
        "widths": [8078559862639537929],
        "multimodal": [3617441907670486243, 3180482294496593672],
        "parent": [18137631916912190772, 10945505651717803727],
    },
    "xxh3_64": {
        "root": [8044481312616520306],
        "plain": [16085461295652143629, 1789221180696624359],
        "seeded": [9829702935778301529, 5423237596058905403],
        "widths": [5218838959922454925],
        "multimodal": [11273059169360330803, 7335300795518578555],
        "parent": [2043797638476133447, 5278559266387306128],
    },
}

GOLDEN_CASES: dict[str, dict[str, object]] = {
    "plain": {"tokens": list(range(1, 33)), "model": "test-model"},
    "seeded": {"tokens": list(range(1, 33)), "model": "test-model", "seed": "test-seed"},
    "widths": {"tokens": WIDTHS * 2 + [7], "model": "m"},
    "multimodal": {
        "tokens": list(range(40)),
        "model": "llava",
        "extra": [None, ["img-a", "img-b"]],
    },
    "parent": {"tokens": list(range(1, 10)), "model": "m", "block_size": 4, "parent": 12345},
}


def _case_keys(algo: str, case: dict[str, object], *, reference: bool) -> list[int]:
    tokens = case["tokens"]
    assert isinstance(tokens, list)
    model = str(case["model"])
    block_size = int(case.get("block_size", 16))  # type: ignore[call-overload]
    seed = str(case.get("seed", ""))
    parent = int(case.get("parent", 0))  # type: ignore[call-overload]
    extra = case.get("extra")
    if reference:
        return ref_keys(
            algo,
            tokens,
            model,
            block_size=block_size,
            seed=seed,
            parent=parent,
            extra=extra,  # type: ignore[arg-type]
        )
    return db(algo, block_size, seed).tokens_to_kv_block_keys(
        parent,
        tokens,
        model,
        features(extra) if extra is not None else None,  # type: ignore[arg-type]
    )


@algos
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_vectors(algo: str, name: str) -> None:
    case = GOLDEN_CASES[name]
    expected = GOLDEN[algo][name]
    assert _case_keys(algo, case, reference=True) == expected
    assert _case_keys(algo, case, reference=False) == expected


@algos
def test_golden_roots(algo: str) -> None:
    (expected,) = GOLDEN[algo]["root"]
    assert ref_root(algo, "test-model") == expected
    assert db(algo).root_key("test-model") == expected
    # The root is the parent of the first block.
    tokens = list(range(1, 17))
    assert db(algo).tokens_to_kv_block_keys(0, tokens, "test-model") == db(
        algo
    ).tokens_to_kv_block_keys(expected, tokens, "test-model")


def test_fnv_root_is_defined_from_seed_and_model() -> None:
    seed_hash = ref_fnv1a64(b"test-seed")
    expected = ref_fnv1a64(bytes([0x83]) + ref_cbor(seed_hash) + b"\xf6" + ref_cbor("llama"))
    assert db("fnv64a_cbor", seed="test-seed").root_key("llama") == expected


def test_fnv_block_payload_bytes() -> None:
    """A text block hashes ``83 <parent> <array of tokens> f6``; multimodal blocks carry maps."""
    processor = db("fnv64a_cbor", block_size=3)
    # 83: array(3) | 1a 00010000: parent 65536 | 83 01 1818 19ffff: [1, 24, 65535] | f6: null
    payload = bytes.fromhex("831a000100008301181819fffff6")
    assert processor.tokens_to_kv_block_keys(65536, [1, 24, 65535], "m") == [ref_fnv1a64(payload)]
    # 83 | 05: parent | 83 010203: tokens | 81 a1 64 "Hash" 61 "x": [{"Hash": "x"}]
    mm_payload = bytes.fromhex("83058301020381a164486173686178")
    assert processor.tokens_to_kv_block_keys(5, [1, 2, 3], "m", features([["x"]])) == [
        ref_fnv1a64(mm_payload)
    ]


# These values were computed by the Go fxamacker/cbor + hash/fnv implementation of the definition
# (Go 1.19, fxamacker/cbor v2.4.0 with cbor.CanonicalEncOptions(), hashing the CBOR of
# []interface{}{parent uint64, tokens []uint32, extra} with fnv.New64a, as llm-d's kvblock token
# processor does; extra is nil for text blocks, the model name for the root, and
# []MMHash{{Hash: id}, ...} for multimodal blocks). Fields: (seed, model, block size, parent,
# tokens, per-block identifiers or None, root of the model, keys).
GO_VECTORS: list[
    tuple[str, str, int, int, list[int], list[list[str] | None] | None, int, list[int]]
] = [
    ("", "", 1, 0, WIDTHS, None, 155877178866718358, [
        9606260442538163877, 4047987399048154612, 13081790588459777252, 586235599674848574,
        15022323966910520978, 5800579201535832762, 853365100112538891, 11447010254833598769,
    ]),
    ("42", "meta-llama/Llama-3.1-8B-Instruct", 4, 0, [*WIDTHS, 9, 9], None, 14719020265107256041,
     [14802313545970200705, 16486575558929666096]),
    ("h\u00e9llo-\u79cd\u5b50-\U0001f642", "\u6a21\u578b-\u00fc", 16, 0, WIDTHS * 4, None,
     5729389165289478078, [1587171383948804767, 3889362789533552223]),
    ("42", "m", 4, 2**64 - 1, WIDTHS, None, 13673417957312747559,
     [13241354489957323985, 8668141808575716276]),
    ("42", "m", 16, 2**64 - 2, WIDTHS * 2, None, 13673417957312747559, [5626701027625233478]),
    ("", "m", 1, 2**32, [4294967295, 0, 65536], None, 11374735546233341228,
     [4125272942863533819, 12506419591365686029, 14080645035433170821]),
    ("", "llava", 4, 0, [*WIDTHS, 1, 2, 3, 4],
     [None, ["img-0a1b2c"], ["img-0a1b2c", "audio-\u00ff-\U0001f642"]], 5993591407126103277,
     [6946167106754517471, 16470652099316187948, 14855796439924182596]),
    ("42", "llava", 1, 2**64 - 1, [24, 255, 256], [["x"], None, ["a" * 30, "b" * 300]],
     8066993263751869806, [11843489739114013545, 16045392082482425380, 10332238162967407457]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("seed", "model", "block_size", "parent", "tokens", "extra", "root", "keys"), GO_VECTORS
)
def test_fnv64a_cbor_matches_go_computed_vectors(
    seed: str,
    model: str,
    block_size: int,
    parent: int,
    tokens: list[int],
    extra: list[list[str] | None] | None,
    root: int,
    keys: list[int],
) -> None:
    processor = db("fnv64a_cbor", block_size, seed)
    assert processor.root_key(model) == root
    feats = None if extra is None else features(extra)
    assert processor.tokens_to_kv_block_keys(parent, tokens, model, feats) == keys
    if parent == 0:
        assert processor.tokens_to_kv_block_keys(root, tokens, model, feats) == keys


# ---------------------------------------------------------------------------------------------
# agreement with the references on random inputs
# ---------------------------------------------------------------------------------------------

token_ids = st.one_of(
    st.integers(0, 23), st.integers(0, 255), st.integers(0, 65535), st.integers(0, 2**32 - 1)
)
identifiers = st.lists(st.text(max_size=6), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    tokens=st.lists(token_ids, max_size=70),
    block_size=st.integers(1, 20),
    seed=st.text(max_size=5),
    model=st.text(max_size=8),
    parent=st.one_of(st.just(0), st.integers(1, 2**64 - 1)),
    data=st.data(),
)
def test_matches_reference(
    algo: str,
    tokens: list[int],
    block_size: int,
    seed: str,
    model: str,
    parent: int,
    data: st.DataObject,
) -> None:
    n_blocks = len(tokens) // block_size
    extra = data.draw(
        st.one_of(
            st.none(),
            st.lists(st.one_of(st.none(), identifiers), min_size=n_blocks, max_size=n_blocks),
        )
    )
    expected = ref_keys(
        algo, tokens, model, block_size=block_size, seed=seed, parent=parent, extra=extra
    )
    got = db(algo, block_size, seed).tokens_to_kv_block_keys(
        parent, tokens, model, features(extra) if extra is not None else None
    )
    assert got == expected
    assert len(got) == n_blocks
    assert all(0 <= k < 2**64 for k in got)


# ---------------------------------------------------------------------------------------------
# prefix and chaining properties
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    tokens=st.lists(token_ids, max_size=120),
    block_size=st.integers(1, 17),
    cut=st.integers(0, 10),
)
def test_prefix_property(algo: str, tokens: list[int], block_size: int, cut: int) -> None:
    processor = db(algo, block_size)
    full = processor.tokens_to_kv_block_keys(0, tokens, "model")
    k = min(cut, len(full))
    assert processor.tokens_to_kv_block_keys(0, tokens[: k * block_size], "model") == full[:k]
    # A partial tail never changes the keys of the full blocks.
    assert (
        processor.tokens_to_kv_block_keys(0, tokens[: k * block_size + block_size - 1], "model")
        == full[:k]
    )


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    first=st.lists(token_ids, min_size=1, max_size=60),
    second=st.lists(token_ids, max_size=60),
    block_size=st.integers(1, 12),
    data=st.data(),
)
def test_chaining_property(
    algo: str, first: list[int], second: list[int], block_size: int, data: st.DataObject
) -> None:
    processor = db(algo, block_size)
    first = first[: len(first) // block_size * block_size]
    keys1 = processor.tokens_to_kv_block_keys(0, first, "m")
    n1, n2 = len(keys1), len(second) // block_size
    extra = data.draw(
        st.lists(st.one_of(st.none(), identifiers), min_size=n1 + n2, max_size=n1 + n2)
    )
    feats = features(extra)
    whole = processor.tokens_to_kv_block_keys(0, first + second, "m", feats)
    head = processor.tokens_to_kv_block_keys(0, first, "m", feats[:n1])
    if not head:
        assert processor.tokens_to_kv_block_keys(0, second, "m", feats[n1:]) == whole
        return
    tail = processor.tokens_to_kv_block_keys(head[-1], second, "m", feats[n1:])
    assert whole == head + tail


@algos
def test_chain_continues_across_calls(algo: str) -> None:
    processor = db(algo)
    tokens = list(range(1000, 1000 + 16 * 6))
    keys = processor.tokens_to_kv_block_keys(0, tokens, "m")
    parent = 0
    step_by_step = []
    for i in range(6):
        (key,) = processor.tokens_to_kv_block_keys(parent, tokens[i * 16 : (i + 1) * 16], "m")
        step_by_step.append(key)
        parent = key
    assert step_by_step == keys


# ---------------------------------------------------------------------------------------------
# what the keys depend on
# ---------------------------------------------------------------------------------------------


@algos
def test_keys_depend_on_model_seed_block_size_parent_and_content(algo: str) -> None:
    tokens = list(range(64))
    base = db(algo).tokens_to_kv_block_keys(0, tokens, "model-a")
    variants = [
        db(algo).tokens_to_kv_block_keys(0, tokens, "model-b"),
        db(algo, seed="s").tokens_to_kv_block_keys(0, tokens, "model-a"),
        db(algo, block_size=32).tokens_to_kv_block_keys(0, tokens, "model-a"),
        db(algo).tokens_to_kv_block_keys(777, tokens, "model-a"),
        db(algo).tokens_to_kv_block_keys(0, [1, *tokens[1:]], "model-a"),
    ]
    for other in variants:
        assert other[0] != base[0]
    # A change in block 2 leaves blocks 0 and 1 alone and changes every key after it.
    changed = db(algo).tokens_to_kv_block_keys(0, [*tokens[:40], 9, *tokens[41:]], "model-a")
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(changed[2:], base[2:], strict=True))


@algos
def test_model_name_is_ignored_when_continuing_a_chain(algo: str) -> None:
    tokens = list(range(32))
    assert db(algo).tokens_to_kv_block_keys(99, tokens, "a") == db(algo).tokens_to_kv_block_keys(
        99, tokens, "b"
    )


@algos
@pytest.mark.parametrize(
    ("left", "right"),
    [
        (None, ["img"]),  # multimodal taints a block
        (["ab"], ["a", "b"]),  # no concatenation ambiguity between identifiers
        (["a"], ["a", ""]),  # an empty identifier still counts
        (["a\x00"], ["a"]),  # padding cannot be confused with content
        (["a", "b"], ["b", "a"]),  # order matters
        (["img"], ["img", "img"]),
    ],
)
def test_extra_features_are_unambiguous(
    algo: str, left: list[str] | None, right: list[str] | None
) -> None:
    processor = db(algo, block_size=4)
    tokens = [1, 2, 3, 4]
    a = processor.tokens_to_kv_block_keys(42, tokens, "m", features([left]))
    b = processor.tokens_to_kv_block_keys(42, tokens, "m", features([right]))
    assert a != b


def test_xxh3_multimodal_block_cannot_mimic_a_larger_text_block() -> None:
    """A multimodal block's message never equals a text block's token bytes."""
    small = db("xxh3_64", block_size=4)
    mm = small.tokens_to_kv_block_keys(42, [1, 2, 3, 4], "m", features([[""]]))
    # The bytes a naive "tokens + u32(count) + u32(len)" layout would produce for that block,
    # read back as the tokens of a 6-token text block.
    mimic = [1, 2, 3, 4, 1, 0]
    assert db("xxh3_64", block_size=6).tokens_to_kv_block_keys(42, mimic, "m") != mm


@algos
def test_empty_features_hash_like_text(algo: str) -> None:
    processor = db(algo)
    tokens = list(range(32))
    text = processor.tokens_to_kv_block_keys(0, tokens, "m")
    assert processor.tokens_to_kv_block_keys(0, tokens, "m", [None, None]) == text
    assert processor.tokens_to_kv_block_keys(0, tokens, "m", [BlockExtraFeatures([]), None]) == text


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------


@algos
def test_any_int_sequence_gives_the_same_keys(algo: str) -> None:
    values = [0, 5, 200, 70000, 2**32 - 1] * 8
    processor = db(algo, block_size=8)
    expected = processor.tokens_to_kv_block_keys(0, values, "m")
    assert len(expected) == 5
    for tokens in (
        tuple(values),
        array("I", values),
        array("Q", values),
        array("L", values),
        memoryview(array("I", values)),
        memoryview(array("q", values)),
    ):
        assert processor.tokens_to_kv_block_keys(0, tokens, "m") == expected
    assert processor.tokens_to_kv_block_keys(0, range(32), "m") == (
        processor.tokens_to_kv_block_keys(0, list(range(32)), "m")
    )
    small = [1, 2, 3, 250] * 4
    assert processor.tokens_to_kv_block_keys(0, bytes(small), "m") == (
        processor.tokens_to_kv_block_keys(0, small, "m")
    )


@algos
def test_platforms_without_a_32_bit_array_type_get_the_same_keys(
    algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    processor = db(algo, block_size=4)
    values = [0, 5, 200, 70000, 2**32 - 1, 1, 2, 3]
    expected = processor.tokens_to_kv_block_keys(0, values, "m", features([None, ["x"]]))
    monkeypatch.setattr(hashing, "_U32_CODE", None)
    assert processor.tokens_to_kv_block_keys(0, values, "m", features([None, ["x"]])) == expected
    with pytest.raises(InvalidInputError, match=r"tokens\[1\] = 4294967296"):
        processor.tokens_to_kv_block_keys(0, [1, 2**32], "m")


@algos
def test_short_inputs(algo: str) -> None:
    processor = db(algo)
    assert processor.tokens_to_kv_block_keys(0, [], "m") == []
    assert processor.tokens_to_kv_block_keys(0, list(range(15)), "m") == []
    assert processor.tokens_to_kv_block_keys(0, list(range(15)), "m", []) == []
    assert len(processor.tokens_to_kv_block_keys(0, list(range(16)), "m")) == 1


SUBPROCESS = """
import json, sys
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.features import BlockExtraFeatures, MMHash
tokens = [(i * 2654435761) % 2**32 for i in range(200)]
extra = [None] * 12
extra[3] = BlockExtraFeatures([MMHash("img-1"), MMHash("\u00e9")])
out = {}
for algo in ("xxh3_64", "fnv64a_cbor"):
    p = ChunkedTokenDatabase(TokenProcessorConfig(hash_seed="s", hash_algo=algo))
    out[algo] = [p.tokens_to_kv_block_keys(0, tokens, "model-\u00e9", extra),
                 p.root_key("model-\u00e9")]
json.dump(out, sys.stdout)
"""


def test_keys_are_identical_in_another_process() -> None:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    child = subprocess.run(
        [sys.executable, "-c", SUBPROCESS], capture_output=True, check=True, env=env, text=True
    )
    theirs = json.loads(child.stdout)
    tokens = [(i * 2654435761) % 2**32 for i in range(200)]
    extra: list[BlockExtraFeatures | None] = [None] * 12
    extra[3] = BlockExtraFeatures([MMHash("img-1"), MMHash("\u00e9")])
    for algo in HASH_ALGOS:
        p = db(algo, seed="s")
        ours = [
            p.tokens_to_kv_block_keys(0, tokens, "model-\u00e9", extra),
            p.root_key("model-\u00e9"),
        ]
        assert theirs[algo] == ours
        assert ours[0] == ref_keys(
            algo,
            tokens,
            "model-\u00e9",
            seed="s",
            extra=[None, None, None, ["img-1", "\u00e9"]] + [None] * 8,
        )


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


@algos
@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, -1], r"tokens\[1\] = -1"),
        ([1, 2, 2**32], r"tokens\[2\] = 4294967296"),
        ([2**70], r"tokens\[0\] = 1180591620717411303424"),
        ([1.0], r"tokens\[0\] is float"),
        ([1, "2"], r"tokens\[1\] is str"),
        ([None], r"tokens\[0\] is NoneType"),
        ([[1]], r"tokens\[0\] is list"),
        ((1, -5), r"tokens\[1\] = -5"),
        (array("q", [3, -2]), r"tokens\[1\] = -2"),
        (array("d", [1.5]), r"tokens\[0\] is float"),
        ("abc", "got str"),
        (None, "got NoneType"),
        (42, "got int"),
    ],
)
def test_bad_token_ids(algo: str, tokens: object, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match) as info:
        db(algo).tokens_to_kv_block_keys(0, tokens, "m")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


@algos
@pytest.mark.parametrize("parent", [-1, 2**64, True, "1", 1.0, None])
def test_bad_parent_key(algo: str, parent: object) -> None:
    with pytest.raises(InvalidInputError, match="parent_key"):
        db(algo).tokens_to_kv_block_keys(parent, list(range(16)), "m")  # type: ignore[arg-type]


@algos
def test_largest_parent_key_is_accepted(algo: str) -> None:
    assert len(db(algo).tokens_to_kv_block_keys(2**64 - 1, list(range(16)), "m")) == 1


@algos
@pytest.mark.parametrize("parent", [0, 5])
@pytest.mark.parametrize("model", [None, 3, b"m"])
def test_bad_model_name(algo: str, parent: int, model: object) -> None:
    with pytest.raises(InvalidInputError, match="model_name"):
        db(algo).tokens_to_kv_block_keys(parent, list(range(16)), model)  # type: ignore[arg-type]


@algos
def test_model_name_without_utf8_form(algo: str) -> None:
    with pytest.raises(InvalidInputError, match="model_name"):
        db(algo).tokens_to_kv_block_keys(0, list(range(16)), "bad\ud800")


@algos
def test_extra_features_length_must_match_full_blocks(algo: str) -> None:
    processor = db(algo)
    with pytest.raises(InvalidInputError, match=r"extra_features has 3 elements .* 2 full blocks"):
        processor.tokens_to_kv_block_keys(0, list(range(40)), "m", [None, None, None])
    with pytest.raises(InvalidInputError, match=r"has 1 elements .* 0 full blocks"):
        processor.tokens_to_kv_block_keys(0, list(range(10)), "m", [None])
    with pytest.raises(ValueError, match=r"has 1 elements .* 2 full blocks"):
        processor.tokens_to_kv_block_keys(0, list(range(32)), "m", [None])


@algos
@pytest.mark.parametrize("bad", [["img"], [MMHash("img")], [{"Hash": "img"}], [1]])
def test_extra_features_elements_must_be_features(algo: str, bad: list[object]) -> None:
    with pytest.raises(InvalidInputError, match=r"extra_features\[0\]"):
        db(algo).tokens_to_kv_block_keys(0, list(range(16)), "m", bad)  # type: ignore[arg-type]


@algos
def test_extra_features_must_be_a_sequence(algo: str) -> None:
    with pytest.raises(InvalidInputError, match="extra_features"):
        db(algo).tokens_to_kv_block_keys(0, list(range(16)), "m", "x")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def test_defaults() -> None:
    config = TokenProcessorConfig()
    assert (config.block_size_tokens, config.hash_seed, config.block_size, config.hash_algo) == (
        16,
        "",
        0,
        "xxh3_64",
    )
    processor = ChunkedTokenDatabase()
    assert processor.block_size() == 16
    assert processor.hash_algo == "xxh3_64"
    assert processor.config == config
    assert isinstance(processor, TokenProcessor)


@pytest.mark.parametrize(
    ("block_size_tokens", "block_size", "resolved"),
    [(0, 0, 16), (32, 0, 32), (0, 8, 8), (16, 8, 16), (4, -5, 4)],
)
def test_block_size_resolution(block_size_tokens: int, block_size: int, resolved: int) -> None:
    config = TokenProcessorConfig(block_size_tokens=block_size_tokens, block_size=block_size)
    assert config.resolved_block_size == resolved
    processor = ChunkedTokenDatabase(config)
    assert processor.block_size() == resolved
    assert len(processor.tokens_to_kv_block_keys(0, list(range(64)), "m")) == 64 // resolved


@pytest.mark.parametrize(
    ("block_size_tokens", "block_size", "reported"),
    [(-1, 0, -1), (-1, 16, -1), (0, -5, -5)],
)
def test_invalid_block_size_message(block_size_tokens: int, block_size: int, reported: int) -> None:
    message = f"blockSizeTokens must be greater than 0, got {reported}"
    with pytest.raises(ValueError, match=message) as info:
        ChunkedTokenDatabase(
            TokenProcessorConfig(block_size_tokens=block_size_tokens, block_size=block_size)
        )
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match=message):
        TokenProcessorConfig.from_dict(
            {"blockSizeTokens": block_size_tokens, "blockSize": block_size}
        )


def test_unknown_hash_algo() -> None:
    with pytest.raises(ConfigError, match="sha256") as info:
        TokenProcessorConfig(hash_algo="sha256")
    assert "xxh3_64" in str(info.value)
    assert "fnv64a_cbor" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size_tokens": "16"},
        {"block_size_tokens": 16.0},
        {"block_size": True},
        {"hash_seed": 5},
        {"hash_seed": "bad\ud800"},
        {"hash_algo": None},
    ],
)
def test_config_field_types(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TokenProcessorConfig(**kwargs)  # type: ignore[arg-type]


def test_from_dict_upstream_keys() -> None:
    config = TokenProcessorConfig.from_dict(
        {"blockSizeTokens": 32, "hashSeed": "42", "hashAlgo": "fnv64a_cbor"}
    )
    assert config == TokenProcessorConfig(
        block_size_tokens=32, hash_seed="42", hash_algo="fnv64a_cbor"
    )
    legacy = TokenProcessorConfig.from_dict({"blockSize": 8})
    assert legacy.resolved_block_size == 8
    assert TokenProcessorConfig.from_dict({}).resolved_block_size == 16
    assert TokenProcessorConfig.from_dict({"blockSize": 8, "blockSizeTokens": 32}) == (
        TokenProcessorConfig(block_size_tokens=32, block_size=8)
    )
    # With keyword arguments, block_size_tokens defaults to 16 and wins over block_size.
    assert TokenProcessorConfig(block_size=8).resolved_block_size == 16
    assert TokenProcessorConfig.from_dict({"block_size_tokens": 4}).resolved_block_size == 4
    # Only a seed set: the block size falls back to the default.
    assert TokenProcessorConfig.from_dict({"hashSeed": "x"}).resolved_block_size == 16
    processor = ChunkedTokenDatabase({"blockSizeTokens": 8, "hashAlgo": "fnv64a_cbor"})
    assert (processor.block_size(), processor.hash_algo) == (8, "fnv64a_cbor")


def test_from_dict_rejects_unknown_and_duplicate_keys() -> None:
    with pytest.raises(ConfigError, match="'chunkSize'"):
        TokenProcessorConfig.from_dict({"chunkSize": 16})
    with pytest.raises(ConfigError, match="twice"):
        TokenProcessorConfig.from_dict({"blockSize": 16, "block_size": 16})
    with pytest.raises(ConfigError, match="mapping"):
        TokenProcessorConfig.from_dict([("blockSize", 16)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ChunkedTokenDatabase("fnv64a_cbor")  # type: ignore[arg-type]


def test_root_cache_is_per_model_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_ROOT_CACHE_LIMIT", 3)
    processor = db("xxh3_64")
    roots = [processor.root_key(f"model-{i}") for i in range(10)]
    assert len(set(roots)) == 10
    assert [processor.root_key(f"model-{i}") for i in range(10)] == roots
    assert len(processor._roots) <= 3

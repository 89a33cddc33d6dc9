"""The fnv64a_cbor scheme: the references against published vectors, the CBOR encoder, the
payload bytes, and keys computed by the Go implementation."""

from __future__ import annotations

import pytest

from kvredis.errors import InvalidInputError
from kvredis.hashing import fnv_cbor
from tests.hashing.references import WIDTHS, db, features, ref_cbor, ref_fnv1a64

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
        fnv_cbor.cbor_encode(value, out)
        assert bytes(out) == ref_cbor(value), value
    for bad in (-1, 2**64, True, 1.5, b"x", {1: 2}):
        with pytest.raises(InvalidInputError):
            fnv_cbor.cbor_encode(bad, bytearray())


@pytest.mark.parametrize(
    ("data", "digest"),
    [(b"", 0xCBF29CE484222325), (b"a", 0xAF63DC4C8601EC8C), (b"foobar", 0x85944171F73967E8)],
)
def test_reference_fnv1a64_matches_published_vectors(data: bytes, digest: int) -> None:
    assert ref_fnv1a64(data) == digest


# ---------------------------------------------------------------------------------------------
# the scheme's definition, byte by byte
# ---------------------------------------------------------------------------------------------


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

"""The xxh3_64 scheme: its message bytes, and why its messages cannot be confused."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.hashing import xxh3
from tests.hashing.references import db, features, identifiers


def test_xxh3_multimodal_block_cannot_mimic_a_larger_text_block() -> None:
    """A multimodal block's message never equals a text block's token bytes."""
    small = db("xxh3_64", block_size=4)
    mm = small.tokens_to_kv_block_keys(42, [1, 2, 3, 4], "m", features([[""]]))
    # The bytes a naive "tokens + u32(count) + u32(len)" layout would produce for that block,
    # read back as the tokens of a 6-token text block.
    mimic = [1, 2, 3, 4, 1, 0]
    assert db("xxh3_64", block_size=6).tokens_to_kv_block_keys(42, mimic, "m") != mm


def test_xxh3_message_bytes() -> None:
    """A text block hashes its little-endian token bytes, seeded by the parent; a multimodal
    block appends ``pad4(E) + u32(k) + u32(block_size) + b"M"``; the root hashes its framed
    parameters with seed 0."""
    processor = db("xxh3_64", block_size=2)
    # 01000000 ffffffff: the tokens [1, 2**32 - 1]
    text = bytes.fromhex("01000000ffffffff")
    assert processor.tokens_to_kv_block_keys(7, [1, 2**32 - 1], "m") == [
        xxhash.xxh3_64_intdigest(text, 7)
    ]
    # 01000000 78 000000: E = u32(1) + "x", padded | 01000000: k = 1 | 02000000: bs = 2 | 4d: "M"
    multimodal = text + bytes.fromhex("0100000078000000" "01000000" "02000000" "4d")
    assert processor.tokens_to_kv_block_keys(7, [1, 2**32 - 1], "m", features([["x"]])) == [
        xxhash.xxh3_64_intdigest(multimodal, 7)
    ]
    # magic | 02000000: bs = 2 | 00000000: empty seed | 01000000 6d: "m" | 000000: pad | "RR"
    root = b"KVRXXH3\x01" + bytes.fromhex("02000000" "00000000" "010000006d" "000000") + b"RR"
    assert processor.root_key("m") == xxhash.xxh3_64_intdigest(root, 0)


@settings(max_examples=100, deadline=None)
@given(ids=identifiers, block_size=st.integers(1, 64))
def test_multimodal_messages_are_1_mod_4_long(ids: list[str], block_size: int) -> None:
    """Text messages are 0 (mod 4) bytes long and roots 2 (mod 4), so the multimodal suffix
    after the 4-byte-aligned token part must leave the message 1 (mod 4) long."""
    assert len(xxh3._mm_suffix(tuple(ids), block_size)) % 4 == 1

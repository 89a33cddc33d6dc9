"""Byte encodings of the Redis layout: pod entries (property-tested), hashes, glob escaping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis import InvalidInputError, NamespaceLayoutError, PodEntry
from kvredis.redis.codec import (
    bytes_text,
    decode_entry,
    encode_entry,
    escape_glob,
    hash_field,
    pack_hashes,
    text_bytes,
)

A = PodEntry("pod-a", "gpu")

texts = st.text(alphabet=st.characters(codec=None), max_size=40)
entries = st.builds(
    PodEntry,
    texts,
    texts,
    st.booleans(),
    st.booleans(),
    st.integers(min_value=0, max_value=2**31 - 1),
    st.integers(min_value=0, max_value=2**31 - 1),
)


@settings(deadline=None, max_examples=300)
@given(entries, entries)
def test_entry_encoding_round_trips_and_is_injective(first: PodEntry, second: PodEntry) -> None:
    assert decode_entry(encode_entry(first)) == first
    assert (encode_entry(first) == encode_entry(second)) == (first == second)


def test_malformed_entry_encoding_is_a_layout_error() -> None:
    good = encode_entry(A)
    ranked = encode_entry(PodEntry("pod-a", "gpu", dp_rank=3))
    flags = len(good) - 5  # the flags byte, before the u32 group
    for bad in (
        b"",
        good[:-1],
        good + b"x",
        b"\xff\xff\xff\xff" + good[4:],
        ranked[:-1],  # the rank flag without its rank
        good[:flags] + b"\x04" + good[flags + 1 :] + b"\x00\x00\x00\x00",  # rank flag, rank 0
        good[:flags] + b"\x04" + good[flags + 1 :],
    ):
        with pytest.raises(NamespaceLayoutError):
            decode_entry(bad)


def test_an_entry_of_rank_0_encodes_as_before_ranks() -> None:
    # Stored entries of pods without data parallelism keep their encoding (and their ids).
    assert encode_entry(PodEntry("pod-a", "gpu", dp_rank=0)) == (
        b"\x00\x00\x00\x05pod-a\x00\x00\x00\x03gpu\x00\x00\x00\x00\x00"
    )
    ranked = encode_entry(PodEntry("pod-a", "gpu", has_group=True, group_idx=1, dp_rank=2))
    assert ranked.endswith(b"\x06\x00\x00\x00\x01\x00\x00\x00\x02")


@settings(deadline=None, max_examples=200)
@given(st.text(alphabet=st.characters(codec=None), max_size=40))
def test_text_round_trips_every_str(text: str) -> None:
    assert bytes_text(text_bytes(text)) == text


def test_hashes_pack_big_endian_and_bad_hashes_are_refused() -> None:
    keys, blob = pack_hashes((1, 2**64 - 1))
    assert keys == [1, 2**64 - 1]
    assert blob == hash_field(1) + hash_field(2**64 - 1) == bytes(7) + b"\x01" + b"\xff" * 8
    for bad in ([-1], [2**64], ["1"], "12", [1.0]):
        with pytest.raises(InvalidInputError):
            pack_hashes(bad)  # type: ignore[arg-type]


def test_glob_characters_are_escaped() -> None:
    assert escape_glob(b"a*b?c[d]e\\f") == b"a\\*b\\?c\\[d\\]e\\\\f"
    assert escape_glob(b"plain:ns") == b"plain:ns"

"""Token ids: every int sequence gives the same keys and bytes, and bad ids are named precisely."""

from __future__ import annotations

import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.errors import InvalidInputError
from kvredis.hashing import database
from kvredis.hashing.tokens import U32_CODE, le_bytes, token_array
from tests.hashing.references import algos, db, features


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
    monkeypatch.setattr(database, "U32_CODE", None)
    assert processor.tokens_to_kv_block_keys(0, values, "m", features([None, ["x"]])) == expected
    with pytest.raises(InvalidInputError, match=r"tokens\[1\] = 4294967296"):
        processor.tokens_to_kv_block_keys(0, [1, 2**32], "m")


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


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_both_array_forms_give_little_endian_u32_bytes(values: list[int]) -> None:
    """The 32-bit array and the list fallback hold the same ids and give the same bytes."""
    expected = struct.pack(f"<{len(values)}I", *values)
    for code in {U32_CODE, None}:
        validated = token_array(values, code)
        assert list(validated) == values
        assert bytes(le_bytes(validated)) == expected

"""Multimodal block features: computing them from placeholders and parsing engine extra_keys."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.errors import InvalidInputError
from kvredis.features import (
    PROMPT_EMBEDS_PREFIX,
    BlockExtraFeatures,
    ExtraKeys,
    MMHash,
    PlaceholderRange,
    compute_block_extra_features,
    parse_raw_extra_keys,
    split_extra_keys,
)


def ids(features: list[BlockExtraFeatures | None] | None) -> list[list[str] | None] | None:
    """The identifier lists of a feature list, for compact assertions."""
    if features is None:
        return None
    return [None if f is None else [m.hash for m in f.mm_hashes] for f in features]


# ---------------------------------------------------------------------------------------------
# value types
# ---------------------------------------------------------------------------------------------


def test_value_types_compare_by_value() -> None:
    assert MMHash("a") == MMHash("a")
    assert MMHash("a") != MMHash("b")
    assert hash(MMHash("a")) == hash(MMHash("a"))
    assert BlockExtraFeatures([MMHash("a"), MMHash("b")]) == BlockExtraFeatures(
        [MMHash("a"), MMHash("b")]
    )
    assert BlockExtraFeatures([MMHash("a"), MMHash("b")]) != BlockExtraFeatures(
        [MMHash("b"), MMHash("a")]
    )
    assert PlaceholderRange(3, 4) == PlaceholderRange(offset=3, length=4)
    assert PlaceholderRange(3, 4) != PlaceholderRange(4, 3)


def test_value_types_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        MMHash("a").hash = "b"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlaceholderRange(0, 1).offset = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockExtraFeatures([]).mm_hashes = []  # type: ignore[misc]


@pytest.mark.parametrize(
    "build",
    [
        lambda: MMHash(b"abc"),  # type: ignore[arg-type]
        lambda: MMHash(None),  # type: ignore[arg-type]
        lambda: MMHash("\ud800"),  # lone surrogate: no UTF-8 form
        lambda: BlockExtraFeatures(("a",)),  # type: ignore[arg-type]
        lambda: BlockExtraFeatures(["a"]),  # type: ignore[list-item]
        lambda: PlaceholderRange(-1, 4),
        lambda: PlaceholderRange(0, -4),
        lambda: PlaceholderRange(1.0, 4),  # type: ignore[arg-type]
        lambda: PlaceholderRange(True, 4),
        lambda: PlaceholderRange(0, "4"),  # type: ignore[arg-type]
    ],
)
def test_value_types_reject_bad_fields(build: object) -> None:
    with pytest.raises(InvalidInputError):
        build()  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# compute_block_extra_features
# ---------------------------------------------------------------------------------------------


def test_image_spanning_blocks() -> None:
    # 64 tokens, block size 16: an image on tokens [10, 40) touches blocks 0, 1 and 2.
    result = compute_block_extra_features(
        {"image": ["img-a"]}, {"image": [PlaceholderRange(10, 30)]}, 16, 64
    )
    assert ids(result) == [["img-a"], ["img-a"], ["img-a"], None]
    assert result is not None
    assert result[0] == BlockExtraFeatures([MMHash("img-a")])


def test_block_boundaries_are_half_open() -> None:
    # [16, 32) is exactly block 1: it touches neither block 0 nor block 2.
    result = compute_block_extra_features(
        {"image": ["x"]}, {"image": [PlaceholderRange(16, 16)]}, 16, 48
    )
    assert ids(result) == [None, ["x"], None]
    # [15, 17) straddles the 0/1 boundary.
    result = compute_block_extra_features(
        {"image": ["x"]}, {"image": [PlaceholderRange(15, 2)]}, 16, 48
    )
    assert ids(result) == [["x"], ["x"], None]


def test_several_items_sorted_by_start_across_modalities() -> None:
    result = compute_block_extra_features(
        {"image": ["img-late", "img-early"], "audio": ["aud"]},
        {
            "image": [PlaceholderRange(20, 4), PlaceholderRange(2, 3)],
            "audio": [PlaceholderRange(8, 20)],
        },
        16,
        32,
    )
    # starts: img-early 2, aud 8, img-late 20
    assert ids(result) == [["img-early", "aud"], ["aud", "img-late"]]


def test_equal_starts_keep_input_order() -> None:
    result = compute_block_extra_features(
        {"image": ["i1", "i2"], "audio": ["a1"]},
        {
            "image": [PlaceholderRange(4, 2), PlaceholderRange(4, 8)],
            "audio": [PlaceholderRange(4, 1)],
        },
        16,
        16,
    )
    assert ids(result) == [["i1", "i2", "a1"]]


def test_pairs_beyond_the_shorter_list_are_dropped() -> None:
    more_hashes = compute_block_extra_features(
        {"image": ["a", "b", "c"]}, {"image": [PlaceholderRange(0, 4)]}, 4, 12
    )
    assert ids(more_hashes) == [["a"], None, None]
    more_ranges = compute_block_extra_features(
        {"image": ["a"]},
        {"image": [PlaceholderRange(0, 4), PlaceholderRange(4, 4), PlaceholderRange(8, 4)]},
        4,
        12,
    )
    assert ids(more_ranges) == [["a"], None, None]


def test_only_full_blocks_are_emitted() -> None:
    # 40 tokens with block size 16: two full blocks; the item in the tail is not reported.
    result = compute_block_extra_features(
        {"image": ["head", "tail"]},
        {"image": [PlaceholderRange(0, 3), PlaceholderRange(33, 5)]},
        16,
        40,
    )
    assert ids(result) == [["head"], None]


def test_zero_length_ranges_as_go() -> None:
    # Go keeps an item whose empty range starts inside a block (end > block start and start <
    # block end); an empty range on a block boundary belongs to no block.
    result = compute_block_extra_features(
        {"image": ["inside", "real", "boundary", "zero"]},
        {
            "image": [
                PlaceholderRange(5, 0),
                PlaceholderRange(20, 1),
                PlaceholderRange(32, 0),
                PlaceholderRange(0, 0),
            ]
        },
        16,
        48,
    )
    assert ids(result) == [["inside"], ["real"], None]
    # Only empty ranges, none inside a block: one (all-None) element per block, as Go.
    only_empty = compute_block_extra_features(
        {"image": ["e"]}, {"image": [PlaceholderRange(16, 0)]}, 16, 32
    )
    assert only_empty == [None, None]


def test_modality_without_ranges_contributes_nothing() -> None:
    result = compute_block_extra_features(
        {"image": ["img"], "audio": ["aud"]},
        {"image": [PlaceholderRange(0, 1)]},
        16,
        16,
    )
    assert ids(result) == [["img"]]


@pytest.mark.parametrize(
    ("mm_hashes", "placeholders", "block_size", "num_tokens"),
    [
        ({}, {"image": [PlaceholderRange(0, 4)]}, 16, 32),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 4)]}, 0, 32),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 4)]}, -16, 32),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 4)]}, 16, 0),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 4)]}, 16, -5),
        ({"image": ["a"]}, {}, 16, 32),  # no (hash, range) pairs at all
        ({"image": []}, {"image": [PlaceholderRange(0, 4)]}, 16, 32),
    ],
)
def test_returns_none(
    mm_hashes: dict[str, list[str]],
    placeholders: dict[str, list[PlaceholderRange]],
    block_size: int,
    num_tokens: int,
) -> None:
    assert compute_block_extra_features(mm_hashes, placeholders, block_size, num_tokens) is None


def test_fewer_tokens_than_a_block_gives_an_empty_list() -> None:
    result = compute_block_extra_features(
        {"image": ["a"]}, {"image": [PlaceholderRange(0, 4)]}, 16, 10
    )
    assert result == []


def test_rejects_malformed_items() -> None:
    with pytest.raises(InvalidInputError):
        compute_block_extra_features({"image": [7]}, {"image": [PlaceholderRange(0, 1)]}, 16, 16)  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        compute_block_extra_features({"image": ["a"]}, {"image": [(0, 1)]}, 16, 16)  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="list of identifiers"):
        compute_block_extra_features({"image": "abc"}, {"image": [PlaceholderRange(0, 1)]}, 16, 16)


@pytest.mark.parametrize(
    "args",
    [
        ({"image": ["a"]}, "image", 16, 16),
        ({"image": ["a"]}, [PlaceholderRange(0, 1)], 16, 16),
        (["a"], {"image": [PlaceholderRange(0, 1)]}, 16, 16),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 1)]}, "16", 16),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 1)]}, 16, None),
        ({"image": ["a"]}, {"image": [PlaceholderRange(0, 1)]}, 16.0, 16),
    ],
)
def test_rejects_malformed_arguments_with_a_typed_error(args: Any) -> None:
    with pytest.raises(InvalidInputError):
        compute_block_extra_features(*args)


def _brute_force(
    mm_hashes: dict[str, list[str]],
    placeholders: dict[str, list[PlaceholderRange]],
    block_size: int,
    num_tokens: int,
) -> list[list[str] | None]:
    """Token-by-token reference: an item overlaps a block iff they share a token index, or (an
    empty range, as in Go) it starts strictly inside the block."""
    flat: list[tuple[int, str, set[int]]] = []
    for modality, hashes in mm_hashes.items():
        for identifier, rng in zip(hashes, placeholders.get(modality, []), strict=False):
            flat.append((rng.offset, identifier, set(range(rng.offset, rng.offset + rng.length))))
    flat.sort(key=lambda item: item[0])
    blocks: list[list[str] | None] = []
    for b in range(num_tokens // block_size):
        start, end = b * block_size, (b + 1) * block_size
        block = set(range(start, end))
        hit = [
            identifier
            for offset, identifier, covered in flat
            if covered & block or (not covered and start < offset < end)
        ]
        blocks.append(hit or None)
    return blocks


@settings(max_examples=150, deadline=None)
@given(
    items=st.dictionaries(
        st.sampled_from(["image", "audio", "video"]),
        st.lists(
            st.tuples(
                st.text(min_size=1, max_size=3),
                st.integers(0, 80),
                st.integers(0, 40),
            ),
            max_size=5,
        ),
        max_size=3,
    ),
    block_size=st.integers(1, 20),
    num_tokens=st.integers(1, 100),
)
def test_matches_token_by_token_reference(
    items: dict[str, list[tuple[str, int, int]]], block_size: int, num_tokens: int
) -> None:
    mm_hashes = {m: [i for i, _, _ in lst] for m, lst in items.items()}
    placeholders = {m: [PlaceholderRange(o, n) for _, o, n in lst] for m, lst in items.items()}
    result = compute_block_extra_features(mm_hashes, placeholders, block_size, num_tokens)
    if not any(items.values()):
        assert result is None
    else:
        assert ids(result) == _brute_force(mm_hashes, placeholders, block_size, num_tokens)


# ---------------------------------------------------------------------------------------------
# parse_raw_extra_keys
# ---------------------------------------------------------------------------------------------


def test_parse_none_and_empty() -> None:
    assert parse_raw_extra_keys(None) is None
    assert parse_raw_extra_keys([]) == []
    assert parse_raw_extra_keys([None, [], None]) == [None, None, None]


def test_parse_bare_identifiers() -> None:
    result = parse_raw_extra_keys([["img-a"], None, ["img-a", "img-b"]])
    assert result == [
        BlockExtraFeatures([MMHash("img-a")]),
        None,
        BlockExtraFeatures([MMHash("img-a"), MMHash("img-b")]),
    ]


def test_parse_legacy_pairs_ignore_the_offset() -> None:
    result = parse_raw_extra_keys([[["img-a", 0]], [("img-a", -16), ["img-b", 3]]])
    assert ids(result) == [["img-a"], ["img-a", "img-b"]]
    # A legacy pair and the bare form give the same features.
    assert parse_raw_extra_keys([[["x", 5]]]) == parse_raw_extra_keys([["x"]])


def test_parse_skips_other_elements() -> None:
    result = parse_raw_extra_keys(
        [
            [42, "img", {"lora": 1}, 3.5, None, [7, "not-an-id"], [], b"salt", ("aud", 2)],
            [1, 2.0, {"cache_salt": "s"}, [None]],
        ]
    )
    assert ids(result) == [["img", "aud"], None]


def test_parse_rejects_malformed_shapes() -> None:
    with pytest.raises(InvalidInputError):
        parse_raw_extra_keys("img")
    with pytest.raises(InvalidInputError):
        parse_raw_extra_keys(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"extra_keys\[1\]"):
        parse_raw_extra_keys([["ok"], "img"])


def test_parsed_features_match_computed_features() -> None:
    """The engine's per-block identifiers and the router's computed ones agree."""
    computed = compute_block_extra_features(
        {"image": ["img-a", "img-b"]},
        {"image": [PlaceholderRange(4, 20), PlaceholderRange(26, 4)]},
        16,
        48,
    )
    from_engine = parse_raw_extra_keys([[["img-a", 4]], [["img-a", -12], ["img-b", 10]], None])
    assert computed == from_engine


# split_extra_keys: each item by its shape


def test_split_extra_keys_by_shape() -> None:
    digest = bytes(range(32))
    raw = [
        ["lora", ["img", 4], "salt", digest],
        ["lora", ["img", -12]],
        ["lora"],
        None,
    ]
    split = split_extra_keys(raw, lora_name="lora", chain_start=True)
    assert split.cache_salt == "salt"
    assert ids(split.features) == [
        ["img", PROMPT_EMBEDS_PREFIX + digest.hex()],
        ["img"],
        None,
        None,
    ]
    # Not a chain start: no salt can be there, a bare string is a (legacy) identifier.
    assert split_extra_keys([["a"]], chain_start=False) == ExtraKeys(
        [BlockExtraFeatures([MMHash("a")])]
    )
    # A salted text prompt: no features at all.
    assert split_extra_keys([["s"], None], chain_start=True) == ExtraKeys(None, "s")
    # A legacy bare identifier that runs on into the next block is not a salt.
    legacy = split_extra_keys([["img"], ["img"]], chain_start=True)
    assert legacy.cache_salt is None and ids(legacy.features) == [["img"], ["img"]]
    # The LoRA name only counts at the head of a block and when the event names it.
    assert ids(split_extra_keys([["x", "lora"]], lora_name="lora").features) == [["x", "lora"]]
    assert split_extra_keys(None) == ExtraKeys(None)
    with pytest.raises(InvalidInputError):
        split_extra_keys("img")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        split_extra_keys([["ok"], "img"])  # type: ignore[list-item]

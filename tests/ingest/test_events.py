"""Wire decoding of engine KV-event batches: every format, every hash form, every reject reason."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.ingest import events as events_module
from kvredis.ingest.events import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Engine,
    Rejection,
    RejectReason,
    WireError,
    decode_batch,
    decode_batch_object,
    encode_batch,
    event_to_wire,
    parse_topic,
    wire_hash,
)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def one_event(raw: Any) -> BlockStored | BlockRemoved | AllBlocksCleared:
    decoded = decode_batch(pack([1.5, [raw]]))
    assert decoded.rejects == (), decoded.rejects
    assert len(decoded.events) == 1
    return decoded.events[0]


def one_reject(raw: Any) -> RejectReason:
    decoded = decode_batch(pack([1.5, [raw]]))
    assert decoded.events == ()
    assert len(decoded.rejects) == 1
    assert decoded.rejects[0].position == 0
    return decoded.rejects[0].reason


FULL_MAP = {
    "type": "BlockStored",
    "block_hashes": [1, 2**64 - 1],
    "parent_block_hash": 2**63,
    "token_ids": [0, 1, 2**32 - 1, 7],
    "block_size": 2,
    "lora_id": 3,
    "medium": "CPU_PINNED",
    "lora_name": "adapter-x",
    "extra_keys": [["img-1"], None],
    "group_idx": 2,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "locality": "LOCAL",
    "ownership": "x",
    "session_id": "s",
    "lookahead_token_ids": [1, 2],
    "cache_salt": "salt",
}

FULL_EVENT = BlockStored(
    block_hashes=(1, 2**64 - 1),
    parent_block_hash=2**63,
    token_ids=(0, 1, 2**32 - 1, 7),
    block_size=2,
    lora_id=3,
    medium="CPU_PINNED",
    lora_name="adapter-x",
    extra_keys=(["img-1"], None),
    group_idx=2,
    kv_cache_spec_kind="sliding_window",
    kv_cache_spec_sliding_window=128,
    locality="LOCAL",
    ownership="x",
)


def test_map_block_stored_with_every_field_and_unknown_keys() -> None:
    event = one_event(FULL_MAP)
    assert event == dataclasses.replace(FULL_EVENT, cache_salt="salt")
    assert isinstance(event, BlockStored)
    assert event.tier == "cpu/x"


def test_array_block_stored_with_every_field_and_extra_trailing_fields() -> None:
    raw = ["BlockStored", [1, 2**64 - 1], 2**63, [0, 1, 2**32 - 1, 7], 2, 3, "CPU_PINNED"]
    raw += ["adapter-x", [["img-1"], None], 2, "sliding_window", 128, "LOCAL", "x"]
    raw += ["session", [[1]], "future-1", {"x": 1}]
    assert one_event(raw) == FULL_EVENT


def test_array_block_stored_with_trailing_fields_absent() -> None:
    event = one_event(["BlockStored", [5], None, [1, 2], 2])
    assert event == BlockStored((5,), None, (1, 2), 2)
    assert isinstance(event, BlockStored)
    assert event.tier == "gpu"
    assert event.group_idx is None and event.lora_name is None and event.extra_keys is None


def test_map_block_stored_with_defaults_omitted() -> None:
    assert one_event({"type": "BlockStored", "block_hashes": [5]}) == BlockStored((5,))
    event = one_event(
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "medium": None}
    )
    assert event == BlockStored((5,))


def test_block_removed_map_and_array() -> None:
    expected = BlockRemoved((7, 8), "GPU", 1, "REMOTE")
    assert (
        one_event(
            {
                "type": "BlockRemoved",
                "block_hashes": [7, 8],
                "medium": "GPU",
                "group_idx": 1,
                "locality": "REMOTE",
                "future": 1,
            }
        )
        == expected
    )
    assert expected.tier == "gpu:remote"
    assert one_event(["BlockRemoved", [7, 8], "GPU", 1, "REMOTE", None, "extra"]) == expected
    removed = one_event(["BlockRemoved", [7]])
    assert removed == BlockRemoved((7,))
    assert isinstance(removed, BlockRemoved)
    assert removed.tier == "gpu"


def test_all_blocks_cleared_map_and_array() -> None:
    assert one_event({"type": "AllBlocksCleared"}) == AllBlocksCleared()
    assert one_event(["AllBlocksCleared"]) == AllBlocksCleared()
    assert one_event(["AllBlocksCleared", "ignored"]) == AllBlocksCleared()


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", "gpu"),
        ("CPU", "cpu"),
        ("STORAGE", "storage"),
        ("DISK", "disk"),
        (None, "gpu"),
        ("", "gpu"),
        ("CPU_PINNED", "cpu"),
        ("Cpu_Pinned", "cpu"),
        ("EXTERNAL", "external"),
        ("NVMe", "nvme"),
    ],
)
def test_medium_to_tier(medium: str | None, tier: str) -> None:
    event = one_event(["BlockRemoved", [1], medium])
    assert isinstance(event, BlockRemoved)
    assert event.tier == tier


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        (0, 0),
        (2**63, 2**63),
        (2**64 - 1, 2**64 - 1),
        (-1, 2**64 - 1),
        (-(2**63), 2**63),
        (-12345, 2**64 - 12345),
        (b"\x01\x02", 0x0102),
        (b"\x00" * 7 + b"\x05", 5),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
        (b"\xff" * 8, 2**64 - 1),
    ],
)
def test_hash_forms(wire: Any, expected: int) -> None:
    assert wire_hash(wire) == expected
    event = one_event({"type": "BlockRemoved", "block_hashes": [wire]})
    assert event == BlockRemoved((expected,))
    stored = one_event(["BlockStored", [wire], wire, [], 16])
    assert stored == BlockStored((expected,), expected, (), 16)


def test_bad_hashes_raise_typed_errors() -> None:
    for bad, reason in [
        (b"", RejectReason.BAD_HASH),
        (1.5, RejectReason.BAD_HASH),
        ("12", RejectReason.BAD_HASH),
        (True, RejectReason.BAD_HASH),
        (2**64, RejectReason.HASH_OUT_OF_RANGE),
        (-(2**63) - 1, RejectReason.HASH_OUT_OF_RANGE),
    ]:
        with pytest.raises(WireError) as info:
            wire_hash(bad)
        assert info.value.reason is reason
        assert isinstance(info.value, ValueError)


BAD_EVENTS: list[tuple[Any, RejectReason]] = [
    (42, RejectReason.BAD_EVENT),
    ("BlockStored", RejectReason.BAD_EVENT),
    ([], RejectReason.BAD_EVENT),
    ({"block_hashes": [1]}, RejectReason.MISSING_TAG),
    ([7, [1]], RejectReason.MISSING_TAG),
    ({"type": 3}, RejectReason.MISSING_TAG),
    ({"type": "BlockMigrated", "block_hashes": [1]}, RejectReason.UNKNOWN_TAG),
    (["Unknown"], RejectReason.UNKNOWN_TAG),
    ({"type": "BlockStored"}, RejectReason.MISSING_FIELD),
    (["BlockStored"], RejectReason.MISSING_FIELD),
    (["BlockRemoved"], RejectReason.MISSING_FIELD),
    ({"type": "BlockStored", "block_hashes": 5}, RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, "tokens", 16], RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, [1, "2"], 16], RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, [1, 2.0], 16], RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, [1], 16, None, 7], RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, [1], 16, None, None, ["x"]], RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, [1], "16"], RejectReason.BAD_FIELD_TYPE),
    (["BlockStored", [1], None, [1], 16, "lora"], RejectReason.BAD_FIELD_TYPE),
    ({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}, RejectReason.BAD_FIELD_TYPE),
    (
        {"type": "BlockStored", "block_hashes": [1], "kv_cache_spec_kind": 1},
        RejectReason.BAD_FIELD_TYPE,
    ),
    (["BlockStored", [1], None, [1], -16], RejectReason.BAD_FIELD_VALUE),
    ({"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1}, RejectReason.BAD_FIELD_VALUE),
    (
        {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 2**31},
        RejectReason.BAD_FIELD_VALUE,
    ),
    (
        {"type": "BlockStored", "block_hashes": [1], "kv_cache_spec_sliding_window": -1},
        RejectReason.BAD_FIELD_VALUE,
    ),
    (["BlockStored", [1.0], None, [1], 16], RejectReason.BAD_HASH),
    (["BlockStored", [b""], None, [1], 16], RejectReason.BAD_HASH),
    (["BlockStored", [1], "parent", [1], 16], RejectReason.BAD_HASH),
    (["BlockRemoved", [None]], RejectReason.BAD_HASH),
    (["BlockStored", [1], None, [2**32], 16], RejectReason.TOKEN_OUT_OF_RANGE),
    (["BlockStored", [1], None, [0, -1], 16], RejectReason.TOKEN_OUT_OF_RANGE),
    (
        {"type": "BlockStored", "block_hashes": [1], "extra_keys": "img"},
        RejectReason.BAD_EXTRA_KEYS,
    ),
    ({"type": "BlockStored", "block_hashes": [1], "extra_keys": [5]}, RejectReason.BAD_EXTRA_KEYS),
]


@pytest.mark.parametrize(("raw", "reason"), BAD_EVENTS)
def test_event_rejects(raw: Any, reason: RejectReason) -> None:
    assert one_reject(raw) is reason


def test_invalid_utf8_string_field_is_rejected() -> None:
    raw = pack([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": b"\xff\xfeGPU"}]])
    # rewrite the bin field into a str field holding invalid UTF-8
    raw = raw.replace(b"\xc4\x05\xff\xfeGPU", b"\xa5\xff\xfeGPU")
    decoded = decode_batch(raw)
    assert [r.reason for r in decoded.rejects] == [RejectReason.BAD_FIELD_VALUE]


def test_out_of_range_values_in_decoded_objects() -> None:
    decoded = decode_batch_object(
        [0.0, [["BlockRemoved", [2**64]], ["BlockRemoved", [-(2**64)]], ["BlockRemoved", [3]]]]
    )
    assert [r.reason for r in decoded.rejects] == [RejectReason.HASH_OUT_OF_RANGE] * 2
    assert decoded.events == (BlockRemoved((3,)),)


def test_bad_events_do_not_hide_good_ones() -> None:
    events = [
        ["BlockStored", [1], None, [1, 2], 2],
        {"type": "Bogus"},
        ["BlockRemoved", [b""]],
        {"type": "BlockRemoved", "block_hashes": [2]},
        7,
        ["AllBlocksCleared"],
    ]
    decoded = decode_batch(pack([3.25, events, 0]))
    assert decoded.ts == 3.25
    assert decoded.data_parallel_rank == 0
    assert decoded.total_events == 6
    assert decoded.events == (
        BlockStored((1,), None, (1, 2), 2),
        BlockRemoved((2,)),
        AllBlocksCleared(),
    )
    assert [(r.reason, r.position) for r in decoded.rejects] == [
        (RejectReason.UNKNOWN_TAG, 1),
        (RejectReason.BAD_HASH, 2),
        (RejectReason.BAD_EVENT, 4),
    ]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", RejectReason.MALFORMED_PAYLOAD),
        (b"\xc1", RejectReason.MALFORMED_PAYLOAD),
        (pack([1.0, []])[:-1] + b"\x93", RejectReason.MALFORMED_PAYLOAD),
        (pack([1.0, []]) + b"\x00", RejectReason.MALFORMED_PAYLOAD),
        (pack([1.0, [["BlockRemoved", [1]]]])[:-2], RejectReason.MALFORMED_PAYLOAD),
        (b"\x91" * 100_000 + b"\xc0", RejectReason.MALFORMED_PAYLOAD),
        (pack({"ts": 1.0, "evts": []}), RejectReason.BAD_BATCH),
        (pack({"ts": 1.0, "events": {}}), RejectReason.BAD_BATCH),
        (pack([1.0]), RejectReason.BAD_BATCH),
        (pack([1.0, {"a": 1}]), RejectReason.BAD_BATCH),
        (pack("text"), RejectReason.BAD_BATCH),
        (pack(None), RejectReason.BAD_BATCH),
    ],
)
def test_payload_rejects(payload: bytes, reason: RejectReason) -> None:
    decoded = decode_batch(payload)
    assert decoded.events == ()
    assert [r.reason for r in decoded.rejects] == [reason]


def test_payload_too_large_is_rejected_unread() -> None:
    decoded = decode_batch(b"\x00" * (MAX_PAYLOAD_BYTES + 1))
    assert [r.reason for r in decoded.rejects] == [RejectReason.PAYLOAD_TOO_LARGE]


def test_bad_timestamp_and_dp_rank_keep_the_events() -> None:
    decoded = decode_batch(pack(["yesterday", [["BlockRemoved", [1]]], "rank"]))
    assert decoded.events == (BlockRemoved((1,)),)
    assert [r.reason for r in decoded.rejects] == [
        RejectReason.BAD_TIMESTAMP,
        RejectReason.BAD_DP_RANK,
    ]
    assert decode_batch(pack([1, [], None])).rejects == ()
    assert decode_batch(pack([1, [], 3])).data_parallel_rank == 3


def test_parse_topic() -> None:
    assert parse_topic("kv@pod-1@meta-llama/Llama-3.1-8B") == ("pod-1", "meta-llama/Llama-3.1-8B")
    assert parse_topic("kv@pod-1@model@rev2") == ("pod-1", "model@rev2")
    assert parse_topic("kv@@m") == (None, "m")
    assert parse_topic("") == (None, None)
    assert parse_topic("pod@model") == (None, None)
    assert parse_topic("xx@pod@model") == (None, None)


def test_map_encoding_omits_defaults_and_array_encoding_trims_trailing() -> None:
    wire = event_to_wire(BlockStored((1,), None, (1, 2), 2), "map")
    # vLLM's msgspec encoding: fields without a default are always there, in declaration order.
    expected = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }
    assert wire == expected
    assert list(wire) == list(expected)
    assert event_to_wire(BlockRemoved((1,)), "map") == {
        "type": "BlockRemoved",
        "block_hashes": [1],
        "medium": None,
    }
    assert event_to_wire(BlockStored((1,), None, (1, 2), 2), "array") == [
        "BlockStored",
        [1],
        None,
        [1, 2],
        2,
    ]
    assert event_to_wire(BlockRemoved((1,), group_idx=3), "array") == ["BlockRemoved", [1], None, 3]


hashes = st.lists(st.integers(0, 2**64 - 1), max_size=4).map(tuple)
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=40).map(tuple)
opt_str = st.none() | st.text(min_size=1, max_size=8)
stored_events = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.none() | st.integers(0, 2**64 - 1),
    token_ids=tokens,
    block_size=st.integers(0, 64),
    lora_id=st.none() | st.integers(0, 5),
    medium=opt_str,
    lora_name=opt_str,
    extra_keys=st.none()
    | st.lists(st.none() | st.lists(st.text(max_size=5), max_size=2), max_size=3).map(tuple),
    group_idx=st.none() | st.integers(0, 2**31 - 1),
    kv_cache_spec_kind=opt_str,
    kv_cache_spec_sliding_window=st.none() | st.integers(0, 4096),
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=opt_str,
)
removed_events = st.builds(
    BlockRemoved,
    hashes,
    opt_str,
    st.none() | st.integers(0, 2**31 - 1),
    st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    opt_str,
)
events = st.lists(stored_events | removed_events | st.just(AllBlocksCleared()), max_size=5)


@settings(max_examples=150, deadline=None)
@given(
    events,
    st.sampled_from(["map", "array"]),
    st.floats(allow_nan=False),
    st.none() | st.integers(0, 7),
)
def test_encode_decode_round_trip(evs: list[Any], fmt: Any, ts: float, rank: int | None) -> None:
    decoded = decode_batch(encode_batch(evs, ts=ts, data_parallel_rank=rank, fmt=fmt))
    assert decoded.rejects == ()
    assert decoded.ts == ts
    assert decoded.data_parallel_rank == rank
    assert list(decoded.events) == evs


@pytest.mark.parametrize("payload", [None, "text", 42, [b"x"]])
def test_a_payload_that_is_not_bytes_is_a_reject(payload: Any) -> None:
    decoded = decode_batch(payload)
    assert decoded.events == ()
    assert [r.reason for r in decoded.rejects] == [RejectReason.MALFORMED_PAYLOAD]
    assert "not bytes" in decoded.rejects[0].detail


def test_the_ingester_counts_a_none_payload_as_a_reject() -> None:
    from kvredis.hashing import ChunkedTokenDatabase
    from kvredis.ingest import EventIngester
    from kvredis.memory import InMemoryIndex

    ingester = EventIngester(InMemoryIndex(), ChunkedTokenDatabase())
    ingester.process("kv@pod-a@m", 0, None)  # type: ignore[arg-type]
    assert ingester.counters.snapshot()["rejected"] == 1


@pytest.mark.parametrize("payload", [b"\xc1", b"\xc1garbage", b"", b"\x92\x01", b"\x01\x02"])
def test_a_malformed_payload_reject_always_says_why(payload: bytes) -> None:
    (reject,) = decode_batch(payload).rejects
    assert reject.reason is RejectReason.MALFORMED_PAYLOAD
    name, _, reason = reject.detail.partition(": ")
    assert name and reason.strip() and not reason.startswith("(")
    if payload:
        assert payload[:2].hex(" ") in reject.detail


def test_a_rejection_never_has_an_empty_detail() -> None:
    assert Rejection(RejectReason.BAD_FIELD_VALUE, "").detail.startswith("bad_field_value")


# ------------------------------------------------------------------------------------------
# The fast path for plain map events (events._plain_event) against the general code. A
# read-only proxy of the same dict is a Mapping but not a dict, so it takes the general code.
# ------------------------------------------------------------------------------------------

VLLM_STORED: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [2**64 - 1],
    "parent_block_hash": 5,
    "token_ids": [0, 2**32 - 1] * 8,
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
VLLM_REMOVED: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
SGLANG_STORED: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [-(2**63), -1, 2**63 - 1],
    "parent_block_hash": -2,
    "token_ids": [1, 2, 3],
    "block_size": 1,
    "lora_id": 4,
    "medium": "GPU",
}


def both_paths(raw: dict[Any, Any]) -> tuple[Any, Any]:
    """The batch holding ``raw`` decoded through the fast path and through the general code."""
    general = decode_batch_object([1.5, [MappingProxyType(raw)]])
    fast = decode_batch_object([1.5, [raw]])
    return fast, general


def assert_same_decoding(raw: dict[Any, Any]) -> None:
    fast, general = both_paths(raw)
    assert fast == general
    assert repr(fast) == repr(general)  # also tells True from 1 and 1.0 from 1


@pytest.mark.parametrize("raw", [VLLM_STORED, VLLM_REMOVED, SGLANG_STORED])
def test_plain_map_events_take_the_fast_path(raw: dict[str, Any]) -> None:
    event = events_module._plain_event(raw)
    assert event is not None
    assert repr(event) == repr(events_module._event(MappingProxyType(raw)))
    assert_same_decoding(raw)


def test_plain_events_decode_to_their_values() -> None:
    assert events_module._plain_event(SGLANG_STORED) == BlockStored(
        (2**63, 2**64 - 1, 2**63 - 1), 2**64 - 2, (1, 2, 3), 1, 4, "GPU"
    )
    assert events_module._plain_event(VLLM_REMOVED) == BlockRemoved((7,), "GPU")
    assert events_module._plain_event({"type": "BlockStored", "block_hashes": []}) == BlockStored(
        ()
    )


class _Str(str):
    pass


UNUSUAL_VALUES: list[Any] = [
    True,
    False,
    -1,
    -(2**63) - 1,
    2**63,
    2**64,
    2**70,
    2**32,
    1.0,
    b"\x01" * 9,
    b"",
    bytearray(b"\x02"),
    "",
    "é",
    "\udc80",
    _Str("GPU"),
    [],
    [True],
    [1, True],
    [1.0],
    [-1],
    [2**64],
    [-1, 2**63],
    [2**32],
    [b"\x01"],
    [[1, 2], [2, 3]],
    [[1, 2], [3, 4]],
    [None],
    (1, 2),
    {"cache_salt": "s"},
]
"""Values one field of a plain event may take instead, each for the fast path to turn down
(or, for some, accept: then both paths must agree on the value)."""


@pytest.mark.parametrize("base", [VLLM_STORED, VLLM_REMOVED, SGLANG_STORED])
@pytest.mark.parametrize("value", UNUSUAL_VALUES, ids=repr)
def test_an_unusual_field_decodes_as_the_general_code_decodes_it(
    base: dict[str, Any], value: Any
) -> None:
    for key in [*base, "extra_keys", "event_version", "cache_salt", "metadata", "group_idx"]:
        assert_same_decoding({**base, key: value})
        if isinstance(base.get(key), list):
            assert_same_decoding({**base, key: [*base[key], value]})
            assert_same_decoding({**base, key: [value, *base[key]]})
    for key in base:
        assert_same_decoding({k: v for k, v in base.items() if k != key})


def test_unusual_maps_decode_as_the_general_code_decodes_them() -> None:
    class Hostile:
        hashable = True

        def __hash__(self) -> int:
            if not self.hashable:
                raise RuntimeError("no hash")
            return 1

    hostile_key = Hostile()
    raw: dict[Any, Any] = {**VLLM_STORED, hostile_key: 1}
    hostile_key.hashable = False  # the dict keeps the hash it got: only a lookup hashes it again
    assert events_module._plain_event(raw) is None
    assert_same_decoding(raw)
    assert_same_decoding({**VLLM_STORED, 1: "int key", b"type": "bytes key"})
    assert_same_decoding({**VLLM_REMOVED, "type": _Str("BlockRemoved")})
    assert_same_decoding({"type": "AllBlocksCleared"})
    assert_same_decoding({"type": "AllBlocksCleared", "block_hashes": [1], "medium": "GPU"})
    assert_same_decoding({"type": "Nope", "block_hashes": [1]})
    assert_same_decoding({"block_hashes": [1]})


plain_ints = st.integers(-(2**63), 2**64 - 1)
edge_values = st.sampled_from(
    [
        *(True, False, -1, 0, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1),
        *(2**64 - 1, 2**64, 1.0, b"\x01", b"", "", "\udc80", _Str("x"), None, [1, 2]),
    ]
)
wire_values = st.recursive(
    st.none()
    | plain_ints
    | st.integers()
    | edge_values
    | st.floats(allow_nan=False)
    | st.binary(max_size=10)
    | st.text(max_size=4)
    | st.sampled_from(["GPU", "CPU", "CPU_PINNED", "é"]),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


@st.composite
def near_plain_maps(draw: st.DrawFn) -> dict[Any, Any]:
    """A plain map event or a near miss: each field is mostly plain, sometimes plain but for an
    edge value (in its array, or instead of it), absent or anything; sometimes with a key more."""
    base = draw(st.sampled_from([VLLM_STORED, VLLM_REMOVED, SGLANG_STORED]))
    plain: dict[str, st.SearchStrategy[Any]] = {
        "block_hashes": st.lists(plain_ints, max_size=3),
        "parent_block_hash": st.none() | plain_ints,
        "token_ids": st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=4),
        "block_size": st.none() | st.integers(0, 2**32 - 1),
        "lora_id": st.none() | st.integers(),
        "medium": st.none() | st.sampled_from(["GPU", "CPU", "DISK"]),
        "lora_name": st.none() | st.text(max_size=3),
    }
    raw: dict[Any, Any] = {"type": base["type"]}
    for key in base:
        if key == "type":
            continue
        how = draw(st.sampled_from(["plain"] * 4 + ["edge"] * 2 + ["absent", "any"]))
        if how in ("plain", "edge"):
            raw[key] = draw(plain[key])
        if how == "edge":
            if isinstance(raw[key], list):
                raw[key].insert(draw(st.integers(0, len(raw[key]))), draw(edge_values))
            else:
                raw[key] = draw(edge_values)
        elif how == "any":
            raw[key] = draw(wire_values)
    if draw(st.integers(0, 5)) == 0:
        key = draw(st.sampled_from(["cache_salt", "group_idx", "extra_keys", "session_id", "x"]))
        raw[key] = draw(wire_values)
    return raw


@settings(max_examples=1000, deadline=None)
@given(near_plain_maps())
def test_the_fast_path_decodes_as_the_general_code(raw: dict[Any, Any]) -> None:
    assert_same_decoding(raw)
    event = events_module._plain_event(raw)
    if event is not None:
        assert repr(event) == repr(events_module._event(MappingProxyType(raw)))


def removed(**fields: Any) -> dict[str, Any]:
    return {**VLLM_REMOVED, **fields}


def stored(**fields: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [1], "medium": "GPU", **fields}


@pytest.mark.parametrize(
    ("batch", "engine"),
    [
        ([0.0, [VLLM_STORED, VLLM_REMOVED]], None),
        ([0.0, [VLLM_STORED, VLLM_REMOVED], 0], None),
        ({"ts": 0.0, "events": [VLLM_STORED], "data_parallel_rank": None}, Engine.VLLM),
        ({"ts": 0.0, "events": [SGLANG_STORED], "data_parallel_rank": 0}, Engine.VLLM),
        ({"ts": 0.0, "events": [VLLM_STORED], "attn_dp_rank": 0}, Engine.SGLANG),
        ([0.0, [SGLANG_STORED]], Engine.SGLANG),
        ([0.0, [VLLM_STORED, removed(block_hashes=[-1])]], Engine.SGLANG),
        ([0.0, [removed(block_hashes=[3, -1])]], Engine.SGLANG),
        ([0.0, [removed(block_hashes=[True, -1])]], None),
        ([0.0, [removed(block_hashes=[-1, b"\x01"])]], None),
        ([0.0, [removed(block_hashes=[b"\x01"])]], None),
        ([0.0, [removed(block_hashes=[-1.0])]], None),
        ([0.0, [removed(block_hashes=(-1,))]], None),
        ([0.0, [removed(medium="CPU_PINNED")]], Engine.SGLANG),
        ([0.0, [removed(medium="DISK"), removed(medium="CPU")]], Engine.SGLANG),
        ([0.0, [removed(medium="CPU"), SGLANG_STORED]], Engine.VLLM),
        ([0.0, [removed(medium=_Str("STORAGE"))]], Engine.VLLM),
        ([0.0, [removed(medium=["CPU"])]], None),
        ([0.0, [stored(cache_salt=None)]], Engine.SGLANG),
        ([0.0, [stored(metadata={}, group_idx=1)]], Engine.SGLANG),
        ([0.0, [stored(group_idx=1), stored(cache_salt="s")]], Engine.VLLM),
        ([0.0, [stored(lookahead_token_ids=[])]], Engine.VLLM),
        ([0.0, [stored(session_id="s")]], None),
        (
            [0.0, [["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": "s"}]]],
            Engine.SGLANG,
        ),
        ([0.0, [["BlockStored", [1], None, [1], 1, None, "GPU", None]]], Engine.VLLM),
        ([0.0, [["BlockStored", [-1], None, [1], 1, None, "GPU"]]], Engine.SGLANG),
        ([0.0, [["BlockStored", [1], None, [1], 1, None, "CPU"]]], Engine.VLLM),
        ([0.0, [["BlockRemoved", [1], "EXTERNAL"]]], Engine.SGLANG),
        ([0.0, [["BlockRemoved", [1]], ["AllBlocksCleared"], "junk", None]], None),
        ([0.0, [removed(block_hashes=[[1], -1]), SGLANG_STORED]], Engine.SGLANG),
    ],
)
def test_the_engine_a_batch_shape_names(batch: Any, engine: Engine | None) -> None:
    assert decode_batch_object(batch).engine is engine
    if msgpack.unpackb(pack(batch), strict_map_key=False) == batch:  # (not with a tuple)
        assert decode_batch(pack(batch)).engine is engine
    proxied = [MappingProxyType(e) if isinstance(e, dict) else e for e in batch_events(batch)]
    assert events_module._engine_hint(batch, proxied) is engine
    assert decode_batch_object(batch, hint=False).engine is None


def batch_events(batch: Any) -> list[Any]:
    return list(batch["events"] if isinstance(batch, dict) else batch[1])

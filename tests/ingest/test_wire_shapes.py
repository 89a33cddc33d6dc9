"""``tests/ingest/wire.py`` writes the bytes the engines write.

The engines encode with msgspec; these structs declare the same fields, types, defaults and
struct options as vLLM 0.34 (``vllm/distributed/kv_events.py``) and SGLang 0.5.23
(``sglang/srt/disaggregation/kv_events.py``), so msgspec's own output is the reference.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.ingest import wire

# -- vLLM 0.34 ----------------------------------------------------------------------------------


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VllmEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(VllmEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VllmEvent):
    pass


# -- SGLang 0.5.23 ------------------------------------------------------------------------------


class SglBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglStored(SglEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglRemoved(SglEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


ENCODE = msgspec.msgpack.Encoder().encode
DIGEST = bytes(range(32))


@pytest.mark.parametrize(
    ("kwargs", "extra"),
    [
        ({}, None),
        (
            {"lora_id": 1, "lora_name": "sql", "group_idx": 0, "locality": "REMOTE"},
            [("sql", ("img", 4), "salt", DIGEST), None],
        ),
        (
            {
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 128,
                "ownership": "kvcr",
                "session_id": "s",
                "lookahead_token_ids": [[9], [10]],
            },
            None,
        ),
    ],
)
def test_vllm_bytes(kwargs: dict[str, Any], extra: list[Any] | None) -> None:
    hashes: list[int | bytes] = [2**64 - 1, b"\x01" * 32]
    tokens = list(range(32))
    ref = BlockStored(hashes, 7, tokens, 16, None, "GPU", None, extra_keys=extra)
    for name, value in kwargs.items():
        setattr(ref, name, value)
    ours = wire.vllm_stored(hashes, 7, tokens, 16, extra_keys=extra, **kwargs)
    removed = BlockRemoved([1], "CPU", group_idx=0, locality="LOCAL")
    expected = ENCODE(VllmBatch(1.5, [ref, removed, AllBlocksCleared()]))
    ours_removed = wire.vllm_removed([1], medium="CPU", group_idx=0, locality="LOCAL")
    assert wire.vllm_batch([ours, ours_removed, wire.all_cleared()], ts=1.5) == expected
    assert wire.vllm_batch([], 1.0, 3) == ENCODE(VllmBatch(1.0, [], 3))


def test_vllm_offload_placeholder_and_dp_rank_bytes() -> None:
    # OffloadingEventsTracker._placeholder_stored (self-describing events off), on DP rank 2
    ref = BlockStored([5], None, [], 0, None, "CPU", None, group_idx=1)
    ours = wire.vllm_offload_placeholder(5, 1)
    assert wire.vllm_batch([ours], 1.0, 2) == ENCODE(VllmBatch(1.0, [ref], 2))


def test_sglang_bytes() -> None:
    events, _ = wire.sglang_pages(list(range(5)), 2, 2**63 + 5, cache_salt="s", lora_name="l")
    ref = [
        SglStored(
            [wire.signed(2**63 + 5), wire.signed(2**63 + 6)],
            None,
            [0, 1, 2, 3],
            2,
            None,
            "GPU",
            "s",
            None,
            "l",
        ),
        SglStored(
            [wire.signed(2**63 + 7)], wire.signed(2**63 + 6), [4], 1, None, "GPU", "s", None, "l"
        ),
    ]
    assert wire.sglang_batch(events) == ENCODE(SglBatch(1.0, ref))
    bigram, _ = wire.sglang_pages([1, 2, 3], 3, 9, bigram_next=4)
    bigram_ref = SglStored([9], None, [(1, 2), (2, 3), (3, 4)], 3, None, "GPU")
    assert wire.sglang_batch(bigram) == ENCODE(SglBatch(1.0, [bigram_ref]))
    assert wire.pack(wire.sglang_removed([1])) == ENCODE(SglRemoved([1], "GPU"))


# -- vLLM main (event_version 1: typed extra keys) ----------------------------------------------


class ExtraKey(msgspec.Struct, gc=False, frozen=True, tag=True):
    pass


class LoRAKey(ExtraKey, frozen=True, tag="lora"):
    name: str


class CacheSaltKey(ExtraKey, frozen=True, tag="cache_salt"):
    salt: str


class PromptEmbedsKey(ExtraKey, frozen=True, tag="prompt_embeds"):
    hash: bytes


class MultiModalKey(ExtraKey, frozen=True, tag="mm"):
    modality: str
    hash: str
    block_offset: int


class LegacyExtraKey(ExtraKey, frozen=True, tag="legacy"):
    value: Any


class StoredV1(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayStoredV1(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


def test_vllm_event_version_1_bytes() -> None:
    typed = (
        LoRAKey("sql"),
        MultiModalKey("image", "img", 4),
        CacheSaltKey("salt"),
        PromptEmbedsKey(DIGEST),
        LegacyExtraKey("x"),
    )
    ref = StoredV1([1, 2], None, list(range(32)), 16, None, "GPU", "sql", extra_keys=[typed, None])
    wire_typed = [
        wire.vllm_lora("sql"),
        wire.vllm_mm("image", "img", 4),
        wire.vllm_salt("salt"),
        wire.vllm_embeds(DIGEST),
        wire.vllm_legacy("x"),
    ]
    ours = wire.vllm_stored_v1(
        [1, 2], None, list(range(32)), 16, lora_name="sql", extra_keys=[wire_typed, None]
    )
    assert wire.vllm_batch([ours]) == ENCODE(VllmBatch(1.0, [ref]))
    array_ref = ArrayStoredV1([1], 7, [5], 1, None, "GPU", None, extra_keys=[(typed[1],)])
    array = wire.vllm_stored_v1([1], 7, [5], 1, extra_keys=[[wire_typed[1]]], fmt="array")
    assert wire.vllm_batch([array]) == ENCODE(VllmBatch(1.0, [array_ref]))
    grouped_ref = ArrayStoredV1([1], 7, [5], 1, None, "GPU", None, group_idx=0)
    grouped = wire.vllm_stored_v1([1], 7, [5], 1, group_idx=0, fmt="array")
    assert wire.vllm_batch([grouped]) == ENCODE(VllmBatch(1.0, [grouped_ref]))


# -- SGLang's array form, with BlockStoredWithMetadata ------------------------------------------


class SglArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class SglArrayStored(SglArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class StoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SglArrayStoredWithMetadata(SglArrayStored, tag="BlockStored", kw_only=True):
    metadata: StoredMetadata


def test_sglang_array_form_bytes() -> None:
    plain = SglArrayStored([wire.signed(2**63 + 1)], None, [1, 2], 2, None, "GPU")
    salted = SglArrayStoredWithMetadata(
        [5], wire.signed(2**63 + 1), [3, 4], 2, None, "GPU", metadata=StoredMetadata("s")
    )
    ours = [
        wire.sglang_array_stored([2**63 + 1], None, [1, 2], 2),
        wire.sglang_array_stored([5], 2**63 + 1, [3, 4], 2, cache_salt="s"),
    ]
    assert wire.sglang_batch(ours) == ENCODE(SglBatch(1.0, [plain, salted]))

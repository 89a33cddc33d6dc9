"""The event shapes engines are about to send: vLLM's ``event_version`` 1 (its main branch:
``event_version`` before ``extra_keys`` in the array form, typed extra keys) and SGLang's array
form with a metadata map (``BlockStoredWithMetadata``).

Every message is built in the engine's own shape (:mod:`tests.ingest.wire`, pinned against
msgspec in ``test_wire_shapes.py``), goes through :class:`~kvredis.ingest.EventIngester` into the
embedded index, Redis 7 and Valkey 9, and is looked up with the keys a router computes. A typed
key is placed exactly where its untyped form is (``docs/ingest.md``, "Ingestion fidelity"); one
that cannot be placed refuses its event, counted and logged, never hashed as plain text.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest

from kvredis.features import (
    PROMPT_EMBEDS_PREFIX,
    BlockExtraFeatures,
    MMHash,
    PlaceholderRange,
    compute_block_extra_features,
)
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest import EventIngester
from kvredis.ingest.events import Engine, decode_batch
from tests.ingest.wire import (
    sglang_array_stored,
    sglang_batch,
    vllm_batch,
    vllm_embeds,
    vllm_legacy,
    vllm_lora,
    vllm_mm,
    vllm_salt,
    vllm_stored,
    vllm_stored_v1,
)

MODEL = "base-model"
LORA = "sql-lora"
TP16 = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))
PROMPT = tuple(range(1000, 1128))


def feed(
    index: Any, payloads: Sequence[bytes], ing: EventIngester | None = None, pod: str = "pod-a"
) -> EventIngester:
    """Apply ``payloads`` as consecutive messages of ``pod``'s publisher (its own endpoint)."""
    ing = EventIngester(index, TP16) if ing is None else ing
    start = ing.counters.get("messages")
    for seq, payload in enumerate(payloads, start):
        ing.process(f"kv@{pod}@{MODEL}", seq, payload, endpoint=f"engine-{pod}")
    return ing


def hits(index: Any, keys: Sequence[int], pod: str = "pod-a") -> int:
    """How many of the router's keys, from the first, the pod holds."""
    found = index.lookup(list(keys), {pod})
    n = 0
    for key in keys:
        if key not in found:
            break
        n += 1
    return n


IMAGE = PlaceholderRange(4, 20)  # tokens 4..23: blocks 0 and 1
FEATS = compute_block_extra_features({"image": ["img-a"]}, {"image": [IMAGE]}, 16, 64)


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_typed_lora_image_and_salt_are_placed_as_their_untyped_forms(
    engine_index: Any, fmt: str
) -> None:
    tokens = PROMPT[:64]
    extra = [
        [vllm_lora(LORA), vllm_mm("image", "img-a", 4), vllm_salt("salt-1")],
        [vllm_lora(LORA), vllm_mm("image", "img-a", -12)],
        [vllm_lora(LORA)],
        [vllm_lora(LORA)],
    ]
    event = vllm_stored_v1(
        [1, 2, 3, 4], None, tokens, 16, lora_name=LORA, extra_keys=extra, fmt=fmt
    )
    ing = feed(engine_index, [vllm_batch([event])])
    assert ing.counters.get("rejected") == 0
    want = TP16.tokens_to_kv_block_keys(0, tokens, LORA, FEATS, cache_salt="salt-1")
    assert hits(engine_index, want) == 4
    # exactly as the untyped shape of vLLM 0.34 is placed
    untyped = [[LORA, ["img-a", 4], "salt-1"], [LORA, ["img-a", -12]], [LORA], [LORA]]
    old = vllm_stored([1, 2, 3, 4], None, tokens, 16, lora_name=LORA, extra_keys=untyped)
    feed(engine_index, [vllm_batch([old])], pod="pod-b")
    assert hits(engine_index, want, "pod-b") == 4
    # never as plain text, unsalted, or without the image
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, LORA)) == 0
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, LORA, FEATS)) == 0
    plain_salted = TP16.tokens_to_kv_block_keys(0, tokens, LORA, cache_salt="salt-1")
    assert hits(engine_index, plain_salted) == 0


def test_typed_salt_continues_across_events(engine_index: Any) -> None:
    tokens = PROMPT[:64]
    first = vllm_stored_v1([1, 2], None, tokens[:32], 16, extra_keys=[[vllm_salt("s")], None])
    more = vllm_stored_v1([3, 4], 2, tokens[32:], 16)
    feed(engine_index, [vllm_batch([first]), vllm_batch([more])])
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, cache_salt="s")) == 4
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 0


def test_typed_prompt_embeds_are_features(engine_index: Any) -> None:
    tokens = (0,) * 32
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
    event = vllm_stored_v1([1, 2], None, tokens, 16, extra_keys=[[vllm_embeds(d)] for d in digests])
    feed(engine_index, [vllm_batch([event])])
    feats = [BlockExtraFeatures([MMHash(PROMPT_EMBEDS_PREFIX + d.hex())]) for d in digests]
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, feats)) == 2
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 0


def test_array_form_with_event_version_before_extra_keys(engine_index: Any) -> None:
    tokens = PROMPT[:32]
    event = vllm_stored_v1(
        [1, 2],
        None,
        tokens,
        16,
        extra_keys=[[vllm_mm("image", "img-b", 0)], None],
        group_idx=0,
        fmt="array",
    )
    assert isinstance(event, list) and event[8] == 1  # event_version, then extra_keys
    ing = feed(engine_index, [vllm_batch([event])])
    feats = compute_block_extra_features(
        {"image": ["img-b"]}, {"image": [PlaceholderRange(0, 10)]}, 16, 32
    )
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, feats)) == 2
    assert ing.counters.get("rejected") == 0


@pytest.mark.parametrize(
    ("extra", "lora_name", "parent"),
    [
        pytest.param([[vllm_legacy("img-x")], None], None, None, id="legacy"),
        pytest.param([[{"type": "adapter_v2", "id": 3}], None], None, None, id="unknown-tag"),
        pytest.param([None, [vllm_salt("s")]], None, None, id="salt-off-first-block"),
        pytest.param([[vllm_salt("s")], None], None, 77, id="salt-in-a-continuation"),
        pytest.param([[vllm_lora("other")], None], LORA, None, id="lora-not-the-events"),
        pytest.param([[vllm_mm("image", "i", 0), "bare"], None], None, None, id="mixed"),
    ],
)
def test_an_extra_key_that_cannot_be_placed_refuses_its_event(
    engine_index: Any,
    caplog: pytest.LogCaptureFixture,
    extra: list[Any],
    lora_name: str | None,
    parent: int | None,
) -> None:
    tokens = PROMPT[:32]
    bad = vllm_stored_v1([1, 2], parent, tokens, 16, lora_name=lora_name, extra_keys=extra)
    good = vllm_stored_v1([9], None, PROMPT[64:80], 16)
    with caplog.at_level(logging.WARNING, logger="kvredis.ingest"):
        ing = feed(engine_index, [vllm_batch([bad, good]), vllm_batch([bad]), vllm_batch([bad])])
    c = ing.counters.snapshot()
    assert c["rejected.unplaced_extra_key"] == 3 and c["rejected"] == 3
    logged = [r for r in caplog.records if "unplaced_extra_key" in r.getMessage()]
    assert len(logged) == 1  # counted every time, logged once
    model = lora_name or MODEL
    for salt in (None, "s"):  # nothing of the refused event, under any reading of it
        assert (
            hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, model, cache_salt=salt)) == 0
        )
    assert engine_index.lookup(TP16.tokens_to_kv_block_keys(0, tokens, model)) == {}
    # the batch's other event still applied
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, PROMPT[64:80], MODEL)) == 1


def test_a_newer_event_version_is_refused(engine_index: Any) -> None:
    event = vllm_stored_v1([1], None, PROMPT[:16], 16, event_version=2)
    ing = feed(engine_index, [vllm_batch([event])])
    assert ing.counters.get("rejected.bad_field_value") == 1
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, PROMPT[:16], MODEL)) == 0


def test_sglang_array_form_with_a_metadata_map(engine_index: Any) -> None:
    tokens = PROMPT[:64]
    salted = sglang_array_stored([2**63 + 1, 2], None, tokens[:32], 16, cache_salt="tenant-7")
    more = sglang_array_stored([3, 4], 2, tokens[32:], 16)  # the legacy seven-field shape
    payloads = [sglang_batch([salted]), sglang_batch([more])]
    assert decode_batch(payloads[0]).engine is Engine.SGLANG
    ing = feed(engine_index, payloads)
    assert ing.counters.get("rejected") == 0
    want = TP16.tokens_to_kv_block_keys(0, tokens, MODEL, cache_salt="tenant-7")
    assert hits(engine_index, want) == 4
    assert hits(engine_index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 0


def test_sglang_metadata_key_it_cannot_place_refuses_the_event(engine_index: Any) -> None:
    event = sglang_array_stored([1, 2], None, PROMPT[:32], 16, cache_salt="s")
    event[7]["lora_name"] = "l"  # a metadata key that may change the hash
    ing = feed(engine_index, [msgpack.packb([1.0, [event], None])])
    assert ing.counters.get("rejected.unplaced_extra_key") == 1
    assert engine_index.lookup(TP16.tokens_to_kv_block_keys(0, PROMPT[:32], MODEL)) == {}

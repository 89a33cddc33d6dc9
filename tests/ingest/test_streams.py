"""Which engine a stream is: a reused endpoint, and what each engine's prefix-cache reset drops.

* An endpoint whose ``kv@<pod>@<model>`` topic names another engine than before publishes a
  different engine: the previous engine is gone and its pod is cleared (once, HA replicas
  agreeing); the new engine's stream is its own, never taken for a restart of the previous one.
* ``AllBlocksCleared`` drops what the engine's reset drops: vLLM its GPU prefix cache; SGLang its
  radix tree with the HiCache host copies (``CPU_PINNED``); the engine told by the endpoint's
  configuration, else by the shape of its events.

Messages are in the engines' own shapes (:mod:`tests.ingest.wire`), fed through
:class:`~kvredis.ingest.EventIngester` into the embedded index, Redis 7 and Valkey 9.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest import BatchOutcome, EndpointConfig, EventIngester, IngesterConfig
from kvredis.types import PodEntry
from tests.ingest.wire import (
    all_cleared,
    sglang_batch,
    sglang_pages,
    vllm_batch,
    vllm_removed,
    vllm_stored,
)

MODEL = "m"
TP = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))
ENDPOINT = "tcp://10.0.0.5:5557"


def toks(start: int, n: int = 32) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def keys(tokens: Sequence[int]) -> list[int]:
    return TP.tokens_to_kv_block_keys(0, tokens, MODEL)


def held(index: Any, tokens: Sequence[int], pod: str) -> set[str]:
    """The tiers of ``pod``'s entries on every block of ``tokens`` (empty if one is missing)."""
    ks = keys(tokens)
    found = index.lookup(ks, {pod})
    if len(found) < len(ks):
        return set()
    tiers = [{e.device_tier for e in found[k]} for k in ks]
    return set.intersection(*tiers)


def stored(first_hash: int, tokens: Sequence[int], parent: int | None = None) -> dict[str, Any]:
    n = len(tokens) // 16
    return vllm_stored(list(range(first_hash, first_hash + n)), parent, tokens, 16)


# -- a reused endpoint ---------------------------------------------------------------------------


def test_another_engine_on_the_endpoint_clears_the_old_pod_and_never_the_new(
    engine_index: Any,
) -> None:
    ing = EventIngester(engine_index, TP)
    for seq in range(3):
        tokens = toks(1000 + 100 * seq)
        ing.process(f"kv@pod-a@{MODEL}", seq, vllm_batch([stored(10 * seq + 1, tokens)]), ENDPOINT)
    assert held(engine_index, toks(1000), "pod-a") == {"gpu"}
    # pod-b already holds blocks it published elsewhere (its own stream, the same rank)
    ing.process(
        f"kv@pod-b@{MODEL}", 0, vllm_batch([stored(500, toks(7000))]), "tcp://10.0.0.6:5557"
    )
    # the endpoint now publishes another engine, from seq 0
    for seq in range(2):
        payload = vllm_batch([stored(100 + 10 * seq, toks(5000 + 100 * seq))])
        outcome = ing.process(f"kv@pod-b@{MODEL}", seq, payload, ENDPOINT)
        assert outcome is BatchOutcome.APPLIED
    for seq in range(3):
        assert held(engine_index, toks(1000 + 100 * seq), "pod-a") == set()
    assert held(engine_index, toks(7000), "pod-b") == {"gpu"}  # never cleared for pod-a
    assert held(engine_index, toks(5000), "pod-b") == held(engine_index, toks(5100), "pod-b")
    assert held(engine_index, toks(5100), "pod-b") == {"gpu"}
    c = ing.counters.snapshot()
    assert (c["engines_replaced"], c["clears_replaced"], c["clears"]) == (1, 1, 1)
    assert (c["restarts"], c["batches_duplicate"], c["gaps"]) == (0, 0, 0)


def test_after_an_ingester_restart_the_new_engine_is_not_a_restart_of_the_old(
    engine_index: Any,
) -> None:
    first = EventIngester(engine_index, TP)
    for seq in range(4):
        payload = vllm_batch([stored(10 * seq + 1, toks(1000 + 100 * seq))])
        first.process(f"kv@pod-a@{MODEL}", seq, payload, ENDPOINT)
    # a new ingester (a restart, a rollout); meanwhile pod-a's engine was replaced by pod-b's
    again = EventIngester(engine_index, TP)
    again.process(f"kv@pod-b@{MODEL}", 0, vllm_batch([stored(500, toks(7000))]), "tcp://other:1")
    outcomes = [
        again.process(
            f"kv@pod-b@{MODEL}",
            seq,
            vllm_batch([stored(100 + 10 * seq, toks(5000 + 100 * seq))]),
            ENDPOINT,
        )
        for seq in range(3)
    ]
    assert outcomes == [BatchOutcome.APPLIED] * 3  # not duplicates of pod-a's batches 0..2
    for seq in range(3):
        assert held(engine_index, toks(5000 + 100 * seq), "pod-b") == {"gpu"}
    assert held(engine_index, toks(7000), "pod-b") == {"gpu"}  # not cleared as a "restart"
    c = again.counters.snapshot()
    assert (c["restarts"], c["clears"], c["batches_duplicate"]) == (0, 0, 0)


def test_ha_replicas_agree_on_a_replaced_engine(engine_index: Any) -> None:
    a, b = EventIngester(engine_index, TP), EventIngester(engine_index, TP)
    old = [vllm_batch([stored(10 * s + 1, toks(1000 + 100 * s))]) for s in range(3)]
    new = [vllm_batch([stored(100 + 10 * s, toks(5000 + 100 * s))]) for s in range(3)]
    for seq in range(2):
        b.process(f"kv@pod-a@{MODEL}", seq, old[seq], ENDPOINT)
    for seq in range(3):
        a.process(f"kv@pod-a@{MODEL}", seq, old[seq], ENDPOINT)
    for seq in range(3):
        a.process(f"kv@pod-b@{MODEL}", seq, new[seq], ENDPOINT)
    # b lags: its last batch of pod-a belongs to an engine a peer saw replaced, and is dropped
    assert b.process(f"kv@pod-a@{MODEL}", 2, old[2], ENDPOINT) is BatchOutcome.SUPERSEDED
    for seq in range(3):
        assert b.process(f"kv@pod-b@{MODEL}", seq, new[seq], ENDPOINT) is BatchOutcome.DUPLICATE
    for seq in range(3):
        assert held(engine_index, toks(1000 + 100 * seq), "pod-a") == set()
        assert held(engine_index, toks(5000 + 100 * seq), "pod-b") == {"gpu"}
    ca, cb = a.counters.snapshot(), b.counters.snapshot()
    assert ca["clears"] + cb["clears"] == 1  # one clear of pod-a between them
    assert (ca["engines_replaced"], cb["engines_replaced"], cb["epochs_adopted"]) == (1, 1, 1)
    assert ca["restarts"] == cb["restarts"] == 0


def test_a_topic_naming_no_pod_stays_on_the_engines_stream(engine_index: Any) -> None:
    ing = EventIngester(engine_index, TP)
    ing.process(f"kv@pod-a@{MODEL}", 0, vllm_batch([stored(1, toks(1000))]), ENDPOINT)
    assert ing.process("", 1, vllm_batch([stored(9, toks(2000))]), ENDPOINT) is (
        BatchOutcome.REJECTED
    )
    ing.process(f"kv@pod-a@{MODEL}", 2, vllm_batch([stored(20, toks(3000))]), ENDPOINT)
    assert held(engine_index, toks(1000), "pod-a") == {"gpu"}
    assert held(engine_index, toks(3000), "pod-a") == {"gpu"}
    c = ing.counters.snapshot()
    assert (c["engines_replaced"], c["gaps"], c["clears"]) == (0, 0, 0)


# -- what a reset drops, per engine --------------------------------------------------------------


def _sglang_with_host_copies(tokens: Sequence[int]) -> list[bytes]:
    """SGLang with HiCache: the prompt's pages on the GPU, then their backups in host memory."""
    gpu, _ = sglang_pages(tokens, 16, 1)
    host, _ = sglang_pages(tokens, 16, 1, medium="CPU_PINNED")
    return [sglang_batch(gpu), sglang_batch(host)]


def test_sglang_reset_drops_its_host_copies(engine_index: Any) -> None:
    tokens = toks(1000, 64)
    ing = EventIngester(engine_index, TP)
    payloads = [*_sglang_with_host_copies(tokens), sglang_batch([all_cleared()])]
    for seq, payload in enumerate(payloads):
        if seq == 2:
            assert held(engine_index, tokens, "pod-s") == {"gpu", "cpu"}
        ing.process(f"kv@pod-s@{MODEL}", seq, payload, "sglang-0")
    assert engine_index.lookup(keys(tokens), {"pod-s"}) == {}  # the host copies went too


def test_vllm_reset_keeps_the_offloaded_copies(engine_index: Any) -> None:
    tokens = toks(1000, 64)
    gpu = vllm_stored([1, 2, 3, 4], None, tokens, 16, group_idx=0)
    cpu = vllm_stored([1, 2, 3, 4], None, tokens, 16, medium="CPU", group_idx=0)
    ing = EventIngester(engine_index, TP)
    for seq, payload in enumerate([vllm_batch([gpu, cpu]), vllm_batch([all_cleared()])]):
        ing.process(f"kv@pod-v@{MODEL}", seq, payload, "vllm-0")
    assert held(engine_index, tokens, "pod-v") == {"cpu"}


def test_the_configured_engine_wins_over_the_shape(engine_index: Any) -> None:
    # an engine configured as vLLM keeps its host copies on a reset, whatever its events look like
    tokens = toks(1000, 64)
    endpoint = EndpointConfig("sglang-0", pod_id="pod-s", model_name=MODEL, engine="vllm")
    ing = EventIngester(engine_index, TP, [endpoint])
    payloads = [*_sglang_with_host_copies(tokens), sglang_batch([all_cleared()])]
    for seq, payload in enumerate(payloads):
        ing.process("", seq, payload, endpoint)
    assert held(engine_index, tokens, "pod-s") == {"cpu"}


def test_a_configured_sglang_engine_drops_host_copies_from_the_first_reset(
    engine_index: Any,
) -> None:
    # host copies applied before this ingester ran; the first batch it sees is the reset
    tokens = toks(1000, 64)
    entries = [PodEntry("pod-s", tier) for tier in ("gpu", "cpu")]
    engine_index.add(None, keys(tokens), entries)
    endpoint = EndpointConfig("sglang-0", pod_id="pod-s", model_name=MODEL, engine="sglang")
    ing = EventIngester(engine_index, TP, [endpoint])
    ing.process("", 0, sglang_batch([all_cleared()]), endpoint)
    assert engine_index.lookup(keys(tokens), {"pod-s"}) == {}


def test_explicit_reset_mediums_hold_for_every_engine(engine_index: Any) -> None:
    tokens = toks(1000, 64)
    config = IngesterConfig(reset_mediums=("GPU",))
    ing = EventIngester(engine_index, TP, config=config)
    payloads = [*_sglang_with_host_copies(tokens), sglang_batch([all_cleared()])]
    for seq, payload in enumerate(payloads):
        ing.process(f"kv@pod-s@{MODEL}", seq, payload, "sglang-0")
    assert held(engine_index, tokens, "pod-s") == {"cpu"}


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "TensorRT", ""])
def test_endpoint_engine_names(engine: str) -> None:
    if engine in ("vllm", "sglang", "trtllm"):
        assert EndpointConfig("e", engine=engine).engine_kind is not None
    else:
        with pytest.raises(ValueError, match="engine must be one of vllm, sglang, trtllm"):
            EndpointConfig("e", engine=engine)


def test_vllm_removal_of_one_tier_keeps_the_other(engine_index: Any) -> None:
    # a guard for the reset tests: an explicit removal names its medium, whatever the engine
    tokens = toks(1000, 32)
    ing = EventIngester(engine_index, TP)
    gpu = vllm_stored([1, 2], None, tokens, 16)
    cpu = vllm_stored([1, 2], None, tokens, 16, medium="CPU")
    for seq, payload in enumerate([vllm_batch([gpu, cpu]), vllm_batch([vllm_removed([2])])]):
        ing.process(f"kv@pod-v@{MODEL}", seq, payload, "vllm-0")
    assert held(engine_index, tokens[:16], "pod-v") == {"gpu", "cpu"}
    assert held(engine_index, tokens, "pod-v") == {"cpu"}


def test_the_streams_engine_keeps_every_other_field_of_a_batch() -> None:
    """A stream hands the sequencer each decoded batch with its engine: every other field is
    the decoder's, whatever fields a batch has."""
    import dataclasses

    from kvredis.ingest.events import BlockRemoved, DecodedBatch, Engine, Rejection, RejectReason
    from kvredis.ingest.stream import StreamState

    values: dict[str, Any] = {
        "ts": 12.5,
        "events": (BlockRemoved((1, 2)),),
        "data_parallel_rank": 3,
        "rejects": (Rejection(RejectReason.BAD_EVENT, "x", 1),),
        "total_events": 2,
        "engine": None,
    }
    assert {f.name for f in dataclasses.fields(DecodedBatch)} == set(values)
    decoded = DecodedBatch(**values)
    st = StreamState(EndpointConfig("tcp://127.0.0.1:1", engine="vllm"))
    assert st.with_engine(decoded) == dataclasses.replace(decoded, engine=Engine.VLLM)

"""The planner alone: events in, index operations and requests (lookups, barriers) out."""

from __future__ import annotations

from kvredis.batch import AddOp, EvictOp
from kvredis.groups import GroupCatalog
from kvredis.ingest.counters import Counter
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)
from kvredis.ingest.planner import Barrier, BatchPlan, Lookup, Planner, PlanSteps, PodCaches
from kvredis.types import KeyType, PodEntry
from tests.ingest.harness import MODEL, POD, TP, block_tokens

GPU = PodEntry(POD, "gpu")


def planner() -> Planner:
    return Planner(TP, GroupCatalog(), PodCaches(64))


def run(steps: PlanSteps, answers: dict[int, int | None]) -> list[Lookup | Barrier]:
    """Drive a plan, answering lookups from ``answers``; the requests it made."""
    requests: list[Lookup | Barrier] = []
    reply: int | None = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration:
            return requests
        requests.append(request)
        reply = answers[request.engine_key] if isinstance(request, Lookup) else None


def chain(n: int, parent: int = 0) -> int:
    return TP.tokens_to_kv_block_keys(parent, block_tokens(n), MODEL)[0]


def test_a_chain_within_one_batch_needs_no_request() -> None:
    p, plan = planner(), BatchPlan(PodCaches(64).get(POD))
    events = [
        BlockStored((1,), None, block_tokens(0), 16),
        BlockStored((2,), 1, block_tokens(1), 16),
    ]
    decoded = decode_batch(encode_batch(events))
    assert run(p.plan(plan, decoded, POD, MODEL), {}) == []
    first = chain(0)
    assert plan.take() == [
        AddOp((1,), (first,), (GPU,)),
        AddOp((2,), (chain(1, first),), (GPU,)),
    ]
    assert plan.stats[Counter.EVENTS_APPLIED] == 2


def test_an_unknown_parent_is_looked_up_then_cached() -> None:
    p = planner()
    cache = p.caches.get(POD)
    plan = BatchPlan(cache)
    decoded = decode_batch(encode_batch([BlockStored((2,), 1, block_tokens(1), 16)]))
    assert run(p.plan(plan, decoded, POD, MODEL), {1: 77}) == [Lookup(1)]
    assert cache.get(1) == 77
    assert plan.take() == [AddOp((2,), (chain(1, 77),), (GPU,))]
    assert plan.stats[Counter.INDEX_LOOKUPS] == 1


def test_a_parent_evicted_earlier_in_the_batch_needs_a_flush_first() -> None:
    p = planner()
    plan = BatchPlan(p.caches.get(POD))
    decoded = decode_batch(
        encode_batch([BlockRemoved((1,)), BlockStored((2,), 1, block_tokens(1), 16)])
    )
    requests = run(p.plan(plan, decoded, POD, MODEL), {1: None})
    assert requests == [Barrier.FLUSH, Lookup(1)]
    assert plan.stats[Counter.PARENT_MISSES] == 1
    assert plan.evicted == {1}


def test_all_blocks_cleared_is_a_clear_barrier() -> None:
    p = planner()
    plan = BatchPlan(p.caches.get(POD))
    decoded = decode_batch(encode_batch([BlockRemoved((5,)), AllBlocksCleared()]))
    steps = p.plan(plan, decoded, POD, MODEL)
    assert next(steps) is Barrier.CLEAR
    assert plan.take() == [EvictOp(5, KeyType.ENGINE, (GPU,))]

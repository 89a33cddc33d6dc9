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
        AddOp((2,), (chain(1, first),), (GPU,), first),  # its parent key: it may join a run
    ]
    assert plan.stats[Counter.EVENTS_APPLIED] == 2


def test_an_unknown_parent_is_looked_up_then_cached() -> None:
    p = planner()
    cache = p.caches.get(POD)
    plan = BatchPlan(cache)
    decoded = decode_batch(encode_batch([BlockStored((2,), 1, block_tokens(1), 16)]))
    assert run(p.plan(plan, decoded, POD, MODEL), {1: 77}) == [Lookup(1)]
    assert cache.get(1) == 77
    assert plan.take() == [AddOp((2,), (chain(1, 77),), (GPU,), 77)]
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


# -- partial-block tails ------------------------------------------------------------------------


def _plan(p: Planner, caches_plan: BatchPlan, *events: BlockStored | BlockRemoved) -> None:
    decoded = decode_batch(encode_batch(list(events)))
    assert run(p.plan(caches_plan, decoded, POD, MODEL), {}) == []


def test_a_tail_waits_for_the_rest_of_its_block_and_maps_every_engine_block() -> None:
    p = planner()
    tokens = tuple(range(100, 132))
    plan = BatchPlan(p.caches.get(POD))
    _plan(p, plan, BlockStored((1, 2, 3), None, tokens[:3], 1))  # 3 pages of 1 token
    assert plan.take() == []
    assert plan.stats == {Counter.EVENTS_APPLIED: 1, Counter.BLOCKS_STORED: 3}
    _plan(p, plan, BlockStored((4,), 3, tokens[3:16], 13))
    want = TP.tokens_to_kv_block_keys(0, tokens[:16], MODEL)
    # One block of the index spans four engine blocks: each one maps to it.
    assert plan.take() == [AddOp((1, 2, 3, 4), tuple(want), (GPU,))]


def test_tails_are_bounded_and_dropped_with_their_engine_key() -> None:
    p = Planner(TP, GroupCatalog(), PodCaches(4))
    plan = BatchPlan(p.caches.get(POD))
    for h in range(10):
        _plan(p, plan, BlockStored((h + 1,), None, (h,) * 5, 5))
    plan.commit_cache()
    cache = p.caches.get(POD)
    assert [cache.get_tail(h + 1) is not None for h in range(10)] == [False] * 6 + [True] * 4
    plan = BatchPlan(cache)
    _plan(p, plan, BlockRemoved((10,)))
    assert plan.tail(10) is None
    plan.commit_cache()
    assert cache.get_tail(10) is None and cache.get_tail(9) is not None
    # A batch that may have partly applied forgets the tails it recorded.
    plan = BatchPlan(cache)
    _plan(p, plan, BlockStored((20,), None, (1,) * 3, 3))
    plan.discard_cache()
    assert cache.get_tail(20) is None

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
from kvredis.ingest.planner import (
    Barrier,
    BatchPlan,
    Lookup,
    Planner,
    PlanSteps,
    PodCaches,
    Reset,
    boundary_key,
    group_engine_key,
)
from kvredis.types import KeyType, PodEntry
from tests.ingest.harness import MODEL, POD, TP, block_tokens

GPU = PodEntry(POD, "gpu")


def planner() -> Planner:
    return Planner(TP, GroupCatalog(), PodCaches(64))


def run(steps: PlanSteps, answers: dict[int, int | None]) -> list[Lookup | Barrier | Reset]:
    """Drive a plan, answering lookups from ``answers``; the requests it made."""
    requests: list[Lookup | Barrier | Reset] = []
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
    # The pod's page size is not known yet: the page's boundary key goes too.
    assert plan.evicted == {1, boundary_key(1)}


def test_all_blocks_cleared_is_a_clear_barrier() -> None:
    p = planner()
    plan = BatchPlan(p.caches.get(POD))
    decoded = decode_batch(encode_batch([BlockRemoved((5,)), AllBlocksCleared()]))
    steps = p.plan(plan, decoded, POD, MODEL)
    assert next(steps) == Reset(0, frozenset({"gpu"}))
    assert plan.take() == [
        EvictOp(5, KeyType.ENGINE, (GPU,)),
        EvictOp(boundary_key(5), KeyType.ENGINE, (GPU,)),
    ]


def test_boundary_keys_are_evicted_only_where_pages_can_end_inside_blocks() -> None:
    p = planner()
    plan = BatchPlan(p.caches.get(POD))
    # Whole-block pages: a removal is the page's alone.
    _plan(p, plan, BlockStored((1,), None, block_tokens(1), 16), BlockRemoved((1,)))
    assert plan.take()[1:] == [EvictOp(1, KeyType.ENGINE, (GPU,))]
    # Finer pages: a page known to end inside a block has no boundary key; others may.
    tokens = block_tokens(2)
    _plan(p, plan, BlockStored((2, 3, 4, 5), None, tokens, 4), BlockRemoved((3, 5)))
    evicts = [op.key for op in plan.take() if isinstance(op, EvictOp)]
    assert evicts == [3, 5, boundary_key(5)]


def test_a_reset_clears_its_rank_on_the_reset_tiers() -> None:
    p = Planner(TP, GroupCatalog(), PodCaches(64), reset_mediums=("GPU", "CPU_PINNED"))
    plan = BatchPlan(p.caches.get(POD))
    decoded = decode_batch(
        encode_batch([BlockRemoved((5,)), AllBlocksCleared()], data_parallel_rank=3)
    )
    steps = p.plan(plan, decoded, POD, MODEL)
    assert next(steps) == Reset(3, frozenset({"gpu", "cpu"}))
    ranked = (PodEntry(POD, "gpu", dp_rank=3),)
    assert plan.take() == [  # the page size is not known yet: the boundary key goes too
        EvictOp(5, KeyType.ENGINE, ranked),
        EvictOp(boundary_key(5), KeyType.ENGINE, ranked),
    ]


def test_a_groups_engine_keys_are_its_own() -> None:
    p = planner()
    plan = BatchPlan(p.caches.get(POD))
    events = [
        BlockStored((1, 2), None, block_tokens(0) + block_tokens(1), 16, group_idx=1),
        BlockRemoved((2,), group_idx=1),
        BlockRemoved((2,), group_idx=0),
    ]
    assert run(p.plan(plan, decode_batch(encode_batch(events)), POD, MODEL), {}) == []
    g1 = PodEntry(POD, "gpu", has_group=True, group_idx=1)
    g0 = PodEntry(POD, "gpu", has_group=True, group_idx=0)
    keys = (group_engine_key(1, 1), group_engine_key(2, 1))
    assert group_engine_key(2, 0) == 2 and group_engine_key(2, None) == 2
    assert len({*keys, 1, 2}) == 4
    ops = plan.take()
    assert isinstance(ops[0], AddOp) and ops[0].engine_keys == keys and ops[0].entries == (g1,)
    assert ops[1:] == [
        EvictOp(keys[1], KeyType.ENGINE, (g1,)),
        EvictOp(2, KeyType.ENGINE, (g0,)),
        # group 0's page size is not known yet (it stored nothing): its boundary key goes too
        EvictOp(boundary_key(2), KeyType.ENGINE, (g0,)),
    ]


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
    # One block of the index spans four engine blocks: each one maps to it, and so does the
    # derived key of the page ending at its boundary (pages here are finer than blocks).
    assert plan.take() == [AddOp((1, 2, 3, 4, boundary_key(4)), tuple(want), (GPU,))]


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


def test_pages_inside_blocks_are_bounded_apart_from_chain_ends() -> None:
    p = Planner(TP, GroupCatalog(), PodCaches(1024, 8))
    cache = p.caches.get(POD)
    plan = BatchPlan(cache)
    tokens = tuple(range(100, 140))
    _plan(p, plan, BlockStored(tuple(range(1, 41)), None, tokens, 1))  # 40 pages of 1 token
    plan.commit_cache()
    # Pages 16 and 32 end blocks (no record: their boundary keys are mapped); page 40 ends the
    # chain; of the 37 others the 8 most recent are kept.
    kept = [h for h in range(1, 41) if cache.get_tail(h) is not None]
    assert kept == [31, 33, 34, 35, 36, 37, 38, 39, 40]
    tail = cache.get_tail(35)
    assert tail is not None and tail.tokens == tokens[32:35]
    assert tail.engine_keys == (33, 34, 35)
    # More chains push pages out, not the chain ends.
    for n in range(5):
        plan = BatchPlan(cache)
        _plan(p, plan, BlockStored(tuple(range(100 * n + 100, 100 * n + 120)), None, tokens, 2))
        plan.commit_cache()
    assert cache.get_tail(40) is not None and cache.get_tail(35) is None

"""Prefixes that branch inside an index block get exactly the router's keys.

Engines with pages smaller than the index block (SGLang page size 1..8, vLLM 16-token blocks
under a 64-token index) publish a branch with a parent page in the middle of an index block.
The events come from :mod:`tests.ingest.radix` (SGLang 0.5.23's radix cache: splits publish
nothing, a node's pages coalesce, leaves evict first) or in vLLM 0.34's shape; the index is the
embedded one and a real Redis/Valkey; every check compares the exact set of (request key, pod)
pairs held with the keys :class:`~kvredis.hashing.ChunkedTokenDatabase` computes for every
sequence a pod's cache holds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvredis.batch import AddOp, EvictOp
from kvredis.errors import EngineKeyNotFoundError
from kvredis.features import PlaceholderRange, compute_block_extra_features
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.indexer import Indexer
from kvredis.ingest import EndpointConfig, EventIngester, IngesterConfig
from kvredis.ingest import backend as backend_module
from kvredis.ingest import planner as planner_module
from kvredis.ingest.events import decode_batch
from kvredis.ingest.journal import encode_entry, journal_for
from kvredis.ingest.planner import boundary_key
from kvredis.ingest.sequencer import Sequencer
from kvredis.memory import InMemoryIndex
from kvredis.scoring import LongestPrefixScorer
from tests.conftest import close_backend, make_backend
from tests.ingest.harness import MODEL as HARNESS_MODEL
from tests.ingest.harness import POD, FakeClock, Replica
from tests.ingest.harness import TP as HARNESS_TP
from tests.ingest.radix import RadixCache
from tests.ingest.wire import sglang_batch, vllm_batch, vllm_removed, vllm_stored
from tests.servers import local_server_kinds, server_kinds

MODEL = "base-model"
TP16 = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))
TP64 = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=64))

BACKENDS = [
    "memory",
    *[pytest.param(f"redis@{kind}", marks=pytest.mark.redis) for kind in server_kinds()],
]


@pytest.fixture(params=BACKENDS)
def recorded(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh index (embedded, then a real Redis and Valkey) remembering every request key an
    applied batch added, so that a test can list every pair the index holds."""
    index = recording(make_backend(request.param, request))
    try:
        yield index
    finally:
        close_backend(index)


#: The backends keeping page journals: those above, and a local cluster of each whose namespace
#: puts pod-a and pod-b on shards of their own (their journals in those shards).
JOURNALED = [
    *BACKENDS,
    *[
        pytest.param(f"cluster_split@{kind}", marks=[pytest.mark.redis, pytest.mark.cluster])
        for kind in local_server_kinds()
    ],
]


@pytest.fixture(params=JOURNALED)
def journaled(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh recording index (:func:`recorded`) of each backend keeping page journals."""
    index = recording(make_backend(request.param, request))
    try:
        yield index
    finally:
        close_backend(index)


def recording(index: Any) -> Any:
    """``index``, with ``index.added``: every request key an applied batch added."""
    index.added = set()
    apply_batch = index.apply_batch

    def apply_and_record(ops: Any, stream: Any = None, watermark: Any = None) -> bool:
        applied = bool(apply_batch(ops, stream, watermark))
        if applied:
            for op in ops:
                if isinstance(op, AddOp):
                    index.added.update(op.request_keys)
        return applied

    index.apply_batch = apply_and_record
    apply_batches = getattr(index, "apply_batches", None)
    if apply_batches is not None:

        def apply_all_and_record(batches: Any) -> list[bool]:
            verdicts = list(apply_batches(batches))
            for batch, applied in zip(batches, verdicts, strict=True):
                if applied:
                    for op in batch[0]:
                        if isinstance(op, AddOp):
                            index.added.update(op.request_keys)
            return verdicts

        index.apply_batches = apply_all_and_record
    return index


def held(index: Any, pod: str) -> set[int]:
    """Every request key ``pod`` holds (of those ever added)."""
    return {k for k in index.added if index.lookup([k], {pod})}


def want(tp: ChunkedTokenDatabase, sequences: Sequence[Sequence[int]]) -> set[int]:
    """The router's keys of the full blocks of every sequence."""
    return {k for seq in sequences for k in tp.tokens_to_kv_block_keys(0, seq, MODEL)}


class Stream:
    """One pod's publisher as ingesters see it: batches in sequence (of ``engine``'s, when set:
    the endpoint says so)."""

    def __init__(self, pod: str, engine: str | None = None) -> None:
        self.pod = pod
        self.seq = -1
        self.endpoint = EndpointConfig(f"eng-{pod}", engine=engine)

    def send(self, payload: bytes, *ingesters: EventIngester) -> None:
        self.seq += 1
        for ing in ingesters:
            ing.process(f"kv@{self.pod}@{MODEL}", self.seq, payload, endpoint=self.endpoint)

    def message(self, payload: bytes) -> tuple[str, int, bytes, EndpointConfig]:
        """The next batch, as one message of :meth:`EventIngester.process_many`."""
        self.seq += 1
        return f"kv@{self.pod}@{MODEL}", self.seq, payload, self.endpoint


def misses(*ingesters: EventIngester) -> int:
    return sum(ing.counters.snapshot().get("parent_misses", 0) for ing in ingesters)


# -- the reproduction -------------------------------------------------------------------

SHARED = tuple(range(1000, 1048))
OWN_1 = tuple(range(2000, 2060))
OWN_2 = tuple(range(3000, 3060))


ENGINES = ["vllm", "sglang"]
"""The endpoint's engine: one whose cache may free any page (vLLM: every page mapped), SGLang
(only the page ending a block). An endpoint of no configured engine learns SGLang from its
batches' shape (see :func:`test_sglang_maps_only_the_page_ending_each_block`)."""


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("shared", [40, 48])
def test_a_second_request_branching_inside_a_block(
    index: Any, page: int, shared: int, engine: str | None
) -> None:
    # Every backend: embedded, Redis and Valkey (sync, asyncio), and a local cluster of each.
    recorded = recording(index)
    cache, stream = RadixCache(page), Stream("pod-a", engine)
    ing = EventIngester(recorded, TP16)
    first, second = SHARED[:shared] + OWN_1, SHARED[:shared] + OWN_2
    for tokens in (first, second):
        cache.insert(tokens)
        stream.send(sglang_batch(cache.take()), ing)
    scores = Indexer(recorded, TP16, LongestPrefixScorer()).score_tokens(second[:100], MODEL)
    assert scores == {"pod-a": 6.0}
    assert held(recorded, "pod-a") == want(TP16, [first, second])
    assert misses(ing) == 0


# -- random radix trees -------------------------------------------------------------------------


def workload(
    rng: random.Random, caches: dict[str, RadixCache], steps: int
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Requests landing on random pods, each a random prefix of an earlier request (any branch
    point; a branch of a branch; the whole of it: an extension) plus new tokens, and evictions
    of random leaves. Yields each batch of a pod's cache (``caches``: pod → its cache)."""
    pods = sorted(caches)
    requests: list[tuple[int, ...]] = []
    fresh = iter(range(10_000, 10**9))
    for _ in range(steps):
        pod = rng.choice(pods)
        cache = caches[pod]
        for _ in range(rng.randint(1, 3)):
            leaves = cache.leaves()
            if leaves and rng.random() < 0.3:
                cache.evict(rng.choice(leaves))
                continue
            prefix: tuple[int, ...] = ()
            if requests and rng.random() < 0.85:
                base = rng.choice(requests)
                prefix = base[: rng.randint(0, len(base))]
            tokens = prefix + tuple(next(fresh) for _ in range(rng.randint(1, 50)))
            requests.append(tokens)
            cache.insert(tokens)
        events = cache.take()
        if events:
            yield pod, events


def check_exact(index: Any, tp: ChunkedTokenDatabase, caches: dict[str, RadixCache]) -> None:
    for pod, cache in caches.items():
        assert held(index, pod) == want(tp, cache.held()), pod


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("page", [1, 2, 4, 8])
def test_random_radix_trees_hold_exactly_the_routers_keys(
    recorded: Any, page: int, engine: str | None
) -> None:
    rng = random.Random(page)
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, engine) for pod in caches}
    ing = EventIngester(recorded, TP16)
    for n, (pod, events) in enumerate(workload(rng, caches, 40)):
        streams[pod].send(sglang_batch(events), ing)
        if n % 8 == 0:
            check_exact(recorded, TP16, caches)
    check_exact(recorded, TP16, caches)
    assert misses(ing) == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(6))
def test_random_radix_trees_under_a_64_token_index(seed: int, engine: str | None) -> None:
    index = recording(InMemoryIndex())
    rng = random.Random(100 + seed)
    page = rng.choice([1, 2, 4, 8, 16])
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, engine) for pod in caches}
    ing = EventIngester(index, TP64)
    for pod, events in workload(rng, caches, 50):
        streams[pod].send(sglang_batch(events), ing)
    check_exact(index, TP64, caches)
    assert misses(ing) == 0


# -- HA replicas --------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("page", [1, 4])
def test_ha_replicas_taking_turns_agree_on_branches(
    recorded: Any, page: int, engine: str | None
) -> None:
    # Both replicas receive every batch; whoever comes first applies it and the other learns
    # it, so most branches hang from a page that the replica applying them only learned.
    rng = random.Random(7 + page)
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, engine) for pod in caches}
    replicas = [EventIngester(recorded, TP16), EventIngester(recorded, TP16)]
    for pod, events in workload(rng, caches, 40):
        order = replicas if rng.random() < 0.5 else replicas[::-1]
        streams[pod].send(sglang_batch(events), *order)
    check_exact(recorded, TP16, caches)
    assert misses(*replicas) == 0


def test_a_replica_learns_a_branch_hanging_from_a_block_boundary(recorded: Any) -> None:
    # Replica one applies request 1 and request 2 (a branch at token 48, a block boundary, so
    # from a page that has no record); replica two only learns them, then applies request 3,
    # a branch inside a block of request 2's node.
    cache, stream = RadixCache(1), Stream("pod-a")
    one, two = EventIngester(recorded, TP16), EventIngester(recorded, TP16)
    requests = [SHARED + OWN_1, SHARED + OWN_2, SHARED + OWN_2[:20] + tuple(range(4000, 4030))]
    for n, tokens in enumerate(requests):
        cache.insert(tokens)
        stream.send(sglang_batch(cache.take()), *([one, two] if n < 2 else [two, one]))
    assert held(recorded, "pod-a") == want(TP16, requests)
    assert misses(one, two) == 0


@pytest.mark.parametrize("page", [1, 2, 4])
def test_ha_replicas_skipping_what_a_peer_applied_agree_on_branches(
    recorded: Any, page: int
) -> None:
    # Each batch is applied by a random replica; the other either plans it and finds it applied,
    # or (knowing the peer is ahead) skips it and learns from it without hashing.
    rng = random.Random(30 + page)
    clock = FakeClock()
    replicas = [Replica(recorded, clock), Replica(recorded, clock)]
    caches = {POD: RadixCache(page)}
    for seq, (_, events) in enumerate(workload(rng, caches, 40)):
        payload = sglang_batch(events)
        applier, other = rng.sample(replicas, 2)
        applier.process(seq, payload)
        if rng.random() < 0.5:
            other.process(seq, payload)
        else:
            # What its sequencer does with a batch at or below the stored position.
            other.planner.caches.forget_batch(POD, decode_batch(payload))
            other.stream.last_seq = seq
    assert held(recorded, POD) == {
        k
        for t in caches[POD].held()
        for k in HARNESS_TP.tokens_to_kv_block_keys(0, t, HARNESS_MODEL)
    }
    assert sum(r.count("parent_misses") for r in replicas) == 0


def test_a_replica_learning_batches_it_skips_continues_them_exactly() -> None:
    # A replica that knows a peer applied a batch skips it and learns from it without hashing
    # (PodCaches.forget_batch): request 2's node hangs from a page at a block boundary that has
    # no record, and request 3 branches inside a block of that node.
    index = recording(InMemoryIndex())
    clock = FakeClock()
    one, two = Replica(index, clock), Replica(index, clock)
    cache = RadixCache(1)
    requests = [SHARED + OWN_1, SHARED + OWN_2, SHARED + OWN_2[:20] + tuple(range(4000, 4030))]
    for seq, tokens in enumerate(requests):
        cache.insert(tokens)
        payload = sglang_batch(cache.take())
        if seq < 2:
            one.process(seq, payload)
            two.planner.caches.forget_batch(POD, decode_batch(payload))
        else:
            two.process(seq, payload)
    assert held(index, POD) == {
        k for t in requests for k in HARNESS_TP.tokens_to_kv_block_keys(0, t, HARNESS_MODEL)
    }
    assert two.count("parent_misses") == 0


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_a_replica_that_never_saw_the_parent(recorded: Any, journal: bool) -> None:
    # Replica one stored request 1; replica two (fresh, or restarted) gets request 2 only. The
    # branch at token 48 hangs from a block boundary: the index names that block's key. The
    # branch at token 40 hangs inside block 2, whose first 8 tokens replica two never saw:
    # replica one's page journal has them; without it the branch is a parent miss, and
    # nothing wrong is written.
    cache, stream = RadixCache(1), Stream("pod-a")
    config = IngesterConfig(page_journal=journal)
    one, two = (
        EventIngester(recorded, TP16, config=config),
        EventIngester(recorded, TP16, config=config),
    )
    first = SHARED + OWN_1
    cache.insert(first)
    stream.send(sglang_batch(cache.take()), one)
    at_boundary = SHARED + OWN_2
    cache.insert(at_boundary)
    stream.send(sglang_batch(cache.take()), two)
    assert misses(two) == 0
    inside = SHARED[:40] + tuple(range(4000, 4060))
    cache.insert(inside)
    stream.send(sglang_batch(cache.take()), two)
    if journal:
        assert misses(two) == 0
        assert held(recorded, "pod-a") == want(TP16, [first, at_boundary, inside])
    else:
        assert misses(two) == 1
        assert held(recorded, "pod-a") == want(TP16, [first, at_boundary, SHARED[:40]])


def test_a_short_event_from_an_unknown_page_is_not_a_tier_update(recorded: Any) -> None:
    # pod-b's cache holds the shared 40 tokens (an ingester that restarted never saw them) and
    # then 3 tokens more, pages pod-a stored too (page hashes chain over content): the index
    # maps them to pod-a's block 2, which pod-b holds only part of.
    pod_a, pod_b = RadixCache(1), RadixCache(1)
    a, b = Stream("pod-a"), Stream("pod-b")
    ing = EventIngester(recorded, TP16)
    pod_a.insert(SHARED[:40] + OWN_1)
    a.send(sglang_batch(pod_a.take()), ing)
    pod_b.insert(SHARED[:40])
    pod_b.take()  # published before this ingester started
    pod_b.insert(SHARED[:40] + OWN_1[:3])
    b.send(sglang_batch(pod_b.take()), ing)
    assert held(recorded, "pod-b") == set()
    assert misses(ing) == 1


# -- bounded state ------------------------------------------------------------------------------


def test_forgotten_partial_blocks_are_parent_misses(recorded: Any) -> None:
    # State for 64 pages per pod (and no page journal to recall them from): request 1's pages
    # inside block 2 are long forgotten when request 2 branches there; the branch is counted
    # and writes nothing.
    cache, stream = RadixCache(1), Stream("pod-a")
    config = IngesterConfig(partial_block_pages=64, page_journal=False)
    ing = EventIngester(recorded, TP16, config=config)
    first = SHARED[:40] + OWN_1 + tuple(range(5000, 5200))
    cache.insert(first)
    stream.send(sglang_batch(cache.take()), ing)
    second = SHARED[:40] + OWN_2
    cache.insert(second)
    stream.send(sglang_batch(cache.take()), ing)
    assert misses(ing) == 1
    assert held(recorded, "pod-a") == want(TP16, [first])
    # A branch inside a block whose pages are still remembered is exact.
    third = first[:250] + tuple(range(6000, 6040))
    cache.insert(third)
    stream.send(sglang_batch(cache.take()), ing)
    assert misses(ing) == 1
    assert held(recorded, "pod-a") == want(TP16, [first, third])


@pytest.mark.parametrize("page", [1, 4])
def test_little_state_and_restarts_write_no_wrong_key(recorded: Any, page: int) -> None:
    # State for 24 pages a pod, and the ingester restarts now and then: branches from forgotten
    # pages are parent misses, and whatever is held is still only the router's keys.
    rng = random.Random(50 + page)
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod) for pod in caches}
    config = IngesterConfig(partial_block_pages=24)
    ing = EventIngester(recorded, TP16, config=config)
    for pod, events in workload(rng, caches, 60):
        if rng.random() < 0.1:
            ing = EventIngester(recorded, TP16, config=config)
        streams[pod].send(sglang_batch(events), ing)
        for name, cache in caches.items():
            assert held(recorded, name) <= want(TP16, cache.held()), name
    assert sum(len(held(recorded, pod)) for pod in caches) > 0


@pytest.mark.parametrize("engine", ENGINES)
def test_an_evicted_branch_point_is_forgotten(recorded: Any, engine: str | None) -> None:
    cache, stream = RadixCache(1), Stream("pod-a", engine)
    ing = EventIngester(recorded, TP16)
    first = SHARED[:40] + OWN_1
    cache.insert(first)
    cache.insert(SHARED[:40] + OWN_2)
    stream.send(sglang_batch(cache.take()), ing)
    # Evict both children, then the shared node: every key goes, and so does what the ingester
    # remembered of the pages (a page stored again is hashed from its new event).
    for _ in range(3):
        cache.evict(cache.leaves()[0])
        stream.send(sglang_batch(cache.take()), ing)
    assert held(recorded, "pod-a") == set()
    cache.insert(SHARED[:40] + OWN_2)
    stream.send(sglang_batch(cache.take()), ing)
    assert held(recorded, "pod-a") == want(TP16, [SHARED[:40] + OWN_2])
    assert misses(ing) == 0


def mapped(index: Any, engine_key: int) -> bool:
    try:
        index.get_request_key(engine_key)
    except EngineKeyNotFoundError:
        return False
    return True


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("restart", [False, True], ids=["same", "restarted"])
def test_evictions_leave_no_mapping(recorded: Any, restart: bool, engine: str | None) -> None:
    # The index maps a page ending at a block boundary under its boundary key as well; the
    # removal of the page removes both, also for an ingester that restarted in between (it
    # knows nothing of the pages yet).
    cache, stream = RadixCache(1), Stream("pod-a", engine)
    ing = EventIngester(recorded, TP16)
    pages: list[int] = []
    for tokens in (SHARED[:40] + OWN_1, SHARED[:40] + OWN_2, SHARED[:40] + OWN_1[:30]):
        cache.insert(tokens)
        events = cache.take()
        pages += [h % 2**64 for e in events for h in e["block_hashes"]]
        stream.send(sglang_batch(events), ing)
    assert any(mapped(recorded, boundary_key(h)) for h in pages)
    if restart:
        ing = EventIngester(recorded, TP16)
    while cache.leaves():
        cache.evict(cache.leaves()[0])
        stream.send(sglang_batch(cache.take()), ing)
    assert held(recorded, "pod-a") == set()
    assert [h for h in pages if mapped(recorded, h) or mapped(recorded, boundary_key(h))] == []


# -- vLLM: engine block 16, index block 64 ------------------------------------------------------


def test_vllm_branch_inside_a_64_token_block(recorded: Any) -> None:
    prompt = tuple(range(100, 260))  # 10 engine blocks
    other = prompt[:80] + tuple(range(900, 980))  # shares 5 engine blocks: 80 tokens
    stream = Stream("pod-a")
    ing = EventIngester(recorded, TP64)
    stream.send(vllm_batch([vllm_stored(range(1, 11), None, prompt, 16)]), ing)
    stream.send(vllm_batch([vllm_stored(range(11, 16), 5, other[80:], 16)]), ing)
    assert held(recorded, "pod-a") == want(TP64, [prompt, other])
    assert misses(ing) == 0
    # The branch's own engine blocks go: so does its block 1 (the shared block 0 stays).
    stream.send(vllm_batch([vllm_removed(range(11, 16))]), ing)
    assert held(recorded, "pod-a") == want(TP64, [prompt])


def test_vllm_branch_inside_a_block_after_an_image(recorded: Any) -> None:
    # An image on tokens 20..35 (engine blocks 1 and 2); the branch hangs from engine block 3
    # (token 48, inside index block 0): the branch's block 0 carries the image's identifier.
    image = PlaceholderRange(20, 16)
    prompt = tuple(range(100, 228))  # 8 engine blocks
    other = prompt[:48] + tuple(range(900, 980))
    extra = [None, [["img", 4]], [["img", -12]], None, None, None, None, None]
    stream = Stream("pod-a")
    ing = EventIngester(recorded, TP64)
    stream.send(vllm_batch([vllm_stored(range(1, 9), None, prompt, 16, extra_keys=extra)]), ing)
    stream.send(vllm_batch([vllm_stored(range(11, 16), 3, other[48:], 16)]), ing)
    keys = {
        k
        for tokens in (prompt, other)
        for k in TP64.tokens_to_kv_block_keys(
            0,
            tokens,
            MODEL,
            compute_block_extra_features({"image": ["img"]}, {"image": [image]}, 64, len(tokens)),
        )
    }
    assert held(recorded, "pod-a") == keys
    assert misses(ing) == 0


# -- SGLang: one mapping per index block --------------------------------------------------------


def recording_ops(index: Any) -> Any:
    """``recording(index)``, with ``index.ops``: every operation of an applied batch."""
    recording(index)
    index.ops = []
    apply_batch = index.apply_batch

    def apply_and_keep(ops: Any, stream: Any = None, watermark: Any = None) -> bool:
        applied = bool(apply_batch(ops, stream, watermark))
        if applied:
            index.ops.extend(ops)
        return applied

    index.apply_batch = apply_and_keep
    return index


@pytest.mark.parametrize("page", [1, 4])
def test_sglang_maps_only_the_page_ending_each_block(recorded: Any, page: int) -> None:
    # A 100-token prompt: 6 full blocks. SGLang evicts a radix node only after its children,
    # so a block goes exactly when the page holding its last token does: that page alone is
    # mapped, under its boundary key. An engine not known to evict so maps every page; an
    # endpoint of no configured engine learns SGLang from its batches (their array form).
    cases = (("vllm", "pod-a", 500), ("sglang", "pod-b", 700), (None, "pod-c", 900))
    for engine, name, first in cases:
        tokens = tuple(range(first, first + 100))
        cache, stream = RadixCache(page), Stream(name, engine)
        ing = EventIngester(recorded, TP16, config=IngesterConfig(max_batches_per_call=1))
        cache.insert(tokens)
        (event,) = cache.take()
        pages = [h % 2**64 for h in event["block_hashes"]]
        stream.send(sglang_batch([event]), ing)
        assert held(recorded, name) == want(TP16, [tokens])
        ends = {pages[(16 * (b + 1)) // page - 1] for b in range(6)}
        assert {h for h in pages if mapped(recorded, boundary_key(h))} == ends
        own = {h for h in pages if mapped(recorded, h)}
        if engine == "vllm":
            assert own == set(pages[: 96 // page])  # the last 4 tokens' pages: no full block
        else:
            assert own == set()


def test_sglang_removal_sends_one_evict_per_block(recorded: Any) -> None:
    # Removing a node of 100 pages costs the index one evict per block it held (6), not one
    # per page and boundary key; the ingester knows which pages end inside blocks.
    index = recording_ops(recorded)
    counts = {}
    cases = (("vllm", "pod-a", 500), ("sglang", "pod-b", 700), (None, "pod-c", 900))
    for engine, name, first in cases:
        tokens = tuple(range(first, first + 100))
        cache, stream = RadixCache(1), Stream(name, engine)
        ing = EventIngester(index, TP16, config=IngesterConfig(max_batches_per_call=1))
        cache.insert(tokens)
        stream.send(sglang_batch(cache.take()), ing)
        index.ops.clear()
        cache.evict(cache.leaves()[0])
        stream.send(sglang_batch(cache.take()), ing)
        assert held(index, name) == set()
        counts[engine] = sum(isinstance(op, EvictOp) for op in index.ops)
    assert counts == {"vllm": 100 + 6, "sglang": 6, None: 6}


# -- restarts and takeovers: the page journal ---------------------------------------------------


def exact_pairs(index: Any, caches: dict[str, RadixCache]) -> None:
    """The index holds exactly the router's keys of what every pod's cache holds."""
    for pod, cache in caches.items():
        assert held(index, pod) == want(TP16, cache.held()), pod


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("page", [1, 4])
def test_an_ingester_restarted_mid_stream_continues_exactly(
    journaled: Any, page: int, engine: str | None
) -> None:
    # The ingester dies now and then (never stopped: whatever it knew is gone) and a new one
    # takes the stream on: branches from pages the dead one stored, and their removals, are
    # exact, from the pods' page journals.
    rng = random.Random(70 + page)
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, engine) for pod in caches}
    ing = EventIngester(journaled, TP16)
    restarts = 0
    for n, (pod, events) in enumerate(workload(rng, caches, 60)):
        if n and n % 7 == 0:
            ing, restarts = EventIngester(journaled, TP16), restarts + 1
        streams[pod].send(sglang_batch(events), ing)
        exact_pairs(journaled, caches)
        assert misses(ing) == 0
    assert restarts >= 5


@pytest.mark.parametrize("engine", ENGINES)
def test_batches_applied_together_are_journaled(
    journaled: Any, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A busy worker applies the batches queued for it together (process_many: the fast ones in
    # one apply_batches call); their page records go to the journal as well, so an ingester
    # restarted after every backlog continues exactly.
    together = []
    finish_fast = Sequencer.finish_fast

    def count_fast(self: Sequencer, fast: Any) -> Any:
        together.append(fast)
        return finish_fast(self, fast)

    monkeypatch.setattr(Sequencer, "finish_fast", count_fast)
    rng = random.Random(33)
    caches = {pod: RadixCache(1) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, engine) for pod in caches}
    backlog: list[Any] = []
    ingesters = []
    for pod, events in workload(rng, caches, 80):
        backlog.append(streams[pod].message(sglang_batch(events)))
        if len(backlog) == 6:
            ing = EventIngester(journaled, TP16)
            ing.process_many(backlog)
            ingesters.append(ing)
            backlog.clear()
            exact_pairs(journaled, caches)
    assert len(together) > 20  # batches applied together, not one by one
    assert misses(*ingesters) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_replica_that_joined_late_takes_over_exactly(journaled: Any, engine: str | None) -> None:
    # Replica one follows the pods alone; replica two starts half-way (it never saw the first
    # half), both then receive every batch, and replica one dies: replica two carries on.
    rng = random.Random(91)
    caches = {pod: RadixCache(1) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, engine) for pod in caches}
    one = EventIngester(journaled, TP16)
    two: EventIngester | None = None
    batches = list(workload(rng, caches, 60))
    for n, (pod, events) in enumerate(batches):
        if n == len(batches) // 3:
            two = EventIngester(journaled, TP16)
        if two is None:
            receivers = [one]
        elif n < 2 * len(batches) // 3:
            receivers = [one, two] if rng.random() < 0.5 else [two, one]
        else:
            receivers = [two]  # replica one died
        streams[pod].send(sglang_batch(events), *receivers)
    exact_pairs(journaled, caches)
    assert misses(one) == 0
    assert two is not None and misses(two) == 0


def test_a_compacted_journal_recalls_the_same_pages(
    journaled: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With journals compacted after every few kilobytes, a pod's journal stays one entry or a
    # few, and an ingester starting from it is as exact as one that appended it all.
    monkeypatch.setattr(backend_module, "COMPACT_MIN_BYTES", 4096)
    rng = random.Random(5)
    caches = {pod: RadixCache(1) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, "sglang") for pod in caches}
    ing = EventIngester(journaled, TP16)
    batches = list(workload(rng, caches, 80))
    for pod, events in batches[:60]:
        streams[pod].send(sglang_batch(events), ing)
    journal = journal_for(journaled)
    assert journal is not None
    sizes = {pod: len(journal.read(pod)) for pod in caches}
    assert all(0 < n < 20 for n in sizes.values()), sizes
    fresh = EventIngester(journaled, TP16)
    for pod, events in batches[60:]:
        streams[pod].send(sglang_batch(events), fresh)
    exact_pairs(journaled, caches)
    assert misses(ing, fresh) == 0


@pytest.mark.parametrize("page", [1, 4])
def test_a_batch_whose_records_all_stand_packs_them_whole(
    page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A batch that neither removed a page it recorded nor recorded one anew packs its records
    # without looking their pages up (``whole``): the entry is the one the page-by-page path
    # writes, byte for byte. Batches of several inserts and evictions take the other path.
    paths = {True: 0, False: 0}

    def both_ways(tails: Any, dropped: Any, candidates: Any, whole: bool = False) -> bytes:
        entry = encode_entry(tails, dropped, candidates=candidates, whole=whole)
        assert entry == encode_entry(tails, dropped, candidates=list(candidates)), whole
        paths[whole] += 1
        return entry

    monkeypatch.setattr(planner_module, "encode_entry", both_ways)
    rng = random.Random(11 + page)
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, "sglang") for pod in caches}
    index = recording(InMemoryIndex())
    ing = EventIngester(index, TP16)
    for pod, events in workload(rng, caches, 60):
        streams[pod].send(sglang_batch(events), ing)
    # Batches that store a request, then evict a leaf or store a branch inside it.
    fresh = iter(range(10**9, 2 * 10**9))
    for _ in range(60):
        pod = rng.choice(sorted(caches))
        cache = caches[pod]
        tokens = tuple(next(fresh) for _ in range(4 * rng.randint(5, 15)))  # whole pages
        cache.insert(tokens)
        if rng.random() < 0.5:  # the new leaf itself
            cache.evict(next(n for n in cache.leaves() if n.tokens[-1:] == tokens[-1:]))
        else:
            cache.insert((*tokens[: rng.randint(1, len(tokens) - 1)], next(fresh)))
        streams[pod].send(sglang_batch(cache.take()), ing)
    exact_pairs(index, caches)
    assert paths[True] > 20 and paths[False] > 20, paths


def test_without_the_journal_a_restart_writes_nothing_wrong(recorded: Any) -> None:
    rng = random.Random(70)
    caches = {pod: RadixCache(1) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, "sglang") for pod in caches}
    config = IngesterConfig(page_journal=False)
    ing = EventIngester(recorded, TP16, config=config)
    restarted = []
    for n, (pod, events) in enumerate(workload(rng, caches, 60)):
        if n and n % 7 == 0:
            restarted.append(ing)
            ing = EventIngester(recorded, TP16, config=config)
        streams[pod].send(sglang_batch(events), ing)
        for name, cache in caches.items():
            assert held(recorded, name) <= want(TP16, cache.held()), name
    assert misses(ing, *restarted) > 0

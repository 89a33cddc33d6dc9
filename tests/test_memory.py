"""The embedded backends beyond the shared contract: their bounds, cost estimate and sizes."""

from __future__ import annotations

import dataclasses
import gc
import random
import threading
import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.batch import AddOp, Watermark
from kvredis.errors import ConfigError, EngineKeyNotFoundError, InvalidInputError
from kvredis.jsonconfig import parse_size
from kvredis.memory import (
    CLEAR_MAPPINGS_PER_PAGE,
    KEY_COST,
    LOG_SLACK,
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    CostAwareMemoryIndex,
    CostAwareMemoryIndexConfig,
    InMemoryIndex,
    InMemoryIndexConfig,
    estimated_entry_cost,
)
from kvredis.memory import index as memory_index
from kvredis.memory import tables as memory_tables
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType, PodEntry
from tests import memory_state

A = PodEntry("pod-a", "gpu")
B = PodEntry("pod-b", "gpu")
C = PodEntry("pod-c", "gpu")


def present(index: Any, key: int) -> set[PodEntry]:
    return set(index.lookup([key]).get(key, []))


# -- InMemoryIndex bounds ----------------------------------------------------------------------


def test_request_keys_are_lru_bounded() -> None:
    index = InMemoryIndex(InMemoryIndexConfig(size=3))
    index.add(None, [1, 2, 3], [A])
    assert index.lookup([1]) == {1: [A]}  # 1 is now more recently used than 2 and 3
    index.add(None, [4], [A])
    assert len(index) == 3
    assert present(index, 2) == set()
    assert {k for k in (1, 3, 4) if present(index, k)} == {1, 3, 4}
    index.add(None, [5, 6, 7, 8], [B])  # one add larger than the bound keeps its last keys
    assert len(index) == 3
    assert [k for k in range(1, 9) if present(index, k)] == [6, 7, 8]


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_scored_keys_count_as_used_as_looked_up_ones_do(make: Any) -> None:
    index = make() if make is CostAwareMemoryIndex else make(InMemoryIndexConfig(size=4))
    index.add(None, [1, 2, 3, 4], [A])
    index.add(None, [3], [B])
    assert index.score([1, 2, 9, 3]) == {"pod-a": 2.0}  # stops at 9: 3 is not used
    index.add(None, [5, 6], [A])
    if make is CostAwareMemoryIndex:
        assert list(index._keys) == [4, 3, 1, 2, 5, 6]
    else:
        assert [k for k in range(1, 7) if present(index, k)] == [1, 2, 5, 6]


def test_score_reads_keys_only_up_to_where_no_pod_is_left() -> None:
    index = InMemoryIndex()
    index.add(None, [1, 2, 3], [A])
    index.add(None, [1, 2, 3, 4], [B])
    index.add(None, [4, 5], [C])
    # B drops out at 5 (C holds it, but C did not hold 1): nothing after 5 is read.
    assert index.score([1, 2, 3, 4, 5, "bad", -1]) == {"pod-a": 3.0, "pod-b": 4.0}  # type: ignore[list-item]
    assert index.score([7, "bad"]) == {}  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        index.score([1, 2, "bad", 3])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        index.score([1, [2]])  # type: ignore[list-item]
    assert index.score((k for k in [1, 2]), {"gpu": 0.5}) == {"pod-a": 1.0, "pod-b": 1.0}


def test_adding_to_an_existing_key_refreshes_its_recency() -> None:
    index = InMemoryIndex(InMemoryIndexConfig(size=2))
    index.add(None, [1, 2], [A])
    index.add(None, [1], [B])
    index.add(None, [3], [A])
    assert present(index, 1) == {A, B}
    assert present(index, 2) == set()


def test_engine_mappings_are_lru_bounded_too() -> None:
    index = InMemoryIndex(InMemoryIndexConfig(size=2))
    index.add([101], [1], [A])
    index.add([102], [2], [A])
    assert index.get_request_key(101) == 1  # resolving counts as use
    index.add([103], [3], [A])
    assert index.get_request_key(101) == 1
    assert index.get_request_key(103) == 3
    with pytest.raises(EngineKeyNotFoundError):
        index.get_request_key(102)


def test_entries_per_key_are_bounded_least_recently_added_first() -> None:
    index = InMemoryIndex(InMemoryIndexConfig(pod_cache_size=2))
    index.add(None, [1], [A])
    index.add(None, [1], [B])
    index.add(None, [1], [C])
    assert present(index, 1) == {B, C}
    index.add(None, [1], [B])  # re-adding refreshes B, so C is now the oldest
    index.add(None, [1], [A])
    assert present(index, 1) == {A, B}
    index.add(None, [2], [A, B, C])  # one add with more entries than fit keeps the last ones
    assert present(index, 2) == {B, C}
    index.clear("pod-a")
    assert present(index, 1) == {B}
    assert present(index, 2) == {B, C}


def test_engine_key_evict_after_its_request_key_aged_out_drops_the_mapping() -> None:
    index = InMemoryIndex(InMemoryIndexConfig(size=2))
    index.add([100], [1], [A])
    index.add(None, [2, 3], [A])  # request key 1 ages out, its mapping survives
    assert present(index, 1) == set()
    assert index.get_request_key(100) == 1
    index.evict(100, KeyType.ENGINE, [A])
    with pytest.raises(EngineKeyNotFoundError):
        index.get_request_key(100)


def test_request_keys_per_engine_key_are_bounded() -> None:
    index = InMemoryIndex()
    n = MAX_REQUEST_KEYS_PER_ENGINE_KEY + 5
    for request_key in range(1, n + 1):
        index.add([7], [request_key], [A])
    assert index.get_request_key(7) == n
    index.evict(7, KeyType.ENGINE, [A])
    # Only the remembered (most recent) request keys were resolved; the oldest five keep A.
    assert [k for k in range(1, n + 1) if present(index, k)] == [1, 2, 3, 4, 5]
    with pytest.raises(EngineKeyNotFoundError):  # every key it still remembers is empty
        index.get_request_key(7)


def test_a_key_repeated_in_one_add_takes_its_last_place_in_the_lru_order() -> None:
    index = InMemoryIndex(InMemoryIndexConfig(size=2))
    index.add(None, [5, 6, 5], [A])  # 5 was used after 6
    index.add(None, [7], [A])
    assert [k for k in (5, 6, 7) if present(index, k)] == [5, 7]
    index.add([9, 9], [1, 2], [B])  # an engine key repeated in a 1:1 add keeps both keys
    assert index.get_request_key(9) == 2
    index.evict(9, KeyType.ENGINE, [B])
    assert not present(index, 1) and not present(index, 2)


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_entries_are_matched_as_podentry_equality_does(make: Any) -> None:
    class Tagged(PodEntry):
        __slots__ = ()

    index = make()
    tagged = Tagged("pod-a", "gpu")
    assert tagged != A  # dataclass equality compares the class too
    index.add(None, [1], [A])
    index.add(None, [1], [tagged])
    index.add(None, [1], [dataclasses.replace(A)])  # equal to A: refreshes it
    assert index.lookup([1]) == {1: [tagged, A]}
    index.evict(1, KeyType.REQUEST, [PodEntry("pod-a", "gpu")])
    assert index.lookup([1]) == {1: [tagged]}
    assert type(index.lookup([1])[1][0]) is Tagged


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_lookup_does_not_read_past_the_first_miss(make: Any) -> None:
    index = make()
    index.add(None, [1, 2], [A])
    # The walk stops at 3, so what follows is never read: not even checked (the contract
    # allows either; the embedded backends keep a miss at block 16 of 512 keys cheap).
    assert index.lookup([1, 3, "junk", -1]) == {1: [A]}
    assert index.lookup([1, 2, 3, [1]], {"pod-a"}) == {1: [A], 2: [A]}
    assert index.lookup([1, 2, 3, 2**64]) == {1: [A], 2: [A]}
    with pytest.raises(InvalidInputError):
        index.lookup([1, 2, "junk"])


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_pods_added_and_cleared_leave_nothing_behind(make: Any) -> None:
    index = make()
    index.add([100], [1], [A])

    def churn() -> None:
        for n in range(2000):
            pod = f"pod-churn-{n}"
            index.add([200 + n], [2, 3 + n], [PodEntry(pod, "gpu"), PodEntry(pod, "cpu")])
            index.evict(3 + n, KeyType.REQUEST, [PodEntry(pod, "cpu")])
            index.clear(pod)

    churn()  # the dicts reach their size
    grown, _ = _traced_bytes(churn)
    assert grown < 20_000, f"{grown} bytes kept after 2,000 pods came and went"
    assert present(index, 1) == {A} and len(index) == 1


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_expiry_follows_the_latest_add_across_clears(make: Any, monkeypatch: Any) -> None:
    clock = [1000.0]
    monkeypatch.setattr(memory_index, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    index = make()
    spec = PodEntry("pod-s", speculative=True)
    index.add(None, [1, 2, 3], [spec], ttl=5)
    index.clear("pod-s")  # the deadlines of the first add must not outlive it
    index.add(None, [1], [PodEntry("pod-s", speculative=True)])  # equal, without a ttl
    index.add(None, [2], [spec], ttl=50)
    index.add(None, [3], [spec, A], ttl=None)
    clock[0] += 10
    assert [present(index, k) for k in (1, 2, 3)] == [{spec}, {spec}, {spec, A}]
    clock[0] += 100
    assert [present(index, k) for k in (1, 2, 3)] == [{spec}, set(), {spec, A}]
    index.clear("pod-s")
    index.clear("pod-a")
    assert len(index) == 0
    if isinstance(index, CostAwareMemoryIndex):
        assert index.cost() == 0


# -- CostAwareMemoryIndex ----------------------------------------------------------------------


def test_cost_aware_budget_and_default() -> None:
    assert CostAwareMemoryIndex().max_cost() == 2 * 1024**3
    assert CostAwareMemoryIndex(CostAwareMemoryIndexConfig("500MiB")).max_cost() == 500 * 2**20
    assert CostAwareMemoryIndex(CostAwareMemoryIndexConfig(12345)).max_cost() == 12345


def test_cost_aware_index_stays_within_budget_dropping_least_recently_used() -> None:
    budget = 40 * (KEY_COST + estimated_entry_cost(A))
    index = CostAwareMemoryIndex(CostAwareMemoryIndexConfig(budget))
    index.add(None, [0], [A])
    for key in range(1, 200):
        index.add(None, [key], [A])
        index.lookup([0])  # key 0 stays the most recently used
        assert index.cost() <= index.max_cost()
    kept = [k for k in range(200) if present(index, k)]
    assert 0 in kept
    assert len(kept) == 40
    assert kept[1:] == list(range(161, 200))


def test_cost_aware_index_drops_old_engine_mappings_first_when_they_are_older() -> None:
    budget = 10 * (KEY_COST + estimated_entry_cost(A))
    index = CostAwareMemoryIndex(CostAwareMemoryIndexConfig(budget))
    index.add([1000], [1], [A])
    for key in range(2, 40):
        index.add(None, [key], [A])
    assert present(index, 1) == set()
    with pytest.raises(EngineKeyNotFoundError):
        index.get_request_key(1000)
    assert index.cost() <= budget


def test_cost_returns_to_zero_once_everything_is_removed() -> None:
    index = CostAwareMemoryIndex()
    entries = [A, PodEntry("pod-a", "cpu"), PodEntry("pod-long" * 20, "gpu", has_group=True)]
    index.add(list(range(100, 108)), list(range(1, 5)), entries)
    index.add([200], list(range(3, 9)), [B])
    index.add(None, [1, 2], [C])
    assert index.cost() > 0
    index.evict(1, KeyType.REQUEST, [C])
    index.clear("pod-a")
    index.clear("pod-long" * 20)
    index.clear("pod-c")
    index.evict(200, KeyType.ENGINE, [B])
    # Mappings whose request keys are all empty now go on their next engine-key evict.
    for engine_key in range(100, 108):
        index.evict(engine_key, KeyType.ENGINE, [A])
    assert len(index) == 0
    assert index.cost() == 0


def _traced_bytes(build: Any) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, result
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("pods,mapped", [(1, False), (4, True)])
def test_cost_estimate_tracks_the_memory_actually_allocated(pods: int, mapped: bool) -> None:
    n = 10_000
    keys = [(k * 0x9E3779B97F4A7C15) % 2**64 for k in range(1, n + 1)]
    engine = [(k * 0xBF58476D1CE4E5B9) % 2**64 for k in range(1, n + 1)]

    def build() -> CostAwareMemoryIndex:
        # Keys made here, as a hasher makes them: the index keeps its own ints, and the
        # estimate counts them.
        index = CostAwareMemoryIndex()
        for p in range(pods):
            for i in range(0, n, 64):
                index.add(
                    [k ^ 0 for k in engine[i : i + 64]] if mapped else None,
                    [k ^ 0 for k in keys[i : i + 64]],
                    [PodEntry(f"pod-{p}", "gpu")],
                )
        return index

    actual, index = _traced_bytes(build)
    ratio = index.cost() / actual
    assert 0.8 <= ratio <= 1.75, f"estimate {index.cost()} vs allocated {actual}"


# -- BatchIndex specifics ----------------------------------------------------------------------


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_apply_batch_argument_checks(make: Any) -> None:
    index = make()
    ops = [AddOp(None, (1,), (A,))]
    for stream, watermark in [
        ("s", None),
        (None, Watermark(0, 0)),
        ("", Watermark(0, 0)),
        (5, Watermark(0, 0)),
        ("s", (0, 0)),
    ]:
        with pytest.raises(InvalidInputError):
            index.apply_batch(ops, stream, watermark)
    with pytest.raises(InvalidInputError):
        index.apply_batch(AddOp(None, (1,), (A,)))  # a single op is not a batch
    with pytest.raises(InvalidInputError):
        index.get_watermark("")
    with pytest.raises(InvalidInputError):
        index.reset_watermark("s", (1, 2))
    assert len(index) == 0


# -- a reference model ------------------------------------------------------------------------

ENTRIES = [
    PodEntry(p, t, s) for p in ("p0", "p1", "p2") for t in ("gpu", "cpu") for s in (False, True)
]
# Sometimes an equal copy: the index must match entries by value, not by identity.
SOME_ENTRY = st.tuples(st.sampled_from(ENTRIES), st.booleans()).map(
    lambda pair: dataclasses.replace(pair[0]) if pair[1] else pair[0]
)
KEYS = st.integers(0, 7)
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.none() | st.lists(st.integers(100, 105), max_size=4),
            st.lists(KEYS, min_size=1, max_size=4),
            st.lists(SOME_ENTRY, min_size=1, max_size=3),
        ),
        st.tuples(
            st.just("evict"),
            st.sampled_from(KeyType),
            st.integers(0, 7) | st.integers(100, 105),
            st.lists(SOME_ENTRY, min_size=1, max_size=3),
        ),
        st.tuples(st.just("clear"), st.sampled_from(["p0", "p1", "p2"])),
    ),
    max_size=30,
)


class Model:
    """The contract, written as plainly as possible (unbounded)."""

    def __init__(self) -> None:
        self.keys: dict[int, set[PodEntry]] = {}
        self.engine: dict[int, list[int]] = {}

    def add(self, eng: list[int] | None, req: list[int], ents: list[PodEntry]) -> None:
        for r in req:
            self.keys.setdefault(r, set()).update(ents)
        if eng:
            n = max(len(eng), len(req))
            for i in range(n):
                e, r = eng[i * len(eng) // n], req[i * len(req) // n]
                refs = self.engine.setdefault(e, [])
                if r in refs:
                    refs.remove(r)
                refs.append(r)

    def evict(self, key_type: KeyType, key: int, ents: list[PodEntry]) -> None:
        targets = [key] if key_type is KeyType.REQUEST else self.engine.get(key, [])
        for r in targets:
            if r in self.keys:
                self.keys[r] -= set(ents)
                if not self.keys[r]:
                    del self.keys[r]
        if (
            key_type is KeyType.ENGINE
            and key in self.engine
            and not any(r in self.keys for r in self.engine[key])
        ):
            del self.engine[key]

    def clear(self, pod: str) -> None:
        for r in list(self.keys):
            self.keys[r] = {e for e in self.keys[r] if e.pod_identifier != pod}
            if not self.keys[r]:
                del self.keys[r]
        for e in [e for e, refs in self.engine.items() if not any(r in self.keys for r in refs)]:
            del self.engine[e]


def _unbounded_in_memory() -> InMemoryIndex:
    """An InMemoryIndex that keeps every entry of a key, as the model does (the default keeps
    10 per key, and the model's ops can put all 12 ENTRIES on one key)."""
    return InMemoryIndex(InMemoryIndexConfig(pod_cache_size=len(ENTRIES)))


@pytest.mark.parametrize("make", [_unbounded_in_memory, CostAwareMemoryIndex])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_embedded_backends_match_a_reference_model(make: Any, ops: list[Any]) -> None:
    index, model = make(), Model()
    for op in ops:
        if op[0] == "add":
            index.add(op[1], op[2], op[3])
            model.add(op[1], op[2], op[3])
        elif op[0] == "evict":
            index.evict(op[2], op[1], op[3])
            model.evict(op[1], op[2], op[3])
        else:
            index.clear(op[1])
            model.clear(op[1])
        for key in range(8):
            assert present(index, key) == model.keys.get(key, set())
        for chain in ([0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 5], [5, 2, 2, 6]):
            assert index.score(chain) == LongestPrefixScorer().score(chain, index.lookup(chain))
        for engine_key in range(100, 106):
            expected = model.engine.get(engine_key)
            if expected is None:
                with pytest.raises(EngineKeyNotFoundError):
                    index.get_request_key(engine_key)
            else:
                assert index.get_request_key(engine_key) == expected[-1]
    assert len(index) == len(model.keys)
    check_entry_records(index)
    if isinstance(index, CostAwareMemoryIndex):
        for pod in ("p0", "p1", "p2"):
            index.clear(pod)
        for engine_key in range(100, 106):
            index.evict(engine_key, KeyType.ENGINE, [ENTRIES[0]])
        assert index.cost() == 0


def check_entry_records(index: Any) -> None:
    """Every entry record counts exactly the keys holding its entry (inline keys, whose tuples
    hold it and which its log names, and run positions), with the rest of the index's internal
    invariants (``tests/memory_state.py``)."""
    memory_state.check(index)


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_concurrent_scores_and_writes_keep_the_entry_records_exact(make: Any) -> None:
    index = make()
    chains = [[c * 1000 + i for i in range(64)] for c in range(6)]
    pods = [PodEntry(f"pod-{p}", tier) for p in range(4) for tier in ("gpu", "cpu")]
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                chain, entry = rng.choice(chains), rng.choice(pods)
                action = rng.random()
                if action < 0.6:
                    index.add(None, chain[: rng.randint(1, 64)], [entry])
                elif action < 0.9:
                    index.evict(rng.choice(chain), KeyType.REQUEST, [entry])
                else:
                    index.clear_entries(entry.pod_identifier, device_tiers=[entry.device_tier])
        except BaseException as exc:
            errors.append(exc)

    def scorer() -> None:
        try:
            for n in range(300):
                chain = chains[n % len(chains)]
                scores = index.score(chain, {"gpu": 1.0, "cpu": 0.3})
                assert all(0 < v <= 64 for v in scores.values())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=scorer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    check_entry_records(index)
    for chain in chains:
        expected = LongestPrefixScorer().score(chain, index.lookup(chain))
        assert index.score(chain) == expected


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_the_key_log_of_an_entry_stays_bounded_under_churn(make: Any) -> None:
    index = make()
    index.add(None, [1], [A])  # keeps A's record alive throughout
    for round_ in range(50):
        keys = list(range(10 + round_ * 50, 10 + round_ * 50 + 40))
        index.add(None, keys, [A])
        index.add(None, keys[::2], [A, B])  # re-added to half of them, with another entry
        for key in keys[:-3]:
            index.evict(key, KeyType.REQUEST, [A])
        held = index._held[memory_tables.equality_key(A)]
        assert held.count == 1 + 3 * (round_ + 1)
        assert len(held.log) <= 2 * (held.count + len(keys)) + LOG_SLACK  # (+ evicted since)
    live = {k for k in range(2600) if A in present(index, k)}
    assert len(live) == 1 + 3 * 50
    assert index.clear_with_progress("pod-a") == len(live)
    assert all(A not in present(index, k) for k in range(2600))
    assert memory_tables.equality_key(A) not in index._held


# -- parse_size --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("500MiB", 500 * 1024**2),
        ("1GB", 10**9),
        ("2GiB", 2 * 1024**3),
        ("1.5GiB", 1536 * 1024**2),
        ("100KB", 100_000),
        ("100KiB", 102_400),
        ("3TB", 3 * 10**12),
        ("1TiB", 1024**4),
        ("4096", 4096),
        (4096, 4096),
        ("64B", 64),
        (" 2 gib ", 2 * 1024**3),
        ("1mb", 10**6),
        ("8K", 8000),
        ("8Ki", 8192),
        ("0.5KiB", 512),
        ("1.0001KB", 1000),
        ("1e3", 1000),
        ("2.5e1MB", 25 * 10**6),
    ],
)
def test_parse_size(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "GiB",
        "abc",
        "1XB",
        "-1",
        "-1GiB",
        "0",
        "0.1",
        0,
        -5,
        True,
        1.5,
        None,
        "1.2.3MB",
        "1 G iB",
        "1GiBs",
        "∞",
        "nan",
    ],
)
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_configs_validate_eagerly() -> None:
    with pytest.raises(ConfigError):
        CostAwareMemoryIndexConfig("lots")
    for kwargs in ({"size": 0}, {"pod_cache_size": 0}, {"size": "10"}, {"pod_cache_size": True}):
        with pytest.raises(ConfigError):
            InMemoryIndexConfig(**kwargs)
    with pytest.raises(ConfigError):
        InMemoryIndex(CostAwareMemoryIndexConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        CostAwareMemoryIndex(InMemoryIndexConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [InMemoryIndex, CostAwareMemoryIndex])
def test_clear_drops_unheld_mappings_across_several_pages(make: Any) -> None:
    index = make()
    n = 2 * CLEAR_MAPPINGS_PER_PAGE + 17
    a, b = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu")
    engine = list(range(1, n + 1))
    request = list(range(10**6, 10**6 + n))
    index.add(engine, request, [a])
    shared = request[::3]  # every third key is also held by pod-b and must keep its mapping
    index.add(None, shared, [b])
    index.clear("pod-a")
    kept = set(shared)
    for e, r in zip(engine, request, strict=True):
        if r in kept:
            assert index.get_request_key(e) == r
        else:
            with pytest.raises(EngineKeyNotFoundError):
                index.get_request_key(e)

"""One reference for the score, and every other place that computes it checked against it.

The longest-prefix score is computed in four places that must give bit-identical floats:
:class:`kvredis.scoring.LongestPrefixScorer` (the reference), ``lua/score.lua`` (Redis and
Valkey), the cluster client's merge of per-shard lookups (scored on the client), and the
embedded indexes' own walk (``kvredis/memory/walks.py``). Here every backend is driven through
the index interface with random holdings on random chains, kept in lockstep with a plain model of
what each key holds: tiers and tier weights (sums exact in binary and not), data-parallel ranks,
KV-cache groups, speculative entries, expiring entries (live, and lapsed before the reads),
holes (mid-chain evictions, by request and by engine key), pod filters, and chains read in
parts (a few keys per script call). The reference scores the model's holdings; each backend's
``score_by_rank`` and ``score`` must give exactly its floats, on a single server and a cluster,
Redis and Valkey, and in the embedded indexes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvredis.memory import InMemoryIndex, InMemoryIndexConfig
from kvredis.redis import ops as redis_ops
from kvredis.redis.cluster import ops as cluster_ops
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType, PodEntry
from tests.conftest import BACKENDS, close_backend, make_backend
from tests.test_index_conformance import hashes

PODS = ["pod-0", "pod-1", "pod-2", "pod-3", "pod-4"]
TIERS = ["gpu", "cpu", "disk", "x"]
RANKS = [0, 0, 0, 1, 3]
#: Weight maps: the defaults; sums inexact in binary (any reordered or lossy sum shows); exact
#: multiples of 2^-10 (the server adds a run of keys in one step); a zero and a huge weight;
#: none (every tier weighs 1.0).
WEIGHTS: list[dict[str, float] | None] = [
    None,
    {"gpu": 0.1, "cpu": 0.7, "disk": 1 / 3},
    {"gpu": 1.0, "cpu": 0.5, "disk": 0.25, "x": 2.0},
    {"gpu": 1e-7, "cpu": 123456.789, "x": 0.0},
    {},
]
LONG_TTL, SHORT_TTL = 600.0, 0.05


class Model:
    """What each request key holds: entry -> its deadline (``None``: no expiry), with the
    index's write semantics (a confirmed entry replaces its pod's expiring speculative
    entries under the key; a speculative entry added again without a ttl stops expiring).

    Engine-key mappings are kept per group of pods sharing them (``group``: one group on a
    single server and in the embedded index; a cluster placing pods keeps each shard's own,
    those its pods' adds recorded: docs/design/cluster.md). An evict by engine key resolves it
    for each entry through the entry's group, so a pod whose group never recorded the mapping
    (or dropped it) keeps its entries, as the index does."""

    def __init__(self, group: Callable[[str], int] = lambda pod: 0) -> None:
        self.keys: dict[int, dict[PodEntry, float | None]] = {}
        self.engine: dict[int, int] = {}  # every engine key an add mapped: its request key
        self.group = group
        self.mapped: dict[tuple[int, int], int] = {}  # (group, engine key) -> request key

    def add(self, keys: list[int], entries: list[PodEntry], ttl: float | None) -> None:
        deadline = None if ttl is None else time.monotonic() + ttl
        for key in keys:
            held = self.keys.setdefault(key, {})
            if ttl is None:
                for entry in entries:
                    if not entry.speculative:
                        for other, d in list(held.items()):
                            if d is not None and other.speculative and (
                                other.pod_identifier == entry.pod_identifier
                            ):
                                del held[other]
            for entry in entries:
                held[entry] = deadline

    def map(self, engine: list[int], keys: list[int], entries: list[PodEntry]) -> None:
        """An add's one-to-one mappings, recorded in the groups of its entries' pods."""
        self.engine.update(zip(engine, keys, strict=True))
        for group in {self.group(e.pod_identifier) for e in entries}:
            self.mapped.update(((group, e), k) for e, k in zip(engine, keys, strict=True))

    def evict(self, key: int, entries: list[PodEntry]) -> None:
        held = self.keys.get(key, {})
        for entry in entries:
            held.pop(entry, None)

    def evict_engine(self, engine: int, entries: list[PodEntry], now: float) -> None:
        """An evict by engine key: in each entry's group, through that group's mapping; a
        group's mapping goes once its request key holds no entry (live at ``now``) of the
        group's pods."""
        groups: dict[int, list[PodEntry]] = {}
        for entry in entries:
            groups.setdefault(self.group(entry.pod_identifier), []).append(entry)
        for group, gone in groups.items():
            key = self.mapped.get((group, engine))
            if key is None:
                continue
            self.evict(key, gone)
            if not any(
                self.group(e.pod_identifier) == group and (d is None or d > now)
                for e, d in self.keys.get(key, {}).items()
            ):
                del self.mapped[(group, engine)]

    def lookup(self, keys: list[int], pods: Any) -> dict[int, list[PodEntry]]:
        """Every key's live entries (of the filter's pods): the reference's input."""
        now = time.monotonic()
        out: dict[int, list[PodEntry]] = {}
        for key in keys:
            live = [
                e
                for e, d in self.keys.get(key, {}).items()
                if (d is None or d > now) and (pods is None or e.pod_identifier in pods)
            ]
            if live:
                out[key] = live
        return out


def _entry(rng: random.Random, speculative: bool | None = None) -> PodEntry:
    spec = rng.random() < 0.25 if speculative is None else speculative
    grouped = rng.random() < 0.2
    return PodEntry(
        rng.choice(PODS),
        "" if spec and rng.random() < 0.3 else rng.choice(TIERS),
        speculative=spec,
        has_group=grouped,
        group_idx=rng.randrange(3) if grouped else 0,
        dp_rank=rng.choice(RANKS),
    )


def _fill(
    index: Any, model: Model, rng: random.Random, chains: list[list[int]], expiring: bool
) -> None:
    """Random holdings, written to the index and the model alike (with ``expiring``, some of
    them speculative entries with a ttl: while one is live the server reads keys one by one,
    else a run of keys holding the same entries at once)."""
    next_engine = 1
    for _ in range(60):
        chain = rng.choice(chains)
        end = rng.randint(1, len(chain))
        start = 0 if rng.random() < 0.75 else rng.randrange(end)
        keys = chain[start:end]
        roll = rng.random()
        if roll < 0.2 and expiring:  # speculative entries that expire, some before the reads
            entries = [_entry(rng, speculative=True) for _ in range(rng.randint(1, 2))]
            ttl = LONG_TTL if rng.random() < 0.6 else SHORT_TTL
            index.add(None, keys, entries, ttl=ttl)
            model.add(keys, entries, ttl)
        elif roll < 0.3:  # with engine keys (1:1), evicted later by engine key
            entries = [_entry(rng, speculative=False)]
            engine = list(range(next_engine, next_engine + len(keys)))
            next_engine += len(keys)
            index.add(engine, keys, entries)
            model.add(keys, entries, None)
            model.map(engine, keys, entries)
        else:
            entries = [_entry(rng) for _ in range(rng.randint(1, 3))]
            index.add(None, keys, entries)
            model.add(keys, entries, None)
        if rng.random() < 0.35:  # a hole: a mid-chain eviction
            key = rng.choice(keys)
            held = list(model.keys.get(key, {}))
            if held:
                gone = rng.sample(held, rng.randint(1, len(held)))
                engine_key = next((e for e, k in model.engine.items() if k == key), None)
                if engine_key is not None and rng.random() < 0.5:
                    # entries of pods of several shards: each resolves the engine key in its
                    # own shard (the model keeps the mappings per group of pods alike)
                    now = time.monotonic()
                    index.evict(engine_key, KeyType.ENGINE, gone)
                    model.evict_engine(engine_key, gone, now)
                else:
                    index.evict(key, KeyType.REQUEST, gone)
                    model.evict(key, gone)


def mapping_group(index: Any) -> Callable[[str], int]:
    """The group of pods sharing engine-key mappings a pod is in: its shard on a cluster placing
    pods (``shares_mappings`` in tests/test_index_conformance.py), one group elsewhere."""
    core = getattr(getattr(index, "inner", index), "core", None)
    return (lambda pod: 0) if core is None else core.pod_shard


def _bits(by_rank: dict[str, dict[int, float]]) -> dict[str, dict[int, str]]:
    return {pod: {rank: s.hex() for rank, s in ranks.items()} for pod, ranks in by_rank.items()}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "memory":
        # The model keeps every entry of a key; InMemoryIndex keeps at most pod_cache_size (10
        # by default, the least recently added dropped first: tests/test_memory.py), a bound
        # the random holdings here pass, so it gets room for all of them.
        index: Any = InMemoryIndex(InMemoryIndexConfig(pod_cache_size=1_000))
    else:
        index = make_backend(request.param, request)
    try:
        yield index
    finally:
        close_backend(index)


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "in-parts"])
@pytest.mark.parametrize("expiring", [False, True], ids=["runs", "expiring"])
@pytest.mark.parametrize("seed", [11, 12])
def test_every_scoring_path_gives_the_references_floats(
    backend: Any, seed: int, expiring: bool, parts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if parts:  # a handful of keys per script call: every chain goes in parts (waves)
        monkeypatch.setattr(redis_ops, "SCORE_KEYS_PER_CALL", 7)
        monkeypatch.setattr(redis_ops, "LOOKUP_KEYS_PER_CALL", 5)
        monkeypatch.setattr(cluster_ops, "LOOKUP_KEYS_PER_CALL", 6)
    rng = random.Random(seed)
    chains = [hashes(rng.randint(20, 45), f"reference/{seed}/{c}") for c in range(4)]
    model = Model(mapping_group(backend))
    _fill(backend, model, rng, chains, expiring)
    if expiring:
        time.sleep(4 * SHORT_TTL)  # the short-lived entries lapse before any read
    queries = [*chains, chains[0][:9], chains[1][1:], chains[2][:1], []]
    queries.append([*chains[3][:6], *hashes(1, f"reference/{seed}/hole"), *chains[3][7:]])
    compared = 0
    for weights in WEIGHTS:
        scorer = LongestPrefixScorer(weights)
        for pods in (None, {"pod-1", "pod-3", "pod-none"}, {"pod-2"}):
            for keys in queries:
                expected = scorer.score_by_rank(keys, model.lookup(keys, pods))
                got = backend.score_by_rank(keys, weights, pods)
                assert _bits(got) == _bits(expected), (weights, pods, len(keys))
                best = {pod: max(ranks.values()) for pod, ranks in expected.items()}
                score = backend.score(keys, weights, pods)
                assert {p: s.hex() for p, s in score.items()} == {
                    p: s.hex() for p, s in best.items()
                }
                compared += len(expected)
    assert compared > 50  # the holdings gave scores to compare, not only empty results

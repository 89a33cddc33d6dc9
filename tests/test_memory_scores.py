"""The embedded indexes' scores against the reference scorer over an independent model, on random
chains held by data-parallel ranks, tiers, KV-cache groups, speculative and expiring entries."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvredis.index import RankScoringIndex, ScoringIndex
from kvredis.memory import CostAwareMemoryIndex, InMemoryIndex, InMemoryIndexConfig
from kvredis.memory import index as memory_index
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType, PodEntry

BACKENDS = [
    pytest.param(lambda: InMemoryIndex(InMemoryIndexConfig(pod_cache_size=1000)), id="memory"),
    pytest.param(CostAwareMemoryIndex, id="cost_aware"),
]
WEIGHTS: list[dict[str, float] | None] = [None, {"gpu": 0.1, "cpu": 0.7}, {"gpu": 1.0}, {}]


class Model:
    """What each request key holds: entry -> deadline (``None``: does not expire)."""

    def __init__(self) -> None:
        self.keys: dict[int, dict[PodEntry, float | None]] = {}

    def add(self, keys: list[int], entries: list[PodEntry], ttl: float | None, now: float) -> None:
        confirmed = {e.pod_identifier for e in entries if not e.speculative}
        for key in keys:
            held = self.keys.setdefault(key, {})
            for entry in [e for e, d in held.items() if d is not None]:
                if entry.pod_identifier in confirmed:  # a confirmation replaces expiring copies
                    del held[entry]
            for entry in entries:
                held[entry] = None if ttl is None else now + ttl

    def evict(self, key: int, entries: list[PodEntry]) -> None:
        for entry in entries:
            self.keys.get(key, {}).pop(entry, None)

    def lookup(self, keys: list[int], now: float) -> dict[int, list[PodEntry]]:
        out = {}
        for key in keys:
            live = [e for e, d in self.keys.get(key, {}).items() if d is None or d > now]
            if not live:
                break
            out[key] = live
        return out


def _bits(scores: dict[str, Any]) -> dict[str, Any]:
    return {
        pod: _bits(value) if isinstance(value, dict) else value.hex()
        for pod, value in scores.items()
    }


@pytest.mark.parametrize("make", BACKENDS)
@pytest.mark.parametrize("seed", range(6))
def test_scores_per_rank_match_the_reference_on_random_chains(
    make: Any, seed: int, monkeypatch: Any
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(memory_index, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    rng = random.Random(seed)
    index, model = make(), Model()
    assert isinstance(index, RankScoringIndex) and isinstance(index, ScoringIndex)
    chains = [[rng.getrandbits(64) for _ in range(48)] for _ in range(3)]
    pods = [f"pod-{p}" for p in range(4)]

    def entry(speculative: bool) -> PodEntry:
        group = rng.random() < 0.2
        return PodEntry(
            rng.choice(pods),
            rng.choice(["gpu", "cpu", "disk"]),
            speculative=speculative,
            has_group=group,
            group_idx=rng.randint(0, 2) if group else 0,
            dp_rank=rng.choice([0, 0, 1, 2]),
        )

    for _ in range(300):
        chain = rng.choice(chains)
        start = 0 if rng.random() < 0.7 else rng.randrange(len(chain))
        keys = chain[start : rng.randint(start + 1, len(chain))]
        action = rng.random()
        if action < 0.55:
            entries = [entry(False) for _ in range(rng.randint(1, 2))]
            index.add(None, keys, entries)
            model.add(keys, entries, None, clock[0])
        elif action < 0.75:
            entries = [entry(True) for _ in range(rng.randint(1, 2))]
            ttl = rng.choice([None, 0.5, 2.0, 5.0])
            index.add(None, keys, entries, ttl=ttl)
            model.add(keys, entries, ttl, clock[0])
        elif action < 0.9:
            key = rng.choice(keys)
            held = list(model.keys.get(key, {})) or [entry(False)]
            evicted = rng.sample(held, rng.randint(1, min(2, len(held))))
            index.evict(key, KeyType.REQUEST, evicted)
            model.evict(key, evicted)
        else:
            clock[0] += rng.choice([0.3, 1.0, 3.0])
        if rng.random() < 0.3:
            query = rng.choice(chains)[: rng.randint(1, 48)]
            pod_filter = rng.choice([None, None, set(rng.sample(pods, 2))])
            found = model.lookup(query, clock[0])
            if pod_filter is not None:
                found = {
                    k: [e for e in v if e.pod_identifier in pod_filter] for k, v in found.items()
                }
                found = _prefix(query, found)
            for weights in WEIGHTS:
                scorer = LongestPrefixScorer(weights)
                want = scorer.score_by_rank(query, found)
                got = index.score_by_rank(query, weights, pod_filter)
                assert _bits(got) == _bits(want), (weights, pod_filter)
                assert _bits(index.score(query, weights, pod_filter)) == _bits(
                    scorer.score(query, found)
                )


def _prefix(keys: list[int], found: dict[int, list[PodEntry]]) -> dict[int, list[PodEntry]]:
    """A lookup cut at the first key with no entry left after filtering."""
    out = {}
    for key in keys:
        if not found.get(key):
            break
        out[key] = found[key]
    return out


@pytest.mark.parametrize("make", BACKENDS)
def test_a_rank_scores_only_its_own_prefix(make: Any) -> None:
    index = make()
    keys = [11, 12, 13]
    index.add(None, [11, 13], [PodEntry("pod-a", "gpu")])
    index.add(None, [12], [PodEntry("pod-a", "gpu", dp_rank=1)])
    assert index.score(keys) == {"pod-a": 1.0}
    assert index.score_by_rank(keys) == {"pod-a": {0: 1.0}}
    index.add(None, keys, [PodEntry("pod-a", "cpu", dp_rank=2)])
    assert index.score_by_rank(keys, {"gpu": 1.0, "cpu": 0.25}) == {
        "pod-a": {0: 1.0, 2: 0.75},
    }
    assert index.score(keys, {"gpu": 1.0, "cpu": 0.25}) == {"pod-a": 1.0}
    assert index.score(keys, {"gpu": 1.0, "cpu": 0.5}) == {"pod-a": 1.5}

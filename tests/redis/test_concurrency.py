"""Several processes hammer one namespace; afterwards Redis itself is checked for invariants."""

from __future__ import annotations

import multiprocessing
import random
import uuid

import pytest
import redis

from kvredis import KeyType, PodEntry, RedisIndex, RedisIndexConfig
from tests.redis.checks import check_findings
from tests.redis.namespace_state import read_namespace

pytestmark = pytest.mark.redis

KEYS = 96  # request key i is mapped from engine key ENGINE_BASE + i by every process
ENGINE_BASE = 1 << 40
SPECULATIVE_BASE = 1 << 50  # keys added without engine keys, evicted by request key
PROCESSES = 4
STEPS = 400


def request_key(i: int) -> int:
    # Spread over the 64-bit range, including values above 2**63.
    return (i * 0x9E3779B97F4A7C15 + 12345) % (1 << 64)


def worker(url: str, namespace: str, worker_id: int, seed: int) -> dict[str, list[int]]:
    """Random adds, evicts, lookups and clears of this worker's own pod on shared keys.

    Returns the worker's model: which request keys hold each of its entries at the end.
    """
    rng = random.Random(seed)
    pod = f"worker-{worker_id}"
    entries = [PodEntry(pod, "gpu"), PodEntry(pod, "cpu"), PodEntry(pod, "gpu", has_group=True)]
    held: dict[PodEntry, set[int]] = {e: set() for e in entries}
    speculative = PodEntry(pod, "gpu", speculative=True)
    spec_held: set[int] = set()
    with RedisIndex(RedisIndexConfig(address=url, namespace=namespace, pool_size=2)) as idx:
        for _ in range(STEPS):
            roll = rng.random()
            entry = rng.choice(entries)
            if roll < 0.45:
                start = rng.randrange(KEYS)
                stop = min(KEYS, start + rng.randint(1, 12))
                idx.add(
                    [ENGINE_BASE + i for i in range(start, stop)],
                    [request_key(i) for i in range(start, stop)],
                    [entry],
                )
                held[entry].update(range(start, stop))
            elif roll < 0.75:
                i = rng.randrange(KEYS)
                idx.evict(ENGINE_BASE + i, KeyType.ENGINE, [entry])
                held[entry].discard(i)
            elif roll < 0.82:
                i = rng.randrange(16)
                idx.add(None, [SPECULATIVE_BASE + i], [speculative])
                spec_held.add(i)
            elif roll < 0.88:
                i = rng.randrange(16)
                idx.evict(SPECULATIVE_BASE + i, KeyType.REQUEST, [speculative])
                spec_held.discard(i)
            elif roll < 0.99:
                chain = [request_key(i) for i in range(KEYS)]
                found = idx.lookup(chain, {pod})
                # The walk stops at the first key this pod does not hold (by its own model).
                expected_len = next(
                    (i for i in range(KEYS) if not any(i in h for h in held.values())), KEYS
                )
                assert len(found) == expected_len
            else:
                idx.clear(pod)
                for keys in held.values():
                    keys.clear()
                spec_held.clear()
    model = {f"{e.device_tier}/{e.has_group}": sorted(keys) for e, keys in held.items()}
    model["speculative"] = sorted(spec_held)
    return model


def test_processes_keep_the_layout_consistent(redis_server_url: str) -> None:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as pool:
        results = pool.starmap(
            worker, [(redis_server_url, namespace, w, 1000 + w) for w in range(PROCESSES)]
        )
    client = redis.Redis.from_url(redis_server_url)
    try:
        state = read_namespace(client, namespace)
    finally:
        client.close()
    assert state.problems == []
    assert check_findings(RedisIndexConfig(address=redis_server_url, namespace=namespace)) == []
    # Every add that returned and was not evicted since is visible, and nothing else is.
    for worker_id, model in enumerate(results):
        pod = f"worker-{worker_id}"
        kinds = {
            "gpu/False": PodEntry(pod, "gpu"),
            "cpu/False": PodEntry(pod, "cpu"),
            "gpu/True": PodEntry(pod, "gpu", has_group=True),
        }
        for kind, entry in kinds.items():
            visible = sorted(
                i for i in range(KEYS) if entry in state.requests.get(request_key(i), [])
            )
            assert visible == model[kind], (pod, kind)
        spec = PodEntry(pod, "gpu", speculative=True)
        visible_spec = sorted(
            i for i in range(16) if spec in state.requests.get(SPECULATIVE_BASE + i, [])
        )
        assert visible_spec == model["speculative"]
    # A request key holds entries exactly when its engine mapping exists.
    for i in range(KEYS):
        holds = bool(state.requests.get(request_key(i)))
        assert (ENGINE_BASE + i in state.engines) == holds, i
        if holds:
            assert state.engines[ENGINE_BASE + i] == [request_key(i)]
    assert sum(len(v) for v in state.requests.values()) > 0

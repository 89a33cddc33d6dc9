"""Speculative entries with a ttl in Redis: reclaimed by the writes, memory back to baseline."""

from __future__ import annotations

import time

import pytest
import redis

from kvredis import KeyType, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.redis.layout import Layout

pytestmark = pytest.mark.redis

SPEC = PodEntry("pod-a", speculative=True)
CONFIRMED = PodEntry("pod-b", "gpu")


def buckets(raw: redis.Redis, namespace: str) -> dict[bytes, dict[bytes, bytes]]:
    """Every request and engine bucket of the namespace with its fields."""
    out = {}
    for key in raw.scan_iter(match=f"{namespace}:[re]:*"):
        out[key] = raw.hgetall(key)
    return out


def test_expired_entries_are_reclaimed_and_the_namespace_returns_to_baseline(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    try:
        confirmed = list(range(1, 201))
        index.add(list(range(10_001, 10_201)), confirmed, [CONFIRMED])
        # The speculative entry's definition (one per pod, like every entry) stays; define it
        # before the baseline so that only what expires is compared.
        index.add(None, [5_000_000], [SPEC])
        index.evict(5_000_000, KeyType.REQUEST, [SPEC])
        keys_before = sorted(raw.scan_iter(match=f"{namespace}:*"))
        buckets_before = buckets(raw, namespace)
        sx = Layout(namespace, 1, b"").sx

        spec_keys = [*confirmed[:100], *range(1_000_000, 1_001_200)]
        index.add(None, spec_keys, [SPEC], ttl=0.2)
        assert raw.zcard(sx) == len(spec_keys)
        assert len(buckets(raw, namespace)) >= len(buckets_before)
        time.sleep(0.35)
        assert index.lookup(spec_keys[100:]) == {}
        assert index.lookup(confirmed) == {k: [CONFIRMED] for k in confirmed}
        assert index.score(confirmed[:3]) == {"pod-b": 3.0}
        # Writes reclaim a bounded number of expired pairs per call.
        calls = 0
        while raw.exists(sx):
            index.add(None, confirmed[:1], [CONFIRMED])
            calls += 1
            assert calls < 10
        assert calls >= 2
        assert sorted(raw.scan_iter(match=f"{namespace}:*")) == keys_before
        assert buckets(raw, namespace) == buckets_before
        assert index.lookup(confirmed) == {k: [CONFIRMED] for k in confirmed}
    finally:
        index.close()

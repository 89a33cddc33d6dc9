"""drop_namespace: removes exactly one namespace, and the clients keep working afterwards."""

from __future__ import annotations

import pytest
import redis

from kvredis import AsyncRedisIndex, PodEntry, RedisIndex, RedisIndexConfig

pytestmark = pytest.mark.redis

P = PodEntry("pod-a", "gpu")


def test_drop_namespace_spares_prefix_sharing_namespaces_and_foreign_keys(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    mine = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    longer = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace + "x"))
    try:
        raw.set(f"foreign-{namespace}", b"1")
        mine.add(list(range(1, 200)), list(range(1000, 1199)), [P])
        longer.add([1], [1000], [P])
        before_longer = set(raw.scan_iter(match=f"{namespace}x:*"))
        deleted = mine.drop_namespace()
        assert deleted > 0
        assert list(raw.scan_iter(match=f"{namespace}:*")) == []
        assert set(raw.scan_iter(match=f"{namespace}x:*")) == before_longer
        assert raw.get(f"foreign-{namespace}") == b"1"
        assert longer.lookup([1000]) == {1000: [P]}
        assert mine.lookup(list(range(1000, 1199))) == {}
        mine.add([7], [8], [P])
        assert mine.lookup([8]) == {8: [P]}
        assert mine.get_request_key(7) == 8
    finally:
        raw.delete(f"foreign-{namespace}")
        mine.drop_namespace()
        longer.drop_namespace()
        for c in (mine, longer):
            c.close()
        raw.close()


async def test_async_drop_namespace(redis_server_url: str, namespace: str) -> None:
    index = AsyncRedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    try:
        await index.add([1, 2], [3, 4], [P])
        assert await index.drop_namespace() > 0
        assert await index.lookup([3, 4]) == {}
    finally:
        await index.aclose()

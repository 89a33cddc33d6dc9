"""An :class:`AsyncRedisIndex` used without ``connect()`` connects whole on its first call, as
:class:`~kvredis.RedisIndex` does when it is built (and ``AsyncRedisClusterIndex`` on its first
call): the function library is chosen (and loaded), a cluster node is refused, an unsafe
eviction policy is warned of (raised with ``strict``), and a namespace it creates records how
the server expires entries (``field`` on Valkey 9)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
import redis

from kvredis import (
    AsyncRedisIndex,
    ClusterModeError,
    PodEntry,
    RedisIndexConfig,
    UnsafeServerConfigError,
)
from kvredis.redis.layout import meta_key
from kvredis.redis.ops import expiry_mode_of
from tests.conftest import TEST_PREFIX
from tests.servers import LocalCluster, RedisServer

A = PodEntry("pod-a", "gpu")

#: Each first call an application may make.
FIRST_CALLS: dict[str, Callable[[AsyncRedisIndex], Awaitable[Any]]] = {
    "lookup": lambda index: index.lookup([1]),
    "score": lambda index: index.score([1]),
    "add": lambda index: index.add(None, [1], [A]),
    "apply_batch": lambda index: index.apply_batch([]),
    "get_watermark": lambda index: index.get_watermark("s"),
}


def _config(server: RedisServer, **kw: Any) -> RedisIndexConfig:
    return RedisIndexConfig(address=server.url, namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:8]}",
                            **kw)  # fmt: skip


def _run(config: RedisIndexConfig, call: Callable[[AsyncRedisIndex], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        index = AsyncRedisIndex(config)
        try:
            await call(index)
            return index
        finally:
            await index.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("first", sorted(FIRST_CALLS))
def test_the_first_call_chooses_and_loads_the_function_library(
    own_redis_server: RedisServer, first: str
) -> None:
    raw = redis.Redis(port=own_redis_server.port)
    try:
        index = _run(_config(own_redis_server), FIRST_CALLS[first])
        assert index.registry.active
        assert raw.function_list(library="kvredis")  # loaded by that first call
        stats = raw.info("commandstats")
        assert "cmdstat_evalsha" not in stats
    finally:
        raw.close()


def test_the_first_call_warns_of_an_eviction_policy_and_raises_with_strict(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    try:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        config = _config(own_redis_server)
        with caplog.at_level(logging.WARNING):
            _run(config, FIRST_CALLS["lookup"])
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("allkeys-lru" in m and "noeviction" in m for m in warned), warned
        with pytest.raises(UnsafeServerConfigError, match="allkeys-lru"):
            _run(replace(config, strict=True), FIRST_CALLS["add"])
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


def test_a_namespace_the_first_call_creates_records_the_servers_expiry_mode(
    own_redis_server: RedisServer,
) -> None:
    raw = redis.Redis(port=own_redis_server.port)
    try:
        config = _config(own_redis_server)
        _run(config, FIRST_CALLS["add"])
        expected = expiry_mode_of(raw.info("server"))
        assert raw.hget(meta_key(config.namespace), "expiry") == expected.encode()
        if own_redis_server.kind == "valkey":
            assert expected == "field"  # Valkey 9 expires hash fields
    finally:
        raw.close()


def test_the_first_call_refuses_a_cluster_node(redis_cluster: LocalCluster) -> None:
    port = redis_cluster.live_ports()[0]
    config = RedisIndexConfig(
        address=f"redis://127.0.0.1:{port}", namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:8]}"
    )
    with pytest.raises(ClusterModeError, match="cluster_enabled:1"):
        _run(config, FIRST_CALLS["lookup"])

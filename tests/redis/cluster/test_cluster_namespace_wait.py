"""A router on a cluster started before its namespace exists: it says so (its read-only user
may not write the descriptor), and with ``wait_for_namespace`` waits for the ingester."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from kvredis import PodEntry, RedisClusterIndex, RedisIndexConfig
from kvredis.errors import NamespaceMissingError
from kvredis.testing.servers import LocalCluster
from tests.redis.test_acl_functions import PASSWORD, printed

A = PodEntry("pod-a", "gpu")


@pytest.fixture
def router_url(redis_cluster: LocalCluster) -> Iterator[tuple[str, str]]:
    """A namespace and the cluster address as its router user (made on every node)."""
    namespace = f"kvt-{uuid.uuid4().hex[:10]}"
    args = [*printed("router", namespace), "+cluster|slots", "+cluster|shards", "+readonly"]
    user = args[2]
    for port in redis_cluster.ports:
        with redis_cluster.client(port) as client:
            client.execute_command(*args)
    seeds = ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports[:3])
    yield namespace, f"redis+cluster://{quote(user, safe='')}:{PASSWORD}@{seeds}"
    for port in redis_cluster.ports:
        with redis_cluster.client(port) as client:
            client.execute_command("ACL", "DELUSER", user)


def test_a_cluster_router_says_the_namespace_does_not_exist_yet(
    router_url: tuple[str, str],
) -> None:
    namespace, url = router_url
    with pytest.raises(NamespaceMissingError, match="does not exist yet"):
        RedisClusterIndex(RedisIndexConfig(address=url, namespace=namespace))


def test_a_cluster_router_waits_for_the_ingester(
    redis_cluster: LocalCluster, router_url: tuple[str, str]
) -> None:
    namespace, url = router_url
    config = RedisIndexConfig(address=url, namespace=namespace, wait_for_namespace=30)
    got: dict[str, Any] = {}

    def route() -> None:
        try:
            with RedisClusterIndex(config) as router:
                got["scores"] = router.score([1, 2, 3])
        except BaseException as exc:
            got["error"] = exc

    thread = threading.Thread(target=route)
    thread.start()
    time.sleep(0.6)
    assert thread.is_alive()
    admin = RedisIndexConfig(address=redis_cluster.url, namespace=namespace)
    with RedisClusterIndex(admin) as ingester:
        ingester.add([9], [1, 2, 3], [A])
        thread.join(40)
        assert "error" not in got, got.get("error")
        assert got["scores"] == {"pod-a": 3.0}
        ingester.drop_namespace()

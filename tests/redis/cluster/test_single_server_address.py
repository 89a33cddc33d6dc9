"""A cluster node addressed as a single server: a clear ClusterModeError at connect, not the
``server error: <slot> <host>:<port>`` of a MOVED reply with its code stripped."""

from __future__ import annotations

import uuid

import pytest

from kvredis import (
    AsyncRedisIndex,
    BackendError,
    ClusterModeError,
    ConfigError,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.errors import translate
from kvredis.redis.cluster.slots import key_slot
from kvredis.redis.layout import Layout
from tests.conftest import TEST_PREFIX, LoopThread
from tests.servers import LocalCluster


def _namespace_keys(cluster: LocalCluster, namespace: str) -> int:
    total = 0
    for port in cluster.live_ports():
        client = cluster.client(port)
        try:
            total += len(list(client.scan_iter(match=f"{namespace}*")))
        finally:
            client.close()
    return total


def test_every_node_addressed_as_a_single_server_raises(redis_cluster: LocalCluster) -> None:
    namespace = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    for port in redis_cluster.live_ports():  # primaries and replicas
        config = RedisIndexConfig(address=f"redis://127.0.0.1:{port}", namespace=namespace)
        with pytest.raises(ClusterModeError, match="redis\\+cluster://") as caught:
            RedisIndex(config)
        assert f"127.0.0.1:{port}" in str(caught.value)
        assert "cluster_enabled:1" in str(caught.value)
        loop = LoopThread()
        try:
            with pytest.raises(ClusterModeError, match="redis\\+cluster://"):
                loop.run(AsyncRedisIndex.create(config))
        finally:
            loop.close()
    assert _namespace_keys(redis_cluster, namespace) == 0  # refused before writing anything


def test_without_info_a_redirect_reply_still_raises(redis_cluster: LocalCluster) -> None:
    """A user not allowed to run INFO: the first key command gets MOVED, which says it too."""
    primaries = [p for p, (role, _, _) in redis_cluster.topology().items() if role == "master"]
    port = primaries[0]
    admin = redis_cluster.client(port)
    try:
        # a namespace whose meta record lives on another node: the HMGET gets MOVED
        namespace = next(
            name
            for name in (f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}" for _ in range(1000))
            if not _serves(redis_cluster, port, key_slot(Layout(name, 16, b"").meta))
        )
        acl = ("on", ">pw", "~*", "&*", "+@all", "-info")
        admin.execute_command("ACL", "SETUSER", "kvt-noinfo", *acl)
        config = RedisIndexConfig(
            address=f"redis://kvt-noinfo:pw@127.0.0.1:{port}", namespace=namespace
        )
        with pytest.raises(ClusterModeError, match="MOVED") as caught:
            RedisIndex(config)
        assert isinstance(caught.value, ConfigError) and isinstance(caught.value, BackendError)
    finally:
        admin.execute_command("ACL", "DELUSER", "kvt-noinfo")
        admin.close()


def _serves(cluster: LocalCluster, port: int, slot: int) -> bool:
    for part in cluster.topology()[port][2].split():
        first, _, last = part.partition("-")
        if int(first) <= slot <= int(last or first):
            return True
    return False


@pytest.mark.parametrize(
    "reply",
    [
        "MOVED 16170 127.0.0.1:7462",
        "ASK 1 10.0.0.1:7000",
        "CROSSSLOT Keys in request don't hash to the same slot",
        "CLUSTERDOWN The cluster is down",
    ],
)
def test_cluster_replies_translate_to_the_typed_error(reply: str) -> None:
    error = translate(reply)
    assert isinstance(error, ClusterModeError)
    assert reply in str(error) and "redis+cluster://" in str(error)

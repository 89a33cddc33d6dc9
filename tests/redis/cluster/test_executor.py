"""Parallel waves on the real clusters: one round trip per node, resharding (MOVED, ASK) and a
failover ridden out, bounded retries."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvredis import BackendUnavailableError, RedisIndexConfig
from kvredis.redis.cluster.executor import AsyncClusterExecutor, SyncClusterExecutor
from kvredis.redis.cluster.routing import SlotCommand
from kvredis.redis.cluster.slots import key_slot
from kvredis.redis.requests import ErrorReply
from tests.conftest import TEST_PREFIX, LoopThread
from tests.servers import LocalCluster, free_port


def _keys(count: int) -> list[bytes]:
    prefix = f"{TEST_PREFIX}{uuid.uuid4().hex[:8]}:".encode()
    rng = random.Random(count)
    return [prefix + rng.randbytes(6).hex().encode() for _ in range(count)]


def _sets(keys: list[bytes]) -> list[SlotCommand]:
    return [SlotCommand(key_slot(k), ("SET", k, i)) for i, k in enumerate(keys)]


def _gets(keys: list[bytes]) -> list[SlotCommand]:
    return [SlotCommand(key_slot(k), ("GET", k)) for k in keys]


@pytest.fixture
def executor(redis_cluster: LocalCluster) -> Iterator[SyncClusterExecutor]:
    cluster_executor = SyncClusterExecutor(RedisIndexConfig(address=redis_cluster.url))
    try:
        yield cluster_executor
    finally:
        cluster_executor.close()


def test_a_wave_is_one_round_trip_per_node(executor: SyncClusterExecutor) -> None:
    keys = _keys(300)
    assert len(executor.slot_map.primaries) == 3
    assert executor.refresh() == executor.slot_map
    before = executor.round_trips
    assert executor.wave(_sets(keys)) == [b"OK"] * len(keys)
    assert executor.round_trips - before == 3
    assert executor.wave(_gets(keys)) == [str(i).encode() for i in range(len(keys))]
    wrong = executor.wave([SlotCommand(key_slot(keys[0]), ("HGET", keys[0], "f"))])
    assert isinstance(wrong[0], ErrorReply) and wrong[0].code == "WRONGTYPE"


def test_reads_from_replicas(redis_cluster: LocalCluster, executor: SyncClusterExecutor) -> None:
    keys = _keys(60)
    executor.wave(_sets(keys))
    redis_cluster.wait_replicated()
    assert executor.wave(_gets(keys), read=True) == [str(i).encode() for i in range(len(keys))]


def test_the_asyncio_executor(redis_cluster: LocalCluster) -> None:
    keys = _keys(200)

    async def scenario() -> tuple[list[Any], list[Any], int]:
        cluster_executor = AsyncClusterExecutor(RedisIndexConfig(address=redis_cluster.url))
        try:
            written = await cluster_executor.wave(_sets(keys))
            start = cluster_executor.round_trips
            read = await cluster_executor.wave(_gets(keys))
            return written, read, cluster_executor.round_trips - start
        finally:
            await cluster_executor.aclose()

    loop = LoopThread()
    try:
        written, read, trips = loop.run(scenario())
    finally:
        loop.close()
    assert written == [b"OK"] * len(keys)
    assert read == [str(i).encode() for i in range(len(keys))]
    assert trips == 3


def _node_ids(cluster: LocalCluster) -> dict[int, str]:
    ids = {}
    for port in cluster.live_ports():
        client = cluster.client(port)
        ids[port] = client.execute_command("CLUSTER", "MYID")
        client.close()
    return ids


def _set_slot(cluster: LocalCluster, port: int, slot: int, *args: Any) -> None:
    client = cluster.client(port)
    try:
        client.execute_command("CLUSTER", "SETSLOT", slot, *args)
    finally:
        client.close()


def test_resharding_ask_then_moved(
    redis_cluster: LocalCluster, executor: SyncClusterExecutor
) -> None:
    """Migrate one slot to another primary for real: mid-migration the moved key answers ASK,
    afterwards the stale map gets MOVED; the executor follows both."""
    keys = _keys(40)
    executor.wave(_sets(keys))
    # a key alone in its slot: the slot is handed over once that key moved (the session's
    # cluster holds other tests' keys too)
    key = next(k for k in keys if _keys_in_slot(redis_cluster, executor, key_slot(k)) == 1)
    value = str(keys.index(key)).encode()
    slot = key_slot(key)
    source = executor.slot_map.primary(slot)
    target = next(n for n in executor.slot_map.primaries if n != source)
    ids = _node_ids(redis_cluster)
    _set_slot(redis_cluster, target.port, slot, "IMPORTING", ids[source.port])
    _set_slot(redis_cluster, source.port, slot, "MIGRATING", ids[target.port])
    moved_back = False
    try:
        client = redis_cluster.client(source.port)
        try:
            client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", key)
        finally:
            client.close()
        # the key left, its slot did not: the source answers ASK
        assert executor.wave(_gets([key])) == [value]
        trips = executor.round_trips
        # finish the migration (on every primary, as redis-cli does)
        for node in executor.slot_map.primaries:
            _set_slot(redis_cluster, node.port, slot, "NODE", ids[target.port])
        assert executor.slot_map.primary(slot) == source  # the executor's map is stale now
        assert executor.wave(_gets([key])) == [value]  # MOVED, then the new owner
        assert executor.round_trips - trips == 3  # MOVED, CLUSTER SHARDS, the new owner
        assert executor.slot_map.primary(slot) == target  # refreshed
        moved_back = _move_slot_back(redis_cluster, executor, slot, key, target, source, ids)
    finally:
        if not moved_back:
            for node in executor.slot_map.primaries:
                _set_slot(redis_cluster, node.port, slot, "STABLE")
    redis_cluster.wait_converged()


def _keys_in_slot(cluster: LocalCluster, executor: SyncClusterExecutor, slot: int) -> int:
    client = cluster.client(executor.slot_map.primary(slot).port)
    try:
        return int(client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot))
    finally:
        client.close()


def _move_slot_back(
    cluster: LocalCluster, executor: SyncClusterExecutor, slot: int, key: bytes,
    holder: Any, owner: Any, ids: dict[int, str],
) -> bool:  # fmt: skip
    _set_slot(cluster, owner.port, slot, "IMPORTING", ids[holder.port])
    _set_slot(cluster, holder.port, slot, "MIGRATING", ids[owner.port])
    client = cluster.client(holder.port)
    try:
        client.execute_command("MIGRATE", "127.0.0.1", owner.port, "", 0, 5000, "KEYS", key)
    finally:
        client.close()
    for node in executor.slot_map.primaries:
        _set_slot(cluster, node.port, slot, "NODE", ids[owner.port])
    return True


def test_a_failover_is_ridden_out(redis_cluster: LocalCluster) -> None:
    config = RedisIndexConfig(address=redis_cluster.url, retries=4)
    cluster_executor = SyncClusterExecutor(config)
    keys = _keys(90)
    killed = None
    try:
        cluster_executor.wave(_sets(keys))
        redis_cluster.wait_replicated()
        killed, promoted = redis_cluster.kill_primary()
        assert any(n.port == killed for n in cluster_executor.slot_map.primaries)  # stale map
        assert cluster_executor.wave(_gets(keys)) == [str(i).encode() for i in range(len(keys))]
        assert any(n.port == promoted for n in cluster_executor.slot_map.primaries)
        assert cluster_executor.wave(_sets(keys[:5])) == [b"OK"] * 5
    finally:
        cluster_executor.close()
        if killed is not None:
            redis_cluster.revive(killed)


def test_no_reachable_seed_is_unavailable() -> None:
    config = RedisIndexConfig(
        address=f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}",
        retries=0,
        connect_timeout=0.5,
    )
    cluster_executor = SyncClusterExecutor(config)
    try:
        with pytest.raises(BackendUnavailableError, match="told its slot map"):
            cluster_executor.wave(_gets([b"x"]))
    finally:
        cluster_executor.close()

"""A primary killed in the middle of a mixed workload, on real redis 7 and Valkey 9 clusters
(:mod:`tests.redis.cluster.faults`), and the ``WAIT``-based durability of
``cluster_wait_replicas``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvredis import BackendUnavailableError, ConfigError, PodEntry, RedisIndexConfig
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.cluster.routing import Wave
from kvredis.redis.requests import ConnectionLost
from tests.conftest import TEST_PREFIX
from tests.redis.cluster.faults import fault_run
from tests.servers import LocalCluster

A = PodEntry("pod-a", "gpu")


def test_a_primary_killed_mid_workload_is_ridden_out_and_keeps_every_later_write(
    redis_cluster: LocalCluster,
) -> None:
    """Adds of 64-512-block chains, evicts by engine key, watermarked batches, lookups and
    scores from four threads; a primary is killed after a second and revived once its replica
    took over. With retries covering a failover (about two node timeouts) no call fails, and
    every write acknowledged after the failover is in the index. Writes acknowledged just
    before the kill may be lost (asynchronous replication; on loopback a primary has sent
    them to its replica along with the reply, so next to none are): counted, not asserted."""
    outcome = fault_run(redis_cluster, before=1.0, after=1.0, retries=12, retry_backoff=0.05)
    print(outcome.line())
    assert outcome.errors == [] and outcome.retried == 0
    assert outcome.victim_pods  # the killed primary held writers' pods: their writes rode it out
    assert outcome.at_risk > 0 and outcome.acknowledged_after > 0
    assert outcome.lost_after == 0, outcome.lost_writes
    assert outcome.longest < outcome.failover + 5


@pytest.fixture
def waiting(redis_cluster: LocalCluster) -> Iterator[RedisClusterIndex]:
    config = RedisIndexConfig(
        address=redis_cluster.url,
        namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}",
        cluster_shards=8,
        cluster_wait_replicas=1,
        socket_timeout=0.6,
    )
    with RedisClusterIndex(config) as index:
        yield index
        index.drop_namespace()


def _watch(index: RedisClusterIndex, change: Any = None) -> list[list[tuple[Any, ...]]]:
    """Record the commands of every wave the index sends (``change`` may alter replies)."""
    sent: list[list[tuple[Any, ...]]] = []
    executor = index.executor
    send = executor._send

    def watching(wave: Wave) -> list[list[Any]]:
        sent.append([c for batch in wave.batches for c in batch.commands])
        replies = send(wave)
        return change(wave, replies) if change is not None else replies

    executor._send = watching  # type: ignore[method-assign]
    return sent


def _waits(sent: list[list[tuple[Any, ...]]]) -> int:
    return sum(1 for wave in sent for command in wave if command[0] == "WAIT")


def _pods_of_every_shard(index: RedisClusterIndex) -> list[PodEntry]:
    """One pod entry per shard (so a write of them all reaches every primary)."""
    found: dict[int, PodEntry] = {}
    n = 0
    while len(found) < index.shards:
        found.setdefault(index.core.pod_shard(f"pod-{n}"), PodEntry(f"pod-{n}", "gpu"))
        n += 1
    return list(found.values())


def test_writes_wait_for_a_replica_of_every_primary_they_wrote_to_reads_do_not(
    waiting: RedisClusterIndex,
) -> None:
    every = _pods_of_every_shard(waiting)
    waiting.add([1], list(range(1, 65)), every)  # every shard, so every primary
    sent = _watch(waiting)
    waiting.add([2], list(range(100, 164)), every)
    nodes = len(waiting.executor.slot_map.primaries)
    assert _waits(sent) == nodes  # one WAIT per primary, in the write's own wave
    assert len(sent) == 1
    sent.clear()
    waiting.add(None, [200], [A])  # one pod: its shard's primary only
    assert _waits(sent) == 1 and len(sent) == 1
    sent.clear()
    assert len(waiting.lookup(range(1, 65))) == 64
    assert waiting.get_request_key(1) == 64
    assert _waits(sent) == 0


def test_a_write_fewer_replicas_acknowledged_raises(redis_cluster: LocalCluster) -> None:
    config = RedisIndexConfig(
        address=redis_cluster.url,
        namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}",
        cluster_wait_replicas=2,  # each primary has one replica
        socket_timeout=0.4,
    )
    with RedisClusterIndex(replace(config, cluster_wait_replicas=0)) as creator:
        creator.add(None, [2], [A])  # connecting to a new namespace writes it (and waits)
    with RedisClusterIndex(config) as index:
        with pytest.raises(BackendUnavailableError, match="1 of the 2 replicas"):
            index.add(None, [1], [A])
        assert index.lookup([1, 2]) == {1: [A], 2: [A]}  # applied on the primary; reads do not wait
    with RedisClusterIndex(replace(config, cluster_wait_replicas=0)) as creator:
        creator.drop_namespace()


@pytest.mark.parametrize("lose", [-1, 0])
def test_a_pipeline_split_between_its_writes_and_its_wait_raises(
    waiting: RedisClusterIndex, lose: int
) -> None:
    """-1: the node answered the script, then the connection broke before WAIT's reply: the
    wave would resend WAIT to whichever node owns the slot by then, which proves nothing about
    the write. 0: the script's reply was lost but WAIT's came: the wave would resend the
    script alone. Either way the call does not return as confirmed: it raises, or it sends the
    write again together with its WAIT (the node-grouped path hands a failed node's writes to
    the per-shard path, which does that)."""
    lost: list[int] = []
    after: list[Wave] = []

    def lose_wait(wave: Wave, replies: list[list[Any]]) -> list[list[Any]]:
        if lost:
            after.append(wave)
        for batch, batch_replies in zip(wave.batches, replies, strict=True):
            if not lost and batch.commands[-1][0] == "WAIT" and len(batch.commands) > 1:
                batch_replies[lose] = ConnectionLost("connection lost")
                lost.append(1)
        return replies

    _watch(waiting, lose_wait)
    try:
        waiting.add(None, [1, 2, 3], [A])
    except BackendUnavailableError as exc:
        assert "came back split" in str(exc)
    else:
        assert any(
            batch.commands[-1][0] == "WAIT"
            and any(c[0] in ("EVALSHA", "FCALL") for c in batch.commands)
            for wave in after
            for batch in wave.batches
        )
    assert lost
    waiting.add(None, [1, 2, 3], [A])
    assert waiting.lookup([1, 2, 3]) == {1: [A], 2: [A], 3: [A]}


def test_a_write_waiting_on_a_primary_just_demoted_raises_unavailable(
    waiting: RedisClusterIndex, redis_cluster: LocalCluster
) -> None:
    """A manual failover demotes the primary of pod-a's shard after the index cached the slot
    map: the next write and its ``WAIT`` reach the demoted node, which redirects the write
    (sent again to the new primary) and refuses ``WAIT`` on a replica. Whether a replica holds
    the write is unknown: the call raises BackendUnavailableError (resending is safe), not a
    plain server error, and the write sent again is confirmed."""
    waiting.add(None, [1], [A])
    slot = waiting.core.slots[waiting.core.pod_shard(A.pod_identifier)]
    old = waiting.executor.slot_map.primary(slot).port
    replica = next(p for p, (_, primary, _) in redis_cluster.topology().items() if primary == old)
    assert redis_cluster.promote(replica) == old
    try:
        with pytest.raises(BackendUnavailableError, match="WAIT"):
            waiting.add(None, [2], [A])
        waiting.add(None, [2], [A])
        assert waiting.lookup([1, 2]) == {1: [A], 2: [A]}
    finally:
        redis_cluster.promote(old)
        waiting.lookup([1])  # a read redirected by the demoted node: the slot map is fresh again


def test_cluster_wait_replicas_config() -> None:
    seeds = "redis+cluster://127.0.0.1:7000"
    config = RedisIndexConfig.from_dict({"address": seeds, "clusterWaitReplicas": 1})
    assert config.cluster_wait_replicas == 1
    assert RedisIndexConfig(address=seeds).cluster_wait_replicas == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="cluster_wait_replicas"):
            RedisIndexConfig(address=seeds, cluster_wait_replicas=bad)  # type: ignore[arg-type]
    from kvredis.redis.config import check_supported

    with pytest.raises(ConfigError, match="cluster_wait_replicas"):
        check_supported(RedisIndexConfig(address="redis://127.0.0.1:6379", cluster_wait_replicas=1))

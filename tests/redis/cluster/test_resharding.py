"""Resharding is invisible to callers: a shard's slot moved to another primary, or migrating
while the index is in use, costs latency, never a failed call or a wrong answer. On real
redis-server 7 and Valkey 9 clusters, with the client's default retries and timeouts.

Every test moves a slot there and back (the session's cluster is left as it was).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kvredis import AddOp, EvictOp, InMemoryIndex, KeyType, PodEntry, RedisIndexConfig, Watermark
from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
from tests.conftest import TEST_PREFIX
from tests.redis.cluster.reshard import (
    Workload,
    begin_migration,
    hand_over,
    move_keys,
    on,
    owner,
    primaries,
    reshard,
    run_during,
    writer_pods,
)
from tests.servers import LocalCluster


@pytest.fixture
def cfg(redis_cluster: LocalCluster) -> Iterator[RedisIndexConfig]:
    config = RedisIndexConfig(
        address=redis_cluster.url,
        namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}",
        cluster_shards=8,
    )
    yield config
    with RedisClusterIndex(config) as index:
        index.drop_namespace()


def _pod_on(index: RedisClusterIndex | AsyncRedisClusterIndex, shard: int, tier: str) -> PodEntry:
    """An entry of a pod placed on ``shard``."""
    n = 0
    while index.core.pod_shard(f"pod-{n}") != shard:
        n += 1
    return PodEntry(f"pod-{n}", tier)


def _second_shard_of_a_node(
    index: RedisClusterIndex | AsyncRedisClusterIndex, cluster: LocalCluster
) -> tuple[int, int]:
    """``(first, second)``: two shards on one primary, ``first`` the lowest there (its keys
    route that primary's node-grouped calls), ``second`` the next."""
    by_node: dict[int, list[int]] = {}
    for shard, slot in enumerate(index.core.slots):
        by_node.setdefault(owner(cluster, slot), []).append(shard)
    shards = next(s for s in by_node.values() if len(s) > 1)
    return shards[0], shards[1]


def _check_like(model: InMemoryIndex, cfg: RedisIndexConfig, keys: list[int]) -> None:
    """A fresh client reads every key as the model holds it."""
    with RedisClusterIndex(cfg) as fresh:
        for key in keys:
            got = {k: set(v) for k, v in fresh.lookup([key]).items()}
            assert got == {k: set(v) for k, v in model.lookup([key]).items()}


def _writes(
    keys: list[int], first: PodEntry, second: PodEntry, step: int
) -> list[tuple[str, tuple]]:
    """Writes touching both shards (of ``first``'s pod and ``second``'s): an add, a batch, an
    evict."""
    chain = keys[4 * step : 4 * step + 4]
    engines = [1_000_000 + 4 * step + i for i in range(4)]
    batch = [
        AddOp(None, (keys[step + 32], keys[step + 40]), (second,)),
        EvictOp(keys[4 * step], KeyType.REQUEST, (first,)),
    ]
    return [
        ("add", (engines, chain, [first, second])),
        ("apply_batch", (batch, "w", Watermark(1, step + 1))),
        ("evict", (keys[4 * step + 1], KeyType.REQUEST, [second])),
    ]


def test_a_writes_only_client_follows_a_slot_move(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    """A client that only writes, on a shard whose slot moved to another primary while the
    client was idle: the node-grouped call of the old primary touches a key it no longer serves
    ("non local key"); the client refreshes its slot map and sends again, every write lands."""
    model = InMemoryIndex()
    keys = list(range(1, 65))
    with RedisClusterIndex(cfg) as index:
        first, second = _second_shard_of_a_node(index, redis_cluster)
        one, two = _pod_on(index, first, "gpu"), _pod_on(index, second, "cpu")
        slot = index.core.slots[second]
        source = owner(redis_cluster, slot)
        target = next(p for p in primaries(redis_cluster) if p != source)
        index.add(None, keys, [one, two])
        model.add(None, keys, [one, two])
        reshard(redis_cluster, slot, source, target, pause=0)
        try:
            for step in range(6):
                for name, args in _writes(keys, one, two, step):
                    getattr(index, name)(*args)
                    getattr(model, name)(*args)
            assert index.executor.slot_map.primary(slot).port == target
        finally:
            reshard(redis_cluster, slot, target, source, pause=0)
    _check_like(model, cfg, keys)


def test_an_async_writes_only_client_follows_a_slot_move(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    model = InMemoryIndex()

    async def run() -> list[int]:
        keys = list(range(1, 65))
        async with AsyncRedisClusterIndex(cfg) as index:
            first, second = _second_shard_of_a_node(index, redis_cluster)
            one, two = _pod_on(index, first, "gpu"), _pod_on(index, second, "cpu")
            slot = index.core.slots[second]
            source = owner(redis_cluster, slot)
            target = next(p for p in primaries(redis_cluster) if p != source)
            await index.add(None, keys, [one, two])
            model.add(None, keys, [one, two])
            reshard(redis_cluster, slot, source, target, pause=0)
            try:
                for step in range(6):
                    for name, args in _writes(keys, one, two, step):
                        await getattr(index, name)(*args)
                        getattr(model, name)(*args)
            finally:
                reshard(redis_cluster, slot, target, source, pause=0)
            return keys

    keys = asyncio.run(run())
    _check_like(model, cfg, keys)


@pytest.mark.parametrize(
    "importing_first", [True, False], ids=["importing-first", "migrating-first"]
)
def test_a_shard_migrating_under_a_mixed_workload_fails_no_call_and_answers_right(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster, importing_first: bool
) -> None:
    """A shard's slot migrates key batch by key batch (GETKEYSINSLOT + MIGRATE, SETSLOT in
    both orders), there and back, while two clients work across every shard: one adds,
    evicts, batches, looks up and scores, one only writes. No call fails, every answer is the
    model's, and so is every key afterwards."""
    with RedisClusterIndex(cfg) as index, RedisClusterIndex(cfg) as writer:
        mixed = Workload(index, range(1, 401))
        writes = Workload(
            writer, range(401, 801), seed=8, stream="ingest", reads=False, pods=writer_pods(writer)
        )
        for _ in range(10):
            mixed.step()
            writes.step()
        slot = index.core.slots[index.core.pod_shard("pod-0")]  # a shard the workloads write
        source = owner(redis_cluster, slot)
        target = next(p for p in primaries(redis_cluster) if p != source)
        moved: list[int] = []
        for there, back in ((source, target), (target, source)):

            def move(there: int = there, back: int = back) -> None:
                moved.append(reshard(redis_cluster, slot, there, back, importing_first))

            steps = run_during([mixed, writes], move)
            assert min(steps) >= 3
            assert index.executor.slot_map.primary(slot).port == back
        mixed.check_all()
        writes.check_all()
    for outcome in (mixed.outcome, writes.outcome):
        assert outcome.errors == [], outcome.summary()
        assert outcome.failed == 0 and outcome.mismatches == 0
    assert all(moved)


def test_a_write_meeting_a_moved_expiry_gate_waits_for_the_migration(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    """A shard whose expiry gate key (``<shard>:sx``) has moved to the target while its other
    keys are still on the source. A batch whose node-grouped call reaches the shard through
    another shard's keys cannot read the gate there: it must not take the gate for absent
    (its evict of a speculative entry would skip the expiring entries and leave the entry in
    place) but wait for the migration, then apply in full."""
    with RedisClusterIndex(cfg) as index:
        first, second = _second_shard_of_a_node(index, redis_cluster)
        kept, key = 1, 2
        A, B = _pod_on(index, second, "gpu"), _pod_on(index, first, "cpu")
        spec = replace(A, device_tier="", speculative=True)
        slot = index.core.slots[second]
        source = owner(redis_cluster, slot)
        target = next(p for p in primaries(redis_cluster) if p != source)
        index.add(None, [key], [A])
        index.add(None, [key], [spec], ttl=600)
        gate = index.core.state(second).layout.sx
        assert on(source, "EXISTS", gate) == 1
        begin_migration(redis_cluster, slot, source, target)
        on(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", gate)

        def finish() -> None:
            time.sleep(0.3)
            move_keys(slot, source, target)
            hand_over(redis_cluster, slot, source, target)

        mover = threading.Thread(target=finish)
        mover.start()
        try:
            batch = [AddOp(None, (kept,), (B,)), EvictOp(key, KeyType.REQUEST, (spec,))]
            assert index.apply_batch(batch)
        finally:
            mover.join(30)
        try:
            assert index.lookup([key]) == {key: [A]}
            assert index.lookup([kept]) == {kept: [B]}
        finally:
            reshard(redis_cluster, slot, target, source, pause=0)

"""Keys to shards: the one-pass form agrees with the per-key one, and groups keep chain order."""

from __future__ import annotations

import random

import pytest

from kvredis.redis.cluster.core import ClusterCore
from kvredis.redis.cluster.routing import ClusterState, WavePolicy
from kvredis.redis.cluster.shards import shard_of, shards_of
from kvredis.redis.cluster.topology import ClusterNode
from kvredis.redis.session import RetryPolicy

EDGES = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


@pytest.mark.parametrize("count", [1, 3, 16, 64, 256])
def test_shards_of_is_shard_of_per_key(count: int) -> None:
    rng = random.Random(count)
    keys = EDGES + [rng.getrandbits(64) for _ in range(2000)]
    assert shards_of(keys, count) == [shard_of(k, count) for k in keys]


def test_by_shard_groups_in_order() -> None:
    core = ClusterCore(
        "ns",
        16,
        16,
        ClusterState([ClusterNode("127.0.0.1", 1)]),
        WavePolicy(),
        RetryPolicy(2, 0.05, "test"),
    )
    core.adopt(16)
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(512)]
    groups = core.by_shard(iter(keys))  # any iterable
    assert sorted(k for part in groups.values() for k in part) == sorted(keys)
    for shard, part in groups.items():
        assert part == [k for k in keys if shard_of(k, 16) == shard]

"""The cluster index on real local clusters (redis-server 7 and Valkey 9): where keys land, what a
call costs in round trips, reads from replicas, the factories, and a differential run against
the single-server index (the conformance suite runs on clusters too)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    ConfigError,
    EngineKeyNotFoundError,
    EvictOp,
    InvalidInputError,
    KeyType,
    NamespaceLayoutError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
    new_index,
)
from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
from kvredis.redis.cluster.shards import (
    DEFAULT_SHARDS,
    check_cluster_namespace,
    parse_descriptor,
    shard_names,
    shard_of,
    shard_slot,
)
from kvredis.redis.cluster.slots import SLOT_COUNT, key_slot
from kvredis.redis.factories import new_async_redis_index, new_redis_index, new_valkey_index
from tests.redis.checks import check_findings
from tests.servers import LocalCluster

A = PodEntry("pod-a", "gpu")
B = PodEntry("pod-b", "cpu")


def chain(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


@pytest.fixture
def cfg(redis_cluster: LocalCluster) -> Iterator[RedisIndexConfig]:
    ns = f"kvt-c{uuid.uuid4().hex[:10]}"
    config = RedisIndexConfig(address=redis_cluster.url, namespace=ns)
    yield config
    with RedisClusterIndex(config) as index:
        index.drop_namespace()


# -- shards (no server) ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3, 16, 64])
def test_shards_get_one_slot_each_spread_evenly_over_the_slot_space(count: int) -> None:
    names = shard_names("kvblock", count)
    assert len(set(names)) == count
    for i, name in enumerate(names):
        slot = shard_slot(name)
        assert int(i * SLOT_COUNT / count) <= slot < int((i + 1) * SLOT_COUNT / count)
        # every key of the shard's layout hashes to the shard's slot
        for suffix in (":meta", ":pi", ":r:\x00\x01", ":e:\xff\xff", ":c:abcd", ":wm"):
            assert key_slot(name + suffix) == slot
    assert shard_names("kvblock", count) == names  # deterministic
    assert shard_names("other", count) != names


def test_keys_spread_evenly_over_shards() -> None:
    counts = [0] * 16
    for key in chain(16000, 1):
        counts[shard_of(key, 16)] += 1
    assert min(counts) > 800 and max(counts) < 1200


def test_cluster_namespaces_refuse_braces_and_bad_descriptors() -> None:
    with pytest.raises(InvalidInputError):
        check_cluster_namespace("a{b}")
    with pytest.raises(ConfigError):
        RedisIndexConfig(address="redis+cluster://127.0.0.1:7000", namespace="a{b}")
    with pytest.raises(ConfigError):
        RedisIndexConfig(address="redis+cluster://127.0.0.1:7000", cluster_shards=0)
    assert parse_descriptor([None, None], "x") is None
    assert parse_descriptor([b"kvredis-cluster/1", b"8"], "x") == 8
    with pytest.raises(NamespaceLayoutError):
        parse_descriptor([b"kvredis-cluster/9", b"8"], "x")
    with pytest.raises(NamespaceLayoutError):
        parse_descriptor([b"kvredis-cluster/1", b"zero"], "x")


def test_config_json_shape_and_factories_refuse_mixing_kinds() -> None:
    config = RedisIndexConfig.from_dict(
        {"address": "redis://127.0.0.1:7000", "cluster": True, "clusterShards": 8}
    )
    assert config.cluster and config.cluster_shards == 8
    with pytest.raises(ConfigError, match="cluster address"):
        RedisIndex(config)
    with pytest.raises(ConfigError, match="no cluster address"):
        RedisClusterIndex(RedisIndexConfig(address="redis://127.0.0.1:7000"))


# -- on a cluster ------------------------------------------------------------------------------


def test_keys_land_on_every_primary_each_shard_in_its_own_slot(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    with RedisClusterIndex(cfg) as index:
        assert index.shards == DEFAULT_SHARDS
        keys = chain(512, 2)
        index.add(chain(512, 3), keys, [A])
        slots = {shard_slot(name) for name in shard_names(cfg.namespace, index.shards)}
        per_node: dict[int, int] = {}
        for port in [node.port for node in index.executor.slot_map.primaries]:
            client = redis.Redis(port=port)
            try:
                found = list(client.scan_iter(match=cfg.namespace + ":*", count=1000))
            finally:
                client.close()
            per_node[port] = len(found)
            for key in found:
                assert key_slot(key) in slots | {key_slot(cfg.namespace + ":cluster")}
        assert len(per_node) == 3 and all(n > 0 for n in per_node.values()), per_node


def test_a_second_client_adopts_the_shard_count(cfg: RedisIndexConfig) -> None:
    keys = chain(64, 4)
    with RedisClusterIndex(cfg) as first:
        first.add(None, keys, [A])
    other = RedisIndexConfig(address=cfg.address, namespace=cfg.namespace, cluster_shards=4)
    with RedisClusterIndex(other) as second:
        assert second.shards == DEFAULT_SHARDS
        assert list(second.lookup(keys)) == keys


def test_the_chain_ends_at_the_first_key_missing_on_any_shard(cfg: RedisIndexConfig) -> None:
    keys = chain(200, 5)
    with RedisClusterIndex(cfg) as index:
        index.add(None, keys[:120], [A])
        index.add(None, keys[121:], [A])  # keys[120] missing, its shard holds later keys
        assert list(index.lookup(keys)) == keys[:120]
        assert index.score(keys) == {"pod-a": 120.0}
        # a pod filter cuts at that pod's first miss, across shards
        index.add(None, keys[:50], [B])
        assert list(index.lookup(keys, {"pod-b"})) == keys[:50]


def test_round_trips_are_one_per_involved_node(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    with RedisClusterIndex(cfg) as index:
        keys, engine = chain(512, 6), chain(512, 7)
        nodes = len(index.executor.slot_map.primaries)
        before = index.round_trips
        index.add(engine, keys, [A])
        assert index.round_trips - before <= nodes
        before = index.round_trips
        assert len(index.lookup(keys)) == 512
        assert index.round_trips - before <= nodes
        before = index.round_trips
        index.score(keys)
        assert index.round_trips - before <= nodes
        # a lookup of a short chain involves only the nodes of its keys' shards
        before = index.round_trips
        index.lookup(keys[:1])
        assert index.round_trips - before == 1
        # evict by engine key: read the mapping, evict and probe, drop the mapping
        before = index.round_trips
        index.evict(engine[10], KeyType.ENGINE, [A])
        assert index.round_trips - before <= 3
        with pytest.raises(EngineKeyNotFoundError):
            index.get_request_key(engine[10])


def _evalsha_calls(port: int) -> int:
    client = redis.Redis(port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    names = ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_fcall_ro")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in names)


def test_reads_from_replicas_spread_lookups_and_scores_over_replicas(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    keys = chain(256, 8)
    with RedisClusterIndex(cfg) as writer:
        writer.add(None, keys, [A])
        slot_map = writer.executor.slot_map
        primaries = [n.port for n in slot_map.primaries]
        replicas = [n.port for r in slot_map.ranges for n in r.replicas]
        for port in primaries:  # the replicas have the writes before we read them
            client = redis.Redis(port=port)
            try:
                client.execute_command("WAIT", 1, 5000)
            finally:
                client.close()
    reading = RedisIndexConfig(
        address=cfg.address, namespace=cfg.namespace, read_from_replicas=True
    )
    with RedisClusterIndex(reading) as reader:
        on_primaries = sum(_evalsha_calls(p) for p in primaries)
        on_replicas = sum(_evalsha_calls(p) for p in replicas)
        for _ in range(5):
            assert list(reader.lookup(keys)) == keys
            assert reader.score(keys) == {"pod-a": 256.0}
        assert sum(_evalsha_calls(p) for p in primaries) == on_primaries
        assert sum(_evalsha_calls(p) for p in replicas) >= on_replicas + 10 * 3
        # writes still go to the primaries
        reader.evict(keys[0], KeyType.REQUEST, [A])
        assert sum(_evalsha_calls(p) for p in primaries) > on_primaries


def test_factories_return_the_cluster_index(cfg: RedisIndexConfig) -> None:
    index = new_redis_index(cfg)
    try:
        assert isinstance(index, RedisClusterIndex)
    finally:
        index.close()
    valkey = new_valkey_index(cfg)
    try:
        assert isinstance(valkey, RedisClusterIndex)
        assert valkey.config.backend_type == "valkey"
    finally:
        valkey.close()
    via_json = new_index(
        {"redisConfig": {"address": cfg.address, "namespace": cfg.namespace, "clusterShards": 4}}
    )
    try:
        assert isinstance(via_json, RedisClusterIndex)
        via_json.add(None, [1, 2, 3], [A])
        assert list(via_json.lookup([1, 2, 3])) == [1, 2, 3]
    finally:
        via_json.close()  # type: ignore[attr-defined]


async def test_async_cluster_index(cfg: RedisIndexConfig) -> None:
    index = new_async_redis_index(cfg)
    assert isinstance(index, AsyncRedisClusterIndex)
    async with index:
        keys, engine = chain(100, 9), chain(100, 10)
        await index.add(engine, keys, [A])
        assert list(await index.lookup(keys)) == keys
        await index.evict(engine[3], KeyType.ENGINE, [A])
        assert list(await index.lookup(keys)) == keys[:3]
        assert await index.apply_batch([AddOp(None, (keys[3],), (A,))], "s", Watermark(1, 0))
        assert not await index.apply_batch([AddOp(None, (keys[3],), (A,))], "s", Watermark(1, 0))
        assert await index.get_watermark("s") == Watermark(1, 0)
        assert await index.clear_with_progress("pod-a") == 100


# -- differential: the cluster index against the single-server index ----------------------------


def _random_ops(rng: random.Random, chains: list[tuple[list[int], list[int]]]) -> list[Any]:
    pods = [A, B, PodEntry("pod-c", "gpu", group_idx=1, has_group=True)]
    ops: list[Any] = []
    for _ in range(rng.randint(1, 6)):
        engine, request = rng.choice(chains)
        ents = tuple(rng.sample(pods, rng.randint(1, 2)))
        start = rng.randrange(len(request))
        end = rng.randint(start + 1, len(request))
        kind = rng.random()
        if kind < 0.4:
            e_lo, e_hi = start * len(engine) // len(request), -(-end * len(engine) // len(request))
            ops.append(AddOp(tuple(engine[e_lo:e_hi]), tuple(request[start:end]), ents))
        elif kind < 0.55:
            ops.append(AddOp(None, tuple(request[start:end]), ents))
        elif kind < 0.85:
            ops.append(EvictOp(rng.choice(engine), KeyType.ENGINE, ents))
        else:
            ops.append(EvictOp(request[start], KeyType.REQUEST, ents))
    return ops


def test_random_batches_give_the_single_server_index_s_answers(
    cfg: RedisIndexConfig, redis_server_url: str
) -> None:
    rng = random.Random(20261203)
    chains: list[tuple[list[int], list[int]]] = []
    for c in range(6):
        n = rng.choice([8, 24, 40])
        ratio = rng.choice([1, 2, 4])
        engine = chain(n // ratio if c % 2 else n * ratio // ratio, 100 + c)
        if c % 3 == 2:
            engine = chain(n * 2, 200 + c)  # many engine blocks per request key
        chains.append((engine, chain(n, 300 + c)))
    single_cfg = RedisIndexConfig(address=redis_server_url, namespace=cfg.namespace)
    with RedisClusterIndex(cfg) as cluster, RedisIndex(single_cfg) as single:
        try:
            for step in range(120):
                ops = _random_ops(rng, chains)
                mark = Watermark(0, step) if step % 2 else None
                stream = "diff" if mark else None
                assert cluster.apply_batch(ops, stream, mark) == single.apply_batch(
                    ops, stream, mark
                )
                if step % 25 == 24:
                    pod = rng.choice(["pod-a", "pod-b"])
                    cluster.clear(pod)
                    single.clear(pod)
                for engine, request in chains:
                    assert _norm(cluster.lookup(request)) == _norm(single.lookup(request)), step
                    for key in engine:
                        assert _mapped(cluster, key) == _mapped(single, key), (step, key)
                assert check_findings(cfg) == [], step
                assert check_findings(single_cfg) == [], step
            assert cluster.get_watermark("diff") == single.get_watermark("diff")
        finally:
            single.drop_namespace()


def _norm(found: dict[int, list[PodEntry]]) -> dict[int, set[PodEntry]]:
    return {k: set(v) for k, v in found.items()}


def _mapped(index: Any, engine_key: int) -> int | None:
    try:
        return int(index.get_request_key(engine_key))
    except EngineKeyNotFoundError:
        return None


def test_the_operator_cli_on_a_cluster(cfg: RedisIndexConfig) -> None:
    from click.testing import CliRunner

    from kvredis.cli.app import cli

    runner = CliRunner()
    base = ["--redis", cfg.address, "--namespace", cfg.namespace]
    missing = runner.invoke(
        cli, ["lookup", *base, "--model", "m", "--tokens", "1,2,3,4", "--block-size", "2"]
    )
    assert missing.exit_code == 1 and "does not exist" in missing.output, missing.output
    with RedisClusterIndex(cfg) as index:
        index.add(None, chain(8, 11), [A])
    stats = runner.invoke(cli, ["stats", *base, "--json"])
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["request_keys"] == 8
    cleared = runner.invoke(cli, ["clear", *base, "--pod", "pod-a", "--yes", "--json"])
    assert cleared.exit_code == 0, cleared.output
    assert json.loads(cleared.output) == {"pod": "pod-a", "removed": 8}
    found = runner.invoke(
        cli, ["lookup", *base, "--model", "m", "--tokens", "1,2", "--block-size", "2", "--json"]
    )
    assert found.exit_code == 0, found.output


def _first_waves(op: Any, waves: int) -> Any:
    """Run only the first ``waves`` requests of a cluster operation (a sender that dies)."""
    reply = None
    for _ in range(waves):
        reply = yield op.send(reply)
    op.close()


def test_a_batch_cut_short_leaves_the_watermark_behind_and_the_next_sender_finishes_it(
    cfg: RedisIndexConfig,
) -> None:
    from kvredis.redis.cluster.writes import op_cluster_apply_batch

    keys, engine = chain(64, 12), chain(64, 13)
    batch = [
        AddOp(tuple(engine), tuple(keys), (A,)),
        EvictOp(engine[40], KeyType.ENGINE, (A,)),
        AddOp(None, tuple(keys[:8]), (B,)),
    ]
    with RedisClusterIndex(cfg) as index, RedisClusterIndex(cfg) as other:
        assert index.apply_batch([], "s", Watermark(1, 0))
        # the sender dies after the opening wave and the mapping read
        index.executor.run(
            _first_waves(op_cluster_apply_batch(index.core, batch, "s", Watermark(1, 1)), 2)
        )
        assert index.get_watermark("s") == Watermark(1, 0)
        assert len(index.lookup(keys)) == 64  # the first step is in, the evict is not
        assert other.apply_batch(batch, "s", Watermark(1, 1)) is True
        assert other.get_watermark("s") == Watermark(1, 1)
        assert list(index.lookup(keys)) == keys[:40]
        assert set(index.lookup(keys[:8], {"pod-b"})) == set(keys[:8])
        with pytest.raises(EngineKeyNotFoundError):
            index.get_request_key(engine[40])
        # the stream is past it now: both senders are told so, nothing is applied again
        assert index.apply_batch(batch, "s", Watermark(1, 1)) is False
        assert index.apply_batch([AddOp(None, (keys[40],), (A,))], "s", Watermark(1, 0)) is False
        assert list(index.lookup(keys)) == keys[:40]


def test_metrics_wrap_the_cluster_index(cfg: RedisIndexConfig) -> None:
    from prometheus_client import CollectorRegistry

    from kvredis import InstrumentedIndex

    registry = CollectorRegistry()
    with RedisClusterIndex(cfg) as index:
        wrapped = InstrumentedIndex(index, registry=registry)
        wrapped.add(None, chain(32, 14), [A])
        assert len(wrapped.lookup(chain(32, 14))) == 32
        trips = registry.get_sample_value(
            "kvredis_index_redis_round_trips_total", {"backend": "redis"}
        )
        assert trips is not None and trips >= 2


def test_a_clear_cut_short_before_its_mapping_pass_drops_the_mappings_when_run_again(
    cfg: RedisIndexConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards reclaim the retired ids only after the mapping pass: a clear cut short before
    it leaves them retired, so running the clear again runs the mapping pass too."""
    import kvredis.redis.cluster.ops as cluster_ops

    with RedisClusterIndex(cfg) as index:
        keys = list(range(1, 41))
        index.add([k + 1000 for k in keys], keys, [A])
        index.add(None, keys[:10], [B])  # B keeps the first keys' mappings alive
        real = cluster_ops.op_clear_mappings

        def cut_short(core: Any) -> Any:
            raise ConnectionError("cut short before the mapping pass")
            yield  # pragma: no cover - a generator like the real one

        monkeypatch.setattr(cluster_ops, "op_clear_mappings", cut_short)
        with pytest.raises(ConnectionError):
            index.clear("pod-a")
        monkeypatch.setattr(cluster_ops, "op_clear_mappings", real)
        index.clear("pod-a")
        assert index.lookup(keys) == {k: [B] for k in keys[:10]}
        for k in keys[:10]:
            assert index.get_request_key(k + 1000) == k
        for k in keys[10:]:
            with pytest.raises(EngineKeyNotFoundError):
                index.get_request_key(k + 1000)

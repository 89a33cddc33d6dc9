"""The cluster index on real local clusters (redis-server 7 and Valkey 9): where pods land, what a
call costs in round trips, reads from replicas, the factories, batches of several streams, and
differential runs against the single-server index (the conformance suite runs on clusters
too)."""

from __future__ import annotations

import dataclasses
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
    CLUSTER_LAYOUT,
    DEFAULT_SHARDS,
    KEY_LAYOUT,
    Descriptor,
    check_cluster_namespace,
    parse_descriptor,
    pod_shard,
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


def test_pods_spread_evenly_over_shards_and_keep_their_shard() -> None:
    for names in (
        [f"vllm-{i}" for i in range(6000)],
        [f"pod-{uuid.uuid4().hex}" for _ in range(6000)],
    ):
        counts = [0] * 6
        for name in names:
            counts[pod_shard(name, 6)] += 1
        assert min(counts) > 850 and max(counts) < 1150, counts
    assert pod_shard("pod-a", 6) == pod_shard("pod-a", 6)
    assert {pod_shard("p\udc80", 6), pod_shard("", 6)} <= set(range(6))  # any str is placed


def test_cluster_namespaces_refuse_braces_and_bad_descriptors() -> None:
    with pytest.raises(InvalidInputError):
        check_cluster_namespace("a{b}")
    with pytest.raises(ConfigError):
        RedisIndexConfig(address="redis+cluster://127.0.0.1:7000", namespace="a{b}")
    with pytest.raises(ConfigError):
        RedisIndexConfig(address="redis+cluster://127.0.0.1:7000", cluster_shards=0)
    assert parse_descriptor([None, None], "x") is None
    assert parse_descriptor([b"kvredis-cluster/2", b"8"], "x") == Descriptor(CLUSTER_LAYOUT, 8)
    assert parse_descriptor([b"kvredis-cluster/1", b"8"], "x") == Descriptor(KEY_LAYOUT, 8)
    assert Descriptor(CLUSTER_LAYOUT, 8).by_pod and not Descriptor(KEY_LAYOUT, 8).by_pod
    with pytest.raises(NamespaceLayoutError, match="newer"):
        parse_descriptor([b"kvredis-cluster/9", b"8"], "x")
    with pytest.raises(NamespaceLayoutError):
        parse_descriptor([b"kvredis-cluster/2", b"zero"], "x")


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


def pods_of_every_shard(index: RedisClusterIndex, tier: str = "gpu") -> list[PodEntry]:
    """One pod entry per shard, in shard order."""
    found: dict[int, PodEntry] = {}
    n = 0
    while len(found) < index.shards:
        found.setdefault(index.core.pod_shard(f"pod-{n}"), PodEntry(f"pod-{n}", tier))
        n += 1
    return [found[s] for s in range(index.shards)]


def test_pods_land_on_every_primary_each_shard_in_its_own_slot(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    with RedisClusterIndex(cfg) as index:
        assert index.shards == DEFAULT_SHARDS
        keys = chain(512, 2)
        every = pods_of_every_shard(index)
        index.add(chain(512, 3), keys, every)
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
        # each pod's entries are in its own shard only
        for shard, entry in enumerate(every):
            layout = index.core.state(shard).layout
            port = index.executor.slot_map.primary(index.core.slots[shard]).port
            client = redis.Redis(port=port)
            try:
                pods = client.hkeys(layout.pp)
            finally:
                client.close()
            assert pods == [entry.pod_identifier.encode()], (shard, pods)


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
    """A write of one pod is one call on one node; a score is one call per node holding a
    shard of the pods asked about (every node without a filter); a lookup, one wave when every
    shard stops at the same key, two when some stop before the farthest (they pass over their
    misses up to it in the second), and then one call per node holding the pods read, which
    checks their stamps (a read of two steps)."""
    with RedisClusterIndex(cfg) as index:
        keys, engine = chain(512, 6), chain(512, 7)
        nodes = len(index.executor.slot_map.primaries)
        before = index.round_trips
        index.add(engine[:64], keys[:64], [A])  # within one call's work budget
        assert index.round_trips - before == 1
        before = index.round_trips
        assert index.apply_batch(
            [AddOp(None, tuple(keys[:8]), (A,)), EvictOp(engine[9], KeyType.ENGINE, (A,))],
            "pod-a",
            Watermark(1, 1),
        )
        assert index.round_trips - before == 1
        index.add(engine, keys, [A])
        other = PodEntry("pod-1", "cpu")  # another shard than pod-a's
        assert index.core.pod_shard("pod-1") != index.core.pod_shard("pod-a")
        index.add(None, keys[:100], [other])
        before = index.round_trips
        assert len(index.lookup(keys)) == 512
        # pod-a's shard's walk goes farthest; a lookup of two waves then checks the stamps of
        # the shards holding the pods it read, one call per node holding them
        slot_map = index.executor.slot_map
        stamped = {
            slot_map.primary(index.core.slots[index.core.pod_shard(pod)])
            for pod in ("pod-a", "pod-1")
        }
        assert index.round_trips - before == 2 * nodes + len(stamped)
        before = index.round_trips
        assert len(index.lookup(keys, ["pod-a"])) == 512
        assert index.round_trips - before == 1
        before = index.round_trips
        assert index.score(keys) == {"pod-a": 512.0, "pod-1": pytest.approx(80.0)}
        assert index.round_trips - before == nodes
        before = index.round_trips
        assert index.score(keys, None, ["pod-a"]) == {"pod-a": 512.0}
        assert index.round_trips - before == 1  # one pod: one shard, one node
        # evict by engine key: one call on the pod's shard
        before = index.round_trips
        index.evict(engine[10], KeyType.ENGINE, [A])
        assert index.round_trips - before == 1
        with pytest.raises(EngineKeyNotFoundError):
            index.get_request_key(engine[10])
        assert index.clear_with_progress("pod-1") == 100  # its shard's node only: below


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
        assert sum(_evalsha_calls(p) for p in replicas) >= on_replicas + 10
        # writes still go to the primaries
        reader.evict(keys[0], KeyType.REQUEST, [A])
        assert sum(_evalsha_calls(p) for p in primaries) > on_primaries
    spread = RedisIndexConfig(
        address=cfg.address, namespace=cfg.namespace, read_from_replicas="spread"
    )
    with RedisClusterIndex(spread) as reader:
        calls = {p: _evalsha_calls(p) for p in (*primaries, *replicas)}
        for _ in range(8):
            assert reader.score(keys[1:]) == {"pod-a": 255.0}
        grown = {p for p in calls if _evalsha_calls(p) > calls[p]}
        # every node of each slot takes its turn: a primary and a replica of every range
        assert any(p in primaries for p in grown) and any(p in replicas for p in grown)
        assert len(grown) == 2 * len(primaries)


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


def spread_pods(count: int) -> list[PodEntry]:
    """``pod-0``, ``pod-1``, ``pod-2`` (three different shards of the default six) and ``pod-4``
    (``pod-0``'s shard: two pods sharing a shard's mappings)."""
    pods = [
        PodEntry("pod-0", "gpu"),
        PodEntry("pod-1", "cpu"),
        PodEntry("pod-2", "gpu", group_idx=1, has_group=True),
        PodEntry("pod-4", "disk"),
    ]
    shards = [pod_shard(p.pod_identifier, count) for p in pods]
    assert len(set(shards[:3])) == 3 and shards[3] == shards[0], shards
    return pods


def _random_ops(
    rng: random.Random, chains: list[tuple[list[int], list[int]]], pods: list[PodEntry]
) -> list[Any]:
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


def _random_chains(rng: random.Random) -> list[tuple[list[int], list[int]]]:
    chains: list[tuple[list[int], list[int]]] = []
    for c in range(6):
        n = rng.choice([8, 24, 40])
        ratio = rng.choice([1, 2, 4])
        engine = chain(n // ratio if c % 2 else n * ratio // ratio, 100 + c)
        if c % 3 == 2:
            engine = chain(n * 2, 200 + c)  # many engine blocks per request key
        chains.append((engine, chain(n, 300 + c)))
    return chains


class ShardedReference:
    """What the pod layout promises, built from single-server indexes: one namespace per shard,
    each op applied to every shard its entries' pods live in with those entries; reads merge
    the shards key by key (a lookup ends at the first key no shard holds), scores by union,
    mappings from the lowest shard holding one, watermarks at their highest."""

    def __init__(self, url: str, namespace: str, count: int) -> None:
        self.count = count
        self.shards = [
            RedisIndex(RedisIndexConfig(address=url, namespace=f"{namespace}-ref{i}"))
            for i in range(count)
        ]

    def _split(self, ops: list[Any]) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for op in ops:
            parts: dict[int, list[PodEntry]] = {}
            for entry in op.entries:
                parts.setdefault(pod_shard(entry.pod_identifier, self.count), []).append(entry)
            for shard, entries in parts.items():
                out.setdefault(shard, []).append(dataclasses.replace(op, entries=tuple(entries)))
        return out

    def apply_batch(self, ops: list[Any], stream: str | None, mark: Watermark | None) -> set[bool]:
        """The verdicts of the shards the batch reaches."""
        return {
            self.shards[shard].apply_batch(part, stream, mark)
            for shard, part in sorted(self._split(ops).items())
        }

    def clear(self, pod: str) -> None:
        self.shards[pod_shard(pod, self.count)].clear(pod)

    def lookup(self, keys: list[int]) -> dict[int, set[PodEntry]]:
        out: dict[int, set[PodEntry]] = {}
        for key in keys:
            held = {e for ref in self.shards for e in ref.lookup([key]).get(key, [])}
            if not held:
                break
            out[key] = held
        return out

    def score(self, keys: list[int]) -> dict[str, float]:
        return {pod: s for ref in self.shards for pod, s in ref.score(keys).items()}

    def mapped(self, engine_key: int) -> int | None:
        for ref in self.shards:
            found = _mapped(ref, engine_key)
            if found is not None:
                return found
        return None

    def get_watermark(self, stream: str) -> Watermark | None:
        marks = [m for ref in self.shards if (m := ref.get_watermark(stream)) is not None]
        return max(marks) if marks else None

    def close(self) -> None:
        for ref in self.shards:
            ref.drop_namespace()
            ref.close()


def test_random_batches_give_the_sharded_single_server_answers(
    cfg: RedisIndexConfig, redis_server_url: str
) -> None:
    """Random batches of adds, evicts by request and engine key (engine keys shared by pods of
    several shards), clears and watermarks, on the cluster and on single-server namespaces
    holding each shard's pods: identical lookups, scores, mappings and watermarks, and a clean
    ``check`` of every shard, after every step."""
    rng = random.Random(20261203)
    chains = _random_chains(rng)
    pods = spread_pods(DEFAULT_SHARDS)
    ref = ShardedReference(redis_server_url, cfg.namespace, DEFAULT_SHARDS)
    with RedisClusterIndex(cfg) as cluster:
        try:
            for step in range(100):
                ops = _random_ops(rng, chains, pods)
                mark = Watermark(0, step) if step % 2 else None
                stream = "diff" if mark else None
                verdict = cluster.apply_batch(ops, stream, mark)
                assert {verdict} >= ref.apply_batch(ops, stream, mark) or len(
                    {pod_shard(e.pod_identifier, DEFAULT_SHARDS) for op in ops for e in op.entries}
                ) > 1
                if step % 25 == 24:
                    pod = rng.choice(pods).pod_identifier
                    cluster.clear(pod)
                    ref.clear(pod)
                if step % 4 == 3 or step == 99:
                    for engine, request in chains:
                        assert _norm(cluster.lookup(request)) == ref.lookup(request), step
                        assert cluster.score(request) == ref.score(request), step
                        for key in engine:
                            assert _mapped(cluster, key) == ref.mapped(key), (step, key)
                    assert check_findings(cfg) == [], step
            assert cluster.get_watermark("diff") == ref.get_watermark("diff")
        finally:
            ref.close()


def test_engine_streams_give_one_single_server_s_lookups_and_scores(
    cfg: RedisIndexConfig, redis_server_url: str
) -> None:
    """As engines send them (each pod adds its own engine keys, evicts by engine key what it
    stored, one stream per pod): the cluster and one single-server namespace give the same
    lookups, scores and watermarks, whatever pods share shards."""
    rng = random.Random(20261205)
    pods = [PodEntry(f"vllm-{i}", "gpu") for i in range(8)]
    prompts = [chain(rng.randint(4, 40), 500 + i) for i in range(6)]
    stored: dict[str, list[tuple[int, ...]]] = {p.pod_identifier: [] for p in pods}
    seqs = dict.fromkeys(stored, 0)
    single_cfg = RedisIndexConfig(address=redis_server_url, namespace=cfg.namespace)
    with RedisClusterIndex(cfg) as cluster, RedisIndex(single_cfg) as single:
        try:
            for step in range(160):
                pod = rng.choice(pods)
                name = pod.pod_identifier
                keys = rng.choice(prompts) + chain(rng.randint(1, 8), 10_000 + step)
                engine = tuple((hash((name, k)) & ((1 << 63) - 1)) or 1 for k in keys)
                ops: list[Any] = [AddOp(engine, tuple(keys), (pod,))]
                if stored[name] and rng.random() < 0.5:
                    victim = stored[name].pop(rng.randrange(len(stored[name])))
                    ops += [
                        EvictOp(e, KeyType.ENGINE, (pod,)) for e in victim[-rng.randint(1, 4) :]
                    ]
                stored[name].append(engine)
                seqs[name] += 1
                mark = Watermark(1, seqs[name])
                assert cluster.apply_batches([(ops, name, mark)]) == [
                    single.apply_batch(ops, name, mark)
                ]
                if step % 40 == 39:
                    gone = rng.choice(pods).pod_identifier
                    cluster.clear(gone)
                    single.clear(gone)
                    stored[gone].clear()
                if step % 8 == 7:
                    for prompt in prompts:
                        assert _norm(cluster.lookup(prompt)) == _norm(single.lookup(prompt))
                        assert cluster.score(prompt) == single.score(prompt)
                        filt = [p.pod_identifier for p in rng.sample(pods, 3)]
                        assert cluster.score(prompt, None, filt) == single.score(prompt, None, filt)
            for name in stored:
                assert cluster.get_watermark(name) == single.get_watermark(name)
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


def test_batches_of_several_streams_go_in_one_wave_and_a_stale_batch_stops_its_stream(
    cfg: RedisIndexConfig,
) -> None:
    """apply_batches: the batches of pods on every shard travel in one wave, one call per node;
    a batch its stream's watermark already passed is not applied, nor are its stream's later
    batches in the call; the other streams' are."""
    with RedisClusterIndex(cfg) as index:
        every = pods_of_every_shard(index)
        nodes = len(index.executor.slot_map.primaries)
        keys = chain(64, 21)
        batches: list[Any] = [
            ([AddOp(None, tuple(keys[:8]), (pod,))], pod.pod_identifier, Watermark(1, 1))
            for pod in every
        ]
        before = index.round_trips
        assert index.apply_batches(batches) == [True] * len(every)
        assert index.round_trips - before == nodes
        first, second = every[0], every[1]
        later = [
            ([AddOp(None, (keys[10],), (first,))], first.pod_identifier, Watermark(1, 1)),
            ([AddOp(None, (keys[11],), (first,))], first.pod_identifier, Watermark(1, 2)),
            ([AddOp(None, (keys[12],), (second,))], second.pod_identifier, Watermark(1, 2)),
            ([], first.pod_identifier, Watermark(1, 3)),
            ([AddOp(None, (keys[13],), (second,))], None, None),
        ]
        assert index.apply_batches(later) == [False, False, True, False, True]
        assert index.lookup([keys[10]]) == index.lookup([keys[11]]) == {}
        assert index.lookup([keys[12]]) == {keys[12]: [second]}
        assert index.lookup([keys[13]]) == {keys[13]: [second]}
        assert index.get_watermark(first.pod_identifier) == Watermark(1, 1)
        assert index.get_watermark(second.pod_identifier) == Watermark(1, 2)
        # a stream whose batches reach pods on two nodes: the stop holds across nodes
        far = next(
            p
            for p in every
            if index.executor.slot_map.primary(
                index.core.slots[index.core.pod_shard(p.pod_identifier)]
            )
            != index.executor.slot_map.primary(
                index.core.slots[index.core.pod_shard(first.pod_identifier)]
            )
        )
        mixed = [
            ([AddOp(None, (keys[20],), (first, far))], "mixed", Watermark(1, 5)),
            ([AddOp(None, (keys[21],), (far,))], "mixed", Watermark(1, 6)),
        ]
        index.core.stream_homes["mixed"] = index.core.pod_shard(first.pod_identifier)
        assert index.apply_batches(mixed) == [True, True]
        index.reset_watermark("mixed", None)
        index.core.stream_homes["mixed"] = index.core.pod_shard(first.pod_identifier)
        index.apply_batch([AddOp(None, (keys[30],), (first,))], "mixed", Watermark(1, 9))
        again = [
            ([AddOp(None, (keys[22],), (first, far))], "mixed", Watermark(1, 7)),
            ([AddOp(None, (keys[23],), (far,))], "mixed", Watermark(1, 8)),
        ]
        assert index.apply_batches(again) == [False, False]
        assert index.lookup([keys[23]]) == {}
        # the batch's other shard (far's) took its segment: segments are the shards' own steps
        assert index.lookup([keys[22]]) == {keys[22]: [far]}


def test_clear_runs_on_the_pod_s_shard_only(cfg: RedisIndexConfig) -> None:
    with RedisClusterIndex(cfg) as index:
        every = pods_of_every_shard(index)
        keys, engine = chain(40, 31), chain(40, 32)
        index.add(engine, keys, every)
        target = every[2]
        sent: list[Any] = []
        execute = index.executor._send

        def watching(wave: Any) -> Any:
            sent.append(wave)
            return execute(wave)

        index.executor._send = watching  # type: ignore[method-assign]
        try:
            assert index.clear_with_progress(target.pod_identifier) == 40
        finally:
            del index.executor._send
        node = index.executor.slot_map.primary(index.core.slots[2])
        assert {b.node for wave in sent for b in wave.batches} == {node}
        assert {e for v in index.lookup(keys).values() for e in v} == set(every) - {target}
        assert index.get_request_key(engine[5]) == keys[5]  # the other shards' mappings


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

"""``kvredis migrate`` of a cluster namespace of the key layout (``kvredis-cluster/1``, kvredis
before pod placement) to the pod layout, online, on real redis-server 7 and Valkey 9 clusters:
read as one being converted before and while the mover runs, every score and lookup the same
before and after, with writes racing the mover; cut short, it goes on where it stopped."""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from kvredis import InMemoryIndex, KeyType, PodEntry, RedisIndexConfig
from kvredis.cli.app import cli
from kvredis.redis.cluster import migrate as cluster_migrate
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.cluster.shards import CLUSTER_LAYOUT, KEY_LAYOUT
from kvredis.scoring import LongestPrefixScorer
from tests.conftest import TEST_PREFIX
from tests.redis.checks import check_findings
from tests.redis.cluster.key_layout import KeyLayoutWriter, create, descriptor_layout
from tests.servers import LocalCluster

PODS = [PodEntry(f"pod-{i}", "gpu" if i % 2 else "cpu") for i in range(8)]
SPEC = PodEntry("pod-3", speculative=True)


@pytest.fixture
def cfg(redis_cluster: LocalCluster) -> Iterator[RedisIndexConfig]:
    config = RedisIndexConfig(
        address=redis_cluster.url, namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    )
    create(config, 6)
    yield config
    with RedisClusterIndex(config) as index:
        index.drop_namespace()


class Fleet:
    """Chains sharing prompts, written in the key layout (and to a model)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.model = InMemoryIndex()
        self.chains: list[list[int]] = []
        self.engines: list[tuple[list[int], PodEntry]] = []
        prompts = [[self.rng.getrandbits(64) for _ in range(self.rng.randint(4, 40))]
                   for _ in range(4)]  # fmt: skip
        for _ in range(24):
            tail = [self.rng.getrandbits(64) for _ in range(self.rng.randint(1, 60))]
            self.chains.append(self.rng.choice(prompts) + tail)

    def engine_of(self, pod: PodEntry, keys: list[int]) -> list[int]:
        return [hash((pod.pod_identifier, k)) & ((1 << 62) - 1) or 1 for k in keys]

    def fill(self, writer: Any) -> None:
        for chain in self.chains:
            for pod in self.rng.sample(PODS, 3):
                held = chain[: self.rng.randint(1, len(chain))]
                engine = self.engine_of(pod, held)
                writer.add(engine, held, [pod])
                self.model.add(engine, held, [pod])
                self.engines.append((engine, pod))
        for chain in self.chains[:6]:
            writer.add(None, chain[:5], [SPEC], 600_000)
            self.model.add(None, chain[:5], [SPEC], ttl=600)
        for engine, pod in self.engines[::5]:  # evicts by engine key, as an engine sends them
            writer.evict(engine[-1], KeyType.ENGINE, [pod])
            self.model.evict(engine[-1], KeyType.ENGINE, [pod])

    def check(self, index: RedisClusterIndex) -> int:
        """Every chain scored and looked up as the model holds it; the scores checked."""
        scorer = LongestPrefixScorer()
        for chain in self.chains:
            want = self.model.lookup(chain)
            assert {k: set(v) for k, v in index.lookup(chain).items()} == {
                k: set(v) for k, v in want.items()
            }
            assert index.score(chain) == scorer.score(chain, want)
        return len(self.chains)


def test_a_key_layout_namespace_is_read_and_written_as_one_being_converted(
    cfg: RedisIndexConfig,
) -> None:
    fleet = Fleet(1)
    with RedisClusterIndex(cfg) as index:
        assert not index.core.by_pod
        fleet.fill(KeyLayoutWriter(index))
        assert fleet.check(index) == 24
        # converting clients write: adds to the pod's shard, evicts everywhere the pair may be
        engine, pod = fleet.engines[1]
        index.evict(engine[0], KeyType.ENGINE, [pod])
        fleet.model.evict(engine[0], KeyType.ENGINE, [pod])
        index.add(None, fleet.chains[0], [PODS[7]])
        fleet.model.add(None, fleet.chains[0], [PODS[7]])
        index.clear("pod-2")
        fleet.model.clear("pod-2")
        fleet.check(index)


def test_migrating_online_keeps_every_score_with_writes_racing_the_mover(
    cfg: RedisIndexConfig,
) -> None:
    fleet = Fleet(2)
    with RedisClusterIndex(cfg) as index, RedisClusterIndex(cfg) as mover:
        fleet.fill(KeyLayoutWriter(index))
        fleet.check(index)  # every score before
        done = threading.Event()
        errors: list[BaseException] = []
        lock = threading.Lock()

        def race() -> None:
            rng = random.Random(3)
            try:
                while not done.is_set():
                    with lock:
                        chain = rng.choice(fleet.chains)
                        pod = rng.choice(PODS)
                        if rng.random() < 0.5:
                            keys = chain[: rng.randint(1, len(chain))]
                            engine = fleet.engine_of(pod, keys)
                            index.add(engine, keys, [pod])
                            fleet.model.add(engine, keys, [pod])
                            fleet.engines.append((engine, pod))
                        elif rng.random() < 0.6:
                            key = rng.choice(chain)
                            index.evict(key, KeyType.REQUEST, [pod])
                            fleet.model.evict(key, KeyType.REQUEST, [pod])
                        else:
                            engine, owner = rng.choice(fleet.engines)
                            index.evict(engine[-1], KeyType.ENGINE, [owner])
                            fleet.model.evict(engine[-1], KeyType.ENGINE, [owner])
            except BaseException as exc:
                errors.append(exc)

        racer = threading.Thread(target=race)
        racer.start()
        try:
            report = mover.migrate()
        finally:
            done.set()
            racer.join(60)
        assert errors == []
        assert report.migrated and report.source == KEY_LAYOUT and report.pairs > 0
        assert report.expiring > 0 and report.mappings > 0
        assert descriptor_layout(cfg) == (CLUSTER_LAYOUT, None)
        assert mover.core.by_pod
        index.core.descriptor_read_at = -1e9  # it reads the descriptor again on its next call
        fleet.check(index)  # every score after (the racing writes included)
        assert index.core.by_pod
        assert check_findings(cfg) == []
        # each pod's entries are in its shard now, and only there
        with RedisClusterIndex(cfg) as fresh:
            fleet.check(fresh)
            for shard in range(fresh.shards):
                pods = _shard_pods(fresh, shard)
                assert all(fresh.core.pod_shard(p) == shard for p in pods), (shard, pods)
            # engine evicts by the pods that stored them still reach their keys
            for engine, pod in fleet.engines[:20]:
                fresh.evict(engine[0], KeyType.ENGINE, [pod])
                fleet.model.evict(engine[0], KeyType.ENGINE, [pod])
            fleet.check(fresh)
        assert not mover.migrate().migrated  # the pod layout is left alone


def _shard_pods(index: RedisClusterIndex, shard: int) -> set[str]:
    import redis

    port = index.executor.slot_map.primary(index.core.slots[shard]).port
    client = redis.Redis(port=port)
    try:
        return {p.decode() for p in client.hkeys(index.core.state(shard).layout.pp)}
    finally:
        client.close()


def _first_waves(op: Any, waves: int) -> Any:
    """Run only the first ``waves`` requests of an operation (a mover that dies)."""
    reply = None
    for _ in range(waves):
        reply = yield op.send(reply)
    op.close()


def test_a_migration_cut_short_goes_on_where_it_stopped(
    cfg: RedisIndexConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_migrate, "BUCKETS_PER_PAGE", 4)
    fleet = Fleet(4)
    with RedisClusterIndex(cfg) as index:
        fleet.fill(KeyLayoutWriter(index))
        index.executor.run(_first_waves(cluster_migrate.op_cluster_migrate(index.core), 40))
        layout, move = descriptor_layout(cfg)
        assert layout == KEY_LAYOUT and move is not None and move != "0:r:0", move
        fleet.check(index)  # half moved: still every entry
        report = index.migrate()
        assert report.resumed and report.migrated
        assert descriptor_layout(cfg) == (CLUSTER_LAYOUT, None)
        fleet.check(index)
        assert check_findings(cfg) == []


def test_the_cli_migrates_a_cluster_namespace(cfg: RedisIndexConfig) -> None:
    fleet = Fleet(5)
    with RedisClusterIndex(cfg) as index:
        fleet.fill(KeyLayoutWriter(index))
    runner = CliRunner()
    args = ["migrate", "--redis", cfg.address, cfg.namespace, "--json"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["migrated"] and report["from"] == KEY_LAYOUT and report["to"] == CLUSTER_LAYOUT
    assert report["pairs"] > 0
    with RedisClusterIndex(cfg) as index:
        assert index.core.by_pod
        fleet.check(index)
    again = runner.invoke(cli, args)
    assert again.exit_code == 0 and not json.loads(again.output)["migrated"]


def test_a_copy_whose_pod_was_evicted_meanwhile_is_refused(cfg: RedisIndexConfig) -> None:
    """move_pairs stores nothing when a pod's counter moved since the mover read it."""
    from kvredis.redis.cluster.core import on_shards

    with RedisClusterIndex(cfg) as index:
        pod = PODS[0]
        shard = index.core.pod_shard(pod.pod_identifier)
        seen = index.executor.run(on_shards(index.core, {shard: cluster_migrate._op_counters}))
        index.evict(5, KeyType.REQUEST, [pod])  # a converting evict raises the counter
        moved = index.executor.run(
            on_shards(
                index.core,
                {shard: lambda st: cluster_migrate._op_copy_pairs(st, [(5, pod, 0)], seen[shard])},
            )
        )
        assert moved[shard] == {pod.pod_identifier}
        assert index.lookup([5]) == {}
        fresh = index.executor.run(on_shards(index.core, {shard: cluster_migrate._op_counters}))
        moved = index.executor.run(
            on_shards(
                index.core,
                {shard: lambda st: cluster_migrate._op_copy_pairs(st, [(5, pod, 0)], fresh[shard])},
            )
        )
        assert moved[shard] == set() and index.lookup([5]) == {5: [pod]}

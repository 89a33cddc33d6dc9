"""The operator's commands on a cluster namespace (stats, pods, check, watermarks, dump, restore),
through the CLI and ClusterInspector, on real local clusters of redis-server 7 and Valkey 9; and
a single node of a cluster named as such."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.cluster
from click.testing import CliRunner

from kvredis import (
    AddOp,
    ClusterModeError,
    EvictOp,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.checks import MAX_REQUEST_KEYS_PER_ENGINE_KEY
from kvredis.cli import cli
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.cluster.inspect import ClusterInspector
from kvredis.redis.cluster.shards import pod_shard, shard_names
from kvredis.redis.inspect import DUMP_FORMAT, Inspector, Problem, op_check, op_stats
from kvredis.redis.layout import Layout
from tests.redis.checks import check_findings
from tests.redis.cluster.test_cluster_index import _norm
from tests.servers import LocalCluster
from tests.test_index_conformance import mapped

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
SPEC = PodEntry("pod-s", speculative=True)


def chain(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


KEYS, ENGINE = chain(40, 1), chain(40, 2)


@pytest.fixture
def cfg(redis_cluster: LocalCluster) -> Iterator[RedisIndexConfig]:
    config = RedisIndexConfig(address=redis_cluster.url, namespace=f"kvt-c{uuid.uuid4().hex[:10]}")
    yield config
    with RedisClusterIndex(config) as index:
        index.drop_namespace()


@pytest.fixture
def populated(cfg: RedisIndexConfig) -> Iterator[RedisClusterIndex]:
    """A cluster namespace with two pods, engine mappings, expiring entries and a watermark."""
    with RedisClusterIndex(cfg) as index:
        index.add(ENGINE, KEYS, [A])
        index.add(None, KEYS[:10], [B])
        index.add(None, KEYS[30:], [SPEC], ttl=600)
        index.apply_batch([AddOp(None, (KEYS[0],), (B,))], "pod-b", Watermark(2, 9))
        index.evict(KEYS[5], KeyType.REQUEST, [A])  # leaves engine key 5's mapping (legitimate)
        yield index


def invoke(cfg: RedisIndexConfig, *args: str, url: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        cli, [*args, "--redis", url or cfg.address, "--namespace", cfg.namespace]
    )
    return result.exit_code, result.output


def as_json(cfg: RedisIndexConfig, *args: str) -> Any:
    code, out = invoke(cfg, *args, "--json")
    assert code == 0, out
    return json.loads(out)


def raw(cluster: LocalCluster) -> redis.cluster.RedisCluster:
    return redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])


def shard_layout(index: RedisClusterIndex, shard: int) -> Layout:
    return index.core.state(shard).layout


def test_stats_and_pods_sum_the_shards(populated: RedisClusterIndex, cfg: RedisIndexConfig) -> None:
    """Each pod's entries are in its shard: a request key held by pods of two shards counts
    once in each."""
    stats = as_json(cfg, "stats")
    assert len(stats["shards"]) == populated.shards
    shard_ab, shard_s = (populated.core.pod_shard(p) for p in ("pod-a", "pod-s"))
    assert populated.core.pod_shard("pod-b") == shard_ab != shard_s
    assert stats["request_keys"] == 40 == sum(s["request_keys"] for s in stats["shards"])
    assert stats["pairs"] == 40 - 1 + 10 + 1 - 1  # 40 A (one evicted), 10 B (+1 again: same)
    assert stats["expiring_entries"] == 10
    assert stats["engine_keys"] == 40
    assert stats["pods"] == {"pod-a": {"gpu": 39}, "pod-b": {"cpu": 10}, "pod-s": {"": 10}}
    names = shard_names(cfg.namespace, populated.shards)
    assert [s["namespace"] for s in stats["shards"]] == list(names)
    per_shard = [0] * populated.shards
    per_shard[shard_ab] = 40
    assert [s["request_keys"] for s in stats["shards"]] == per_shard
    assert [s["expiring_entries"] for s in stats["shards"]][shard_s] == 10
    assert stats["watermarks"] == 1  # the stream's batches went to pod-b's shard
    assert stats["server"]["primaries"] == 3
    assert as_json(cfg, "pods") == stats["pods"]
    code, out = invoke(cfg, "stats")
    assert code == 0 and "cluster at" in out and f"{populated.shards} on 3 primaries" in out
    with ClusterInspector(cfg) as inspector:
        merged = inspector.stats(memory=False)
    assert merged.pairs == stats["pairs"] and len(merged.shards) == populated.shards


def test_watermarks_are_the_highest_over_the_shards(
    populated: RedisClusterIndex, cfg: RedisIndexConfig
) -> None:
    found = as_json(cfg, "watermarks")
    assert found["pod-b"]["epoch"] == 2 and found["pod-b"]["shards"] == 1
    # a batch of another pod's shard: the stream's watermark there is the highest
    populated.apply_batch([AddOp(None, (KEYS[1],), (SPEC,))], "pod-b", Watermark(2, 10))
    found = as_json(cfg, "watermarks")
    assert found["pod-b"]["stored"].startswith("2:10:") and found["pod-b"]["shards"] == 2
    assert populated.get_watermark("pod-b") == Watermark(2, 10)
    populated.reset_watermark("pod-b", Watermark(2, 9))
    assert populated.get_watermark("pod-b") == Watermark(2, 9)
    code, out = invoke(cfg, "watermarks", "--reset", "pod-b", "--yes")
    assert code == 0, out
    assert as_json(cfg, "watermarks") == {}


def test_check_runs_per_shard_names_the_shard_and_repairs(
    populated: RedisClusterIndex, cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    clean = as_json(cfg, "check")
    assert clean["ok"] and clean["findings"] == [] and clean["notes"] == []
    before = populated.lookup(KEYS)
    client = raw(redis_cluster)
    try:
        # pod-a's shard: an undefined id under a request key; pod-s's: an undecodable definition
        one_shard, four_shard = populated.core.pod_shard("pod-a"), populated.core.pod_shard("pod-s")
        one, four = shard_layout(populated, one_shard), shard_layout(populated, four_shard)
        bucket = one.request_bucket(KEYS[7])
        client.hset(bucket, (7).to_bytes(8, "big"), b"\x00\x00\x00\x63")
        client.hset(four.pi, b"\x00\x00\x00\x50", b"junk")
    finally:
        client.close()
    code, out = invoke(cfg, "check", "--json")
    assert code == 1, out
    report = json.loads(out)
    where = {(f["problem"], f["shard"]) for f in report["findings"]}
    assert where >= {("unknown_id", one_shard), ("undecodable_entry", four_shard)}
    assert {f["problem"] for f in report["findings"]} <= {
        "unknown_id",
        "undecodable_entry",
        "misplaced_field",
    }
    code, out = invoke(cfg, "check")
    assert code == 1 and f"(shard {one_shard})" in out and f"(shard {four_shard})" in out
    code, out = invoke(cfg, "check", "--repair")
    assert code == 0, out
    assert as_json(cfg, "check")["findings"] == []
    assert populated.lookup(KEYS) == before


def test_dump_restores_every_shard_into_another_cluster_namespace(
    populated: RedisClusterIndex, cfg: RedisIndexConfig, tmp_path: Path
) -> None:
    path = tmp_path / "cluster.jsonl.gz"
    code, out = invoke(cfg, "dump", str(path))
    assert code == 0, out
    other = RedisIndexConfig(address=cfg.address, namespace=f"kvt-c{uuid.uuid4().hex[:10]}")
    try:
        code, out = invoke(other, "restore", str(path))
        assert code == 0, out
        with RedisClusterIndex(other, create=False) as copy:
            assert copy.shards == populated.shards
            assert copy.lookup(KEYS) == populated.lookup(KEYS)
            assert copy.get_watermark("pod-b") == Watermark(2, 9)
            assert copy.get_request_key(ENGINE[3]) == KEYS[3]
        assert as_json(other, "stats")["pairs"] == as_json(cfg, "stats")["pairs"]
        assert as_json(other, "check")["findings"] == []
        code, out = invoke(other, "restore", str(path))
        assert code == 1 and "--replace" in out
        code, out = invoke(other, "restore", str(path), "--replace")
        assert code == 0, out
        with RedisClusterIndex(other, create=False) as copy:
            assert copy.lookup(KEYS) == populated.lookup(KEYS)
    finally:
        with RedisClusterIndex(other) as copy:
            copy.drop_namespace()


@contextmanager
def _restored_in_one_server(url: str, dump: Path) -> Iterator[tuple[RedisIndexConfig, RedisIndex]]:
    """``kvredis restore`` of ``dump`` into a new namespace of the server at ``url``: its config
    and an index on it, the namespace dropped afterwards."""
    single = RedisIndexConfig(address=url, namespace=f"kvt-{uuid.uuid4().hex[:12]}")
    code, out = invoke(single, "restore", str(dump))
    assert code == 0, out
    try:
        with RedisIndex(single) as merged:
            yield single, merged
    finally:
        with RedisIndex(single) as index:
            index.drop_namespace()


def test_a_cluster_dump_restores_into_one_server_and_a_single_dump_makes_one_shard(
    populated: RedisClusterIndex, cfg: RedisIndexConfig, redis_server_url: str, tmp_path: Path
) -> None:
    """A dump placed by pod holds a request key in each shard of a pod holding it: merged into
    one server, each key holds every shard's entries, runs kept where one shard held a key."""
    long = chain(300, 3)  # long enough for chain runs in every shard
    ranked = PodEntry("pod-r", "gpu", dp_rank=2)
    # the pods holding long's keys live in several shards: the merge joins a key's entries
    assert len({pod_shard(e.pod_identifier, populated.shards) for e in (A, B, ranked, SPEC)}) > 1
    populated.add(chain(300, 4)[:100], long, [A, ranked])  # an engine key per 3 request keys
    populated.add(None, long[:50], [B])
    populated.evict(long[7], KeyType.REQUEST, [A])
    populated.add(None, long[:5], [SPEC], ttl=600)
    populated.reset_watermark("pod-r", Watermark(4, 2))
    path = tmp_path / "cluster.jsonl"
    assert invoke(cfg, "dump", str(path))[0] == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {bytes.fromhex(r["key"])[:2] for r in records if "key" in r}
    assert {b"r:", b"e:", b"s:", b"c:"} <= kinds  # runs, expiring entries and mappings too
    with _restored_in_one_server(redis_server_url, path) as (single, merged):
        for keys in (KEYS, long):
            assert merged.lookup(keys) == populated.lookup(keys)
            weights = {"gpu": 1.0, "cpu": 0.5}
            assert merged.score(keys, weights) == populated.score(keys, weights)
        for engine_key in [*ENGINE, *chain(300, 4)[:100]]:
            assert merged.get_request_key(engine_key) == populated.get_request_key(engine_key)
        for stream in ("pod-b", "pod-r"):
            assert merged.get_watermark(stream) == populated.get_watermark(stream)
        assert as_json(single, "check")["findings"] == []
        assert as_json(single, "stats")["pairs"] == as_json(cfg, "stats")["pairs"]
        raw = merged.client
        assert list(raw.scan_iter(match=f"{single.namespace}:c:*"))  # the runs kept
        entries = {A, B, SPEC, ranked}
        assert raw.hlen(f"{single.namespace}:pe") == len(entries)  # one id per entry
        merged.add(None, [12345], [PodEntry("pod-new", "gpu")])  # new ids after the merged
        merged.clear("pod-a")
        assert merged.lookup(long[:3]) == {k: [ranked, B, SPEC] for k in long[:3]}
        assert merged.lookup([12345]) == {12345: [PodEntry("pod-new", "gpu")]}
        assert as_json(single, "check")["findings"] == []


def test_a_single_server_dump_makes_a_cluster_namespace_of_one_shard(
    cfg: RedisIndexConfig, redis_server_url: str, tmp_path: Path
) -> None:
    single = RedisIndexConfig(address=redis_server_url, namespace=f"kvt-{uuid.uuid4().hex[:12]}")
    with RedisIndex(single) as index:
        try:
            index.add(ENGINE[:8], KEYS[:8], [A])
            single_dump = tmp_path / "single.jsonl"
            assert invoke(single, "dump", str(single_dump))[0] == 0
            other = RedisIndexConfig(address=cfg.address, namespace=f"kvt-c{uuid.uuid4().hex[:10]}")
            try:
                code, out = invoke(other, "restore", str(single_dump))
                assert code == 0, out
                with RedisClusterIndex(other, create=False) as copy:
                    assert copy.shards == 1
                    assert copy.lookup(KEYS[:8]) == index.lookup(KEYS[:8])
                    assert copy.get_request_key(ENGINE[2]) == KEYS[2]
            finally:
                with RedisClusterIndex(other) as copy:
                    copy.drop_namespace()
        finally:
            index.drop_namespace()


def test_a_node_of_a_cluster_is_named_as_such(
    populated: RedisClusterIndex,
    cfg: RedisIndexConfig,
    redis_cluster: LocalCluster,
    tmp_path: Path,
) -> None:
    node = f"redis://127.0.0.1:{redis_cluster.ports[0]}"
    empty = tmp_path / "empty.jsonl"  # a dump of an empty single-server namespace
    header = {"format": DUMP_FORMAT, "namespace": "x", "bucket_bits": 16}
    empty.write_text(
        f"{json.dumps(header)}\n{json.dumps({'end': True, 'keys': 0, 'records': 0})}\n"
    )
    commands = [
        ["restore", str(empty)],
        ["stats"],
        ["pods"],
        ["check"],
        ["watermarks"],
        ["dump", "-"],
        ["lookup", "--model", "m", "--tokens", "1,2", "--block-size", "2"],
    ]
    for command in commands:
        code, out = invoke(cfg, *command, url=node)
        assert code == 1, (command, out)
        assert "this is a node of a Redis Cluster; use --redis redis+cluster://" in out
        assert "does not exist" not in out
    single = RedisIndexConfig(address=node, namespace=cfg.namespace)
    with Inspector(single) as inspector, pytest.raises(ClusterModeError):
        inspector.layout()


def test_a_missing_cluster_namespace_does_not_exist(cfg: RedisIndexConfig) -> None:
    for command in (["stats"], ["check"], ["watermarks"]):
        code, out = invoke(cfg, *command)
        assert code == 1 and "does not exist" in out, out
    with ClusterInspector(cfg) as inspector:
        assert inspector.shards() is None


def _random_ops(rng: random.Random) -> list[Any]:
    ops: list[Any] = []
    for _ in range(rng.randint(1, 6)):
        start = rng.randrange(len(KEYS))
        end = rng.randint(start + 1, len(KEYS))
        ents = tuple(rng.sample([A, B], rng.randint(1, 2)))
        roll = rng.random()
        if roll < 0.4:
            ops.append(AddOp(tuple(ENGINE[start:end]), tuple(KEYS[start:end]), ents))
        elif roll < 0.55:
            ops.append(AddOp(None, tuple(KEYS[start:end]), ents))
        elif roll < 0.8:
            ops.append(EvictOp(rng.choice(ENGINE), KeyType.ENGINE, ents))
        else:
            ops.append(EvictOp(KEYS[start], KeyType.REQUEST, ents))
    return ops


def _speculative_beside(index: RedisClusterIndex, pod: str) -> PodEntry:
    """A speculative entry of a pod placed on ``pod``'s shard."""
    shard = index.core.pod_shard(pod)
    n = 0
    while index.core.pod_shard(f"pod-s{n}") != shard:
        n += 1
    return PodEntry(f"pod-s{n}", speculative=True)


def test_check_finds_nothing_after_every_step_of_random_batches(
    cfg: RedisIndexConfig, redis_server_url: str
) -> None:
    """Random batches, clears and speculative adds on a cluster namespace and a single-server
    one: after every step, check (per shard on the cluster) finds no problem on either. The
    pods share one shard (and so its engine-key mappings, as on one server), and the
    statistics agree."""
    rng = random.Random(20261204)
    single_cfg = RedisIndexConfig(address=redis_server_url, namespace=cfg.namespace)
    with (
        RedisClusterIndex(cfg) as cluster,
        RedisIndex(single_cfg) as single,
        ClusterInspector(cfg) as cluster_inspector,
        Inspector(single_cfg) as single_inspector,
    ):
        try:
            for step in range(30):
                ops = _random_ops(rng)
                mark = Watermark(0, step) if step % 2 else None
                stream = "diff" if mark else None
                assert cluster.apply_batch(ops, stream, mark) == single.apply_batch(
                    ops, stream, mark
                )
                if step % 10 == 9:
                    pod = rng.choice(["pod-a", "pod-b"])
                    cluster.clear(pod)
                    single.clear(pod)
                if step % 7 == 3:
                    start = rng.randrange(len(KEYS))
                    spec = _speculative_beside(cluster, "pod-a")
                    for index in (cluster, single):
                        index.add(None, KEYS[start : start + 5], [spec], ttl=600)
                report = cluster_inspector.check()
                assert report.findings == [], (step, report.findings)
                layout = single_inspector.layout()
                assert layout is not None
                assert single_inspector.run(op_check(layout)).findings == [], step
            merged = cluster_inspector.stats(memory=False)
            alone = single_inspector.run(op_stats(layout, memory=False))
            for name in ("pairs", "request_keys", "engine_keys", "expiring_entries"):
                assert getattr(merged, name) == getattr(alone, name), name
            assert merged.pods == alone.pods
        finally:
            single.drop_namespace()


def test_check_problem_on_a_cluster_carries_its_shard(
    populated: RedisClusterIndex, cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    layout = shard_layout(populated, 2)
    client = raw(redis_cluster)
    try:
        client.hset(layout.pp, "pod-z", b"\x00\x00\x00\x01\x00")  # 5 bytes: not an id list
    finally:
        client.close()
    with ClusterInspector(cfg) as inspector:
        report = inspector.check()
        assert [(f.problem, f.shard) for f in report.findings] == [(Problem.POD_RECORD_STRAY, 2)]
        assert inspector.check(repair=True).ok
        assert inspector.check().findings == []


# -- a dump placed by pod merged into one server, against the cluster --------------------------


def _pods_over_shards(count: int) -> list[PodEntry]:
    """Pods of four different shards and a fifth sharing the first's shard, of several tiers
    and ranks."""
    tiers = ["gpu", "cpu", "disk", "gpu", "cpu"]
    pods: list[PodEntry] = []
    used: list[int] = []
    n = 0
    while len(pods) < 5:
        name = f"pod-m{n}"
        shard = pod_shard(name, count)
        n += 1
        if (len(pods) < 4 and shard in used) or (len(pods) == 4 and shard != used[0]):
            continue
        pods.append(PodEntry(name, tiers[len(pods)], dp_rank=len(pods) % 2))
        used.append(shard)
    return pods


def _engine_of(key: int) -> int:
    """The engine key an engine sends for a request key (one each, whatever the pod)."""
    return ((key * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) | 1


def _merge_chains() -> list[list[int]]:
    """Chains sharing prefixes: a fork of the first mid-way, an extension past its end (a run
    grows), a short one (inline keys)."""
    trunk = chain(96, 41)
    return [trunk, trunk[:30] + chain(50, 42), trunk + chain(24, 43), chain(12, 44)]


class _MergeWorkload:
    """Random adds, evicts, speculative adds and fenced batches (one stream per pod) over pods
    of several shards, sent to every index given."""

    def __init__(self, seed: int, pods: list[PodEntry], spec: list[PodEntry]) -> None:
        self.rng = random.Random(seed)
        self.pods, self.spec = pods, spec
        self.chains = _merge_chains()
        self.seqs = {p.pod_identifier: 0 for p in pods}

    def _span(self) -> list[int]:
        keys = self.rng.choice(self.chains)
        start = 0 if self.rng.random() < 0.6 else self.rng.randrange(len(keys))
        end = self.rng.randint(start + 1, len(keys))
        return keys[start:end]

    def step(self, indexes: list[Any], clears: bool) -> list[bool]:
        """One random step on every index; the verdicts of a fenced batch (else [])."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.15 and not self.spec:
            roll = 0.15  # no speculative entries: no expiring bucket, runs read range by range
        if roll < 0.1:
            keys = self._span()[:20]
            spec = rng.choice(self.spec)
            for index in indexes:
                index.add(None, keys, [spec], ttl=600)
            return []
        if roll < 0.15:
            key = rng.choice(self._span())
            spec = rng.choice(self.spec)
            for index in indexes:
                index.evict(key, KeyType.REQUEST, [spec])
            return []
        if clears and roll < 0.18:
            pod = rng.choice(self.pods).pod_identifier
            for index in indexes:
                index.clear(pod)
            return []
        pod = rng.choice(self.pods)
        ops: list[Any] = []
        for _ in range(rng.randint(1, 3)):
            keys = self._span()
            kind = rng.random()
            if kind < 0.55:
                ops.append(AddOp(tuple(map(_engine_of, keys)), tuple(keys), (pod,)))
            elif kind < 0.8:
                ops.append(EvictOp(_engine_of(rng.choice(keys)), KeyType.ENGINE, (pod,)))
            else:
                ops.append(EvictOp(rng.choice(keys), KeyType.REQUEST, (pod,)))
        name = pod.pod_identifier
        if rng.random() < 0.1 and self.seqs[name]:  # a batch replayed: refused everywhere
            mark = Watermark(1, rng.randint(1, self.seqs[name]))
        else:
            self.seqs[name] += 1
            mark = Watermark(1, self.seqs[name])
        return [index.apply_batch(ops, name, mark) for index in indexes]

    def reads(self) -> list[list[int]]:
        """Chains to read: every chain, and spans starting inside runs."""
        spans = list(self.chains)
        for keys in self.chains:
            spans += [keys[3:], keys[17:60], keys[-9:]]
        return spans


def _same_answers(merged: RedisIndex, cluster: RedisClusterIndex, work: _MergeWorkload) -> None:
    weights = {"gpu": 1.0, "cpu": 0.5, "disk": 0.25}
    pods = [p.pod_identifier for p in work.pods]
    for keys in work.reads():
        assert _norm(merged.lookup(keys)) == _norm(cluster.lookup(keys)), keys[:1]
        assert merged.score(keys) == cluster.score(keys)
        assert merged.score_by_rank(keys, weights) == cluster.score_by_rank(keys, weights)
        assert merged.score(keys, weights, pods[1:3]) == cluster.score(keys, weights, pods[1:3])
    for name in pods:
        assert merged.get_watermark(name) == cluster.get_watermark(name), name


def _refs_held_elsewhere(path: Path) -> int:
    """How many request keys of a dump are held through a run in one shard and held in
    another shard too."""
    held: dict[bytes, list[bytes]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "key" in record and bytes.fromhex(record["key"]).startswith(b"r:"):
            for field, value in record["fields"]:
                held.setdefault(bytes.fromhex(field), []).append(bytes.fromhex(value))
    return sum(
        1 for values in held.values() if len(values) > 1 and any(len(v) == 6 for v in values)
    )


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "no-expiry"])
def test_a_dump_placed_by_pod_merged_into_one_server_answers_as_the_cluster_before_and_after_writes(
    cfg: RedisIndexConfig, redis_server_url: str, tmp_path: Path, speculative: bool
) -> None:
    """Random adds (chain runs, forks mid-run, runs grown past their end), evicts, clears,
    speculative adds (or none: reads then take a run's ranges whole) and fenced batches by pods
    of several shards; the dump restored into one server gives the cluster's lookups, scores,
    mappings and watermarks, and ``check`` finds nothing; then the same random writes on both
    keep them answering alike."""
    with RedisClusterIndex(cfg) as cluster:
        pods = _pods_over_shards(cluster.shards)
        spec = [_speculative_beside(cluster, p.pod_identifier) for p in pods[:2] if speculative]
        work = _MergeWorkload(20261205, pods, spec)
        for _ in range(80):
            work.step([cluster], clears=True)
        assert check_findings(cfg) == []
        path = tmp_path / "cluster.jsonl"
        assert invoke(cfg, "dump", str(path))[0] == 0
        # the merge's hard case is there: keys of runs that other shards hold too
        assert _refs_held_elsewhere(path) >= 10
        with _restored_in_one_server(redis_server_url, path) as (single, merged):
            assert check_findings(single) == []
            assert list(merged.client.scan_iter(match=f"{single.namespace}:c:*"))
            assert merged.client.exists(f"{single.namespace}:sx") == speculative
            _same_answers(merged, cluster, work)
            for keys in work.chains:
                for key in keys:
                    engine = _engine_of(key)
                    assert mapped(merged, engine) == mapped(cluster, engine), key
            for step in range(60):
                verdicts = work.step([cluster, merged], clears=False)
                assert len(set(verdicts)) <= 1, step
                if step % 15 == 14:
                    _same_answers(merged, cluster, work)
                    assert check_findings(single) == [], step
            for pod in pods[:2]:
                cluster.clear(pod.pod_identifier)
                merged.clear(pod.pod_identifier)
            _same_answers(merged, cluster, work)
            assert check_findings(single) == []


def _reversed_records(path: Path) -> Path:
    """The dump at ``path`` with its key records in the reverse order (header and end record
    kept in place): a merge must not depend on the order shards' records come in."""
    lines = path.read_text().splitlines()
    out = path.with_name(f"reversed-{path.name}")
    out.write_text("\n".join([lines[0], *reversed(lines[1:-1]), lines[-1]]) + "\n")
    return out


def test_keys_held_in_several_shards_merge_as_the_cluster_answers_them(
    cfg: RedisIndexConfig, redis_server_url: str, tmp_path: Path
) -> None:
    """An engine key mapped by pods of several shards answers, merged, the request key the
    cluster answers (the lowest shard's mapping's), whatever order the dump's records come in;
    a request key held in several shards lists the shards' entries in shard order."""
    with RedisClusterIndex(cfg) as cluster:
        low, high = sorted(
            _pods_over_shards(cluster.shards)[:2],
            key=lambda p: pod_shard(p.pod_identifier, cluster.shards),
        )
        one, two, three, four = chain(4, 51)
        cluster.add([901], [one], [low])
        cluster.add([901], [two], [high])  # another request key in the other shard
        cluster.add([902], [two, three], [low])
        cluster.add([902], [one, two], [high])
        cluster.add([903], [four], [high])
        cluster.add(None, [four], [low])
        path = tmp_path / "cluster.jsonl"
        assert invoke(cfg, "dump", str(path))[0] == 0
        for dump in (path, _reversed_records(path)):
            with _restored_in_one_server(redis_server_url, dump) as (single, merged):
                for engine_key in (901, 902, 903):
                    assert merged.get_request_key(engine_key) == cluster.get_request_key(
                        engine_key
                    ), (dump.name, engine_key)
                assert merged.lookup([four]) == {four: [low, high]}, dump.name
                assert merged.lookup([two]) == {two: [low, high]}, dump.name
                assert check_findings(single) == []


def test_an_engine_key_mapped_past_one_mapping_s_cap_over_the_shards_keeps_every_request_key(
    cfg: RedisIndexConfig, redis_server_url: str, tmp_path: Path
) -> None:
    """Pods of two shards map one engine key to more request keys together than one mapping
    keeps (MAX_REQUEST_KEYS_PER_ENGINE_KEY): merged, the mapping keeps them all, so an evict by
    that engine key still reaches every request key its pod holds, as on the cluster."""
    with RedisClusterIndex(cfg) as cluster:
        low, high = _pods_over_shards(cluster.shards)[:2]
        mine, theirs = chain(700, 61), chain(700, 62)
        assert len(mine) + len(theirs) > MAX_REQUEST_KEYS_PER_ENGINE_KEY
        cluster.add([905], mine, [low])
        cluster.add([905], theirs, [high])
        path = tmp_path / "cluster.jsonl"
        assert invoke(cfg, "dump", str(path))[0] == 0
        with _restored_in_one_server(redis_server_url, path) as (single, merged):
            assert merged.get_request_key(905) == cluster.get_request_key(905)
            for index in (cluster, merged):
                index.evict(905, KeyType.ENGINE, [high])
                index.add([905], [12345], [low])
            assert merged.lookup(theirs) == cluster.lookup(theirs) == {}
            assert merged.lookup(mine) == cluster.lookup(mine) == {k: [low] for k in mine}
            assert merged.get_request_key(905) == cluster.get_request_key(905) == 12345
            assert check_findings(single) == []

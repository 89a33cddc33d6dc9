"""kvredis migrate and kvredis drop, and the errors that name them, on real servers."""

from __future__ import annotations

import gzip
import json
import uuid
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvredis import (
    NamespaceLayoutError,
    PodEntry,
    RedisClusterIndex,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.cli.app import cli
from kvredis.redis.cluster.shards import CLUSTER_LAYOUT
from kvredis.redis.layout import LAYOUT_VERSION
from tests.redis.layout_v1 import V1, V1Namespace
from tests.servers import LocalCluster

A = PodEntry("pod-a", "gpu")
SPEC = PodEntry("pod-s", "gpu", speculative=True)


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def _v1(url: str, namespace: str) -> V1Namespace:
    raw = redis.Redis.from_url(url)
    v1 = V1Namespace(raw, namespace)
    v1.add([11, 12, 13], [1, 2, 3], [A])
    v1.add(None, [2, 3], [SPEC], ttl_ms=3_600_000)
    return v1


def _keys(url: str, namespace: str) -> list[bytes]:
    raw = redis.Redis.from_url(url)
    try:
        return sorted(raw.scan_iter(match=f"{namespace}:*"))
    finally:
        raw.close()


@pytest.mark.redis
def test_every_layout_error_says_which_command_fixes_it(
    redis_server_url: str, namespace: str
) -> None:
    v1 = _v1(redis_server_url, namespace)
    cfg = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    with pytest.raises(NamespaceLayoutError) as older:
        RedisIndex(cfg)
    assert str(older.value) == (
        f"namespace {namespace!r} is in layout {V1}, this kvredis reads {LAYOUT_VERSION}: "
        f"convert it with `kvredis migrate --redis {redis_server_url} {namespace}` (or drop "
        f"it: `kvredis drop --redis {redis_server_url} {namespace} --yes`)"
    )
    # the operator's commands say the same, with the address given
    code, _out, err = _invoke(
        "stats", "--redis", redis_server_url, "--namespace", namespace, "--no-memory"
    )
    assert code == 1 and f"kvredis migrate --redis {redis_server_url} {namespace}`" in err
    assert "b'" not in err.replace(repr(namespace), "")  # (a name may end in b)
    v1.raw.hset(v1.meta, "layout", "kvredis-kvblock/3")
    with pytest.raises(NamespaceLayoutError) as newer:
        RedisIndex(cfg)
    assert str(newer.value) == (
        f"namespace {namespace!r} is in layout kvredis-kvblock/3, written by a newer kvredis "
        f"(this one reads {LAYOUT_VERSION}): upgrade kvredis to a version that reads layout "
        "kvredis-kvblock/3"
    )
    v1.raw.hset(v1.meta, "layout", "someone-else/9")
    with pytest.raises(NamespaceLayoutError) as unknown:
        RedisIndex(cfg)
    assert "'someone-else/9', which is no kvredis layout" in str(unknown.value)
    assert f"`kvredis drop --redis {redis_server_url} {namespace} --yes`" in str(unknown.value)
    v1.raw.hset(v1.meta, "layout", b"\xff\xfe")
    with pytest.raises(NamespaceLayoutError) as binary:
        RedisIndex(cfg)
    shown = str(binary.value).replace(repr(namespace), "")  # (a name may end in b)
    assert "b'" not in shown and "no kvredis layout" in shown
    v1.raw.hdel(v1.meta, "layout")
    v1.raw.hset(v1.meta, "gen", "x")
    with pytest.raises(NamespaceLayoutError) as incomplete:
        RedisIndex(cfg)
    assert str(incomplete.value) == (
        f"namespace {namespace!r} has an incomplete meta record (layout missing, "
        f"bucket_bits='16', gen='x'): drop it with `kvredis drop --redis {redis_server_url} "
        f"{namespace} --yes`, or use another namespace"
    )
    v1.raw.close()


@pytest.mark.redis
def test_kvredis_migrate_converts_and_reports(redis_server_url: str, namespace: str) -> None:
    _v1(redis_server_url, namespace).raw.close()
    code, out, err = _invoke("migrate", "--redis", redis_server_url, namespace, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["migrated"] and report["from"] == V1 and report["to"] == LAYOUT_VERSION
    assert (report["speculative_pairs"], report["moved"], report["dropped"]) == (2, 2, 0)
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace)) as index:
        assert index.lookup([1, 2, 3]) == {1: [A], 2: [A, SPEC], 3: [A, SPEC]}
        assert index.get_request_key(12) == 2
    code, out, err = _invoke("migrate", "--redis", redis_server_url, "--namespace", namespace)
    assert code == 0 and f"is in layout {LAYOUT_VERSION} already: nothing to migrate" in out


@pytest.mark.redis
def test_kvredis_migrate_prints_progress_and_refuses_what_it_cannot(
    redis_server_url: str, namespace: str
) -> None:
    _v1(redis_server_url, namespace).raw.close()
    code, out, err = _invoke("migrate", "--redis", redis_server_url, namespace)
    assert code == 0, err
    assert f"migrating {namespace!r}: 2/2 speculative pairs converted (100%)" in err
    assert out.startswith(f"migrated namespace {namespace!r} at {redis_server_url} from {V1}")
    assert "2 speculative entries with a ttl converted (2 moved" in out
    code, out, err = _invoke("migrate", "--redis", redis_server_url, namespace + "-none")
    assert code == 1 and "does not exist" in err and "nothing to migrate" in err
    raw = redis.Redis.from_url(redis_server_url)
    raw.hset(f"{namespace}:meta", "layout", "kvredis-kvblock/9")
    code, out, err = _invoke("migrate", "--redis", redis_server_url, namespace)
    assert code == 1 and "upgrade kvredis to a version that reads layout kvredis-kvblock/9" in err
    code, out, err = _invoke("migrate", "--redis", redis_server_url, "x", "--namespace", "y")
    assert code == 2 and "two namespaces given" in err
    raw.close()


@pytest.mark.redis
def test_kvredis_drop_asks_then_drops_any_layout(redis_server_url: str, namespace: str) -> None:
    _v1(redis_server_url, namespace).raw.close()
    before = _keys(redis_server_url, namespace)
    code, out, err = _invoke("drop", "--redis", redis_server_url, namespace)
    assert code == 1 and _keys(redis_server_url, namespace) == before
    assert (
        f"this would delete {len(before)} keys of namespace {namespace!r} at "
        f"{redis_server_url} (layout {V1}); nothing deleted: pass --yes" in err
    )
    code, out, err = _invoke("drop", "--redis", redis_server_url, "--yes")
    assert code == 2 and "name the namespace to drop" in err
    code, out, err = _invoke("drop", "--redis", redis_server_url, namespace, "--yes")
    assert code == 0, err
    assert out.strip() == (
        f"dropped namespace {namespace!r} at {redis_server_url}: {len(before)} keys deleted"
    )
    assert _keys(redis_server_url, namespace) == []
    code, out, err = _invoke("drop", "--redis", redis_server_url, namespace, "--yes")
    assert code == 0 and "does not exist: nothing to drop" in out


@pytest.mark.redis
def test_kvredis_drop_finishes_a_drop_cut_short(redis_server_url: str, namespace: str) -> None:
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace)) as index:
        index.add([1], [2], [A])
    raw = redis.Redis.from_url(redis_server_url)
    raw.hset(f"{namespace}:meta", "gen", "dropping:abc")  # the dropper died after "begin"
    raw.delete(f"{namespace}:pe")
    code, _out, err = _invoke("drop", "--redis", redis_server_url, "--namespace", namespace)
    assert code == 1 and "a drop cut short" in err
    code, _out, err = _invoke(
        "drop", "--redis", redis_server_url, "--namespace", namespace, "--yes"
    )
    assert code == 0, err
    assert _keys(redis_server_url, namespace) == []
    raw.close()


@pytest.mark.redis
def test_restore_replace_replaces_a_namespace_of_another_layout(
    redis_server_url: str, namespace: str, tmp_path: Path
) -> None:
    source = f"kvt-{uuid.uuid4().hex[:12]}"
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=source)) as index:
        index.add([5], [6], [A])
        dump = tmp_path / "dump.jsonl.gz"
        code, _out, err = _invoke(
            "dump", "--redis", redis_server_url, "--namespace", source, str(dump)
        )
        assert code == 0, err
        index.drop_namespace()
    with gzip.open(dump) as fh:
        assert fh.readline()
    _v1(redis_server_url, namespace).raw.close()
    args = ("restore", "--redis", redis_server_url, "--namespace", namespace, str(dump))
    code, _out, err = _invoke(*args)
    assert code == 1 and "already holds keys (in a layout this kvredis does not read)" in err
    code, _out, err = _invoke(*args, "--replace")
    assert code == 0, err
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace)) as index:
        assert index.lookup([6]) == {6: [A]} and index.lookup([1]) == {}
        index.drop_namespace()


def test_kvredis_drop_on_a_cluster(redis_cluster: LocalCluster) -> None:
    url = redis_cluster.url
    ns = f"kvt-{uuid.uuid4().hex[:12]}"
    with RedisClusterIndex(RedisIndexConfig(address=url, namespace=ns)) as index:
        index.add([1], [2], [A])
        code, out, err = _invoke("drop", "--redis", url, ns)
        assert code == 1 and "on every shard" in err and index.lookup([2]) == {2: [A]}
        code, out, err = _invoke("drop", "--redis", url, ns, "--yes")
        assert code == 0 and f"dropped namespace {ns!r}" in out, err
        assert index.lookup([2]) == {}
        code, out, err = _invoke("migrate", "--redis", url, ns)  # a cluster namespace: gone
        assert code == 1 and "does not exist" in err and "nothing to migrate" in err, err


def test_migrate_says_nothing_to_do_alike_on_one_server_and_a_cluster(
    redis_cluster: LocalCluster, redis_server_url: str
) -> None:
    """A namespace in the layout migrate converts to: exit 0 and the same words, whether on one
    server (the single-server layout) or on a cluster (the pod layout of cluster namespaces)."""
    ns = f"kvt-{uuid.uuid4().hex[:12]}"
    single = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=ns))
    cluster = RedisClusterIndex(RedisIndexConfig(address=redis_cluster.url, namespace=ns))
    try:
        cases = (
            (single, redis_server_url, LAYOUT_VERSION),
            (cluster, redis_cluster.url, CLUSTER_LAYOUT),
        )
        for index, url, layout in cases:
            index.add([1], [2], [A])
            code, out, err = _invoke("migrate", "--redis", url, ns)
            assert code == 0, err
            assert f"is in layout {layout} already: nothing to migrate" in out
            code, out, err = _invoke("migrate", "--redis", url, ns, "--json")
            assert code == 0, err
            report = json.loads(out)
            assert report["migrated"] is False and report["to"] == layout
            assert index.lookup([2]) == {2: [A]}
    finally:
        for index in (single, cluster):
            index.drop_namespace()
            index.close()

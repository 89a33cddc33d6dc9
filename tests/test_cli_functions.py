"""``kvredis functions load|show`` against real servers, and the library on every node of a
cluster."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from click.testing import CliRunner

from kvredis import AddOp, PodEntry, RedisIndex, RedisIndexConfig, Watermark
from kvredis.cli import cli
from kvredis.redis.functions import API_VERSION, LIBRARY, VERSION_FUNCTION, shipped_library
from tests.servers import LocalCluster, RedisServer


def test_show_code_prints_the_library_without_a_server() -> None:
    result = CliRunner().invoke(cli, ["functions", "show", "--code"])
    assert result.exit_code == 0, result.output
    assert result.output.encode() == shipped_library().code


def test_load_then_show(own_redis_server: RedisServer) -> None:
    url = own_redis_server.url
    runner = CliRunner()
    shown = runner.invoke(cli, ["functions", "show", "--redis", url, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["servers"][0]["version"] is None
    loaded = runner.invoke(cli, ["functions", "load", "--redis", url])
    assert loaded.exit_code == 0, loaded.output
    assert f"loaded kvredis api {API_VERSION}" in loaded.output
    assert "was: no kvredis library" in loaded.output
    again = runner.invoke(cli, ["functions", "load", "--redis", url, "--json"])
    assert json.loads(again.output)["servers"][0]["loaded"] is False
    shown = runner.invoke(cli, ["functions", "show", "--redis", url])
    assert f"build {shipped_library().build} (this release's)" in shown.output
    client = redis.Redis(port=own_redis_server.port)
    try:
        assert client.fcall_ro(VERSION_FUNCTION, 0)[0] == LIBRARY.encode()
    finally:
        client.close()


def test_load_refused_is_one_line(own_redis_server: RedisServer) -> None:
    client = redis.Redis(port=own_redis_server.port)
    commands = ["+fcall_ro", "+ping", "+client|setname", "+hello"]
    for extra in (["+client|setinfo"], []):  # CLIENT SETINFO: Redis 7.2 and later
        try:
            client.acl_setuser("reader", enabled=True, passwords=["+pw"], commands=commands + extra)
            break
        except redis.ResponseError:
            continue
    client.close()
    url = f"redis://reader:pw@127.0.0.1:{own_redis_server.port}"
    result = CliRunner().invoke(cli, ["functions", "load", "--redis", url])
    assert result.exit_code == 1
    assert "FUNCTION LOAD of the kvredis library failed" in result.output


@pytest.mark.cluster
def test_the_library_is_on_every_node_of_a_cluster(redis_cluster: LocalCluster) -> None:
    ns = f"kvt-{uuid.uuid4().hex[:12]}"
    config = RedisIndexConfig(address=redis_cluster.url, namespace=ns)
    with _cluster_index(config) as index:
        index.add(None, list(range(1, 40)), [PodEntry("pod-a", "gpu")])
        assert index.lookup([1, 2])
        redis_cluster.wait_replicated()
        for port in redis_cluster.ports:  # primaries loaded it, replicas got it by replication
            client = redis_cluster.client(port)
            assert client.fcall_ro(VERSION_FUNCTION, 0)[4] == shipped_library().build
        primaries = [p for p, (role, _, _) in redis_cluster.topology().items() if role == "master"]
        for port in primaries:  # a flushed cluster: each node reloads on its miss
            redis_cluster.client(port).function_flush()
        assert index.lookup([1, 2]) == {
            1: [PodEntry("pod-a", "gpu")],
            2: [PodEntry("pod-a", "gpu")],
        }
        batch = [AddOp(None, tuple(range(100, 140)), (PodEntry("pod-b", "cpu"),))]
        assert index.apply_batch(batch, "s", Watermark(1, 1))
        expected = 0.0
        for _ in range(40):
            expected += 0.8  # summed in key order, as the function does
        assert index.score(list(range(100, 140))) == {"pod-b": expected}
        index.drop_namespace()
    result = CliRunner().invoke(cli, ["functions", "show", "--redis", redis_cluster.url, "--json"])
    assert result.exit_code == 0, result.output
    servers = json.loads(result.output)["servers"]
    assert servers and all(s["version"]["build"] == shipped_library().build for s in servers)


def _cluster_index(config: RedisIndexConfig) -> RedisIndex:
    from kvredis.redis.factories import new_redis_index

    return new_redis_index(config)  # type: ignore[return-value]

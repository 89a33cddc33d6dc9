"""RedisIndexConfig, the factories, and the connection forms (TCP, unix, TLS, valkey://)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from kvredis import (
    AsyncRedisIndex,
    BackendUnavailableError,
    ConfigError,
    IndexConfig,
    InvalidInputError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    new_index,
    new_redis_index,
    new_valkey_index,
)
from kvredis.redis.config import DEFAULT_VALKEY_ADDRESS
from tests.servers import RedisServer, free_port

A = PodEntry("pod-a", "gpu")


# -- config ------------------------------------------------------------------------------------


def test_config_defaults_match_upstream() -> None:
    cfg = RedisIndexConfig()
    assert (cfg.address, cfg.backend_type, cfg.enable_rdma, cfg.namespace) == (
        "redis://127.0.0.1:6379",
        "redis",
        False,
        "kvblock",
    )


def test_config_from_upstream_camel_case_and_snake_case() -> None:
    cfg = RedisIndexConfig.from_dict(
        {
            "address": "valkeys://v:6379",
            "backendType": "valkey",
            "enableRDMA": True,
            "namespace": "prod",
            "socketTimeout": 0.5,
            "poolSize": 4,
            "bucketBits": 12,
            "tls_verify": False,
        }
    )
    assert (cfg.address, cfg.backend_type, cfg.enable_rdma, cfg.namespace) == (
        "valkeys://v:6379",
        "valkey",
        True,
        "prod",
    )
    assert (cfg.socket_timeout, cfg.pool_size, cfg.bucket_bits, cfg.tls_verify) == (
        0.5,
        4,
        12,
        False,
    )


@pytest.mark.parametrize(
    "mapping",
    [
        {"adress": "redis://h"},
        {"address": "redis://h", "backendType": "memcached"},
        {"address": "ftp://h"},
        {"namespace": ""},
        {"namespace": "prod:r"},
        {"namespace": "a:e:b"},
        {"poolSize": 0},
        {"poolSize": 2.5},
        {"retries": -1},
        {"socketTimeout": 0},
        {"socketTimeout": "1s"},
        {"bucketBits": 0},
        {"bucketBits": 25},
        {"enableRDMA": "yes"},
        {"password": 123},
        {"poolSize": 3, "pool_size": 4},
        {"socketTimeout": float("nan")},
        {"socketTimeout": float("inf")},
        {"connectTimeout": float("nan")},
        {"poolTimeout": float("inf")},
        {"retryBackoff": float("nan")},
        {"retryBackoff": float("inf")},
        {"strict": "yes"},
        {"address": "redis://h:1", "tlsCaFile": "/ca.pem"},
        {"address": "redis://h:1", "tlsVerify": False},
        {"address": "valkey://h:1", "tlsCertFile": "/c.pem"},
        {"address": "unix:///r.sock", "tlsKeyFile": "/k.pem"},
    ],
)
def test_bad_config_raises_config_error(mapping: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RedisIndexConfig.from_dict(mapping)
    with pytest.raises(ConfigError):
        RedisIndexConfig.from_dict("redis://h")  # type: ignore[arg-type]


def test_index_rejects_a_config_of_the_wrong_type() -> None:
    with pytest.raises(ConfigError):
        RedisIndex({"address": "redis://h"})  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        AsyncRedisIndex("redis://h")  # type: ignore[arg-type]


# -- connecting --------------------------------------------------------------------------------


def _ns() -> str:
    return f"kvt-{uuid.uuid4().hex[:12]}"


def test_construction_against_a_dead_port_names_the_address() -> None:
    port = free_port()
    cfg = RedisIndexConfig(
        address=f"redis://u:pw@127.0.0.1:{port}/0", connect_timeout=0.5, retries=1
    )
    with pytest.raises(BackendUnavailableError) as info:
        RedisIndex(cfg)
    assert f"127.0.0.1:{port}" in str(info.value) and ":pw@" not in str(info.value)
    assert isinstance(info.value, ConnectionError)


async def test_async_connect_against_a_dead_port_names_the_address() -> None:
    port = free_port()
    cfg = RedisIndexConfig(address=f"127.0.0.1:{port}", connect_timeout=0.5, retries=0)
    with pytest.raises(BackendUnavailableError) as info:
        await AsyncRedisIndex.create(cfg)
    assert f"127.0.0.1:{port}" in str(info.value)


@pytest.mark.redis
def test_valkey_scheme_and_bare_address_reach_the_same_server(redis_server_url: str) -> None:
    host_port = redis_server_url.removeprefix("redis://")
    ns = _ns()
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=ns)) as first:
        first.add(None, [1, 2], [A])
    with new_valkey_index(RedisIndexConfig(address=f"valkey://{host_port}", namespace=ns)) as v:
        assert v.config.backend_type == "valkey"
        assert v.lookup([1, 2]) == {1: [A], 2: [A]}
    with new_redis_index(RedisIndexConfig(address=host_port, namespace=ns)) as bare:
        assert bare.lookup([1, 2]) == {1: [A], 2: [A]}
    with RedisIndex(RedisIndexConfig(address=f"{redis_server_url}/1", namespace=ns)) as other_db:
        assert other_db.lookup([1, 2]) == {}


def test_valkey_defaults_and_backend_type() -> None:
    assert DEFAULT_VALKEY_ADDRESS == "valkey://127.0.0.1:6379"
    with pytest.raises(BackendUnavailableError) as info:
        new_valkey_index(
            RedisIndexConfig(
                address=f"redis://127.0.0.1:{free_port()}", connect_timeout=0.3, retries=0
            )
        )
    # A config handed to new_valkey_index is used with backend_type "valkey".
    assert "cannot reach valkey at redis://127.0.0.1:" in str(info.value)


@pytest.mark.redis
def test_unix_socket_address() -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvredis-sock-"))
    sock = directory / "redis.sock"
    server = RedisServer(extra_args=["--unixsocket", str(sock), "--unixsocketperm", "700"])
    server.start()
    try:
        with RedisIndex(RedisIndexConfig(address=f"unix://{sock}?db=2", namespace=_ns())) as idx:
            idx.add([7], [8], [A])
            assert idx.get_request_key(7) == 8
            assert idx.client.connection_pool.connection_kwargs["db"] == 2
    finally:
        server.close()
        sock.unlink(missing_ok=True)
        directory.rmdir()


@pytest.mark.redis
def test_enable_rdma_logs_a_warning_and_uses_tcp(
    redis_server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = RedisIndexConfig(address=redis_server_url, namespace=_ns(), enable_rdma=True)
    with caplog.at_level(logging.WARNING, logger="kvredis.redis.index"):
        idx = RedisIndex(cfg)
    try:
        assert any("RDMA" in r.getMessage() for r in caplog.records)
        idx.add(None, [5], [A])
        assert idx.lookup([5]) == {5: [A]}
    finally:
        idx.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvredis.redis.index"):
        RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=_ns())).close()
    assert not any("RDMA" in r.getMessage() for r in caplog.records)


@pytest.mark.redis
def test_credentials_from_the_address_are_used() -> None:
    server = RedisServer()
    server.start()
    try:
        admin = redis.Redis(port=server.port)
        admin.config_set("requirepass", "s3cret")
        admin.close()
        good = f"redis://:s3cret@127.0.0.1:{server.port}"
        with RedisIndex(RedisIndexConfig(address=good, namespace=_ns())) as idx:
            idx.add(None, [3], [A])
            assert idx.lookup([3]) == {3: [A]}
        bad = RedisIndexConfig(address=f"redis://:wrong@127.0.0.1:{server.port}", retries=3)
        with pytest.raises(BackendUnavailableError) as info:
            RedisIndex(bad)
        assert "authentication" in str(info.value) and ":wrong@" not in str(info.value)
    finally:
        server.close()


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI for a cert")
def test_tls_address_with_a_ca_file(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    tls_port = free_port()
    server = RedisServer(
        extra_args=[
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        ]
    )
    server.start()
    try:
        address = f"rediss://localhost:{tls_port}"
        cfg = RedisIndexConfig(address=address, namespace=_ns(), tls_ca_file=str(cert))
        with RedisIndex(cfg) as idx:
            idx.add([1], [2], [A])
            assert idx.lookup([2]) == {2: [A]}
        untrusted = RedisIndexConfig(address=address, connect_timeout=1.0, retries=0)
        with pytest.raises(BackendUnavailableError, match="localhost"):
            RedisIndex(untrusted)  # the self-signed certificate is not trusted by default
    finally:
        server.close()


def test_tls_options_need_a_tls_address_and_strict_is_read_from_json() -> None:
    config = RedisIndexConfig.from_dict({"address": "rediss://h:1", "tlsCaFile": "/ca.pem"})
    assert config.tls_ca_file == "/ca.pem"
    with pytest.raises(ConfigError, match="rediss://"):
        RedisIndexConfig(address="redis://u:hunter2@h:1", tls_ca_file="/ca.pem")
    try:
        RedisIndexConfig(address="redis://u:hunter2@h:1", tls_ca_file="/ca.pem")
    except ConfigError as exc:
        assert "hunter2" not in str(exc)
    assert RedisIndexConfig.from_dict({"strict": True}).strict is True
    assert RedisIndexConfig().strict is False


def test_config_repr_never_shows_passwords() -> None:
    config = RedisIndexConfig(address="redis://u:s3cret-a@h:6379/0", password="s3cret-b")
    text = repr(config)
    assert "s3cret" not in text
    assert "password='***'" in text
    assert "redis://u:***@h:6379/0" in text
    assert "s3cret" not in repr(IndexConfig(redis_config=config))
    # a password containing "@" is masked whole, in repr and in the index's repr and errors
    config = RedisIndexConfig(address="redis://u:p@ss@w0rd@h:6379/0")
    assert "ss@w0rd" not in repr(config) and "w0rd" not in repr(config)
    assert "w0rd" not in config.server()


# -- cluster mode (parsed and checked; this version's clients serve single servers) ------------


def test_cluster_options_in_the_upstream_json_shape() -> None:
    cfg = RedisIndexConfig.from_dict(
        {"address": "redis://10.0.0.1:7000", "cluster": True, "readFromReplicas": True}
    )
    assert (cfg.cluster, cfg.read_from_replicas) == (True, True)
    snake = RedisIndexConfig.from_dict({"cluster": True, "read_from_replicas": False})
    assert (snake.cluster, snake.read_from_replicas) == (True, False)
    assert (RedisIndexConfig().cluster, RedisIndexConfig().read_from_replicas) == (False, False)


def test_a_cluster_address_sets_cluster_mode() -> None:
    cfg = RedisIndexConfig(address="valkey+cluster://a:1,b:2")
    assert cfg.cluster
    assert cfg.parsed_address().seeds == (("a", 1), ("b", 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cluster": "yes"}, "cluster must be a bool"),
        ({"read_from_replicas": 1}, 'read_from_replicas must be true, false or "spread"'),
        ({"read_from_replicas": "replicas"}, 'read_from_replicas must be true, false or "spread"'),
        ({"cluster": True, "address": "unix:///run/r.sock"}, "unix socket"),
    ],
)
def test_cluster_options_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RedisIndexConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"address": "redis+cluster://127.0.0.1:1"},
        {"address": "rediss+cluster://127.0.0.1:1,127.0.0.1:2"},
        {"address": "redis://127.0.0.1:1", "cluster": True},
    ],
)
def test_single_server_classes_refuse_a_cluster_config_and_factories_pick_the_cluster_index(
    kwargs: dict[str, object],
) -> None:
    cfg = RedisIndexConfig(**kwargs)  # type: ignore[arg-type]
    for build in (RedisIndex, AsyncRedisIndex):
        with pytest.raises(ConfigError, match=r"is a cluster address: use RedisClusterIndex"):
            build(cfg)
    # nothing listens on port 1: the cluster index is built and cannot reach its seeds
    fast = replace(cfg, retries=0, connect_timeout=0.2)
    for make in (new_redis_index, new_valkey_index):
        with pytest.raises(BackendUnavailableError, match=r"127\.0\.0\.1:1"):
            make(fast)
    mapping = {"redisConfig": {"address": cfg.address, "cluster": cfg.cluster, "retries": 0}}
    with pytest.raises(BackendUnavailableError):
        new_index(mapping)

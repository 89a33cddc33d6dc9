"""Addresses, RedisIndexConfig, the factories, and the connection forms (TCP, unix, valkey://)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import redis

from kvredis.address import mask_password, parse_address
from kvredis.config import IndexConfig
from kvredis.errors import BackendUnavailableError, ConfigError, InvalidInputError
from kvredis.redis_index import (
    DEFAULT_VALKEY_ADDRESS,
    AsyncRedisIndex,
    RedisIndex,
    RedisIndexConfig,
    new_redis_index,
    new_valkey_index,
)
from kvredis.types import PodEntry
from tests.servers import RedisServer, free_port

A = PodEntry("pod-a", "gpu")


# -- addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "transport", "host", "port", "tls", "db"),
    [
        ("redis://127.0.0.1:6379", "tcp", "127.0.0.1", 6379, False, 0),
        ("redis://cache.example:7000/3", "tcp", "cache.example", 7000, False, 3),
        ("rediss://cache.example:6380/0", "tcp", "cache.example", 6380, True, 0),
        ("valkey://10.1.2.3", "tcp", "10.1.2.3", 6379, False, 0),
        ("valkeys://10.1.2.3:6390/2", "tcp", "10.1.2.3", 6390, True, 2),
        ("VALKEY://Host:1", "tcp", "host", 1, False, 0),
        ("127.0.0.1:6400", "tcp", "127.0.0.1", 6400, False, 0),
        ("localhost", "tcp", "localhost", 6379, False, 0),
        ("cache:6379/5", "tcp", "cache", 6379, False, 5),
        ("redis://[::1]:6379", "tcp", "::1", 6379, False, 0),
        ("redis://h:1?db=4", "tcp", "h", 1, False, 4),
        ("  redis://h:2/1  ", "tcp", "h", 2, False, 1),
    ],
)
def test_tcp_address_forms(
    address: str, transport: str, host: str, port: int, tls: bool, db: int
) -> None:
    parsed = parse_address(address)
    assert (parsed.transport, parsed.host, parsed.port, parsed.tls, parsed.db) == (
        transport,
        host,
        port,
        tls,
        db,
    )


def test_credentials_are_parsed_percent_decoded_and_masked() -> None:
    parsed = parse_address("redis://alice:p%40ss%3Aword@h:1/2")
    assert (parsed.username, parsed.password, parsed.db) == ("alice", "p@ss:word", 2)
    assert "p%40ss" not in parsed.display and "***" in parsed.display
    only_password = parse_address("rediss://:secret@h")
    assert (only_password.username, only_password.password) == (None, "secret")
    assert "secret" not in only_password.display
    query = parse_address("unix:///run/r.sock?db=3&password=pw&username=bob")
    assert (query.transport, query.path, query.db, query.password, query.username) == (
        "unix",
        "/run/r.sock",
        3,
        "pw",
        "bob",
    )
    assert mask_password("redis://u:topsecret@h:1") == "redis://u:***@h:1"


@pytest.mark.parametrize(
    "address",
    [
        "",
        "   ",
        "http://h:1",
        "redis://h:notaport",
        "redis://h:0",
        "redis://h:70000",
        "redis://h:1/x",
        "redis://h:1/-1",
        "redis://h:1/1/2",
        "redis://h:1/1?db=2",
        "redis://h:1?timeout=3",
        "redis://h:1?db=1&db=2",
        "redis://:1",
        "redis://h:1#frag",
        "unix://",
        "unix://host/path.sock",
    ],
)
def test_malformed_addresses_raise_config_error(address: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_address(address)
    assert isinstance(info.value, ValueError)


def test_errors_name_the_address_without_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_address("redis://u:hunter2@h:badport")
    assert "h:badport" in str(info.value) and "hunter2" not in str(info.value)
    with pytest.raises(ConfigError):
        parse_address(6379)  # type: ignore[arg-type]


def test_a_password_given_as_query_parameter_is_masked_too() -> None:
    parsed = parse_address("unix:///run/r.sock?db=3&password=hunter2")
    assert parsed.password == "hunter2" and "hunter2" not in parsed.display
    assert "hunter2" not in parse_address("h:1?password=hunter2&db=1").display
    assert mask_password("redis://h:1?db=1&password=hunter2") == "redis://h:1?db=1&password=***"
    with pytest.raises(ConfigError) as info:
        parse_address("redis://h:1/x?password=hunter2")
    assert "hunter2" not in str(info.value)


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
            "address": "valkey://v:6379",
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
        "valkey://v:6379",
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
    with caplog.at_level(logging.WARNING, logger="kvredis.redis_index"):
        idx = RedisIndex(cfg)
    try:
        assert any("RDMA" in r.getMessage() for r in caplog.records)
        idx.add(None, [5], [A])
        assert idx.lookup([5]) == {5: [A]}
    finally:
        idx.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvredis.redis_index"):
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


def test_config_repr_never_shows_passwords() -> None:
    config = RedisIndexConfig(address="redis://u:s3cret-a@h:6379/0", password="s3cret-b")
    text = repr(config)
    assert "s3cret" not in text
    assert "password='***'" in text
    assert "redis://u:***@h:6379/0" in text
    assert "s3cret" not in repr(IndexConfig(redis_config=config))

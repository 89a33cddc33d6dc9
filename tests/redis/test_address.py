"""Server addresses: the accepted forms, credentials, and passwords kept out of messages."""

from __future__ import annotations

import pytest

from kvredis import ConfigError, RedisIndexConfig, mask_password, parse_address


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


@pytest.mark.parametrize(
    "address",
    ["redis://u:p@ss@h:1/0", "u:p@ss@h:1", "rediss://:a@b@c@h", "valkey://u:x@y@h:1?db=2"],
)
def test_a_password_containing_at_signs_is_masked_whole(address: str) -> None:
    parsed = parse_address(address)
    assert parsed.password is not None and "@" in parsed.password
    assert parsed.password not in parsed.display
    for part in parsed.password.split("@"):
        assert f":{part}" not in parsed.display and f"{part}@" not in parsed.display
    assert parsed.host == ("h" if "h" in address else parsed.host)


# -- cluster addresses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "tls", "seeds"),
    [
        ("redis+cluster://10.0.0.1:7000", False, (("10.0.0.1", 7000),)),
        ("redis+cluster://a:7000,b:7001,c", False, (("a", 7000), ("b", 7001), ("c", 6379))),
        ("valkey+cluster://a:1,b:2", False, (("a", 1), ("b", 2))),
        ("rediss+cluster://a:1,b:2", True, (("a", 1), ("b", 2))),
        ("valkeys+cluster://a:1", True, (("a", 1),)),
        ("VALKEY+CLUSTER://Node-A:1, node-b:2", False, (("node-a", 1), ("node-b", 2))),
        ("redis+cluster://[::1]:7000,[fe80::2]:7001", False, (("::1", 7000), ("fe80::2", 7001))),
        ("redis+cluster://a:1,a:1,b:2/0", False, (("a", 1), ("b", 2))),  # each seed once
        ("redis+cluster://a:1?db=0", False, (("a", 1),)),
    ],
)
def test_cluster_addresses_list_their_seeds(
    address: str, tls: bool, seeds: tuple[tuple[str, int], ...]
) -> None:
    parsed = parse_address(address)
    assert parsed.cluster
    assert parsed.seeds == seeds
    assert (parsed.transport, parsed.tls, parsed.db) == ("tcp", tls, 0)
    assert (parsed.host, parsed.port) == seeds[0]


def test_a_single_server_address_is_its_own_seed() -> None:
    assert parse_address("redis://h:1").seeds == (("h", 1),)
    assert not parse_address("redis://h:1").cluster
    assert parse_address("unix:///run/redis.sock").seeds == ()


def test_cluster_credentials_apply_to_every_seed_and_stay_masked() -> None:
    parsed = parse_address("valkey+cluster://user:p%40ss@a:1,b:2")
    assert (parsed.username, parsed.password) == ("user", "p@ss")
    assert parsed.seeds == (("a", 1), ("b", 2))
    assert parsed.display == "valkey+cluster://user:***@a:1,b:2"
    with pytest.raises(ConfigError) as caught:
        parse_address("redis+cluster://user:topsecret@a:1,b:port")
    assert "topsecret" not in str(caught.value)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("redis://a:1,b:2", "redis\\+cluster://"),
        ("valkey://a,b", "redis\\+cluster://"),
        ("a:1,b:2", "redis\\+cluster://"),
        ("redis+cluster://", "no host"),
        ("redis+cluster://a:1,,b:2", "no host"),
        ("redis+cluster://a:1,b:x", "b:x"),
        ("redis+cluster://a:70000", "a:70000"),
        ("redis+cluster://a:1/3", "database 0 only"),
        ("redis+cluster://a:1?db=2", "database 0 only"),
        ("unix+cluster:///x.sock", "unsupported scheme"),
    ],
)
def test_malformed_cluster_addresses_raise_config_error(address: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_address(address)


@pytest.mark.parametrize(
    "address",
    [
        "redis://:S3cretPW/x@127.0.0.1:6379/0",
        "redis://u:S3cretPW?x@h:1",
        "rediss://u:S3cretPW#x@h",
        "u:S3cretPW/x?y#z@h:1",
        "redis+cluster://:S3cretPW/x@a:1,b:2",
        "redis://:S3cretPW/x@y@h:1/0",
    ],
)
def test_a_password_with_a_raw_slash_question_mark_or_hash_is_never_shown(address: str) -> None:
    shown = mask_password(address)
    assert "S3cretPW" not in shown and "x@" not in shown and "***@" in shown
    with pytest.raises(ConfigError) as info:
        parse_address(address)
    message = str(info.value)
    assert "S3cretPW" not in message and "percent-encode" in message
    with pytest.raises(ConfigError) as info:
        RedisIndexConfig(address=address)
    assert "S3cretPW" not in str(info.value)


def test_masking_keeps_the_user_name_and_a_query_password_may_hold_an_at_sign() -> None:
    assert mask_password("redis://user@h:1") == "redis://user@h:1"
    assert mask_password("redis://a/b@h:1") == "redis://***@h:1"
    parsed = parse_address("redis://h:1/0?password=p@ss")
    assert parsed.password == "p@ss" and parsed.display == "redis://h:1/0?password=***"

"""A namespace an earlier kvredis created under a name the rules refuse now (``:`` or a glob
character): opening it is an error naming ``kvredis rename``, and that command moves it, byte
for byte, to an accepted name, leaving every other namespace alone."""

from __future__ import annotations

import re
import shlex
import uuid
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from kvredis import KeyType, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.cli import cli
from kvredis.errors import ConfigError
from kvredis.redis.config import config_for_existing
from kvredis.redis.layout import Layout

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
SPEC = PodEntry("pod-s", "gpu", speculative=True)


def _fill(index: Any) -> None:
    index.add([101, 102], [1, 2, 3], [A])
    index.add(None, [1, 2], [B])
    index.add(None, [1], [SPEC], ttl=600)
    index.evict(3, KeyType.REQUEST, [A])


def _contents(raw: redis.Redis, namespace: str) -> dict[bytes, object]:
    """Every key of the namespace (relative name) with its value."""
    layout = Layout(namespace, 16, b"")
    prefix = re.sub(rb"([*?\[\]\\])", rb"\\\1", namespace.encode()) + b":*"
    out: dict[bytes, object] = {}
    for key in raw.scan_iter(match=prefix, count=1000):
        if not layout.owns(key):
            continue
        rel = key[len(namespace.encode()) + 1 :]
        out[rel] = raw.hgetall(key) if raw.type(key) == b"hash" else raw.get(key)
    return out


@pytest.mark.parametrize("old", ["kv:prod", "t*", "team[1]", "a?b"])
def test_an_old_name_is_refused_with_the_command_that_renames_it(
    redis_server_url: str, old: str
) -> None:
    tag = f"kvt-{uuid.uuid4().hex[:8]}"
    old = f"{tag}-{old}"
    base = RedisIndexConfig(address=redis_server_url)
    raw = redis.Redis.from_url(redis_server_url)
    legacy = RedisIndex(config_for_existing(base, old))  # as an earlier kvredis made it
    neighbour = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=tag))
    try:
        _fill(legacy)
        _fill(neighbour)
        before = _contents(raw, old)
        theirs = _contents(raw, tag)
        with pytest.raises(ConfigError, match="kvredis rename") as refused:
            RedisIndexConfig(address=redis_server_url, namespace=old)
        command = re.search(r"`(kvredis rename [^`]*)`", str(refused.value))
        assert command is not None
        args = shlex.split(command.group(1).replace("URL", redis_server_url))
        new = args[3]
        result = CliRunner().invoke(cli, [*args[1:], "--yes"])
        assert result.exit_code == 0, result.output
        assert f"renamed namespace {old!r} to {new!r}" in result.output
        assert _contents(raw, old) == {}
        assert _contents(raw, new) == before  # byte for byte
        assert _contents(raw, tag) == theirs  # the neighbour untouched
        with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=new)) as moved:
            assert moved.lookup([1, 2, 3]) == {1: [A, B, SPEC], 2: [A, B]}
    finally:
        for index in (legacy, neighbour):
            index.drop_namespace()
            index.close()
        for key in raw.scan_iter(match=f"{tag}*"):
            raw.unlink(key)
        raw.close()


def test_rename_refuses_a_new_name_that_holds_keys_or_is_refused(redis_server_url: str) -> None:
    tag = f"kvt-{uuid.uuid4().hex[:8]}"
    base = RedisIndexConfig(address=redis_server_url)
    with (
        RedisIndex(config_for_existing(base, f"{tag}:a")) as old,
        RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=f"{tag}-b")) as taken,
    ):
        try:
            _fill(old)
            _fill(taken)
            runner = CliRunner()
            args = ["rename", f"{tag}:a", "--redis", redis_server_url, "--yes"]
            result = runner.invoke(cli, [*args[:2], f"{tag}-b", *args[2:]])
            assert result.exit_code == 1 and "already holds keys" in result.output
            result = runner.invoke(cli, [*args[:2], f"{tag}:c", *args[2:]])
            assert result.exit_code == 2 and "may not contain" in result.output
            result = runner.invoke(cli, [*args[:2], f"{tag}-missing", "--redis", redis_server_url])
            assert result.exit_code == 1  # asks first: no --yes, no input
            result = runner.invoke(cli, ["rename", f"{tag}-none", f"{tag}-d", *args[2:]])
            assert result.exit_code == 1 and "does not exist" in result.output
            assert old.lookup([1]) == {1: [A, B, SPEC]}  # nothing moved
        finally:
            old.drop_namespace()
            taken.drop_namespace()


def test_drop_and_migrate_take_an_old_name(redis_server_url: str) -> None:
    tag = f"kvt-{uuid.uuid4().hex[:8]}"
    old = f"{tag}:old"
    with RedisIndex(config_for_existing(RedisIndexConfig(address=redis_server_url), old)) as idx:
        _fill(idx)
    runner = CliRunner()
    result = runner.invoke(cli, ["migrate", old, "--redis", redis_server_url])
    assert result.exit_code == 0 and "nothing to migrate" in result.output, result.output
    result = runner.invoke(cli, ["drop", old, "--redis", redis_server_url, "--yes"])
    assert result.exit_code == 0 and "dropped" in result.output, result.output
    raw = redis.Redis.from_url(redis_server_url)
    try:
        assert _contents(raw, old) == {}
    finally:
        raw.close()


def test_rename_on_a_cluster(redis_cluster: Any) -> None:
    from kvredis import RedisClusterIndex

    tag = f"kvt-{uuid.uuid4().hex[:8]}"
    base = RedisIndexConfig(address=redis_cluster.url)
    with RedisClusterIndex(config_for_existing(base, f"{tag}:old")) as old:
        _fill(old)
        expected = old.lookup([1, 2, 3])
    result = CliRunner().invoke(
        cli, ["rename", f"{tag}:old", f"{tag}-new", "--redis", redis_cluster.url, "--yes"]
    )
    assert result.exit_code == 0, result.output
    with RedisClusterIndex(
        RedisIndexConfig(address=redis_cluster.url, namespace=f"{tag}-new")
    ) as new:
        try:
            assert new.lookup([1, 2, 3]) == expected
        finally:
            new.drop_namespace()
    with pytest.raises(Exception, match="does not exist"):
        RedisClusterIndex(config_for_existing(base, f"{tag}:old"), create=False)

"""The Lua script registry: sources, headers, EVALSHA, and recovery from flushes and restarts."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvredis.redis_index import AsyncRedisIndex, RedisIndex, RedisIndexConfig
from kvredis.scripts import ScriptCall, ScriptRegistry, expand, lua_sources
from kvredis.types import KeyType, PodEntry
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
COMMANDS = {
    "add",
    "apply_batch",
    "clear",
    "clear_mappings",
    "evict",
    "lookup",
    "namespace",
    "ping",
    "request_key",
    "score",
}


def _ns() -> str:
    return f"kvt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def raw(own_redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=own_redis_server.port)
    try:
        yield client
    finally:
        client.close()


def test_every_command_file_is_registered_and_libraries_are_not() -> None:
    registry = ScriptRegistry()
    assert set(registry.names()) == COMMANDS
    on_disk = {p.stem for p in LUA_DIR.glob("*.lua")}
    assert {n for n in on_disk if not n.startswith("_")} == COMMANDS
    assert "_kvblock" in on_disk and "_kvblock" not in registry


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_file_opens_with_a_true_header(name: str) -> None:
    text = (LUA_DIR / f"{name}.lua").read_text()
    body = text.split("\n", 1)[1] if text.startswith("#!lua") else text
    match = re.match(r"--\[\[ (\w+): .+?\]\]", body, re.DOTALL)
    assert match, f"{name}.lua has no header block"
    assert match.group(1) == name
    header = match.group(0)
    for part in ("KEYS", "ARGV", "Returns", "Complexity"):
        assert part in header, f"{name}.lua header lacks {part}"


def test_read_only_scripts_are_flagged_no_writes(raw: redis.Redis) -> None:
    registry = ScriptRegistry()
    for name in ("lookup", "score", "request_key"):
        assert registry[name].source.startswith(b"#!lua flags=no-writes")
    # The server enforces the flag: a write inside a no-writes script fails.
    with pytest.raises(redis.ResponseError, match="Write commands are not allowed"):
        raw.eval("#!lua flags=no-writes\nreturn redis.call('SET', 'x', 1)", 0)


def test_includes_are_expanded_and_shas_are_computed_locally(raw: redis.Redis) -> None:
    sources = lua_sources()
    registry = ScriptRegistry()
    for name in registry.names():
        script = registry[name]
        assert not re.search(rb"(?m)^--@include", script.source)
        assert script.sha == hashlib.sha1(script.source).hexdigest()
        assert raw.script_load(script.source) == script.sha  # the server agrees
    assert "local function run_ops" in expand("add", sources)
    with pytest.raises(Exception, match="not found"):
        expand("no_such_script", sources)
    with pytest.raises(Exception, match="cycle"):
        expand("a", {"a": "--@include b\n", "b": "--@include a\n"})


def test_first_call_is_evalsha_and_loads_on_noscript(raw: redis.Redis) -> None:
    registry = ScriptRegistry()
    raw.script_flush()
    assert registry.call(raw, ScriptCall("ping", (), ())) == 1
    assert raw.script_exists(registry["ping"].sha) == [True]
    assert registry.call(raw, ScriptCall("ping", (), ())) == 1


def test_noscript_inside_a_pipeline_recovers(raw: redis.Redis) -> None:
    registry = ScriptRegistry()
    raw.script_flush()
    items = [
        ScriptCall("ping", (), ()),
        ("SET", "plain", "v"),
        ScriptCall("namespace", (b"pipe:meta",), ("kvredis-kvblock/1", 16, "g1")),
        ("GET", "plain"),
        ScriptCall("ping", (), ()),
    ]
    replies = registry.execute(raw, items)
    assert replies[0] == 1 and replies[4] == 1
    assert replies[1] is True and replies[3] == b"v"
    assert replies[2] == [b"kvredis-kvblock/1", b"16", b"g1"]
    # Each command ran exactly once: the namespace record was created by the retried call.
    assert raw.hgetall("pipe:meta") == {
        b"layout": b"kvredis-kvblock/1",
        b"bucket_bits": b"16",
        b"gen": b"g1",
    }


async def test_noscript_inside_an_async_pipeline_recovers(
    own_redis_server: RedisServer,
) -> None:
    client = redis.asyncio.Redis(port=own_redis_server.port)
    try:
        registry = ScriptRegistry()
        await client.script_flush()
        replies = await registry.aexecute(
            client, [ScriptCall("ping", (), ()), ("ECHO", "x"), ScriptCall("ping", (), ())]
        )
        assert replies == [1, b"x", 1]
        await client.script_flush()
        assert await registry.acall(client, ScriptCall("ping", (), ())) == 1
    finally:
        await client.aclose()


def test_index_survives_script_flush(own_redis_server: RedisServer, raw: redis.Redis) -> None:
    with RedisIndex(RedisIndexConfig(address=own_redis_server.url, namespace=_ns())) as idx:
        idx.add([1], [10], [A])
        raw.script_flush()
        assert idx.lookup([10]) == {10: [A]}
        raw.script_flush()
        idx.add([2], [20], [B])
        raw.script_flush()
        assert idx.score([10]) == {"pod-a": 1.0}
        raw.script_flush()
        idx.clear("pod-a")  # paged: its script calls travel in pipelines
        assert idx.lookup([10]) == {}
        assert idx.get_request_key(2) == 20


def test_same_client_works_after_a_server_restart(own_redis_server: RedisServer) -> None:
    cfg = RedisIndexConfig(address=own_redis_server.url, namespace=_ns(), retries=5)
    with RedisIndex(cfg) as idx:
        idx.add([1], [10], [A])
        assert idx.lookup([10]) == {10: [A]}
        own_redis_server.restart()  # no persistence: scripts and data are gone
        assert idx.lookup([10]) == {}
        idx.add([2], [20], [B])
        assert idx.lookup([20]) == {20: [B]}
        idx.evict(2, KeyType.ENGINE, [B])
        assert idx.lookup([20]) == {}


async def test_async_client_works_after_a_server_restart(own_redis_server: RedisServer) -> None:
    cfg = RedisIndexConfig(address=own_redis_server.url, namespace=_ns(), retries=5)
    async with AsyncRedisIndex(cfg) as idx:
        await idx.add([1], [10], [A])
        own_redis_server.restart()
        assert await idx.lookup([10]) == {}
        await idx.add(None, [20], [B])
        assert await idx.lookup([20]) == {20: [B]}

"""The Lua scripts and their registry: sources, includes, headers, the error-code table, EVALSHA,
and recovery from flushes and restarts."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvredis import (
    AsyncRedisIndex,
    EngineKeyNotFoundError,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.errors import LUA_ERROR_CODES
from kvredis.redis.executor import AsyncExecutor, SyncExecutor
from kvredis.redis.requests import Command, Pipeline, ScriptCall
from kvredis.redis.scripts import ScriptRegistry, expand, lua_sources
from kvredis.redis.session import RetryPolicy, Session, op_send
from kvredis.redis.state import CoreState
from tests.servers import RedisServer

LUA_DIR = Path(__file__).resolve().parents[2] / "lua"
INCLUDES = LUA_DIR / "includes"
A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
COMMANDS = {
    "add",
    "apply_batch",
    "apply_batches",
    "clear",
    "clear_mappings",
    "clear_runs",
    "drop",
    "reclaim",
    "retire",
    "unmap",
    "lookup_shards",
    "apply_shards",
    "score_shards",
    "lookup_union",
    "apply_parts",
    "move_pairs",
    "move_mappings",
    "evict",
    "lookup",
    "migrate",
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


def _session() -> Session:
    return Session(CoreState(_ns()), ScriptRegistry(), RetryPolicy(0, 0.0, "the test server"))


def test_every_command_file_is_registered_and_libraries_are_not() -> None:
    registry = ScriptRegistry()
    assert set(registry.names()) == COMMANDS
    assert {p.stem for p in LUA_DIR.glob("*.lua")} == COMMANDS
    includes = {p.stem for p in INCLUDES.glob("*.lua")}
    assert "program" in includes and not includes & set(registry.names())
    assert set(lua_sources()) == COMMANDS | {f"includes/{name}" for name in includes}


@pytest.mark.parametrize("path", sorted(INCLUDES.glob("*.lua")), ids=lambda p: p.stem)
def test_includes_take_every_input_as_a_parameter(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"\b(ARGV|KEYS)\b", text.split("]]", 1)[1]), f"{path.name} reads ARGV/KEYS"
    assert text.startswith(f"--[[ {path.stem}: ")


def _raised_codes() -> dict[str, set[str]]:
    """Every error code a Lua file can raise, with the files raising it."""
    raised: dict[str, set[str]] = {}
    for path in sorted(LUA_DIR.rglob("*.lua")):
        text = path.read_text()
        codes = re.findall(r"fail\(\s*'([A-Z_]+)'", text) + re.findall(r"KVREDIS_([A-Z_]+)", text)
        for code in codes:
            raised.setdefault(code, set()).add(path.name)
    return raised


def test_every_raised_error_code_is_mapped_and_every_mapped_code_is_raised() -> None:
    raised = _raised_codes()
    unmapped = {code: files for code, files in raised.items() if code not in LUA_ERROR_CODES}
    assert not unmapped, f"codes raised in lua/ but missing from LUA_ERROR_CODES: {unmapped}"
    assert set(LUA_ERROR_CODES) <= set(raised), "LUA_ERROR_CODES maps codes no script raises"
    # the scan sees what it must: fail() calls in includes and inline codes in commands
    assert "errors.lua" in raised["STALE"] and "lookup.lua" in raised["STALE"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_file_opens_with_a_true_header(name: str) -> None:
    text = (LUA_DIR / f"{name}.lua").read_text()
    body = text.split("\n", 1)[1] if text.startswith("#!lua") else text
    match = re.match(r"--\[\[ (\w+): .+?\]\]", body, re.DOTALL)
    assert match, f"{name}.lua has no header block"
    assert match.group(1) == name
    header = match.group(0)
    for part in ("KEYS", "ARGV", "Returns", "Errors", "Complexity"):
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
    assert expand("add", sources).count("local function run_program") == 1
    with pytest.raises(Exception, match="not found"):
        expand("no_such_script", sources)


def test_each_include_is_pasted_once_before_its_first_use() -> None:
    sources = {
        "cmd": "-- cmd\n--@include b\n--@include a\n--@include b\nbody\n",
        "includes/a": "--@include c\nA\n",
        "includes/b": "--@include a\n--@include c\nB\n",
        "includes/c": "C\n",
    }
    lines = [line for line in expand("cmd", sources).splitlines() if line]
    assert lines == ["-- cmd", "C", "A", "B", "body"]
    cyclic = {"cmd": "--@include x\n", "includes/x": "--@include y\n"}
    cyclic["includes/y"] = "--@include x\n"
    with pytest.raises(Exception, match="cycle: cmd -> x -> y -> x"):
        expand("cmd", cyclic)
    with pytest.raises(Exception, match=r"'nope' \(of cmd\) not found"):
        expand("cmd", {"cmd": "--@include nope\n"})


def test_a_command_pasted_by_another_is_a_function_of_its_body_after_its_includes() -> None:
    sources = {
        "cmd": "#!lua flags=no-writes\n-- cmd\n--@include a\nreturn KEYS[1] .. ARGV[1]\n",
        "outer": "-- outer\n--@include b\n--@command cmd\nreturn command_cmd({'k'}, {'v'})\n",
        "includes/a": "--@include c\nA\n",
        "includes/b": "--@include c\nB\n",
        "includes/c": "C\n",
    }
    lines = [line for line in expand("outer", sources).splitlines() if line]
    assert lines == [
        "-- outer",
        "C",
        "B",
        "A",  # c already pasted: once only
        "local function command_cmd(KEYS, ARGV)",
        "-- cmd",
        "return KEYS[1] .. ARGV[1]",
        "end",
        "return command_cmd({'k'}, {'v'})",
    ]
    nested = {**sources, "twice": "--@command outer\n"}
    with pytest.raises(Exception, match="pastes a command itself"):
        expand("twice", nested)
    with pytest.raises(Exception, match="only a command pastes a command"):
        expand("x", {**sources, "x": "--@include d\n", "includes/d": "--@command cmd\n"})


def test_score_shards_runs_score_unchanged(raw: redis.Redis) -> None:
    """The body of score.lua, as pasted into score_shards, is score.lua's own text."""
    registry = ScriptRegistry()
    score = registry["score"].source.decode()
    body = score.split("check_gen(KEYS[1], ARGV[1])", 1)[1]
    pasted = registry["score_shards"].source.decode()
    assert "local function command_score(KEYS, ARGV)\n" in pasted
    assert "check_gen(KEYS[1], ARGV[1])" + body.split("\nreturn out\n", 1)[0] in pasted
    assert raw.script_load(registry["score_shards"].source) == registry["score_shards"].sha


@pytest.fixture
def executor(own_redis_server: RedisServer) -> Iterator[SyncExecutor]:
    runner = SyncExecutor(RedisIndexConfig(address=own_redis_server.url))
    try:
        yield runner
    finally:
        runner.close()


def test_first_call_is_evalsha_and_loads_on_noscript(
    raw: redis.Redis, executor: SyncExecutor
) -> None:
    session = _session()
    registry = session.registry
    raw.script_flush()
    assert executor.run(op_send(session, ScriptCall("ping", (), ()))) == 1
    assert raw.script_exists(registry["ping"].sha) == [True]
    assert executor.run(op_send(session, ScriptCall("ping", (), ()))) == 1


def test_noscript_inside_a_pipeline_recovers(raw: redis.Redis, executor: SyncExecutor) -> None:
    session = _session()
    raw.script_flush()
    items = (
        ScriptCall("ping", (), ()),
        Command(("SET", "plain", "v")),
        ScriptCall("namespace", (b"pipe:meta", b"pipe:pi"), ("kvredis-kvblock/1", 16, "g1")),
        Command(("GET", "plain")),
        ScriptCall("ping", (), ()),
    )
    replies = executor.run(op_send(session, Pipeline(items)))
    assert replies[0] == 1 and replies[4] == 1
    assert replies[1] is True and replies[3] == b"v"
    assert replies[2] == [b"kvredis-kvblock/1", b"16", b"g1"]
    # Each command ran exactly once: the namespace record was created by the retried call.
    assert raw.hgetall("pipe:meta") == {
        b"layout": b"kvredis-kvblock/1",
        b"bucket_bits": b"16",
        b"gen": b"g1",
        b"expiry": b"key",
    }


async def test_noscript_inside_an_async_pipeline_recovers(
    own_redis_server: RedisServer,
) -> None:
    executor = AsyncExecutor(RedisIndexConfig(address=own_redis_server.url))
    client = executor.client
    try:
        session = _session()
        await client.script_flush()
        items = (ScriptCall("ping", (), ()), Command(("ECHO", "x")), ScriptCall("ping", (), ()))
        replies = await executor.run(op_send(session, Pipeline(items)))
        assert replies == [1, b"x", 1]
        await client.script_flush()
        assert await executor.run(op_send(session, ScriptCall("ping", (), ()))) == 1
    finally:
        await executor.close()


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


def test_unmap_drops_a_mapping_only_while_it_reads_as_given(
    redis_server_url: str, namespace: str
) -> None:
    engine, first, second = 0x1111, 0x2222, 0x3333
    cfg = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    with RedisIndex(cfg) as index, redis.Redis.from_url(redis_server_url) as client:
        index.add([engine], [first], [PodEntry("pod-a", "gpu")])
        layout = index._session.state.layout
        source = ScriptRegistry()["unmap"].source

        def unmap(expected: bytes) -> int:
            args = (layout.gen, layout.eprefix, layout.bucket_bits, engine.to_bytes(8, "big"))
            return int(client.eval(source, 1, layout.meta, *args, expected))

        assert unmap(second.to_bytes(8, "big")) == 0  # changed since it was read: kept
        assert index.get_request_key(engine) == first
        assert unmap(first.to_bytes(8, "big")) == 1
        with pytest.raises(EngineKeyNotFoundError):
            index.get_request_key(engine)
        with pytest.raises(redis.ResponseError, match="KVREDIS_INVALID"):
            unmap(b"short")
        with pytest.raises(redis.ResponseError, match="KVREDIS_STALE"):
            client.eval(source, 1, layout.meta, b"old-gen", layout.eprefix, 16)

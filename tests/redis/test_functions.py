"""The ``kvredis`` Redis Functions library: how it is built, that every function answers what
its EVALSHA script answers, and how clients load, reload and fall back."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    AsyncRedisIndex,
    EvictOp,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.errors import BackendError, ConfigError, InvalidInputError
from kvredis.redis import requests as rq
from kvredis.redis.executor import failure
from kvredis.redis.functions import (
    API_VERSION,
    LIBRARY,
    VERSION_FUNCTION,
    FunctionRegistry,
    Plan,
    api_argument,
    build_library,
    function_name,
    plan,
    shipped_library,
)
from kvredis.redis.layout import LAYOUT_VERSION
from kvredis.redis.scripts import Missing, ScriptRegistry, lua_sources, missing_callee
from kvredis.redis.session import RetryPolicy, Session, op_drive, op_send
from kvredis.redis.state import CoreState
from tests.servers import RedisServer

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
SPEC = PodEntry("pod-c", "gpu", speculative=True)


def _ns() -> str:
    return f"kvt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def raw(own_redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=own_redis_server.port)
    yield client
    client.close()


# -- the library -------------------------------------------------------------------------------


def test_every_script_is_a_function_with_its_flags() -> None:
    library = shipped_library()
    scripts = ScriptRegistry()
    assert sorted(library.reads) == scripts.names()
    code = library.code.decode()
    for name in scripts.names():
        flags = scripts[name].source.split(b"\n", 1)[0].partition(b"flags=")[2].decode().split(",")
        listed = ", ".join(f"'{f}'" for f in flags if f)
        assert f"function_name='{function_name(name)}',\n  flags={{{listed}}}," in code, name
        assert library.reads[name] == scripts[name].no_writes
    assert library.functions() == sorted(
        [*(function_name(n) for n in scripts.names()), VERSION_FUNCTION]
    )


def test_the_build_changes_with_any_source() -> None:
    sources = lua_sources()
    base = build_library(sources)
    assert build_library(sources).build == base.build  # deterministic
    for name in ("lookup", "includes/walk"):
        changed = dict(sources, **{name: sources[name] + "\n-- changed\n"})
        assert build_library(changed).build != base.build, name


def test_the_library_loads_and_reports_its_versions(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    library = shipped_library()
    assert raw.function_load(library.code.decode()) == LIBRARY.encode()
    reply = raw.fcall_ro(VERSION_FUNCTION, 0)
    release, build = library.version[3:]
    assert reply == [
        b"kvredis",
        API_VERSION,
        LAYOUT_VERSION.encode(),
        release.encode(),
        build.encode(),
    ]
    [listed] = raw.function_list(library=LIBRARY)
    got = dict(zip(listed[::2], listed[1::2], strict=True))
    assert got[b"library_name"] == LIBRARY.encode()
    functions = {}
    for entry in got[b"functions"]:
        fields = dict(zip(entry[::2], entry[1::2], strict=True))
        functions[fields[b"name"].decode()] = fields
    assert sorted(functions) == library.functions()
    version = functions[VERSION_FUNCTION]
    assert f"layout {LAYOUT_VERSION}".encode() in version[b"description"]
    assert f"build {library.build}".encode() in version[b"description"]
    for name, read in library.reads.items():
        assert (b"no-writes" in functions[function_name(name)][b"flags"]) == read, name


# -- every function answers what its script answers ---------------------------------------------


class Tee:
    """An executor that sends every script call twice: by EVALSHA to db 0 and as its function
    (FCALL / FCALL_RO) to db 1, checks that both replies (or error replies) are the same, and
    resumes the operation with the first. Plain commands go to both databases."""

    def __init__(self, port: int) -> None:
        self.scripts = redis.Redis(port=port, db=0)
        self.functions = redis.Redis(port=port, db=1)
        registry = FunctionRegistry()
        registry.active = True
        self.registry = registry
        self.by_sha = {registry[n].sha: n for n in registry.names()}
        self.compared: dict[str, int] = {}

    def close(self) -> None:
        self.scripts.close()
        self.functions.close()

    def _send(self, client: redis.Redis, args: tuple[Any, ...]) -> Any:
        try:
            return client.execute_command(*args)
        except redis.ResponseError as exc:
            return failure(exc)

    def _one(self, command: rq.Command) -> Any:
        args = command.args
        if args[0] == "EVALSHA":
            name, n = self.by_sha[str(args[1])], int(args[2])
            call = rq.ScriptCall(name, args[3 : 3 + n], args[3 + n :])
            first = self._send(self.scripts, args)
            if isinstance(first, rq.ErrorReply) and first.code == "NOSCRIPT":
                return first  # loaded, then sent again
            second = self._send(self.functions, self.registry.call_command(call).args)
            assert _same(first) == _same(second), (name, first, second)
            self.compared[name] = self.compared.get(name, 0) + 1
            return first
        if args[:2] == ("SCRIPT", "LOAD"):
            return self._send(self.scripts, args)
        first = self._send(self.scripts, args)
        self._send(self.functions, args)
        return first

    def run(self, op: rq.Op[Any]) -> Any:
        try:
            request = next(op)
            while True:
                if isinstance(request, rq.Sleep):
                    reply: Any = None
                elif isinstance(request, rq.Pipeline):
                    reply = [self._one(item) for item in request.items]  # type: ignore[arg-type]
                else:
                    assert isinstance(request, rq.Command), request
                    reply = self._one(request)
                request = op.throw(reply) if isinstance(reply, rq.Failure) else op.send(reply)
        except StopIteration as stop:
            return stop.value


def _same(reply: Any) -> Any:
    """A reply as compared: error replies by their text without the script/function trailer."""
    if isinstance(reply, rq.Failure):
        return ("error", reply.message.split(" script: ", 1)[0])
    return reply


def _dump(client: redis.Redis) -> dict[bytes, Any]:
    return {key: (client.dump(key), client.pttl(key) > 0) for key in client.scan_iter(count=1000)}


def test_every_function_replies_as_its_script(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    ns = _ns()
    raw.function_load(shipped_library().code.decode())
    config = RedisIndexConfig(address=own_redis_server.url, namespace=ns, use_functions=False)
    tee = Tee(own_redis_server.port)
    index = RedisIndex(config)
    try:
        for key in raw.scan_iter():  # the namespace record, in db 1 too
            raw.copy(key, key, destination_db=1)
        index._exec = tee  # type: ignore[assignment]
        chain = list(range(1000, 1600))
        engine = [k + 10**6 for k in chain]
        index.add(engine, chain, [A, B])
        index.add(None, chain[:40], [SPEC])
        index.add(engine[:3], chain[:3], [PodEntry("pod-d", "cpu", True, True, 7)])
        assert index.lookup(chain)[chain[0]]
        assert index.lookup([10**9]) == {}  # a miss at the first key
        assert index.lookup(chain, {"pod-b"})
        assert index.score(chain, {"gpu": 1.0, "cpu": 0.5})
        index.evict(chain[5], KeyType.REQUEST, [A])
        index.evict(engine[7], KeyType.ENGINE, [B])
        assert index.get_request_key(engine[9]) == chain[9]
        batch = [AddOp(None, (5, 6), (A,)), EvictOp(5, KeyType.REQUEST, (A,))] * 5
        index.apply_batch(batch, "stream-1", Watermark(1, 1))
        index.apply_batch(batch, "stream-1", Watermark(1, 1))  # fenced off
        index.clear("pod-a")
        assert _dump(tee.scripts) == _dump(tee.functions)
        with pytest.raises(InvalidInputError):  # an error reply, the same both ways
            index._exec.run(
                op_send(index._session, rq.ScriptCall("namespace", (b"m", b"p"), ("", "x", "")))
            )
        index.drop_namespace()
        assert _dump(tee.scripts) == _dump(tee.functions) == {}
        ran = set(tee.compared)
        assert {
            "add",
            "apply_batch",
            "clear",
            "clear_mappings",
            "clear_runs",
            "drop",
            "evict",
            "lookup",
            "namespace",
            "reclaim",
            "request_key",
            "score",
        } <= ran, ran
    finally:
        tee.close()


# -- clients ------------------------------------------------------------------------------------


def _calls(raw: redis.Redis) -> dict[str, int]:
    stats = raw.info("commandstats")
    return {
        name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
        for name in ("evalsha", "fcall", "fcall_ro", "function|load")
    }


def test_a_client_loads_the_library_and_calls_functions(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    config = RedisIndexConfig(address=own_redis_server.url, namespace=_ns())
    with RedisIndex(config) as index:
        assert index.registry.active
        index.add(None, [1, 2, 3], [A])
        assert index.score([1, 2, 3]) == {"pod-a": 3.0}
        calls = _calls(raw)
        assert calls["evalsha"] == 0 and calls["function|load"] == 1
        assert calls["fcall"] >= 1 and calls["fcall_ro"] >= 2
        with RedisIndex(config) as other:  # the library is there: no second load
            assert other.lookup([1]) == {1: [A]}
        assert _calls(raw)["function|load"] == 1
        index.drop_namespace()


def test_use_functions_false_keeps_to_evalsha(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    config = RedisIndexConfig(address=own_redis_server.url, namespace=_ns(), use_functions=False)
    with RedisIndex(config) as index:
        index.add(None, [1, 2, 3], [A])
        assert index.lookup([1, 2, 3])
        assert not index.registry.active
        index.drop_namespace()
    calls = _calls(raw)
    assert calls["fcall"] == calls["fcall_ro"] == calls["function|load"] == 0
    assert raw.function_list() == []


def test_use_functions_is_checked() -> None:
    with pytest.raises(ConfigError, match="use_functions"):
        RedisIndexConfig(use_functions="yes")  # type: ignore[arg-type]
    assert RedisIndexConfig.from_dict({"useFunctions": False}).use_functions is False
    assert RedisIndexConfig.from_dict({"useFunctions": "auto"}).use_functions == "auto"


def test_the_library_is_reloaded_after_a_flush(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    config = RedisIndexConfig(address=own_redis_server.url, namespace=_ns())
    with RedisIndex(config) as index:
        index.add(None, [1, 2], [A])
        raw.function_flush()
        assert index.lookup([1, 2]) == {1: [A], 2: [A]}  # a read reloads it
        raw.function_flush()
        index.add(None, [3], [B])  # a write too
        raw.function_flush()
        batch = [AddOp(None, (7,), (A,)), EvictOp(1, KeyType.REQUEST, (A,))]
        assert index.apply_batch(batch, "s", Watermark(1, 1))
        assert _calls(raw)["function|load"] == 4 and _calls(raw)["evalsha"] == 0
        index.drop_namespace()


def test_the_async_client_loads_and_reloads(own_redis_server: RedisServer) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis(port=own_redis_server.port)
        config = RedisIndexConfig(address=own_redis_server.url, namespace=_ns())
        index = await AsyncRedisIndex.create(config)
        try:
            await index.add(None, [1, 2], [A])
            await client.function_flush()
            assert await index.score([1, 2]) == {"pod-a": 2.0}
            stats = await client.info("commandstats")
            assert stats["cmdstat_function|load"]["calls"] == 2
            assert "cmdstat_evalsha" not in stats
            await index.drop_namespace()
        finally:
            await index.aclose()
            await client.aclose()

    asyncio.run(main())


def _other_library(release: str, api: int = API_VERSION) -> str:
    """The shipped library as another release (or api) would ship it."""
    library = shipped_library()
    code = library.code.decode()
    code = code.replace(f"release {library.version[3]}", f"release {release}")
    code = code.replace(f"'{library.version[3]}', '{library.build}'", f"'{release}', 'other'")
    return re.sub(r"\{'kvredis', \d+,", f"{{'kvredis', {api},", code)


def test_an_older_library_is_replaced_and_a_newer_one_used(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    raw.function_load(_other_library("0.0.1"))
    config = RedisIndexConfig(address=own_redis_server.url, namespace=_ns())
    with RedisIndex(config) as index:
        assert index.registry.active
    assert raw.fcall_ro(VERSION_FUNCTION, 0)[4] == shipped_library().build.encode()
    raw.function_load(_other_library("999.0"), replace=True)
    with RedisIndex(config) as index:  # a newer release of the same api: used as it is
        assert index.registry.active
        index.add(None, [1], [A])
        index.drop_namespace()
    assert raw.fcall_ro(VERSION_FUNCTION, 0)[3] == b"999.0"


def test_a_library_of_a_newer_api_means_evalsha(
    own_redis_server: RedisServer, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    raw.function_load(_other_library("999.0", API_VERSION + 1))
    config = RedisIndexConfig(address=own_redis_server.url, namespace=_ns())
    with caplog.at_level(logging.WARNING), RedisIndex(config) as index:
        assert not index.registry.active
        index.add(None, [1], [A])
        assert index.lookup([1]) == {1: [A]}
        index.drop_namespace()
    assert raw.fcall_ro(VERSION_FUNCTION, 0)[1] == API_VERSION + 1  # left alone
    assert [r.message for r in caplog.records].count(
        next(r.message for r in caplog.records if "EVALSHA" in r.message)
    ) == 1
    with pytest.raises(BackendError, match="use_functions is true"):
        RedisIndex(RedisIndexConfig(address=own_redis_server.url, use_functions=True))


def test_a_user_without_function_falls_back_to_evalsha_with_one_log_line(
    own_redis_server: RedisServer, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    ns = _ns()
    raw.acl_setuser(
        "scripts", enabled=True, passwords=["+pw"], keys=[f"{ns}:*"],
        commands=["+@all", "-function", "-fcall", "-fcall_ro"],
    )  # fmt: skip
    config = RedisIndexConfig(
        address=own_redis_server.url, namespace=ns, username="scripts", password="pw"
    )
    with caplog.at_level(logging.INFO, logger="kvredis"), RedisIndex(config) as index:
        index.add(None, [1, 2], [A])
        assert index.lookup([1, 2]) == {1: [A], 2: [A]}
        assert index.score([1, 2]) == {"pod-a": 2.0}
        assert not index.registry.active
        index.drop_namespace()
    lines = [r.getMessage() for r in caplog.records if "EVALSHA" in r.getMessage()]
    assert len(lines) == 1 and LIBRARY in lines[0], lines
    assert _calls(raw)["fcall"] == 0


def test_a_refused_fcall_after_connecting_falls_back(
    own_redis_server: RedisServer, raw: redis.Redis
) -> None:
    ns = _ns()
    raw.acl_setuser(
        "shifting", enabled=True, passwords=["+pw"], keys=[f"{ns}:*"], commands=["+@all"]
    )
    config = RedisIndexConfig(
        address=own_redis_server.url, namespace=ns, username="shifting", password="pw"
    )
    with RedisIndex(config) as index:
        assert index.registry.active
        index.add(None, [1], [A])
        raw.acl_setuser("shifting", commands=["-fcall", "-fcall_ro", "-function"])
        index.add(None, [2], [A])
        assert index.lookup([1, 2]) == {1: [A], 2: [A]}
        assert not index.registry.active
        index.drop_namespace()


# -- the decision, server-free -----------------------------------------------------------------


def test_plan_of_each_version_reply() -> None:
    library = shipped_library()
    ours = list(library.version)
    assert plan(None, library) is Plan.LOAD
    assert plan(ours, library) is Plan.USE
    assert plan([*ours[:3], ours[3], "other"], library) is Plan.LOAD  # same release, other code
    assert plan([*ours[:3], "0.0.1", "other"], library) is Plan.LOAD
    assert plan([*ours[:3], "999.0", "other"], library) is Plan.USE
    assert plan([ours[0], API_VERSION - 1, *ours[2:4], "x"], library) is Plan.LOAD
    assert plan([ours[0], API_VERSION + 1, *ours[2:4], "x"], library) is Plan.SCRIPTS
    with pytest.raises(BackendError):
        plan([b"kvredis"], library)


def test_calls_by_function_name_once_active() -> None:
    registry = FunctionRegistry()
    call = rq.ScriptCall("lookup", (b"k",), ("a",), read=True)
    assert registry.call_command(call).args[0] == "EVALSHA"
    registry.active = True
    marker = api_argument()
    assert registry.call_command(call) == rq.Command(
        ("FCALL_RO", "kvredis_lookup", 1, b"k", "a", marker), True
    )
    write = rq.ScriptCall("add", (b"k",), ("a",))
    assert registry.call_command(write).args[:2] == ("FCALL", "kvredis_add")
    assert registry.load_command("add").args[:3] == ("FUNCTION", "LOAD", "REPLACE")
    assert not registry.load_command("lookup", read=True).read  # loads go to the primary
    assert registry.missing(rq.ErrorReply("ERR Function not found"))
    assert registry.missing(rq.ErrorReply("NOSCRIPT No matching script"))
    assert not registry.missing(rq.ErrorReply("KVREDIS_STALE namespace layout changed"))
    assert not registry.missing("NOSCRIPT No matching script")  # a reply, not an error reply


def test_a_script_cannot_take_the_version_function_name() -> None:
    with pytest.raises(BackendError, match="clash"):
        build_library({**lua_sources(), "version": "return 1\n"})


# -- the core's choices, driven with scripted replies (no server) -------------------------------


def _functions_session() -> Session:
    return Session(CoreState(_ns()), FunctionRegistry(), RetryPolicy(0, 0.0, "the test server"))


def _drive(op: rq.Op[Any], replies: list[Any]) -> tuple[Any, list[rq.Request]]:
    """Run ``op``, answering its requests in turn (a Failure is thrown into it)."""
    sent: list[rq.Request] = []
    outcome: Any = None
    answers = iter(replies)
    while True:
        try:
            failed = isinstance(outcome, rq.Failure)
            request = op.throw(outcome) if failed else op.send(outcome)
        except StopIteration as stop:
            assert next(answers, None) is None, "replies left over"
            return stop.value, sent
        sent.append(request)
        outcome = next(answers)


NOT_FOUND = rq.ErrorReply("Function not found")
NO_FCALL = rq.ErrorReply("NOPERM User r has no permissions to run the 'fcall_ro' command")


def test_connecting_loads_a_missing_library() -> None:
    session = _functions_session()
    registry = session.registry
    _, sent = _drive(op_drive(session, registry.op_choose()), [NOT_FOUND, b"kvredis"])
    assert [r.args[:2] for r in sent if isinstance(r, rq.Command)] == [
        ("FCALL_RO", VERSION_FUNCTION),
        ("FUNCTION", "LOAD"),
    ]
    assert registry.active


def test_connecting_without_fcall_keeps_to_evalsha(caplog: pytest.LogCaptureFixture) -> None:
    session = _functions_session()
    with caplog.at_level(logging.WARNING):
        _drive(op_drive(session, session.registry.op_choose()), [NO_FCALL])
    assert not session.registry.active
    assert len([r for r in caplog.records if "EVALSHA" in r.getMessage()]) == 1


def _active_session() -> Session:
    session = _functions_session()
    session.registry.active = True
    return session


def test_what_a_server_lacks_is_read_from_its_reply() -> None:
    """One reading of "the server lacks what was called", for the session and the cluster's
    waves alike: by the reply's code (NOSCRIPT, KVREDIS_VERSION) or text (function not found),
    never by anything but an error reply."""
    assert missing_callee(rq.ErrorReply("NOSCRIPT No matching script.")) is Missing.SCRIPT
    assert missing_callee(rq.ErrorReply("ERR Function not found")) is Missing.FUNCTION
    other_api = rq.ErrorReply("KVREDIS_VERSION the call speaks kvredis-api:1, the library ...")
    assert missing_callee(other_api) is Missing.VERSION
    assert missing_callee(rq.ErrorReply("ERR unknown command 'FCALL'")) is None
    assert missing_callee(b"NOSCRIPT No matching script.") is None  # a reply, not an error
    assert missing_callee(b"KVREDIS_VERSION the call speaks ...") is None
    scripts, functions = ScriptRegistry(), FunctionRegistry()
    function_missing = rq.ErrorReply("ERR Function not found")
    for reply in (function_missing, other_api):
        assert not scripts.missing(reply) and not functions.missing(reply)
    functions.active = True  # a missing function only matters while calls go by FCALL
    assert functions.missing(function_missing) and functions.missing(other_api)
    assert not scripts.missing(other_api)


def test_connecting_reads_the_error_reply_not_the_exception_message() -> None:
    """A reply that reached the library check typed (as a :mod:`kvredis.errors` exception) is
    read as the reply it was made of: the check decides by the reply, whatever the exception
    says."""
    registry = FunctionRegistry()
    op = registry.op_choose()
    assert next(op).args[:2] == ("FCALL_RO", VERSION_FUNCTION)
    typed = BackendError("the version function cannot be called")
    typed.__cause__ = rq.ErrorReply("ERR Function not found")
    load = op.throw(typed).args  # missing: load it, without REPLACE (a racing load stays)
    assert load == ("FUNCTION", "LOAD", registry.library.code)
    raced = BackendError("the library cannot be loaded")
    raced.__cause__ = rq.ErrorReply("ERR Library 'kvredis' already exists")
    assert op.throw(raced).args[:2] == ("FCALL_RO", VERSION_FUNCTION)  # loaded meanwhile: ask
    assert op.throw(typed).args == load
    with pytest.raises(StopIteration):
        op.send(b"kvredis")
    assert registry.active


def test_an_error_reply_raised_typed_carries_the_reply() -> None:
    session = _functions_session()
    reply = rq.ErrorReply("ERR Function not found")
    with pytest.raises(BackendError) as raised:
        _drive(op_send(session, rq.Command(("FCALL_RO", VERSION_FUNCTION, 0))), [reply])
    assert rq.error_reply(raised.value) is reply


def test_a_missing_function_reloads_the_library_and_calls_again() -> None:
    session = _active_session()
    call = rq.ScriptCall("ping", (), (), read=True)
    replies = [NOT_FOUND, NOT_FOUND, None, b"kvredis", [b"l", b"16", b"g"], 1]
    result, sent = _drive(op_send(session, call), replies)
    assert result == 1
    assert [r.args[:2] for r in sent if isinstance(r, rq.Command)] == [
        ("FCALL_RO", "kvredis_ping"),
        ("FCALL_RO", VERSION_FUNCTION),  # what the server holds now: nothing
        ("HGET", f"{session.state.namespace}:meta".encode()),  # no newer api recorded
        ("FUNCTION", "LOAD"),  # never REPLACE: a library loaded meanwhile stays
        ("FCALL", "kvredis_namespace"),  # the api recorded
        ("FCALL_RO", "kvredis_ping"),
    ]
    assert sent[3].args[2] == shipped_library().code
    assert not sent[3].read  # the library goes to the primary


def test_a_refused_fcall_that_evalsha_serves_switches_for_good() -> None:
    session = _active_session()
    call = rq.ScriptCall("ping", (), ())
    refused = rq.ErrorReply("NOPERM User u has no permissions to run the 'fcall_ro' command")
    result, sent = _drive(op_send(session, call), [refused, 1])
    assert result == 1 and [r.args[0] for r in sent if isinstance(r, rq.Command)] == [
        "FCALL_RO",
        "EVALSHA",
    ]
    assert not session.registry.active


def test_a_refusal_evalsha_cannot_serve_either_keeps_the_function_path() -> None:
    session = _active_session()
    call = rq.ScriptCall("ping", (), ())
    no_evalsha = rq.ErrorReply("NOPERM User u has no permissions to run the 'evalsha' command")
    with pytest.raises(BackendError, match=r"function\|load"):
        _drive(
            op_send(session, call),
            [
                NOT_FOUND,
                NOT_FOUND,
                None,
                rq.ErrorReply(
                    "NOPERM User u has no permissions to run the 'function|load' command"
                ),
                no_evalsha,
            ],
        )
    assert session.registry.active  # it waits for the library to be loaded again


def test_a_pipeline_reloads_once_for_all_its_missing_functions() -> None:
    session = _active_session()
    calls = (rq.ScriptCall("ping", (), ()), rq.ScriptCall("ping", (b"k",), ()))
    result, sent = _drive(
        op_send(session, rq.Pipeline(calls)),
        [[NOT_FOUND, NOT_FOUND], NOT_FOUND, None, b"kvredis", [b"l", b"16", b"g"], [1, 1]],
    )
    assert result == [1, 1]
    loads = [r for r in sent if isinstance(r, rq.Command) and r.args[0] == "FUNCTION"]
    assert len(loads) == 1

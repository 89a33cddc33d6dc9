"""The executors' one job besides sending: map redis-py exceptions to the requests vocabulary."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
from redis._parsers.base import BaseParser
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)

from kvredis import RedisIndexConfig
from kvredis.errors import (
    CallBudgetError,
    InvalidInputError,
    StaleNamespaceError,
    translate,
)
from kvredis.redis.executor import AsyncExecutor, SyncExecutor, failure, send_commands
from kvredis.redis.requests import (
    AuthenticationFailed,
    Command,
    ConnectionLost,
    ErrorReply,
    Failure,
    Op,
    Pipeline,
    ScriptCall,
)


def _reply_error(cls: type[ResponseError], text: str, status_code: str | None) -> ResponseError:
    """An exception as some redis-py version raises it (``status_code`` is set by attribute:
    the oldest supported versions take no such keyword)."""
    exc = cls(text)
    exc.status_code = status_code  # type: ignore[attr-defined]
    return exc


@pytest.mark.parametrize(
    ("exc", "kind", "message"),
    [
        # redis-py strips the code of the replies it has a class for; the failure restores it
        (_reply_error(NoScriptError, "x", "NOSCRIPT"), ErrorReply, "NOSCRIPT x"),
        (NoScriptError("x"), ErrorReply, "NOSCRIPT x"),
        (ReadOnlyError("x"), ErrorReply, "READONLY x"),
        (ResponseError("BUSY x"), ErrorReply, "BUSY x"),
        (ResponseError("KVREDIS_STALE x"), ErrorReply, "KVREDIS_STALE x"),
        (AuthenticationError("x"), AuthenticationFailed, "x"),
        (redis.ConnectionError("x"), ConnectionLost, "x"),
        (redis.TimeoutError("x"), ConnectionLost, "x"),
        (BusyLoadingError("x"), ConnectionLost, "x"),
        (OSError("x"), ConnectionLost, "x"),
    ],
)
def test_redis_py_exceptions_become_failures(
    exc: BaseException, kind: type[Failure], message: str
) -> None:
    got = failure(exc)
    assert type(got) is kind and got.message == message


#: Error replies as the server sends them, and what kvredis makes of each.
REPLIES = [
    ("KVREDIS_BUDGET 0 3 the keys reach chain runs of more than 3 ranges", CallBudgetError),
    ("KVREDIS_STALE namespace layout changed or was removed; reload it", StaleNamespaceError),
    ("KVREDIS_INVALID bad pod filter", InvalidInputError),
    ("NOSCRIPT No matching script. Please use EVAL.", None),
    ("BUSY Redis is busy running a script.", None),
    ("MOVED 3999 127.0.0.1:6381", None),
]


@pytest.mark.parametrize("status_code", [False, True], ids=["redis-py<8.2", "redis-py>=8.2"])
@pytest.mark.parametrize(("reply", "error"), REPLIES, ids=[r.split()[0] for r, _ in REPLIES])
def test_a_reply_keeps_its_code_once_whichever_way_redis_py_reports_it(
    reply: str, error: type[Exception] | None, status_code: bool
) -> None:
    """redis-py cuts the code off the replies it has a class for and keeps the others whole;
    redis-py 8.2 also sets ``status_code`` on those others. Either way the failure is the reply
    as sent, and a ``KVREDIS_BUDGET`` reply's sizes are read from it."""
    code, _, rest = reply.partition(" ")
    cls = BaseParser.EXCEPTION_CLASSES.get(code)
    if isinstance(cls, type):  # a class of its own: the message lost the code
        exc = _reply_error(cls, rest, code if status_code else None)
    else:
        exc = _reply_error(ResponseError, reply, code if status_code else None)
    got = failure(exc)
    assert isinstance(got, ErrorReply) and got.message == reply and got.code == code
    _check_translated(got, error)


@pytest.mark.parametrize(("reply", "error"), REPLIES, ids=[r.split()[0] for r, _ in REPLIES])
def test_the_installed_redis_py_parser_and_the_failure_agree(
    reply: str, error: type[Exception] | None
) -> None:
    """The installed redis-py's own error parsing (the one the pure-Python and the hiredis
    parsers both call), then the executor's: the reply comes back as sent."""
    exc = BaseParser.parse_error(reply)
    got = failure(exc)
    assert isinstance(got, ErrorReply) and got.message == reply
    _check_translated(got, error)


def _check_translated(got: ErrorReply, error: type[Exception] | None) -> None:
    if error is None:
        return
    translated = translate(got.message)
    assert type(translated) is error
    if isinstance(translated, CallBudgetError):
        assert (translated.ops, translated.keys) == (0, 3)
        assert str(translated).startswith("the keys reach")


def test_an_executor_sends_no_unresolved_script_calls() -> None:
    executor = SyncExecutor(RedisIndexConfig(address="redis://127.0.0.1:1"))
    call = ScriptCall("ping", (), ())

    def op(request: object) -> Op[None]:
        yield request  # type: ignore[misc]

    try:
        for request in (call, Pipeline((call,))):
            with pytest.raises(TypeError, match="not ScriptCall"):
                executor.run(op(request))
    finally:
        executor.close()


# -- script calls packed in one C call ---------------------------------------------------------

PACKED_SOURCE = (
    "if ARGV[1] == 'fail' then return redis.error_reply('KVREDIS_TEST ' .. ARGV[2]) end "
    "return {ARGV[1], tonumber(ARGV[2]) + 1, {ARGV[3]}}"
)


def _plain(outcome: Any) -> Any:
    return (type(outcome), outcome.message) if isinstance(outcome, Failure) else outcome


def _one(request: object) -> Op[Any]:
    """One request; its failure (a Failure the executor throws in) is the result."""
    try:
        return (yield request)  # type: ignore[misc]
    except Failure as exc:
        return exc


@pytest.mark.redis
def test_script_calls_go_packed_and_answer_as_redis_py_does(redis_server_url: str) -> None:
    """EVALSHA/FCALL go out packed by hiredis on a pooled connection: the same reply and error
    reply as redis-py's ``execute_command``, arguments hiredis does not take (a memoryview)
    through redis-py, and every connection back in the pool, usable."""
    executor = SyncExecutor(RedisIndexConfig(address=redis_server_url))
    plain = redis.Redis.from_url(redis_server_url)
    try:
        sha = plain.script_load(PACKED_SOURCE)
        through_redis_py: list[tuple[Any, ...]] = []
        execute = executor.client.execute_command

        def counted(*args: Any, **options: Any) -> Any:
            through_redis_py.append(args)
            return execute(*args, **options)

        executor.client.execute_command = counted  # type: ignore[method-assign]
        calls = [
            ("EVALSHA", sha, 0, "text", 41, b"\x00\xffbytes"),
            ("EVALSHA", sha, 0, "fail", 2**63, "é"),
            ("EVALSHA", sha, 0, memoryview(b"view"), 1.5, bytearray(b"array")),
        ]
        for args in calls * 3:
            try:
                want: Any = plain.execute_command(*args)
            except ResponseError as exc:
                want = failure(exc)
            except redis.DataError:  # redis-py before 5.1 packs no memoryview either
                with pytest.raises(redis.DataError):
                    executor.run(_one(Command(args)))
                continue
            assert _plain(executor.run(_one(Command(args)))) == _plain(want)
        assert isinstance(executor.run(_one(Command(calls[1]))), ErrorReply)
        assert through_redis_py == [calls[2]] * 3  # only the call hiredis cannot pack
        pool: Any = executor.pool  # every connection idle again: queued, or on the idle stack
        assert pool._connections
        assert [c for c in pool._connections if c not in pool.pool.queue + pool.idle] == []
        assert executor.run(_one(Command(("EVALSHA", sha, 0, "again", 1, "x")))) == [
            b"again",
            2,
            [b"x"],
        ]
    finally:
        executor.close()
        plain.close()


@pytest.mark.redis
def test_async_script_calls_go_packed_and_answer_as_redis_py_does(redis_server_url: str) -> None:
    """The same on the asyncio executor, and a call cancelled while it waits for its reply
    leaves no connection that would hand its reply to the next call."""
    plain = redis.Redis.from_url(redis_server_url)
    sha = plain.script_load(PACKED_SOURCE)
    slow = plain.script_load(
        "local n = 0 for i = 1, tonumber(ARGV[2]) do n = n + i end return ARGV[1]"
    )
    started = time.perf_counter()
    plain.evalsha(slow, 0, "calibrate", 1_000_000)
    spin = int(1_000_000 * 0.3 / max(time.perf_counter() - started, 1e-4))  # about 0.3 s
    calls = [
        ("EVALSHA", sha, 0, "text", 41, b"\x00\xffbytes"),
        ("EVALSHA", sha, 0, "fail", 2**63, "é"),
    ]

    async def run() -> None:
        executor = AsyncExecutor(RedisIndexConfig(address=redis_server_url))
        through_redis_py: list[tuple[Any, ...]] = []
        execute = executor.client.execute_command

        async def counted(*args: Any, **options: Any) -> Any:
            through_redis_py.append(args)
            return await execute(*args, **options)

        executor.client.execute_command = counted  # type: ignore[method-assign]
        try:
            for args in calls * 3:
                try:
                    want: Any = plain.execute_command(*args)
                except ResponseError as exc:
                    want = failure(exc)
                assert _plain(await executor.run(_one(Command(args)))) == _plain(want)
            waiting = asyncio.ensure_future(
                executor.run(_one(Command(("EVALSHA", slow, 0, "late", spin))))
            )
            await asyncio.sleep(0.1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await asyncio.sleep(0.5)  # the late reply arrives on the cancelled call's socket
            for _ in range(4):
                got = await executor.run(_one(Command(("EVALSHA", sha, 0, "next", 1, "y"))))
                assert got == [b"next", 2, [b"y"]]
            assert through_redis_py == []
        finally:
            await executor.close()

    try:
        asyncio.run(run())
    finally:
        plain.close()


@pytest.mark.redis
def test_commands_sent_together_answer_as_redis_py_pipelines_do(redis_server_url: str) -> None:
    """``send_commands`` (the page journal's appends): one write of hiredis-packed commands,
    their replies in order as redis-py's pipeline gives them; an error reply raises once every
    reply was read (the connection goes back clean), and an argument hiredis does not take goes
    through redis-py's pipeline."""
    executor = SyncExecutor(RedisIndexConfig(address=redis_server_url))
    plain = redis.Redis.from_url(redis_server_url)
    key, other = b"kvt-send-a", b"kvt-send-b"
    try:
        plain.delete(key, other)
        commands: list[tuple[Any, ...]] = [
            (b"RPUSH", key, b"\x00\xff"),
            (b"RPUSH", key, "\u00e9", 7),
            (b"SET", other, b"text"),
            (b"LRANGE", key, 0, -1),
        ]
        want = [1, 3, True, [b"\x00\xff", "\u00e9".encode(), b"7"]]
        got = send_commands(executor.client, commands)
        assert [bool(r) if r in (b"OK", True) else r for r in got] == want
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            send_commands(executor.client, [(b"RPUSH", other, b"y"), (b"RPUSH", key, b"z")])
        assert plain.llen(key) == 4  # the command after the error reply ran
        assert send_commands(executor.client, [(b"RPUSH", key, memoryview(b"view"))]) == [5]
        assert plain.lrange(key, -1, -1) == [b"view"]
        pool: Any = executor.pool
        assert [c for c in pool._connections if c not in pool.pool.queue + pool.idle] == []
        assert send_commands(executor.client, [(b"LLEN", key)]) == [5]
        assert send_commands(executor.client, []) == []  # nothing sent, whatever redis-py
    finally:
        plain.delete(key, other)
        executor.close()
        plain.close()


# -- connections handed straight back ----------------------------------------------------------


def _client_id(executor: SyncExecutor) -> int:
    got = executor.run(_one(Command(("CLIENT", "ID"))))
    assert isinstance(got, int), got
    return got


@pytest.mark.redis
def test_a_released_connection_is_handed_straight_back(redis_server_url: str) -> None:
    """Script calls, redis-py's own commands and pipelines all take the connection the last one
    released: one connection serves a thread's calls, and it is never handed out twice."""
    executor = SyncExecutor(RedisIndexConfig(address=redis_server_url, pool_size=4))
    plain = redis.Redis.from_url(redis_server_url)
    try:
        sha = plain.script_load(PACKED_SOURCE)
        pool: Any = executor.pool
        first = _client_id(executor)
        for _ in range(3):
            assert executor.run(_one(Command(("EVALSHA", sha, 0, "a", 1, "b")))) == [
                b"a",
                2,
                [b"b"],
            ]
            assert executor.run(_one(Pipeline((Command(("PING",)), Command(("ECHO", "x")))))) == [
                True,
                b"x",
            ]
            assert _client_id(executor) == first
        assert len(pool._connections) == 1 and pool.idle == pool._connections
        held = [pool.get_connection(), pool.get_connection()]
        assert held[0] is not held[1] and pool.idle == []
        for connection in held:
            pool.release(connection)
        assert sorted(map(id, pool.idle)) == sorted(map(id, held))
    finally:
        executor.close()
        plain.close()


@pytest.mark.redis
def test_a_caller_waiting_for_a_connection_gets_the_next_one_released(
    redis_server_url: str,
) -> None:
    """With every connection taken, a caller waits (redis-py's blocking pool) and the next
    release goes to it, not onto the idle stack: it is served at once, not after its timeout."""
    import threading

    executor = SyncExecutor(RedisIndexConfig(address=redis_server_url, pool_size=1))
    try:
        pool: Any = executor.pool
        _client_id(executor)
        held = pool.get_connection()
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(_client_id(executor)))
        waiter.start()
        deadline = time.monotonic() + 10
        while pool._waiting == 0:
            assert time.monotonic() < deadline, "the caller never waited"
            time.sleep(0.01)
        pool.release(held)
        waiter.join(timeout=pool.timeout / 2)  # well before the pool's timeout
        assert not waiter.is_alive(), "the release did not reach the waiting caller"
        assert len(got) == 1 and isinstance(got[0], int)
        assert pool._waiting == 0 and pool.idle == pool._connections
    finally:
        executor.close()


@pytest.mark.redis
def test_an_idle_connection_is_checked_before_it_is_handed_back(redis_server_url: str) -> None:
    """A connection the server closed while it sat idle is reconnected, and one left with a
    reply nobody read is not handed out with it: the next call gets its own reply."""
    executor = SyncExecutor(RedisIndexConfig(address=redis_server_url, pool_size=2))
    plain = redis.Redis.from_url(redis_server_url)
    try:
        pool: Any = executor.pool
        before = _client_id(executor)
        assert plain.execute_command("CLIENT", "KILL", "ID", before) == 1
        time.sleep(0.05)
        after = _client_id(executor)
        assert after != before
        connection = pool.get_connection()
        connection.send_command("ECHO", "stale")
        assert connection.can_read(timeout=5)
        pool.release(connection)
        assert executor.run(_one(Command(("ECHO", "fresh")))) == b"fresh"
        assert _client_id(executor) not in (before, after)  # reconnected, not drained
    finally:
        executor.close()
        plain.close()


@pytest.mark.redis
def test_a_forked_child_uses_connections_of_its_own(redis_server_url: str) -> None:
    """A child forked with connections on the idle stack opens its own; the parent's stay
    usable."""
    import os

    executor = SyncExecutor(RedisIndexConfig(address=redis_server_url))
    try:
        parent = _client_id(executor)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 when its connection is another one
            code = 1
            try:
                code = 0 if _client_id(executor) != parent else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _client_id(executor) == parent
    finally:
        executor.close()


@pytest.mark.redis
def test_async_connections_are_handed_straight_back(redis_server_url: str) -> None:
    """The asyncio pool: the connection released last serves the next call, a caller waiting
    for one gets the next released, and one the server closed while idle is reconnected."""
    plain = redis.Redis.from_url(redis_server_url)

    async def client_id(executor: AsyncExecutor) -> int:
        got = await executor.run(_one(Command(("CLIENT", "ID"))))
        assert isinstance(got, int), got
        return got

    async def run() -> None:
        executor = AsyncExecutor(RedisIndexConfig(address=redis_server_url, pool_size=1))
        pool: Any = executor.pool
        try:
            first = await client_id(executor)
            assert await client_id(executor) == first and len(pool.idle) == 1
            held = await pool.get_connection()
            waiting = asyncio.ensure_future(client_id(executor))
            await asyncio.sleep(0.1)
            assert not waiting.done() and pool._waiting == 1
            await pool.release(held)
            assert await asyncio.wait_for(waiting, pool.timeout / 2) == first
            assert pool._waiting == 0 and len(pool.idle) == 1
            assert plain.execute_command("CLIENT", "KILL", "ID", first) == 1
            await asyncio.sleep(0.05)
            assert await client_id(executor) != first
        finally:
            await executor.close()

    try:
        asyncio.run(run())
    finally:
        plain.close()


@pytest.mark.redis
def test_a_call_that_finds_every_connection_taken_fails_after_the_pool_timeout(
    redis_server_url: str,
) -> None:
    """With every connection in use past ``pool_timeout``, a call is retried as ``retries``
    says and then fails ``BackendUnavailableError``; the connection released serves the next."""
    from kvredis import RedisIndex
    from kvredis.errors import BackendUnavailableError

    config = RedisIndexConfig(
        address=redis_server_url, pool_size=1, pool_timeout=0.2, retries=1, retry_backoff=0.01
    )
    index = RedisIndex(config)
    try:
        assert index.lookup([1, 2]) == {}
        pool: Any = index._exec.pool
        held = pool.get_connection()
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError):
            index.lookup([1, 2])
        assert time.monotonic() - started >= 0.4  # two waits of pool_timeout: a try and a retry
        pool.release(held)
        assert index.lookup([1, 2]) == {}
    finally:
        index.close()

"""The executors' one job besides sending: map redis-py exceptions to the requests vocabulary."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)

from kvredis import RedisIndexConfig
from kvredis.redis.executor import SyncExecutor, failure
from kvredis.redis.requests import (
    AuthenticationFailed,
    ConnectionLost,
    ErrorReply,
    Failure,
    Op,
    Pipeline,
    ScriptCall,
)


@pytest.mark.parametrize(
    ("exc", "kind", "message"),
    [
        # redis-py strips the code of the replies it has a class for; the failure restores it
        (NoScriptError("x", status_code="NOSCRIPT"), ErrorReply, "NOSCRIPT x"),
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

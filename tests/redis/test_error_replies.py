"""Error replies from real servers, read by each parser redis-py has (pure Python, hiredis):
the executor hands the ops the reply as the server sent it, code first and once, whichever
redis-py version and parser is installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from redis._parsers import _HiredisParser, _RESP2Parser

from kvredis.errors import CallBudgetError, StaleNamespaceError, translate
from kvredis.redis.executor import failure
from kvredis.redis.requests import ErrorReply

try:
    import hiredis  # noqa: F401

    PARSERS = [_RESP2Parser, _HiredisParser]
except ImportError:  # redis[hiredis] is a dependency; a bare redis install has the Python one
    PARSERS = [_RESP2Parser]


@pytest.fixture(params=PARSERS, ids=lambda cls: cls.__name__)
def client(request: pytest.FixtureRequest, redis_server_url: str) -> Iterator[redis.Redis]:
    raw = redis.Redis.from_url(redis_server_url, parser_class=request.param)
    yield raw
    raw.close()


def _reply_of(client: redis.Redis, *args: object) -> ErrorReply:
    with pytest.raises(redis.ResponseError) as raised:
        client.execute_command(*args)
    got = failure(raised.value)
    assert isinstance(got, ErrorReply)
    return got


def test_a_scripts_error_reply_reaches_the_ops_whole(client: redis.Redis) -> None:
    budget = "KVREDIS_BUDGET 2 5 the keys reach chain runs of more than 3 ranges"
    got = _reply_of(client, "EVAL", f"return redis.error_reply('{budget}')", 0)
    assert got.message.startswith(budget) and got.code == "KVREDIS_BUDGET"
    error = translate(got.message)
    assert isinstance(error, CallBudgetError) and (error.ops, error.keys) == (2, 5)
    assert str(error).startswith("the keys reach")
    stale = "KVREDIS_STALE namespace layout changed"
    got = _reply_of(client, "EVAL", f"error({{err = '{stale}'}})", 0)
    assert got.code == "KVREDIS_STALE" and got.message.count("KVREDIS_STALE") == 1
    assert isinstance(translate(got.message), StaleNamespaceError)


def test_a_reply_redis_py_has_a_class_for_keeps_its_code(client: redis.Redis) -> None:
    got = _reply_of(client, "EVALSHA", "0" * 40, 0)
    assert got.code == "NOSCRIPT" and got.message.count("NOSCRIPT") == 1
    client.set("kvt-error-replies", "x")
    try:
        got = _reply_of(client, "HGET", "kvt-error-replies", "f")
    finally:
        client.delete("kvt-error-replies")
    assert got.code == "WRONGTYPE" and got.message.count("WRONGTYPE") == 1


def test_the_executors_speak_resp2_whatever_the_library_defaults_to(redis_server_url: str) -> None:
    """The ops decode RESP2 replies (flat arrays, integers, bulk strings): the connections ask
    for it rather than take redis-py's default."""
    from kvredis import RedisIndex, RedisIndexConfig

    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace="kvt-resp")) as index:
        info = index.client.execute_command("CLIENT", "INFO")
        assert b"resp=2" in (info if isinstance(info, bytes) else str(info).encode())
        index.drop_namespace()

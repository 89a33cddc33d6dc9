"""A router started before its namespace exists (issue: it failed with ``NOPERM ... 'fcall'``,
its read-only user refused the create): it says the namespace does not exist yet, and with
``wait_for_namespace`` it waits for the ingester to create it, on Redis 7.0 and Valkey 9."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvredis import AsyncRedisIndex, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.errors import ConfigError, NamespaceMissingError
from kvredis.redis.functions import shipped_library
from kvredis.redis.layout import meta_key
from tests.redis.test_acl_functions import PASSWORD, create, printed, user_url
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

A = PodEntry("pod-a", "gpu")


@pytest.fixture
def server(own_redis_server: RedisServer) -> Iterator[tuple[RedisServer, redis.Redis]]:
    admin = redis.Redis(port=own_redis_server.port)
    admin.function_load(shipped_library().code.decode(), replace=True)
    yield own_redis_server, admin
    admin.close()


def _router(server: RedisServer, admin: redis.Redis, namespace: str, evalsha: bool) -> str:
    args = printed("router", namespace)
    if evalsha:
        args = [a for a in args if a != "+fcall_ro"]
        args += ["+evalsha", "+script|load"]
        args = [f"~{namespace}:*" if a == f"%R~{namespace}:*" else a for a in args]
    return user_url(server, create(admin, args))


@pytest.mark.parametrize("evalsha", [False, True], ids=["functions", "evalsha"])
def test_a_read_only_router_says_the_namespace_does_not_exist_yet(
    server: tuple[RedisServer, redis.Redis], evalsha: bool
) -> None:
    srv, admin = server
    namespace = f"kvt-{uuid.uuid4().hex[:10]}"
    url = _router(srv, admin, namespace, evalsha)
    config = RedisIndexConfig(address=url, namespace=namespace, use_functions=not evalsha)
    with pytest.raises(NamespaceMissingError) as missing:
        RedisIndex(config)
    message = str(missing.value)
    assert f"namespace {namespace!r} does not exist yet" in message
    assert "wait_for_namespace" in message and "kvredis ingest" in message
    assert PASSWORD not in message
    assert not admin.exists(meta_key(namespace))

    async def connect() -> None:
        index = AsyncRedisIndex(config)
        try:
            await index.connect()
        finally:
            await index.aclose()

    with pytest.raises(NamespaceMissingError, match="does not exist yet"):
        asyncio.run(connect())


def test_a_router_waits_for_the_ingester_to_create_the_namespace(
    server: tuple[RedisServer, redis.Redis],
) -> None:
    srv, admin = server
    namespace = f"kvt-{uuid.uuid4().hex[:10]}"
    url = _router(srv, admin, namespace, evalsha=False)
    config = RedisIndexConfig(address=url, namespace=namespace, wait_for_namespace=20)
    got: dict[str, Any] = {}

    def route() -> None:
        try:
            with RedisIndex(config) as router:
                got["connected"] = time.monotonic()
                got["scores"] = router.score([1, 2, 3])
        except BaseException as exc:
            got["error"] = exc

    thread = threading.Thread(target=route)
    thread.start()
    time.sleep(0.6)
    assert thread.is_alive() and not admin.exists(meta_key(namespace))  # waiting, made nothing
    created = time.monotonic()
    with RedisIndex(RedisIndexConfig(address=srv.url, namespace=namespace)) as ingester:
        ingester.add([9], [1, 2, 3], [A])
    thread.join(30)
    assert "error" not in got, got.get("error")
    assert got["connected"] >= created
    assert got["scores"] == {"pod-a": 3.0}
    with RedisIndex(RedisIndexConfig(address=srv.url, namespace=namespace)) as admin_index:
        admin_index.drop_namespace()


def test_the_wait_ends_with_a_clear_error(server: tuple[RedisServer, redis.Redis]) -> None:
    srv, admin = server
    namespace = f"kvt-{uuid.uuid4().hex[:10]}"
    url = _router(srv, admin, namespace, evalsha=False)
    config = RedisIndexConfig(address=url, namespace=namespace, wait_for_namespace=0.4)
    started = time.monotonic()
    with pytest.raises(NamespaceMissingError, match=r"did not appear within .*0\.4 s"):
        RedisIndex(config)
    assert 0.4 <= time.monotonic() - started < 5

    async def connect() -> None:
        index = await AsyncRedisIndex.create(config)
        await index.aclose()

    with pytest.raises(NamespaceMissingError, match="did not appear"):
        asyncio.run(connect())


def test_a_client_allowed_to_create_waits_instead_when_asked(
    server: tuple[RedisServer, redis.Redis],
) -> None:
    srv, admin = server
    namespace = f"kvt-{uuid.uuid4().hex[:10]}"
    config = RedisIndexConfig(address=srv.url, namespace=namespace, wait_for_namespace=0.2)
    with pytest.raises(NamespaceMissingError):
        RedisIndex(config)
    assert not admin.exists(meta_key(namespace))
    config = RedisIndexConfig.from_dict(
        {"address": srv.url, "namespace": namespace, "waitForNamespace": 0}
    )
    with RedisIndex(config) as index:  # 0: the client creates it, as always
        index.drop_namespace()


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), "5", True])
def test_wait_for_namespace_is_a_finite_number_of_seconds(value: object) -> None:
    with pytest.raises(ConfigError, match="wait_for_namespace"):
        RedisIndexConfig(wait_for_namespace=value)  # type: ignore[arg-type]

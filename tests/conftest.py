"""Shared fixtures: real Redis servers on free ports and the Index backend matrix.

Markers follow the fixtures: a test that uses a Redis server (``redis_server_url``,
``own_redis_server``, or a Redis backend of the matrix) carries the ``redis`` marker, so
``pytest -m "not redis"`` runs everything that needs no server. Without ``redis-server`` (and
without ``KVREDIS_TEST_REDIS_URL`` or Docker), a selected test that needs one fails at setup,
saying so; it is never skipped.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from kvredis.types import KeyType, PodEntry
from tests.servers import RedisServer, redis_url

T = TypeVar("T")

#: Fixtures that start or reach a Redis server; a test using one (directly or through another
#: fixture) is marked ``redis``.
REDIS_FIXTURES = frozenset({"redis_server_url", "own_redis_server"})
REDIS_BACKENDS = [pytest.param(name, marks=pytest.mark.redis) for name in ("redis", "async_redis")]
BACKENDS = ["memory", "cost_aware", *REDIS_BACKENDS]


def pytest_itemcollected(item: pytest.Item) -> None:
    if REDIS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    """URL of a real Redis shared by the session (tests isolate themselves by namespace)."""
    with redis_url() as (url, _server):
        yield url


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server process owned by one test, which it may stop, restart or flush."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses."""
    return f"kvt-{uuid.uuid4().hex[:12]}"


class LoopThread:
    """An asyncio event loop in a daemon thread, for driving async clients from sync code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class SyncOverAsync:
    """Presents an AsyncIndex through the sync Index methods, so one conformance suite covers it."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._loop = LoopThread()

        async def build() -> Any:
            return factory()

        self.inner = self._loop.run(build())

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        return self._loop.run(self.inner.lookup(request_keys, pod_identifier_set))  # type: ignore[no-any-return]

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
    ) -> None:
        self._loop.run(self.inner.add(engine_keys, request_keys, entries))

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        self._loop.run(self.inner.evict(key, key_type, entries))

    def get_request_key(self, engine_key: int) -> int:
        return self._loop.run(self.inner.get_request_key(engine_key))  # type: ignore[no-any-return]

    def clear(self, pod_identifier: str) -> None:
        self._loop.run(self.inner.clear(pod_identifier))

    def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Any = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        return self._loop.run(  # type: ignore[no-any-return]
            self.inner.score(request_keys, medium_weights, pod_identifier_set)
        )

    def apply_batch(
        self, ops: Sequence[Any], stream: str | None = None, watermark: Any = None
    ) -> bool:
        return self._loop.run(self.inner.apply_batch(ops, stream, watermark))  # type: ignore[no-any-return]

    def get_watermark(self, stream: str) -> Any:
        return self._loop.run(self.inner.get_watermark(stream))

    def reset_watermark(self, stream: str, watermark: Any) -> None:
        self._loop.run(self.inner.reset_watermark(stream, watermark))

    def close(self) -> None:
        aclose = getattr(self.inner, "aclose", None)
        if aclose is not None:
            self._loop.run(aclose())
        self._loop.close()


def make_backend(name: str, request: pytest.FixtureRequest) -> Any:
    """Build a fresh, empty index of the named backend."""
    if name == "memory":
        from kvredis.memory import InMemoryIndex

        return InMemoryIndex()
    if name == "cost_aware":
        from kvredis.memory import CostAwareMemoryIndex

        return CostAwareMemoryIndex()
    url: str = request.getfixturevalue("redis_server_url")
    ns = f"kvt-{uuid.uuid4().hex[:12]}"
    from kvredis import AsyncRedisIndex, RedisIndex, RedisIndexConfig

    config = RedisIndexConfig(address=url, namespace=ns)
    if name == "redis":
        return RedisIndex(config)
    if name == "async_redis":
        return SyncOverAsync(lambda: AsyncRedisIndex(config))
    raise ValueError(f"unknown backend {name}")


@pytest.fixture(params=BACKENDS)
def index(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh, empty index of every backend in turn (the Index conformance matrix)."""
    idx = make_backend(request.param, request)
    try:
        yield idx
    finally:
        close = getattr(idx, "close", None)
        if close is not None:
            close()


@pytest.fixture(params=REDIS_BACKENDS)
def redis_backend_index(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh Redis-backed index, sync and async (through SyncOverAsync)."""
    idx = make_backend(request.param, request)
    try:
        yield idx
    finally:
        idx.close()


@pytest.fixture
def backend_name(index: Any, request: pytest.FixtureRequest) -> str:
    """Name of the backend the ``index`` fixture built for this test."""
    return str(request.node.callspec.params["index"])

"""The pytest plugin of :mod:`kvredis.testing` (entry point ``pytest11``: ``kvredis``).

It declares fixtures and nothing else: no options, hooks or markers, and nothing is started or
imported beyond this module until a test asks for a fixture.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import pytest

if TYPE_CHECKING:
    from kvredis.redis.index import RedisIndex
    from kvredis.testing.engine import EngineKind, FakeEngine
    from kvredis.testing.servers import LocalCluster, ServerHandle


class EngineFactory(Protocol):
    """The ``fake_engine`` fixture: makes a :class:`~kvredis.testing.engine.FakeEngine`."""

    def __call__(
        self,
        pod: str = "pod-a",
        model: str = "model-a",
        *,
        engine: EngineKind = "vllm",
        block_size: int = 16,
        page_size: int = 1,
        medium: str = "GPU",
        replay: bool = True,
    ) -> FakeEngine: ...


@pytest.fixture(scope="session")
def kvredis_server() -> Iterator[ServerHandle]:
    """A real Redis or Valkey server for the session (see
    :func:`~kvredis.testing.servers.provide_server` for the order it looks in); skips with
    what to install when none exists."""
    from kvredis.testing.servers import ServerUnavailableError, provide_server

    manager = provide_server()
    try:
        handle = manager.__enter__()
    except ServerUnavailableError as exc:
        pytest.skip(str(exc))
    try:
        yield handle
    finally:
        manager.__exit__(None, None, None)


@pytest.fixture
def kvredis_index(kvredis_server: ServerHandle) -> Iterator[RedisIndex]:
    """A :class:`~kvredis.RedisIndex` on a namespace of its own, dropped after the test."""
    from kvredis.redis.config import RedisIndexConfig
    from kvredis.redis.index import RedisIndex

    namespace = f"kvtest-{uuid.uuid4().hex[:12]}"
    index = RedisIndex(RedisIndexConfig(address=kvredis_server.url, namespace=namespace))
    try:
        yield index
    finally:
        try:
            index.drop_namespace()
        finally:
            index.close()


@pytest.fixture(scope="session")
def kvredis_cluster() -> Iterator[LocalCluster]:
    """A local Redis Cluster (3 primaries, 3 replicas) of real server processes on 127.0.0.1;
    ``.url`` is its ``redis+cluster://`` address. Skips when no server binary is installed."""
    from kvredis.testing.servers import (
        INSTALL_HINT,
        LocalCluster,
        server_binary,
    )

    kind = os.environ.get("KVREDIS_TEST_SERVER_KIND") or (
        "redis" if server_binary("redis") else "valkey"
    )
    if server_binary(kind) is None:
        pytest.skip(f"kvredis_cluster needs a local {kind} server binary: {INSTALL_HINT}")
    cluster = LocalCluster(kind)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def fake_engine() -> Iterator[EngineFactory]:
    """Makes :class:`~kvredis.testing.engine.FakeEngine` publishers; all closed after the test."""
    from kvredis.testing.engine import FakeEngine

    engines: list[FakeEngine] = []

    def make(pod: str = "pod-a", model: str = "model-a", **kwargs: Any) -> FakeEngine:
        engine = FakeEngine(pod, model, **kwargs)
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in engines:
            engine.close()

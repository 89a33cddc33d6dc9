"""The Redis/Valkey index: the KV-block index kept in one server shared by many router replicas.

All index logic runs server-side in the Lua scripts under ``lua/``; every public method is one
script call (one round trip), except :meth:`RedisIndex.clear`, which pages the namespace with
SCAN. :class:`RedisIndex` is the thread-safe sync client, :class:`AsyncRedisIndex` the asyncio
one; both drive the same sans-IO operations of :mod:`kvredis.redis_core`.

Failures: construction pings the server and raises
:class:`~kvredis.errors.BackendUnavailableError` naming the address when it cannot connect;
later connection failures and timeouts raise the same after ``retries`` more attempts with
exponential backoff (every index call is idempotent: adds and evicts have set semantics, and
watermarked batches apply at most once). A call therefore gives up after at most about
``(retries + 1) * max(socket_timeout, connect_timeout)`` plus the backoff.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, ResponseError
from redis.retry import Retry

from kvredis.address import RedisAddress, mask_password, parse_address
from kvredis.batch import IndexOp, Watermark
from kvredis.errors import (
    BackendUnavailableError,
    ConfigError,
    KVRedisError,
    StaleNamespaceError,
    translate,
)
from kvredis.jsonconfig import check_number, take_fields
from kvredis.redis_core import (
    DEFAULT_BUCKET_BITS,
    DEFAULT_CLEAR_FIELDS_PER_CALL,
    ClearProgress,
    Command,
    CoreState,
    Op,
    Request,
    check_bucket_bits,
    check_namespace,
    op_add,
    op_apply_batch,
    op_clear,
    op_drop_namespace,
    op_evict,
    op_get_request_key,
    op_get_watermark,
    op_load_namespace,
    op_lookup,
    op_reset_watermark,
    op_score,
)
from kvredis.scripts import ScriptCall, ScriptRegistry
from kvredis.types import KeyType, PodEntry

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKEND_TYPES = ("redis", "valkey")
#: Address of :func:`new_valkey_index` without a config.
DEFAULT_VALKEY_ADDRESS = "valkey://127.0.0.1:6379"

_CAMEL = {
    "address": "address",
    "backendType": "backend_type",
    "enableRDMA": "enable_rdma",
    "enableRdma": "enable_rdma",
    "namespace": "namespace",
    "socketTimeout": "socket_timeout",
    "connectTimeout": "connect_timeout",
    "poolSize": "pool_size",
    "poolTimeout": "pool_timeout",
    "retries": "retries",
    "retryBackoff": "retry_backoff",
    "bucketBits": "bucket_bits",
    "clearFieldsPerCall": "clear_fields_per_call",
    "username": "username",
    "password": "password",
    "tlsCaFile": "tls_ca_file",
    "tlsCertFile": "tls_cert_file",
    "tlsKeyFile": "tls_key_file",
    "tlsVerify": "tls_verify",
    "tlsCheckHostname": "tls_check_hostname",
    "clientName": "client_name",
}


@dataclass(frozen=True, slots=True)
class RedisIndexConfig:
    """Where and how to reach the server, and which namespace to use.

    ``address`` accepts ``redis://``, ``rediss://`` (TLS), ``valkey://``, ``valkeys://``,
    ``unix://`` and a bare ``host:port`` (see :mod:`kvredis.address`). ``enable_rdma`` is accepted
    for upstream compatibility; the Python client does not support RDMA, logs a warning and uses
    TCP. ``username``/``password`` override those in the address. Timeouts are in seconds.
    ``bucket_bits`` only matters for the first client of a new namespace: it fixes the number
    of buckets (``2**bucket_bits``) for everyone (aim for at most a few hundred request keys per
    bucket: 16 bits suits up to ~30M request keys). ``clear_fields_per_call`` bounds the work of
    one ``clear`` script call.
    """

    address: str = "redis://127.0.0.1:6379"
    backend_type: str = "redis"
    enable_rdma: bool = False
    namespace: str = "kvblock"
    socket_timeout: float = 2.0
    connect_timeout: float = 2.0
    pool_size: int = 32
    pool_timeout: float = 5.0
    retries: int = 2
    retry_backoff: float = 0.05
    bucket_bits: int = DEFAULT_BUCKET_BITS
    clear_fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    tls_check_hostname: bool = True
    client_name: str | None = "kvredis"

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "address":
                value = mask_password(value)
            elif f.name == "password" and value is not None:
                value = "***"
            shown.append(f"{f.name}={value!r}")
        return f"RedisIndexConfig({', '.join(shown)})"

    def __post_init__(self) -> None:
        parse_address(self.address)
        if self.backend_type not in BACKEND_TYPES:
            raise ConfigError(
                f"backend_type must be one of {', '.join(BACKEND_TYPES)}, got {self.backend_type!r}"
            )
        for name in ("enable_rdma", "tls_verify", "tls_check_hostname"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        try:
            check_namespace(self.namespace)
            check_bucket_bits(self.bucket_bits)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in ("socket_timeout", "connect_timeout", "pool_timeout"):
            check_number(name, getattr(self, name))
        check_number("retry_backoff", self.retry_backoff, zero=True)
        check_number("pool_size", self.pool_size, integer=True)
        check_number("retries", self.retries, integer=True, zero=True)
        check_number("clear_fields_per_call", self.clear_fields_per_call, integer=True)
        for name in (
            "username",
            "password",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "client_name",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a str or None, got {value!r}")

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> RedisIndexConfig:
        """Build from the upstream JSON shape (``address``, ``backendType``, ``enableRDMA``, ...).

        Every field is also accepted in its snake_case spelling; unknown keys raise ConfigError.
        """
        kwargs = take_fields("redis config", mapping, _CAMEL)
        return cls(**kwargs)

    def parsed_address(self) -> RedisAddress:
        """The parsed :attr:`address`."""
        return parse_address(self.address)


def _connection_kwargs(config: RedisIndexConfig, address: RedisAddress) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "db": address.db,
        "username": config.username if config.username is not None else address.username,
        "password": config.password if config.password is not None else address.password,
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "client_name": config.client_name,
    }
    if address.transport == "unix":
        kwargs["path"] = address.path
    else:
        kwargs["host"] = address.host
        kwargs["port"] = address.port
    if address.tls:
        kwargs.update(
            ssl_ca_certs=config.tls_ca_file,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
            ssl_cert_reqs="required" if config.tls_verify else "none",
            ssl_check_hostname=config.tls_check_hostname and config.tls_verify,
        )
    return kwargs


def _log_rdma(config: RedisIndexConfig) -> None:
    if config.enable_rdma:
        logger.warning(
            "enable_rdma is set for %s, but the Python client does not support RDMA; using TCP",
            parse_address(config.address).display,
        )


def _translate(exc: ResponseError) -> KVRedisError:
    """A kvredis exception for an error reply of the server."""
    return translate(str(exc))


class _Executor:
    """What the sync and asyncio executors share: retry policy and error messages."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self.config = config
        self.address = config.parsed_address()
        self.registry = ScriptRegistry()
        self.state = CoreState(config.namespace, config.bucket_bits)

    def unavailable(self, exc: BaseException) -> BackendUnavailableError:
        what = (
            "authentication failed at" if isinstance(exc, AuthenticationError) else "cannot reach"
        )
        return BackendUnavailableError(
            f"{what} {self.config.backend_type} at {self.address.display}: {exc}"
        )

    def backoff(self, attempt: int) -> float:
        return float(min(1.0, self.config.retry_backoff * (2**attempt)))

    @staticmethod
    def check_pipeline(replies: list[Any]) -> list[Any]:
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies


_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, OSError)
#: Error replies of a server that is up but cannot serve right now (retried like timeouts).
_TRANSIENT_REPLIES = ("BUSY", "LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN")


def _transient_reply(exc: ResponseError) -> bool:
    return str(exc).startswith(_TRANSIENT_REPLIES)


class _SyncExecutor(_Executor):
    def __init__(self, config: RedisIndexConfig) -> None:
        super().__init__(config)
        address = self.address
        connection_class: type[Any]
        if address.transport == "unix":
            connection_class = redis.UnixDomainSocketConnection
        elif address.tls:
            connection_class = redis.SSLConnection
        else:
            connection_class = redis.Connection
        pool_class: Any = redis.BlockingConnectionPool
        self.pool = pool_class(
            connection_class=connection_class,
            max_connections=config.pool_size,
            timeout=config.pool_timeout,
            retry=Retry(NoBackoff(), 0),
            **_connection_kwargs(config, address),
        )
        self.client = redis.Redis(connection_pool=self.pool)
        self._reload_lock = threading.Lock()

    def close(self) -> None:
        self.client.close()
        self.pool.disconnect()

    def _dispatch(self, request: Request) -> Any:
        if isinstance(request, ScriptCall):
            return self.registry.call(self.client, request)
        if isinstance(request, Command):
            client: Any = self.client
            return client.execute_command(*request.args)
        return self.check_pipeline(self.registry.execute(self.client, request.items))

    def send(self, request: Request) -> Any:
        attempt = 0
        while True:
            try:
                return self._dispatch(request)
            except AuthenticationError as exc:
                raise self.unavailable(exc) from exc
            except (*_TRANSIENT, ResponseError) as exc:
                if isinstance(exc, ResponseError) and not _transient_reply(exc):
                    raise _translate(exc) from exc
                if attempt >= self.config.retries:
                    raise self.unavailable(exc) from exc
                time.sleep(self.backoff(attempt))
                attempt += 1

    def drive(self, op: Op[T]) -> T:
        try:
            request = next(op)
            while True:
                request = op.send(self.send(request))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            op.close()

    def run(self, factory: Callable[[], Op[T]]) -> T:
        """Run an operation; on a stale namespace reload it once and run the operation again."""
        if not self.state.loaded:
            self.load()
        try:
            return self.drive(factory())
        except StaleNamespaceError:
            self.load()
            return self.drive(factory())

    def load(self, ping: bool = False) -> None:
        with self._reload_lock:
            self.drive(op_load_namespace(self.state, ping=ping))


class _AsyncExecutor(_Executor):
    def __init__(self, config: RedisIndexConfig) -> None:
        super().__init__(config)
        address = self.address
        connection_class: type[Any]
        if address.transport == "unix":
            connection_class = redis.asyncio.UnixDomainSocketConnection
        elif address.tls:
            connection_class = redis.asyncio.SSLConnection
        else:
            connection_class = redis.asyncio.Connection
        kwargs = _connection_kwargs(config, address)
        self.pool = redis.asyncio.BlockingConnectionPool(
            connection_class=connection_class,
            max_connections=config.pool_size,
            timeout=config.pool_timeout,
            retry=AsyncRetry(NoBackoff(), 0),
            **kwargs,
        )
        self.client = redis.asyncio.Redis(connection_pool=self.pool)
        self._reload_lock: asyncio.Lock | None = None

    async def close(self) -> None:
        await self.client.aclose()
        await self.pool.disconnect()

    async def _dispatch(self, request: Request) -> Any:
        if isinstance(request, ScriptCall):
            return await self.registry.acall(self.client, request)
        if isinstance(request, Command):
            client: Any = self.client
            return await client.execute_command(*request.args)
        return self.check_pipeline(await self.registry.aexecute(self.client, request.items))

    async def send(self, request: Request) -> Any:
        attempt = 0
        while True:
            try:
                return await self._dispatch(request)
            except AuthenticationError as exc:
                raise self.unavailable(exc) from exc
            except (*_TRANSIENT, asyncio.TimeoutError, ResponseError) as exc:
                if isinstance(exc, ResponseError) and not _transient_reply(exc):
                    raise _translate(exc) from exc
                if attempt >= self.config.retries:
                    raise self.unavailable(exc) from exc
                await asyncio.sleep(self.backoff(attempt))
                attempt += 1

    async def drive(self, op: Op[T]) -> T:
        try:
            request = next(op)
            while True:
                request = op.send(await self.send(request))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            op.close()

    async def run(self, factory: Callable[[], Op[T]]) -> T:
        if not self.state.loaded:
            await self.load()
        try:
            return await self.drive(factory())
        except StaleNamespaceError:
            await self.load()
            return await self.drive(factory())

    async def load(self, ping: bool = False) -> None:
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:
            await self.drive(op_load_namespace(self.state, ping=ping))


class RedisIndex:
    """The Index (and BatchIndex) in a Redis or Valkey server; thread-safe.

    Besides the :class:`~kvredis.index.Index` methods it offers :meth:`score` (the
    LongestPrefixScorer computed in Redis), :meth:`apply_batch` with watermarks, and a progress
    callback on :meth:`clear`. Close it with :meth:`close` (or use it as a context manager).
    """

    def __init__(self, config: RedisIndexConfig | None = None) -> None:
        cfg = RedisIndexConfig() if config is None else config
        if not isinstance(cfg, RedisIndexConfig):
            raise ConfigError(f"config must be a RedisIndexConfig, got {cfg!r}")
        self.config = cfg
        _log_rdma(cfg)
        self._exec = _SyncExecutor(cfg)
        try:
            self._exec.load(ping=True)
        except BaseException:
            self._exec.close()
            raise

    @property
    def namespace(self) -> str:
        """The namespace all keys of this index live under."""
        return self.config.namespace

    @property
    def bucket_bits(self) -> int:
        """Bucket bits of the namespace (fixed by its first client)."""
        return self._exec.state.layout.bucket_bits

    @property
    def registry(self) -> ScriptRegistry:
        """The Lua script registry of this client."""
        return self._exec.registry

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for inspection and benchmarks)."""
        return self._exec.client

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        """Entries per key along the chain, stopping at the first key no (filtered) pod holds."""
        state = self._exec.state
        return self._exec.run(lambda: op_lookup(state, request_keys, pod_identifier_set))

    def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        """Per-pod longest-prefix scores, computed in Redis (same floats as LongestPrefixScorer)."""
        state = self._exec.state
        return self._exec.run(
            lambda: op_score(state, request_keys, medium_weights, pod_identifier_set)
        )

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
    ) -> None:
        """Store every entry under every request key and record the engine→request mappings."""
        state = self._exec.state
        self._exec.run(lambda: op_add(state, engine_keys, request_keys, entries))

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """Remove exactly these entries; an engine key resolves to all its request keys."""
        state = self._exec.state
        self._exec.run(lambda: op_evict(state, key, key_type, entries))

    def get_request_key(self, engine_key: int) -> int:
        """The request key most recently mapped to ``engine_key``."""
        state = self._exec.state
        return self._exec.run(lambda: op_get_request_key(state, engine_key))

    def clear(self, pod_identifier: str, progress: ClearProgress | None = None) -> None:
        """Remove every entry of the pod, page by page (see :func:`kvredis.redis_core.op_clear`).

        ``progress(done, removed)``, if given, is called after every page with the number of
        bucket keys processed so far and the number of (request key, entry) pairs removed so far.
        """
        self.clear_with_progress(pod_identifier, progress)

    def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int:
        """:meth:`clear`, returning the number of (request key, entry) pairs removed."""
        state, per_call = self._exec.state, self.config.clear_fields_per_call
        return self._exec.run(lambda: op_clear(state, pod_identifier, progress, per_call))

    def apply_batch(
        self,
        ops: Sequence[IndexOp],
        stream: str | None = None,
        watermark: Watermark | None = None,
    ) -> bool:
        """Apply ``ops`` in order in one atomic script call, fenced by the stream's watermark."""
        state = self._exec.state
        return self._exec.run(lambda: op_apply_batch(state, ops, stream, watermark))

    def get_watermark(self, stream: str) -> Watermark | None:
        """The stored watermark of ``stream``, or ``None``."""
        state = self._exec.state
        return self._exec.run(lambda: op_get_watermark(state, stream))

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """Overwrite, or with ``None`` delete, the stored watermark of ``stream``."""
        state = self._exec.state
        self._exec.run(lambda: op_reset_watermark(state, stream, watermark))

    def drop_namespace(self) -> int:
        """Delete every key of this index's namespace; returns the number of keys deleted."""
        state = self._exec.state
        return self._exec.run(lambda: op_drop_namespace(state))

    def close(self) -> None:
        """Close the connections."""
        self._exec.close()

    def __enter__(self) -> RedisIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RedisIndex({self.config.backend_type} at {self._exec.address.display}, "
            f"namespace={self.namespace!r})"
        )


class AsyncRedisIndex:
    """The asyncio form of :class:`RedisIndex`: same methods, same semantics, as coroutines.

    The constructor does no I/O; the namespace is loaded (and the server pinged) by
    :meth:`connect`, by ``async with``, by :meth:`create`, or else by the first call. Close it
    with :meth:`aclose`.
    """

    def __init__(self, config: RedisIndexConfig | None = None) -> None:
        cfg = RedisIndexConfig() if config is None else config
        if not isinstance(cfg, RedisIndexConfig):
            raise ConfigError(f"config must be a RedisIndexConfig, got {cfg!r}")
        self.config = cfg
        _log_rdma(cfg)
        self._exec = _AsyncExecutor(cfg)

    @classmethod
    async def create(cls, config: RedisIndexConfig | None = None) -> AsyncRedisIndex:
        """Build the index and :meth:`connect` it."""
        index = cls(config)
        try:
            await index.connect()
        except BaseException:
            await index.aclose()
            raise
        return index

    async def connect(self) -> None:
        """Ping the server and load the namespace (BackendUnavailableError if unreachable)."""
        await self._exec.load(ping=True)

    @property
    def namespace(self) -> str:
        """The namespace all keys of this index live under."""
        return self.config.namespace

    @property
    def registry(self) -> ScriptRegistry:
        """The Lua script registry of this client."""
        return self._exec.registry

    @property
    def client(self) -> redis.asyncio.Redis:
        """The underlying redis-py asyncio client."""
        return self._exec.client

    async def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        """See :meth:`RedisIndex.lookup`."""
        state = self._exec.state
        return await self._exec.run(lambda: op_lookup(state, request_keys, pod_identifier_set))

    async def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        """See :meth:`RedisIndex.score`."""
        state = self._exec.state
        return await self._exec.run(
            lambda: op_score(state, request_keys, medium_weights, pod_identifier_set)
        )

    async def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
    ) -> None:
        """See :meth:`RedisIndex.add`."""
        state = self._exec.state
        await self._exec.run(lambda: op_add(state, engine_keys, request_keys, entries))

    async def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """See :meth:`RedisIndex.evict`."""
        state = self._exec.state
        await self._exec.run(lambda: op_evict(state, key, key_type, entries))

    async def get_request_key(self, engine_key: int) -> int:
        """See :meth:`RedisIndex.get_request_key`."""
        state = self._exec.state
        return await self._exec.run(lambda: op_get_request_key(state, engine_key))

    async def clear(self, pod_identifier: str, progress: ClearProgress | None = None) -> None:
        """See :meth:`RedisIndex.clear` (``progress`` is a plain callable)."""
        await self.clear_with_progress(pod_identifier, progress)

    async def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int:
        """See :meth:`RedisIndex.clear_with_progress`."""
        state, per_call = self._exec.state, self.config.clear_fields_per_call
        return await self._exec.run(lambda: op_clear(state, pod_identifier, progress, per_call))

    async def drop_namespace(self) -> int:
        """See :meth:`RedisIndex.drop_namespace`."""
        state = self._exec.state
        return await self._exec.run(lambda: op_drop_namespace(state))

    async def apply_batch(
        self,
        ops: Sequence[IndexOp],
        stream: str | None = None,
        watermark: Watermark | None = None,
    ) -> bool:
        """See :meth:`RedisIndex.apply_batch`."""
        state = self._exec.state
        return await self._exec.run(lambda: op_apply_batch(state, ops, stream, watermark))

    async def get_watermark(self, stream: str) -> Watermark | None:
        """See :meth:`RedisIndex.get_watermark`."""
        state = self._exec.state
        return await self._exec.run(lambda: op_get_watermark(state, stream))

    async def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """See :meth:`RedisIndex.reset_watermark`."""
        state = self._exec.state
        await self._exec.run(lambda: op_reset_watermark(state, stream, watermark))

    async def aclose(self) -> None:
        """Close the connections."""
        await self._exec.close()

    async def close(self) -> None:
        """Alias of :meth:`aclose`."""
        await self.aclose()

    async def __aenter__(self) -> AsyncRedisIndex:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"AsyncRedisIndex({self.config.backend_type} at {self._exec.address.display}, "
            f"namespace={self.namespace!r})"
        )


def new_redis_index(config: RedisIndexConfig | None = None) -> RedisIndex:
    """A :class:`RedisIndex` (default: ``redis://127.0.0.1:6379``, namespace ``kvblock``)."""
    return RedisIndex(config)


def new_valkey_index(config: RedisIndexConfig | None = None) -> RedisIndex:
    """A :class:`RedisIndex` on Valkey (default: ``valkey://127.0.0.1:6379``, backend "valkey")."""
    if config is None:
        config = RedisIndexConfig(address=DEFAULT_VALKEY_ADDRESS, backend_type="valkey")
    elif config.backend_type != "valkey":
        config = replace(config, backend_type="valkey")
    return RedisIndex(config)

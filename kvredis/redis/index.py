"""RedisIndex and AsyncRedisIndex: the KV-block index kept in one Redis or Valkey server.

All index logic runs server-side in the Lua scripts under ``lua/``; every public method is one
script call (one round trip), except ``clear``, which pages the namespace with SCAN, and calls
beyond one script call's work budget (:data:`kvredis.redis.program.CALL_BUDGET`), which go in parts.
:class:`RedisIndex` is the thread-safe sync client, :class:`AsyncRedisIndex` the asyncio one;
both run the same sans-IO operations (:mod:`kvredis.redis.ops`) through an executor
(:mod:`kvredis.redis.executor`), so they behave the same by construction.

Failures: constructing a :class:`RedisIndex` (connecting an :class:`AsyncRedisIndex`) pings the
server and raises :class:`~kvredis.errors.BackendUnavailableError` naming the address when it
cannot connect; later connection failures and timeouts raise the same after ``retries`` more
attempts with exponential backoff (every index call is idempotent: adds and evicts have set
semantics, and watermarked batches carry a token that recognises a resend of a call that was
applied but whose reply was lost). A call therefore gives up after at most
about ``(retries + 1) * max(socket_timeout, connect_timeout)`` plus the backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import TypeVar

import redis
import redis.asyncio

from kvredis.batch import IndexOp, Watermark
from kvredis.checks import check_selection
from kvredis.errors import ConfigError, NamespaceMissingError
from kvredis.index import Progress
from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
from kvredis.redis.config import DEFAULT_VALKEY_ADDRESS, RedisIndexConfig, check_supported
from kvredis.redis.executor import AsyncExecutor, SyncExecutor
from kvredis.redis.functions import FunctionRegistry
from kvredis.redis.ops import (
    Weights,
    op_add,
    op_apply_batch,
    op_clear,
    op_connect,
    op_drop_namespace,
    op_evict,
    op_get_request_key,
    op_get_watermark,
    op_lookup,
    op_reset_watermark,
    op_run,
    op_score,
    op_score_by_rank,
)
from kvredis.redis.requests import Op
from kvredis.redis.scripts import ScriptRegistry
from kvredis.redis.session import RetryPolicy, Session, op_drive
from kvredis.redis.state import CoreState
from kvredis.types import Entries, Keys, KeyType, Lookup, Pods

logger = logging.getLogger(__name__)

T = TypeVar("T")



class _Facade:
    """What both index classes hold: the checked config and the session their operations use."""

    def __init__(self, config: RedisIndexConfig | None) -> None:
        cfg = RedisIndexConfig() if config is None else config
        if not isinstance(cfg, RedisIndexConfig):
            raise ConfigError(f"config must be a RedisIndexConfig, got {cfg!r}")
        check_supported(cfg)
        if cfg.cluster:
            raise ConfigError(
                f"{cfg.server()} is a cluster address: use RedisClusterIndex "
                "(kvredis.redis.cluster.index), or new_redis_index(), which picks it"
            )
        self.config = cfg
        if cfg.enable_rdma:
            logger.warning(
                "enable_rdma is set for %s, but the Python client does not support RDMA; using TCP",
                cfg.parsed_address().display,
            )
        self._session = Session(
            CoreState(cfg.namespace, cfg.bucket_bits),
            FunctionRegistry(use=cfg.use_functions),
            RetryPolicy(cfg.retries, cfg.retry_backoff, cfg.server()),
        )
        self._session.state.address = cfg.parsed_address().display

    def _op(self, factory: Callable[[CoreState], Op[T]]) -> Op[T]:
        """The operation ``factory(state)``, run with namespace loading and stale reloads."""
        state = self._session.state
        return op_run(self._session, lambda: factory(state))

    @property
    def namespace(self) -> str:
        """The namespace all keys of this index live under."""
        return self.config.namespace

    @property
    def backend_label(self) -> str:
        """``redis`` or ``valkey`` (the config's ``backend_type``), for metrics and traces."""
        return str(self.config.backend_type)

    @property
    def registry(self) -> ScriptRegistry:
        """The Lua script registry of this client (calls by FCALL, or EVALSHA)."""
        return self._session.registry

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.server()}, namespace={self.namespace!r})"


class RedisIndex(_Facade):
    """The Index (and BatchIndex) in a Redis or Valkey server; thread-safe.

    Besides the :class:`~kvredis.index.Index` methods it offers :meth:`score` (the
    LongestPrefixScorer computed in Redis), :meth:`apply_batch` with watermarks, and a progress
    callback on :meth:`clear`. Close it with :meth:`close` (or use it as a context manager).
    """

    def __init__(self, config: RedisIndexConfig | None = None) -> None:
        super().__init__(config)
        self._exec = SyncExecutor(self.config)
        try:
            self._exec.run(op_connect(self._session, self.config.strict))
        except BaseException:
            self._exec.close()
            raise

    @property
    def bucket_bits(self) -> int:
        """Bucket bits of the namespace (fixed by its first client)."""
        return self._session.state.layout.bucket_bits

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client (for inspection and benchmarks)."""
        return self._exec.client

    @property
    def round_trips(self) -> int:
        """Round trips to the server so far (read by :class:`kvredis.metrics.InstrumentedIndex`)."""
        return self._exec.round_trips

    def lookup(self, request_keys: Keys, pod_identifier_set: Pods = None) -> Lookup:
        """Entries per key along the chain, stopping at the first key no (filtered) pod holds."""
        return self._exec.run(self._op(lambda s: op_lookup(s, request_keys, pod_identifier_set)))

    def score(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, float]:
        """Per-pod longest-prefix scores, computed in Redis (same floats as LongestPrefixScorer):
        each pod's best data-parallel rank's."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return self._exec.run(self._op(lambda s: op_score(s, *args)))

    def score_by_rank(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, dict[int, float]]:
        """pod -> data-parallel rank -> longest-prefix score, computed in Redis in the same
        calls as :meth:`score` (same floats as ``LongestPrefixScorer.score_by_rank``)."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return self._exec.run(self._op(lambda s: op_score_by_rank(s, *args)))

    def add(
        self,
        engine_keys: Keys | None,
        request_keys: Keys,
        entries: Entries,
        *,
        ttl: float | None = None,
    ) -> None:
        """Store every entry under every request key and record the engine→request mappings."""
        self._exec.run(self._op(lambda s: op_add(s, engine_keys, request_keys, entries, ttl)))

    def evict(self, key: int, key_type: KeyType, entries: Entries) -> None:
        """Remove exactly these entries; an engine key resolves to all its request keys."""
        self._exec.run(self._op(lambda s: op_evict(s, key, key_type, entries)))

    def get_request_key(self, engine_key: int) -> int:
        """The request key most recently mapped to ``engine_key``."""
        return self._exec.run(self._op(lambda s: op_get_request_key(s, engine_key)))

    def clear(self, pod_identifier: str, progress: Progress = None) -> None:
        """Remove every entry of the pod, page by page (see :func:`kvredis.redis.ops.op_clear`).

        ``progress(done, removed)``, if given, is called after every page with the number of
        bucket keys processed so far and the number of (request key, entry) pairs removed so far.
        """
        self.clear_with_progress(pod_identifier, progress)

    def clear_with_progress(self, pod_identifier: str, progress: Progress = None) -> int:
        """:meth:`clear`, returning the number of (request key, entry) pairs removed."""
        per_call = self.config.clear_fields_per_call
        return self._exec.run(self._op(lambda s: op_clear(s, pod_identifier, progress, per_call)))

    def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: Progress = None,
    ) -> int:
        """Remove the pod's entries on ``device_tiers`` of rank ``dp_rank`` (``None``: all), as
        :meth:`clear` does; returns the (request key, entry) pairs removed."""
        selection = check_selection(device_tiers, dp_rank)
        per_call = self.config.clear_fields_per_call
        return self._exec.run(
            self._op(lambda s: op_clear(s, pod_identifier, progress, per_call, selection=selection))
        )

    def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """Apply ``ops`` in order in one atomic script call, fenced by the stream's watermark."""
        return self._exec.run(self._op(lambda s: op_apply_batch(s, ops, stream, watermark)))

    def get_watermark(self, stream: str) -> Watermark | None:
        """The stored watermark of ``stream``, or ``None``."""
        return self._exec.run(self._op(lambda s: op_get_watermark(s, stream)))

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """Overwrite, or with ``None`` delete, the stored watermark of ``stream``."""
        self._exec.run(self._op(lambda s: op_reset_watermark(s, stream, watermark)))

    def drop_namespace(self) -> int:
        """Delete every key of this index's namespace; returns the number of keys deleted."""
        return self._exec.run(self._op(op_drop_namespace))

    def close(self) -> None:
        """Close the connections."""
        self._exec.close()

    def __enter__(self) -> RedisIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRedisIndex(_Facade):
    """The asyncio form of :class:`RedisIndex`: same methods, same semantics, as coroutines.

    The constructor does no I/O; the namespace is loaded (and the server pinged) by
    :meth:`connect`, by ``async with``, by :meth:`create`, or else by the first call. Close it
    with :meth:`aclose`.
    """

    def __init__(self, config: RedisIndexConfig | None = None) -> None:
        super().__init__(config)
        self._exec = AsyncExecutor(self.config)

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
        await self._exec.run(op_connect(self._session, self.config.strict))

    @property
    def client(self) -> redis.asyncio.Redis:
        """The underlying redis-py asyncio client."""
        return self._exec.client

    @property
    def round_trips(self) -> int:
        """See :attr:`RedisIndex.round_trips`."""
        return self._exec.round_trips

    async def lookup(self, request_keys: Keys, pod_identifier_set: Pods = None) -> Lookup:
        """See :meth:`RedisIndex.lookup`."""
        run = self._op(lambda s: op_lookup(s, request_keys, pod_identifier_set))
        return await self._exec.run(run)

    async def score(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, float]:
        """See :meth:`RedisIndex.score`."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return await self._exec.run(self._op(lambda s: op_score(s, *args)))

    async def score_by_rank(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, dict[int, float]]:
        """See :meth:`RedisIndex.score_by_rank`."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return await self._exec.run(self._op(lambda s: op_score_by_rank(s, *args)))

    async def add(
        self,
        engine_keys: Keys | None,
        request_keys: Keys,
        entries: Entries,
        *,
        ttl: float | None = None,
    ) -> None:
        """See :meth:`RedisIndex.add`."""
        await self._exec.run(self._op(lambda s: op_add(s, engine_keys, request_keys, entries, ttl)))

    async def evict(self, key: int, key_type: KeyType, entries: Entries) -> None:
        """See :meth:`RedisIndex.evict`."""
        await self._exec.run(self._op(lambda s: op_evict(s, key, key_type, entries)))

    async def get_request_key(self, engine_key: int) -> int:
        """See :meth:`RedisIndex.get_request_key`."""
        return await self._exec.run(self._op(lambda s: op_get_request_key(s, engine_key)))

    async def clear(self, pod_identifier: str, progress: Progress = None) -> None:
        """See :meth:`RedisIndex.clear` (``progress`` is a plain callable)."""
        await self.clear_with_progress(pod_identifier, progress)

    async def clear_with_progress(self, pod_identifier: str, progress: Progress = None) -> int:
        """See :meth:`RedisIndex.clear_with_progress`."""
        per_call = self.config.clear_fields_per_call
        run = self._op(lambda s: op_clear(s, pod_identifier, progress, per_call))
        return await self._exec.run(run)

    async def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: Progress = None,
    ) -> int:
        """See :meth:`RedisIndex.clear_entries`."""
        selection = check_selection(device_tiers, dp_rank)
        per_call = self.config.clear_fields_per_call
        run = self._op(
            lambda s: op_clear(s, pod_identifier, progress, per_call, selection=selection)
        )
        return await self._exec.run(run)

    async def drop_namespace(self) -> int:
        """See :meth:`RedisIndex.drop_namespace`."""
        return await self._exec.run(self._op(op_drop_namespace))

    async def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """See :meth:`RedisIndex.apply_batch`."""
        return await self._exec.run(self._op(lambda s: op_apply_batch(s, ops, stream, watermark)))

    async def get_watermark(self, stream: str) -> Watermark | None:
        """See :meth:`RedisIndex.get_watermark`."""
        return await self._exec.run(self._op(lambda s: op_get_watermark(s, stream)))

    async def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """See :meth:`RedisIndex.reset_watermark`."""
        await self._exec.run(self._op(lambda s: op_reset_watermark(s, stream, watermark)))

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


def new_redis_index(config: RedisIndexConfig | None = None) -> RedisIndex | RedisClusterIndex:
    """A :class:`RedisIndex` (default: ``redis://127.0.0.1:6379``, namespace ``kvblock``), or a
    :class:`~kvredis.redis.cluster.index.RedisClusterIndex` for a cluster config."""
    if config is not None and config.cluster:
        return RedisClusterIndex(config)
    return RedisIndex(config)


def new_valkey_index(config: RedisIndexConfig | None = None) -> RedisIndex | RedisClusterIndex:
    """:func:`new_redis_index` on Valkey (default: ``valkey://127.0.0.1:6379``, backend
    "valkey")."""
    if config is None:
        config = RedisIndexConfig(address=DEFAULT_VALKEY_ADDRESS, backend_type="valkey")
    elif config.backend_type != "valkey":
        config = replace(config, backend_type="valkey")
    return new_redis_index(config)


def new_async_redis_index(
    config: RedisIndexConfig | None = None,
) -> AsyncRedisIndex | AsyncRedisClusterIndex:
    """The asyncio index for ``config`` (:class:`AsyncRedisIndex`, or
    :class:`~kvredis.redis.cluster.index.AsyncRedisClusterIndex` for a cluster config), not
    connected yet: ``await index.connect()``, ``async with``, or the first call connects."""
    if config is not None and config.cluster:
        return AsyncRedisClusterIndex(config)
    return AsyncRedisIndex(config)


def drop_namespace(config: RedisIndexConfig) -> int:
    """Delete every key of the namespace of ``config``, whatever its layout (also one of an
    earlier or later kvredis, which :class:`RedisIndex` refuses to open, and one whose drop was
    cut short); returns the number of keys deleted, 0 when there was no namespace.

    The same steps as :meth:`RedisIndex.drop_namespace` (the generation becomes a tombstone
    first, so no client writes meanwhile), without loading the namespace; on a cluster address,
    :meth:`~kvredis.redis.cluster.index.RedisClusterIndex.drop_namespace`.
    """
    if not isinstance(config, RedisIndexConfig):
        raise ConfigError(f"config must be a RedisIndexConfig, got {config!r}")
    if config.cluster:
        try:
            cluster = RedisClusterIndex(config, create=False)
        except NamespaceMissingError:
            return 0
        try:
            return cluster.drop_namespace()
        finally:
            cluster.close()
    check_supported(config)
    state = CoreState(config.namespace, config.bucket_bits)
    session = Session(
        state, ScriptRegistry(), RetryPolicy(config.retries, config.retry_backoff, config.server())
    )
    executor = SyncExecutor(config)
    try:
        return executor.run(op_drive(session, op_drop_namespace(state)))
    finally:
        executor.close()

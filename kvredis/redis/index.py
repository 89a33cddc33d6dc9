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
from typing import Any, TypeVar

import redis
import redis.asyncio

from kvredis.batch import Batch, IndexOp, Watermark
from kvredis.checks import check_selection
from kvredis.errors import ConfigError
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import Progress
from kvredis.redis.config import RedisIndexConfig, check_supported
from kvredis.redis.executor import AsyncExecutor, SyncExecutor
from kvredis.redis.functions import FunctionRegistry
from kvredis.redis.ops import (
    Weights,
    op_add,
    op_apply_batch,
    op_apply_batches,
    op_block_key_scheme,
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
from kvredis.redis.session import RetryPolicy, Session
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
        self._session.state.wait_for_namespace = cfg.wait_for_namespace

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

    def apply_batches(self, batches: Sequence[Batch]) -> list[bool]:
        """Apply the batches in order, as few script calls as their work allows (one in the
        common case), each fenced by its stream's watermark (see
        :meth:`kvredis.index.MultiBatchIndex.apply_batches`)."""
        return self._exec.run(self._op(lambda s: op_apply_batches(s, batches)))

    def get_watermark(self, stream: str) -> Watermark | None:
        """The stored watermark of ``stream``, or ``None``."""
        return self._exec.run(self._op(lambda s: op_get_watermark(s, stream)))

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """Overwrite, or with ``None`` delete, the stored watermark of ``stream``."""
        self._exec.run(self._op(lambda s: op_reset_watermark(s, stream, watermark)))

    def drop_namespace(self) -> int:
        """Delete every key of this index's namespace; returns the number of keys deleted."""
        return self._exec.run(self._op(op_drop_namespace))

    def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """See :meth:`kvredis.index.SchemeIndex.check_block_key_scheme`."""
        return self._exec.run(self._op(lambda s: op_block_key_scheme(s, scheme, record)))

    def close(self) -> None:
        """Close the connections."""
        self._exec.close()

    def __enter__(self) -> RedisIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRedisIndex(_Facade):
    """The asyncio form of :class:`RedisIndex`: same methods, same semantics, as coroutines.

    The constructor does no I/O; the client connects (what constructing a :class:`RedisIndex`
    does: it pings the server, checks that it is no cluster node, learns how it expires
    entries, settles on the function library or EVALSHA, loads the namespace and checks the
    eviction policy) in :meth:`connect`, ``async with``, :meth:`create`, or else in its first
    call. Close it with :meth:`aclose`.
    """

    def __init__(self, config: RedisIndexConfig | None = None) -> None:
        super().__init__(config)
        self._exec = AsyncExecutor(self.config)
        self._connected = False

    def _op(self, factory: Callable[[CoreState], Op[T]]) -> Op[T]:
        """The operation, after the whole connect when this client has not connected yet."""
        op = super()._op(factory)
        return op if self._connected else self._connect_first(op)

    def _connect_first(self, op: Op[T]) -> Op[T]:
        if not self._connected:  # another call may have connected meanwhile
            yield from op_connect(self._session, self.config.strict)
            self._connected = True
        return (yield from op)

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
        """Connect as :class:`RedisIndex` does when it is built (BackendUnavailableError if the
        server is unreachable)."""
        await self._exec.run(op_connect(self._session, self.config.strict))
        self._connected = True

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

    async def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """See :meth:`kvredis.index.SchemeIndex.check_block_key_scheme`."""
        run = self._op(lambda s: op_block_key_scheme(s, scheme, record))
        return await self._exec.run(run)

    async def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """See :meth:`RedisIndex.apply_batch`."""
        return await self._exec.run(self._op(lambda s: op_apply_batch(s, ops, stream, watermark)))

    async def apply_batches(self, batches: Sequence[Batch]) -> list[bool]:
        """See :meth:`RedisIndex.apply_batches`."""
        return await self._exec.run(self._op(lambda s: op_apply_batches(s, batches)))

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


#: The factories, which pick the cluster index for a cluster config, are in
#: :mod:`kvredis.redis.factories` (this module knows no cluster); imports of them from here work.
_FACTORIES = frozenset(
    {"new_redis_index", "new_valkey_index", "new_async_redis_index", "drop_namespace"}
)


def __getattr__(name: str) -> Any:
    """The factories' old place (PEP 562): loaded from :mod:`kvredis.redis.factories`."""
    if name in _FACTORIES:
        from kvredis.redis import factories

        return getattr(factories, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The index on a Redis Cluster or Valkey cluster: :class:`RedisClusterIndex` (thread-safe) and
:class:`AsyncRedisClusterIndex` (asyncio).

Same methods and semantics as :class:`~kvredis.redis.index.RedisIndex`, except where pods on
different shards do not share engine-key mappings and a write spanning shards is one atomic
step per shard (see :mod:`kvredis.redis.cluster.ops`, :mod:`.writes` and
``docs/design/cluster.md``). Both run the sans-IO cluster operations of :mod:`.ops` and
:mod:`.writes` with the executors of :mod:`.executor`; nothing here knows about slots or
redirections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from kvredis.batch import Batch, IndexOp, Watermark
from kvredis.checks import check_selection
from kvredis.errors import ConfigError
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import Progress
from kvredis.redis.cluster.core import ClusterCore, ReadFrom, op_cluster_connect
from kvredis.redis.cluster.executor import AsyncClusterExecutor, SyncClusterExecutor
from kvredis.redis.cluster.migrate import (
    ClusterMigrationReport,
    MoveProgress,
    op_cluster_migrate,
    op_converting,
)
from kvredis.redis.cluster.ops import (
    op_cluster_block_key_scheme,
    op_cluster_clear,
    op_cluster_drop,
    op_cluster_get_request_key,
    op_cluster_lookup,
    op_cluster_score,
    op_cluster_score_by_rank,
)
from kvredis.redis.cluster.routing import WaveOp
from kvredis.redis.cluster.writes import (
    op_cluster_add,
    op_cluster_apply_batch,
    op_cluster_apply_batches,
    op_cluster_evict,
    op_cluster_get_watermark,
    op_cluster_reset_watermark,
)
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.functions import FunctionRegistry
from kvredis.redis.session import RetryPolicy
from kvredis.types import Keys, KeyType, Lookup, PodEntry, Pods

T = TypeVar("T")
logger = logging.getLogger(__name__)


def _read_from(read_from_replicas: object) -> ReadFrom:
    if read_from_replicas == "spread":
        return "spread"
    return "replicas" if read_from_replicas else "primary"


class _ClusterFacade:
    """The checked config and the cluster core both index classes run their operations on."""

    def __init__(self, config: RedisIndexConfig | None) -> None:
        if not isinstance(config, RedisIndexConfig):
            raise ConfigError(f"config must be a RedisIndexConfig, got {config!r}")
        if not config.cluster:
            raise ConfigError(
                f"{config.server()} is no cluster address: use redis+cluster://host:port"
                "[,host:port...] or cluster=True (or RedisIndex for a single server)"
            )
        self.config = config

    def _core(self, executor: SyncClusterExecutor | AsyncClusterExecutor) -> ClusterCore:
        cfg = self.config
        core = ClusterCore(
            cfg.namespace,
            cfg.bucket_bits,
            cfg.cluster_shards,
            executor.cluster_state,
            executor.wave_policy,
            RetryPolicy(cfg.retries, cfg.retry_backoff, cfg.server()),
            _read_from(cfg.read_from_replicas),
        )
        core.wait_replicas = cfg.cluster_wait_replicas
        core.wait_for_namespace = cfg.wait_for_namespace
        core.registry = FunctionRegistry(use=cfg.use_functions)
        core.wait_timeout_ms = max(1, int(cfg.socket_timeout * 500))
        return core

    @property
    def namespace(self) -> str:
        """The namespace all keys of this index live under."""
        return self.config.namespace

    @property
    def backend_label(self) -> str:
        """``redis`` or ``valkey`` (the config's ``backend_type``), as on one server."""
        return str(self.config.backend_type)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.server()}, namespace={self.namespace!r})"


class RedisClusterIndex(_ClusterFacade):
    """The Index (and BatchIndex, ScoringIndex, NamespaceIndex) on a cluster; thread-safe.

    Connects when built: fetches the slot map, reads or creates the namespace's descriptor and
    loads every shard (``create=False``: a missing namespace raises
    :class:`~kvredis.errors.NamespaceMissingError` instead of being created). Close it with
    :meth:`close` (or use it as a context manager).
    """

    def __init__(self, config: RedisIndexConfig | None = None, *, create: bool = True) -> None:
        super().__init__(config)
        self._exec = SyncClusterExecutor(self.config)
        self.core = self._core(self._exec)
        try:
            self._run(lambda core: op_cluster_connect(core, self.config.strict, create))
        except BaseException:
            self._exec.close()
            raise

    def _run(self, op: Callable[[ClusterCore], WaveOp[T]]) -> T:
        return self._exec.run(op_converting(self.core, op(self.core)))

    @property
    def shards(self) -> int:
        """The number of shards of the namespace (fixed by its first client)."""
        return self.core.count

    @property
    def bucket_bits(self) -> int:
        """Bucket bits of the namespace's shards."""
        return self.core.state(0).layout.bucket_bits

    @property
    def executor(self) -> SyncClusterExecutor:
        """The cluster executor (slot map, raw waves; for inspection and benchmarks)."""
        return self._exec

    @property
    def round_trips(self) -> int:
        """Round trips so far: a wave counts one per node it involves."""
        return self._exec.round_trips

    def lookup(self, request_keys: Keys, pod_identifier_set: Pods = None) -> Lookup:
        """Entries per key along the chain, stopping at the first key no (filtered) pod holds."""
        return self._run(lambda c: op_cluster_lookup(c, request_keys, pod_identifier_set))

    def score(
        self, request_keys: Keys, medium_weights: Any = None, pod_identifier_set: Pods = None
    ) -> dict[str, float]:
        """Per-pod longest-prefix scores (the same floats as LongestPrefixScorer): each pod's
        best data-parallel rank's."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return self._run(lambda c: op_cluster_score(c, *args))

    def score_by_rank(
        self, request_keys: Keys, medium_weights: Any = None, pod_identifier_set: Pods = None
    ) -> dict[str, dict[int, float]]:
        """pod -> data-parallel rank -> longest-prefix score, from the same lookup as
        :meth:`score` (the same floats as ``LongestPrefixScorer.score_by_rank``)."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return self._run(lambda c: op_cluster_score_by_rank(c, *args))

    def add(
        self,
        engine_keys: Keys | None,
        request_keys: Keys,
        entries: Sequence[PodEntry],
        *,
        ttl: float | None = None,
    ) -> None:
        """Store every entry under every request key and record the engine→request mappings."""
        self._run(lambda c: op_cluster_add(c, engine_keys, request_keys, entries, ttl))

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """Remove exactly these entries; an engine key resolves to all its request keys."""
        self._run(lambda c: op_cluster_evict(c, key, key_type, entries))

    def get_request_key(self, engine_key: int) -> int:
        """The request key most recently mapped to ``engine_key``."""
        return self._run(lambda c: op_cluster_get_request_key(c, engine_key))

    def clear(self, pod_identifier: str, progress: Progress = None) -> None:
        """Remove every entry of the pod (on the pod's shard, mappings included)."""
        self.clear_with_progress(pod_identifier, progress)

    def clear_with_progress(self, pod_identifier: str, progress: Progress = None) -> int:
        """:meth:`clear`, returning the number of (request key, entry) pairs removed."""
        per_call = self.config.clear_fields_per_call
        return self._run(lambda c: op_cluster_clear(c, pod_identifier, progress, per_call))

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
        return self._run(
            lambda c: op_cluster_clear(c, pod_identifier, progress, per_call, selection)
        )

    def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """Apply ``ops`` in order, fenced by the stream's watermark in each shard they reach
        (one shard, the pod's, for an engine batch)."""
        return self._run(lambda c: op_cluster_apply_batch(c, ops, stream, watermark))

    def apply_batches(self, batches: Sequence[Batch]) -> list[bool]:
        """Apply each ``(ops, stream, watermark)`` as :meth:`apply_batch` would, in order,
        except that once a batch of a stream is not applied, the stream's later batches are not
        applied either (False); one script call per node involved."""
        return self._run(lambda c: op_cluster_apply_batches(c, batches))

    def get_watermark(self, stream: str) -> Watermark | None:
        """The stream's watermark (the highest over the shards)."""
        return self._run(lambda c: op_cluster_get_watermark(c, stream))

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """Overwrite, or with ``None`` delete, the stream's watermark on every shard."""
        self._run(lambda c: op_cluster_reset_watermark(c, stream, watermark))

    def drop_namespace(self) -> int:
        """Delete every key of the namespace on every node; the number of keys deleted."""
        return self._run(op_cluster_drop)

    def migrate(self, progress: MoveProgress | None = None) -> ClusterMigrationReport:
        """Convert a namespace of the key layout to the pod layout, in place and online
        (:mod:`kvredis.redis.cluster.migrate`); a namespace of the pod layout is left alone.
        ``progress(shards done, shards)`` follows the mover."""
        if progress is None:
            return self._exec.run(op_cluster_migrate(self.core))
        return self._exec.run(op_cluster_migrate(self.core, progress))

    def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """See :meth:`kvredis.index.SchemeIndex.check_block_key_scheme` (every shard records
        it)."""
        return self._run(lambda c: op_cluster_block_key_scheme(c, scheme, record))

    def close(self) -> None:
        """Close every node's connections."""
        self._exec.close()

    def __enter__(self) -> RedisClusterIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRedisClusterIndex(_ClusterFacade):
    """The asyncio form of :class:`RedisClusterIndex`: same methods, as coroutines.

    The constructor does no I/O: :meth:`connect`, ``async with`` or :meth:`create` connect (or
    else the first call does).
    """

    def __init__(self, config: RedisIndexConfig | None = None) -> None:
        super().__init__(config)
        self._exec = AsyncClusterExecutor(self.config)
        self.core = self._core(self._exec)
        self._connected = False

    @classmethod
    async def create(cls, config: RedisIndexConfig | None = None) -> AsyncRedisClusterIndex:
        """Build the index and :meth:`connect` it."""
        index = cls(config)
        try:
            await index.connect()
        except BaseException:
            await index.aclose()
            raise
        return index

    async def connect(self) -> None:
        """Fetch the slot map and load the namespace's shards."""
        await self._exec.run(op_cluster_connect(self.core, self.config.strict))
        self._connected = True

    async def _run(self, op: Callable[[ClusterCore], WaveOp[T]]) -> T:
        if not self._connected:
            await self.connect()
        return await self._exec.run(op_converting(self.core, op(self.core)))

    @property
    def shards(self) -> int:
        """See :attr:`RedisClusterIndex.shards`."""
        return self.core.count

    @property
    def round_trips(self) -> int:
        """See :attr:`RedisClusterIndex.round_trips`."""
        return self._exec.round_trips

    async def lookup(self, request_keys: Keys, pod_identifier_set: Pods = None) -> Lookup:
        """See :meth:`RedisClusterIndex.lookup`."""
        return await self._run(lambda c: op_cluster_lookup(c, request_keys, pod_identifier_set))

    async def score(
        self, request_keys: Keys, medium_weights: Any = None, pod_identifier_set: Pods = None
    ) -> dict[str, float]:
        """See :meth:`RedisClusterIndex.score`."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return await self._run(lambda c: op_cluster_score(c, *args))

    async def score_by_rank(
        self, request_keys: Keys, medium_weights: Any = None, pod_identifier_set: Pods = None
    ) -> dict[str, dict[int, float]]:
        """See :meth:`RedisClusterIndex.score_by_rank`."""
        args = (request_keys, medium_weights, pod_identifier_set)
        return await self._run(lambda c: op_cluster_score_by_rank(c, *args))

    async def add(
        self,
        engine_keys: Keys | None,
        request_keys: Keys,
        entries: Sequence[PodEntry],
        *,
        ttl: float | None = None,
    ) -> None:
        """See :meth:`RedisClusterIndex.add`."""
        await self._run(lambda c: op_cluster_add(c, engine_keys, request_keys, entries, ttl))

    async def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """See :meth:`RedisClusterIndex.evict`."""
        await self._run(lambda c: op_cluster_evict(c, key, key_type, entries))

    async def get_request_key(self, engine_key: int) -> int:
        """See :meth:`RedisClusterIndex.get_request_key`."""
        return await self._run(lambda c: op_cluster_get_request_key(c, engine_key))

    async def clear(self, pod_identifier: str, progress: Progress = None) -> None:
        """See :meth:`RedisClusterIndex.clear`."""
        await self.clear_with_progress(pod_identifier, progress)

    async def clear_with_progress(self, pod_identifier: str, progress: Progress = None) -> int:
        """See :meth:`RedisClusterIndex.clear_with_progress`."""
        per_call = self.config.clear_fields_per_call
        return await self._run(lambda c: op_cluster_clear(c, pod_identifier, progress, per_call))

    async def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: Progress = None,
    ) -> int:
        """See :meth:`RedisClusterIndex.clear_entries`."""
        selection = check_selection(device_tiers, dp_rank)
        per_call = self.config.clear_fields_per_call
        return await self._run(
            lambda c: op_cluster_clear(c, pod_identifier, progress, per_call, selection)
        )

    async def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """See :meth:`RedisClusterIndex.apply_batch`."""
        return await self._run(lambda c: op_cluster_apply_batch(c, ops, stream, watermark))

    async def apply_batches(self, batches: Sequence[Batch]) -> list[bool]:
        """See :meth:`RedisClusterIndex.apply_batches`."""
        return await self._run(lambda c: op_cluster_apply_batches(c, batches))

    async def get_watermark(self, stream: str) -> Watermark | None:
        """See :meth:`RedisClusterIndex.get_watermark`."""
        return await self._run(lambda c: op_cluster_get_watermark(c, stream))

    async def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """See :meth:`RedisClusterIndex.reset_watermark`."""
        await self._run(lambda c: op_cluster_reset_watermark(c, stream, watermark))

    async def drop_namespace(self) -> int:
        """See :meth:`RedisClusterIndex.drop_namespace`."""
        return await self._run(op_cluster_drop)

    async def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """See :meth:`RedisClusterIndex.check_block_key_scheme`."""
        return await self._run(lambda c: op_cluster_block_key_scheme(c, scheme, record))

    async def aclose(self) -> None:
        """Close every node's connections."""
        await self._exec.aclose()

    async def close(self) -> None:
        """Alias of :meth:`aclose`."""
        await self.aclose()

    async def __aenter__(self) -> AsyncRedisClusterIndex:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

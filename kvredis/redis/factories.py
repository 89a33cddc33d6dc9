"""The index factories: the single-server index, or the cluster index for a cluster config.

:func:`new_redis_index`, :func:`new_valkey_index` and :func:`new_async_redis_index` build
:class:`~kvredis.redis.index.RedisIndex` / :class:`~kvredis.redis.index.AsyncRedisIndex`, or
their cluster counterparts of :mod:`kvredis.redis.cluster.index` when the config names a
cluster; :func:`drop_namespace` deletes a namespace of either kind. The only module of the
backend that knows both: the single-server index imports nothing of the cluster package.
"""

from __future__ import annotations

from dataclasses import replace

from kvredis.errors import ConfigError, NamespaceMissingError
from kvredis.redis.calls import CallChoice
from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
from kvredis.redis.config import DEFAULT_VALKEY_ADDRESS, RedisIndexConfig, check_supported
from kvredis.redis.executor import SyncExecutor
from kvredis.redis.index import AsyncRedisIndex, RedisIndex
from kvredis.redis.ops import op_drop_namespace
from kvredis.redis.session import RetryPolicy, Session, op_drive
from kvredis.redis.state import CoreState


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
    calls = CallChoice(config.use_functions, config.server())
    policy = RetryPolicy(config.retries, config.retry_backoff, config.server())
    session = Session(state, calls.registry, policy)
    executor = SyncExecutor(config)
    try:
        return executor.run(op_drive(session, calls.op(op_drop_namespace(state))))
    finally:
        executor.close()

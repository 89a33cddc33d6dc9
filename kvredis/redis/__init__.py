"""The Redis/Valkey backend: the KV-block index kept in one server shared by many router replicas.

Modules, in dependency order (each imports only the ones before it):

- ``address``   server addresses (``redis://``, ``rediss://``, ``valkey://``, ``unix://``, ...)
- ``requests``  the sans-IO vocabulary: ScriptCall, Command, Pipeline, Sleep, the Failures an
  executor throws into an operation
- ``codec``     byte encodings (text, hashes, pod entries, SCAN patterns)
- ``layout``    THE key layout of a namespace
- ``state``     what a client knows of its namespace (layout, entry dictionary)
- ``scripts``   the Lua script registry (``lua/``, includes expanded, SHA1s)
- ``functions`` the same scripts as the ``kvredis`` Redis Functions library, its version check,
  and the registry that calls it (FCALL / FCALL_RO, EVALSHA as the fallback)
- ``config``    RedisIndexConfig (and the checks of its fields: no cluster package, no operation)
- ``acl``       the ACL rules of each role on a namespace (``kvredis acl``)
- ``session``   the session an operation runs in: sending with retries, backoff and script or
  function reloads (``op_send``, ``op_drive``), and the checks of the server's INFO
- ``calls``     how a client that is not an index (inspector, drop, migrate) sends script calls:
  the function library where offered, else EVALSHA, chosen before its first script call
- ``program``   the write programs of adds, evicts and batches, their cost, the split into calls
- ``stamps``    the stamps a read in parts carries from call to call (StampBook), so the parts
  never credit a pod with more than it held at once
- ``ops``       the index operations as generators (lookup, score, add, evict, batches, clear,
  drop), and the stale-namespace reload around them
- ``replicas``  reads from replicas of a single server: discovery, choice, fallback (sans-IO)
- ``executor``  sync and asyncio executors: send one request with redis-py, nothing else
- ``reading``, ``check``, ``dump``, ``inspect``  the operator's reads: the namespace read with
  plain commands, ``kvredis check`` and its repair, dump and restore, statistics and the
  Inspector that drives them
- ``merge``     a cluster dump's shards merged into one namespace (``kvredis restore`` into one
  server)
- ``migrate``   converting a namespace of an earlier layout in place (``kvredis migrate``)
- ``index``     RedisIndex and AsyncRedisIndex (a single server: nothing of the cluster package)
- ``cluster/``  the index on a Redis Cluster: shards, key slots, MOVED/ASK, the slot map,
  parallel waves per node, the cluster operations, RedisClusterIndex (its ``executor`` and
  ``index`` load redis-py; the rest is sans-IO)
- ``factories`` ``new_redis_index``, ``new_valkey_index``, ``new_async_redis_index`` and
  ``drop_namespace``, which pick the cluster index for a cluster config

Everything but ``executor`` and the modules that drive it (``inspect``, ``migrate``, ``index``,
the cluster's ``executor``, ``index`` and ``inspect``, and ``factories``) is sans-IO: importing
it loads no redis-py. The public names below are loaded lazily (PEP 562), so ``import
kvredis.redis`` does not load redis-py either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "AsyncRedisIndex": "kvredis.redis.index",
    "RedisIndex": "kvredis.redis.index",
    "new_redis_index": "kvredis.redis.factories",
    "new_valkey_index": "kvredis.redis.factories",
    "new_async_redis_index": "kvredis.redis.factories",
    "AsyncRedisClusterIndex": "kvredis.redis.cluster.index",
    "RedisClusterIndex": "kvredis.redis.cluster.index",
    "RedisIndexConfig": "kvredis.redis.config",
    "bucket_bits_for": "kvredis.redis.layout",
    "RedisAddress": "kvredis.redis.address",
    "mask_password": "kvredis.redis.address",
    "parse_address": "kvredis.redis.address",
}

__all__ = [
    "AsyncRedisClusterIndex",
    "AsyncRedisIndex",
    "RedisAddress",
    "RedisClusterIndex",
    "RedisIndex",
    "RedisIndexConfig",
    "bucket_bits_for",
    "mask_password",
    "new_async_redis_index",
    "new_redis_index",
    "new_valkey_index",
    "parse_address",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from kvredis.redis.address import RedisAddress, mask_password, parse_address
    from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
    from kvredis.redis.config import RedisIndexConfig
    from kvredis.redis.factories import new_async_redis_index, new_redis_index, new_valkey_index
    from kvredis.redis.index import AsyncRedisIndex, RedisIndex
    from kvredis.redis.layout import bucket_bits_for

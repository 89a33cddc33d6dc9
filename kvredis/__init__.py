"""kvredis: a shared KV-cache block index for LLM routers, kept in Redis or Valkey.

Everything public is re-exported here, lazily (PEP 562): ``import kvredis`` loads neither pyzmq nor
redis-py; a name is imported from its module on first use. The submodules hold the
implementations.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvredis._version import __version__

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # values, errors, contracts
    "EMPTY_BLOCK_HASH": "kvredis.types",
    "BlockHash": "kvredis.types",
    "GroupMetadata": "kvredis.types",
    "KeyType": "kvredis.types",
    "PodEntry": "kvredis.types",
    "GroupCatalog": "kvredis.groups",
    "BackendAuthenticationError": "kvredis.errors",
    "BackendError": "kvredis.errors",
    "BackendOutOfMemoryError": "kvredis.errors",
    "UnsafeServerConfigError": "kvredis.errors",
    "BackendUnavailableError": "kvredis.errors",
    "ClusterModeError": "kvredis.errors",
    "ConfigError": "kvredis.errors",
    "EngineKeyNotFoundError": "kvredis.errors",
    "InvalidInputError": "kvredis.errors",
    "KVRedisError": "kvredis.errors",
    "NamespaceLayoutError": "kvredis.errors",
    "NamespaceMissingError": "kvredis.errors",
    "CallBudgetError": "kvredis.errors",
    "StaleNamespaceError": "kvredis.errors",
    "BlockKeySchemeError": "kvredis.errors",
    "ProtocolVersionError": "kvredis.errors",
    "AddOp": "kvredis.batch",
    "Batch": "kvredis.batch",
    "EvictOp": "kvredis.batch",
    "IndexOp": "kvredis.batch",
    "Watermark": "kvredis.batch",
    "AsyncIndex": "kvredis.index",
    "AsyncBatchIndex": "kvredis.index",
    "AsyncMultiBatchIndex": "kvredis.index",
    "AsyncRankScoringIndex": "kvredis.index",
    "AsyncScoringIndex": "kvredis.index",
    "BatchIndex": "kvredis.index",
    "Index": "kvredis.index",
    "LabelledIndex": "kvredis.index",
    "MultiBatchIndex": "kvredis.index",
    "NamespaceIndex": "kvredis.index",
    "ProgressClearIndex": "kvredis.index",
    "RankScoringIndex": "kvredis.index",
    "ScoringIndex": "kvredis.index",
    "SchemeIndex": "kvredis.index",
    "AsyncSchemeIndex": "kvredis.index",
    "SelectiveClearIndex": "kvredis.index",
    "parse_size": "kvredis.jsonconfig",
    "parse_duration": "kvredis.jsonconfig",
    # hashing and features
    "DEFAULT_BLOCK_SIZE": "kvredis.hashing.config",
    "HASH_ALGOS": "kvredis.hashing.config",
    "ChunkedTokenDatabase": "kvredis.hashing.database",
    "TokenProcessor": "kvredis.hashing.database",
    "TokenProcessorConfig": "kvredis.hashing.config",
    "BlockKeyScheme": "kvredis.hashing.config",
    "BlockExtraFeatures": "kvredis.features",
    "MMHash": "kvredis.features",
    "PlaceholderRange": "kvredis.features",
    "compute_block_extra_features": "kvredis.features",
    "parse_raw_extra_keys": "kvredis.features",
    "realign_extra_features": "kvredis.features",
    "split_extra_keys": "kvredis.features",
    "ExtraKeys": "kvredis.features",
    "PROMPT_EMBEDS_PREFIX": "kvredis.features",
    "TierMap": "kvredis.tiers",
    "DEFAULT_TIERS": "kvredis.tiers",
    # backends, scoring, configuration
    "CostAwareMemoryIndex": "kvredis.memory",
    "CostAwareMemoryIndexConfig": "kvredis.memory",
    "InMemoryIndex": "kvredis.memory",
    "InMemoryIndexConfig": "kvredis.memory",
    "DEFAULT_MEDIUM_WEIGHTS": "kvredis.scoring",
    "LongestPrefixScorer": "kvredis.scoring",
    "Indexer": "kvredis.indexer",
    "IndexConfig": "kvredis.config",
    "new_index": "kvredis.config",
    "RedisAddress": "kvredis.redis.address",
    "mask_password": "kvredis.redis.address",
    "parse_address": "kvredis.redis.address",
    "AsyncRedisIndex": "kvredis.redis.index",
    "RedisIndex": "kvredis.redis.index",
    "RedisIndexConfig": "kvredis.redis.config",
    "new_redis_index": "kvredis.redis.factories",
    "new_valkey_index": "kvredis.redis.factories",
    "new_async_redis_index": "kvredis.redis.factories",
    "drop_namespace": "kvredis.redis.factories",
    "MigrationReport": "kvredis.redis.migrate",
    "migrate_namespace": "kvredis.redis.migrate",
    "migrate_namespace_async": "kvredis.redis.migrate",
    "AsyncRedisClusterIndex": "kvredis.redis.cluster.index",
    "RedisClusterIndex": "kvredis.redis.cluster.index",
    # event ingestion
    "AllBlocksCleared": "kvredis.ingest.events",
    "BlockRemoved": "kvredis.ingest.events",
    "BlockStored": "kvredis.ingest.events",
    "DecodedBatch": "kvredis.ingest.events",
    "Rejection": "kvredis.ingest.events",
    "RejectReason": "kvredis.ingest.events",
    "WireError": "kvredis.ingest.events",
    "decode_batch": "kvredis.ingest.events",
    "encode_batch": "kvredis.ingest.events",
    "parse_topic": "kvredis.ingest.events",
    "BatchOutcome": "kvredis.ingest",
    "EndpointConfig": "kvredis.ingest",
    "EventIngester": "kvredis.ingest",
    "IngestCounters": "kvredis.ingest",
    "IngesterConfig": "kvredis.ingest",
    "MessageSink": "kvredis.ingest",
    "BurstSink": "kvredis.ingest",
    "ReplayClient": "kvredis.ingest",
    "ReplayedMessage": "kvredis.ingest",
    "ZmqReplayClient": "kvredis.ingest.zmq",
    # observability
    "AsyncInstrumentedIndex": "kvredis.metrics",
    "InstrumentedIndex": "kvredis.metrics",
    "AsyncTracedIndex": "kvredis.tracing",
    "TracedIndex": "kvredis.tracing",
    "IngestMetrics": "kvredis.ingest.metrics",
}

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MEDIUM_WEIGHTS",
    "DEFAULT_TIERS",
    "EMPTY_BLOCK_HASH",
    "HASH_ALGOS",
    "PROMPT_EMBEDS_PREFIX",
    "AddOp",
    "AllBlocksCleared",
    "AsyncBatchIndex",
    "AsyncIndex",
    "AsyncInstrumentedIndex",
    "AsyncMultiBatchIndex",
    "AsyncRankScoringIndex",
    "AsyncRedisClusterIndex",
    "AsyncRedisIndex",
    "AsyncSchemeIndex",
    "AsyncScoringIndex",
    "AsyncTracedIndex",
    "BackendAuthenticationError",
    "BackendError",
    "BackendOutOfMemoryError",
    "BackendUnavailableError",
    "Batch",
    "BatchIndex",
    "BatchOutcome",
    "BlockExtraFeatures",
    "BlockHash",
    "BlockKeyScheme",
    "BlockKeySchemeError",
    "BlockRemoved",
    "BlockStored",
    "BurstSink",
    "CallBudgetError",
    "ChunkedTokenDatabase",
    "ClusterModeError",
    "ConfigError",
    "CostAwareMemoryIndex",
    "CostAwareMemoryIndexConfig",
    "DecodedBatch",
    "EndpointConfig",
    "EngineKeyNotFoundError",
    "EventIngester",
    "EvictOp",
    "ExtraKeys",
    "GroupCatalog",
    "GroupMetadata",
    "InMemoryIndex",
    "InMemoryIndexConfig",
    "Index",
    "IndexConfig",
    "IndexOp",
    "Indexer",
    "IngestCounters",
    "IngestMetrics",
    "IngesterConfig",
    "InstrumentedIndex",
    "InvalidInputError",
    "KVRedisError",
    "KeyType",
    "LabelledIndex",
    "LongestPrefixScorer",
    "MMHash",
    "MessageSink",
    "MigrationReport",
    "MultiBatchIndex",
    "NamespaceIndex",
    "NamespaceLayoutError",
    "NamespaceMissingError",
    "PlaceholderRange",
    "PodEntry",
    "ProgressClearIndex",
    "ProtocolVersionError",
    "RankScoringIndex",
    "RedisAddress",
    "RedisClusterIndex",
    "RedisIndex",
    "RedisIndexConfig",
    "RejectReason",
    "Rejection",
    "ReplayClient",
    "ReplayedMessage",
    "SchemeIndex",
    "ScoringIndex",
    "SelectiveClearIndex",
    "StaleNamespaceError",
    "TierMap",
    "TokenProcessor",
    "TokenProcessorConfig",
    "TracedIndex",
    "UnsafeServerConfigError",
    "Watermark",
    "WireError",
    "ZmqReplayClient",
    "__version__",
    "compute_block_extra_features",
    "decode_batch",
    "drop_namespace",
    "encode_batch",
    "mask_password",
    "migrate_namespace",
    "migrate_namespace_async",
    "new_async_redis_index",
    "new_index",
    "new_redis_index",
    "new_valkey_index",
    "parse_address",
    "parse_duration",
    "parse_raw_extra_keys",
    "parse_size",
    "parse_topic",
    "realign_extra_features",
    "split_extra_keys",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvredis' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from kvredis.batch import AddOp, Batch, EvictOp, IndexOp, Watermark
    from kvredis.config import IndexConfig, new_index
    from kvredis.errors import (
        BackendAuthenticationError,
        BackendError,
        BackendOutOfMemoryError,
        BackendUnavailableError,
        BlockKeySchemeError,
        CallBudgetError,
        ClusterModeError,
        ConfigError,
        EngineKeyNotFoundError,
        InvalidInputError,
        KVRedisError,
        NamespaceLayoutError,
        NamespaceMissingError,
        ProtocolVersionError,
        StaleNamespaceError,
        UnsafeServerConfigError,
    )
    from kvredis.features import (
        PROMPT_EMBEDS_PREFIX,
        BlockExtraFeatures,
        ExtraKeys,
        MMHash,
        PlaceholderRange,
        compute_block_extra_features,
        parse_raw_extra_keys,
        realign_extra_features,
        split_extra_keys,
    )
    from kvredis.groups import GroupCatalog
    from kvredis.hashing.config import (
        DEFAULT_BLOCK_SIZE,
        HASH_ALGOS,
        BlockKeyScheme,
        TokenProcessorConfig,
    )
    from kvredis.hashing.database import ChunkedTokenDatabase, TokenProcessor
    from kvredis.index import (
        AsyncBatchIndex,
        AsyncIndex,
        AsyncMultiBatchIndex,
        AsyncRankScoringIndex,
        AsyncSchemeIndex,
        AsyncScoringIndex,
        BatchIndex,
        Index,
        LabelledIndex,
        MultiBatchIndex,
        NamespaceIndex,
        ProgressClearIndex,
        RankScoringIndex,
        SchemeIndex,
        ScoringIndex,
        SelectiveClearIndex,
    )
    from kvredis.indexer import Indexer
    from kvredis.ingest import (
        BatchOutcome,
        BurstSink,
        EndpointConfig,
        EventIngester,
        IngestCounters,
        IngesterConfig,
        MessageSink,
        ReplayClient,
        ReplayedMessage,
    )
    from kvredis.ingest.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        DecodedBatch,
        Rejection,
        RejectReason,
        WireError,
        decode_batch,
        encode_batch,
        parse_topic,
    )
    from kvredis.ingest.metrics import IngestMetrics
    from kvredis.ingest.zmq import ZmqReplayClient
    from kvredis.jsonconfig import parse_duration, parse_size
    from kvredis.memory import (
        CostAwareMemoryIndex,
        CostAwareMemoryIndexConfig,
        InMemoryIndex,
        InMemoryIndexConfig,
    )
    from kvredis.metrics import AsyncInstrumentedIndex, InstrumentedIndex
    from kvredis.redis.address import RedisAddress, mask_password, parse_address
    from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
    from kvredis.redis.config import RedisIndexConfig
    from kvredis.redis.factories import (
        drop_namespace,
        new_async_redis_index,
        new_redis_index,
        new_valkey_index,
    )
    from kvredis.redis.index import AsyncRedisIndex, RedisIndex
    from kvredis.redis.migrate import (
        MigrationReport,
        migrate_namespace,
        migrate_namespace_async,
    )
    from kvredis.scoring import DEFAULT_MEDIUM_WEIGHTS, LongestPrefixScorer
    from kvredis.tiers import DEFAULT_TIERS, TierMap
    from kvredis.tracing import AsyncTracedIndex, TracedIndex
    from kvredis.types import EMPTY_BLOCK_HASH, BlockHash, GroupMetadata, KeyType, PodEntry

"""kvredis: a shared KV-cache block index for LLM routers, kept in Redis or Valkey.

Everything public is re-exported here; submodules hold the implementations.
"""

from kvredis.address import RedisAddress, parse_address
from kvredis.batch import AddOp, BatchIndex, EvictOp, IndexOp, Watermark
from kvredis.config import IndexConfig, new_index
from kvredis.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    EngineKeyNotFoundError,
    InvalidInputError,
    KVRedisError,
    NamespaceLayoutError,
)
from kvredis.events import (
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
from kvredis.features import (
    BlockExtraFeatures,
    MMHash,
    PlaceholderRange,
    compute_block_extra_features,
    parse_raw_extra_keys,
)
from kvredis.hashing import (
    DEFAULT_BLOCK_SIZE,
    HASH_ALGOS,
    ChunkedTokenDatabase,
    TokenProcessor,
    TokenProcessorConfig,
)
from kvredis.index import AsyncIndex, Index
from kvredis.indexer import Indexer
from kvredis.ingest import (
    BatchOutcome,
    EndpointConfig,
    EventIngester,
    IngestCounters,
    IngesterConfig,
    ReplayClient,
    ReplayedMessage,
)
from kvredis.memory import (
    CostAwareMemoryIndex,
    CostAwareMemoryIndexConfig,
    InMemoryIndex,
    InMemoryIndexConfig,
    parse_size,
)
from kvredis.redis_index import (
    AsyncRedisIndex,
    RedisIndex,
    RedisIndexConfig,
    new_redis_index,
    new_valkey_index,
)
from kvredis.scoring import DEFAULT_MEDIUM_WEIGHTS, LongestPrefixScorer
from kvredis.types import (
    EMPTY_BLOCK_HASH,
    BlockHash,
    GroupCatalog,
    GroupMetadata,
    KeyType,
    PodEntry,
)
from kvredis.zmq_transport import ZmqReplayClient

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MEDIUM_WEIGHTS",
    "EMPTY_BLOCK_HASH",
    "HASH_ALGOS",
    "AddOp",
    "AllBlocksCleared",
    "AsyncIndex",
    "AsyncRedisIndex",
    "BackendError",
    "BackendUnavailableError",
    "BatchIndex",
    "BatchOutcome",
    "BlockExtraFeatures",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ChunkedTokenDatabase",
    "ConfigError",
    "CostAwareMemoryIndex",
    "CostAwareMemoryIndexConfig",
    "DecodedBatch",
    "EndpointConfig",
    "EngineKeyNotFoundError",
    "EventIngester",
    "EvictOp",
    "GroupCatalog",
    "GroupMetadata",
    "InMemoryIndex",
    "InMemoryIndexConfig",
    "Index",
    "IndexConfig",
    "IndexOp",
    "Indexer",
    "IngestCounters",
    "IngesterConfig",
    "InvalidInputError",
    "KVRedisError",
    "KeyType",
    "LongestPrefixScorer",
    "MMHash",
    "NamespaceLayoutError",
    "PlaceholderRange",
    "PodEntry",
    "RedisAddress",
    "RedisIndex",
    "RedisIndexConfig",
    "RejectReason",
    "Rejection",
    "ReplayClient",
    "ReplayedMessage",
    "TokenProcessor",
    "TokenProcessorConfig",
    "Watermark",
    "WireError",
    "ZmqReplayClient",
    "__version__",
    "compute_block_extra_features",
    "decode_batch",
    "encode_batch",
    "new_index",
    "new_redis_index",
    "new_valkey_index",
    "parse_address",
    "parse_raw_extra_keys",
    "parse_size",
    "parse_topic",
]

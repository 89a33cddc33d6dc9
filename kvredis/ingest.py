"""Event ingestion: apply engine KV-cache event batches to an Index in order, once, fast.

:class:`EventIngester` takes an :class:`~kvredis.index.Index`, a token processor and endpoint
configurations. Engine messages ``(topic, seq, payload)`` come from ZMQ subscribers
(:mod:`kvredis.zmq_transport`, started by :meth:`EventIngester.start`) or are fed directly
(:meth:`EventIngester.process`, :meth:`EventIngester.submit`). Each message is decoded
(:mod:`kvredis.events`), translated into index operations with the llm-d event-pool semantics, and
applied.

Semantics (per event, in batch order)
-------------------------------------
* ``BlockStored`` → ``add(engine_keys, request_keys, [PodEntry(pod, tier[, group])])``. The model
  is ``lora_name`` when present, else the endpoint's/topic's model. A non-zero parent hash resolves
  to the parent's request key (first from what this ingester stored, then through
  ``Index.get_request_key``); an unresolvable parent skips the event (``parent_misses``).
  ``extra_keys`` go through :func:`kvredis.features.parse_raw_extra_keys` and are realigned to our
  block size (1:many replicates each engine block's features to its sub-blocks, many:1 merges the
  identifiers of the engine blocks inside one of ours, an item that continues across an engine
  block boundary counted once). With ``group_idx``
  the entry is grouped and the pod's :class:`~kvredis.types.GroupCatalog` learns the group.
  Without a full block of tokens but with hashes, the event is a tier update: each engine key
  resolves to its request key and the new tier's entry is added to those keys, with no mapping.
* ``BlockRemoved`` → ``evict(hash, ENGINE, [PodEntry(pod, tier[, group])])`` per hash.
* ``AllBlocksCleared`` → ``clear(pod)``.

Throughput
----------
With a :class:`~kvredis.batch.BatchIndex`, one engine batch becomes one
:meth:`~kvredis.batch.BatchIndex.apply_batch` call: one round trip to Redis in the common case.
Parents usually resolve from a bounded per-pod engine→request cache filled from what this ingester
stored (and from the batch itself), so no lookup round trip is needed. Any other Index gets the
operations one call at a time. Endpoints are sharded to worker threads by pod id (by endpoint
when the pod comes from the topic): one publisher's batches are applied in order by one worker,
different pods in parallel. Worker queues are bounded; a full queue blocks the receiver, and ZMQ
then drops at the publisher's high-water mark, which shows up as a sequence gap.

Reliability
-----------
Sequence numbers are tracked per endpoint. A gap is filled from the engine's replay endpoint
when one is configured, duplicates skipped. When replay cannot cover the gap the pod is cleared
and ingestion resumes (a stale index is worse than an empty one), unless nothing of the current
epoch had been applied yet (a missed prefix leaves nothing stale). ``seq`` going backwards means
the engine restarted: the pod is cleared and a new epoch begins.

High availability: watermarks and epochs
----------------------------------------
Several ingesters may consume the same publishers against one shared index. Each publisher is a
*stream* (``EndpointConfig.stream``, default: the pod id, else the endpoint address; replicas
must name streams alike) with a :class:`~kvredis.batch.Watermark` ``(epoch, position)`` stored in
the index and checked-and-advanced atomically with each batch, so a batch takes effect at most
once: the first replica's ``apply_batch`` wins, the others get ``False`` and skip it.

``position`` packs the engine ``seq`` and a 16-bit *phase*: ``((seq + 1) << 16) | phase``. A batch
applied in one step is stored at phase ``0xFFFF`` ("done"). A batch that needs several steps
(it contains ``AllBlocksCleared``, a clear precedes it after an uncoverable gap, or a parent
resolution must see the effect of an eviction earlier in the same batch) claims the stream with
its first step at phase 1 and advances the phase with every later step and, during a long clear,
every ``heartbeat_interval_s``; its last step stores phase ``0xFFFF``. A replica whose attempt
is refused reads the watermark: "done" at or past its batch means a duplicate; a lower phase means
a peer is mid-batch, so it waits (no later batch can be applied by it meanwhile), and if the phase
has not moved for ``takeover_timeout_s`` it takes the batch over at the next phase (re-running a
clear and the batch's operations, which are idempotent). A replica whose own plan of that batch
needs a single step applies it at phase "done", overtaking a stalled owner. A replica whose
heartbeat or later step is refused has lost the batch to a peer and stops.

Engine restarts. A replica that sees ``seq`` go backwards on its connection claims epoch
``E + 1`` (``E`` = the epoch it follows) at position ``(seq=-1, phase=1)``, clears the pod, and
stores ``(E + 1, (-1, done))``; batches of the new incarnation follow in epoch ``E + 1``. Two
replicas that detect the same restart both try to claim ``E + 1``; exactly one wins and clears,
the other sees epoch ``E + 1`` in progress or done, waits, adopts it and continues, so both agree
on the new epoch and the pod is cleared once. A replica that starts (or reconnects) and receives
``seq`` below the stored position cannot tell a restart from a peer that is ahead: it probes the
replay endpoint from the stored position (a publisher that has nothing at or after it has
restarted); without replay, a ``seq`` within ``restart_window`` batches of the stored position is
a peer slightly ahead, and one further below is a restart unless the stored watermark moves
within ``peer_grace_s`` (a live peer is ahead, or already started the new epoch).

Limits. An engine restart no replica witnessed, after which the new incarnation passed the stored
sequence number before any replica reconnected, is not detectable from sequence numbers alone and
is treated as a gap; without replay, a restart whose new incarnation is first seen within
``restart_window`` batches below the stored position is missed. Two restarts closer together than a
replica's reaction time may make a replica adopt the first new epoch for the second incarnation (it
then follows the peer that saw both). A replica that lost a batch other replicas received waits
``peer_grace_s`` for them before clearing, and a clear racing with a peer's batches can only remove
entries (under-reporting, never stale). A batch whose owner dies between steps is finished by a
takeover, so its idempotent operations may run twice; single-step batches (the common case) are
never applied twice. Sequence numbers of 2**47 - 1 and above are rejected.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark
from kvredis.checks import infer_mappings
from kvredis.errors import (
    BackendUnavailableError,
    ConfigError,
    EngineKeyNotFoundError,
    InvalidInputError,
)
from kvredis.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Rejection,
    RejectReason,
    decode_batch,
    parse_topic,
)
from kvredis.features import parse_raw_extra_keys, realign_extra_features
from kvredis.groups import GroupCatalog
from kvredis.index import BatchIndex, Index, ProgressClearIndex, apply_op
from kvredis.types import GroupMetadata, KeyType, PodEntry

if TYPE_CHECKING:
    from kvredis.hashing import TokenProcessor

__all__ = [
    "COUNTER_NAMES",
    "MAX_ENGINE_SEQ",
    "PHASE_DONE",
    "BatchOutcome",
    "EndpointConfig",
    "EventIngester",
    "IngestCounters",
    "IngesterConfig",
    "ReplayClient",
    "ReplayedMessage",
    "split_position",
    "stream_position",
]

logger = logging.getLogger(__name__)

PHASE_BITS = 16
PHASE_DONE = (1 << PHASE_BITS) - 1
_PHASE_LAST_STEP = PHASE_DONE - 1
MAX_ENGINE_SEQ = (1 << 47) - 2
"""Largest engine ``seq`` that fits a watermark position."""


def stream_position(seq: int, phase: int = PHASE_DONE) -> int:
    """The watermark position of engine batch ``seq`` (``-1``: epoch start) at ``phase``."""
    return ((seq + 1) << PHASE_BITS) | phase


def split_position(position: int) -> tuple[int, int]:
    """Inverse of :func:`stream_position`: ``(seq, phase)``."""
    return (position >> PHASE_BITS) - 1, position & PHASE_DONE


# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One engine publisher.

    ``endpoint`` is the ZMQ address of its PUB socket (any label when messages are fed directly).
    ``pod_id`` and ``model_name`` override what the ``kv@<pod>@<model>`` topic says (the engine
    default topic is empty). ``stream`` names the watermark stream; replicas of an HA deployment
    must use the same name for the same publisher (default: ``pod_id``, else ``endpoint``).
    """

    endpoint: str
    replay_endpoint: str | None = None
    pod_id: str | None = None
    model_name: str | None = None
    topic_filter: str = ""
    stream: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ConfigError("endpoint must be a non-empty string")
        for name in ("replay_endpoint", "pod_id", "model_name", "stream"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string or None, got {value!r}")
        if not isinstance(self.topic_filter, str):
            raise ConfigError("topic_filter must be a string")

    @property
    def stream_name(self) -> str:
        """The watermark stream of this publisher."""
        return self.stream or self.pod_id or self.endpoint

    @property
    def shard_key(self) -> str:
        """What picks the worker: the pod id when configured, else the endpoint."""
        return self.pod_id or self.endpoint


@dataclass(frozen=True, slots=True)
class IngesterConfig:
    """Tuning of an :class:`EventIngester` (the defaults suit production)."""

    workers: int = 4
    """Worker threads; endpoints are sharded across them."""
    queue_size: int = 1024
    """Messages buffered per worker before receivers block (backpressure)."""
    parent_cache_size: int = 131_072
    """Engine→request mappings remembered per pod for parent resolution."""
    use_watermarks: bool = True
    """Fence batches with per-stream watermarks when the index is a BatchIndex (HA-safe)."""
    replay_timeout_s: float = 2.0
    """Give up on a replay when the replay endpoint is silent this long."""
    max_replay_batches: int = 20_000
    peer_grace_s: float = 0.5
    """How long to wait for peers before clearing after a lost batch or an ambiguous restart."""
    takeover_timeout_s: float = 10.0
    """How long a peer's in-progress batch may stall before this replica takes it over."""
    heartbeat_interval_s: float = 1.0
    """How often a long clear advances its claim (the takeover clock of the others)."""
    restart_window: int = 32
    """Without replay, a fresh subscriber's ``seq`` this close below the stored position is
    taken for a peer that is slightly ahead, not for an engine restart."""
    poll_interval_s: float = 0.02
    backend_retry_max_s: float = 5.0
    """Backoff cap while the index backend is unavailable (batches are retried, not dropped)."""
    reject_log_interval_s: float = 10.0
    """Rejections of one reason are logged at most once per interval (all are counted)."""

    def __post_init__(self) -> None:
        for name in (
            "workers",
            "queue_size",
            "parent_cache_size",
            "max_replay_batches",
            "restart_window",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in (
            "replay_timeout_s",
            "peer_grace_s",
            "takeover_timeout_s",
            "heartbeat_interval_s",
            "poll_interval_s",
            "backend_retry_max_s",
            "reject_log_interval_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")


# ------------------------------------------------------------------------------------------
# Counters
# ------------------------------------------------------------------------------------------

COUNTER_NAMES = (
    "messages",
    "batches",
    "batches_applied",
    "batches_duplicate",
    "batches_failed",
    "batches_abandoned",
    "batches_rejected",
    "events",
    "events_applied",
    "blocks_stored",
    "blocks_removed",
    "request_keys_stored",
    "tier_updates",
    "tier_update_misses",
    "parent_misses",
    "index_calls",
    "index_lookups",
    "gaps",
    "replays",
    "replayed_batches",
    "replay_failures",
    "restarts",
    "epochs_adopted",
    "clears",
    "clears_all_blocks_cleared",
    "clears_restart",
    "clears_gap",
    "peer_waits",
    "takeovers",
    "lost_ownership",
    "backend_retries",
    "rejected",
    "received",
    "connects",
    "disconnects",
    "transport_errors",
)


class IngestCounters:
    """Thread-safe counters of everything the ingester counts.

    :meth:`snapshot` returns a flat ``dict``: the names in :data:`COUNTER_NAMES` plus
    ``rejected.<reason>`` for every :class:`~kvredis.events.RejectReason`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        for reason in RejectReason:
            self._values[f"rejected.{reason.value}"] = 0

    def inc(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def add_all(self, amounts: dict[str, int]) -> None:
        """Add several counters at once."""
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] = self._values.get(name, 0) + amount

    def reject(self, reason: RejectReason, amount: int = 1) -> None:
        """Count a rejection."""
        with self._lock:
            self._values["rejected"] += amount
            key = f"rejected.{reason.value}"
            self._values[key] = self._values.get(key, 0) + amount

    def get(self, name: str) -> int:
        """The current value of one counter."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter."""
        with self._lock:
            return dict(self._values)


class _RateLimitedLog:
    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self._interval:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
        if suppressed:
            message += f" (+{suppressed} similar suppressed)"
        logger.warning(message, *args)


# ------------------------------------------------------------------------------------------
# Replay client interface (implemented over ZMQ by kvredis.zmq_transport)
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayedMessage:
    """One batch returned by an engine's replay endpoint (``topic`` is ``b""`` when omitted)."""

    topic: bytes
    seq: int
    payload: bytes


class ReplayClient(Protocol):
    """Fetches buffered batches from an engine's replay endpoint."""

    def fetch(self, start_seq: int) -> list[ReplayedMessage] | None:
        """Every buffered batch with ``seq >= start_seq`` in order; ``None`` if unreachable."""
        ...

    def close(self) -> None:
        """Release the client's resources."""
        ...


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


class _LRU:
    """A bounded, thread-safe engine→request map (least recently used dropped)."""

    __slots__ = ("_data", "_limit", "_lock")

    def __init__(self, limit: int) -> None:
        self._data: OrderedDict[int, int] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, key: int) -> int | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: int, value: int) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self._limit:
                self._data.popitem(last=False)

    def pop(self, key: int) -> None:
        with self._lock:
            self._data.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class BatchOutcome(enum.Enum):
    """What happened to one engine message."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """Already applied (by a peer replica, by a replay, or before a restart of this ingester)."""
    FAILED = "failed"
    """The index raised an unexpected error; the batch was dropped (logged, counted)."""
    ABANDONED = "abandoned"
    """Shutdown interrupted a wait for the backend or a peer; the batch was not applied."""
    REJECTED = "rejected"
    """Nothing usable in the message (bad seq or payload, no pod); counted and logged."""


class _NotOwner(Exception):
    """The first step of a run was refused by the watermark."""


class _LostOwnership(Exception):
    """A later step or heartbeat of a run was refused: a peer took the batch over."""


class _Abandon(Exception):
    """Shutdown while waiting for the backend."""


class _Failed(Exception):
    """The index raised something a retry will not fix."""


@dataclass
class _Message:
    topic: bytes
    seq: int
    payload: bytes
    counted: bool = False


@dataclass
class _Stream:
    endpoint: EndpointConfig
    lock: threading.Lock = field(default_factory=threading.Lock)
    synced: bool = False
    epoch: int = 0
    last_seq: int | None = None
    known: tuple[int, int] | None = None
    """Last known stored position of ``epoch`` as ``(seq, phase)`` (None: nothing applied)."""
    pods: set[str] = field(default_factory=set)
    last_topic: bytes = b""
    replay: ReplayClient | None = None
    replay_ready: bool = False

    @property
    def name(self) -> str:
        return self.endpoint.stream_name

    def known_at_least(self, seq: int) -> bool:
        return self.known is not None and stream_position(*self.known) >= stream_position(seq)

    def dirty(self) -> bool:
        """Whether entries of the current epoch may have been applied from this stream."""
        return self.known is not None and self.known[0] >= 0


_STOP = object()


@dataclass(frozen=True, slots=True)
class _Queued:
    stream: _Stream
    topic: bytes
    seq: int
    payload: bytes


# ------------------------------------------------------------------------------------------
# One execution of one batch (possibly several steps)
# ------------------------------------------------------------------------------------------


class _Run:
    """Plans and applies one batch; see the module docstring for steps, phases and claims."""

    def __init__(
        self,
        ing: EventIngester,
        st: _Stream,
        epoch: int,
        seq: int,
        claim_seq: int,
        first_phase: int,
        pod: str | None,
    ) -> None:
        self.ing = ing
        self.st = st
        self.pod = pod
        self.cache = ing._cache(pod) if pod is not None else None
        self.epoch = epoch
        self.seq = seq
        self.claim_seq = claim_seq
        self.phase = first_phase
        self.steps = 0
        self.pending: list[IndexOp] = []
        self.batch_map: dict[int, int] = {}
        """Engine→request mappings added by this batch so far (not yet in the pod cache)."""
        self.pending_evicts: set[int] = set()
        """Engine keys evicted by ops not yet applied."""
        self.evicted: set[int] = set()
        """Engine keys evicted by this batch (and not re-added): the pod cache is stale there."""
        self.stats: dict[str, int] = {}
        self.rejects: list[Rejection] = []
        self.cleared: set[str] = set()
        self._last_beat = time.monotonic()

    def count(self, name: str, amount: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + amount

    # -- index steps -----------------------------------------------------------------------

    def _step(self, ops: list[IndexOp], position: int) -> None:
        ing = self.ing
        if not ing._fenced:
            ing._apply_unfenced(ops)
            return
        wm = Watermark(self.epoch, position)
        if not ing._apply_fenced(ops, self.st.name, wm):
            raise _NotOwner if self.steps == 0 else _LostOwnership
        self.steps += 1
        self.st.known = split_position(position)

    def flush(self) -> None:
        """Apply the pending ops as an intermediate step (the first one claims the batch)."""
        if self.phase > _PHASE_LAST_STEP:
            raise _Failed("too many steps in one batch")
        ops, self.pending = self.pending, []
        self._step(ops, stream_position(self.claim_seq, self.phase))
        self.phase += 1
        self.pending_evicts.clear()
        self._last_beat = time.monotonic()

    def finish(self) -> None:
        """Apply the remaining ops as the batch's last step (phase done)."""
        ops, self.pending = self.pending, []
        self._step(ops, stream_position(self.seq))
        self.pending_evicts.clear()

    def heartbeat(self, _done: int = 0, _total: int = 0) -> None:
        """Advance the claim during a long clear so peers see progress (or learn we lost it)."""
        if not self.ing._fenced:
            return
        now = time.monotonic()
        if now - self._last_beat < self.ing.config.heartbeat_interval_s:
            return
        if self.phase > _PHASE_LAST_STEP - 1:
            return
        self._last_beat = now
        self._step([], stream_position(self.claim_seq, self.phase))
        self.phase += 1

    def clear(self, pods: Iterable[str], cause: str) -> None:
        """Clear pods as a step of this batch (after applying what precedes it)."""
        self.flush()
        for pod in sorted(set(pods)):
            self.ing._clear_pod(pod, self.heartbeat)
            self.cleared.add(pod)
            self.count("clears")
            self.count(f"clears_{cause}")
        if self.pod is not None:
            self.cache = self.ing._cache(self.pod)
        self.batch_map.clear()
        self.evicted.clear()
        self.pending_evicts.clear()
        self._last_beat = time.monotonic()

    # -- planning helpers ------------------------------------------------------------------

    def add(self, op: AddOp, mappings: list[tuple[int, int]] | None) -> None:
        self.pending.append(op)
        if mappings:
            batch_map, evicted = self.batch_map, self.evicted
            for engine_key, request_key in mappings:
                batch_map[engine_key] = request_key
                evicted.discard(engine_key)

    def evict(self, keys: Sequence[int], entries: tuple[PodEntry, ...]) -> None:
        self.pending.extend([EvictOp(key, KeyType.ENGINE, entries) for key in keys])
        batch_map = self.batch_map
        for key in keys:
            batch_map.pop(key, None)
        self.pending_evicts.update(keys)
        self.evicted.update(keys)

    def resolve(self, engine_key: int) -> int | None:
        """The request key ``engine_key`` maps to, as if the batch so far were applied."""
        hit = self.batch_map.get(engine_key)
        if hit is not None:
            return hit
        if engine_key in self.evicted:
            if engine_key in self.pending_evicts:
                self.flush()
            return self.ing._index_request_key(engine_key, None, self)
        assert self.cache is not None
        cached = self.cache.get(engine_key)
        if cached is not None:
            return cached
        return self.ing._index_request_key(engine_key, self.cache, self)

    def commit_cache(self) -> None:
        """The batch took effect: the pod cache learns its mappings and forgets its evictions."""
        cache = self.cache
        if cache is None:
            return
        for engine_key in self.evicted:
            cache.pop(engine_key)
        for engine_key, request_key in self.batch_map.items():
            cache.put(engine_key, request_key)

    def discard_cache(self) -> None:
        """The batch may have partly applied: forget every mapping it touched."""
        cache = self.cache
        if cache is None:
            return
        for engine_key in self.evicted:
            cache.pop(engine_key)
        for engine_key in self.batch_map:
            cache.pop(engine_key)


# ------------------------------------------------------------------------------------------
# The ingester
# ------------------------------------------------------------------------------------------

ReplayFactory = Callable[[EndpointConfig], "ReplayClient | None"]


class EventIngester:
    """Applies engine KV-cache event batches to an index; see the module docstring.

    Use :meth:`start`/:meth:`stop` (or ``with``) to run ZMQ subscribers for the configured
    endpoints, or feed messages yourself with :meth:`process` (synchronous, in the caller's
    thread) or :meth:`submit` (queued to the workers; needs :meth:`start`).
    """

    def __init__(
        self,
        index: Index,
        token_processor: TokenProcessor,
        endpoints: Sequence[EndpointConfig] = (),
        config: IngesterConfig | None = None,
        *,
        group_catalog: GroupCatalog | None = None,
        counters: IngestCounters | None = None,
        replay_factory: ReplayFactory | None = None,
    ) -> None:
        self.index = index
        self.token_processor = token_processor
        self.config = config or IngesterConfig()
        self.catalog = group_catalog if group_catalog is not None else GroupCatalog()
        self.counters = counters if counters is not None else IngestCounters()
        self._block_size = int(token_processor.block_size())
        if self._block_size <= 0:
            raise ConfigError(f"token processor block size must be > 0, got {self._block_size}")
        self._batch_index = isinstance(index, BatchIndex)
        self._fenced = self._batch_index and self.config.use_watermarks
        self._clear_progress = isinstance(index, ProgressClearIndex)
        self._replay_factory = replay_factory
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._endpoints: list[EndpointConfig] = []
        self._caches: dict[str, _LRU] = {}
        self._entries: dict[tuple[str, str, int | None], PodEntry] = {}
        self._caches_lock = threading.Lock()
        self._log = _RateLimitedLog(self.config.reject_log_interval_s)
        self._stopping = threading.Event()
        """Set by :meth:`stop`: waits for the backend or for peers give up."""
        self._closed = threading.Event()
        """Set by :meth:`stop` once the receivers are done: nothing more is queued."""
        self._queues: list[queue.Queue[object]] = []
        self._workers: list[threading.Thread] = []
        self._receivers: list[Any] = []
        self._context: Any = None
        self._idle = threading.Condition()
        self._inflight = 0
        self._started = False
        for endpoint in endpoints:
            self.add_endpoint(endpoint)

    # -- configuration ---------------------------------------------------------------------

    def add_endpoint(self, endpoint: EndpointConfig) -> None:
        """Register a publisher (before :meth:`start`, or for direct feeding)."""
        if not isinstance(endpoint, EndpointConfig):
            raise ConfigError(f"expected an EndpointConfig, got {type(endpoint).__name__}")
        with self._streams_lock:
            if endpoint.endpoint in self._streams:
                raise ConfigError(f"endpoint {endpoint.endpoint} is configured twice")
            names = {s.name for s in self._streams.values()}
            if endpoint.stream_name in names:
                raise ConfigError(
                    f"stream {endpoint.stream_name!r} is used by two endpoints; give each "
                    "publisher its own stream name"
                )
            self._streams[endpoint.endpoint] = _Stream(endpoint)
            self._endpoints.append(endpoint)

    @property
    def endpoints(self) -> list[EndpointConfig]:
        """The configured publishers."""
        return list(self._endpoints)

    def _stream(self, endpoint: EndpointConfig | str | None) -> _Stream:
        key = endpoint.endpoint if isinstance(endpoint, EndpointConfig) else endpoint or "direct"
        with self._streams_lock:
            st = self._streams.get(key)
        if st is None:
            if isinstance(endpoint, EndpointConfig):
                self.add_endpoint(endpoint)
            else:
                self.add_endpoint(EndpointConfig(endpoint=key))
            with self._streams_lock:
                st = self._streams[key]
        return st

    def _cache(self, pod: str) -> _LRU:
        with self._caches_lock:
            cache = self._caches.get(pod)
            if cache is None:
                cache = self._caches[pod] = _LRU(self.config.parent_cache_size)
            return cache

    def _drop_cache(self, pod: str) -> None:
        with self._caches_lock:
            self._caches.pop(pod, None)

    # -- public feeding API ----------------------------------------------------------------

    def process(
        self,
        topic: bytes | str,
        seq: int,
        payload: bytes,
        endpoint: EndpointConfig | str | None = None,
    ) -> BatchOutcome:
        """Apply one engine message now, in the caller's thread. Never raises on bad input.

        ``endpoint`` names the publisher (an :class:`EndpointConfig`, the address of a
        configured one, or any label; default ``"direct"``); sequence numbers are tracked per
        publisher, so messages must arrive once and in order, like on a ZMQ subscription: a
        ``seq`` at or below the previous one means the publisher restarted.
        """
        st = self._stream(endpoint)
        topic_b = topic.encode("utf-8", "surrogateescape") if isinstance(topic, str) else topic
        with st.lock:
            return self._on_message(st, topic_b, seq, payload)

    def submit(
        self,
        topic: bytes | str,
        seq: int,
        payload: bytes,
        endpoint: EndpointConfig | str | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Queue one message for the workers (blocks while the queue is full).

        Returns ``False`` if the ingester is stopping or ``timeout`` expired.
        """
        if not self._started:
            raise InvalidInputError("submit() needs a started ingester; call start() first")
        st = self._stream(endpoint)
        topic_b = topic.encode("utf-8", "surrogateescape") if isinstance(topic, str) else topic
        return self._enqueue(st, topic_b, seq, payload, timeout)

    def reject_message(self, reason: RejectReason, detail: str) -> None:
        """Count and log a message a transport could not even split into frames."""
        self.counters.inc("messages")
        self._reject(Rejection(reason, detail), "transport")

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and a ZMQ subscriber per configured endpoint."""
        if self._started:
            return
        self._stopping.clear()
        self._closed.clear()
        self._queues = [queue.Queue(self.config.queue_size) for _ in range(self.config.workers)]
        self._workers = [
            threading.Thread(
                target=self._worker, args=(q,), name=f"kvredis-ingest-{i}", daemon=True
            )
            for i, q in enumerate(self._queues)
        ]
        for worker in self._workers:
            worker.start()
        self._started = True
        real = [e for e in self._endpoints if "://" in e.endpoint]
        if real:
            from kvredis.zmq_transport import ZmqSubscriber, new_context

            self._context = new_context()
            for endpoint in real:
                sub = ZmqSubscriber(endpoint, self, self._context)
                sub.start()
                self._receivers.append(sub)

    def stop(self, drain: bool = True, timeout: float = 30.0) -> bool:
        """Stop receiving; apply what was received (``drain``) or drop it; join the workers.

        A batch in progress completes; waits for an unavailable backend or a stalled peer give
        up (the batch is counted as abandoned). :meth:`process` calls running in other threads
        are interrupted the same way. Returns ``False`` if the workers did not finish within
        ``timeout`` seconds.
        """
        self._stopping.set()
        if not self._started:
            self._closed.set()
            self._close_replays()
            return True
        deadline = time.monotonic() + timeout
        for sub in self._receivers:
            sub.stop()
        for sub in self._receivers:
            sub.join(max(0.0, deadline - time.monotonic()))
        self._receivers = []
        self._closed.set()
        if not drain:
            for q in self._queues:
                self._drop_queued(q)
        for q in self._queues:
            q.put(_STOP)
        ok = True
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            ok = ok and not worker.is_alive()
        if not ok:
            logger.error("ingest workers did not finish within %.1fs", timeout)
        self._workers = []
        self._queues = []
        self._started = False
        self._close_replays()
        if self._context is not None:
            from kvredis.zmq_transport import close_context

            close_context(self._context)
            self._context = None
        return ok

    def __enter__(self) -> EventIngester:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every queued message has been processed; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def status_line(self) -> str:
        """A one-line summary of the counters (what the CLI logs periodically)."""
        c = self.counters.snapshot()
        return (
            f"batches={c['batches']} applied={c['batches_applied']} "
            f"dup={c['batches_duplicate']} events={c['events']} "
            f"blocks=+{c['blocks_stored']}/-{c['blocks_removed']} gaps={c['gaps']} "
            f"replays={c['replays']} restarts={c['restarts']} clears={c['clears']} "
            f"rejects={c['rejected']} parent_misses={c['parent_misses']}"
        )

    def _close_replays(self) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for st in streams:
            if st.replay is not None:
                st.replay.close()
                st.replay = None
                st.replay_ready = False

    def _drop_queued(self, q: queue.Queue[object]) -> None:
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._done_one()

    # -- workers ---------------------------------------------------------------------------

    def _enqueue(
        self, st: _Stream, topic: bytes, seq: int, payload: bytes, timeout: float | None
    ) -> bool:
        shard = zlib.crc32(st.endpoint.shard_key.encode("utf-8", "surrogateescape"))
        q = self._queues[shard % len(self._queues)]
        with self._idle:
            self._inflight += 1
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed.is_set():
                self._done_one()
                return False
            try:
                q.put(_Queued(st, topic, seq, payload), timeout=0.1)
                return True
            except queue.Full:
                if deadline is not None and time.monotonic() >= deadline:
                    self._done_one()
                    return False

    def enqueue_from_transport(
        self, endpoint: EndpointConfig, topic: bytes, seq: int, payload: bytes
    ) -> bool:
        """Used by subscribers: queue a received message (blocks while the queue is full)."""
        self.counters.inc("received")
        return self._enqueue(self._stream(endpoint), topic, seq, payload, None)

    def _done_one(self) -> None:
        with self._idle:
            self._inflight -= 1
            if not self._inflight:
                self._idle.notify_all()

    def _worker(self, q: queue.Queue[object]) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            assert isinstance(item, _Queued)
            st, topic, seq, payload = item.stream, item.topic, item.seq, item.payload
            try:
                with st.lock:
                    self._on_message(st, topic, seq, payload)
            except Exception:  # the worker must survive anything
                logger.exception("unexpected error while ingesting a batch")
                self.counters.inc("batches_failed")
            finally:
                self._done_one()

    # -- rejections ------------------------------------------------------------------------

    def _reject(self, rejection: Rejection, where: str) -> None:
        self.counters.reject(rejection.reason)
        position = "" if rejection.position is None else f" event {rejection.position}"
        self._log.warning(
            rejection.reason.value,
            "rejected (%s) from %s%s: %s",
            rejection.reason.value,
            where,
            position,
            rejection.detail,
        )

    # -- sequencing ------------------------------------------------------------------------

    def _on_message(self, st: _Stream, topic: bytes, seq: int, payload: bytes) -> BatchOutcome:
        self.counters.inc("messages")
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_ENGINE_SEQ:
            self._reject(
                Rejection(RejectReason.SEQ_OUT_OF_RANGE, f"seq {seq!r}"), st.endpoint.endpoint
            )
            return BatchOutcome.REJECTED
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            self._reject(
                Rejection(RejectReason.BAD_MESSAGE, f"payload is a {type(payload).__name__}"),
                st.endpoint.endpoint,
            )
            return BatchOutcome.REJECTED
        if topic:
            st.last_topic = topic
        return self._sequence(st, _Message(topic, seq, bytes(payload)), allow_restart=True)

    def _sync(self, st: _Stream) -> None:
        if st.synced:
            return
        if self._fenced:
            stored = self._get_watermark(st.name)
            if stored is not None:
                st.epoch = stored.epoch
                st.known = split_position(stored.seq)
        st.synced = True

    def _sequence(
        self, st: _Stream, msg: _Message, allow_restart: bool, depth: int = 0
    ) -> BatchOutcome:
        try:
            try:
                self._sync(st)
            except _Failed as exc:
                logger.error("stream %s: cannot read the stored watermark: %s", st.name, exc)
                self.counters.inc("batches_failed")
                return BatchOutcome.FAILED
            return self._sequence_synced(st, msg, allow_restart, depth)
        except _Abandon:
            self.counters.inc("batches_abandoned")
            return BatchOutcome.ABANDONED

    def _sequence_synced(
        self, st: _Stream, msg: _Message, allow_restart: bool, depth: int
    ) -> BatchOutcome:
        if depth > 4:
            logger.error(
                "stream %s: giving up on batch %d after repeated conflicts", st.name, msg.seq
            )
            self.counters.inc("batches_failed")
            st.last_seq = msg.seq
            return BatchOutcome.FAILED
        seq = msg.seq
        if st.last_seq is None:
            if st.known is None:
                expected = 0
            else:
                kseq, kphase = st.known
                expected = kseq + 1 if kphase == PHASE_DONE else max(kseq, 0)
            if seq < expected:
                verdict = self._fresh_verdict(st, msg) if allow_restart else "duplicate"
                if verdict == "restart":
                    return self._restart(st, msg, depth)
                if verdict == "resequence":
                    return self._sequence(st, msg, allow_restart=False, depth=depth + 1)
                st.last_seq = seq
                return self._count_duplicate(msg, st)
            if seq > expected:
                return self._gap(st, expected, msg, depth)
            return self._apply(st, msg, depth)
        if seq == st.last_seq + 1:
            return self._apply(st, msg, depth)
        if seq > st.last_seq + 1:
            return self._gap(st, st.last_seq + 1, msg, depth)
        if allow_restart:
            return self._restart(st, msg, depth)
        st.last_seq = seq
        return self._count_duplicate(msg, st)

    def _count_duplicate(self, msg: _Message, st: _Stream | None = None) -> BatchOutcome:
        if not msg.counted:
            msg.counted = True
            self.counters.inc("batches")
        self.counters.inc("batches_duplicate")
        if st is not None:
            self._forget_touched(st, msg)
        return BatchOutcome.DUPLICATE

    def _forget_touched(self, st: _Stream, msg: _Message) -> None:
        """A batch a peer applied may have changed mappings this ingester cached: drop them."""
        pod, _ = self._identity(st, msg.topic)
        if pod is None:
            return
        decoded = decode_batch(msg.payload)
        cache = self._cache(pod)
        for event in decoded.events:
            if isinstance(event, AllBlocksCleared):
                self._drop_cache(pod)
                cache = self._cache(pod)
            else:
                for engine_key in event.block_hashes:
                    cache.pop(engine_key)

    def _fresh_verdict(self, st: _Stream, msg: _Message) -> str:
        """A fresh subscription got ``seq`` below the stored position: restart or a peer ahead?

        The replay endpoint settles it: a publisher with nothing at or after the stored
        position has restarted. Without replay, a ``seq`` within ``restart_window`` batches of
        the stored position is a peer slightly ahead; further below, the stored watermark must
        move within ``peer_grace_s`` (a live peer) or it is a restart.
        """
        assert st.known is not None
        stored_seq = st.known[0]
        replay = self._replay_client(st)
        if replay is not None and stored_seq >= 0:
            found = self._fetch(st, replay, stored_seq)
            if found is not None:
                restarted = not any(m.seq >= stored_seq for m in found)
                return "restart" if restarted else "duplicate"
        if not self._fenced:
            return "restart"
        if stored_seq - msg.seq <= self.config.restart_window:
            return "duplicate"
        before = (st.epoch, st.known)
        deadline = time.monotonic() + self.config.peer_grace_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            self._stopping.wait(self.config.poll_interval_s)
            stored = self._get_watermark_quiet(st.name)
            if stored is None or (stored.epoch, split_position(stored.seq)) == before:
                continue
            if stored.epoch != st.epoch:
                self._adopt_epoch(st, stored, msg)
                return "resequence"
            st.known = split_position(stored.seq)
            return "duplicate"
        if self._stopping.is_set():
            raise _Abandon  # undecided: clearing on a guess would hurt every replica
        return "restart"

    def _adopt_epoch(self, st: _Stream, stored: Watermark, msg: _Message | None) -> None:
        """Follow the epoch a peer started (it detected a restart and cleared the pod)."""
        self.counters.inc("epochs_adopted")
        logger.info("stream %s: following epoch %d started by a peer", st.name, stored.epoch)
        for pod in self._stream_pods(st, msg):
            self._drop_cache(pod)
            self.catalog.forget_pod(pod)
        st.epoch = stored.epoch
        st.known = split_position(stored.seq)
        st.last_seq = None

    def _restart(self, st: _Stream, msg: _Message, depth: int) -> BatchOutcome:
        self.counters.inc("restarts")
        pods = self._stream_pods(st, msg)
        logger.warning(
            "stream %s: seq went back to %d (last %s): engine restart, clearing %s",
            st.name,
            msg.seq,
            st.last_seq if st.last_seq is not None else st.known,
            ", ".join(sorted(pods)) or "nothing",
        )
        new_epoch = st.epoch + 1
        for pod in pods:
            self.catalog.forget_pod(pod)
            self._drop_cache(pod)
        outcome = self._run_batch(
            st,
            epoch=new_epoch,
            seq=-1,
            claim_seq=-1,
            plan=lambda run: run.clear(pods, "restart") if pods else run.flush(),
            count_batch=False,
        )
        if outcome in (BatchOutcome.ABANDONED, BatchOutcome.FAILED):
            st.last_seq = msg.seq
            return outcome
        if st.epoch < new_epoch:
            st.epoch = new_epoch
            if outcome is BatchOutcome.APPLIED:
                st.known = (-1, PHASE_DONE)
        st.last_seq = None
        return self._sequence(st, msg, allow_restart=False, depth=depth + 1)

    def _stream_pods(self, st: _Stream, msg: _Message | None) -> set[str]:
        pods = set(st.pods)
        if st.endpoint.pod_id:
            pods.add(st.endpoint.pod_id)
        if msg is not None:
            pod, _ = self._identity(st, msg.topic)
            if pod:
                pods.add(pod)
        return pods

    def _gap(self, st: _Stream, first_missing: int, msg: _Message, depth: int) -> BatchOutcome:
        self.counters.inc("gaps")
        logger.info("stream %s: gap, batches %d..%d missing", st.name, first_missing, msg.seq - 1)
        replayed: list[_Message] = []
        replay = self._replay_client(st)
        if replay is not None:
            found = self._fetch(st, replay, first_missing)
            if found is not None:
                by_seq: dict[int, _Message] = {}
                for item in found:
                    # later batches are on their way live; applying them now would make them
                    # look like a publisher restart when they arrive
                    if first_missing <= item.seq <= msg.seq:
                        by_seq.setdefault(
                            item.seq, _Message(item.topic or st.last_topic, item.seq, item.payload)
                        )
                expect = first_missing
                while expect in by_seq:
                    replayed.append(by_seq[expect])
                    expect += 1
                if replayed and replayed[-1].seq >= msg.seq - 1:
                    self.counters.inc("replayed_batches", len(replayed))
                    for replayed_msg in replayed:
                        if st.last_seq is not None and replayed_msg.seq <= st.last_seq:
                            continue
                        self._apply(st, replayed_msg, depth)
                    if st.last_seq is not None and msg.seq <= st.last_seq:
                        return self._count_duplicate(msg, st)
                    return self._apply(st, msg, depth)
                tail = [by_seq[s] for s in sorted(by_seq) if s < msg.seq and s > first_missing]
                replayed = self._contiguous_tail(tail, msg.seq)
            self.counters.inc("replay_failures")
        if not st.dirty() or (self._fenced and self._peers_covered(st, msg.seq - 1)):
            st.last_seq = msg.seq - 1
            return self._apply(st, msg, depth)
        logger.warning(
            "stream %s: batches %d..%d are lost, clearing the pod",
            st.name,
            first_missing,
            msg.seq - 1,
        )
        batches = [*replayed, msg]
        outcome = self._apply(st, batches[0], depth, pre_clear=True, claim_seq=first_missing)
        for later in batches[1:]:
            outcome = self._apply(st, later, depth)
        return outcome

    @staticmethod
    def _contiguous_tail(found: list[_Message], upto: int) -> list[_Message]:
        """The replayed batches ending right before ``upto`` without a hole."""
        tail: list[_Message] = []
        expect = upto - 1
        for m in sorted(found, key=lambda m: -m.seq):
            if m.seq != expect:
                break
            tail.append(m)
            expect -= 1
        tail.reverse()
        return tail

    def _peers_covered(self, st: _Stream, last_missing: int) -> bool:
        """Wait up to ``peer_grace_s`` for peers to apply the missing batches."""
        deadline = time.monotonic() + self.config.peer_grace_s
        while True:
            stored = self._get_watermark_quiet(st.name)
            if stored is not None and stored.epoch == st.epoch:
                st.known = split_position(stored.seq)
                if stored.seq >= stream_position(last_missing):
                    return True
            if self._stopping.is_set():
                raise _Abandon  # undecided: clearing on a guess would hurt every replica
            if time.monotonic() >= deadline:
                return False
            self._stopping.wait(self.config.poll_interval_s)

    # -- replay ----------------------------------------------------------------------------

    def _replay_client(self, st: _Stream) -> ReplayClient | None:
        if st.replay_ready:
            return st.replay
        st.replay_ready = True
        if self._replay_factory is not None:
            st.replay = self._replay_factory(st.endpoint)
        elif st.endpoint.replay_endpoint:
            from kvredis.zmq_transport import ZmqReplayClient

            st.replay = ZmqReplayClient(
                st.endpoint.replay_endpoint,
                timeout_s=self.config.replay_timeout_s,
                max_batches=self.config.max_replay_batches,
                on_bad_message=lambda detail: self._reject(
                    Rejection(RejectReason.BAD_MESSAGE, detail), "replay"
                ),
            )
        return st.replay

    def _fetch(self, st: _Stream, replay: ReplayClient, start: int) -> list[ReplayedMessage] | None:
        self.counters.inc("replays")
        try:
            found = replay.fetch(max(start, 0))
        except Exception as exc:
            logger.warning("stream %s: replay from %d failed: %s", st.name, start, exc)
            found = None
        if found is None:
            logger.warning("stream %s: replay from %d got no answer", st.name, start)
        return found

    # -- applying one batch ----------------------------------------------------------------

    def _identity(self, st: _Stream, topic: bytes) -> tuple[str | None, str | None]:
        ep = st.endpoint
        if ep.pod_id and ep.model_name:
            return ep.pod_id, ep.model_name
        topic_pod: str | None = None
        topic_model: str | None = None
        if topic:
            topic_pod, topic_model = parse_topic(topic.decode("utf-8", "replace"))
        return ep.pod_id or topic_pod, ep.model_name or topic_model

    def _apply(
        self,
        st: _Stream,
        msg: _Message,
        depth: int,
        pre_clear: bool = False,
        claim_seq: int | None = None,
    ) -> BatchOutcome:
        """Decode, plan and apply one batch of the current epoch; updates ``last_seq``."""
        st.last_seq = msg.seq
        first = not msg.counted
        msg.counted = True
        if first:
            self.counters.inc("batches")
        if self._fenced and not pre_clear and st.known_at_least(msg.seq):
            return self._count_duplicate(msg, st)
        where = st.endpoint.endpoint
        pod, model = self._identity(st, msg.topic)
        decoded = decode_batch(msg.payload)
        if first:
            self.counters.inc("events", decoded.total_events)
            for rejection in decoded.rejects:
                self._reject(rejection, where)
            if pod is None:
                self._reject(
                    Rejection(RejectReason.NO_POD, f"topic {msg.topic[:80]!r} names no pod"),
                    where,
                )
        unusable = pod is None or (not decoded.events and bool(decoded.rejects))
        if pod is None:
            decoded = DecodedBatch(ts=decoded.ts, events=())
        else:
            st.pods.add(pod)
        clear_pods = self._stream_pods(st, msg) if pre_clear else set()

        def plan(run: _Run) -> None:
            if pre_clear:
                run.clear(clear_pods, "gap")
            if pod is not None:
                self._plan(run, decoded, pod, model)

        return self._run_batch(
            st,
            epoch=st.epoch,
            seq=msg.seq,
            claim_seq=msg.seq if claim_seq is None else claim_seq,
            plan=plan,
            count_batch=True,
            msg=msg,
            depth=depth,
            unusable=unusable,
            pod=pod,
        )

    def _run_batch(
        self,
        st: _Stream,
        epoch: int,
        seq: int,
        claim_seq: int,
        plan: Callable[[_Run], object],
        count_batch: bool,
        msg: _Message | None = None,
        depth: int = 0,
        unusable: bool = False,
        pod: str | None = None,
    ) -> BatchOutcome:
        """Run ``plan`` as one batch until applied, found duplicate, or given up.

        ``unusable`` marks a payload nothing could be decoded from: it still advances the
        watermark (so peers see the stream move on) but counts as rejected, not applied.
        """
        first_phase = 1
        takeover_clear = False
        for _attempt in range(8):
            run = _Run(self, st, epoch, seq, claim_seq, first_phase, pod)
            try:
                if takeover_clear:
                    run.clear(self._stream_pods(st, msg), "restart" if claim_seq < 0 else "gap")
                plan(run)
                run.finish()
            except _NotOwner:
                try:
                    verdict, stored = self._conflict(st, epoch, seq)
                except _Abandon:
                    verdict, stored = "abandoned", None
                except _Failed as exc:
                    run.discard_cache()
                    logger.error("stream %s: batch %d failed: %s", st.name, seq, exc)
                    self.counters.inc("batches_failed")
                    return BatchOutcome.FAILED
                if verdict == "duplicate":
                    run.commit_cache()
                    if count_batch:
                        self.counters.inc("batches_duplicate")
                    return BatchOutcome.DUPLICATE
                if verdict == "takeover":
                    assert stored is not None
                    self.counters.inc("takeovers")
                    sseq, sphase = split_position(stored.seq)
                    logger.warning(
                        "stream %s: peer stalled at batch %d phase %d, taking over",
                        st.name,
                        sseq,
                        sphase,
                    )
                    claim_seq, first_phase = sseq, sphase + 1
                    takeover_clear = sseq < seq
                    continue
                run.discard_cache()
                if verdict == "retry":
                    continue
                if verdict == "abandoned":
                    self.counters.inc("batches_abandoned")
                    return BatchOutcome.ABANDONED
                # the epoch moved on (a peer saw a restart) or the stream moved past our claim
                assert stored is not None
                if stored.epoch != st.epoch:
                    self._adopt_epoch(st, stored, msg)
                st.known = split_position(stored.seq)
                if msg is None:
                    return BatchOutcome.DUPLICATE
                st.last_seq = None
                return self._sequence(st, msg, allow_restart=False, depth=depth + 1)
            except _LostOwnership:
                run.discard_cache()
                self.counters.inc("lost_ownership")
                logger.warning("stream %s: a peer took batch %d over", st.name, seq)
                if count_batch:
                    self.counters.inc("batches_duplicate")
                return BatchOutcome.DUPLICATE
            except _Abandon:
                run.discard_cache()
                self.counters.inc("batches_abandoned")
                return BatchOutcome.ABANDONED
            except _Failed as exc:
                run.discard_cache()
                logger.error("stream %s: batch %d failed: %s", st.name, seq, exc)
                self.counters.inc("batches_failed")
                return BatchOutcome.FAILED
            run.commit_cache()
            for rejection in run.rejects:
                self._reject(rejection, st.endpoint.endpoint)
            self.counters.add_all(run.stats)
            if not self._fenced:
                st.known = (seq, PHASE_DONE)
            if unusable:
                self.counters.inc("batches_rejected")
                return BatchOutcome.REJECTED
            if count_batch:
                self.counters.inc("batches_applied")
            return BatchOutcome.APPLIED
        logger.error("stream %s: batch %d kept conflicting, dropped", st.name, seq)
        self.counters.inc("batches_failed")
        return BatchOutcome.FAILED

    def _conflict(self, st: _Stream, epoch: int, seq: int) -> tuple[str, Watermark | None]:
        """Why a claim was refused: duplicate, a peer mid-batch (wait/takeover), or moved on."""
        target = stream_position(seq)
        last: Watermark | None = None
        since = time.monotonic()
        waited = False
        while True:
            stored = self._get_watermark(st.name)
            if stored is None or stored.epoch < epoch:
                return "retry", stored
            if stored.epoch > epoch:
                return "moved", stored
            if stored.seq >= target:
                st.known = split_position(stored.seq)
                return "duplicate", stored
            sphase = split_position(stored.seq)[1]
            if sphase == PHASE_DONE:
                return "moved", stored
            if stored != last:
                last, since = stored, time.monotonic()
            elif time.monotonic() - since >= self.config.takeover_timeout_s:
                return "takeover", stored
            if self._stopping.is_set():
                return "abandoned", stored
            if not waited:
                waited = True
                self.counters.inc("peer_waits")
            self._stopping.wait(self.config.poll_interval_s)

    # -- planning --------------------------------------------------------------------------

    def _plan(self, run: _Run, decoded: DecodedBatch, pod: str, model: str | None) -> None:
        for position, event in enumerate(decoded.events):
            if isinstance(event, BlockStored):
                self._plan_stored(run, event, pod, model, position)
            elif isinstance(event, BlockRemoved):
                self._plan_removed(run, event, pod, position)
            elif isinstance(event, AllBlocksCleared):
                run.clear([pod], "all_blocks_cleared")
                run.count("events_applied")

    def _entry(
        self, run: _Run, pod: str, tier: str, group: int | None, position: int
    ) -> PodEntry | None:
        key = (pod, tier, group)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        try:
            if group is None:
                entry = PodEntry(pod, tier)
            else:
                entry = PodEntry(pod, tier, has_group=True, group_idx=group)
        except InvalidInputError as exc:
            run.rejects.append(Rejection(RejectReason.BAD_FIELD_VALUE, str(exc), position))
            return None
        if len(self._entries) >= 4096:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _plan_stored(
        self, run: _Run, ev: BlockStored, pod: str, model: str | None, position: int
    ) -> None:
        entry = self._entry(run, pod, ev.tier, ev.group_idx, position)
        if entry is None:
            return
        if ev.group_idx is not None:
            self.catalog.learn(
                pod,
                ev.group_idx,
                GroupMetadata(
                    ev.kv_cache_spec_kind or "", ev.block_size, ev.kv_cache_spec_sliding_window
                ),
            )
        blocks = len(ev.token_ids) // self._block_size
        if blocks == 0:
            if not ev.block_hashes:
                return
            resolved: list[int] = []
            seen: set[int] = set()
            for engine_key in ev.block_hashes:
                request_key = run.resolve(engine_key)
                if request_key is not None and request_key not in seen:
                    seen.add(request_key)
                    resolved.append(request_key)
            if not resolved:
                run.count("tier_update_misses")
                return
            run.add(AddOp(None, tuple(resolved), (entry,)), None)
            run.count("tier_updates")
            run.count("events_applied")
            return
        model_name = ev.lora_name or model
        if not model_name:
            run.rejects.append(
                Rejection(RejectReason.NO_MODEL, "no model name for hashing", position)
            )
            return
        parent = 0
        if ev.parent_block_hash:
            found = run.resolve(ev.parent_block_hash)
            if found is None:
                run.count("parent_misses")
                return
            parent = found
        features = None
        if ev.extra_keys is not None:
            try:
                parsed = parse_raw_extra_keys(list(ev.extra_keys))
            except (ValueError, TypeError) as exc:
                run.rejects.append(Rejection(RejectReason.BAD_EXTRA_KEYS, str(exc), position))
                return
            features = realign_extra_features(parsed, blocks)
        try:
            request_keys = self.token_processor.tokens_to_kv_block_keys(
                parent, ev.token_ids, model_name, features
            )
        except (ValueError, TypeError) as exc:
            run.rejects.append(Rejection(RejectReason.HASHING_FAILED, str(exc), position))
            return
        if not request_keys:
            return
        request = tuple(request_keys)
        mappings = infer_mappings(ev.block_hashes, request) if ev.block_hashes else None
        run.add(AddOp(ev.block_hashes, request, (entry,)), mappings)
        run.count("events_applied")
        run.count("blocks_stored", len(ev.block_hashes))
        run.count("request_keys_stored", len(request))

    def _plan_removed(self, run: _Run, ev: BlockRemoved, pod: str, position: int) -> None:
        entry = self._entry(run, pod, ev.tier, ev.group_idx, position)
        if entry is None:
            return
        run.evict(ev.block_hashes, (entry,))
        run.count("events_applied")
        run.count("blocks_removed", len(ev.block_hashes))

    # -- index access (retries while the backend is unavailable) ---------------------------

    def _call(self, fn: Callable[[], Any]) -> Any:
        delay = 0.05
        while True:
            self.counters.inc("index_calls")
            try:
                return fn()
            except BackendUnavailableError as exc:
                self.counters.inc("backend_retries")
                self._log.warning("backend", "index backend unavailable, retrying: %s", exc)
                if self._stopping.is_set():
                    raise _Abandon from exc
                self._stopping.wait(delay)
                delay = min(delay * 2, self.config.backend_retry_max_s)
            except (_LostOwnership, _NotOwner, _Abandon, _Failed):
                raise
            except Exception as exc:
                raise _Failed(f"{type(exc).__name__}: {exc}") from exc

    def _apply_fenced(self, ops: list[IndexOp], stream: str, wm: Watermark) -> bool:
        index: Any = self.index
        attempts = [0]

        def call() -> bool:
            attempts[0] += 1
            return bool(index.apply_batch(ops, stream, wm))

        ok: bool = self._call(call)
        if not ok and attempts[0] > 1:
            # an attempt whose reply was lost may have applied: then the stored mark is ours
            stored = self._get_watermark(stream)
            ok = stored == wm
        return ok

    def _apply_unfenced(self, ops: list[IndexOp]) -> None:
        if not ops:
            return
        index: Any = self.index
        if self._batch_index:
            self._call(lambda: index.apply_batch(ops))
            return
        for op in ops:
            self._call(functools.partial(apply_op, index, op))

    def _get_watermark(self, stream: str) -> Watermark | None:
        index: Any = self.index
        result: Watermark | None = self._call(lambda: index.get_watermark(stream))
        return result

    def _get_watermark_quiet(self, stream: str) -> Watermark | None:
        try:
            return self._get_watermark(stream)
        except (_Abandon, _Failed):
            return None

    def _index_request_key(self, engine_key: int, cache: _LRU | None, run: _Run) -> int | None:
        index = self.index
        run.count("index_lookups")

        def call() -> int | None:
            try:
                return int(index.get_request_key(engine_key))
            except EngineKeyNotFoundError:
                return None

        found: int | None = self._call(call)
        if found is not None and cache is not None:
            cache.put(engine_key, found)
        return found

    def _clear_pod(self, pod: str, heartbeat: Callable[[int, int], None]) -> None:
        index: Any = self.index
        if self._clear_progress:
            self._call(lambda: index.clear_with_progress(pod, heartbeat))
        else:
            self._call(lambda: index.clear(pod))
        self._drop_cache(pod)

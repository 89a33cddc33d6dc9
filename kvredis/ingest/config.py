"""What an ingester is told: the engine publishers it follows and how it is tuned."""

from __future__ import annotations

import gc
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvredis.errors import ConfigError
from kvredis.ingest.events import Engine
from kvredis.jsonconfig import check_number
from kvredis.tiers import DEFAULT_TIERS, TierMap

__all__ = [
    "DEFAULT_RESET_MEDIUMS",
    "ENGINE_RESET_MEDIUMS",
    "EndpointConfig",
    "IngesterConfig",
    "is_http_endpoint",
]

DEFAULT_RESET_MEDIUMS: tuple[str, ...] = ("GPU",)
"""The mediums a prefix-cache reset (``AllBlocksCleared``) covers for vLLM, and for a stream
whose engine is not known: vLLM 0.34's ``reset_prefix_cache`` resets its block pools (the GPU
prefix cache) and keeps the offloading connector's CPU and storage copies unless asked to reset
the connector too (which publishes nothing)."""

ENGINE_RESET_MEDIUMS: Mapping[Engine, tuple[str, ...]] = MappingProxyType(
    {
        Engine.VLLM: DEFAULT_RESET_MEDIUMS,
        Engine.SGLANG: ("GPU", "CPU_PINNED"),
        Engine.TRTLLM: ("GPU", "CPU"),
    }
)
"""The mediums a reset covers per engine (``IngesterConfig.reset_mediums`` unset): SGLang's radix
cache reset also empties its HiCache host pool (``CPU_PINNED``; its ``DISK``/``EXTERNAL``
storage stays); a TensorRT-LLM ``created`` event is a new KV-cache manager, primary (``GPU``,
cache level 0) and secondary (``CPU``, level 1) pools alike."""

_HTTP = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]@]+):(\d{1,5})(/[^\s?#]*)?$")


def is_http_endpoint(endpoint: str) -> bool:
    """Whether ``endpoint`` names a polled HTTP source (``http://HOST:PORT``: trtllm-serve)."""
    return endpoint.startswith(("http://", "https://"))


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """One engine publisher.

    ``endpoint`` is the ZMQ address of its PUB socket (vLLM, SGLang), the ``http://HOST:PORT``
    address of a ``trtllm-serve`` whose ``/kv_cache_events`` is polled (TensorRT-LLM), or any
    label when messages are fed directly. ``pod_id`` and ``model_name`` override what the
    ``kv@<pod>@<model>`` topic says (the engine default topic is empty; TensorRT-LLM has no topic,
    so an ``http://`` endpoint needs both). ``stream`` names the watermark stream; replicas of an
    HA deployment must use the same name for the same publisher (default: ``pod_id``, else
    ``endpoint``; with the pod taken from the topic, each engine's stream is its own, see
    :attr:`stream_name`). ``engine`` (``"vllm"``, ``"sglang"``, ``"trtllm"``, or an
    :class:`Engine`) says which engine publishes: for what its prefix-cache reset drops, and, for
    an engine whose cache evicts leaves first (SGLang, TensorRT-LLM), to map one page per index
    block where its pages are finer than blocks (see *Ingestion fidelity* in ``docs/ingest.md``).
    Unset, it is learned from the events (``http://`` endpoints are TensorRT-LLM); until it is
    known, every page is mapped.
    """

    endpoint: str
    replay_endpoint: str | None = None
    pod_id: str | None = None
    model_name: str | None = None
    topic_filter: str = ""
    stream: str | None = None
    engine: Engine | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ConfigError("endpoint must be a non-empty string")
        for name in ("replay_endpoint", "pod_id", "model_name", "stream"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a non-empty string or None, got {value!r}")
        if not isinstance(self.topic_filter, str):
            raise ConfigError("topic_filter must be a string")
        engine = self.engine
        if engine is not None and not isinstance(engine, Engine):
            try:
                engine = Engine(engine)
            except ValueError:
                names = ", ".join(e.value for e in Engine)
                raise ConfigError(f"engine must be one of {names}, got {engine!r}") from None
            object.__setattr__(self, "engine", engine)
        if is_http_endpoint(self.endpoint):
            self._check_http(engine)

    def _check_http(self, engine: Engine | str | None) -> None:
        where = f"endpoint {self.endpoint}"
        match = _HTTP.match(self.endpoint)
        if not match or not 0 < int(match.group(2)) < 65536:
            raise ConfigError(
                f"{where} is not an HTTP address (expected http://HOST:PORT, trtllm-serve's)"
            )
        if engine is not None and engine is not Engine.TRTLLM:
            raise ConfigError(f"{where} is polled over HTTP: only TensorRT-LLM publishes so")
        object.__setattr__(self, "engine", Engine.TRTLLM)
        if not self.pod_id or not self.model_name:
            raise ConfigError(
                f"{where} (TensorRT-LLM's trtllm-serve) has no topic to name the pod and model "
                "by: give pod_id and model_name (--pod and --model)"
            )
        if self.replay_endpoint is not None:
            raise ConfigError(f"{where} has no replay endpoint: trtllm-serve keeps no replay")
        if self.topic_filter:
            raise ConfigError(f"{where} has no topics to filter")

    @property
    def stream_name(self) -> str:
        """The watermark stream of this publisher.

        With the pod taken from the ``kv@<pod>@<model>`` topic, this is the base name: each
        engine the endpoint publishes has the stream ``<stream_name>#kv@<pod>@<model>``
        (:meth:`topic_stream_name`), so a different engine on the same endpoint is never taken
        for a restart of the previous one.
        """
        return self.stream or self.pod_id or self.endpoint

    @property
    def engine_kind(self) -> Engine | None:
        """:attr:`engine` as an :class:`~kvredis.ingest.events.Engine` (``None``: learned)."""
        return self.engine if isinstance(self.engine, Engine) else None

    @property
    def identified_by_topic(self) -> bool:
        """Whether the pod comes from the messages' topic (then each engine the topic names,
        pod and model, has a stream of its own)."""
        return not self.pod_id

    def topic_stream_name(self, pod: str | None, model: str | None) -> str:
        """The watermark stream of the engine publishing as ``pod``/``model`` on this endpoint."""
        if not self.identified_by_topic:
            return self.stream_name
        return f"{self.stream_name}#kv@{pod or ''}@{model or ''}"

    @property
    def shard_key(self) -> str:
        """What picks the worker: the pod id when configured, else the endpoint."""
        return self.pod_id or self.endpoint


@dataclass(frozen=True, slots=True)
class IngesterConfig:
    """Tuning of an :class:`~kvredis.ingest.EventIngester` (the defaults suit production).

    The HA timings (``peer_grace_s``, ``takeover_timeout_s``, ``heartbeat_interval_s``,
    ``restart_window``) are explained in ``docs/ingest-protocol.md``.
    """

    workers: int = 4
    """Worker threads; endpoints are sharded across them."""
    queue_size: int = 1024
    """Messages buffered per worker before receivers block (backpressure)."""
    queue_bytes: int = 64 * 2**20
    """Payload bytes buffered per worker before receivers block (a larger message waits for an
    empty queue). See "Memory" in ``docs/ingest-protocol.md``."""
    max_message_bytes: int = 8 * 2**20
    """Largest engine message accepted, set as ZMQ_MAXMSGSIZE on the SUB and replay sockets: ZMQ
    refuses a larger message from its size header, before buffering it, and drops that
    connection (it is re-made; the message is lost, a gap). ``-1``: no limit."""
    parent_cache_size: int = 131_072
    """Engine→request mappings remembered per pod for parent resolution."""
    partial_block_pages: int = 65_536
    """Engine pages ending inside an index block remembered per pod (least recently used
    dropped), besides chain ends: a branch hanging from such a page gets exact keys; a branch
    from a forgotten one is a parent miss. About 220 bytes a page (SGLang page size 1, 16-token
    blocks; see "Ingestion fidelity" in ``docs/ingest.md``)."""
    max_batches_per_call: int = 256
    """Engine batches a worker applies together at most: the batches queued for it that need
    nothing but their fenced step go to the index in one ``apply_batches`` call (one script
    call on Redis, fewer when their work exceeds one call's budget), each fenced on its own.
    ``1``: each batch alone."""
    use_watermarks: bool = True
    """Fence batches with per-stream watermarks when the index is a BatchIndex (HA-safe)."""
    page_journal: bool = True
    """Keep what this ingester knows of the pages that end inside index blocks in a journal per
    pod beside the index (an embedded index, or the Redis of a ``RedisIndex``), so that an
    ingester that restarts, or a replica that takes over, continues every chain exactly
    (:mod:`kvredis.ingest.journal`; the bytes it costs are in ``docs/ingest.md``). ``False``:
    such an ingester counts a parent miss for a chain hanging inside a block it never saw."""
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
    reset_check_interval_s: float = 5.0
    """How often (at most) a stream's stored watermark is read back to detect a namespace reset
    (the index lost its data); ``0``: before every batch."""
    poll_interval_s: float = 0.02
    backend_retry_max_s: float = 5.0
    """Backoff cap while the index backend is unavailable (batches are retried, not dropped)."""
    reject_log_interval_s: float = 10.0
    """Rejections of one reason are logged at most once per interval (all are counted)."""
    tiers: TierMap = field(default=DEFAULT_TIERS)
    """How an event's medium, locality and ownership become an entry's device tier."""
    offload_blocks_per_chunk: int = 1
    """Engine blocks per chunk of vLLM's offloading connector (its ``kv_connector_extra_config``
    ``blocks_per_chunk``, or its ``block_size`` over the GPU block size). Without
    self-describing events a stored or removed chunk names only its last block's hash; the
    ingester credits (and removes) the chunk's blocks before it too, through the parents its
    GPU events named."""
    reset_mediums: tuple[str, ...] | None = None
    """The engine mediums whose local copies ``AllBlocksCleared`` removes (of the batch's
    data-parallel rank), for every engine; copies on other tiers stay (on an index that is not a
    :class:`~kvredis.index.SelectiveClearIndex` the whole pod is cleared). ``None`` (the default):
    each stream's engine's own (:data:`ENGINE_RESET_MEDIUMS`: vLLM ``GPU``; SGLang ``GPU`` and
    ``CPU_PINNED``, its reset empties the HiCache host pool too; TensorRT-LLM both cache levels),
    :data:`DEFAULT_RESET_MEDIUMS` while a stream's engine is not known yet."""

    def __post_init__(self) -> None:
        for name in (
            "workers",
            "queue_size",
            "queue_bytes",
            "max_batches_per_call",
            "parent_cache_size",
            "partial_block_pages",
            "max_replay_batches",
            "restart_window",
            "offload_blocks_per_chunk",
        ):
            check_number(name, getattr(self, name), integer=True)
        for name in (
            "replay_timeout_s",
            "peer_grace_s",
            "takeover_timeout_s",
            "heartbeat_interval_s",
            "poll_interval_s",
            "reset_check_interval_s",
            "backend_retry_max_s",
            "reject_log_interval_s",
        ):
            check_number(name, getattr(self, name), zero=True)
        if self.reset_mediums is not None and (
            not isinstance(self.reset_mediums, tuple)
            or not self.reset_mediums
            or not all(isinstance(m, str) and m for m in self.reset_mediums)
        ):
            raise ConfigError(
                "reset_mediums must be None or a non-empty tuple of medium names, got "
                f"{self.reset_mediums!r}"
            )
        if self.max_message_bytes != -1:
            check_number("max_message_bytes", self.max_message_bytes, integer=True)


GC_THRESHOLD = 50_000
"""The first-generation threshold :func:`tune_collector` sets by default (Python's own: 700)."""


def tune_collector(threshold: int = GC_THRESHOLD) -> None:
    """Let Python's cyclic garbage collector run less often in an ingester's process.

    An ingester keeps large tables (its pods' page records and mappings) and makes many
    short-lived objects per message: with Python's defaults a collection comes every 700 new
    objects, and each full one walks every table (10-25% of an ingester's CPU on the realistic
    fleets of ``scripts/bench_realistic.py``). This raises the first generation's threshold to
    ``threshold``; garbage without reference cycles is freed at once either way, so memory
    hardly grows. ``kvredis ingest`` calls it at startup (``--gc-threshold``); a process that
    embeds an :class:`~kvredis.ingest.EventIngester` may call it too. ``0`` leaves the
    collector as it is.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ConfigError(f"the collector threshold must be an int >= 0, got {threshold!r}")
    if threshold == 0:
        return
    _, second, third = gc.get_threshold()
    gc.set_threshold(threshold, max(second, 20), third)

"""The ingester service: lifecycle, worker threads and queues around the sequencer.

:class:`EventIngester` takes an :class:`~kvredis.index.Index`, a token processor and endpoint
configurations. Engine messages ``(topic, seq, payload)`` come from ZMQ subscribers
(:mod:`kvredis.ingest.zmq`), ``trtllm-serve`` pollers (:mod:`kvredis.ingest.http`, one message per
TensorRT-LLM event, its id the ``seq``), both started by :meth:`EventIngester.start`, or are fed
directly (:meth:`EventIngester.process`, :meth:`EventIngester.submit`). Each message is routed to
its stream (the endpoint's; with the pod and model taken from the topic, the engine's that the
topic names; for TensorRT-LLM, the attention-DP rank's), decoded by the endpoint's wire format
and goes through the :class:`~kvredis.ingest.sequencer.Sequencer`, driven here with real time
against an :class:`~kvredis.ingest.backend.IndexBackend`. When an endpoint's topic names another
engine than the one before, the previous engine is gone: its stream clears its pod
(:meth:`~kvredis.ingest.sequencer.Sequencer.on_replaced`), the new engine's stream starts on
its own.

Throughput: with a :class:`~kvredis.index.BatchIndex`, one engine batch becomes one
``apply_batch`` call, one round trip to Redis in the common case; parents usually resolve from a
bounded per-pod engine→request cache, so no lookup round trip is needed. Any other Index gets the
operations one call at a time. Endpoints are sharded to worker threads by pod id (by endpoint when
the pod comes from the topic): one publisher's batches are applied in order by one worker,
different pods in parallel. Worker queues are bounded; a full queue blocks the receiver, and ZMQ
then drops at the publisher's high-water mark, which shows up as a sequence gap.

Sequencing, gaps, restarts and the HA protocol: ``docs/ingest-protocol.md``.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvredis.errors import BackendUnavailableError, ConfigError, InvalidInputError
from kvredis.groups import GroupCatalog
from kvredis.hashing import TokenProcessor
from kvredis.hashing.config import BlockKeyScheme
from kvredis.hashing.database import SchemedTokenProcessor
from kvredis.index import BatchIndex, Index, SchemeIndex
from kvredis.ingest.actions import BatchOutcome, drive
from kvredis.ingest.backend import IndexBackend
from kvredis.ingest.config import EndpointConfig, IngesterConfig, is_http_endpoint
from kvredis.ingest.counters import Counter, IngestCounters, RateLimitedLog
from kvredis.ingest.events import DecodedBatch, Rejection, RejectReason
from kvredis.ingest.journal import journal_for, snapshot
from kvredis.ingest.planner import Planner, PodCaches
from kvredis.ingest.sequencer import BatchGroup, Sequencer
from kvredis.ingest.stream import StreamState
from kvredis.ingest.transport import ReplayClient, ReplayFactory
from kvredis.ingest.workqueue import WorkQueue

if TYPE_CHECKING:
    from kvredis.hashing import TokenProcessor

__all__ = ["BatchOutcome", "EventIngester"]

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A publisher as the service holds it: the sequencing state of its streams and the lock
    that orders them (one endpoint's messages are handled one at a time, in order)."""

    state: StreamState
    """The stream the endpoint's last message went to (messages whose topic names no engine go
    there too); at first the endpoint's own."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    queued: int = 0
    """Messages received and not yet handled (guarded by the service's ``_idle`` lock)."""
    shard: int = 0
    """The worker the endpoint's messages go to, modulo the number of workers."""
    states: dict[object, StreamState] = field(default_factory=dict)
    """Every stream of the endpoint, by engine (``(pod, model)`` from the topic) or, for
    TensorRT-LLM, by attention-DP rank."""
    engine_key: object = None
    """The engine the endpoint published last (``None``: none named yet)."""
    subscribed: set[object] = field(default_factory=set)
    """The streams of a polled endpoint whose stored watermark was read since
    :meth:`EventIngester.start`."""

    def all_states(self) -> list[StreamState]:
        return [self.state, *(s for s in self.states.values() if s is not self.state)]


#: One message for :meth:`EventIngester.process_many`: ``(topic, seq, payload)`` or
#: ``(topic, seq, payload, endpoint)``.
Message = (
    tuple[bytes | str, int, bytes] | tuple[bytes | str, int, bytes, "EndpointConfig | str | None"]
)


_Queued = tuple[_Stream, bytes, int, bytes]
"""A received message queued for a worker: its endpoint's stream, topic, seq and payload."""


def _record_scheme(index: Index, token_processor: TokenProcessor) -> BlockKeyScheme | None:
    """Record the token processor's block key scheme in the namespace when it records none, and
    check it (:class:`~kvredis.errors.BlockKeySchemeError`, naming both, when it records
    another). A backend that cannot be reached now: the scheme to record before the first write
    (the ingester rides out outages), else None."""
    if not (isinstance(token_processor, SchemedTokenProcessor) and isinstance(index, SchemeIndex)):
        return None
    try:
        index.check_block_key_scheme(token_processor.scheme, record=True)
    except BackendUnavailableError as exc:
        logger.warning("cannot record the block key scheme yet (%s): before the first write", exc)
        return token_processor.scheme
    return None


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
        scheme = _record_scheme(index, token_processor)
        self.config = config or IngesterConfig()
        self.catalog = group_catalog if group_catalog is not None else GroupCatalog()
        self.counters = counters if counters is not None else IngestCounters()
        journal = journal_for(index) if self.config.page_journal else None
        caches = PodCaches(
            self.config.parent_cache_size,
            self.config.partial_block_pages,
            journaled=journal is not None,
        )
        self._planner = Planner(
            token_processor,
            self.catalog,
            caches,
            tiers=self.config.tiers,
            reset_mediums=self.config.reset_mediums,
            offload_blocks_per_chunk=self.config.offload_blocks_per_chunk,
        )
        self._replay_factory = replay_factory
        self._log = RateLimitedLog(logger, self.config.reject_log_interval_s)
        self._stopping = threading.Event()
        """Set by :meth:`stop`: waits for the backend or for peers give up."""
        self._closed = threading.Event()
        """Set by :meth:`stop` once the receivers are done: nothing more is queued."""
        self._backend = IndexBackend(
            index,
            self.counters,
            stop=self._stopping,
            clock=time.monotonic,
            replay_factory=self._open_replay,
            retry_max_s=self.config.backend_retry_max_s,
            warn=self._log,
            scheme=scheme,
            journal=journal,
            snapshot=lambda pod: snapshot(caches.get(pod)),
        )
        self._sequencer = Sequencer(
            self.config,
            self._planner,
            self.counters,
            fenced=isinstance(index, BatchIndex) and self.config.use_watermarks,
            clock=time.monotonic,
            stopping=self._stopping.is_set,
            reject=self._reject,
        )
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._endpoints: list[EndpointConfig] = []
        self._queues: list[WorkQueue[_Queued]] = []
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
            names = {s.state.name for s in self._streams.values()}
            if endpoint.stream_name in names:
                raise ConfigError(
                    f"stream {endpoint.stream_name!r} is used by two endpoints; give each "
                    "publisher its own stream name"
                )
            shard = zlib.crc32(endpoint.shard_key.encode("utf-8", "surrogateescape"))
            self._streams[endpoint.endpoint] = _Stream(StreamState(endpoint), shard=shard)
            if is_http_endpoint(endpoint.endpoint):
                self._streams[endpoint.endpoint].states[0] = self._streams[endpoint.endpoint].state
            self._endpoints.append(endpoint)

    @property
    def endpoints(self) -> list[EndpointConfig]:
        """The configured publishers."""
        return list(self._endpoints)

    def _stream(self, endpoint: EndpointConfig | str | None) -> _Stream:
        key = endpoint.endpoint if isinstance(endpoint, EndpointConfig) else endpoint or "direct"
        st = self._streams.get(key)  # streams are only ever added (under the lock)
        if st is None:
            if isinstance(endpoint, EndpointConfig):
                self.add_endpoint(endpoint)
            else:
                self.add_endpoint(EndpointConfig(endpoint=key))
            with self._streams_lock:
                st = self._streams[key]
        return st

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
        return self._handle(st, topic_b, seq, payload)  # anything not bytes is a counted reject

    def process_many(self, messages: Iterable[Message]) -> list[BatchOutcome]:
        """Apply several engine messages now, in the caller's thread, as a worker applies the
        messages queued for it: consecutive messages that need nothing but their fenced step
        go to the index together (one ``apply_batches`` call, see
        :class:`~kvredis.index.MultiBatchIndex`), the others one by one, in order. Each message
        is ``(topic, seq, payload)`` or ``(topic, seq, payload, endpoint)``, with the meaning
        :meth:`process` gives them. Never raises on bad input; returns each one's outcome.
        """
        items: list[tuple[_Stream, object, int, object]] = []
        for message in messages:
            topic, seq, payload, *rest = message
            st = self._stream(rest[0] if rest else None)
            if isinstance(topic, str):
                topic = topic.encode("utf-8", "surrogateescape")
            items.append((st, topic, seq, payload))
        return self._handle_many(items)

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
        return self._enqueue(st, [(topic_b, seq, payload)], timeout)

    def enqueue_from_transport(
        self, endpoint: EndpointConfig, topic: bytes, seq: int, payload: bytes
    ) -> bool:
        """Used by subscribers: queue a received message (blocks while the queue is full)."""
        return self.enqueue_many_from_transport(endpoint, [(topic, seq, payload)])

    def enqueue_many_from_transport(
        self, endpoint: EndpointConfig, messages: Sequence[tuple[bytes, int, bytes]]
    ) -> bool:
        """Used by subscribers: queue messages received together, in order (blocks while the
        queue is full)."""
        self.counters.inc(Counter.RECEIVED, len(messages))
        return self._enqueue(self._stream(endpoint), messages, None)

    def subscribing(self, endpoint: EndpointConfig) -> None:
        """Used by subscribers: a subscription to ``endpoint`` is about to connect."""
        st = self._stream(endpoint)
        with st.lock:
            drive(self._sequencer.on_subscribe(st.state), self._backend.perform)

    def reject_message(self, reason: RejectReason, detail: str) -> None:
        """Count and log a message a transport could not even split into frames."""
        self.counters.inc(Counter.MESSAGES)
        self._reject(Rejection(reason, detail), "transport")

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers, a ZMQ subscriber per ZMQ endpoint and a poller per ``http://``
        (trtllm-serve) endpoint."""
        if self._started:
            return
        self._stopping.clear()
        self._closed.clear()
        with self._streams_lock:
            for st in self._streams.values():
                st.subscribed.clear()
        self._queues = [
            WorkQueue(self.config.queue_size, self.config.queue_bytes)
            for _ in range(self.config.workers)
        ]
        self._workers = [
            threading.Thread(
                target=self._worker, args=(q,), name=f"kvredis-ingest-{i}", daemon=True
            )
            for i, q in enumerate(self._queues)
        ]
        for worker in self._workers:
            worker.start()
        self._started = True
        polled = [e for e in self._endpoints if is_http_endpoint(e.endpoint)]
        real = [e for e in self._endpoints if "://" in e.endpoint and e not in polled]
        if real:
            from kvredis.ingest.zmq import SubscriberOptions, ZmqSubscriber, new_context

            self._context = new_context()
            for endpoint in real:
                options = SubscriberOptions(max_message_bytes=self.config.max_message_bytes)
                sub = ZmqSubscriber(endpoint, self, self._context, options)
                sub.start()
                self._receivers.append(sub)
        if polled:
            from kvredis.ingest.http import PollerOptions, TrtllmPoller

            for endpoint in polled:
                poller = TrtllmPoller(
                    endpoint, self, PollerOptions(max_answer_bytes=self.config.queue_bytes)
                )
                poller.start()
                self._receivers.append(poller)

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
        for q in self._queues:
            if not drain:
                self._done([item for item, _ in q.drain()])
            q.finish()
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
            from kvredis.ingest.zmq import close_context

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

    def stream_lags(self) -> dict[str, int]:
        """Per endpoint, by its stream name, messages received and not yet applied (queued or
        in progress): an endpoint's engines (with the pod taken from the topic) and
        attention-DP ranks (TensorRT-LLM) share its queue."""
        with self._streams_lock:
            streams = list(self._streams.values())
        with self._idle:
            return {st.state.endpoint.stream_name: st.queued for st in streams}

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

    # -- replay clients --------------------------------------------------------------------

    def _open_replay(self, endpoint: EndpointConfig) -> ReplayClient | None:
        if self._replay_factory is not None:
            return self._replay_factory(endpoint)
        if not endpoint.replay_endpoint:
            return None
        from kvredis.ingest.zmq import ZmqReplayClient

        return ZmqReplayClient(
            endpoint.replay_endpoint,
            timeout_s=self.config.replay_timeout_s,
            max_batches=self.config.max_replay_batches,
            max_message_bytes=self.config.max_message_bytes,
            max_bytes=self.config.queue_bytes,
            on_bad_message=lambda detail: self._reject(
                Rejection(RejectReason.BAD_MESSAGE, detail), "replay"
            ),
        )

    def _close_replays(self) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        self._backend.close_replays()
        for st in streams:
            for state in st.all_states():
                state.has_replay = None

    # -- workers ---------------------------------------------------------------------------

    def _handle(self, st: _Stream, topic: object, seq: int, payload: object) -> BatchOutcome:
        with st.lock:
            state, decoded = self._route(st, topic, payload)
            steps = self._sequencer.on_message(state, topic, seq, payload, decoded)
            return drive(steps, self._backend.perform)

    def _route(
        self,
        st: _Stream,
        topic: object,
        payload: object,
        before_io: Callable[[], None] | None = None,
    ) -> tuple[StreamState, DecodedBatch | None]:
        """The stream a message of endpoint ``st`` belongs to, and its payload when routing
        had to decode it. ``before_io`` runs before routing performs an index action (the
        clear of an engine replaced on a topic-named endpoint)."""
        endpoint = st.state.endpoint
        if is_http_endpoint(endpoint.endpoint):
            return self._rank_stream(st, payload)
        if endpoint.identified_by_topic:
            return self._topic_stream(st, topic, before_io), None
        return st.state, None

    def _topic_stream(
        self, st: _Stream, topic: object, before_io: Callable[[], None] | None = None
    ) -> StreamState:
        """The stream of the engine ``topic`` names (``kv@<pod>@<model>``); a change of engine
        clears the previous engine's pod, on its own stream."""
        if not isinstance(topic, (bytes, bytearray)) or not topic:
            return st.state
        endpoint = st.state.endpoint
        pod, model = st.state.identity(bytes(topic))
        if pod is None:
            return st.state
        key = (pod, model)
        if key == st.engine_key:
            return st.state
        state = st.states.get(key)
        if state is None:
            state = StreamState(endpoint, stream=endpoint.topic_stream_name(pod, model))
            st.states[key] = state
        previous, previous_key = st.state, st.engine_key
        st.state, st.engine_key = state, key
        if previous_key is not None and previous is not state:
            if before_io is not None:
                before_io()
            drive(self._sequencer.on_replaced(previous), self._backend.perform)
        return state

    def _rank_stream(self, st: _Stream, payload: object) -> tuple[StreamState, DecodedBatch]:
        """A TensorRT-LLM event's stream (its attention-DP rank's) and the event, decoded. A
        drained source hands each event out once: the stored watermark read before a stream's
        first event in this run covers only events handed out before, as a subscription's."""
        base = st.states[0]
        decoded = base.decode(payload)
        rank = decoded.data_parallel_rank or 0
        state = st.states.get(rank)
        if state is None:
            endpoint = base.endpoint
            state = StreamState(endpoint, stream=f"{endpoint.stream_name}#dp{rank}")
            st.states[rank] = state
        st.state = state
        if rank not in st.subscribed:
            st.subscribed.add(rank)
            drive(self._sequencer.on_subscribe(state), self._backend.perform)
        return state, decoded

    def _handle_many(
        self, items: Sequence[tuple[_Stream, object, int, object]]
    ) -> list[BatchOutcome]:
        """Handle messages in order, applying the fast batches among them together
        (:class:`~kvredis.ingest.sequencer.BatchGroup`): a group is applied before any message
        that needs more (a lookup, a clear, a gap, a restart, another engine on an endpoint) is
        handled, so the index sees every message's effect in order."""
        group = BatchGroup(
            self._sequencer,
            self._backend.perform,
            self._backend.apply_steps,
            self.config.max_batches_per_call,
        )
        held: list[_Stream] = []
        try:
            for number, (st, topic, seq, payload) in enumerate(items):
                if not any(st is h for h in held):
                    st.lock.acquire()
                    held.append(st)
                state, decoded = self._route(st, topic, payload, group.flush)
                group.handle(number, state, topic, seq, payload, decoded)
            group.flush()
        finally:
            for st in held:
                st.lock.release()
        return [group.outcomes.get(n, BatchOutcome.FAILED) for n in range(len(items))]

    def _enqueue(
        self,
        st: _Stream,
        messages: Sequence[tuple[bytes, int, bytes]],
        timeout: float | None,
    ) -> bool:
        """Queue ``messages`` of ``st`` for its worker, in order; ``False`` if not all of them
        were queued (the ingester is closing, or ``timeout`` expired)."""
        q = self._queues[st.shard % len(self._queues)]
        n = len(messages)
        items: list[_Queued] = []
        sizes: list[int] = []
        for topic, seq, payload in messages:
            items.append((st, topic, seq, payload))
            sizes.append(len(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else 0)
        with self._idle:
            self._inflight += n
            st.queued += n
        deadline = None if timeout is None else time.monotonic() + timeout
        queued = q.put(items, sizes, deadline, self._closed)
        if queued < n:
            self._done(items[queued:])
            return False
        return True

    def _done(self, items: Sequence[_Queued]) -> None:
        """Messages handled (or dropped): no longer in flight."""
        if not items:
            return
        with self._idle:
            self._inflight -= len(items)
            for st, *_ in items:
                st.queued -= 1
            if not self._inflight:
                self._idle.notify_all()

    def _worker(self, q: WorkQueue[_Queued]) -> None:
        # what is queued goes to the index together (group commit): one index call for every
        # batch that needs nothing but its step
        limit = max(1, self.config.max_batches_per_call)
        while True:
            taken = q.take(limit)
            if taken is None:
                return
            items = [item for item, _ in taken]
            try:
                self._handle_many(items)
            except Exception:  # the worker must survive anything
                logger.exception("unexpected error while ingesting a batch")
                self.counters.inc(Counter.BATCHES_FAILED)
            finally:
                q.release(sum(size for _, size in taken))
                self._done(items)

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

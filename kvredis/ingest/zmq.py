"""ZMQ transport for event ingestion: a SUB subscriber per engine and the engine replay protocol.

Live events: the engine's PUB socket sends ``[topic, seq (8 bytes big-endian), payload]``. One
:class:`ZmqSubscriber` thread per endpoint owns a SUB socket, validates the frames and queues the
messages into a :class:`~kvredis.ingest.transport.MessageSink` (the
:class:`~kvredis.ingest.EventIngester`'s worker queues, blocking while they are full): those
waiting on the socket, up to 64, in one hand-off when the sink is a
:class:`~kvredis.ingest.transport.BurstSink`, else one by one. libzmq reconnects on its own with
exponential backoff (``reconnect_ivl_s`` doubling up to
``reconnect_ivl_max_s``); ZMTP heartbeats detect a publisher that vanished without closing the
connection, so a restarted engine is reconnected to and its reset sequence numbers are noticed.
Socket errors recreate the socket after a backoff.

Replay: an engine started with a replay endpoint binds a ROUTER socket. :class:`ZmqReplayClient`
sends ``[b"", start_seq (8 bytes)]`` from a DEALER and reads ``[b"", topic, seq8, payload]`` for
every buffered batch with ``seq >= start_seq`` (older engines omit the topic frame:
``[b"", seq8, payload]``), up to the end marker ``[b"", b"", b"\\xff" * 8, b""]`` (or
``[b"", b"\\xff" * 8, b""]``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvredis.ingest.config import EndpointConfig
from kvredis.ingest.counters import Counter
from kvredis.ingest.events import RejectReason
from kvredis.ingest.transport import BurstSink, MessageSink, ReplayedMessage

__all__ = [
    "END_SEQ",
    "SubscriberOptions",
    "ZmqReplayClient",
    "ZmqSubscriber",
    "close_context",
    "new_context",
]

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
"""The sequence frame of the replay end marker."""


def new_context() -> Any:
    """A private ZMQ context for an ingester's sockets."""
    return zmq.Context()


def close_context(context: Any) -> None:
    """Close every socket of ``context`` (linger 0) and terminate it."""
    context.destroy(linger=0)


@dataclass(frozen=True, slots=True)
class SubscriberOptions:
    """Socket tuning of a :class:`ZmqSubscriber`."""

    rcvhwm: int = 1000
    """Messages ZMQ queues while the receiver is blocked (backpressure); more are dropped."""
    max_message_bytes: int = -1
    """ZMQ_MAXMSGSIZE: larger messages are refused before they are buffered (-1: no limit)."""
    reconnect_ivl_s: float = 0.1
    reconnect_ivl_max_s: float = 5.0
    heartbeat_ivl_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    poll_s: float = 0.1
    error_backoff_max_s: float = 5.0


_BURST = 64
"""Messages a subscriber receives before it queues them to the workers together."""
_DRAIN_ROUNDS = 16
"""Bursts a subscriber queues before it looks at its monitor and stop flag again."""

_NO_RETRY_S = 0.5
"""How long after a disconnect ZMQ must report a reconnect attempt before the socket is reopened."""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class ZmqSubscriber:
    """Receives one engine's live batches on a SUB socket in a thread and queues them."""

    def __init__(
        self,
        endpoint: EndpointConfig,
        sink: MessageSink,
        context: Any,
        options: SubscriberOptions | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._sink = sink
        self._burst = sink if isinstance(sink, BurstSink) else None
        """The sink, when it takes the messages received together in one call."""
        self._context = context
        self._options = options or SubscriberOptions()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvredis-sub-{endpoint.endpoint}", daemon=True
        )
        self.connected = threading.Event()
        """Set while the SUB socket has a connection to the publisher."""
        self._lost_at: float | None = None
        """When the connection was lost, until ZMQ reports it is reconnecting."""

    def start(self) -> None:
        """Start the receiving thread."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop (see :meth:`join`)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to finish."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _open(self) -> tuple[Any, Any]:
        opts = self._options
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, opts.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, opts.max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, _ms(opts.reconnect_ivl_s))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _ms(opts.reconnect_ivl_max_s))
        sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(opts.heartbeat_ivl_s))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(opts.heartbeat_timeout_s))
        sock.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic_filter.encode("utf-8"))
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        try:
            sock.connect(self.endpoint.endpoint)
        except zmq.ZMQError:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise
        return sock, monitor

    def _run(self) -> None:
        counters = self._sink.counters
        backoff = self._options.reconnect_ivl_s
        self._sink.subscribing(self.endpoint)
        while not self._stop.is_set():
            try:
                sock, monitor = self._open()
            except zmq.ZMQError as exc:
                counters.inc(Counter.TRANSPORT_ERRORS)
                logger.warning("cannot connect to %s: %s", self.endpoint.endpoint, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._options.error_backoff_max_s)
                continue
            backoff = self._options.reconnect_ivl_s
            try:
                self._loop(sock, monitor)
            except zmq.ZMQError as exc:
                counters.inc(Counter.TRANSPORT_ERRORS)
                logger.warning("socket error on %s, reopening: %s", self.endpoint.endpoint, exc)
                self._stop.wait(backoff)
            finally:
                self.connected.clear()
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)

    def _loop(self, sock: Any, monitor: Any) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poll_ms = _ms(self._options.poll_s)
        self._lost_at = None
        while not self._stop.is_set():
            ready = dict(poller.poll(poll_ms))
            if monitor in ready:
                self._drain_monitor(monitor)
            if self._lost_at is not None and time.monotonic() - self._lost_at > _NO_RETRY_S:
                # ZMQ does not reconnect after a protocol error (such as a message over
                # ZMQ_MAXMSGSIZE): reopen the socket
                self._sink.counters.inc(Counter.TRANSPORT_ERRORS)
                logger.warning(
                    "%s dropped the connection for good (a message over %d bytes?); reopening",
                    self.endpoint.endpoint,
                    self._options.max_message_bytes,
                )
                return
            if sock in ready:
                for _ in range(_DRAIN_ROUNDS):
                    received, error = self._receive(sock)
                    if received and not self._hand_off(received):
                        return
                    if error is not None:  # after what came before it was queued
                        raise error
                    if len(received) < _BURST:
                        break

    def _drain_monitor(self, monitor: Any) -> None:
        counters = self._sink.counters
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event.get("event")
            if kind == zmq.EVENT_CONNECTED:
                self._lost_at = None
                counters.inc(Counter.CONNECTS)
                self.connected.set()
                logger.info("connected to %s", self.endpoint.endpoint)
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self._lost_at = None
            elif kind == zmq.EVENT_DISCONNECTED:
                counters.inc(Counter.DISCONNECTS)
                self._lost_at = time.monotonic()
                self.connected.clear()
                logger.warning("disconnected from %s, reconnecting", self.endpoint.endpoint)

    def _receive(self, sock: Any) -> tuple[list[tuple[bytes, int, bytes]], zmq.ZMQError | None]:
        """The messages waiting on ``sock`` (at most ``_BURST``), received without blocking,
        and the socket error that cut them short, if any (raised once they are queued);
        malformed ones are rejected on the way."""
        out: list[tuple[bytes, int, bytes]] = []
        recv = sock.recv_multipart
        for _ in range(_BURST):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                return out, exc
            if len(frames) != 3 or len(frames[1]) != 8:
                self._sink.reject_message(
                    RejectReason.BAD_MESSAGE,
                    f"expected [topic, seq(8 bytes), payload], got {len(frames)} frames "
                    f"from {self.endpoint.endpoint}",
                )
                continue
            topic, seq_frame, payload = frames
            out.append((topic, int.from_bytes(seq_frame, "big"), payload))
        return out, None

    def _hand_off(self, received: list[tuple[bytes, int, bytes]]) -> bool:
        """Queue messages received together; ``False`` once the sink is closing."""
        if self._burst is not None:
            return self._burst.enqueue_many_from_transport(self.endpoint, received)
        enqueue = self._sink.enqueue_from_transport
        return all(enqueue(self.endpoint, t, s, p) for t, s, p in received)


class ZmqReplayClient:
    """Asks an engine's replay ROUTER for buffered batches (one DEALER per request)."""

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 2.0,
        max_batches: int = 20_000,
        on_bad_message: Callable[[str], None] | None = None,
        max_message_bytes: int = -1,
        max_bytes: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._timeout_ms = _ms(timeout_s)
        self._max = max_batches
        self._max_message_bytes = max_message_bytes
        self._max_bytes = max_bytes
        """Payload bytes one fetch keeps at most; the rest of the replay is not read."""
        self._on_bad = on_bad_message
        self._context = zmq.Context()

    def fetch(self, start_seq: int) -> list[ReplayedMessage] | None:
        """Every buffered batch with ``seq >= start_seq``, in the order sent.

        Returns ``None`` when the endpoint does not answer within the timeout; a replay cut off
        by the timeout returns what arrived.
        """
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        out: list[ReplayedMessage] = []
        kept = 0
        try:
            sock.connect(self.endpoint)
            sock.send_multipart([b"", int(start_seq).to_bytes(8, "big")])
            while len(out) < self._max:
                if not sock.poll(self._timeout_ms):
                    logger.warning(
                        "replay from %s timed out after %d batches", self.endpoint, len(out)
                    )
                    return out or None
                frames = sock.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else None
                if body is not None and len(body) == 3:
                    topic, seq_frame, payload = body
                elif body is not None and len(body) == 2:
                    topic = b""
                    seq_frame, payload = body
                else:
                    self._bad(f"replay message with {len(frames)} frames")
                    continue
                if seq_frame == END_SEQ:
                    return out
                if len(seq_frame) != 8:
                    self._bad(f"replay seq frame of {len(seq_frame)} bytes")
                    continue
                kept += len(payload)
                if self._max_bytes is not None and kept > self._max_bytes:
                    logger.warning(
                        "replay from %s cut at %d batches: over %d bytes",
                        self.endpoint,
                        len(out),
                        self._max_bytes,
                    )
                    return out
                out.append(ReplayedMessage(topic, int.from_bytes(seq_frame, "big"), payload))
            return out
        except zmq.ZMQError as exc:
            logger.warning("replay from %s failed: %s", self.endpoint, exc)
            return out or None
        finally:
            sock.close(linger=0)

    def _bad(self, detail: str) -> None:
        if self._on_bad is not None:
            self._on_bad(detail)

    def close(self) -> None:
        """Terminate the client's ZMQ context."""
        self._context.destroy(linger=0)

"""HTTP transport for event ingestion: polling ``trtllm-serve``'s ``/kv_cache_events``.

TensorRT-LLM publishes nothing: ``trtllm-serve`` buffers its KV cache events (up to
``kv_cache_config.event_buffer_max_size``, the oldest dropped when full) and ``POST
/kv_cache_events`` answers with every event buffered since the previous call, as a JSON array,
after waiting a moment (two seconds in TensorRT-LLM 1.2) when there is none. Each event is handed
out once, to whichever caller asks first, and there is no replay. One :class:`TrtllmPoller`
thread per endpoint asks in a loop over one keep-alive connection and queues one message per
event into a :class:`~kvredis.ingest.transport.MessageSink`: ``(endpoint, b"", event_id, event
JSON)`` (:func:`kvredis.ingest.trtllm.split_events`), blocking while the ingester's queues are
full (the engine's buffer then fills, and what it drops shows up as a gap).

A poller is connected (``connects``) from its first answer on, disconnected (``disconnects``)
when a request fails; it retries with a backoff. An answer that is not an array of events is a
transport error, logged with what the status code usually means.
"""

from __future__ import annotations

import http.client
import logging
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvredis.ingest.config import EndpointConfig
from kvredis.ingest.counters import Counter
from kvredis.ingest.events import RejectReason
from kvredis.ingest.transport import MessageSink
from kvredis.ingest.trtllm import split_events

__all__ = ["EVENTS_PATH", "PollerOptions", "TrtllmPoller"]

logger = logging.getLogger(__name__)

EVENTS_PATH = "/kv_cache_events"
"""trtllm-serve's route for the buffered KV cache events (``POST``)."""


@dataclass(frozen=True, slots=True)
class PollerOptions:
    """Timing of a :class:`TrtllmPoller`."""

    poll_interval_s: float = 0.05
    """Pause after an empty answer (trtllm-serve already waits for events before answering)."""
    timeout_s: float = 10.0
    """Connect and read timeout of one request (above the server's own wait)."""
    backoff_s: float = 0.1
    backoff_max_s: float = 5.0
    max_answer_bytes: int = 64 * 2**20
    """Larger answers are refused (and their events lost: a gap)."""


class TrtllmPoller:
    """Polls one trtllm-serve's ``/kv_cache_events`` in a thread and queues its events."""

    def __init__(
        self, endpoint: EndpointConfig, sink: MessageSink, options: PollerOptions | None = None
    ) -> None:
        self.endpoint = endpoint
        self._sink = sink
        self._options = options or PollerOptions()
        parts = urlsplit(endpoint.endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._path = parts.path.rstrip("/") + EVENTS_PATH
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"kvredis-sub-{endpoint.endpoint}", daemon=True
        )
        self.connected = threading.Event()
        """Set while trtllm-serve answers."""

    def start(self) -> None:
        """Start the polling thread."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop after the request in flight (its events are still queued)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to finish."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._options.timeout_s)
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _lost(self, why: str) -> None:
        counters = self._sink.counters
        counters.inc(Counter.TRANSPORT_ERRORS)
        if self.connected.is_set():
            self.connected.clear()
            counters.inc(Counter.DISCONNECTS)
            logger.warning("lost %s: %s; retrying", self.endpoint.endpoint, why)
        else:
            logger.warning("cannot poll %s: %s; retrying", self.endpoint.endpoint, why)

    def _run(self) -> None:
        opts = self._options
        backoff = opts.backoff_s
        try:
            while not self._stop.is_set():
                body = self._poll()
                if body is None:
                    self._close()
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, opts.backoff_max_s)
                    continue
                backoff = opts.backoff_s
                if not self.connected.is_set():
                    self.connected.set()
                    self._sink.counters.inc(Counter.CONNECTS)
                    logger.info("polling %s", self.endpoint.endpoint)
                delivered = self._deliver(body)
                if delivered is None:
                    return  # the sink is closing
                if not delivered:
                    self._stop.wait(opts.poll_interval_s)
        finally:
            self._close()
            if self.connected.is_set():
                self.connected.clear()
                self._sink.counters.inc(Counter.DISCONNECTS)

    def _poll(self) -> bytes | None:
        """One ``POST``: the answer's body, or ``None`` after a failure (counted, logged)."""
        try:
            conn = self._connection()
            conn.request(
                "POST", self._path, body=b"", headers={"Content-Length": "0", "Accept": "*/*"}
            )
            response = conn.getresponse()
            body = response.read(self._options.max_answer_bytes + 1)
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            self._lost(f"{type(exc).__name__}: {exc}")
            return None
        if status != 200:
            hint = (
                " (is this trtllm-serve, with kv_cache_config.event_buffer_max_size > 0?)"
                if status in (404, 405)
                else ""
            )
            self._lost(f"POST {self._path} answered HTTP {status}{hint}")
            return None
        if len(body) > self._options.max_answer_bytes:
            self._lost(f"an answer over {self._options.max_answer_bytes} bytes (events lost)")
            return None
        return body

    def _deliver(self, body: bytes) -> bool | None:
        """Queue the answer's events: whether there was one (``None``: the sink is closing)."""
        events, problems = split_events(body)
        for problem in problems:
            self._sink.reject_message(
                RejectReason.BAD_MESSAGE, f"{self.endpoint.endpoint}: {problem}"
            )
        for event in events:
            if not self._sink.enqueue_from_transport(
                self.endpoint, b"", event.event_id, event.payload
            ):
                return None
        return bool(events)

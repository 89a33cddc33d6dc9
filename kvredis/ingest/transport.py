"""The seam between the ingester and its transports.

A transport (the ZMQ subscriber of :mod:`kvredis.ingest.zmq`, or anything else) delivers engine
messages into a :class:`MessageSink`; a :class:`ReplayClient` fetches the batches an engine still
buffers. Both sides depend on these protocols only, so the ingester never imports a transport
module unless it starts one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvredis.ingest.config import EndpointConfig
from kvredis.ingest.counters import IngestCounters
from kvredis.ingest.events import RejectReason

__all__ = ["BurstSink", "MessageSink", "ReplayClient", "ReplayFactory", "ReplayedMessage"]


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


ReplayFactory = Callable[[EndpointConfig], "ReplayClient | None"]
"""Builds the replay client of a publisher (``None``: it has no replay endpoint)."""


class MessageSink(Protocol):
    """Where a subscriber delivers engine messages (an :class:`~kvredis.ingest.EventIngester`)."""

    @property
    def counters(self) -> IngestCounters:
        """Where the transport counts connects, disconnects and socket errors."""
        ...

    def enqueue_from_transport(
        self, endpoint: EndpointConfig, topic: bytes, seq: int, payload: bytes
    ) -> bool:
        """Queue one received message (blocks while full); ``False`` once the sink is closing."""
        ...

    def subscribing(self, endpoint: EndpointConfig) -> None:
        """Called once before the subscription to ``endpoint`` connects (it reads the stream's
        stored watermark, so that whatever arrives afterwards is known to be newer)."""
        ...

    def reject_message(self, reason: RejectReason, detail: str) -> None:
        """Count and log a message the transport could not even split into frames."""
        ...


@runtime_checkable
class BurstSink(MessageSink, Protocol):
    """A :class:`MessageSink` that also takes the messages a transport received together in one
    call (the :class:`~kvredis.ingest.EventIngester` is one): one hand-off for them instead of
    one per message. A transport hands a sink that is not one the messages one by one."""

    def enqueue_many_from_transport(
        self, endpoint: EndpointConfig, messages: Sequence[tuple[bytes, int, bytes]]
    ) -> bool:
        """Queue messages received together, each ``(topic, seq, payload)``, in order (blocks
        while full); ``False`` once the sink is closing (the rest are not queued)."""
        ...

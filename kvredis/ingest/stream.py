"""One publisher's sequencing state, and how a batch's place in it is encoded in a watermark.

A watermark ``position`` packs the engine ``seq`` and a 16-bit *phase*:
``((seq + 1) << 16) | phase``. ``seq = -1`` is the start of an epoch; phase :data:`PHASE_DONE`
marks a batch fully applied, lower phases the steps of a multi-step batch in progress (see
``docs/ingest-protocol.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvredis.ingest.config import EndpointConfig
from kvredis.ingest.events import parse_topic

__all__ = [
    "CLEAR_PHASE",
    "MAX_ENGINE_SEQ",
    "PHASE_BITS",
    "PHASE_DONE",
    "PHASE_LAST_STEP",
    "StreamState",
    "split_position",
    "stream_position",
]

PHASE_BITS = 16
PHASE_DONE = (1 << PHASE_BITS) - 1
"""The phase of a batch that is fully applied."""
PHASE_LAST_STEP = PHASE_DONE - 1
"""The highest phase an intermediate step of a multi-step batch may use."""
CLEAR_PHASE = 1 << (PHASE_BITS - 1)
"""The first phase of a batch that opens with a gap clear: a claim at this phase or above tells
whoever takes it over that the clear is part of the batch (other batches stay below it)."""
MAX_ENGINE_SEQ = (1 << 47) - 2
"""Largest engine ``seq`` that fits a watermark position."""


def stream_position(seq: int, phase: int = PHASE_DONE) -> int:
    """The watermark position of engine batch ``seq`` (``-1``: epoch start) at ``phase``."""
    return ((seq + 1) << PHASE_BITS) | phase


def split_position(position: int) -> tuple[int, int]:
    """Inverse of :func:`stream_position`: ``(seq, phase)``."""
    return (position >> PHASE_BITS) - 1, position & PHASE_DONE


@dataclass
class StreamState:
    """What this ingester knows about one publisher's stream (guarded by its caller's lock)."""

    endpoint: EndpointConfig
    synced: bool = False
    """Whether the stored watermark was read since this ingester started following the stream."""
    epoch: int = 0
    last_seq: int | None = None
    """The last ``seq`` handled on the current subscription (None: a fresh subscriber)."""
    subscribed_before: bool = False
    """Whether ``known`` was read before the subscription delivered its first message (so a
    first ``seq`` below it can only come from a new engine incarnation)."""
    superseded: bool = False
    """Whether the subscription still delivers an engine incarnation older than ``epoch``'s
    successor a peer already started: its batches are dropped until ``seq`` goes back."""
    known: tuple[int, int] | None = None
    """Last known stored position of ``epoch`` as ``(seq, phase)`` (None: nothing applied)."""
    pods: set[str] = field(default_factory=set)
    """Every pod this stream's batches named."""
    ranks: set[int] = field(default_factory=set)
    """Every data-parallel rank this stream's batches carried (0 for none)."""
    last_topic: bytes = b""
    next_reset_check: float = 0.0
    """When the stored watermark is next read back to detect a namespace reset (clock time)."""
    has_replay: bool | None = None
    """Whether the publisher has a replay client (None: not asked yet)."""

    @property
    def name(self) -> str:
        """The watermark stream name."""
        return self.endpoint.stream_name

    def known_at_least(self, seq: int) -> bool:
        """Whether the stored position is known to have reached batch ``seq`` (done)."""
        return self.known is not None and stream_position(*self.known) >= stream_position(seq)

    def dirty(self) -> bool:
        """Whether entries of the current epoch may have been applied from this stream."""
        return self.known is not None and self.known[0] >= 0

    def identity(self, topic: bytes) -> tuple[str | None, str | None]:
        """``(pod, model)`` of a message: the endpoint configuration, else its topic."""
        ep = self.endpoint
        if ep.pod_id and ep.model_name:
            return ep.pod_id, ep.model_name
        topic_pod: str | None = None
        topic_model: str | None = None
        if topic:
            topic_pod, topic_model = parse_topic(topic.decode("utf-8", "replace"))
        return ep.pod_id or topic_pod, ep.model_name or topic_model

    def pods_for(self, topic: bytes | None) -> set[str]:
        """Every pod a clear of this stream must cover (with the one ``topic`` names)."""
        pods = set(self.pods)
        if self.endpoint.pod_id:
            pods.add(self.endpoint.pod_id)
        if topic is not None:
            pod, _ = self.identity(topic)
            if pod:
                pods.add(pod)
        return pods

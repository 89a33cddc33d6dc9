"""One publisher's sequencing state, and how a batch's place in it is encoded in a watermark.

A stream is one engine's sequence of batches: an endpoint's, or, when its pod and model come
from the topic, each engine's that the endpoint publishes (and, for TensorRT-LLM, each
attention-DP rank's). Its state also holds the decoder of its endpoint's wire format (the seam
between transports and the sequencer: msgpack batches of vLLM and SGLang, TensorRT-LLM's JSON
events) and the engine it learned its batches come from.

A watermark ``position`` packs the engine ``seq`` and a 16-bit *phase*:
``((seq + 1) << 16) | phase``. ``seq = -1`` is the start of an epoch; phase :data:`PHASE_DONE`
marks a batch fully applied, lower phases the steps of a multi-step batch in progress (see
``docs/ingest-protocol.md``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from kvredis.ingest.config import EndpointConfig, is_http_endpoint
from kvredis.ingest.events import DecodedBatch, Engine, decode_batch, parse_topic
from kvredis.ingest.trtllm import TrtllmDecoder

__all__ = [
    "CLEAR_PHASE",
    "MAX_ENGINE_SEQ",
    "PHASE_BITS",
    "PHASE_DONE",
    "PHASE_LAST_STEP",
    "Decoder",
    "StreamState",
    "decoder_for",
    "split_position",
    "stream_position",
]

logger = logging.getLogger(__name__)


class Decoder(Protocol):
    """A wire format: one message payload to a decoded batch (never raises); with ``hint``, the
    batch names the engine its shape shows, if any."""

    def __call__(self, payload: object, *, hint: bool = True) -> DecodedBatch: ...


def decoder_for(endpoint: EndpointConfig) -> Decoder:
    """The decoder of ``endpoint``'s wire format: TensorRT-LLM's JSON events for an ``http://``
    endpoint (a :class:`~kvredis.ingest.trtllm.TrtllmDecoder` of its own), else vLLM's and
    SGLang's msgpack batches."""
    return TrtllmDecoder() if is_http_endpoint(endpoint.endpoint) else decode_batch


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
    stream: str | None = None
    """The watermark stream's name, when not the endpoint's own (one engine of an endpoint whose
    pod and model come from the topic, one attention-DP rank of a TensorRT-LLM endpoint)."""
    decoder: Decoder | None = None
    """The endpoint's wire format (default: :func:`decoder_for` the endpoint)."""
    engine: Engine | None = None
    """The engine publishing the stream: configured (``EndpointConfig.engine``), else learned
    from the first batch whose shape names one (see :mod:`kvredis.ingest.events`)."""
    _conflict_seen: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.decoder is None:
            self.decoder = decoder_for(self.endpoint)
        if self.engine is None:
            self.engine = self.endpoint.engine_kind

    @property
    def name(self) -> str:
        """The watermark stream name."""
        return self.stream or self.endpoint.stream_name

    def decode(self, payload: object) -> DecodedBatch:
        """``payload`` decoded by the endpoint's wire format, its ``engine`` the stream's."""
        assert self.decoder is not None
        return self.with_engine(self.decoder(payload, hint=self.engine is None))

    def with_engine(self, decoded: DecodedBatch) -> DecodedBatch:
        """``decoded`` with the stream's engine (learning it from ``decoded`` if not known)."""
        engine = self.engine
        seen = decoded.engine
        if engine is None and seen is not None:
            self.engine = engine = seen
            logger.info("stream %s: the events are %s's", self.name, seen.value)
        elif seen is not None and seen is not engine and not self._conflict_seen:
            self._conflict_seen = True
            logger.warning(
                "stream %s: a batch looks like %s's, the stream is taken for %s's "
                "(set the endpoint's engine if that is wrong)",
                self.name,
                seen.value,
                engine.value if engine is not None else "?",
            )
        if seen is engine:
            return decoded
        # (the constructor, not dataclasses.replace: this runs for every message)
        return DecodedBatch(
            decoded.ts,
            decoded.events,
            decoded.data_parallel_rank,
            decoded.rejects,
            decoded.total_events,
            engine,
        )

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

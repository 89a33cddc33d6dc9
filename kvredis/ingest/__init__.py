"""Event ingestion: apply engine KV-cache event batches to an Index in order, once, fast.

:class:`EventIngester` subscribes to the KV-cache events vLLM and SGLang publish, polls those
TensorRT-LLM's ``trtllm-serve`` hands out (or is fed them), and keeps an index true to what every
pod holds. Several ingesters can share one index: the
watermark/epoch protocol they follow, and its limits, are in ``docs/ingest-protocol.md``.

The modules, each importing (at its top) only those listed before it:

=============  ===============================================================================
events         wire decoding (and encoding) of engine batches into typed events
trtllm         TensorRT-LLM's JSON KV cache events decoded into the same events
config         :class:`EndpointConfig` (a publisher), :class:`IngesterConfig` (tuning),
               :func:`tune_collector` (the process's garbage collector)
counters       :class:`Counter` names, :class:`IngestCounters`, rate-limited warnings
chains         what is remembered of the engines' chains per pod, and how an event advances one
journal        the page journal: page records kept per pod beside the index (restarts, takeovers)
transport      the seam to transports: :class:`MessageSink` (:class:`BurstSink`: in bursts),
               :class:`ReplayClient`
stream         one engine's sequencing state, its wire decoder; the watermark position encoding
actions        the vocabulary of the state machine: the actions it yields, their results
planner        decoded batch → index operations (pure; asks for lookups and barriers)
sequencer      the ingest protocol as a sans-IO state machine that yields actions
backend        the port those actions run against: index calls with retry, replay, waiting
workqueue      a worker's queue: bounded in messages and bytes, filled and drained in bursts
service        :class:`EventIngester`: lifecycle, workers, queues; drives the sequencer
zmq            the ZMQ subscriber and replay client (the only module that loads pyzmq)
http           the trtllm-serve poller (``POST /kv_cache_events``)
metrics        the counters as Prometheus metrics (:class:`~kvredis.ingest.metrics.IngestMetrics`)
=============  ===============================================================================

The ``kvredis ingest`` command is :mod:`kvredis.cli.ingest`.

Importing this package loads neither pyzmq nor redis-py: :mod:`kvredis.ingest.zmq` is imported
by :meth:`EventIngester.start` only when an endpoint is a real ZMQ address (or a replay endpoint
is used).
"""

from __future__ import annotations

from kvredis.ingest.actions import BatchOutcome
from kvredis.ingest.config import GC_THRESHOLD, EndpointConfig, IngesterConfig, tune_collector
from kvredis.ingest.counters import COUNTER_NAMES, Counter, IngestCounters
from kvredis.ingest.events import Engine
from kvredis.ingest.planner import chunk_engine_key, group_engine_key
from kvredis.ingest.service import EventIngester
from kvredis.ingest.stream import MAX_ENGINE_SEQ, PHASE_DONE, split_position, stream_position
from kvredis.ingest.transport import (
    BurstSink,
    MessageSink,
    ReplayClient,
    ReplayedMessage,
    ReplayFactory,
)

__all__ = [
    "COUNTER_NAMES",
    "GC_THRESHOLD",
    "MAX_ENGINE_SEQ",
    "PHASE_DONE",
    "BatchOutcome",
    "BurstSink",
    "Counter",
    "EndpointConfig",
    "Engine",
    "EventIngester",
    "IngestCounters",
    "IngesterConfig",
    "MessageSink",
    "ReplayClient",
    "ReplayFactory",
    "ReplayedMessage",
    "chunk_engine_key",
    "group_engine_key",
    "split_position",
    "stream_position",
    "tune_collector",
]

"""Prometheus metrics of an index: :class:`InstrumentedIndex` and its asyncio twin.

``InstrumentedIndex(index, registry=...)`` wraps any index (keeping its capabilities, see
:mod:`kvredis.observed`) and exports, in ``registry`` (default: ``prometheus_client.REGISTRY``):

The upstream llm-d ``kvblock`` metrics, under their names, so the dashboards of a mixed Go/Python
fleet work unchanged:

=========================================  =========================================================
``kvcache_index_admissions_total``         {backend} request keys added (``add``, and the adds of
                                           an applied ``apply_batch``)
``kvcache_index_evictions_total``          {backend} pod entries named by evicts (``evict``, and the
                                           evicts of an applied ``apply_batch``)
``kvcache_index_lookup_requests_total``    ``lookup`` calls (failed ones included)
``kvcache_index_lookup_hits_total``        per lookup, the entry count of the pod with the most
                                           entries in the result
``kvcache_index_max_pod_hit_count_total``  the same sum (upstream exports it twice)
``kvcache_index_lookup_latency_seconds``   histogram of ``lookup`` latency (default buckets)
=========================================  =========================================================

kvredis's own, each with a ``backend`` label:

===========================================  ======================================================
``kvredis_index_operation_seconds``          histogram of every call's latency, by ``op``
``kvredis_index_errors_total``               calls that raised, by ``op`` and ``kind`` (the
                                             exception class)
``kvredis_index_clears_total``               pod clears
``kvredis_index_clear_entries_removed_total`` (request key, entry) pairs removed by clears
``kvredis_index_redis_round_trips_total``    round trips to the server, for an index that counts
                                             them (:class:`RoundTripCounter`)
===========================================  ======================================================

A router that scores through Redis (``Indexer.score_tokens`` on a
:class:`~kvredis.index.ScoringIndex`) calls ``score``, not ``lookup``: its calls show in
``kvredis_index_operation_seconds{op="score"}``, not in the ``lookup`` metrics (as upstream, those
count ``Lookup`` calls only). Admissions and evictions count successful calls only.

:func:`start_metrics_logging` logs a one-line summary of a registry periodically (what
``IndexConfig.metrics_logging_interval`` turns on).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from operator import attrgetter
from typing import Any, Protocol, runtime_checkable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvredis.batch import AddOp, EvictOp
from kvredis.observed import (
    AsyncObservedIndex,
    Call,
    Observation,
    ObservedIndex,
    Operation,
    backend_label,
)

__all__ = [
    "AsyncInstrumentedIndex",
    "IndexMetrics",
    "InstrumentedIndex",
    "MetricsLogger",
    "RoundTripCounter",
    "index_metrics",
    "metrics_summary",
    "start_metrics_logging",
]

logger = logging.getLogger(__name__)

#: Buckets of ``kvredis_index_operation_seconds``: 100 µs (a Redis round trip on loopback) to
#: 10 s (a long pod clear).
OPERATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


@runtime_checkable
class RoundTripCounter(Protocol):
    """An index that counts its round trips to the server (cumulative, since it was built)."""

    @property
    def round_trips(self) -> int: ...


class _RoundTrips(Collector):
    """Reads the round-trip counts of the instrumented indexes of one registry at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[tuple[str, weakref.ref[Any]]] = []

    def add(self, backend: str, index: RoundTripCounter) -> None:
        with self._lock:
            self._sources.append((backend, weakref.ref(index)))

    def collect(self) -> Iterator[Metric]:
        totals: dict[str, int] = {}
        with self._lock:
            alive = []
            for backend, ref in self._sources:
                index = ref()
                if index is None:
                    continue
                alive.append((backend, ref))
                totals[backend] = totals.get(backend, 0) + int(index.round_trips)
            self._sources = alive
        family = CounterMetricFamily(
            "kvredis_index_redis_round_trips",
            "Round trips to the Redis/Valkey server made by the index",
            labels=["backend"],
        )
        for backend, total in sorted(totals.items()):
            family.add_metric([backend], total)
        yield family

    def describe(self) -> Iterable[Metric]:
        return []


class IndexMetrics:
    """The metric families of the index wrappers in one registry (see :func:`index_metrics`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        kw: dict[str, Any] = {"registry": registry}
        self.admissions = Counter(
            "kvcache_index_admissions", "Total number of KV-block admissions", ["backend"], **kw
        )
        self.evictions = Counter(
            "kvcache_index_evictions", "Total number of KV-block evictions", ["backend"], **kw
        )
        self.lookup_requests = Counter(
            "kvcache_index_lookup_requests", "Total number of lookup calls", **kw
        )
        self.lookup_hits = Counter(
            "kvcache_index_lookup_hits", "Number of keys found in the cache on Lookup()", **kw
        )
        self.max_pod_hit_count = Counter(
            "kvcache_index_max_pod_hit_count",
            "Maximum cache hits on a single pod on Lookup()",
            **kw,
        )
        self.lookup_latency = Histogram(
            "kvcache_index_lookup_latency_seconds", "Latency of Lookup calls in seconds", **kw
        )
        self.operation_seconds = Histogram(
            "kvredis_index_operation_seconds",
            "Latency of index calls in seconds, by operation",
            ["backend", "op"],
            buckets=OPERATION_BUCKETS,
            **kw,
        )
        self.errors = Counter(
            "kvredis_index_errors",
            "Index calls that raised, by operation and exception class",
            ["backend", "op", "kind"],
            **kw,
        )
        self.clears = Counter("kvredis_index_clears", "Pod clears", ["backend"], **kw)
        self.clear_entries_removed = Counter(
            "kvredis_index_clear_entries_removed",
            "(request key, entry) pairs removed by pod clears",
            ["backend"],
            **kw,
        )
        self.round_trips = _RoundTrips()
        registry.register(self.round_trips)


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, IndexMetrics] = (
    weakref.WeakKeyDictionary()
)
_BY_REGISTRY_LOCK = threading.Lock()


def index_metrics(registry: CollectorRegistry | None = None) -> IndexMetrics:
    """The index metric families of ``registry`` (default: the global one), created once."""
    reg = REGISTRY if registry is None else registry
    with _BY_REGISTRY_LOCK:
        metrics = _BY_REGISTRY.get(reg)
        if metrics is None:
            metrics = _BY_REGISTRY[reg] = IndexMetrics(reg)
        return metrics


_POD = attrgetter("pod_identifier")


def _max_pod_hits(result: object) -> int:
    """Upstream's hit count of a lookup: the most entries any one pod has in the result."""
    if not isinstance(result, dict) or not result:
        return 0
    per_pod = Tally(map(_POD, chain.from_iterable(result.values())))
    return max(per_pod.values(), default=0)


class _MetricsObserver:
    """Records the metrics of one wrapper (label values resolved once)."""

    def __init__(self, metrics: IndexMetrics, backend: str) -> None:
        self.metrics = metrics
        self.backend = backend
        self.admissions = metrics.admissions.labels(backend)
        self.evictions = metrics.evictions.labels(backend)
        self.clears = metrics.clears.labels(backend)
        self.removed = metrics.clear_entries_removed.labels(backend)
        self._latency: dict[Operation, Any] = {}

    def begin(self, call: Call) -> Observation:
        if call.op is Operation.LOOKUP:
            self.metrics.lookup_requests.inc()
        return _Timed(self, call, time.perf_counter())

    def latency(self, op: Operation) -> Any:
        child = self._latency.get(op)
        if child is None:  # created on first use: no empty series for calls never made
            child = self.metrics.operation_seconds.labels(self.backend, op.value)
            self._latency[op] = child
        return child

    def done(self, call: Call, seconds: float, result: object) -> None:
        self.latency(call.op).observe(seconds)
        op = call.op
        if op is Operation.LOOKUP:
            self.metrics.lookup_latency.observe(seconds)
            hits = _max_pod_hits(result)
            self.metrics.lookup_hits.inc(hits)
            self.metrics.max_pod_hit_count.inc(hits)
        elif op is Operation.ADD:
            self.admissions.inc(len(call.request_keys))
        elif op is Operation.EVICT:
            self.evictions.inc(len(call.entries))
        elif op is Operation.CLEAR:
            self.clears.inc()
            if isinstance(result, int):
                self.removed.inc(result)
        elif op is Operation.APPLY_BATCH and result:
            self._batch(call)

    def _batch(self, call: Call) -> None:
        added = evicted = 0
        for item in call.ops:
            if isinstance(item, AddOp):
                added += len(item.request_keys)
            elif isinstance(item, EvictOp):
                evicted += len(item.entries)
        if added:
            self.admissions.inc(added)
        if evicted:
            self.evictions.inc(evicted)

    def error(self, call: Call, seconds: float, error: BaseException) -> None:
        self.latency(call.op).observe(seconds)
        if call.op is Operation.LOOKUP:
            self.metrics.lookup_latency.observe(seconds)
        if isinstance(error, Exception):
            self.metrics.errors.labels(self.backend, call.op.value, type(error).__name__).inc()


class _Timed:
    __slots__ = ("call", "observer", "start")

    def __init__(self, observer: _MetricsObserver, call: Call, start: float) -> None:
        self.observer = observer
        self.call = call
        self.start = start

    def ok(self, result: object) -> None:
        self.observer.done(self.call, time.perf_counter() - self.start, result)

    def failed(self, error: BaseException) -> None:
        self.observer.error(self.call, time.perf_counter() - self.start, error)


def _observer(
    index: object, registry: CollectorRegistry | None, backend: str | None
) -> _MetricsObserver:
    metrics = index_metrics(registry)
    label = backend or backend_label(index)
    if isinstance(index, RoundTripCounter):
        metrics.round_trips.add(label, index)
    return _MetricsObserver(metrics, label)


class _Instrumented:
    """The constructor both instrumented wrappers share (the next base is the observed index)."""

    __slots__ = ()

    def __init__(
        self,
        next: Any,
        *,
        registry: CollectorRegistry | None = None,
        backend: str | None = None,
    ) -> None:
        observer = _observer(next, registry, backend)
        super().__init__(next, observer, backend=observer.backend)  # type: ignore[call-arg]


class InstrumentedIndex(_Instrumented, ObservedIndex):
    """Any :class:`~kvredis.index.Index`, exporting Prometheus metrics (see the module docstring).

    ``InstrumentedIndex(next, *, registry=None, backend=None)``. Keeps the capabilities of
    ``next``. ``backend`` overrides the ``backend`` label (default: derived from ``next``, see
    :func:`kvredis.observed.backend_label`).
    """

    __slots__ = ()


class AsyncInstrumentedIndex(_Instrumented, AsyncObservedIndex):
    """The asyncio form of :class:`InstrumentedIndex`, e.g. for an ``AsyncRedisIndex``."""

    __slots__ = ()


# -- periodic summary --------------------------------------------------------------------------


def _total(registry: CollectorRegistry, name: str) -> float:
    """The sum of every sample named ``name`` in ``registry`` (all label values)."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


def metrics_summary(registry: CollectorRegistry | None = None) -> str:
    """A one-line summary of the index metrics of ``registry`` (what the metrics logger logs)."""
    reg = REGISTRY if registry is None else registry
    count = _total(reg, "kvcache_index_lookup_latency_seconds_count")
    total = _total(reg, "kvcache_index_lookup_latency_seconds_sum")
    avg = total / count if count else 0.0
    values = {
        name: int(_total(reg, f"kvcache_index_{name}_total"))
        for name in ("admissions", "evictions", "lookup_requests", "lookup_hits")
    }
    return (
        f"admissions={values['admissions']} evictions={values['evictions']} "
        f"lookups={values['lookup_requests']} hits={values['lookup_hits']} "
        f"lookup_latency_avg={avg * 1000:.3f}ms"
    )


class MetricsLogger:
    """Logs :func:`metrics_summary` every ``interval`` seconds in a daemon thread until stopped."""

    def __init__(
        self,
        interval: float,
        registry: CollectorRegistry | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.interval = interval
        self.registry = registry
        self._log = log or (lambda line: logger.info("index metrics: %s", line))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvredis-metrics-log", daemon=True)

    def start(self) -> MetricsLogger:
        """Start logging; returns ``self``."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop logging (returns at once; the thread ends at its next wake-up)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._log(metrics_summary(self.registry))


def start_metrics_logging(
    interval: float, registry: CollectorRegistry | None = None, *, owner: object | None = None
) -> MetricsLogger:
    """Log a summary of the index metrics every ``interval`` seconds (as upstream does).

    With ``owner`` given, logging stops once ``owner`` is garbage-collected.
    """
    log = MetricsLogger(interval, registry).start()
    if owner is not None:
        weakref.finalize(owner, log.stop)
    return log

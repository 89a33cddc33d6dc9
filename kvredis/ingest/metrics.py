"""The ingester's counters as Prometheus metrics.

:class:`IngestMetrics` is a collector: registered in a registry (the one the index metrics use,
so one scrape shows both), it reads ``ingester.counters.snapshot()`` at every scrape. Names:

==========================================  =====================================================
``kvredis_ingest_<counter>_total``          every :class:`~kvredis.ingest.counters.Counter`
                                            (``batches``, ``events``, ``blocks_stored``,
                                            ``blocks_removed``, ``gaps``, ``replays``,
                                            ``restarts``, ``clears``, ...)
``kvredis_ingest_rejects_total{reason}``    rejections by
                                            :class:`~kvredis.ingest.events.RejectReason`
                                            (their sum is not exported again)
``kvredis_ingest_endpoints``                configured publishers
``kvredis_ingest_endpoints_connected``      publishers with a live connection (connects minus
                                            disconnects)
``kvredis_ingest_stream_lag_batches``       {stream} batches received and not yet applied, for an
                                            ingester that reports it (:class:`StreamLagSource`)
==========================================  =====================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvredis.ingest.counters import Counter
from kvredis.ingest.service import EventIngester

__all__ = ["IngestMetrics", "StreamLagSource", "connected_endpoints"]

_REJECTED_PREFIX = "rejected."


@runtime_checkable
class StreamLagSource(Protocol):
    """An ingester that knows, per watermark stream, how many received batches await applying."""

    def stream_lags(self) -> Mapping[str, int]: ...


def connected_endpoints(snapshot: Mapping[str, int]) -> int:
    """Publishers connected now, from a counters snapshot (connects minus disconnects)."""
    connects = snapshot.get(Counter.CONNECTS.value, 0)
    return max(0, connects - snapshot.get(Counter.DISCONNECTS.value, 0))


class IngestMetrics(Collector):
    """Exports an :class:`~kvredis.ingest.EventIngester`'s counters (see the module docstring).

    Registers itself in ``registry`` (default: the global one) unless ``register`` is false.
    """

    def __init__(
        self,
        ingester: EventIngester,
        registry: CollectorRegistry | None = None,
        *,
        register: bool = True,
    ) -> None:
        self.ingester = ingester
        if register:
            (REGISTRY if registry is None else registry).register(self)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snapshot = self.ingester.counters.snapshot()
        for counter in Counter:
            if counter is Counter.REJECTED:
                continue
            family = CounterMetricFamily(
                f"kvredis_ingest_{counter.value}",
                f"Ingester counter {counter.value!r} (kvredis.ingest.counters.Counter)",
                value=snapshot.get(counter.value, 0),
            )
            yield family
        rejects = CounterMetricFamily(
            "kvredis_ingest_rejects", "Rejected payloads, events and messages", labels=["reason"]
        )
        for name, value in sorted(snapshot.items()):
            if name.startswith(_REJECTED_PREFIX):
                rejects.add_metric([name[len(_REJECTED_PREFIX) :]], value)
        yield rejects
        endpoints = [e for e in self.ingester.endpoints if "://" in e.endpoint]
        yield GaugeMetricFamily(
            "kvredis_ingest_endpoints", "Configured publishers", value=len(endpoints)
        )
        yield GaugeMetricFamily(
            "kvredis_ingest_endpoints_connected",
            "Publishers with a live connection",
            value=connected_endpoints(snapshot),
        )
        source: Any = self.ingester
        if isinstance(source, StreamLagSource):
            lag = GaugeMetricFamily(
                "kvredis_ingest_stream_lag_batches",
                "Batches received and not yet applied, per watermark stream",
                labels=["stream"],
            )
            for stream, value in sorted(source.stream_lags().items()):
                lag.add_metric([stream], value)
            yield lag

"""InstrumentedIndex and the ingester's metrics, read back from a real CollectorRegistry."""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvredis.batch import AddOp, EvictOp, Watermark
from kvredis.config import IndexConfig, new_index
from kvredis.errors import InvalidInputError
from kvredis.index import (
    BatchIndex,
    NamespaceIndex,
    ProgressClearIndex,
    RankScoringIndex,
    ScoringIndex,
)
from kvredis.memory import InMemoryIndex
from kvredis.metrics import (
    AsyncInstrumentedIndex,
    InstrumentedIndex,
    MetricsLogger,
    metrics_summary,
)
from kvredis.probes import ProbeServer
from kvredis.types import KeyType, PodEntry

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu")


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_upstream_metrics_count_adds_evicts_and_lookups() -> None:
    reg = CollectorRegistry()
    index = InstrumentedIndex(InMemoryIndex(), registry=reg)
    index.add([11, 12, 13], [1, 2, 3], [A])
    index.add(None, [1, 2], [B])
    index.evict(11, KeyType.ENGINE, [A])
    lb = {"backend": "in_memory"}
    assert value(reg, "kvcache_index_admissions_total", **lb) == 5
    assert value(reg, "kvcache_index_evictions_total", **lb) == 1
    # after the evict: key 1 -> {b}, key 2 -> {a, b}, key 3 -> {a}; pod b has 2 hits, a has 2
    result = index.lookup([1, 2, 3])
    assert set(result) == {1, 2, 3}
    index.lookup([99])
    assert value(reg, "kvcache_index_lookup_requests_total") == 2
    assert value(reg, "kvcache_index_lookup_hits_total") == 2
    assert value(reg, "kvcache_index_max_pod_hit_count_total") == 2
    assert value(reg, "kvcache_index_lookup_latency_seconds_count") == 2
    op = {"backend": "in_memory", "op": "lookup"}
    assert value(reg, "kvredis_index_operation_seconds_count", **op) == 2
    assert value(reg, "kvredis_index_operation_seconds_count", backend="in_memory", op="add") == 2


def test_errors_are_counted_by_kind_and_reraised() -> None:
    reg = CollectorRegistry()
    index = InstrumentedIndex(InMemoryIndex(), registry=reg)
    with pytest.raises(InvalidInputError):
        index.add(None, [1], ["x"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        index.add(None, [-1], [A])
    labels = {"backend": "in_memory", "op": "add", "kind": "InvalidInputError"}
    assert value(reg, "kvredis_index_errors_total", **labels) == 2
    assert value(reg, "kvcache_index_admissions_total", backend="in_memory") == 0


def test_wrapper_keeps_exactly_the_capabilities() -> None:
    reg = CollectorRegistry()
    mem = InstrumentedIndex(InMemoryIndex(), registry=reg)
    raw = InMemoryIndex()
    for capability in (
        ScoringIndex,
        RankScoringIndex,
        BatchIndex,
        ProgressClearIndex,
        NamespaceIndex,
    ):
        assert isinstance(mem, capability) == isinstance(raw, capability), capability
    assert isinstance(mem, ScoringIndex)  # the embedded indexes score on their own
    assert isinstance(mem, RankScoringIndex)  # each data-parallel rank on its own, too
    for index in (mem, raw):
        index.add(None, [1, 2], [A, PodEntry("pod-a", "cpu", dp_rank=1)])
    assert mem.score_by_rank([1, 2]) == raw.score_by_rank([1, 2]) == {"pod-a": {0: 2.0, 1: 1.6}}
    assert value(reg, "kvredis_index_operation_seconds_count", backend="in_memory", op="score") == 1


@pytest.mark.redis
def test_redis_index_metrics(redis_server_url: str, namespace: str) -> None:
    from kvredis.redis import RedisIndexConfig, new_redis_index

    reg = CollectorRegistry()
    raw = new_redis_index(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    index = InstrumentedIndex(raw, registry=reg)
    try:
        assert isinstance(index, ScoringIndex) and isinstance(index, BatchIndex)
        assert isinstance(index, ProgressClearIndex) and isinstance(index, NamespaceIndex)
        before = value(reg, "kvredis_index_redis_round_trips_total", backend="redis")
        assert before == raw.round_trips > 0
        applied = index.apply_batch(
            [
                AddOp((21, 22), (1, 2), (A,)),
                AddOp(None, (1,), (B,)),
                EvictOp(21, KeyType.ENGINE, (A,)),
            ],
            "s1",
            Watermark(0, 1),
        )
        assert applied
        assert value(reg, "kvcache_index_admissions_total", backend="redis") == 3
        assert value(reg, "kvcache_index_evictions_total", backend="redis") == 1
        assert index.score([1, 2]).get("pod-b") == 1.0
        index.clear("pod-a")
        assert value(reg, "kvredis_index_clears_total", backend="redis") == 1
        assert value(reg, "kvredis_index_clear_entries_removed_total", backend="redis") == 1
        after = value(reg, "kvredis_index_redis_round_trips_total", backend="redis")
        assert after == raw.round_trips >= before + 3
        assert value(reg, "kvredis_index_operation_seconds_count", backend="redis", op="score") == 1
        # the per-rank scores of the same calls are a capability the wrapper keeps, seen as scores
        assert isinstance(index, RankScoringIndex)
        assert index.score_by_rank([1, 2]) == {"pod-b": {0: 1.0}}
        assert value(reg, "kvredis_index_operation_seconds_count", backend="redis", op="score") == 2
    finally:
        index.drop_namespace()
        index.close()


@pytest.mark.redis
def test_async_redis_index_metrics(redis_server_url: str, namespace: str) -> None:
    from kvredis.redis import AsyncRedisIndex, RedisIndexConfig

    reg = CollectorRegistry()

    async def run() -> None:
        raw = AsyncRedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
        index: Any = AsyncInstrumentedIndex(raw, registry=reg)
        async with index:
            await index.add([5], [1], [A])
            assert (await index.lookup([1])) == {1: [A]}
            assert await index.clear_with_progress("pod-a") == 1
            await index.drop_namespace()

    asyncio.run(run())
    assert value(reg, "kvcache_index_admissions_total", backend="redis") == 1
    assert value(reg, "kvcache_index_lookup_requests_total") == 1
    assert value(reg, "kvcache_index_lookup_hits_total") == 1
    assert value(reg, "kvredis_index_clear_entries_removed_total", backend="redis") == 1


def test_new_index_enable_metrics_wraps() -> None:
    reg = CollectorRegistry()
    index = new_index(IndexConfig(enable_metrics=True), registry=reg)
    assert isinstance(index, InstrumentedIndex)
    index.add(None, [7], [A])
    assert value(reg, "kvcache_index_admissions_total", backend="in_memory") == 1
    plain = new_index({"enableMetrics": False})
    assert isinstance(plain, InMemoryIndex)


def test_summary_and_periodic_logging(caplog: pytest.LogCaptureFixture) -> None:
    reg = CollectorRegistry()
    index = InstrumentedIndex(InMemoryIndex(), registry=reg)
    index.add(None, [1, 2], [A])
    index.lookup([1, 2])
    line = metrics_summary(reg)
    assert line.startswith("admissions=2 evictions=0 lookups=1 hits=2 ")
    lines: list[str] = []
    logger = MetricsLogger(0.01, reg, log=lines.append).start()
    try:
        for _ in range(500):
            if lines:
                break
            logger._stop.wait(0.01)
    finally:
        logger.stop()
    assert lines and lines[0].startswith("admissions=2")
    with pytest.raises(ValueError):
        MetricsLogger(0, reg)
    with caplog.at_level(logging.WARNING, "kvredis.config"):
        new_index(IndexConfig(metrics_logging_interval=5))
    assert "enable_metrics" in caplog.text


def get(url: str) -> tuple[int, str]:
    """``(status, body)`` of a GET; ``(0, "")`` while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


def test_probe_server_serves_metrics_and_probes() -> None:
    reg = CollectorRegistry()
    InstrumentedIndex(InMemoryIndex(), registry=reg).add(None, [1], [A])
    state = {"ready": False}
    server = ProbeServer(0, "127.0.0.1", reg, lambda: (state["ready"], ["redis: down"])).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, body = get(base + "/metrics")
        assert status == 200
        assert 'kvcache_index_admissions_total{backend="in_memory"} 1.0' in body
        assert get(base + "/healthz") == (200, "ok\n")
        assert get(base + "/readyz") == (503, "redis: down\n")
        state["ready"] = True
        assert get(base + "/readyz")[0] == 200
        assert get(base + "/nope")[0] == 404
    finally:
        server.close()


def test_ingester_counters_become_metrics() -> None:
    from kvredis.hashing import ChunkedTokenDatabase
    from kvredis.ingest import EventIngester
    from kvredis.ingest.counters import Counter
    from kvredis.ingest.events import BlockStored, RejectReason, encode_batch
    from kvredis.ingest.metrics import IngestMetrics

    reg = CollectorRegistry()
    index = InstrumentedIndex(InMemoryIndex(), registry=reg)
    ingester = EventIngester(index, ChunkedTokenDatabase())
    IngestMetrics(ingester, reg)
    payload = encode_batch([BlockStored((1, 2), None, tuple(range(32)), 16)], ts=0.0)
    ingester.process("kv@pod-a@m", 0, payload)
    ingester.process("kv@pod-a@m", 1, b"\xc1 not msgpack")
    ingester.process("", 2, payload, endpoint="other")
    snapshot = ingester.counters.snapshot()
    for counter in Counter:
        if counter is Counter.REJECTED:
            continue
        name = f"kvredis_ingest_{counter.value}_total"
        assert reg.get_sample_value(name) == snapshot[counter.value], name
    assert value(reg, "kvredis_ingest_blocks_stored_total") == 2
    assert value(reg, "kvredis_ingest_batches_applied_total") == 1
    for reason in RejectReason:
        got = reg.get_sample_value("kvredis_ingest_rejects_total", {"reason": reason.value})
        assert got == snapshot[f"rejected.{reason.value}"], reason
    assert value(reg, "kvredis_ingest_rejects_total", reason="malformed_payload") == 1
    assert value(reg, "kvredis_ingest_rejects_total", reason="no_pod") == 1
    assert value(reg, "kvcache_index_admissions_total", backend="in_memory") == 2
    for stream in ("direct", "other"):
        labels = {"stream": stream}
        assert reg.get_sample_value("kvredis_ingest_stream_lag_batches", labels) == 0


class _Gated(InMemoryIndex):
    """An index whose adds wait for a gate (to hold batches in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def add(self, engine_keys: Any, request_keys: Any, entries: Any) -> None:
        self.gate.wait(20)
        super().add(engine_keys, request_keys, entries)


def test_stream_lag_counts_batches_not_yet_applied() -> None:
    from kvredis.hashing import ChunkedTokenDatabase
    from kvredis.ingest import EventIngester, IngesterConfig
    from kvredis.ingest.events import BlockStored, encode_batch
    from kvredis.ingest.metrics import IngestMetrics

    reg = CollectorRegistry()
    index = _Gated()
    config = IngesterConfig(workers=1, use_watermarks=False)
    ingester = EventIngester(index, ChunkedTokenDatabase(), config=config)
    IngestMetrics(ingester, reg)
    lag = {"stream": "s"}
    with ingester:
        for seq in range(3):
            payload = encode_batch([BlockStored((seq + 1,), None, tuple(range(16)), 16)], ts=0.0)
            assert ingester.submit("kv@pod-a@m", seq, payload, endpoint="s")
        assert reg.get_sample_value("kvredis_ingest_stream_lag_batches", lag) == 3
        index.gate.set()
        assert ingester.wait_idle(20)
        assert reg.get_sample_value("kvredis_ingest_stream_lag_batches", lag) == 0


def test_observability_modules_load_neither_redis_nor_zmq() -> None:
    import subprocess
    import sys

    probe = (
        "import kvredis.metrics, kvredis.tracing, kvredis.probes, kvredis.observed, sys\n"
        "print(' '.join(m for m in ('redis', 'zmq') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


def test_every_metric_the_operations_guide_names_is_exported() -> None:
    """docs/operations.md (metric table and alerts) names only metrics kvredis exports."""
    import re
    from pathlib import Path

    from kvredis.hashing import ChunkedTokenDatabase
    from kvredis.ingest import EventIngester
    from kvredis.ingest.metrics import IngestMetrics

    reg = CollectorRegistry()
    index = InstrumentedIndex(InMemoryIndex(), registry=reg)
    IngestMetrics(EventIngester(index, ChunkedTokenDatabase()), reg)
    index.lookup([1])
    exported: set[str] = set()
    for family in reg.collect():
        exported |= {sample.name for sample in family.samples} | {family.name}
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    named = set(re.findall(r"\b(kv(?:redis|cache)_[a-z_]+?)(?:_bucket)?\b(?![<a-z_])", text))
    named = {n for n in named if not n.endswith("_")}  # kvredis_ingest_<counter>_total patterns
    assert named, "the guide names metrics"
    missing = sorted(
        n for n in named if not {n, f"{n}_total", n.removesuffix("_total")} & exported
    )
    assert missing == []

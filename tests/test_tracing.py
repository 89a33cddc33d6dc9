"""TracedIndex spans, recorded by the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvredis.errors import InvalidInputError
from kvredis.index import RankScoringIndex, ScoringIndex
from kvredis.memory import InMemoryIndex
from kvredis.tracing import AsyncTracedIndex, TracedIndex, tracing_available
from kvredis.types import KeyType, PodEntry

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")


@pytest.fixture
def traces() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_upstream_span_names_and_attributes(
    traces: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = traces
    assert tracing_available()
    index = TracedIndex(InMemoryIndex(), tracer_provider=provider)
    index.add([11, 12], [1, 2], [A, B])
    index.evict(1, KeyType.REQUEST, [B])
    index.lookup([1, 2, 3], {"pod-a"})
    index.lookup([9])
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [
        "llm_d.kv_cache.index.add",
        "llm_d.kv_cache.index.evict",
        "llm_d.kv_cache.index",
        "llm_d.kv_cache.index",
    ]
    add, evict, hit, miss = (dict(s.attributes or {}) for s in spans)
    assert add == {
        "kvredis.backend": "in_memory",
        "llm_d.kv_cache.index.add.engine_key_count": 2,
        "llm_d.kv_cache.index.add.request_key_count": 2,
        "llm_d.kv_cache.index.add.pod_entry_count": 2,
        "llm_d.kv_cache.index.add.device_tier_count": 2,
    }
    assert evict == {
        "kvredis.backend": "in_memory",
        "llm_d.kv_cache.index.evict.key_type": "request",
        "llm_d.kv_cache.index.evict.pod_entry_count": 1,
        "llm_d.kv_cache.index.evict.device_tier_count": 1,
    }
    assert hit == {
        "kvredis.backend": "in_memory",
        "llm_d.kv_cache.index.lookup.block_count": 3,
        "llm_d.kv_cache.lookup.pod_filter_count": 1,
        "llm_d.kv_cache.lookup.cache_hit": True,
        "llm_d.kv_cache.lookup.blocks_found": 2,
    }
    assert miss["llm_d.kv_cache.lookup.cache_hit"] is False
    assert miss["llm_d.kv_cache.lookup.blocks_found"] == 0
    assert all(s.kind is SpanKind.INTERNAL for s in spans)


def test_failed_call_records_error(traces: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traces
    index = TracedIndex(InMemoryIndex(), tracer_provider=provider)
    with pytest.raises(InvalidInputError):
        index.add(None, [-1], [A])
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.events[0].name == "exception"


def test_other_calls_get_kvredis_spans(
    traces: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = traces
    index = TracedIndex(InMemoryIndex(), tracer_provider=provider)
    index.add(None, [1], [A])
    index.clear("pod-a")
    assert [s.name for s in exporter.get_finished_spans()][-1] == "kvredis.index.clear"
    assert isinstance(index, ScoringIndex) == isinstance(InMemoryIndex(), ScoringIndex)
    # the embedded index scores per data-parallel rank: the traced one passes that through
    assert isinstance(index, RankScoringIndex)
    index.add(None, [1, 2], [A, PodEntry("pod-a", "gpu", dp_rank=1)])
    index.evict(2, KeyType.REQUEST, [A])
    assert index.score_by_rank([1, 2]) == {"pod-a": {0: 1.0, 1: 2.0}}
    assert [s.name for s in exporter.get_finished_spans()][-1] == "kvredis.index.score"


@pytest.mark.redis
def test_async_redis_spans(
    traces: tuple[TracerProvider, InMemorySpanExporter], redis_server_url: str, namespace: str
) -> None:
    from kvredis.redis import AsyncRedisIndex, RedisIndexConfig

    provider, exporter = traces

    async def run() -> None:
        raw = AsyncRedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
        index: Any = AsyncTracedIndex(raw, tracer_provider=provider)
        async with index:
            await index.add([5], [1], [A])
            assert await index.score([1]) == {"pod-a": 1.0}
            await index.drop_namespace()

    asyncio.run(run())
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [
        "llm_d.kv_cache.index.add",
        "kvredis.index.score",
        "kvredis.index.drop_namespace",
    ]
    assert {dict(s.attributes or {})["kvredis.backend"] for s in spans} == {"redis"}
    assert dict(spans[1].attributes or {})["kvredis.score.pods_scored"] == 1


def test_no_op_without_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvredis.tracing as tracing

    monkeypatch.setattr(tracing, "trace", None)
    index = tracing.TracedIndex(InMemoryIndex())
    index.add(None, [1], [A])
    assert index.lookup([1]) == {1: [A]}
    assert not tracing.tracing_available()

"""OpenTelemetry spans of an index: :class:`TracedIndex` and its asyncio twin.

``TracedIndex(index, tracer_provider=...)`` wraps any index (keeping its capabilities, see
:mod:`kvredis.observed`) and opens a span (kind ``INTERNAL``) around every call, current while the
call runs. Span names and attributes follow the upstream llm-d ``kvblock`` traced index, so traces
of a mixed Go/Python fleet read the same:

=============================== ================================================================
``llm_d.kv_cache.index``        lookup: ``llm_d.kv_cache.index.lookup.block_count``,
                                ``llm_d.kv_cache.lookup.pod_filter_count``, and when it returns
                                ``llm_d.kv_cache.lookup.cache_hit``,
                                ``llm_d.kv_cache.lookup.blocks_found``
``llm_d.kv_cache.index.add``    ``llm_d.kv_cache.index.add.engine_key_count``, ``...add.
                                request_key_count``, ``...add.pod_entry_count``, ``...add.
                                device_tier_count``
``llm_d.kv_cache.index.evict``  ``llm_d.kv_cache.index.evict.key_type`` (``engine``/``request``),
                                ``...evict.pod_entry_count``, ``...evict.device_tier_count``
=============================== ================================================================

The other calls get ``kvredis.index.<op>`` spans (``score``, ``apply_batch``, ``clear``, ...)
with ``kvredis.*`` attributes. Every span carries ``kvredis.backend``. A call that raises records
the exception and sets the span status to ``ERROR`` with its message.

The OpenTelemetry API is an optional extra (``otel``; README, "Install"): without it,
:class:`TracedIndex` only delegates. ``tracer_provider`` defaults to the global provider.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any

from kvredis.batch import AddOp, EvictOp
from kvredis.observed import (
    AsyncObservedIndex,
    Call,
    Observation,
    ObservedIndex,
    Operation,
    backend_label,
)
from kvredis.types import KeyType, PodEntry

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError:  # the optional extra is not installed: spans are not recorded
    trace = None  # type: ignore[assignment]
    otel_context = None  # type: ignore[assignment]

__all__ = ["TRACER_NAME", "AsyncTracedIndex", "TracedIndex", "tracing_available"]

#: Instrumentation scope of the spans.
TRACER_NAME = "kvredis"

_SPAN_NAMES = {
    Operation.LOOKUP: "llm_d.kv_cache.index",
    Operation.ADD: "llm_d.kv_cache.index.add",
    Operation.EVICT: "llm_d.kv_cache.index.evict",
}


def tracing_available() -> bool:
    """Whether the OpenTelemetry API is installed (else the traced indexes record nothing)."""
    return trace is not None


def _tier_count(entries: object) -> int:
    if not isinstance(entries, Iterable) or isinstance(entries, (str, bytes)):
        return 0
    return len({e.device_tier for e in entries if isinstance(e, PodEntry) and e.device_tier})


def _size(value: object) -> int:
    return len(value) if isinstance(value, Sized) and not isinstance(value, (str, bytes)) else 0


def _start_attributes(call: Call, backend: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {"kvredis.backend": backend}
    op = call.op
    if op is Operation.LOOKUP:
        attrs["llm_d.kv_cache.index.lookup.block_count"] = _size(call.request_keys)
        attrs["llm_d.kv_cache.lookup.pod_filter_count"] = _size(call.pods)
    elif op is Operation.ADD:
        attrs["llm_d.kv_cache.index.add.engine_key_count"] = _size(call.engine_keys)
        attrs["llm_d.kv_cache.index.add.request_key_count"] = _size(call.request_keys)
        attrs["llm_d.kv_cache.index.add.pod_entry_count"] = _size(call.entries)
        attrs["llm_d.kv_cache.index.add.device_tier_count"] = _tier_count(call.entries)
    elif op is Operation.EVICT:
        key_type = call.key_type.value if isinstance(call.key_type, KeyType) else "unknown"
        attrs["llm_d.kv_cache.index.evict.key_type"] = key_type
        attrs["llm_d.kv_cache.index.evict.pod_entry_count"] = _size(call.entries)
        attrs["llm_d.kv_cache.index.evict.device_tier_count"] = _tier_count(call.entries)
    elif op is Operation.SCORE:
        attrs["kvredis.score.block_count"] = _size(call.request_keys)
        attrs["kvredis.score.pod_filter_count"] = _size(call.pods)
    elif op is Operation.APPLY_BATCH:
        attrs["kvredis.batch.add_count"] = sum(isinstance(o, AddOp) for o in call.ops)
        attrs["kvredis.batch.evict_count"] = sum(isinstance(o, EvictOp) for o in call.ops)
        if call.stream is not None:
            attrs["kvredis.batch.stream"] = call.stream
    elif op is Operation.CLEAR and call.pod is not None:
        attrs["kvredis.clear.pod"] = call.pod
    elif call.stream is not None:
        attrs["kvredis.watermark.stream"] = call.stream
    return attrs


def _end_attributes(op: Operation, result: object) -> dict[str, Any]:
    if op is Operation.LOOKUP:
        found = sum(1 for entries in result.values() if entries) if isinstance(result, dict) else 0
        return {
            "llm_d.kv_cache.lookup.cache_hit": found > 0,
            "llm_d.kv_cache.lookup.blocks_found": found,
        }
    if op is Operation.SCORE:
        return {"kvredis.score.pods_scored": _size(result)}
    if op is Operation.APPLY_BATCH:
        return {"kvredis.batch.applied": bool(result)}
    if op is Operation.CLEAR and isinstance(result, int):
        return {"kvredis.clear.entries_removed": result}
    return {}


class _Span:
    __slots__ = ("op", "span", "token")

    def __init__(self, op: Operation, span: Any, token: Any) -> None:
        self.op = op
        self.span = span
        self.token = token

    def ok(self, result: object) -> None:
        try:
            if self.span.is_recording():
                self.span.set_attributes(_end_attributes(self.op, result))
        finally:
            self._end()

    def failed(self, error: BaseException) -> None:
        try:
            self.span.record_exception(error)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        finally:
            self._end()

    def _end(self) -> None:
        otel_context.detach(self.token)
        self.span.end()


class _Untraced:
    __slots__ = ()

    def ok(self, result: object) -> None:
        return None

    def failed(self, error: BaseException) -> None:
        return None


_UNTRACED = _Untraced()


class _TracingObserver:
    def __init__(self, tracer_provider: Any, backend: str) -> None:
        self.backend = backend
        self.tracer: Any = None
        if trace is not None:
            from kvredis._version import __version__

            self.tracer = trace.get_tracer(TRACER_NAME, __version__, tracer_provider)

    def begin(self, call: Call) -> Observation:
        if self.tracer is None:
            return _UNTRACED
        name = _SPAN_NAMES.get(call.op) or f"kvredis.index.{call.op.value}"
        span = self.tracer.start_span(
            name, kind=trace.SpanKind.INTERNAL, attributes=_start_attributes(call, self.backend)
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        return _Span(call.op, span, token)


class _Traced:
    """The constructor both traced wrappers share (the next base is the observed index)."""

    __slots__ = ()

    def __init__(
        self, next: Any, *, tracer_provider: Any = None, backend: str | None = None
    ) -> None:
        label = backend or backend_label(next)
        observer = _TracingObserver(tracer_provider, label)
        super().__init__(next, observer, backend=label)  # type: ignore[call-arg]


class TracedIndex(_Traced, ObservedIndex):
    """Any :class:`~kvredis.index.Index`, with a span around every call (see the module docstring).

    ``TracedIndex(next, *, tracer_provider=None, backend=None)``. Keeps the capabilities of
    ``next``. A no-op wrapper when the OpenTelemetry API is not installed.
    """

    __slots__ = ()


class AsyncTracedIndex(_Traced, AsyncObservedIndex):
    """The asyncio form of :class:`TracedIndex`, e.g. for an ``AsyncRedisIndex``."""

    __slots__ = ()

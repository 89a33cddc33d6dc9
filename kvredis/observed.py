"""Index wrappers that let an observer watch every call: the base of the metrics and traces.

:class:`ObservedIndex` wraps any :class:`~kvredis.index.Index` (:class:`AsyncObservedIndex` any
:class:`~kvredis.index.AsyncIndex`) and tells an :class:`Observer` about each call: what was asked
(a :class:`Call`) when it starts, and its result or error when it ends. The metrics
(:mod:`kvredis.metrics`) and the traces (:mod:`kvredis.tracing`) are two such observers.

A wrapper has exactly the capabilities of the index it wraps: wrapping a
:class:`~kvredis.redis.index.RedisIndex` gives an object that is still a
:class:`~kvredis.index.ScoringIndex`, :class:`~kvredis.index.RankScoringIndex`,
:class:`~kvredis.index.BatchIndex`,
:class:`~kvredis.index.ProgressClearIndex`, :class:`~kvredis.index.SelectiveClearIndex`,
:class:`~kvredis.index.NamespaceIndex`, :class:`~kvredis.index.SchemeIndex` and
:class:`~kvredis.index.Closeable` (so the Indexer still scores server-side and the ingester still
sends one ``apply_batch`` per engine batch); wrapping an :class:`~kvredis.memory.InMemoryIndex`
gives one that is not a ``ScoringIndex``. Each wrapper class is composed once per set of
capabilities.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from kvredis.batch import IndexOp, Watermark
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import (
    AsyncBatchIndex,
    AsyncIndex,
    AsyncNamespaceIndex,
    AsyncProgressClearIndex,
    AsyncRankScoringIndex,
    AsyncSchemeIndex,
    AsyncScoringIndex,
    AsyncSelectiveClearIndex,
    BatchIndex,
    Closeable,
    Index,
    LabelledIndex,
    NamespaceIndex,
    ProgressClearIndex,
    RankScoringIndex,
    SchemeIndex,
    ScoringIndex,
    SelectiveClearIndex,
)
from kvredis.types import Entries, Keys, KeyType, PodEntry, Pods

__all__ = [
    "AsyncObservedIndex",
    "Call",
    "Observation",
    "ObservedIndex",
    "Observer",
    "Operation",
    "backend_label",
]

T = TypeVar("T")
W = TypeVar("W")

Weights = Mapping[str, float] | None


class Operation(enum.Enum):
    """The index methods a wrapper observes; the value is the ``op`` label of the metrics."""

    LOOKUP = "lookup"
    SCORE = "score"
    ADD = "add"
    EVICT = "evict"
    GET_REQUEST_KEY = "get_request_key"
    CLEAR = "clear"
    APPLY_BATCH = "apply_batch"
    GET_WATERMARK = "get_watermark"
    RESET_WATERMARK = "reset_watermark"
    DROP_NAMESPACE = "drop_namespace"


@dataclass(frozen=True, slots=True)
class Call:
    """One index call as an observer sees it: the operation and the arguments that describe it."""

    op: Operation
    request_keys: Keys = ()
    engine_keys: Keys | None = None
    entries: Entries = ()
    key_type: KeyType | None = None
    pods: Pods = None
    ops: Sequence[IndexOp] = ()
    stream: str | None = None
    pod: str | None = None


class Observation(Protocol):
    """A call in progress: told once how it ended."""

    def ok(self, result: object) -> None:
        """The call returned ``result`` (``clear`` returns the entries removed, or ``None``)."""
        ...

    def failed(self, error: BaseException) -> None:
        """The call raised ``error`` (re-raised to the caller afterwards)."""
        ...


class Observer(Protocol):
    """Watches the calls of an index wrapper."""

    def begin(self, call: Call) -> Observation:
        """A call starts (the returned observation is told how it ends)."""
        ...


def backend_label(index: object) -> str:
    """The ``backend`` label of an index, as the upstream metrics name it.

    ``in_memory``, ``cost_aware_memory``, ``redis``, ``valkey``: what the index says it is
    (:class:`~kvredis.index.LabelledIndex`), the label of the index inside a wrapper, else
    ``unknown``.
    """
    if isinstance(index, (ObservedIndex, AsyncObservedIndex)):
        return index.backend
    if isinstance(index, LabelledIndex):
        return str(index.backend_label)
    return "unknown"


# -- composition -------------------------------------------------------------------------------


@functools.cache
def _composed(base: type, mixins: tuple[type, ...]) -> type:
    if not mixins:
        return base
    namespace = {"__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__}
    return type(base.__name__, (base, *mixins), namespace)


def _instance(cls: type[W], index: object, table: Sequence[tuple[type, type]]) -> W:
    mixins = tuple(mixin for protocol, mixin in table if isinstance(index, protocol))
    return cast(W, object.__new__(_composed(cast(type, cls), mixins)))


class _Wrapper:
    """What the sync and async wrappers share: the wrapped index, its observer and label."""

    __slots__ = ("_backend", "_observer", "_progress_clear", "_wrapped")
    _wrapped: Any
    _observer: Observer
    _backend: str
    _progress_clear: bool

    def _wrap(
        self, next: Any, observer: Observer, backend: str | None, progress_clear: type
    ) -> None:
        self._wrapped = next
        self._observer = observer
        self._backend = backend or backend_label(next)
        self._progress_clear = isinstance(next, progress_clear)

    @property
    def wrapped(self) -> Any:
        """The index this wrapper calls."""
        return self._wrapped

    @property
    def backend(self) -> str:
        """The ``backend`` label of the wrapped index (see :func:`backend_label`)."""
        return self._backend


# -- sync --------------------------------------------------------------------------------------


class _Sync(_Wrapper):
    __slots__ = ()

    def _run(self, call: Call, fn: Callable[[], T]) -> T:
        observation = self._observer.begin(call)
        try:
            result = fn()
        except BaseException as exc:
            observation.failed(exc)
            raise
        observation.ok(result)
        return result


class _Scoring(_Sync):
    __slots__ = ()

    def score(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, float]:
        """See :meth:`kvredis.index.ScoringIndex.score`."""
        inner = cast(ScoringIndex, self._wrapped)
        call = Call(Operation.SCORE, request_keys=request_keys, pods=pod_identifier_set)
        return self._run(
            call, lambda: inner.score(request_keys, medium_weights, pod_identifier_set)
        )


class _RankScoring(_Sync):
    __slots__ = ()

    def score_by_rank(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, dict[int, float]]:
        """See :meth:`kvredis.index.RankScoringIndex.score_by_rank` (observed as a score)."""
        inner = cast(RankScoringIndex, self._wrapped)
        call = Call(Operation.SCORE, request_keys=request_keys, pods=pod_identifier_set)
        return self._run(
            call, lambda: inner.score_by_rank(request_keys, medium_weights, pod_identifier_set)
        )


class _Batch(_Sync):
    __slots__ = ()

    def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """See :meth:`kvredis.index.BatchIndex.apply_batch`."""
        inner = cast(BatchIndex, self._wrapped)
        call = Call(Operation.APPLY_BATCH, ops=ops, stream=stream)
        return self._run(call, lambda: inner.apply_batch(ops, stream, watermark))

    def get_watermark(self, stream: str) -> Watermark | None:
        """See :meth:`kvredis.index.BatchIndex.get_watermark`."""
        inner = cast(BatchIndex, self._wrapped)
        return self._run(
            Call(Operation.GET_WATERMARK, stream=stream), lambda: inner.get_watermark(stream)
        )

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """See :meth:`kvredis.index.BatchIndex.reset_watermark`."""
        inner = cast(BatchIndex, self._wrapped)
        self._run(
            Call(Operation.RESET_WATERMARK, stream=stream),
            lambda: inner.reset_watermark(stream, watermark),
        )


class _ProgressClear(_Sync):
    __slots__ = ()

    def clear_with_progress(
        self, pod_identifier: str, progress: Callable[[int, int], None] | None = None
    ) -> int:
        """See :meth:`kvredis.index.ProgressClearIndex.clear_with_progress`."""
        inner = cast(ProgressClearIndex, self._wrapped)
        return self._run(
            Call(Operation.CLEAR, pod=pod_identifier),
            lambda: inner.clear_with_progress(pod_identifier, progress),
        )


class _SelectiveClear(_Sync):
    __slots__ = ()

    def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """See :meth:`kvredis.index.SelectiveClearIndex.clear_entries`."""
        inner = cast(SelectiveClearIndex, self._wrapped)
        return self._run(
            Call(Operation.CLEAR, pod=pod_identifier),
            lambda: inner.clear_entries(
                pod_identifier, device_tiers=device_tiers, dp_rank=dp_rank, progress=progress
            ),
        )


class _Namespace(_Sync):
    __slots__ = ()

    def drop_namespace(self) -> int:
        """See :meth:`kvredis.index.NamespaceIndex.drop_namespace`."""
        inner = cast(NamespaceIndex, self._wrapped)
        return self._run(Call(Operation.DROP_NAMESPACE), inner.drop_namespace)


class _Scheme(_Sync):
    __slots__ = ()

    def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """See :meth:`kvredis.index.SchemeIndex.check_block_key_scheme` (not observed)."""
        inner = cast(SchemeIndex, self._wrapped)
        return inner.check_block_key_scheme(scheme, record=record)


class _Close(_Sync):
    __slots__ = ()

    def close(self) -> None:
        """Close the wrapped index."""
        cast(Closeable, self._wrapped).close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SYNC_CAPABILITIES: tuple[tuple[type, type], ...] = (
    (ScoringIndex, _Scoring),
    (RankScoringIndex, _RankScoring),
    (BatchIndex, _Batch),
    (ProgressClearIndex, _ProgressClear),
    (SelectiveClearIndex, _SelectiveClear),
    (NamespaceIndex, _Namespace),
    (SchemeIndex, _Scheme),
    (Closeable, _Close),
)


class ObservedIndex(_Sync):
    """An :class:`~kvredis.index.Index` whose calls an :class:`Observer` watches.

    Has the capabilities of the wrapped index, no more and no fewer (see the module docstring).
    ``clear`` of a wrapped :class:`~kvredis.index.ProgressClearIndex` runs
    ``clear_with_progress``, so the observer learns how many entries were removed.
    """

    __slots__ = ("__weakref__",)

    def __new__(cls, next: object, *args: Any, **kwargs: Any) -> ObservedIndex:
        return _instance(cls, next, _SYNC_CAPABILITIES)

    def __init__(self, next: Any, observer: Observer, *, backend: str | None = None) -> None:
        self._wrap(next, observer, backend, ProgressClearIndex)

    def lookup(
        self, request_keys: Keys, pod_identifier_set: Pods = None
    ) -> dict[int, list[PodEntry]]:
        """See :meth:`kvredis.index.Index.lookup`."""
        call = Call(Operation.LOOKUP, request_keys=request_keys, pods=pod_identifier_set)
        return self._run(call, lambda: self._wrapped.lookup(request_keys, pod_identifier_set))

    def add(
        self,
        engine_keys: Keys | None,
        request_keys: Keys,
        entries: Entries,
        *,
        ttl: float | None = None,
    ) -> None:
        """See :meth:`kvredis.index.Index.add`."""
        call = Call(
            Operation.ADD, request_keys=request_keys, engine_keys=engine_keys, entries=entries
        )
        self._run(call, lambda: self._wrapped.add(engine_keys, request_keys, entries, ttl=ttl))

    def evict(self, key: int, key_type: KeyType, entries: Entries) -> None:
        """See :meth:`kvredis.index.Index.evict`."""
        call = Call(Operation.EVICT, key_type=key_type, entries=entries)
        self._run(call, lambda: self._wrapped.evict(key, key_type, entries))

    def get_request_key(self, engine_key: int) -> int:
        """See :meth:`kvredis.index.Index.get_request_key`."""
        inner: Index = self._wrapped
        return self._run(Call(Operation.GET_REQUEST_KEY), lambda: inner.get_request_key(engine_key))

    def clear(self, pod_identifier: str) -> None:
        """See :meth:`kvredis.index.Index.clear`."""
        call = Call(Operation.CLEAR, pod=pod_identifier)
        if self._progress_clear:
            self._run(call, lambda: self._wrapped.clear_with_progress(pod_identifier))
        else:
            self._run(call, lambda: self._wrapped.clear(pod_identifier))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrapped!r})"


# -- async -------------------------------------------------------------------------------------


@runtime_checkable
class _AsyncClosing(Protocol):
    async def aclose(self) -> None: ...


class _Async(_Wrapper):
    __slots__ = ()

    async def _arun(self, call: Call, fn: Callable[[], Awaitable[T]]) -> T:
        observation = self._observer.begin(call)
        try:
            result = await fn()
        except BaseException as exc:
            observation.failed(exc)
            raise
        observation.ok(result)
        return result


class _AsyncScoring(_Async):
    __slots__ = ()

    async def score(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, float]:
        """See :meth:`kvredis.index.ScoringIndex.score`."""
        inner = cast(AsyncScoringIndex, self._wrapped)
        call = Call(Operation.SCORE, request_keys=request_keys, pods=pod_identifier_set)
        return await self._arun(
            call, lambda: inner.score(request_keys, medium_weights, pod_identifier_set)
        )


class _AsyncRankScoring(_Async):
    __slots__ = ()

    async def score_by_rank(
        self, request_keys: Keys, medium_weights: Weights = None, pod_identifier_set: Pods = None
    ) -> dict[str, dict[int, float]]:
        """See :meth:`kvredis.index.RankScoringIndex.score_by_rank` (observed as a score)."""
        inner = cast(AsyncRankScoringIndex, self._wrapped)
        call = Call(Operation.SCORE, request_keys=request_keys, pods=pod_identifier_set)
        return await self._arun(
            call, lambda: inner.score_by_rank(request_keys, medium_weights, pod_identifier_set)
        )


class _AsyncBatch(_Async):
    __slots__ = ()

    async def apply_batch(
        self, ops: Sequence[IndexOp], stream: str | None = None, watermark: Watermark | None = None
    ) -> bool:
        """See :meth:`kvredis.index.BatchIndex.apply_batch`."""
        inner = cast(AsyncBatchIndex, self._wrapped)
        call = Call(Operation.APPLY_BATCH, ops=ops, stream=stream)
        return await self._arun(call, lambda: inner.apply_batch(ops, stream, watermark))

    async def get_watermark(self, stream: str) -> Watermark | None:
        """See :meth:`kvredis.index.BatchIndex.get_watermark`."""
        inner = cast(AsyncBatchIndex, self._wrapped)
        return await self._arun(
            Call(Operation.GET_WATERMARK, stream=stream), lambda: inner.get_watermark(stream)
        )

    async def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """See :meth:`kvredis.index.BatchIndex.reset_watermark`."""
        inner = cast(AsyncBatchIndex, self._wrapped)
        await self._arun(
            Call(Operation.RESET_WATERMARK, stream=stream),
            lambda: inner.reset_watermark(stream, watermark),
        )


class _AsyncProgressClear(_Async):
    __slots__ = ()

    async def clear_with_progress(
        self, pod_identifier: str, progress: Callable[[int, int], None] | None = None
    ) -> int:
        """See :meth:`kvredis.index.ProgressClearIndex.clear_with_progress`."""
        inner = cast(AsyncProgressClearIndex, self._wrapped)
        return await self._arun(
            Call(Operation.CLEAR, pod=pod_identifier),
            lambda: inner.clear_with_progress(pod_identifier, progress),
        )


class _AsyncSelectiveClear(_Async):
    __slots__ = ()

    async def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """See :meth:`kvredis.index.SelectiveClearIndex.clear_entries`."""
        inner = cast(AsyncSelectiveClearIndex, self._wrapped)
        return await self._arun(
            Call(Operation.CLEAR, pod=pod_identifier),
            lambda: inner.clear_entries(
                pod_identifier, device_tiers=device_tiers, dp_rank=dp_rank, progress=progress
            ),
        )


class _AsyncNamespace(_Async):
    __slots__ = ()

    async def drop_namespace(self) -> int:
        """See :meth:`kvredis.index.NamespaceIndex.drop_namespace`."""
        inner = cast(AsyncNamespaceIndex, self._wrapped)
        return await self._arun(Call(Operation.DROP_NAMESPACE), inner.drop_namespace)


class _AsyncScheme(_Async):
    __slots__ = ()

    async def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """See :meth:`kvredis.index.SchemeIndex.check_block_key_scheme` (not observed)."""
        inner = cast(AsyncSchemeIndex, self._wrapped)
        return await inner.check_block_key_scheme(scheme, record=record)


class _AsyncClose(_Async):
    __slots__ = ()

    async def aclose(self) -> None:
        """Close the wrapped index."""
        await cast(_AsyncClosing, self._wrapped).aclose()

    async def close(self) -> None:
        """Alias of :meth:`aclose`."""
        await self.aclose()


class _AsyncContext(_Async):
    __slots__ = ()

    async def __aenter__(self) -> Any:
        await cast(AbstractAsyncContextManager[Any], self._wrapped).__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await cast(AbstractAsyncContextManager[Any], self._wrapped).__aexit__(*exc)


_ASYNC_CAPABILITIES: tuple[tuple[type, type], ...] = (
    (AsyncScoringIndex, _AsyncScoring),
    (AsyncRankScoringIndex, _AsyncRankScoring),
    (AsyncBatchIndex, _AsyncBatch),
    (AsyncProgressClearIndex, _AsyncProgressClear),
    (AsyncSelectiveClearIndex, _AsyncSelectiveClear),
    (AsyncNamespaceIndex, _AsyncNamespace),
    (AsyncSchemeIndex, _AsyncScheme),
    (_AsyncClosing, _AsyncClose),
    (AbstractAsyncContextManager, _AsyncContext),
)


class AsyncObservedIndex(_Async):
    """The asyncio form of :class:`ObservedIndex`, for an :class:`~kvredis.index.AsyncIndex`.

    Keeps the async capabilities of the wrapped index (``score``, ``apply_batch``,
    ``clear_with_progress``, ``drop_namespace``, ``aclose`` and ``async with``).
    """

    __slots__ = ("__weakref__",)

    def __new__(cls, next: object, *args: Any, **kwargs: Any) -> AsyncObservedIndex:
        return _instance(cls, next, _ASYNC_CAPABILITIES)

    def __init__(self, next: Any, observer: Observer, *, backend: str | None = None) -> None:
        self._wrap(next, observer, backend, AsyncProgressClearIndex)

    async def lookup(
        self, request_keys: Keys, pod_identifier_set: Pods = None
    ) -> dict[int, list[PodEntry]]:
        """See :meth:`kvredis.index.Index.lookup`."""
        call = Call(Operation.LOOKUP, request_keys=request_keys, pods=pod_identifier_set)
        inner = self._wrapped
        return await self._arun(call, lambda: inner.lookup(request_keys, pod_identifier_set))

    async def add(
        self,
        engine_keys: Keys | None,
        request_keys: Keys,
        entries: Entries,
        *,
        ttl: float | None = None,
    ) -> None:
        """See :meth:`kvredis.index.Index.add`."""
        call = Call(
            Operation.ADD, request_keys=request_keys, engine_keys=engine_keys, entries=entries
        )
        await self._arun(
            call, lambda: self._wrapped.add(engine_keys, request_keys, entries, ttl=ttl)
        )

    async def evict(self, key: int, key_type: KeyType, entries: Entries) -> None:
        """See :meth:`kvredis.index.Index.evict`."""
        call = Call(Operation.EVICT, key_type=key_type, entries=entries)
        await self._arun(call, lambda: self._wrapped.evict(key, key_type, entries))

    async def get_request_key(self, engine_key: int) -> int:
        """See :meth:`kvredis.index.Index.get_request_key`."""
        inner: AsyncIndex = self._wrapped
        call = Call(Operation.GET_REQUEST_KEY)
        return await self._arun(call, lambda: inner.get_request_key(engine_key))

    async def clear(self, pod_identifier: str) -> None:
        """See :meth:`kvredis.index.Index.clear`."""
        call = Call(Operation.CLEAR, pod=pod_identifier)
        if self._progress_clear:
            await self._arun(call, lambda: self._wrapped.clear_with_progress(pod_identifier))
        else:
            await self._arun(call, lambda: self._wrapped.clear(pod_identifier))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrapped!r})"

"""The Index contract shared by every backend, and the capabilities some backends add.

An index maps *request keys* (block hashes kvredis computes from token ids) to the pod entries
holding that block, and *engine keys* (the hashes engines report in KV events) to request keys.
Every backend (in-memory, cost-aware, Redis, Valkey) implements :class:`Index`; the asyncio Redis
backend implements :class:`AsyncIndex` with the same semantics.

Capabilities beyond the core contract are declared as protocols of their own, so callers test
``isinstance(index, ScoringIndex)`` instead of sniffing for methods:

=========================  ===============================================================
:class:`BatchIndex`        ``apply_batch`` fenced by per-stream watermarks (ingestion)
:class:`MultiBatchIndex`   ``apply_batches``: several fenced batches in one step (one call)
:class:`ScoringIndex`      ``score``: the LongestPrefixScorer computed by the backend itself
:class:`RankScoringIndex`  ``score_by_rank``: the same, per data-parallel rank of each pod
:class:`ProgressClearIndex` ``clear_with_progress``: a pod clear that reports progress
:class:`SelectiveClearIndex` ``clear_entries``: clear only some tiers or one rank of a pod
:class:`NamespaceIndex`    ``drop_namespace``: delete everything the index stored
:class:`SchemeIndex`       ``check_block_key_scheme``: the block key scheme the namespace records
:class:`Closeable`         ``close``: release connections (network backends)
=========================  ===============================================================

Each has an asyncio twin (``AsyncBatchIndex``, ...). The input checks every backend applies
live in :mod:`kvredis.checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

from kvredis.batch import AddOp, Batch, IndexOp, Watermark, check_batches
from kvredis.checks import MAX_REQUEST_KEYS_PER_ENGINE_KEY
from kvredis.hashing.config import BlockKeyScheme
from kvredis.types import KeyType, PodEntry

__all__ = [
    "MAX_REQUEST_KEYS_PER_ENGINE_KEY",
    "AsyncBatchIndex",
    "AsyncIndex",
    "AsyncMultiBatchIndex",
    "AsyncNamespaceIndex",
    "AsyncProgressClearIndex",
    "AsyncRankScoringIndex",
    "AsyncSchemeIndex",
    "AsyncScoringIndex",
    "AsyncSelectiveClearIndex",
    "BatchIndex",
    "ClearProgress",
    "Closeable",
    "Index",
    "MultiBatchIndex",
    "NamespaceIndex",
    "ProgressClearIndex",
    "RankScoringIndex",
    "SchemeIndex",
    "ScoringIndex",
    "SelectiveClearIndex",
    "apply_batches_in_turn",
    "apply_op",
]

#: ``progress(done, removed)`` of a long clear: units of work done so far, entries removed so far.
ClearProgress = Callable[[int, int], None]
#: An optional :data:`ClearProgress`, as the clear methods take it.
Progress = ClearProgress | None


@runtime_checkable
class Index(Protocol):
    """A thread-safe KV-block index."""

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        """Walk ``request_keys`` in order; stop at the first key no (filtered) pod holds."""
        ...

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
        *,
        ttl: float | None = None,
    ) -> None:
        """Store every entry under every request key; map engine keys to request keys.

        ``ttl`` (seconds, finite, > 0; speculative entries only, else ``InvalidInputError``)
        makes the added entries expire by themselves: after it they are never returned, and
        their memory is reclaimed without an outside process. A confirmed entry of a pod
        replaces that pod's speculative entries under the same key.
        """
        ...

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """Remove exactly these entries (an engine key resolves to its request keys)."""
        ...

    def get_request_key(self, engine_key: int) -> int:
        """The last request key mapped to ``engine_key``; ``EngineKeyNotFoundError`` if none."""
        ...

    def clear(self, pod_identifier: str) -> None:
        """Remove every entry of the pod, on every tier, group and data-parallel rank."""
        ...


@runtime_checkable
class AsyncIndex(Protocol):
    """The asyncio form of :class:`Index`: same methods, same semantics, as coroutines."""

    async def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]: ...

    async def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
        *,
        ttl: float | None = None,
    ) -> None: ...

    async def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None: ...

    async def get_request_key(self, engine_key: int) -> int: ...

    async def clear(self, pod_identifier: str) -> None: ...


@runtime_checkable
class BatchIndex(Protocol):
    """An index that applies op lists atomically, fenced by a per-stream watermark."""

    def apply_batch(
        self,
        ops: Sequence[IndexOp],
        stream: str | None = None,
        watermark: Watermark | None = None,
    ) -> bool:
        """Apply ``ops`` in order.

        With ``stream`` and ``watermark`` given, the ops are applied only if ``watermark`` is
        greater than the stored watermark of ``stream`` (or none is stored), and the stored
        watermark becomes ``watermark`` in the same atomic step. Returns ``True`` if applied,
        ``False`` if skipped because the stream already reached ``watermark``. Invalid ops raise
        ``InvalidInputError`` before anything is applied.
        """
        ...

    def get_watermark(self, stream: str) -> Watermark | None:
        """The stored watermark of ``stream``, or ``None`` if nothing was applied from it."""
        ...

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """Overwrite (or with ``None`` delete) the stored watermark of ``stream``."""
        ...


@runtime_checkable
class AsyncBatchIndex(Protocol):
    """The asyncio form of :class:`BatchIndex`."""

    async def apply_batch(
        self,
        ops: Sequence[IndexOp],
        stream: str | None = None,
        watermark: Watermark | None = None,
    ) -> bool: ...

    async def get_watermark(self, stream: str) -> Watermark | None: ...

    async def reset_watermark(self, stream: str, watermark: Watermark | None) -> None: ...


@runtime_checkable
class MultiBatchIndex(Protocol):
    """A :class:`BatchIndex` that applies several fenced batches in one step (for Redis, one
    script call): what an ingester sends for the engine batches queued for it."""

    def apply_batches(self, batches: Sequence[Batch]) -> list[bool]:
        """Apply each batch as ``apply_batch(*batch)`` would, in order; returns whether each
        applied.

        Once a fenced batch of a stream is not applied, the later batches of that stream in
        ``batches`` are not applied either (``False``): their sender must sequence them again.
        Each batch is atomic (a backend may apply all of them in one atomic step). Invalid ops
        in any batch raise ``InvalidInputError`` before anything is applied.
        """
        ...


@runtime_checkable
class AsyncMultiBatchIndex(Protocol):
    """The asyncio form of :class:`MultiBatchIndex`."""

    async def apply_batches(self, batches: Sequence[Batch]) -> list[bool]: ...


@runtime_checkable
class ScoringIndex(Protocol):
    """An index that computes the LongestPrefixScorer itself (server-side for Redis)."""

    def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        """Per-pod longest-prefix scores (each pod's best data-parallel rank's); bit-identical
        to ``LongestPrefixScorer.score``."""
        ...


@runtime_checkable
class AsyncScoringIndex(Protocol):
    """The asyncio form of :class:`ScoringIndex`."""

    async def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]: ...


@runtime_checkable
class RankScoringIndex(Protocol):
    """An index that scores each data-parallel rank of a pod on its own, as ``score`` does
    before it keeps each pod's best rank: for a router that can pin the rank a request runs on
    (vLLM's external data-parallel load balancing takes it per request)."""

    def score_by_rank(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, dict[int, float]]:
        """pod -> ``dp_rank`` -> longest-prefix score (a pod without data parallelism has only
        rank 0); bit-identical to ``LongestPrefixScorer.score_by_rank``, and the pod's best rank
        is what ``score`` returns for it."""
        ...


@runtime_checkable
class AsyncRankScoringIndex(Protocol):
    """The asyncio form of :class:`RankScoringIndex`."""

    async def score_by_rank(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, dict[int, float]]: ...


@runtime_checkable
class ProgressClearIndex(Protocol):
    """An index whose pod clear reports progress and counts what it removed."""

    def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int:
        """``clear(pod)``, calling ``progress(done, removed)`` after every page of work.

        Returns the number of (request key, entry) pairs removed.
        """
        ...


@runtime_checkable
class AsyncProgressClearIndex(Protocol):
    """The asyncio form of :class:`ProgressClearIndex` (``progress`` is a plain callable)."""

    async def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int: ...


@runtime_checkable
class SelectiveClearIndex(Protocol):
    """An index that clears part of a pod: some device tiers, one data-parallel rank."""

    def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: ClearProgress | None = None,
    ) -> int:
        """Remove the pod's entries whose ``device_tier`` is in ``device_tiers`` (``None``:
        every tier) and whose ``dp_rank`` is ``dp_rank`` (``None``: every rank), as ``clear``
        does for all of them (engine mappings left without holders are dropped too).

        Returns the number of (request key, entry) pairs removed; ``progress`` as in
        :meth:`ProgressClearIndex.clear_with_progress`.
        """
        ...


@runtime_checkable
class AsyncSelectiveClearIndex(Protocol):
    """The asyncio form of :class:`SelectiveClearIndex`."""

    async def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: ClearProgress | None = None,
    ) -> int: ...


@runtime_checkable
class NamespaceIndex(Protocol):
    """An index kept in a shared store under a namespace, which it can delete as a whole."""

    def drop_namespace(self) -> int:
        """Delete every key of the namespace; returns how many were deleted."""
        ...


@runtime_checkable
class AsyncNamespaceIndex(Protocol):
    """The asyncio form of :class:`NamespaceIndex`."""

    async def drop_namespace(self) -> int: ...


@runtime_checkable
class SchemeIndex(Protocol):
    """An index whose namespace records the block key scheme of the keys it holds (hash
    algorithm, block size, hash seed: :class:`~kvredis.hashing.config.BlockKeyScheme`), so that
    a client computing keys another way fails clearly instead of missing every key."""

    def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None:
        """Check ``scheme`` against the namespace's now, and at every later load of the
        namespace; with ``record`` (a writer), record it first when the namespace records none
        (the first writer's stays). Returns the scheme recorded (None: none yet); raises
        :class:`~kvredis.errors.BlockKeySchemeError`, naming both, when it is another."""
        ...


@runtime_checkable
class AsyncSchemeIndex(Protocol):
    """The asyncio form of :class:`SchemeIndex`."""

    async def check_block_key_scheme(
        self, scheme: BlockKeyScheme, *, record: bool = False
    ) -> BlockKeyScheme | None: ...


@runtime_checkable
class LabelledIndex(Protocol):
    """An index that names its backend for metrics and traces (``in_memory``,
    ``cost_aware_memory``, ``redis``, ``valkey``: the labels the upstream metrics use)."""

    @property
    def backend_label(self) -> str:
        """The ``backend`` label of this index."""
        ...


@runtime_checkable
class Closeable(Protocol):
    """Something holding resources (connections) that ``close()`` releases."""

    def close(self) -> None:
        """Release the resources; the object is not used afterwards."""
        ...


def apply_op(index: Index, op: IndexOp) -> None:
    """Apply one op to any :class:`Index` with the matching call (``add`` or ``evict``)."""
    if isinstance(op, AddOp):
        index.add(op.engine_keys, op.request_keys, op.entries)
    else:
        index.evict(op.key, op.key_type, op.entries)


def apply_batches_in_turn(index: BatchIndex, batches: Sequence[Batch]) -> list[bool]:
    """:meth:`MultiBatchIndex.apply_batches` on any :class:`BatchIndex`: one ``apply_batch``
    call per batch, in order, skipping the batches of a stream after one that did not apply."""
    out: list[bool] = []
    stopped: set[str] = set()
    for ops, stream, watermark in check_batches(batches):
        if stream is not None and stream in stopped:
            out.append(False)
            continue
        applied = index.apply_batch(ops, stream, watermark)
        if not applied and stream is not None and watermark is not None:
            stopped.add(stream)
        out.append(applied)
    return out

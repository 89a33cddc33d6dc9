"""Batched, fenced index mutations: the contract between event ingestion and index backends.

An ingester turns one engine event batch into a list of :class:`AddOp` / :class:`EvictOp` and hands
it to :meth:`BatchIndex.apply_batch` together with the batch's :class:`Watermark`. A backend applies
the ops in order and atomically with the watermark check: the ops take effect only if the
watermark is newer than the one stored for that stream, and the stored watermark advances in the
same step. Several ingester replicas feeding one shared index therefore apply each batch at most
once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvredis.errors import InvalidInputError
from kvredis.types import KeyType, PodEntry


@dataclass(frozen=True, slots=True)
class AddOp:
    """``Index.add(engine_keys, request_keys, entries)`` as a value."""

    engine_keys: tuple[int, ...] | None
    request_keys: tuple[int, ...]
    entries: tuple[PodEntry, ...]


@dataclass(frozen=True, slots=True)
class EvictOp:
    """``Index.evict(key, key_type, entries)`` as a value."""

    key: int
    key_type: KeyType
    entries: tuple[PodEntry, ...]


IndexOp = AddOp | EvictOp


@dataclass(frozen=True, slots=True, order=True)
class Watermark:
    """Position of the last batch applied from one event stream (one publisher of one pod).

    ``epoch`` counts publisher restarts as seen by the ingesters (the engine's sequence numbers
    restart at 0), ``seq`` is the engine's batch sequence number within the epoch. Ordering is
    lexicographic: a batch is new iff its watermark is greater than the stored one.
    """

    epoch: int
    seq: int

    def __post_init__(self) -> None:
        for name in ("epoch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInputError(f"watermark {name} must be an int, got {value!r}")
            if not -1 <= value < (1 << 63):
                raise InvalidInputError(f"watermark {name} must be in [-1, 2**63), got {value}")


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

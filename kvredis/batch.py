"""Batched, fenced index mutations: the contract between event ingestion and index backends.

An ingester turns one engine event batch into a list of :class:`AddOp` / :class:`EvictOp` and
hands it to :meth:`kvredis.index.BatchIndex.apply_batch` together with the batch's
:class:`Watermark`. A backend applies the ops in order and atomically with the watermark check:
the ops take effect only if the watermark is newer than the one stored for that stream, and the
stored watermark advances in the same step. Several ingester replicas feeding one shared index
therefore apply each batch at most once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvredis.checks import check_add, check_entries, check_hash, check_key_type, plain_hashes
from kvredis.errors import InvalidInputError
from kvredis.fastinit import slot_init
from kvredis.types import MAX_BLOCK_HASH, KeyType, PodEntry


@slot_init
@dataclass(frozen=True, slots=True)
class AddOp:
    """``Index.add(engine_keys, request_keys, entries)`` as a value.

    ``parent`` is the request key before ``request_keys[0]`` in its chain, when the caller knows
    it (an ingester continuing an engine's chain): it changes nothing a lookup sees, but lets a
    backend store keys appended one event at a time with the chain they continue (the Redis
    backend's chain runs), so a walk of the chain stays one read per run.
    """

    engine_keys: tuple[int, ...] | None
    request_keys: tuple[int, ...]
    entries: tuple[PodEntry, ...]
    parent: int | None = None


@slot_init
@dataclass(frozen=True, slots=True)
class EvictOp:
    """``Index.evict(key, key_type, entries)`` as a value."""

    key: int
    key_type: KeyType
    entries: tuple[PodEntry, ...]


IndexOp = AddOp | EvictOp


class CheckedOps(list[IndexOp]):
    """Ops built in the normal form :func:`check_batch` returns by code that builds nothing else
    (the ingester's planner: plain int keys in range, tuples, :class:`~kvredis.types.PodEntry`
    entries, each checked when made): :func:`check_batch` takes them as they are instead of
    looking at every key again (about a twelfth of an ingester's CPU). Internal: code handing
    in ops from anywhere else passes a plain list, which is checked."""

    __slots__ = ()


_MARK_LIMIT = 1 << 63


@slot_init
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
        epoch, seq = self.epoch, self.seq
        if (
            type(epoch) is int
            and type(seq) is int
            and -1 <= epoch < _MARK_LIMIT
            and -1 <= seq < _MARK_LIMIT
        ):
            return
        for name in ("epoch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInputError(f"watermark {name} must be an int, got {value!r}")
            if not -1 <= value < (1 << 63):
                raise InvalidInputError(f"watermark {name} must be in [-1, 2**63), got {value}")


def check_stream(stream: object) -> str:
    """Validate a watermark stream name: a non-empty str."""
    if not isinstance(stream, str) or not stream:
        raise InvalidInputError(f"stream must be a non-empty str, got {stream!r}")
    return stream


def check_watermark(watermark: object, *, optional: bool = False) -> Watermark | None:
    """Validate a watermark argument (``None`` allowed only with ``optional``)."""
    if watermark is None and optional:
        return None
    if not isinstance(watermark, Watermark):
        kind = "a Watermark or None" if optional else "a Watermark"
        raise InvalidInputError(f"watermark must be {kind}, got {watermark!r}")
    return watermark


def check_batch(
    ops: Sequence[IndexOp], stream: str | None, watermark: Watermark | None
) -> list[IndexOp]:
    """Validate a whole batch up front, so that a bad op rejects it before anything applies.

    Returns the ops with their fields normalized to plain ints and tuples.
    """
    if (stream is None) != (watermark is None):
        raise InvalidInputError("apply_batch needs both stream and watermark, or neither")
    if stream is not None:
        check_stream(stream)
        check_watermark(watermark)
    if type(ops) is CheckedOps:
        return ops
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Sequence):
        raise InvalidInputError(f"ops must be a sequence of AddOp/EvictOp, got {ops!r}")
    plan: list[IndexOp] = []
    # the last entries tuples found valid, of an evict and of an add
    good_entries: tuple[PodEntry, ...] | None = None
    good_adds: tuple[PodEntry, ...] | None = None
    for position, op in enumerate(ops):
        # an evict already in normal form (what an ingester builds) is kept as it is
        if type(op) is EvictOp:
            key, entries = op.key, op.entries
            if (
                type(key) is int
                and 0 <= key <= MAX_BLOCK_HASH
                and type(op.key_type) is KeyType
                and type(entries) is tuple
                and (entries is good_entries or _plain_entries(entries))
            ):
                good_entries = entries
                plan.append(op)
                continue
        elif type(op) is AddOp:
            entries, parent = op.entries, op.parent
            if (
                _plain_hashes(op.request_keys, True)
                and (op.engine_keys is None or _plain_hashes(op.engine_keys, False))
                and (parent is None or (type(parent) is int and 0 <= parent <= MAX_BLOCK_HASH))
                and type(entries) is tuple
                and (entries is good_adds or _plain_add_entries(entries))
            ):
                good_adds = entries
                plan.append(op)
                continue
        try:
            if isinstance(op, AddOp):
                eng, req, ents = check_add(op.engine_keys, op.request_keys, op.entries)
                parent = None if op.parent is None else check_hash(op.parent, "parent key")
                plan.append(
                    AddOp(None if eng is None else tuple(eng), tuple(req), tuple(ents), parent)
                )
            elif isinstance(op, EvictOp):
                key = check_hash(op.key, "evict key")
                plan.append(
                    EvictOp(key, check_key_type(op.key_type), tuple(check_entries(op.entries)))
                )
            else:
                raise InvalidInputError(f"expected AddOp or EvictOp, got {type(op).__name__}")
        except InvalidInputError as exc:
            raise InvalidInputError(f"batch op {position}: {exc}") from exc
    return plan


def _plain_entries(entries: tuple[object, ...]) -> bool:
    """Whether ``entries`` is a non-empty tuple of :class:`PodEntry` (each checked when made)."""
    return bool(entries) and all(type(e) is PodEntry for e in entries)


def _plain_add_entries(entries: tuple[object, ...]) -> bool:
    """Whether ``entries`` passes ``check_entries(entries, for_add=True)`` as it is."""
    return bool(entries) and all(
        type(e) is PodEntry and e.pod_identifier and (e.device_tier or e.speculative)
        for e in entries
    )


def _plain_hashes(keys: object, non_empty: bool) -> bool:
    """Whether ``keys`` is a tuple that :func:`~kvredis.checks.check_hashes` accepts (non-empty
    if asked), already in the form it returns."""
    return type(keys) is tuple and (bool(keys) or not non_empty) and plain_hashes(keys)


class Batch(NamedTuple):
    """One batch of :meth:`kvredis.index.MultiBatchIndex.apply_batches`: the arguments of one
    ``apply_batch(ops, stream, watermark)`` call (a plain ``(ops, stream, watermark)`` tuple is
    one too)."""

    ops: Sequence[IndexOp]
    stream: str | None = None
    watermark: Watermark | None = None


def check_batches(batches: object) -> list[tuple[list[IndexOp], str | None, Watermark | None]]:
    """Validate every batch of an ``apply_batches`` call up front (see :func:`check_batch`), so
    that a bad one rejects the call before anything applies."""
    if isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
        raise InvalidInputError(f"batches must be a sequence of Batch, got {batches!r}")
    out: list[tuple[list[IndexOp], str | None, Watermark | None]] = []
    for position, batch in enumerate(batches):
        if not isinstance(batch, tuple) or len(batch) != 3:
            raise InvalidInputError(
                f"batch {position}: expected Batch(ops, stream, watermark), got {batch!r}"
            )
        ops, stream, watermark = batch
        try:
            out.append((check_batch(ops, stream, watermark), stream, watermark))
        except InvalidInputError as exc:
            raise InvalidInputError(f"batch {position}: {exc}") from exc
    return out

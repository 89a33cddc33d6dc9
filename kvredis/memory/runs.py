"""Runs of the embedded indexes: consecutive request keys one add stored, held range by range.

A walk that asked the key table for every key of a 512-block chain would spend most of a score in
512 dictionary lookups and 512 recency updates. Engines store a chain's blocks together and
routers look them up together, so an add that brings :data:`RUN_MIN` or more new keys stores them
as a :class:`Run` (the in-process form of the Redis backend's chain runs,
``docs/design/chain-runs.md``): the keys in chain order, and what the positions hold as ranges
of positions with equal entries, the way a radix tree's edges hold a stretch of blocks. A walk
looks up the first key of a run, compares the run's following keys with the chain's following
keys as one list comparison (:func:`span`), and takes the entries range by range; the recency
of the positions is kept as ranges too (:class:`Ranges`), so touching a run's span is one range
assignment, not one update per key.

Exactness: the key table maps a key to its run only while the key's position holds entries;
a position left without entries is a *hole* (its key stays in the run's list, which no longer
speaks for it), so a walk that reaches a hole asks the key table again. Runs are built from new
keys only, so a key is live in at most one run, at one position.

Each run may also hold the engine keys an add paired 1:1 with its new request keys
(``engine``), with their own recency ranges: an engine key resolves to the request key at its
position. Positions whose engine key went away hold ``None``.

This module holds the data and the range algebra; the index (:mod:`kvredis.memory.index`) keeps
the tables, the entry records and the byte estimate consistent with them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from kvredis.types import PodEntry

__all__ = ["RUN_MAX", "RUN_MIN", "Ranges", "Run", "span", "span_at"]

#: Fewest new request keys one add stores as a run (fewer are kept one by one, unless they
#: continue a run: see :data:`RUN_MAX`).
RUN_MIN = 8
#: Most keys a run grows to by appends: an add that names its parent (``AddOp.parent``, as an
#: ingester does for an engine storing a chain block by block) appends its new keys to the run
#: its parent ends, up to this length.
RUN_MAX = 1024

V = TypeVar("V", bound=Hashable)


class Ranges(Generic[V]):
    """A value per position of ``[0, n)``, kept as ranges of equal values: range ``j`` covers
    ``[ends[j - 1], ends[j])`` (``[0, ends[0])`` for the first) and has ``values[j]``.
    Neighbouring ranges may hold equal values (the index merges where it pays)."""

    __slots__ = ("ends", "values")

    def __init__(self, n: int, value: V) -> None:
        self.ends = [n]
        self.values = [value]

    def __len__(self) -> int:
        return len(self.ends)

    def at(self, pos: int) -> V:
        """The value at ``pos``."""
        return self.values[bisect_right(self.ends, pos)]

    def index(self, pos: int) -> int:
        """The range holding ``pos``."""
        return bisect_right(self.ends, pos)

    def start(self, j: int) -> int:
        """Where range ``j`` starts."""
        return self.ends[j - 1] if j else 0

    def cut(self, pos: int) -> int:
        """Make ``pos`` (``0 <= pos <= n``) the start of a range; returns that range's index
        (``len(self)`` for ``pos == n``)."""
        ends = self.ends
        j = bisect_right(ends, pos)
        if j == len(ends) or (ends[j - 1] if j else 0) == pos:
            return j
        ends.insert(j, pos)
        self.values.insert(j, self.values[j])
        return j + 1

    def assign(self, a: int, b: int, value: V) -> None:
        """Give ``[a, b)`` (``a < b``) one ``value``."""
        ja = self.cut(a)
        jb = self.cut(b)
        self.ends[ja:jb] = [b]
        self.values[ja:jb] = [value]

    def merge(self, j: int) -> None:
        """Merge range ``j`` into range ``j - 1`` when both hold equal values."""
        if 0 < j < len(self.ends) and self.values[j] == self.values[j - 1]:
            del self.ends[j - 1]
            del self.values[j]

    def merge_span(self, ja: int, jb: int) -> None:
        """After ranges ``ja`` to ``jb - 1`` changed: merge the equal neighbours among them
        and the ranges on either side."""
        for j in range(min(jb, len(self.ends) - 1), max(ja, 1) - 1, -1):
            self.merge(j)


class Run:
    """Consecutive request keys stored together (see the module docstring).

    ``keys`` and ``engine`` are lists by position, fixed for the run's life; ``sets`` holds the
    entries of each position (oldest added first, ``()`` at holes); ``recency`` and
    ``engine_recency`` the last-use tick of each position (0: not in use). ``live`` counts the
    positions that hold entries, ``mapped`` those with an engine key; ``holders`` the positions
    each entry record holds. ``view`` is what scores read, kept by the index until ``sets``
    change: the ranges again, neighbours that score alike merged, with what a score needs of
    their entries (for one set of tier weights).
    """

    __slots__ = (
        "engine",
        "engine_recency",
        "holders",
        "keys",
        "live",
        "mapped",
        "recency",
        "sets",
        "view",
    )

    def __init__(self, keys: list[int], entries: tuple[PodEntry, ...], tick: int) -> None:
        n = len(keys)
        self.keys = keys
        self.sets: Ranges[tuple[PodEntry, ...]] = Ranges(n, entries)
        self.recency: Ranges[int] = Ranges(n, tick)
        self.live = n
        self.engine: list[int | None] | None = None
        self.engine_recency: Ranges[int] | None = None
        self.mapped = 0
        self.holders: dict[object, int] = {}
        self.view: tuple[object, list[int], list[object]] | None = None

    def __repr__(self) -> str:
        return f"<Run {len(self.keys)} keys, {self.live} live, {self.mapped} mapped>"

    @property
    def alive(self) -> bool:
        """Whether any position still holds entries or an engine key."""
        return bool(self.live or self.mapped)

    def position(self, key: int, hint: int = -1) -> int:
        """The position of ``key``, a key of this run (``hint``: where it likely is)."""
        keys = self.keys
        if 0 <= hint < len(keys) and keys[hint] == key:
            return hint
        return keys.index(key)

    def engine_position(self, engine_key: int, hint: int = -1) -> int:
        """The position of ``engine_key``, an engine key of this run (``hint``: where it
        likely is)."""
        engine = self.engine
        assert engine is not None
        if 0 <= hint < len(engine) and engine[hint] == engine_key:
            return hint
        return engine.index(engine_key)

    def map_engine(self, engine: list[int | None], tick: int) -> None:
        """Pair the positions with these engine keys (``None``: none), all used at ``tick``."""
        self.engine = engine
        self.engine_recency = Ranges(len(self.keys), tick)
        self.mapped = len(engine) - engine.count(None)


def span(keys: Sequence[int], i: int, run_keys: Sequence[int | None], pos: int) -> int:
    """How many keys from ``keys[i]`` on equal the run's keys from ``pos`` on, given that
    ``keys[i]`` is ``run_keys[pos]`` (both lists: a tuple never equals a list).

    Block hashes chain (each block's key hashes its parent's), so two chains that part do not
    meet again: when the last keys of the stretch agree, one comparison of the whole stretch
    settles it; when they differ, a binary search of single keys finds where the chains part,
    and one comparison of everything before confirms it. Keys that do not chain (the index
    takes any keys) fall back to comparing stretches that double from the matched part, then
    halve to the first difference (each key compared about twice at most).
    """
    m = min(len(keys) - i, len(run_keys) - pos)
    if m <= 1:
        return m
    if keys[i + m - 1] == run_keys[pos + m - 1]:
        if m == 2 or keys[i + 1 : i + m - 1] == run_keys[pos + 1 : pos + m - 1]:
            return m
        hi = m - 1
    else:
        lo, hi = 0, m - 1  # keys[i + lo] matches, keys[i + hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if keys[i + mid] == run_keys[pos + mid]:
                lo = mid
            else:
                hi = mid
        if hi == 1 or keys[i + 1 : i + hi] == run_keys[pos + 1 : pos + hi]:
            return hi
    # keys that do not chain: the first difference is before hi
    lo, step = 1, 1
    while True:  # lo keys match; find a stretch past lo that does not
        top = min(lo + step, hi)
        if keys[i + lo : i + top] != run_keys[pos + lo : pos + top]:
            break
        lo, step = top, step * 2
    while top - lo > 1:  # the first difference is in [lo, top)
        mid = (lo + top) // 2
        if keys[i + lo : i + mid] == run_keys[pos + lo : pos + mid]:
            lo = mid
        else:
            top = mid
    return lo


def span_at(
    keys: Sequence[int], i: int, run_keys: Sequence[int | None], pos: int, ends: Sequence[int]
) -> int:
    """:func:`span`, trying first where the run's holders change (``ends``, sorted): a chain
    that leaves a run usually leaves where the run's own chain went on to other pods, so a few
    single keys at those places find it, then one comparison confirms it."""
    m = min(len(keys) - i, len(run_keys) - pos)
    if m > 2 and keys[i + m - 1] != run_keys[pos + m - 1]:
        lo, hi = bisect_right(ends, pos + 1), bisect_right(ends, pos + m - 2)
        for j in range(hi - 1, lo - 1, -1):  # the last place where the keys still agree
            k = ends[j] - pos
            if keys[i + k - 1] == run_keys[pos + k - 1]:
                if keys[i + k] != run_keys[pos + k] and (
                    keys[i + 1 : i + k] == run_keys[pos + 1 : pos + k]
                ):
                    return k
                break
    return span(keys, i, run_keys, pos)

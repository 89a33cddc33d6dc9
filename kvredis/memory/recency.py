"""Least-recently-used order over the positions of runs, for one key space (request or engine).

Every use of a key takes a new tick from the index's counter. A key kept on its own has its tick
beside it (the index's ordered tables); a stretch of run positions used together gets one tick
in the run's recency ranges (:class:`~kvredis.memory.runs.Ranges`), so one use of a run's span
costs one range assignment. :class:`RunOrder` finds the least recently used run positions: a
heap of (tick, run) *events*, one per use of a run, where an event is stale once no range of the
run holds its tick any more. Ticks are unique per use, so the positions an event names are the
ranges holding its tick, used in position order (a walk goes forward): evicting them in that order
is evicting in exact least-recently-used order.

The heap costs nothing until the index first has to evict (an index that never fills never
builds it); from then on every use pushes one event, and the heap is rebuilt from the runs when
stale events outnumber live ones.

Not thread-safe on its own: the index calls it with its lock held.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection
from itertools import count

from kvredis.memory.runs import Ranges, Run

__all__ = ["RunOrder"]

#: Heap sizes below this are never rebuilt.
_SLACK = 1024


class RunOrder:
    """The heap of use events of one key space's run positions (see the module docstring).

    ``ranges(run)`` gives the recency ranges of that key space in a run (``None``: the run has
    none, as a run without engine keys on the engine side).
    """

    __slots__ = ("_check_at", "_heap", "_ranges", "_seq")

    def __init__(self, ranges: Callable[[Run], Ranges[int] | None]) -> None:
        self._ranges = ranges
        self._heap: list[tuple[int, int, Run]] | None = None
        self._seq = count()
        self._check_at = _SLACK  # the heap size at which to count its live events again

    @property
    def active(self) -> bool:
        """Whether the heap is kept (it is from the first eviction on)."""
        return self._heap is not None

    def used(self, run: Run, tick: int) -> None:
        """Record that positions of ``run`` were given ``tick``."""
        if self._heap is not None:
            heapq.heappush(self._heap, (tick, next(self._seq), run))

    def oldest(self, runs: Collection[Run]) -> tuple[int, Run] | None:
        """The tick and run of the least recently used positions, or ``None`` if no run
        position is in use; ``runs`` are the live runs (read to build or rebuild the heap)."""
        heap = self._heap
        if heap is None or (len(heap) > self._check_at and self._stale(runs)):
            heap = self._heap = self._build(runs)
            self._check_at = 2 * len(heap) + _SLACK
        ranges_of = self._ranges
        while heap:
            tick, _, run = heap[0]
            ranges = ranges_of(run)
            if ranges is not None and run.alive and tick in ranges.values:
                return tick, run
            heapq.heappop(heap)
        return None

    def done(self, run: Run, tick: int) -> None:
        """The event at the top of the heap (``tick`` of ``run``) has no position left."""
        heap = self._heap
        if heap and heap[0][0] == tick and heap[0][2] is run:
            heapq.heappop(heap)

    def _stale(self, runs: Collection[Run]) -> bool:
        """Whether the heap holds more than twice the live events (at most one per range in
        use); if not, the next count waits until the heap has doubled (amortized O(1))."""
        assert self._heap is not None
        live = 0
        for run in runs:
            ranges = self._ranges(run)
            if ranges is not None:
                live += len(ranges)
        if len(self._heap) > 2 * live + _SLACK:
            return True
        self._check_at = 2 * len(self._heap)
        return False

    def _build(self, runs: Collection[Run]) -> list[tuple[int, int, Run]]:
        heap: list[tuple[int, int, Run]] = []
        seq = self._seq
        for run in runs:
            ranges = self._ranges(run)
            if ranges is not None:
                heap.extend((tick, next(seq), run) for tick in set(ranges.values) if tick)
        heapq.heapify(heap)
        return heap

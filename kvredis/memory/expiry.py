"""The expiry table of the embedded indexes: when each expiring entry under each request key dies.

Speculative entries added with a ttl expire by themselves. The table maps (request key, entry
record) to a monotonic deadline, and keeps a heap of (deadline, sequence, key, record) to find
the due ones; a heap item is stale once the table holds another deadline for its pair (records
hash by identity, not by the fields of the entry). Reads ask :meth:`ExpiryTable.live`; the index
reclaims what :meth:`ExpiryTable.due` hands it, a bounded number per call.

Times come from the caller (the index reads its clock once per call), so the table has none of
its own. Not thread-safe on its own: the index calls it with its lock held.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["ExpiryTable"]

#: An entry record (anything hashable; the index uses its per-entry records).
R = TypeVar("R", bound=Hashable)


class ExpiryTable(Generic[R]):
    """(request key, record) -> deadline, and the heap that finds the due pairs."""

    __slots__ = ("_deadlines", "_heap", "_seq")

    def __init__(self) -> None:
        self._deadlines: dict[tuple[int, R], float] = {}
        self._heap: list[tuple[float, int, int, R]] = []
        self._seq = 0

    def __bool__(self) -> bool:
        """Whether some pair has a deadline."""
        return bool(self._deadlines)

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, pair: tuple[int, R]) -> bool:
        return pair in self._deadlines

    @property
    def pending(self) -> bool:
        """Whether the heap holds anything (live or stale): a call should reclaim first."""
        return bool(self._heap)

    def set(self, key: int, record: R, deadline: float) -> None:
        """``record`` under ``key`` dies at ``deadline`` (replacing an earlier deadline)."""
        self._deadlines[(key, record)] = deadline
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key, record))

    def discard(self, key: int, record: R) -> None:
        """``record`` under ``key`` no longer expires (or is gone)."""
        self._deadlines.pop((key, record), None)

    def live(self, key: int, record: R, now: float) -> bool:
        """Whether ``record`` under ``key`` is alive at ``now`` (a pair without a deadline is)."""
        deadline = self._deadlines.get((key, record))
        return deadline is None or deadline > now

    def due(self, now: float, limit: int) -> Iterator[tuple[int, R]]:
        """Up to ``limit`` pairs whose deadline is past, each forgotten as it is handed out (the
        caller removes the entry); stale heap items are skipped without counting."""
        heap, deadlines = self._heap, self._deadlines
        if not deadlines:
            heap.clear()
            return
        done = 0
        while heap and heap[0][0] <= now and done < limit:
            deadline, _, key, record = heapq.heappop(heap)
            if deadlines.get((key, record)) != deadline:
                continue
            del deadlines[(key, record)]
            done += 1
            yield key, record

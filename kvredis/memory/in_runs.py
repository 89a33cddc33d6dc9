"""Request keys an embedded index keeps in runs (:mod:`kvredis.memory.runs`): making a run of
an add's new keys, adding entries to a span of a run and removing them (positions left without
entries become holes), holing positions, forgetting a dead run, taking a key out of its run to
stand inline, what a score reads of a run (its view), and dropping the least recently used
positions.

A layer of the index class (see :mod:`kvredis.memory.tables`); its methods run with the index's
lock held.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from itertools import repeat

from kvredis.memory.bounds import (
    KEY_COST,
    RUN_COST,
    RUN_KEY_COST,
    RUN_POSITION_COST,
)
from kvredis.memory.inline import InlineKeys
from kvredis.memory.race import Best
from kvredis.memory.runs import Run
from kvredis.memory.tables import Held, holds
from kvredis.types import PodEntry

__all__ = ["RunKeys"]


class RunKeys(InlineKeys):
    """The index's request keys in runs."""

    def _new_run(self, keys: list[int], helds: list[Held], tick: int) -> Run:
        """A run of new keys holding these entries, all used at ``tick``."""
        n = len(keys)
        entries = tuple(h.entry for h in helds)
        run = Run(keys, entries, tick)
        self._runs[run] = None
        self._resident.update(zip(keys, repeat(run)))
        self._cost += RUN_COST + n * (RUN_POSITION_COST + RUN_KEY_COST)
        for held in helds:
            run.holders[held] = n
            held.runs.add(run)
            held.count += n
            self._cost += held.cost
        if tick:
            self._order.used(run, tick)
        return run

    def _run_add(self, run: Run, a: int, b: int, helds: list[Held]) -> int:
        """Add the entries to the live positions ``[a, b)`` of a run, up to its first hole;
        returns where it stopped. Equal tuples before give equal tuples after (one per range),
        re-added entries move to the most recent end, the per-key cap drops the oldest."""
        added = tuple(h.entry for h in helds)
        added_ids = set(map(id, added))
        cap = self._entries_per_key
        sets = run.sets
        ja = sets.cut(a)
        jb = sets.cut(b)
        made: dict[int, tuple[PodEntry, ...]] = {}
        ends, values = sets.ends, sets.values
        start = a
        j = ja
        while j < jb:
            old: tuple[PodEntry, ...] = values[j]
            end = ends[j]
            if not old:  # a hole: its key is not this run's any more
                b = start
                break
            new = made.get(id(old))
            if new is None:
                new = (*[e for e in old if id(e) not in added_ids], *added)
                if cap is not None and len(new) > cap:
                    new = new[-cap:]
                made[id(old)] = new
            if new != old:
                self._account(run, old, new, end - start)
                values[j] = new
                run.view = None
            start = end
            j += 1
        else:
            b = start
        sets.merge_span(ja, jb)
        return b

    def _account(
        self, run: Run, old: tuple[PodEntry, ...], new: tuple[PodEntry, ...], length: int
    ) -> None:
        """Entries come and go on ``length`` positions of a run (``old`` -> ``new``)."""
        by_id, holders = self._by_id, run.holders
        for entry in new:
            if not holds(old, entry):
                held = by_id[id(entry)]
                count = holders.get(held, 0)
                if not count:
                    held.runs.add(run)
                    self._cost += held.cost
                holders[held] = count + length
                held.count += length
        for entry in old:
            if not holds(new, entry):
                held = by_id[id(entry)]
                count = holders[held] - length
                held.count -= length
                if count:
                    holders[held] = count
                else:
                    del holders[held]
                    held.runs.discard(run)
                    self._cost -= held.cost
                if not held.count:
                    self._release(held)

    def _run_remove_at(self, run: Run, pos: int, held: Held) -> int:
        """:meth:`_run_remove` of one position (an evict): the position's range is split
        around it, and merged with a neighbour holding the same entries."""
        sets = run.sets
        ends, values = sets.ends, sets.values
        j = bisect_right(ends, pos)
        old: tuple[PodEntry, ...] = values[j]
        entry = held.entry
        if not holds(old, entry):
            return 0
        new = old[:-1] if old[-1] is entry else tuple([e for e in old if e is not entry])
        run.view = None
        start = ends[j - 1] if j else 0
        end = ends[j]
        if end - start == 1:
            values[j] = new
        else:
            split_ends, split_values = [pos + 1], [new]
            if end > pos + 1:
                split_ends.append(end)
                split_values.append(old)
            if pos > start:
                split_ends.insert(0, pos)
                split_values.insert(0, old)
            ends[j : j + 1] = split_ends
            values[j : j + 1] = split_values
            if pos > start:
                j += 1
        if j + 1 < len(ends) and values[j + 1] == new:
            del ends[j]
            del values[j + 1]
        if j and values[j - 1] == new:
            del ends[j - 1]
            del values[j]
        count = run.holders[held] - 1
        if count:
            run.holders[held] = count
        else:
            del run.holders[held]
            held.runs.discard(run)
            self._cost -= held.cost
        held.count -= 1
        if not held.count:
            self._release(held)
        if not new:
            self._emptied(run, pos, pos + 1)
            if not run.alive:
                self._bury(run)
        return 1

    def _run_remove(self, run: Run, a: int, b: int, held: Held) -> int:
        """Remove one entry from the positions ``[a, b)`` of a run (positions left without
        entries become holes); returns how many positions held it."""
        if held not in run.holders:
            return 0
        entry = held.entry
        sets = run.sets
        ja = sets.cut(a)
        jb = sets.cut(b)
        ends, values = sets.ends, sets.values
        made: dict[int, tuple[PodEntry, ...]] = {}
        removed = 0
        holes: list[tuple[int, int]] = []
        start = sets.start(ja)
        for j in range(ja, jb):
            end = ends[j]
            old: tuple[PodEntry, ...] = values[j]
            if holds(old, entry):
                new = made.get(id(old))
                if new is None:
                    new = made[id(old)] = tuple([e for e in old if e is not entry])
                values[j] = new
                run.view = None
                removed += end - start
                if not new:
                    holes.append((start, end))
            start = end
        count = run.holders[held] - removed
        if count:
            run.holders[held] = count
        else:
            del run.holders[held]
            held.runs.discard(run)
            self._cost -= held.cost
        held.count -= removed
        if not held.count:
            self._release(held)
        for hole_start, hole_end in holes:
            self._emptied(run, hole_start, hole_end)
        sets.merge_span(ja, jb)
        if holes and not run.alive:
            self._bury(run)
        return removed

    def _emptied(self, run: Run, a: int, b: int) -> None:
        """Positions ``[a, b)`` of a run were left without entries: their keys leave the
        table of keys in runs."""
        deque(map(self._resident.pop, run.keys[a:b]), 0)
        run.live -= b - a
        self._cost -= (b - a) * RUN_KEY_COST

    def _hole(self, run: Run, a: int, b: int) -> int:
        """Drop every entry of the live positions in ``[a, b)`` of a run; returns how many
        positions were live."""
        sets = run.sets
        ja = sets.cut(a)
        jb = sets.cut(b)
        ends, values = sets.ends, sets.values
        live = 0
        start = sets.start(ja)
        for j in range(ja, jb):
            end = ends[j]
            old: tuple[PodEntry, ...] = values[j]
            if old:
                self._account(run, old, (), end - start)
                values[j] = ()
                run.view = None
                self._emptied(run, start, end)
                live += end - start
            start = end
        sets.merge_span(ja, jb)
        if not run.alive:
            self._bury(run)
        return live

    def _bury(self, run: Run) -> None:
        """Forget a run none of whose positions holds entries or an engine key."""
        if self._runs.pop(run, 0) is None:
            self._cost -= RUN_COST + len(run.keys) * RUN_POSITION_COST
            if run.engine is not None:
                self._cost -= len(run.keys) * 8

    def _unrun(self, key: int, run: Run) -> None:
        """Move a key out of its run to stand inline with the same entries (its position
        becomes a hole; its engine key, if any, stays with the run)."""
        pos = run.position(key)
        entries: tuple[PodEntry, ...] = run.sets.at(pos)
        tick = run.recency.at(pos)
        self._hole(run, pos, pos + 1)
        if not entries:
            return
        self._keys[key] = entries
        self._key_ticks[key] = tick
        self._cost += KEY_COST
        for entry in entries:
            held = self._intern(entry)
            self._log_keys(held, (key,))

    def _view(
        self,
        run: Run,
        weights: dict[str, float],
        best_of: Callable[[tuple[PodEntry, ...]], Best],
    ) -> tuple[list[int], list[Best | None]]:
        """What a score reads of a run for these weights (see :attr:`Run.view`): the ends of
        its ranges with neighbours of equal best weights merged, and their best weights
        (``None`` at holes); built on the run's first score after its entries changed."""
        view = run.view
        if view is not None and view[0] is weights:
            return view[1], view[2]  # type: ignore[return-value]
        ends: list[int] = []
        infos: list[Best | None] = []
        for end, entries in zip(run.sets.ends, run.sets.values, strict=True):
            info = best_of(entries) if entries else None
            if infos and (
                info[0] == infos[-1][0]
                if info is not None and infos[-1] is not None
                else info is infos[-1]
            ):
                ends[-1] = end
            else:
                ends.append(end)
                infos.append(info)
        run.view = (weights, ends, infos)  # type: ignore[assignment]
        return ends, infos

    def _drop_used(self, run: Run, tick: int, limit: int) -> int:
        """Drop up to ``limit`` request keys of ``run`` last used at ``tick`` (position
        order: the order they were used in); returns how many were held."""
        recency = run.recency
        dropped = 0
        while dropped < limit:
            try:
                j = recency.values.index(tick)
            except ValueError:
                self._order.done(run, tick)
                break
            a = recency.start(j)
            b = min(recency.ends[j], a + limit - dropped)
            recency.assign(a, b, 0)
            dropped += self._hole(run, a, b)
            if not run.alive:
                break
        return dropped

"""Walks of an embedded index: a chain's keys read in order up to the first key no (filtered,
live) entry holds, run span by run span and inline group by group; the score's own loop; what a
walk counts as used; the tier weights and best weights a score reads.

A layer of the index class (see :mod:`kvredis.memory.tables`); its methods run with the index's
lock held.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from itertools import groupby, islice, repeat

from kvredis.checks import check_hashes
from kvredis.memory.engine_keys import EngineKeys
from kvredis.memory.race import Best, Piece, Race, Racer, best_weights
from kvredis.memory.runs import Run, span, span_at
from kvredis.scoring import score_weights
from kvredis.types import MAX_BLOCK_HASH, PodEntry

__all__ = ["Walks", "checked_reach"]

#: Tuples of entries whose best weights the index remembers (then it forgets them all).
_BEST_CACHED = 4096
#: Weight maps the index remembers validated (then it forgets them all).
_WEIGHTS_CACHED = 64


def checked_reach(keys: list[int], reached: int) -> bool:
    """Check the first ``reached`` keys of a walk (the keys it compared or looked up; the last
    one may be where it stopped): plain ints at C speed, anything else as every backend does.
    Returns whether they are all plain ints."""
    seen = keys if reached >= len(keys) else keys[:reached]
    if seen and (
        list(map(type, seen)).count(int) != len(seen) or not 0 <= seen[-1] <= MAX_BLOCK_HASH
    ):  # (counting is the fastest whole pass in C: the types compare by identity)
        check_hashes(seen, "request key")
        return False
    return True


class Walks(EngineKeys):
    """Reading chains."""

    def _pieces(self, keys: list[int], pods: frozenset[str] | None, now: float) -> Iterator[Piece]:
        """The walk of a chain: its stretches of equal (filtered, live) entries, in order, up
        to the first key without any. A run is read span by span (:func:`span` compares the
        chain with the run's keys; the run's ranges give the entries); inline keys are read
        in groups of equal tuples, key by key where entries expire or a filter applies."""
        inline_get, resident_get = self._keys.get, self._resident.get
        expiry, by_id = self._expiry, self._by_id
        n = len(keys)
        i = 0
        while i < n:
            key = keys[i]
            run = resident_get(key)
            if run is None:
                stored = inline_get(key)
                if stored is None:
                    return
                if expiry or pods is not None:
                    if pods is not None:
                        stored = tuple([e for e in stored if e.pod_identifier in pods])
                    if expiry:
                        stored = tuple([e for e in stored if expiry.live(key, by_id[id(e)], now)])
                    if not stored:
                        return
                    yield i, 1, stored, None, 0
                    i += 1
                    continue
                for stored, group in groupby(map(inline_get, islice(keys, i, None))):
                    if stored is None:
                        break
                    c = len([*group])
                    yield i, c, stored, None, 0
                    i += c
                continue
            run_keys = run.keys
            pos = run_keys.index(key)
            end = pos + span(keys, i, run_keys, pos)
            sets = run.sets
            ends, values = sets.ends, sets.values
            j = sets.index(pos)
            p = pos
            while p < end:
                stored = values[j]
                if not stored:
                    break  # a hole: its key may be held elsewhere
                e = ends[j]
                if e > end:
                    e = end
                if pods is not None:
                    stored = tuple([x for x in stored if x.pod_identifier in pods])
                    if not stored:
                        return
                yield i, e - p, stored, run, p
                i += e - p
                p = e
                j += 1

    def _score_walk(
        self,
        keys: list[int],
        weights: dict[str, float],
        best_of: Callable[[tuple[PodEntry, ...]], Best],
    ) -> tuple[dict[Racer, float], list[Piece]]:
        """:func:`~kvredis.memory.race.race` over :meth:`_pieces` without a filter or expiring
        entries, in one loop: the walk of a score, its hot path. Returns the scores and the
        stretches used (one per span of a run, one per group of inline keys)."""
        inline_get, resident_get = self._keys.get, self._resident.get
        used: list[Piece] = []
        race: Race | None = None
        n = len(keys)
        i = 0
        while i < n:
            key = keys[i]
            run = resident_get(key)
            if run is None:
                if inline_get(key) is None:
                    break
                stop = False
                for stored, group in groupby(map(inline_get, islice(keys, i, None))):
                    if stored is None:
                        break
                    c = len([*group])
                    if race is None:
                        race = Race(i, best_of(stored))
                    elif not race.step(i, best_of(stored)):
                        stop = True
                        break
                    used.append((i, c, stored, None, 0))
                    i += c
                if stop:
                    break
                continue
            run_keys = run.keys
            pos = run_keys.index(key)
            ends, infos = self._view(run, weights, best_of)
            end = pos + span_at(keys, i, run_keys, pos, ends)
            j = bisect_right(ends, pos)
            p = pos
            start = i
            stop = False
            while p < end:
                info = infos[j]
                if info is None:
                    break  # a hole: its key may be held elsewhere
                if race is None:
                    race = Race(i, info)
                elif (
                    info[2] != race.common or race.common is None or not race.alive <= info[1]
                ) and not race.step(i, info):  # (the usual stretch: nobody drops out)
                    stop = True
                    break
                e = ends[j]
                if e > end:
                    e = end
                i += e - p
                p = e
                j += 1
            if p > pos:
                used.append((start, p - pos, (), run, pos))
            if stop:
                break
        if race is None:
            return {}, used
        return race.finish(i), used

    def _use(self, keys: list[int], used: list[Piece]) -> None:
        """Count the keys of these pieces of a walk as used, in walk order."""
        inline, ticks, order = self._keys, self._key_ticks, self._order
        tick = self._tick
        last: Run | None = None
        a = b = 0
        for i, c, _, run, p in used:
            if run is not None and run is last and p == b:
                b += c
                continue
            if last is not None:
                tick += 1
                last.recency.assign(a, b, tick)
                order.used(last, tick)
            if run is None:
                last = None
                tick += 1
                touched = keys[i : i + c]
                deque(map(inline.move_to_end, touched), 0)  # (C-level loop)
                ticks.update(zip(touched, repeat(tick)))
            else:
                last, a, b = run, p, p + c
        if last is not None:
            tick += 1
            last.recency.assign(a, b, tick)
            order.used(last, tick)
        self._tick = tick

    def _weights(self, medium_weights: Mapping[str, float] | None) -> dict[str, float]:
        """The validated weights: the same dict for equal weight maps (of equal types), so
        the best weights of a tuple of entries are remembered across calls."""
        if medium_weights is None:
            return score_weights(None)
        try:
            key = tuple([(k, type(v), v) for k, v in medium_weights.items()])
            weights = self._weights_seen.get(key)
        except (AttributeError, TypeError):  # not a mapping, or unhashable
            return score_weights(medium_weights)
        if weights is None:
            weights = score_weights(medium_weights)
            if len(self._weights_seen) >= _WEIGHTS_CACHED:
                self._weights_seen.clear()
            self._weights_seen[key] = weights
        return weights

    def _best_of(self, weights: dict[str, float]) -> Callable[[tuple[PodEntry, ...]], Best]:
        """:func:`best_weights` for ``weights``, remembered per tuple of entries."""
        cache = self._bests
        cache_get = cache.get

        def best_of(entries: tuple[PodEntry, ...]) -> Best:
            hit = cache_get(id(entries))
            if hit is not None and hit[0] is entries and hit[1] is weights:
                return hit[2]
            best = best_weights(entries, weights)
            if len(cache) >= _BEST_CACHED:
                cache.clear()
            cache[id(entries)] = (entries, weights, best)
            return best

        return best_of

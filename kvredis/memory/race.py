"""The race a score runs over a walk of an embedded index (the scorer's rule, as
:class:`~kvredis.scoring.LongestPrefixScorer` states it).

Every (pod, data-parallel rank) holding the first key of a chain is a *racer*: it earns its best
weight at every key from the first on and drops out at its first key without an entry; a pod's
score is its best rank's. The walk hands the race stretches of keys with equal entries (a range
of a run, a group of keys kept one by one); :func:`best_weights` says what a stretch holds for
the race, and :class:`Race` adds a racer's keys up only when it drops out or changes weight, with
:func:`~kvredis.scoring.add_times`, so the floats are the scorer's, key by key.

Pure functions and values: no index state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import repeat

from kvredis.memory.runs import Run
from kvredis.scoring import UNKNOWN_TIER_WEIGHT, add_times
from kvredis.types import PodEntry

__all__ = [
    "RANKED",
    "Best",
    "Piece",
    "Race",
    "Racer",
    "add_up",
    "best_ranks",
    "best_weights",
    "race",
    "settle",
]

#: Who races in a score: a pod's rank 0 as the pod's name, any other rank as (pod, rank).
Racer = str | tuple[str, int]
#: Marks race results where some racer is a rank other than 0.
RANKED = ("", -1)
#: A stretch of a walk with equal entries: (index of its first key in the chain, number of
#: keys, the entries, the run and position it is read from, or None and 0 for inline keys).
Piece = tuple[int, int, tuple[PodEntry, ...], "Run | None", int]
#: What a score needs of a tuple of entries: each racer's best weight, the racers, and their
#: one weight when they all have the same (else None).
Best = tuple[dict[Racer, float], frozenset[Racer], float | None]
#: Below this, adding whole numbers to a float total is exact (chains are far shorter).
_EXACT = float(1 << 52)


def best_ranks(scores: Mapping[Racer, float]) -> dict[str, float]:
    """Each pod's best rank's score, from the scores of a race."""
    out: dict[str, float] = {}
    for racer, total in scores.items():
        if racer is RANKED:
            continue
        pod = racer if isinstance(racer, str) else racer[0]
        if pod not in out or total > out[pod]:
            out[pod] = total
    return out


class Race:
    """A score in progress (see :class:`~kvredis.scoring.LongestPrefixScorer`): each
    (pod, rank) earns its best weight at every key from the first on and drops out at its
    first key without an entry; :meth:`step` takes the next stretch of keys with equal entries
    (their best weights per racer, as :func:`best_weights` gives them).

    A racer's keys are added up only when it drops out or changes weight (with
    :func:`~kvredis.scoring.add_times`, the same floats as adding key by key). While every
    racer left has one weight and keeps it (the usual case: one tier), a stretch costs one
    subset test of two sets.
    """

    __slots__ = ("alive", "common", "scores", "since", "weight")

    def __init__(self, i: int, first: Best) -> None:
        best, racers, common = first
        self.scores = dict(best)  # the first key's weights
        self.weight = dict(best)
        self.alive = set(racers)
        self.since = dict.fromkeys(racers, i + 1)  # keys from here on are not added up yet
        self.common = common

    def step(self, i: int, info: Best) -> bool:
        """The keys from ``i`` on hold these entries; ``False`` if no racer is left."""
        best, racers, uniform = info
        common = self.common
        if common is not None and uniform == common:
            alive = self.alive
            if alive <= racers:
                return True
            gone = alive - racers  # some drop out, the others keep the weight
            if len(gone) == len(alive):
                return False
            settle(self.scores, self.since, gone, common, i)
            weight = self.weight
            for racer in gone:
                del weight[racer]
            alive -= gone
            return True
        scores, since, weight = self.scores, self.since, self.weight
        for racer in list(weight):  # weights differ: racer by racer
            w = weight[racer]
            now = best.get(racer)
            if now == w:
                continue
            n = i - since[racer]
            if n:
                scores[racer] = add_up(scores[racer], w, n)
            if now is None:
                del weight[racer]
            else:
                weight[racer] = now
                since[racer] = i
        if not weight:
            return False
        self.alive = set(weight)
        values = set(weight.values())
        self.common = next(iter(values)) if len(values) == 1 else None
        return True

    def finish(self, end: int) -> dict[Racer, float]:
        """The scores, the race having reached key ``end``; with :data:`RANKED` among the
        keys when some rank is not 0."""
        scores = self.scores
        if self.common is not None:
            settle(scores, self.since, self.weight, self.common, end)
        else:
            for racer, w in self.weight.items():
                n = end - self.since[racer]
                if n:
                    scores[racer] = add_up(scores[racer], w, n)
        if not all(map(isinstance, scores, repeat(str))):
            scores[RANKED] = 0.0
        return scores


def race(
    pieces: Iterator[Piece], best_of: Callable[[tuple[PodEntry, ...]], Best]
) -> tuple[dict[Racer, float], list[Piece]]:
    """Score a walk given as pieces (a filtered or expiring walk of
    :mod:`kvredis.memory.walks`); returns the scores and the pieces where some racer was still
    in the race."""
    used: list[Piece] = []
    first = next(pieces, None)
    if first is None:
        return {}, used
    running = Race(first[0], best_of(first[2]))
    used.append(first)
    end = first[0] + first[1]
    for piece in pieces:
        i, c, entries, _, _ = piece
        if not running.step(i, best_of(entries)):
            break
        used.append(piece)
        end = i + c
    return running.finish(end), used


def settle(
    scores: dict[Racer, float],
    since: dict[Racer, int],
    racers: Iterable[Racer],
    weight: float,
    end: int,
) -> None:
    """Add up the keys of ``racers`` (all at ``weight``) from where each was last added up to
    ``end``; racers that started together end together (one sum for all of them)."""
    last: tuple[float, int] | None = None
    result = 0.0
    for racer in racers:
        n = end - since[racer]
        if n:
            total = scores[racer]
            if last != (total, n):
                last = (total, n)
                result = add_up(total, weight, n)
            scores[racer] = result


def add_up(total: float, weight: float, times: int) -> float:
    """:func:`~kvredis.scoring.add_times`, whole weights of 1 added at once."""
    if weight == 1.0 and total.is_integer() and total < _EXACT:
        return total + times
    return add_times(total, weight, times)


def best_weights(entries: tuple[PodEntry, ...], weights: dict[str, float]) -> Best:
    """Each (pod, rank)'s best weight among these entries, the racers, their one weight."""
    best: dict[Racer, float] = {}
    for entry in entries:
        racer: Racer = entry.pod_identifier
        if entry.dp_rank:
            racer = (entry.pod_identifier, entry.dp_rank)
        w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
        if racer not in best or w > best[racer]:
            best[racer] = w
    values = set(best.values())
    return best, frozenset(best), next(iter(values)) if len(values) == 1 else None

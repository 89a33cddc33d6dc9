"""Embedded indexes: the whole KV-block index in this process's memory.

Two backends share one implementation and differ only in how they bound their memory:

* :class:`InMemoryIndex` keeps at most ``size`` request keys and at most ``size`` engine keys
  (least recently used dropped first) and at most ``pod_cache_size`` entries per request key
  (least recently added dropped first).
* :class:`CostAwareMemoryIndex` keeps an estimate of the bytes it holds (see
  :func:`estimated_entry_cost` and the ``*_COST`` constants) under a budget such as ``"2GiB"``,
  dropping the least recently used request keys and engine keys, whichever is older, until it
  fits.

"Used" means added to, looked up with a hit, or walked by a score while some pod is still in
the race (request keys), or resolved by ``get_request_key`` (engine keys). Both backends
implement :class:`~kvredis.index.Index`, :class:`~kvredis.index.BatchIndex`,
:class:`~kvredis.index.ScoringIndex` and :class:`~kvredis.index.RankScoringIndex` (``score``
and ``score_by_rank`` walk the chain once, racing each data-parallel rank of a pod on its own,
and stop when no (pod, rank) is left); one lock guards all state, so every method is atomic.

How the keys are kept:

* An add that brings :data:`~kvredis.memory_runs.RUN_MIN` or more new request keys (without a
  ttl) stores them as a *run* (:mod:`kvredis.memory_runs`): the keys in chain order, their
  entries as ranges of positions, their recency as ranges of ticks, and, when the add paired
  them 1:1 with new engine keys, those engine keys. An add that names its parent
  (``AddOp.parent`` in :meth:`apply_batch`, as the ingester writes an engine's chain block by
  block) appends its new keys to the run its parent ends. A walk reads a run with one table
  lookup and one list comparison, and takes its entries range by range; using a span of a run
  is one range assignment. So a score of a chain stored by a few events costs a few lookups,
  not one per block, and a key in a run costs a table slot and two list slots, not an
  ordered-dict node.
* Other request keys are kept one by one (*inline*): key -> the tuple of its entries, oldest
  added first, in least-recently-used order, with its last-use tick (keys holding one entry
  share its 1-tuple, and consecutive keys an add or a removal leaves with the same entries share
  one tuple). Entries that expire are kept inline only: an add with a ttl moves its keys out of
  their runs.
* Engine keys not in a run are in an :class:`~kvredis.memory_engine.EngineTable`; the deadlines
  of expiring entries in an :class:`~kvredis.memory_expiry.ExpiryTable`; the order of run
  positions by last use in :class:`~kvredis.memory_recency.RunOrder` heaps, built on the
  first eviction. Per distinct entry a record counts the keys holding it and knows its runs and
  (a log of) its inline keys, so ``clear(pod)`` never compares PodEntry values key by key.

``scripts/bench_vs_dynamo.py`` measures ``score`` and the memory per entry against Dynamo's
in-process radix tree, ``scripts/bench_memory.py`` against a plain dict of sets. Inputs that
are plain lists of ints and plain PodEntry values are checked at C speed or in one ``type()``
test, anything else goes through the shared checks of :mod:`kvredis.checks` (same errors as
every backend); walks check the keys they reach, so keys past the first miss are never read.
"""

from __future__ import annotations

import threading
import time
from array import array
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import fields
from functools import partial
from itertools import groupby, islice, repeat
from operator import attrgetter

from kvredis.batch import AddOp, IndexOp, Watermark, check_batch, check_stream, check_watermark
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    EntrySelection,
    check_add,
    check_entries,
    check_hash,
    check_hashes,
    check_key_type,
    check_pod_identifier,
    check_selection,
    check_ttl,
    infer_mappings,
    pod_filter,
)
from kvredis.errors import ConfigError, EngineKeyNotFoundError, InvalidInputError
from kvredis.index import ClearProgress
from kvredis.memory_bounds import (
    KEY_COST,
    RUN_COST,
    RUN_KEY_COST,
    RUN_MAPPING_COST,
    RUN_POSITION_COST,
    CostAwareMemoryIndexConfig,
    InMemoryIndexConfig,
    estimated_entry_cost,
)
from kvredis.memory_engine import EngineTable, refs
from kvredis.memory_expiry import ExpiryTable
from kvredis.memory_recency import RunOrder
from kvredis.memory_runs import RUN_MAX, RUN_MIN, Ranges, Run, span, span_at
from kvredis.scoring import UNKNOWN_TIER_WEIGHT, add_times, score_weights
from kvredis.types import MAX_BLOCK_HASH, KeyType, PodEntry

__all__ = [
    "CLEAR_MAPPINGS_PER_PAGE",
    "EXPIRED_PER_CALL",
    "LOG_SLACK",
    "MAX_REQUEST_KEYS_PER_ENGINE_KEY",
    "CostAwareMemoryIndex",
    "InMemoryIndex",
]

#: Most expired speculative entries reclaimed per call (the rest on later calls; reads filter
#: out whatever is left past its deadline).
EXPIRED_PER_CALL = 256

#: Engine mappings checked per lock hold when a clear drops the mappings it left without holders.
CLEAR_MAPPINGS_PER_PAGE = 4096

#: A log of request keys is compacted once it is longer than twice its live keys plus this.
LOG_SLACK = 64


class _Held:
    """One distinct entry the index holds: the one instance every key stores (equal entries
    added later resolve to it), the request keys holding it, its cost and its 1-tuple.

    ``count`` is the number of request keys holding it, inline or in runs. The runs holding it
    are ``runs`` (each run counts its positions per record); the inline keys are in ``log``, an
    ``array('Q')`` of 8 bytes per key (a set would take 5-6 times that): every inline key
    holding the entry is in the log, which may also name keys that no longer hold it (removals
    do not touch it) or name a key twice; whether a key holds the entry is read from the key's
    tuple. :meth:`_MemoryIndex._log_keys` compacts a log that has grown past twice its keys.
    """

    __slots__ = ("alone", "cost", "count", "entry", "fields", "log", "runs")

    def __init__(self, entry: PodEntry, fields: tuple[object, ...]) -> None:
        self.entry = entry
        self.fields = fields
        self.log = array("Q")
        self.count = 0
        self.cost = estimated_entry_cost(entry)
        self.alone = (entry,)
        self.runs: set[Run] = set()


def _holds(stored: tuple[PodEntry, ...] | None, entry: PodEntry) -> bool:
    """Whether a key's tuple holds this very (interned) entry instance."""
    if stored is not None:
        for held in stored:
            if held is entry:
                return True
    return False


#: The fields PodEntry equality compares, read at C speed; derived from the dataclass, so a
#: field added to PodEntry distinguishes entries here too.
_FIELDS = attrgetter(*(field.name for field in fields(PodEntry) if field.compare))


def _equality_key(entry: PodEntry) -> tuple[object, ...]:
    """What PodEntry equality compares (the class and every compared field), as a tuple that
    is hashed and compared at C speed."""
    return (entry.__class__, _FIELDS(entry))


#: Who races in a score: a pod's rank 0 as the pod's name, any other rank as (pod, rank).
_Racer = str | tuple[str, int]
#: Marks race results where some racer is a rank other than 0.
_RANKED = ("", -1)
#: A stretch of a walk with equal entries: (index of its first key in the chain, number of
#: keys, the entries, the run and position it is read from or None and 0 for inline keys).
_Piece = tuple[int, int, tuple[PodEntry, ...], "Run | None", int]


def _best_ranks(scores: Mapping[_Racer, float]) -> dict[str, float]:
    """Each pod's best rank's score, from the scores of a race."""
    out: dict[str, float] = {}
    for racer, total in scores.items():
        if racer is _RANKED:
            continue
        pod = racer if isinstance(racer, str) else racer[0]
        if pod not in out or total > out[pod]:
            out[pod] = total
    return out


#: What a score needs of a tuple of entries: each racer's best weight, the racers, and their
#: one weight when they all have the same (else None).
_Best = tuple[dict[_Racer, float], frozenset[_Racer], float | None]


class _Race:
    """A score in progress (see :class:`~kvredis.scoring.LongestPrefixScorer`): each
    (pod, rank) earns its best weight at every key from the first on and drops out at its
    first key without an entry; :meth:`step` takes the next stretch of keys with equal entries
    (their best weights per racer, as :func:`_best_weights` gives them).

    A racer's keys are added up only when it drops out or changes weight (with
    :func:`~kvredis.scoring.add_times`, the same floats as adding key by key). While every
    racer left has one weight and keeps it (the usual case: one tier), a stretch costs one
    subset test of two sets.
    """

    __slots__ = ("alive", "common", "scores", "since", "weight")

    def __init__(self, i: int, first: _Best) -> None:
        best, racers, common = first
        self.scores = dict(best)  # the first key's weights
        self.weight = dict(best)
        self.alive = set(racers)
        self.since = dict.fromkeys(racers, i + 1)  # keys from here on are not added up yet
        self.common = common

    def step(self, i: int, info: _Best) -> bool:
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
            _settle(self.scores, self.since, gone, common, i)
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
                scores[racer] = _add_up(scores[racer], w, n)
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

    def finish(self, end: int) -> dict[_Racer, float]:
        """The scores, the race having reached key ``end``; with :data:`_RANKED` among the
        keys when some rank is not 0."""
        scores = self.scores
        if self.common is not None:
            _settle(scores, self.since, self.weight, self.common, end)
        else:
            for racer, w in self.weight.items():
                n = end - self.since[racer]
                if n:
                    scores[racer] = _add_up(scores[racer], w, n)
        if not all(map(isinstance, scores, repeat(str))):
            scores[_RANKED] = 0.0
        return scores


def _race(
    pieces: Iterator[_Piece], best_of: Callable[[tuple[PodEntry, ...]], _Best]
) -> tuple[dict[_Racer, float], list[_Piece]]:
    """Score a walk given as pieces (:meth:`_MemoryIndex._pieces`); returns the scores and
    the pieces where some racer was still in the race."""
    used: list[_Piece] = []
    first = next(pieces, None)
    if first is None:
        return {}, used
    race = _Race(first[0], best_of(first[2]))
    used.append(first)
    end = first[0] + first[1]
    for piece in pieces:
        i, c, entries, _, _ = piece
        if not race.step(i, best_of(entries)):
            break
        used.append(piece)
        end = i + c
    return race.finish(end), used


def _settle(
    scores: dict[_Racer, float],
    since: dict[_Racer, int],
    racers: Iterable[_Racer],
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
                result = _add_up(total, weight, n)
            scores[racer] = result


def _add_up(total: float, weight: float, times: int) -> float:
    """:func:`~kvredis.scoring.add_times`, whole weights of 1 added at once."""
    if weight == 1.0 and total.is_integer() and total < _EXACT:
        return total + times
    return add_times(total, weight, times)


def _best_weights(entries: tuple[PodEntry, ...], weights: dict[str, float]) -> _Best:
    """Each (pod, rank)'s best weight among these entries, the racers, their one weight."""
    best: dict[_Racer, float] = {}
    for entry in entries:
        racer: _Racer = entry.pod_identifier
        if entry.dp_rank:
            racer = (entry.pod_identifier, entry.dp_rank)
        w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
        if racer not in best or w > best[racer]:
            best[racer] = w
    values = set(best.values())
    return best, frozenset(best), next(iter(values)) if len(values) == 1 else None


#: Below this, adding whole numbers to a float total is exact (chains are far shorter).
_EXACT = float(1 << 52)
#: Tuples of entries whose best weights the index remembers (then it forgets them all).
_BEST_CACHED = 4096
#: Weight maps the index remembers validated (then it forgets them all).
_WEIGHTS_CACHED = 64


_INT_ONLY = frozenset({int})
_ENGINE, _REQUEST = KeyType.ENGINE, KeyType.REQUEST


def _plain_hashes(values: object) -> bool:
    """Whether ``values`` is a list or tuple of plain ints in ``[0, 2**64)``, checked at C
    speed; anything else (including every bad input) goes through :mod:`kvredis.checks`."""
    if type(values) is not list and type(values) is not tuple:
        return False
    if values and set(map(type, values)) != _INT_ONLY:
        return False
    try:
        array("Q", values)  # refuses negative ints and ints of 2**64 and more
    except OverflowError:
        return False
    return True


def _checked_entries(entries: Sequence[PodEntry], *, for_add: bool) -> Sequence[PodEntry]:
    """``entries`` validated as :func:`~kvredis.checks.check_entries` does; one plain entry
    in a list or tuple (the common case) is checked inline."""
    if (type(entries) is list or type(entries) is tuple) and len(entries) == 1:
        entry = entries[0]
        if type(entry) is PodEntry and (
            not for_add or (entry.pod_identifier and (entry.device_tier or entry.speculative))
        ):
            return entries
    return check_entries(entries, for_add=for_add)


def _checked_reach(keys: list[int], reached: int) -> bool:
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


class _MemoryIndex:
    """The shared implementation; subclasses decide the per-key entry cap and :meth:`_shrink`.

    State (see the module docstring): ``_keys``, the inline request keys (key -> entries, in
    least-recently-used order) and ``_key_ticks`` (their last-use ticks); ``_resident``, the
    request keys in runs (key -> run) and ``_runs``, the live runs; ``_engine``, the engine keys
    not in runs, and ``_engine_resident``, those in runs (engine key -> run); the entry records
    ``_held`` (by the fields equality compares), ``_by_id`` (by the id of the stored instance)
    and ``_pods`` (by pod); ``_cost``, the byte estimate of everything but the engine table
    (which keeps its own).
    """

    def __init__(self, entries_per_key: int | None) -> None:
        self._lock = threading.Lock()
        self._entries_per_key = entries_per_key
        self._keys: OrderedDict[int, tuple[PodEntry, ...]] = OrderedDict()
        self._key_ticks: dict[int, int] = {}
        self._resident: dict[int, Run] = {}
        self._runs: dict[Run, None] = {}
        self._order = RunOrder(_request_recency)
        self._engine = EngineTable(track_ticks=True)
        self._engine_resident: dict[int, Run] = {}
        self._engine_order = RunOrder(_engine_recency)
        self._held: dict[tuple[object, ...], _Held] = {}
        self._by_id: dict[int, _Held] = {}  # id of the stored instance -> its record
        self._pods: dict[str, set[_Held]] = {}  # so clear() is O(pod's keys)
        self._watermarks: dict[str, Watermark] = {}
        # The best weights of tuples of entries scored lately (id -> the tuple, which keeps
        # the id its own, the weights and the best weights), and the weight maps seen lately.
        self._bests: dict[int, tuple[tuple[PodEntry, ...], dict[str, float], _Best]]
        self._bests = {}
        self._weights_seen: dict[tuple[tuple[object, ...], ...], dict[str, float]] = {}
        self._tick = 0
        self._cost = 0
        self._expiry: ExpiryTable[_Held] = ExpiryTable()
        # The last tuple an entry was removed from, the record and what was left: the next key
        # holding the same tuple gets the same tuple back (one tuple per run of a chain).
        self._shrunk: tuple[tuple[PodEntry, ...], _Held | None, tuple[PodEntry, ...]] = (
            (),
            None,
            (),
        )

    # -- Index -----------------------------------------------------------------------------

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        """Entries per key along the chain, stopping at the first key no (filtered) pod holds.

        Keys are checked up to where the walk stops: a bad key past the first miss is not read.
        """
        keys = request_keys
        if type(keys) is not list:
            keys = list(keys) if type(keys) is tuple else check_hashes(keys, "request key")
        pods = None if pod_identifier_set is None else pod_filter(pod_identifier_set)
        out: dict[int, list[PodEntry]] = {}
        lock = self._lock
        lock.acquire()  # (a with block costs more: its special-method lookups)
        try:
            now = 0.0
            if self._expiry:
                now = time.monotonic()
                self._expire(now)
            used = []
            end = 0
            try:
                for piece in self._pieces(keys, pods, now):
                    i, c, entries, _, _ = piece
                    if c == 1:
                        out[keys[i]] = [*entries]
                    else:
                        out.update(zip(keys[i : i + c], map(list, repeat(entries, c)), strict=True))
                    used.append(piece)
                    end = i + c
            except TypeError:  # an unhashable key
                check_hashes(keys, "request key")
                raise
            if not _checked_reach(keys, end + 1):  # int subclasses: answer with ints
                out = {int(key): found for key, found in out.items()}
            if used:
                self._use(keys, used)
        finally:
            lock.release()
        return out

    def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        """Per-pod longest-prefix scores, each pod's best data-parallel rank's: the floats of
        ``LongestPrefixScorer(medium_weights).score(keys, lookup(keys, pod_identifier_set))``,
        in one walk that stops as soon as no (pod, rank) holds every key so far.

        The walk reads runs span by span and inline keys with equal entries group by group.
        The keys where some pod is still in the race count as used, as a lookup's hits do; keys
        are checked up to where the walk stops.
        """
        scores = self._scores(request_keys, medium_weights, pod_identifier_set)
        if _RANKED in scores:
            return _best_ranks(scores)
        return scores  # type: ignore[return-value]

    def score_by_rank(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, dict[int, float]]:
        """pod -> dp_rank -> longest-prefix score of that rank: the floats of
        ``LongestPrefixScorer(medium_weights).score_by_rank(keys, lookup(keys, ...))``, in the
        walk :meth:`score` makes (see :class:`~kvredis.index.RankScoringIndex`)."""
        scores = self._scores(request_keys, medium_weights, pod_identifier_set)
        scores.pop(_RANKED, None)
        out: dict[str, dict[int, float]] = {}
        for racer, total in scores.items():
            if isinstance(racer, str):
                pod, rank = racer, 0
            else:
                pod, rank = racer
            ranks = out.get(pod)
            if ranks is None:
                out[pod] = {rank: total}
            else:
                ranks[rank] = total
        return out

    def _scores(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None,
        pod_identifier_set: Collection[str] | None,
    ) -> dict[_Racer, float]:
        """The score of every (pod, rank) in the race, with :data:`_RANKED` among the keys
        when some rank is not 0."""
        keys = request_keys
        if type(keys) is not list:
            keys = list(keys) if type(keys) is tuple else check_hashes(keys, "request key")
        weights = self._weights(medium_weights)
        pods = None if pod_identifier_set is None else pod_filter(pod_identifier_set)
        if not keys:
            return {}
        lock = self._lock
        lock.acquire()
        try:
            now = 0.0
            if self._expiry:
                now = time.monotonic()
                self._expire(now)
            try:
                if pods is None and not self._expiry:
                    scores, used = self._score_walk(keys, weights, self._best_of(weights))
                else:  # (filtered pieces are tuples of their own: nothing to remember)
                    best_of = partial(_best_weights, weights=weights)
                    scores, used = _race(self._pieces(keys, pods, now), best_of)
            except TypeError:  # an unhashable key
                check_hashes(keys, "request key")
                raise
            if used:
                i, c, _, _, _ = used[-1]
                _checked_reach(keys, i + c + 1)
                self._use(keys, used)
            else:
                _checked_reach(keys, 1)
        finally:
            lock.release()
        return scores

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

    def _best_of(self, weights: dict[str, float]) -> Callable[[tuple[PodEntry, ...]], _Best]:
        """:func:`_best_weights` for ``weights``, remembered per tuple of entries."""
        cache = self._bests
        cache_get = cache.get

        def best_of(entries: tuple[PodEntry, ...]) -> _Best:
            hit = cache_get(id(entries))
            if hit is not None and hit[0] is entries and hit[1] is weights:
                return hit[2]
            best = _best_weights(entries, weights)
            if len(cache) >= _BEST_CACHED:
                cache.clear()
            cache[id(entries)] = (entries, weights, best)
            return best

        return best_of

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
        *,
        ttl: float | None = None,
    ) -> None:
        """Store every entry under every request key and record the engine→request mappings.

        With ``ttl`` (seconds; speculative entries only) the entries expire by themselves.
        """
        eng: Sequence[int] | None = engine_keys
        req: Sequence[int] = request_keys
        if req and _plain_hashes(req) and (eng is None or _plain_hashes(eng)):
            ents = _checked_entries(entries, for_add=True)
        else:
            eng, req, ents = check_add(engine_keys, request_keys, entries)
        seconds = None if ttl is None else check_ttl(ttl, ents)
        lock = self._lock
        lock.acquire()
        try:
            now = 0.0
            if self._expiry.pending or seconds is not None:
                now = time.monotonic()
                self._expire(now)
            self._add(eng, req, ents, None if seconds is None else now + seconds)
        finally:
            lock.release()

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """Remove exactly these entries; an engine key resolves to all its request keys."""
        if type(key) is not int or not 0 <= key <= MAX_BLOCK_HASH:
            key = check_hash(key, "evict key")
        if key_type is not _ENGINE and key_type is not _REQUEST:
            key_type = check_key_type(key_type)
        ents = entries
        if type(ents) is not list or len(ents) != 1 or type(ents[0]) is not PodEntry:
            ents = check_entries(entries)
        lock = self._lock
        lock.acquire()
        try:
            if self._expiry.pending:
                self._expire(time.monotonic())
            self._evict(key, key_type, ents)
        finally:
            lock.release()

    def get_request_key(self, engine_key: int) -> int:
        """The request key most recently mapped to ``engine_key``."""
        key = engine_key
        if type(key) is not int or not 0 <= key <= MAX_BLOCK_HASH:
            key = check_hash(key, "engine key")
        lock = self._lock
        lock.acquire()
        try:
            self._tick += 1
            run = self._engine_resident.get(key)
            if run is not None:
                pos = run.engine_position(key)
                self._use_engine(run, pos, pos + 1)
                return run.keys[pos]
            value = self._engine.resolve(key, self._tick)
            if value is None:
                raise EngineKeyNotFoundError(key)
        finally:
            lock.release()
        return value if type(value) is int else value[-1]  # type: ignore[index]

    def clear(self, pod_identifier: str) -> None:
        """Remove every entry of the pod, on every tier, group and data-parallel rank."""
        self.clear_with_progress(pod_identifier)

    def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int:
        """:meth:`clear`, returning the (key, entry) pairs removed.

        ``progress(done, removed)`` is called after every page of engine mappings examined.
        """
        return self._clear(pod_identifier, None, progress)

    def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: ClearProgress | None = None,
    ) -> int:
        """Remove the pod's entries on ``device_tiers`` of rank ``dp_rank`` (``None``: all);
        returns the (key, entry) pairs removed (see :class:`~kvredis.index.SelectiveClearIndex`).
        """
        return self._clear(pod_identifier, check_selection(device_tiers, dp_rank), progress)

    def _clear(
        self,
        pod_identifier: str,
        selection: EntrySelection | None,
        progress: ClearProgress | None,
    ) -> int:
        pod = check_pod_identifier(pod_identifier)
        if progress is not None and not callable(progress):
            raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
        removed = 0
        with self._lock:
            for held in list(self._pods.get(pod, ())):
                if selection is not None and not selection.matches(held.entry):
                    continue
                for run in list(held.runs):
                    removed += self._run_remove(run, 0, len(run.keys), held)
                for key in held.log.tolist():
                    if not held.count:
                        break
                    removed += self._drop_pair(key, held)
            engine_keys = self._engine.keys()
            runs = [run for run in self._runs if run.mapped]
        # As in the Redis backend, a clear also drops every engine mapping none of whose request
        # keys holds an entry, so a stale engine key no longer resolves. Like the Redis clear it
        # goes page by page, so lookups are never held up for long by a large index.
        total = len(engine_keys) + sum(run.mapped for run in runs)
        done = 0
        for start in range(0, len(engine_keys), CLEAR_MAPPINGS_PER_PAGE):
            page = engine_keys[start : start + CLEAR_MAPPINGS_PER_PAGE]
            with self._lock:
                inline, resident, get = self._keys, self._resident, self._engine.get
                for engine_key in page:
                    value = get(engine_key)
                    if value is None or value in inline or value in resident:
                        continue  # (an int: one request key)
                    if type(value) is int or not any(
                        r in inline or r in resident for r in refs(value)
                    ):
                        self._engine.drop(engine_key)
            done += len(page)
            if progress is not None:
                progress(done, removed)
        page_runs: list[Run] = []
        page_size = 0
        for i, run in enumerate(runs):
            page_runs.append(run)
            page_size += len(run.keys)
            if page_size < CLEAR_MAPPINGS_PER_PAGE and i + 1 < len(runs):
                continue
            with self._lock:
                for run in page_runs:
                    done += self._drop_unheld_engine_keys(run)
            page_runs, page_size = [], 0
            if progress is not None:
                progress(min(done, total), removed)
        return removed

    def __len__(self) -> int:
        """Number of request keys held."""
        with self._lock:
            if self._expiry.pending:
                self._expire(time.monotonic())
            return len(self._keys) + len(self._resident)

    # -- BatchIndex ------------------------------------------------------------------------

    def apply_batch(
        self,
        ops: Sequence[IndexOp],
        stream: str | None = None,
        watermark: Watermark | None = None,
    ) -> bool:
        """Apply ``ops`` in order, atomically, if ``watermark`` is newer than the stream's."""
        plan = check_batch(ops, stream, watermark)
        with self._lock:
            if self._expiry.pending:
                self._expire(time.monotonic())
            if stream is not None and watermark is not None:
                stored = self._watermarks.get(stream)
                if stored is not None and watermark <= stored:
                    return False
            for op in plan:
                if isinstance(op, AddOp):
                    self._add(op.engine_keys, op.request_keys, op.entries, parent=op.parent)
                else:
                    self._evict(op.key, op.key_type, op.entries)
            if stream is not None and watermark is not None:
                self._watermarks[stream] = watermark
        return True

    def get_watermark(self, stream: str) -> Watermark | None:
        """The stored watermark of ``stream``, or ``None``."""
        check_stream(stream)
        with self._lock:
            return self._watermarks.get(stream)

    def reset_watermark(self, stream: str, watermark: Watermark | None) -> None:
        """Overwrite, or with ``None`` delete, the stored watermark of ``stream``."""
        check_stream(stream)
        check_watermark(watermark, optional=True)
        with self._lock:
            if watermark is None:
                self._watermarks.pop(stream, None)
            else:
                self._watermarks[stream] = watermark

    # -- walks (called with the lock held) -------------------------------------------------

    def _pieces(self, keys: list[int], pods: frozenset[str] | None, now: float) -> Iterator[_Piece]:
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

    def _view(
        self,
        run: Run,
        weights: dict[str, float],
        best_of: Callable[[tuple[PodEntry, ...]], _Best],
    ) -> tuple[list[int], list[_Best | None]]:
        """What a score reads of a run for these weights (see :attr:`Run.view`): the ends of
        its ranges with neighbours of equal best weights merged, and their best weights
        (``None`` at holes); built on the run's first score after its entries changed."""
        view = run.view
        if view is not None and view[0] is weights:
            return view[1], view[2]  # type: ignore[return-value]
        ends: list[int] = []
        infos: list[_Best | None] = []
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

    def _score_walk(
        self,
        keys: list[int],
        weights: dict[str, float],
        best_of: Callable[[tuple[PodEntry, ...]], _Best],
    ) -> tuple[dict[_Racer, float], list[_Piece]]:
        """:func:`_race` over :meth:`_pieces` without a filter or expiring entries, in one
        loop: the walk of a score, its hot path. Returns the scores and the stretches used (one
        per span of a run, one per group of inline keys)."""
        inline_get, resident_get = self._keys.get, self._resident.get
        used: list[_Piece] = []
        race: _Race | None = None
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
                        race = _Race(i, best_of(stored))
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
                    race = _Race(i, info)
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

    def _use(self, keys: list[int], used: list[_Piece]) -> None:
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

    def _use_engine(self, run: Run, a: int, b: int) -> None:
        """Count the engine keys at ``[a, b)`` of ``run`` as used."""
        assert run.engine_recency is not None
        self._tick += 1
        run.engine_recency.assign(a, b, self._tick)
        self._engine_order.used(run, self._tick)

    # -- entry records ---------------------------------------------------------------------

    def _find(self, entry: PodEntry) -> _Held | None:
        """The record of the entry equal to ``entry``, if the index holds one."""
        held = self._by_id.get(id(entry))
        if held is not None and held.entry is entry:
            return held
        return self._held.get(_equality_key(entry))

    def _intern(self, entry: PodEntry) -> _Held:
        """:meth:`_find`, creating the record (with ``entry`` as the instance stored)."""
        held = self._find(entry)
        if held is None:
            fields = _equality_key(entry)
            held = self._held[fields] = _Held(entry, fields)
            self._by_id[id(entry)] = held
            pods = self._pods.get(entry.pod_identifier)
            if pods is None:
                self._pods[entry.pod_identifier] = {held}
            else:
                pods.add(held)
        return held

    def _release(self, held: _Held) -> None:
        """Forget the record of an entry no key holds any more."""
        del self._held[held.fields]
        del self._by_id[id(held.entry)]
        pod = held.entry.pod_identifier
        pods = self._pods[pod]
        pods.discard(held)
        if not pods:
            del self._pods[pod]

    def _records(self, ents: Sequence[PodEntry]) -> list[_Held]:
        """The records of the distinct entries of an add (the most recent ``cap`` of them)."""
        cap = self._entries_per_key
        unique = list(dict.fromkeys(ents))
        if cap is not None and len(unique) > cap:  # the oldest would be dropped at once
            unique = unique[-cap:]
        return [self._intern(e) for e in unique]

    # -- adds ------------------------------------------------------------------------------

    def _add(
        self,
        eng: Sequence[int] | None,
        req: Sequence[int],
        ents: Sequence[PodEntry],
        deadline: float | None = None,
        *,
        parent: int | None = None,
    ) -> None:
        resident = self._resident
        if parent is not None and deadline is None:  # an append to a chain
            run = resident.get(parent)
            if (
                run is not None
                and run.keys[-1] == parent
                and len(run.keys) + len(req) <= RUN_MAX
                and resident.keys().isdisjoint(req)
                and self._keys.keys().isdisjoint(req)
                and len(set(req)) == len(req)
            ):
                self._extend_run(run, eng, req, ents)
                self._shrink()
                return
        if (
            deadline is None
            and len(req) >= RUN_MIN
            and resident.keys().isdisjoint(req)
            and self._keys.keys().isdisjoint(req)
            and len(set(req)) == len(req)
        ):
            self._add_run(eng, req, ents)  # a new chain, or a new piece of one
            self._shrink()
            return
        if deadline is not None or not (resident and not resident.keys().isdisjoint(req)):
            fresh = [k for k in req if k not in self._keys] if deadline is None else ()
            if len(fresh) < RUN_MIN:  # everything inline
                if deadline is not None and resident:
                    for key in req:
                        run = resident.get(key)
                        if run is not None:
                            self._unrun(key, run)
                self._add_inline(req, ents, deadline)
                if eng:
                    self._map(eng, req, None, {})
                self._shrink()
                return
        self._add_mixed(eng, req, ents)
        self._shrink()

    def _add_inline(
        self, req: Sequence[int], ents: Sequence[PodEntry], deadline: float | None
    ) -> None:
        """Add to keys that are all inline or new (and stay inline)."""
        if len(ents) == 1 and deadline is None and not self._expiry:
            self._add_one(req, self._intern(ents[0]))
        else:
            self._add_many(req, ents, deadline)
        self._tick += 1
        self._key_ticks.update(dict.fromkeys(req, self._tick))

    def _add_run(
        self, eng: Sequence[int] | None, req: Sequence[int], ents: Sequence[PodEntry]
    ) -> None:
        """Store new, distinct request keys as one run."""
        helds = self._records(ents)
        self._tick += 1
        run = self._new_run(list(req), helds, self._tick)
        if not eng:
            return
        n = len(req)
        engine_resident = self._engine_resident
        if (
            len(eng) == n
            and engine_resident.keys().isdisjoint(eng)
            and self._engine.disjoint(eng)
            and len(set(eng)) == n
        ):
            self._tick += 1
            run.map_engine(list(eng), self._tick)
            engine_resident.update(zip(eng, repeat(run)))
            self._cost += n * (RUN_MAPPING_COST + 8)
            self._engine_order.used(run, self._tick)
            return
        self._map(eng, req, run, {k: p for p, k in enumerate(run.keys)})

    def _extend_run(
        self, run: Run, eng: Sequence[int] | None, req: Sequence[int], ents: Sequence[PodEntry]
    ) -> None:
        """Append new, distinct request keys to the run whose last key is their parent (an
        engine storing a chain block by block): the chain stays one run."""
        helds = self._records(ents)
        entries = tuple(h.entry for h in helds)
        start, n = len(run.keys), len(req)
        end = start + n
        run.keys.extend(req)
        sets = run.sets
        sets.ends.append(end)
        sets.values.append(entries)
        sets.merge(len(sets.ends) - 1)
        run.view = None
        run.live += n
        self._resident.update(zip(req, repeat(run)))
        self._cost += n * (RUN_POSITION_COST + RUN_KEY_COST)
        holders = run.holders
        for held in helds:
            count = holders.get(held, 0)
            if not count:
                held.runs.add(run)
                self._cost += held.cost
            holders[held] = count + n
            held.count += n
        self._tick += 1
        run.recency.ends.append(end)
        run.recency.values.append(self._tick)
        self._order.used(run, self._tick)
        if run.engine is not None:
            assert run.engine_recency is not None
            run.engine.extend([None] * n)
            run.engine_recency.ends.append(end)
            run.engine_recency.values.append(0)
            self._cost += n * 8
        if eng:
            self._map(eng, req, run, {k: start + p for p, k in enumerate(req)})

    def _new_run(self, keys: list[int], helds: list[_Held], tick: int) -> Run:
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

    def _add_mixed(
        self, eng: Sequence[int] | None, req: Sequence[int], ents: Sequence[PodEntry]
    ) -> None:
        """Add to keys of runs, inline keys and new keys alike (no ttl): new keys become a run
        when there are enough of them; keys are used in the order of ``req``."""
        helds = self._records(ents)
        if type(req) is not list:
            req = list(req)  # (compared with the runs' key lists)
        inline, resident = self._keys, self._resident
        new = [k for k in req if k not in inline and k not in resident]
        run: Run | None = None
        positions: dict[int, int] = {}
        if len(new) >= RUN_MIN and len(set(new)) == len(new):
            run = self._new_run(new, helds, 0)
            positions = {k: p for p, k in enumerate(new)}
        n = len(req)
        i = 0
        last: Run | None = None
        hint = -1
        while i < n:
            key = req[i]
            pos = positions.get(key)
            if pos is not None:  # new keys of the new run, in its order
                j = i + 1
                while j < n and positions.get(req[j]) == pos + j - i:
                    j += 1
                assert run is not None
                self._tick += 1
                run.recency.assign(pos, pos + j - i, self._tick)
                self._order.used(run, self._tick)
                i = j
                continue
            home = resident.get(key)
            if home is not None:  # a stretch of an older run
                start = home.position(key, hint if home is last else -1)
                stop = start + span(req, i, home.keys, start)
                stop = self._run_add(home, start, stop, helds)
                last, hint = home, stop
                self._tick += 1
                home.recency.assign(start, stop, self._tick)
                self._order.used(home, self._tick)
                i += stop - start
                continue
            j = i + 1  # inline keys (or new ones kept inline)
            while j < n and req[j] not in resident:
                j += 1
            self._add_inline(req[i:j], ents, None)
            i = j
        if eng:
            self._map(eng, req, run, positions)

    def _run_add(self, run: Run, a: int, b: int, helds: list[_Held]) -> int:
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
            if not _holds(old, entry):
                held = by_id[id(entry)]
                count = holders.get(held, 0)
                if not count:
                    held.runs.add(run)
                    self._cost += held.cost
                holders[held] = count + length
                held.count += length
        for entry in old:
            if not _holds(new, entry):
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

    def _add_one(self, req: Sequence[int], held: _Held) -> None:
        """Add one entry to inline or new keys (no expiry involved): the common event."""
        table = self._keys
        entry, alone = held.entry, held.alone
        keys_before = len(table)
        added: Sequence[int] = ()
        fresh = None
        if table.keys().isdisjoint(req):  # all new keys: one C-level update of each dict
            fresh = dict.fromkeys(req, alone)
            if len(fresh) == len(req):
                table.update(fresh)
                added = req
            else:  # a key repeated: its place in the LRU order is its last occurrence
                fresh = None
        if fresh is None:
            get, touch, cap = table.get, table.move_to_end, self._entries_per_key
            # Keys that held the same tuple hold the same tuple after the add too: a chain
            # added pod by pod keeps one tuple for the whole run of keys its pods share.
            grown_from: tuple[PodEntry, ...] | None = None
            grown: tuple[PodEntry, ...] = alone
            refreshed_from: tuple[PodEntry, ...] | None = None
            refreshed: tuple[PodEntry, ...] = alone
            added = []
            for key in req:
                stored = get(key)
                if stored is None:
                    table[key] = alone
                    added.append(key)
                    continue
                if stored[-1] is not entry:
                    if stored is grown_from:  # as the key before: share its tuple
                        stored = grown
                        added.append(key)
                    elif stored is refreshed_from:
                        stored = refreshed
                    elif _holds(stored, entry):  # re-added: it becomes the most recent
                        refreshed_from = stored
                        stored = refreshed = (*[e for e in stored if e is not entry], entry)
                    else:
                        added.append(key)
                        grown_from = stored
                        stored += alone
                        if cap is not None and len(stored) > cap:
                            stored = self._trim(key, stored, cap)
                            grown_from = None
                        grown = stored
                    table[key] = stored
                touch(key)
        self._cost += (len(table) - keys_before) * KEY_COST
        if added:
            self._log_keys(held, added)

    def _log_keys(self, held: _Held, keys: Sequence[int]) -> None:
        """Record that inline ``keys`` (not holding the entry before) now hold it; compact the
        log once it is over twice its keys (amortized O(1) per key logged)."""
        held.count += len(keys)
        self._cost += len(keys) * held.cost
        log = held.log
        log.extend(keys)
        if len(log) > 2 * held.count + LOG_SLACK:
            get, entry = self._keys.get, held.entry
            held.log = array("Q", [k for k in dict.fromkeys(log) if _holds(get(k), entry)])

    def _add_many(
        self, req: Sequence[int], ents: Sequence[PodEntry], deadline: float | None
    ) -> None:
        """Add several entries, or entries that expire, or while some entries expire, to
        inline or new keys."""
        cap = self._entries_per_key
        helds = self._records(ents)
        added = tuple(h.entry for h in helds)
        added_ids = set(map(id, added))
        by_id = self._by_id
        # A confirmed entry of a pod replaces that pod's expiring speculative entries under
        # the key (speculative entries added without a ttl stay until evicted).
        expiry = self._expiry
        confirmed = {e.pod_identifier for e in added if not e.speculative} if expiry else ()
        table = self._keys
        new_keys: list[list[int]] = [[] for _ in helds]  # logged once the keys hold them
        for key in req:
            stored = table.get(key)
            if stored is None:
                stored = ()
                self._cost += KEY_COST
            else:
                table.move_to_end(key)
            # Re-adding an entry refreshes it: it moves to the most recently added end.
            kept = [e for e in stored if id(e) not in added_ids]
            if confirmed and kept:
                replaced = {
                    id(e): e
                    for e in kept
                    if e.pod_identifier in confirmed and (key, by_id[id(e)]) in expiry
                }
                if replaced:
                    for entry in replaced.values():
                        self._forget(key, entry)
                    kept = [e for e in kept if id(e) not in replaced]
            for held, logged in zip(helds, new_keys, strict=True):
                if not _holds(stored, held.entry):
                    logged.append(key)
            merged = (*kept, *added)
            if cap is not None and len(merged) > cap:
                merged = self._trim(key, merged, cap)
            table[key] = merged
            if deadline is not None:
                for held in helds:
                    expiry.set(key, held, deadline)
            elif expiry:
                for held in helds:
                    expiry.discard(key, held)
        for held, logged in zip(helds, new_keys, strict=True):
            if logged:
                self._log_keys(held, logged)

    def _trim(self, key: int, stored: tuple[PodEntry, ...], cap: int) -> tuple[PodEntry, ...]:
        """Keep the ``cap`` most recently added entries of an inline key."""
        for entry in stored[:-cap]:
            self._forget(key, entry)
        return stored[-cap:]

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

    # -- engine mappings -------------------------------------------------------------------

    def _map(
        self,
        eng: Sequence[int],
        req: Sequence[int],
        run: Run | None,
        positions: Mapping[int, int],
    ) -> None:
        """Record the engine->request mappings of an add, used in their order. A new engine
        key paired with a key of the add's new run is kept in the run, at the key's position;
        the others go to (or stay in) the engine table, or stay in the run they are in."""
        engine_resident, table = self._engine_resident, self._engine
        if run is None and not engine_resident:
            self._tick += 1
            table.map_all(eng, req, self._tick)
            return
        aligned = len(eng) == len(req)
        if aligned and (type(eng) is not list or type(req) is not list):
            eng, req = list(eng), list(req)  # (compared with the runs' key lists)
        pairs: Iterable[tuple[int, int]]
        pairs = enumerate(eng) if aligned else infer_mappings(eng, req)
        skip = 0  # pairs already handled as part of a stretch of a run
        inline: list[tuple[int, int]] = []  # pairs for the table, used next
        # engine keys of one run at positions [a, b), used next
        used: Run | None = None
        a = b = 0

        def flush() -> None:
            nonlocal used
            if inline:
                self._tick += 1
                table.map_pairs(inline, self._tick)
                inline.clear()
            if used is not None:
                self._use_engine(used, a, b)
                used = None

        for first, second in pairs:
            if aligned:  # (index, engine key)
                if skip:
                    skip -= 1
                    continue
                engine_key, request_key = second, req[first]
            else:
                engine_key, request_key = first, second
            home = engine_resident.get(engine_key)
            if home is not None:
                pos = home.engine_position(engine_key, b if home is used else -1)
                if home.keys[pos] == request_key:
                    if home is not used or pos != b:
                        flush()
                        used, a = home, pos
                    b = pos + 1
                    if aligned:  # the pairs that follow along the run, at once
                        assert home.engine is not None
                        more = min(
                            span(eng, first, home.engine, pos), span(req, first, home.keys, pos)
                        )
                        skip = more - 1
                        b = pos + more
                    continue
                flush()  # a second request key: the mapping moves to the table
                old = home.keys[pos]
                self._drop_engine(home, pos)
                self._tick += 1
                table.put(engine_key, old, self._tick)
                table.map_pairs(((engine_key, request_key),), self._tick)
                continue
            pos = positions.get(request_key, -1)
            if pos >= 0 and run is not None and (run.engine is None or run.engine[pos] is None):
                if inline:
                    flush()
                if table.get(engine_key) is None:
                    self._place_engine(run, pos, engine_key)
                    if run is not used or pos != b:
                        flush()
                        used, a = run, pos
                    b = pos + 1
                    continue
            if used is not None:
                flush()
            inline.append((engine_key, request_key))
        flush()

    def _place_engine(self, run: Run, pos: int, engine_key: int) -> None:
        """Keep a new engine key at ``pos`` of ``run`` (the caller marks it used)."""
        n = len(run.keys)
        if run.engine is None:
            run.engine = [None] * n
            run.engine_recency = Ranges(n, 0)
            self._cost += n * 8
        run.engine[pos] = engine_key
        run.mapped += 1
        self._engine_resident[engine_key] = run
        self._cost += RUN_MAPPING_COST

    def _drop_engine(self, run: Run, pos: int) -> None:
        """Forget the engine key at ``pos`` of ``run``."""
        assert run.engine is not None
        engine_key = run.engine[pos]
        assert engine_key is not None
        del self._engine_resident[engine_key]
        run.engine[pos] = None
        run.mapped -= 1
        self._cost -= RUN_MAPPING_COST
        if not run.alive:
            self._bury(run)

    def _drop_unheld_engine_keys(self, run: Run) -> int:
        """Drop the engine keys of ``run`` whose request key no key holds; returns how many
        engine keys it examined."""
        engine = run.engine
        if engine is None or not run.mapped:
            return 0
        examined = run.mapped
        inline, resident = self._keys, self._resident
        for pos, engine_key in enumerate(engine):
            if engine_key is not None:
                key = run.keys[pos]
                if key not in resident and key not in inline:
                    self._drop_engine(run, pos)
                    if run.engine is None or not run.alive:
                        break
        return examined

    # -- evicts ----------------------------------------------------------------------------

    def _evict(self, key: int, key_type: KeyType, ents: Sequence[PodEntry]) -> None:
        found: Iterable[_Held]
        if len(ents) == 1:  # the common case, without building lists
            held = self._find(ents[0])
            found = () if held is None else (held,)
        else:
            found = [h for h in map(self._find, ents) if h is not None]
        if key_type is KeyType.REQUEST:
            for held in found:
                self._remove(key, held)
            return
        inline, resident = self._keys, self._resident
        run = self._engine_resident.get(key)
        if run is not None:
            pos = run.engine_position(key)
            request_key = run.keys[pos]
            for held in found:
                self._remove(request_key, held, pos)
            if request_key not in resident and request_key not in inline:
                self._drop_engine(run, pos)
            return
        value = self._engine.get(key)
        if value is None:
            return
        # Empty request keys are always removed, so "holds no entry" is "is not a key".
        if type(value) is int:
            for held in found:
                self._remove(value, held)
            if value not in inline and value not in resident:
                self._engine.drop(key)
            return
        targets: tuple[int, ...] = value  # type: ignore[assignment]
        for request_key in targets:
            for held in found:
                self._remove(request_key, held)
        if not any(r in inline or r in resident for r in targets):
            self._engine.drop(key)

    def _remove(self, key: int, held: _Held, hint: int = -1) -> int:
        """Remove one entry from one key, inline or in a run (``hint``: where in its run it
        likely is); 1 if it was there, else 0."""
        run = self._resident.get(key)
        if run is None:
            return self._drop_pair(key, held)
        if held not in run.holders:
            return 0
        return self._run_remove_at(run, run.position(key, hint), held)

    def _run_remove_at(self, run: Run, pos: int, held: _Held) -> int:
        """:meth:`_run_remove` of one position (an evict): the position's range is split
        around it, and merged with a neighbour holding the same entries."""
        sets = run.sets
        ends, values = sets.ends, sets.values
        j = bisect_right(ends, pos)
        old: tuple[PodEntry, ...] = values[j]
        entry = held.entry
        if not _holds(old, entry):
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

    def _run_remove(self, run: Run, a: int, b: int, held: _Held) -> int:
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
            if _holds(old, entry):
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

    def _drop_pair(self, key: int, held: _Held) -> int:
        """Remove one entry from one inline key (and the key once empty); 1 if it was there,
        else 0."""
        table = self._keys
        stored = table.get(key)
        if not _holds(stored, held.entry):
            return 0
        assert stored is not None
        held.count -= 1
        self._cost -= held.cost
        if len(stored) == 1:  # it held only this entry
            del table[key]
            del self._key_ticks[key]
            self._cost -= KEY_COST
        else:
            shrunk = self._shrunk
            if shrunk[0] is stored and shrunk[1] is held:  # as the key before: share
                table[key] = shrunk[2]
            else:
                entry = held.entry
                left = (
                    stored[:-1]
                    if stored[-1] is entry
                    else tuple([e for e in stored if e is not entry])
                )
                table[key] = left
                self._shrunk = (stored, held, left)
        if self._expiry:
            self._expiry.discard(key, held)
        if not held.count:
            self._release(held)
        return 1

    def _forget(self, key: int, entry: PodEntry) -> None:
        """Account for a stored entry no longer under an inline key (the caller updates the
        key)."""
        held = self._by_id[id(entry)]
        held.count -= 1
        self._cost -= held.cost
        if self._expiry:
            self._expiry.discard(key, held)
        if not held.count:
            self._release(held)

    def _expire(self, now: float) -> None:
        """Reclaim up to :data:`EXPIRED_PER_CALL` entries whose deadline is past."""
        for key, held in self._expiry.due(now, EXPIRED_PER_CALL):
            self._drop_pair(key, held)

    # -- bounds ----------------------------------------------------------------------------

    def _drop_key(self, key: int) -> None:
        """Drop an inline key with all its entries."""
        stored = self._keys.pop(key)
        del self._key_ticks[key]
        self._cost -= KEY_COST
        for entry in stored:
            self._forget(key, entry)

    def _oldest_key(self) -> tuple[int, int | None, Run | None]:
        """The least recently used request keys: (tick, an inline key, None) or (tick, None,
        a run whose positions used at tick are the oldest); (0, None, None) if there are none."""
        key = next(iter(self._keys), None)
        event = self._order.oldest(self._runs) if self._resident else None
        if key is not None:
            tick = self._key_ticks[key]
            if event is None or tick < event[0]:
                return tick, key, None
        if event is not None:
            return event[0], None, event[1]
        return 0, None, None

    def _oldest_engine_key(self) -> tuple[int, int | None, Run | None]:
        """As :meth:`_oldest_key`, for engine keys."""
        engine = self._engine
        key = engine.oldest()
        event = self._engine_order.oldest(self._runs) if self._engine_resident else None
        if key is not None:
            assert engine.ticks is not None
            tick = engine.ticks[key]
            if event is None or tick < event[0]:
                return tick, key, None
        if event is not None:
            return event[0], None, event[1]
        return 0, None, None

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

    def _drop_used_engine(self, run: Run, tick: int, limit: int) -> int:
        """Drop up to ``limit`` engine keys of ``run`` last used at ``tick``; returns how
        many there were."""
        recency, engine = run.engine_recency, run.engine
        assert recency is not None and engine is not None
        dropped = 0
        while dropped < limit:
            try:
                j = recency.values.index(tick)
            except ValueError:
                self._engine_order.done(run, tick)
                break
            a = recency.start(j)
            b = min(recency.ends[j], a + limit - dropped)
            recency.assign(a, b, 0)
            for pos in range(a, b):
                if engine[pos] is not None:
                    self._drop_engine(run, pos)
                    dropped += 1
            if not run.alive:
                break
        return dropped

    def _shrink(self) -> None:
        raise NotImplementedError


def _request_recency(run: Run) -> Ranges[int]:
    return run.recency


def _engine_recency(run: Run) -> Ranges[int] | None:
    return run.engine_recency


class InMemoryIndex(_MemoryIndex):
    """An embedded index bounded by key counts (see the module docstring)."""

    #: the ``backend`` label of metrics and traces
    backend_label = "in_memory"

    def __init__(self, config: InMemoryIndexConfig | None = None) -> None:
        cfg = InMemoryIndexConfig() if config is None else config
        if not isinstance(cfg, InMemoryIndexConfig):
            raise ConfigError(f"config must be an InMemoryIndexConfig, got {cfg!r}")
        super().__init__(cfg.pod_cache_size)
        self.config = cfg
        self._size = cfg.size

    def _shrink(self) -> None:
        size = self._size
        excess = len(self._keys) + len(self._resident) - size
        while excess > 0:
            tick, key, run = self._oldest_key()
            if key is not None:
                self._drop_key(key)
                excess -= 1
            elif run is not None:
                excess -= self._drop_used(run, tick, excess)
            else:
                break
        engine = self._engine
        excess = len(engine) + len(self._engine_resident) - size
        while excess > 0:
            tick, key, run = self._oldest_engine_key()
            if key is not None:
                engine.drop(key)
                excess -= 1
            elif run is not None:
                excess -= self._drop_used_engine(run, tick, excess)
            else:
                break


class CostAwareMemoryIndex(_MemoryIndex):
    """An embedded index bounded by an estimate of the bytes it holds (see the module docstring).

    The estimate charges :data:`KEY_COST` per inline request key and :func:`estimated_entry_cost`
    per entry under it; per run :data:`RUN_COST`, :data:`RUN_POSITION_COST` per position,
    :data:`RUN_KEY_COST` per position holding entries, :data:`RUN_MAPPING_COST` per engine key
    and :func:`estimated_entry_cost` per distinct entry it holds; :data:`MAPPING_COST` per engine
    key not in a run and :data:`MAPPING_REF_COST` per request key it remembers. The number of
    entries per request key is not capped separately.
    """

    #: the ``backend`` label of metrics and traces
    backend_label = "cost_aware_memory"

    def __init__(self, config: CostAwareMemoryIndexConfig | None = None) -> None:
        cfg = CostAwareMemoryIndexConfig() if config is None else config
        if not isinstance(cfg, CostAwareMemoryIndexConfig):
            raise ConfigError(f"config must be a CostAwareMemoryIndexConfig, got {cfg!r}")
        super().__init__(None)
        self.config = cfg
        self._max_cost = cfg.max_cost()

    def max_cost(self) -> int:
        """The byte budget."""
        return self._max_cost

    def cost(self) -> int:
        """The current estimate of bytes held."""
        with self._lock:
            return self._cost + self._engine.cost

    def _shrink(self) -> None:
        engine = self._engine
        while self._cost + engine.cost > self._max_cost:
            tick, key, run = self._oldest_key()
            engine_tick, engine_key, engine_run = self._oldest_engine_key()
            if (key is not None or run is not None) and (
                (engine_key is None and engine_run is None) or tick <= engine_tick
            ):
                if key is not None:
                    self._drop_key(key)
                else:
                    assert run is not None
                    self._drop_used(run, tick, 1)
            elif engine_key is not None:
                engine.drop(engine_key)
            elif engine_run is not None:
                self._drop_used_engine(engine_run, engine_tick, 1)
            else:
                break

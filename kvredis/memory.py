"""Embedded indexes: the whole KV-block index in this process's memory.

Two backends share one implementation and differ only in how they bound their memory:

* :class:`InMemoryIndex` keeps at most ``size`` request keys and at most ``size`` engine keys
  (least recently used dropped first) and at most ``pod_cache_size`` entries per request key
  (least recently added dropped first).
* :class:`CostAwareMemoryIndex` keeps an estimate of the bytes it holds (see
  :func:`estimated_entry_cost` and the ``*_COST`` constants) under a budget such as ``"2GiB"``,
  dropping the least recently used request keys and engine keys, whichever is older, until it
  fits.

"Used" means added to, looked up with a hit (request keys) or resolved by ``get_request_key``
(engine keys). Both backends implement :class:`~kvredis.index.Index`,
:class:`~kvredis.index.BatchIndex`, :class:`~kvredis.index.ScoringIndex` and
:class:`~kvredis.index.RankScoringIndex` (``score`` and ``score_by_rank`` walk the chain once,
run of equal entries by run, racing each data-parallel rank of a pod on its own, and stop when
no (pod, rank) is left); one lock guards all state, so every method is atomic.
``scripts/bench_vs_dynamo.py`` measures ``score`` and the memory per entry against Dynamo's
in-process radix tree.

The parts, each in a module of its own: :mod:`kvredis.memory_bounds` (the configs and the
byte-cost model), :mod:`kvredis.memory_expiry` (when each expiring entry dies),
:mod:`kvredis.memory_engine` (engine key -> request keys); this module holds the request keys,
the entry records, the walks and the bounds' enforcement.

Built to cost little more than a plain dict of sets on the hot paths (``scripts/bench_memory.py``
measures the two side by side): inputs that are plain lists of ints and plain PodEntry values
are checked at C speed or in one ``type()`` test, anything else goes through the shared checks
of :mod:`kvredis.checks` (same errors as every backend); ``lookup`` checks each key as its walk
reaches it, so keys past the first miss are never read.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import fields
from itertools import groupby, repeat
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
    pod_filter,
)
from kvredis.errors import ConfigError, EngineKeyNotFoundError, InvalidInputError
from kvredis.index import ClearProgress
from kvredis.memory_bounds import (
    KEY_COST,
    CostAwareMemoryIndexConfig,
    InMemoryIndexConfig,
    estimated_entry_cost,
)
from kvredis.memory_engine import EngineTable, refs
from kvredis.memory_expiry import ExpiryTable
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

    The request keys holding it are ``count`` and a log, an ``array('Q')`` of 8 bytes per key
    (a set would take 5-6 times that): every key holding the entry is in the log, which may also
    name keys that no longer hold it (removals do not touch it) or name a key twice; whether a
    key holds the entry is read from the key's tuple. :meth:`_MemoryIndex._log_keys` compacts
    a log that has grown past twice its live keys.
    """

    __slots__ = ("alone", "cost", "count", "entry", "fields", "log")

    def __init__(self, entry: PodEntry, fields: tuple[object, ...]) -> None:
        self.entry = entry
        self.fields = fields
        self.log = array("Q")
        self.count = 0
        self.cost = estimated_entry_cost(entry)
        self.alone = (entry,)


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


_INT_ONLY = {int}
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


class _MemoryIndex:
    """The shared implementation; subclasses decide the per-key entry cap and :meth:`_shrink`.

    State: request key -> the tuple of entries it holds, oldest added first (keys holding
    just one entry share its 1-tuple, and consecutive keys an add or a removal leaves with the
    same entries share one tuple); per distinct entry a :class:`_Held` with the count and a log
    of the request keys holding it (membership tests compare identities in a key's tuple and
    ``clear(pod)`` walks the pod's logs, never comparing PodEntry values key by key); the
    engine keys in an :class:`~kvredis.memory_engine.EngineTable`; the deadlines of expiring
    entries in an :class:`~kvredis.memory_expiry.ExpiryTable`. ``_key_ticks`` and the engine
    table's ticks (last use of every key) exist only where :meth:`_shrink` weighs request keys
    against engine keys. ``_cost`` is the request keys' share of the byte estimate, the engine
    table keeps its own.
    """

    def __init__(self, entries_per_key: int | None, *, track_ticks: bool = False) -> None:
        self._lock = threading.Lock()
        self._entries_per_key = entries_per_key
        self._keys: OrderedDict[int, tuple[PodEntry, ...]] = OrderedDict()
        self._engine = EngineTable(track_ticks=track_ticks)
        self._held: dict[tuple[object, ...], _Held] = {}
        self._by_id: dict[int, _Held] = {}  # id of the stored instance -> its record
        self._pods: dict[str, set[_Held]] = {}  # so clear() is O(pod's keys)
        self._key_ticks: dict[int, int] | None = {} if track_ticks else None
        self._watermarks: dict[str, Watermark] = {}
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

        Keys are checked as the walk reaches them: a bad key past the first miss is not read.
        """
        keys = request_keys
        if type(keys) is not list and type(keys) is not tuple:
            keys = check_hashes(keys, "request key")
        pods = None if pod_identifier_set is None else pod_filter(pod_identifier_set)
        lock = self._lock
        lock.acquire()  # (a with block costs more: its special-method lookups)
        try:
            now = 0.0
            if self._expiry:
                now = time.monotonic()
                self._expire(now)
            out = None
            if pods is None and not self._expiry:
                out = self._walk_plain(keys)
            if out is None:
                out = self._walk(keys, pods, now)
            if out and self._key_ticks is not None:
                self._tick += 1
                self._key_ticks.update(dict.fromkeys(out, self._tick))
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

        Consecutive keys holding the same entries (a chain added pod by pod shares one stored
        tuple along its keys) are scored once per run. The keys where some pod is still in the
        race count as used, as a lookup's hits do; keys are checked up to where the walk stops.
        """
        scores = self._race(request_keys, medium_weights, pod_identifier_set)
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
        scores = self._race(request_keys, medium_weights, pod_identifier_set)
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

    def _race(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None,
        pod_identifier_set: Collection[str] | None,
    ) -> dict[_Racer, float]:
        """The score of every (pod, rank) in the race (see :func:`_racer`), with
        :data:`_RANKED` among the keys when some rank is not 0."""
        keys = request_keys
        if type(keys) is not list and type(keys) is not tuple:
            keys = check_hashes(keys, "request key")
        weights = score_weights(medium_weights)
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
                scores, walked = self._score_walk(keys, weights, pods, now)
            except TypeError:  # an unhashable key
                check_hashes(keys, "request key")
                raise
            reached = keys[: walked + 1]
            if set(map(type, reached)) != _INT_ONLY or not 0 <= reached[-1] <= MAX_BLOCK_HASH:
                check_hashes(reached, "request key")
            if walked:
                used = keys[:walked]
                deque(map(self._keys.move_to_end, used), 0)  # (C-level loop)
                if self._key_ticks is not None:
                    self._tick += 1
                    self._key_ticks.update(zip(used, repeat(self._tick)))
        finally:
            lock.release()
        return scores

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
            if key_type is _ENGINE and len(ents) == 1:  # the common case, in as few steps
                value = self._engine.get(key)
                if type(value) is int:
                    entry = ents[0]
                    held = self._by_id.get(id(entry))
                    if held is None or held.entry is not entry:
                        held = self._held.get(_equality_key(entry))
                    if held is not None:
                        self._drop_pair(value, held)
                    if value not in self._keys:
                        self._engine.drop(key)
                    return
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
                for key in held.log.tolist():
                    removed += self._drop_pair(key, held)
                    if not held.count:
                        break
            engine_keys = self._engine.keys()
        # As in the Redis backend, a clear also drops every engine mapping none of whose request
        # keys holds an entry, so a stale engine key no longer resolves. Like the Redis clear it
        # goes page by page, so lookups are never held up for long by a large index.
        for start in range(0, len(engine_keys), CLEAR_MAPPINGS_PER_PAGE):
            with self._lock:
                table, get = self._keys, self._engine.get
                for engine_key in engine_keys[start : start + CLEAR_MAPPINGS_PER_PAGE]:
                    value = get(engine_key)
                    if value is None or value in table:  # (an int: one request key)
                        continue
                    if type(value) is int or not any(r in table for r in refs(value)):
                        self._engine.drop(engine_key)
            if progress is not None:
                progress(min(start + CLEAR_MAPPINGS_PER_PAGE, len(engine_keys)), removed)
        return removed

    def __len__(self) -> int:
        """Number of request keys held."""
        with self._lock:
            if self._expiry.pending:
                self._expire(time.monotonic())
            return len(self._keys)

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
                    self._add(op.engine_keys, op.request_keys, op.entries)
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

    # -- internals (called with the lock held) ---------------------------------------------

    def _walk_plain(self, keys: Sequence[int]) -> dict[int, list[PodEntry]] | None:
        """The unfiltered walk over plain int keys, or ``None`` once it meets any other key
        (then :meth:`_walk` starts over and checks each key it reaches)."""
        out: dict[int, list[PodEntry]] = {}
        table = self._keys
        get, touch = table.get, table.move_to_end
        try:
            for key in keys:
                held = get(key)
                if held is None or type(key) is not int:
                    if type(key) is int and 0 <= key <= MAX_BLOCK_HASH:
                        break
                    return None
                out[key] = [*held]
                touch(key)
        except TypeError:  # an unhashable key
            return None
        return out

    def _walk(
        self, keys: Sequence[int], pods: frozenset[str] | None, now: float
    ) -> dict[int, list[PodEntry]]:
        """The walk with a pod filter, expiring entries or keys other than plain ints."""
        out: dict[int, list[PodEntry]] = {}
        table, expiry, by_id = self._keys, self._expiry, self._by_id
        get, touch = table.get, table.move_to_end
        for key in keys:
            if type(key) is not int:
                key = check_hash(key, "request key")
            held = get(key)
            if held is None:
                if not 0 <= key <= MAX_BLOCK_HASH:
                    check_hash(key, "request key")
                break
            hits = [*held] if pods is None else [e for e in held if e.pod_identifier in pods]
            if expiry:
                hits = [e for e in hits if expiry.live(key, by_id[id(e)], now)]
            if not hits:
                break
            out[key] = hits
            touch(key)
        return out

    def _score_walk(
        self,
        keys: Sequence[int],
        weights: dict[str, float],
        pods: frozenset[str] | None,
        now: float,
    ) -> tuple[dict[_Racer, float], int]:
        """The scores of the chain per (pod, rank) and how many keys of it some (pod, rank) in
        the race holds.

        Walks runs of keys with equal (live) entries: each run costs one pass over its entries
        and, per racer, one :func:`add_times`. The sums are the scorer's: a racer's score is its
        best weight at the first key, plus its best weight at every later key in key order.
        """
        stored: Iterable[tuple[PodEntry, ...] | None] = map(self._keys.get, keys)
        if self._expiry:
            stored = self._live(keys, now)
        runs = groupby(stored)
        head, run = next(runs)
        if head is None:
            return {}, 0
        scores: dict[_Racer, float] = {}
        ranked = False
        for entry in head:
            pod = entry.pod_identifier
            if pods is None or pod in pods:
                racer: _Racer = pod
                if entry.dp_rank:
                    racer, ranked = (pod, entry.dp_rank), True
                w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
                if racer not in scores or w > scores[racer]:
                    scores[racer] = w
        if not scores:
            return {}, 0
        active = dict(scores)
        walked = len([*run])
        if walked > 1:
            for racer, w in active.items():
                scores[racer] = add_times(scores[racer], w, walked - 1)
        for head, run in runs:
            if head is None:
                break
            best: dict[_Racer, float] = {}
            for entry in head:
                racer = entry.pod_identifier
                if entry.dp_rank:
                    racer = (racer, entry.dp_rank)
                if racer in active:
                    w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
                    if racer not in best or w > best[racer]:
                        best[racer] = w
            if not best:
                break
            n = len([*run])
            for racer, w in best.items():
                scores[racer] = add_times(scores[racer], w, n)
            walked += n
            active = best
        if ranked:
            scores[_RANKED] = 0.0
        return scores, walked

    def _live(self, keys: Sequence[int], now: float) -> Iterator[tuple[PodEntry, ...] | None]:
        """The entries of each key not past their deadline, ``None`` from the first key with
        none (the walk stops there)."""
        get, expiry, by_id = self._keys.get, self._expiry, self._by_id
        for key in keys:
            stored = get(key)
            if stored is not None:
                stored = tuple(
                    [e for e in stored if expiry.live(key, by_id[id(e)], now)]
                )
            yield stored or None
            if not stored:
                return

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

    def _add(
        self,
        eng: Sequence[int] | None,
        req: Sequence[int],
        ents: Sequence[PodEntry],
        deadline: float | None = None,
    ) -> None:
        if len(ents) == 1 and deadline is None and not self._expiry:
            self._add_one(req, self._intern(ents[0]))
        else:
            self._add_many(req, ents, deadline)
        self._tick += 1
        if self._key_ticks is not None:
            self._key_ticks.update(dict.fromkeys(req, self._tick))
        if eng:
            self._engine.map_all(eng, req, self._tick)
        self._shrink()

    def _add_one(self, req: Sequence[int], held: _Held) -> None:
        """Add one entry to every key of ``req`` (no expiry involved): the common event."""
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
                    elif _holds(stored, entry):  # re-added: it becomes the most recent
                        stored = (*[e for e in stored if e is not entry], entry)
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
        """Record that ``keys`` (not holding the entry before) now hold it; compact the log
        once it is over twice the live keys (amortized O(1) per key logged)."""
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
        """Add several entries, or entries that expire, or while some entries expire."""
        cap = self._entries_per_key
        unique = list(dict.fromkeys(ents))
        if cap is not None and len(unique) > cap:  # the oldest would be dropped at once
            unique = unique[-cap:]
        helds = [self._intern(e) for e in unique]
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
        """Keep the ``cap`` most recently added entries of a key."""
        for entry in stored[:-cap]:
            self._forget(key, entry)
        return stored[-cap:]

    def _evict(self, key: int, key_type: KeyType, ents: Sequence[PodEntry]) -> None:
        found: Iterable[_Held]
        if len(ents) == 1:  # the common case, without building lists
            held = self._find(ents[0])
            found = () if held is None else (held,)
        else:
            found = [h for h in map(self._find, ents) if h is not None]
        if key_type is KeyType.REQUEST:
            for held in found:
                self._drop_pair(key, held)
            return
        value = self._engine.get(key)
        if value is None:
            return
        table = self._keys
        # Empty request keys are always removed, so "holds no entry" is "is not a key".
        if type(value) is int:
            for held in found:
                self._drop_pair(value, held)
            if value not in table:
                self._engine.drop(key)
            return
        refs: tuple[int, ...] = value  # type: ignore[assignment]
        for request_key in refs:
            for held in found:
                self._drop_pair(request_key, held)
        if not any(request_key in table for request_key in refs):
            self._engine.drop(key)

    def _drop_pair(self, key: int, held: _Held) -> int:
        """Remove one entry from one key (and the key once empty); 1 if it was there, else 0."""
        table = self._keys
        stored = table.get(key)
        if not _holds(stored, held.entry):
            return 0
        assert stored is not None
        held.count -= 1
        self._cost -= held.cost
        if len(stored) == 1:  # it held only this entry
            del table[key]
            self._cost -= KEY_COST
            if self._key_ticks is not None:
                del self._key_ticks[key]
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
        """Account for a stored entry no longer under a key (the caller updates the key)."""
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

    def _drop_key(self, key: int) -> None:
        stored = self._keys.pop(key)
        self._cost -= KEY_COST
        if self._key_ticks is not None:
            del self._key_ticks[key]
        for entry in stored:
            self._forget(key, entry)

    def _shrink(self) -> None:
        raise NotImplementedError


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
        keys, engine, size = self._keys, self._engine, self._size
        while len(keys) > size:
            self._drop_key(next(iter(keys)))
        while len(engine) > size:
            self._engine.drop(engine.oldest())  # type: ignore[arg-type]


class CostAwareMemoryIndex(_MemoryIndex):
    """An embedded index bounded by an estimate of the bytes it holds (see the module docstring).

    The estimate charges :data:`KEY_COST` per request key, :func:`estimated_entry_cost` per entry
    under a key, :data:`MAPPING_COST` per engine key and :data:`MAPPING_REF_COST` per request key
    an engine key remembers. The number of entries per request key is not capped separately.
    """

    #: the ``backend`` label of metrics and traces
    backend_label = "cost_aware_memory"

    def __init__(self, config: CostAwareMemoryIndexConfig | None = None) -> None:
        cfg = CostAwareMemoryIndexConfig() if config is None else config
        if not isinstance(cfg, CostAwareMemoryIndexConfig):
            raise ConfigError(f"config must be a CostAwareMemoryIndexConfig, got {cfg!r}")
        super().__init__(None, track_ticks=True)
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
        if self._cost + engine.cost <= self._max_cost:
            return
        keys = self._keys
        key_ticks, engine_ticks = self._key_ticks, engine.ticks
        assert key_ticks is not None and engine_ticks is not None
        while self._cost + engine.cost > self._max_cost and (keys or engine):
            key = next(iter(keys), None)
            engine_key = engine.oldest()
            if key is not None and (
                engine_key is None or key_ticks[key] <= engine_ticks[engine_key]
            ):
                self._drop_key(key)
            elif engine_key is not None:
                self._engine.drop(engine_key)

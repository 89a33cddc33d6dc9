"""The public embedded indexes, :class:`InMemoryIndex` and :class:`CostAwareMemoryIndex`: the
checks of their inputs, the lock, adds, evicts, clears, expiry, and the bounds each keeps its
memory under. The top layer of the index class (see :mod:`kvredis.memory` for the design and the
layers below).

Inputs that are plain lists of ints and plain PodEntry values are checked at C speed or in one
``type()`` test, anything else goes through the shared checks of :mod:`kvredis.checks` (same
errors as every backend); walks check the keys they reach, so keys past the first miss are never
read.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import partial
from itertools import repeat

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
from kvredis.memory.bounds import (
    RUN_KEY_COST,
    RUN_MAPPING_COST,
    RUN_POSITION_COST,
    CostAwareMemoryIndexConfig,
    InMemoryIndexConfig,
)
from kvredis.memory.engine import refs
from kvredis.memory.inline import EXPIRED_PER_CALL, LOG_SLACK
from kvredis.memory.race import RANKED, Racer, best_ranks, best_weights, race
from kvredis.memory.runs import RUN_MAX, RUN_MIN, Run, span
from kvredis.memory.tables import Held
from kvredis.memory.walks import Walks, checked_reach
from kvredis.types import MAX_BLOCK_HASH, KeyType, PodEntry

__all__ = [
    "CLEAR_MAPPINGS_PER_PAGE",
    "EXPIRED_PER_CALL",
    "LOG_SLACK",
    "MAX_REQUEST_KEYS_PER_ENGINE_KEY",
    "CostAwareMemoryIndex",
    "InMemoryIndex",
]

#: Engine mappings checked per lock hold when a clear drops the mappings it left without holders.
CLEAR_MAPPINGS_PER_PAGE = 4096

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


class _MemoryIndex(Walks):
    """The shared implementation (the public face of the layers, see the module docstring);
    subclasses decide the per-key entry cap and :meth:`_shrink`."""

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
            if not checked_reach(keys, end + 1):  # int subclasses: answer with ints
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
        if RANKED in scores:
            return best_ranks(scores)
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
        scores.pop(RANKED, None)
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
    ) -> dict[Racer, float]:
        """The score of every (pod, rank) in the race, with :data:`RANKED` among the keys
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
                    best_of = partial(best_weights, weights=weights)
                    scores, used = race(self._pieces(keys, pods, now), best_of)
            except TypeError:  # an unhashable key
                check_hashes(keys, "request key")
                raise
            if used:
                i, c, _, _, _ = used[-1]
                checked_reach(keys, i + c + 1)
                self._use(keys, used)
            else:
                checked_reach(keys, 1)
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

    # -- adds, evicts and bounds (called with the lock held) -------------------------------

    def _add(
        self,
        eng: Sequence[int] | None,
        req: Sequence[int],
        ents: Sequence[PodEntry],
        deadline: float | None = None,
        *,
        parent: int | None = None,
    ) -> None:
        if len(req) > RUN_MAX and deadline is None and (not eng or len(eng) == len(req)):
            # One add per RUN_MAX keys, each naming the last key of the one before as its
            # parent: runs stay short enough to search a key in, and the keys are used in the
            # same order.
            for start in range(0, len(req), RUN_MAX):
                stop = start + RUN_MAX
                self._add(
                    eng[start:stop] if eng else None,
                    req[start:stop],
                    ents,
                    parent=req[start - 1] if start else parent,
                )
            return
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

    def _evict(self, key: int, key_type: KeyType, ents: Sequence[PodEntry]) -> None:
        found: Iterable[Held]
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

    def _remove(self, key: int, held: Held, hint: int = -1) -> int:
        """Remove one entry from one key, inline or in a run (``hint``: where in its run it
        likely is); 1 if it was there, else 0."""
        run = self._resident.get(key)
        if run is None:
            return self._drop_pair(key, held)
        if held not in run.holders:
            return 0
        return self._run_remove_at(run, run.position(key, hint), held)

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

    The estimate (the constants of :mod:`kvredis.memory.bounds`) charges ``KEY_COST`` per inline
    request key and ``estimated_entry_cost`` per entry under it; per run ``RUN_COST``,
    ``RUN_POSITION_COST`` per position, ``RUN_KEY_COST`` per position holding entries,
    ``RUN_MAPPING_COST`` per engine key and ``estimated_entry_cost`` per distinct entry it
    holds; ``MAPPING_COST`` per engine key not in a run and ``MAPPING_REF_COST`` per request key
    it remembers. The number of entries per request key is not capped separately.
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

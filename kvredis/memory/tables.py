"""The tables of an embedded index and its records of entries: the state every other part of
:mod:`kvredis.memory` reads and changes, each part a layer of the index class over this one.

The layers, each a module importing only those before it: this one (the tables, the entry
records), :mod:`kvredis.memory.inline` (keys kept one by one), :mod:`kvredis.memory.in_runs`
(keys kept in runs), :mod:`kvredis.memory.engine_keys` (engine keys, in the engine table or
beside their run's keys), :mod:`kvredis.memory.walks` (walks: lookups, scores, what they count as
used) and :mod:`kvredis.memory.index` (the public indexes, the adds, evicts, clears and
bounds). Each layer's methods run with the index's lock held.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import fields
from operator import attrgetter

from kvredis.batch import Watermark
from kvredis.memory.bounds import estimated_entry_cost
from kvredis.memory.engine import EngineTable
from kvredis.memory.expiry import ExpiryTable
from kvredis.memory.race import Best
from kvredis.memory.recency import RunOrder
from kvredis.memory.runs import Ranges, Run
from kvredis.types import PodEntry

__all__ = ["Held", "Tables", "equality_key", "holds"]


class Held:
    """One distinct entry the index holds: the one instance every key stores (equal entries
    added later resolve to it), the request keys holding it, its cost and its 1-tuple.

    ``count`` is the number of request keys holding it, inline or in runs. The runs holding it
    are ``runs`` (each run counts its positions per record); the inline keys are in ``log``, an
    ``array('Q')`` of 8 bytes per key (a set would take 5-6 times that): every inline key
    holding the entry is in the log, which may also name keys that no longer hold it (removals
    do not touch it) or name a key twice; whether a key holds the entry is read from the key's
    tuple. ``InlineKeys._log_keys`` compacts a log that has grown past twice its keys.
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


def holds(stored: tuple[PodEntry, ...] | None, entry: PodEntry) -> bool:
    """Whether a key's tuple holds this very (interned) entry instance."""
    if stored is not None:
        for held in stored:
            if held is entry:
                return True
    return False


#: The fields PodEntry equality compares, read at C speed; derived from the dataclass, so a
#: field added to PodEntry distinguishes entries here too.
_FIELDS = attrgetter(*(field.name for field in fields(PodEntry) if field.compare))


def equality_key(entry: PodEntry) -> tuple[object, ...]:
    """What PodEntry equality compares (the class and every compared field), as a tuple that
    is hashed and compared at C speed."""
    return (entry.__class__, _FIELDS(entry))


def _request_recency(run: Run) -> Ranges[int]:
    return run.recency


def _engine_recency(run: Run) -> Ranges[int] | None:
    return run.engine_recency


class Tables:
    """The state of an embedded index (see the docstring of :mod:`kvredis.memory`) and
    its entry records.

    ``_keys``: the inline request keys (key -> entries, oldest added first, in least recently
    used order) and ``_key_ticks`` (their last-use ticks); ``_resident``: the request keys in
    runs (key -> run) and ``_runs``, the live runs, with ``_order``, the order of their
    positions by last use; ``_engine``: the engine keys not in runs, ``_engine_resident`` those
    in runs (engine key -> run), ``_engine_order`` their order by last use; the entry records
    ``_held`` (by the fields equality compares), ``_by_id`` (by the id of the stored instance)
    and ``_pods`` (by pod); ``_expiry``, the deadlines of expiring entries; ``_cost``, the byte
    estimate of everything but the engine table (which keeps its own).
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
        self._held: dict[tuple[object, ...], Held] = {}
        self._by_id: dict[int, Held] = {}  # id of the stored instance -> its record
        self._pods: dict[str, set[Held]] = {}  # so clear() is O(pod's keys)
        self._watermarks: dict[str, Watermark] = {}
        # The best weights of tuples of entries scored lately (id -> the tuple, which keeps
        # the id its own, the weights and the best weights), and the weight maps seen lately.
        self._bests: dict[int, tuple[tuple[PodEntry, ...], dict[str, float], Best]]
        self._bests = {}
        self._weights_seen: dict[tuple[tuple[object, ...], ...], dict[str, float]] = {}
        self._tick = 0
        self._cost = 0
        self._expiry: ExpiryTable[Held] = ExpiryTable()
        # The last tuple an entry was removed from, the record and what was left: the next key
        # holding the same tuple gets the same tuple back (one tuple per run of a chain).
        self._shrunk: tuple[tuple[PodEntry, ...], Held | None, tuple[PodEntry, ...]] = (
            (),
            None,
            (),
        )

    def _find(self, entry: PodEntry) -> Held | None:
        """The record of the entry equal to ``entry``, if the index holds one."""
        held = self._by_id.get(id(entry))
        if held is not None and held.entry is entry:
            return held
        return self._held.get(equality_key(entry))

    def _intern(self, entry: PodEntry) -> Held:
        """:meth:`_find`, creating the record (with ``entry`` as the instance stored)."""
        held = self._find(entry)
        if held is None:
            fields = equality_key(entry)
            held = self._held[fields] = Held(entry, fields)
            self._by_id[id(entry)] = held
            pods = self._pods.get(entry.pod_identifier)
            if pods is None:
                self._pods[entry.pod_identifier] = {held}
            else:
                pods.add(held)
        return held

    def _release(self, held: Held) -> None:
        """Forget the record of an entry no key holds any more."""
        del self._held[held.fields]
        del self._by_id[id(held.entry)]
        pod = held.entry.pod_identifier
        pods = self._pods[pod]
        pods.discard(held)
        if not pods:
            del self._pods[pod]

    def _records(self, ents: Sequence[PodEntry]) -> list[Held]:
        """The records of the distinct entries of an add (the most recent ``cap`` of them)."""
        cap = self._entries_per_key
        unique = list(dict.fromkeys(ents))
        if cap is not None and len(unique) > cap:  # the oldest would be dropped at once
            unique = unique[-cap:]
        return [self._intern(e) for e in unique]

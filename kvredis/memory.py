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
(engine keys). Both backends implement :class:`~kvredis.index.Index` and
:class:`~kvredis.batch.BatchIndex`; one lock guards all state, so every method is atomic.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvredis.batch import AddOp, IndexOp, Watermark, check_batch, check_stream, check_watermark
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    check_add,
    check_entries,
    check_hash,
    check_hashes,
    check_key_type,
    check_pod_identifier,
    check_ttl,
    infer_mappings,
    pod_filter,
)
from kvredis.errors import ConfigError, EngineKeyNotFoundError, InvalidInputError
from kvredis.index import ClearProgress
from kvredis.jsonconfig import parse_size, take_fields
from kvredis.types import MAX_BLOCK_HASH, KeyType, PodEntry

#: Most expired speculative entries reclaimed per call (the rest on later calls; reads filter
#: out whatever is left past its deadline).
EXPIRED_PER_CALL = 256

#: Engine mappings checked per lock hold when a clear drops the mappings it left without holders.
CLEAR_MAPPINGS_PER_PAGE = 4096

# Byte-cost estimate of the cost-aware index: what the structures below take on 64-bit CPython
# 3.11, measured with tracemalloc. Dict growth makes the true figure swing with the number of
# keys: for 100k-400k keys and 1-10 pods the estimate is within -10%/+30% of what is allocated,
# for smaller indexes it errs high (scripts/bench_memory.py reports it, tests/test_memory.py
# checks it).
#: A request key: its int, its slot in the LRU dict and the per-key record with its tuple.
KEY_COST = 152
#: One entry under one request key (its tuple slot and per-pod bookkeeping), plus the length
#: of its two strings (see estimated_entry_cost).
ENTRY_COST = 88
#: An engine key: its int, its slot in the LRU dict and the mapping record with its tuple.
MAPPING_COST = 192
#: One request key remembered by an engine key.
MAPPING_REF_COST = 24


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class InMemoryIndexConfig:
    """Bounds of :class:`InMemoryIndex`: request keys kept, entries kept per key."""

    size: int = 100_000_000
    pod_cache_size: int = 10

    def __post_init__(self) -> None:
        _positive_int("size", self.size)
        _positive_int("pod_cache_size", self.pod_cache_size)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> InMemoryIndexConfig:
        """Build from the upstream JSON shape (``size``, ``podCacheSize``)."""
        fields = {"size": "size", "podCacheSize": "pod_cache_size"}
        return cls(**take_fields("inMemoryConfig", mapping, fields))


@dataclass(frozen=True, slots=True)
class CostAwareMemoryIndexConfig:
    """Budget of :class:`CostAwareMemoryIndex`: a human size (``"2GiB"``) or bytes."""

    size: int | str = "2GiB"

    def __post_init__(self) -> None:
        parse_size(self.size)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> CostAwareMemoryIndexConfig:
        """Build from the upstream JSON shape (``size``)."""
        return cls(**take_fields("costAwareMemoryConfig", mapping, {"size": "size"}))

    def max_cost(self) -> int:
        """The budget in bytes."""
        return parse_size(self.size)


def estimated_entry_cost(entry: PodEntry) -> int:
    """Estimated bytes of one entry stored under one request key (strings counted in full)."""
    return ENTRY_COST + len(entry.pod_identifier) + len(entry.device_tier)


class _Slot:
    """One request key: its entries, oldest added first, and when it was last used."""

    __slots__ = ("entries", "tick")

    def __init__(self, tick: int) -> None:
        self.entries: tuple[PodEntry, ...] = ()
        self.tick = tick


class _Mapping:
    """One engine key: the request keys mapped to it, most recent last, and its last use."""

    __slots__ = ("request_keys", "tick")

    def __init__(self, tick: int, request_key: int) -> None:
        self.request_keys: tuple[int, ...] = (request_key,)
        self.tick = tick


def _fast_hashes(values: Sequence[int]) -> Sequence[int] | None:
    """``values`` if it is a non-empty list or tuple of plain in-range ints, else ``None``.

    The common case of the hot paths, checked at C speed; anything else (including every bad
    input) goes through the shared checks of :mod:`kvredis.index`.
    """
    if (
        type(values) in (list, tuple)
        and values
        and set(map(type, values)) == _INT_ONLY
        and min(values) >= 0
        and max(values) <= MAX_BLOCK_HASH
    ):
        return values
    return None


_INT_ONLY = {int}


class _MemoryIndex:
    """The shared implementation; subclasses decide the per-key entry cap and :meth:`_shrink`."""

    def __init__(self, entries_per_key: int | None) -> None:
        self._lock = threading.Lock()
        self._entries_per_key = entries_per_key
        self._keys: OrderedDict[int, _Slot] = OrderedDict()
        self._engine: OrderedDict[int, _Mapping] = OrderedDict()
        # pod -> {request key: number of the pod's entries under it}, so clear() is O(pod's keys)
        self._pod_keys: dict[str, dict[int, int]] = {}
        self._watermarks: dict[str, Watermark] = {}
        self._tick = 0
        self._cost = 0
        # Speculative entries added with a ttl: (request key, entry) -> monotonic deadline, and
        # a heap of (deadline, seq, key, entry), stale once the dict holds another deadline.
        self._deadlines: dict[tuple[int, PodEntry], float] = {}
        self._expiry: list[tuple[float, int, int, PodEntry]] = []
        self._seq = 0

    # -- Index -----------------------------------------------------------------------------

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        """Entries per key along the chain, stopping at the first key no (filtered) pod holds."""
        keys = _fast_hashes(request_keys)
        if keys is None:
            keys = check_hashes(request_keys, "request key")
        pods = pod_filter(pod_identifier_set)
        out: dict[int, list[PodEntry]] = {}
        with self._lock:
            deadlines = self._deadlines
            now = 0.0
            if deadlines:
                now = time.monotonic()
                self._expire(now)
            table = self._keys
            self._tick += 1
            tick = self._tick
            for key in keys:
                slot = table.get(key)
                if slot is None:
                    break
                if pods is None:
                    hits = list(slot.entries)
                else:
                    hits = [e for e in slot.entries if e.pod_identifier in pods]
                if deadlines:
                    hits = [e for e in hits if deadlines.get((key, e), now + 1.0) > now]
                if not hits:
                    break
                out[key] = hits
                table.move_to_end(key)
                slot.tick = tick
        return out

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
        req = _fast_hashes(request_keys)
        eng = None if engine_keys is None else _fast_hashes(engine_keys)
        if req is None or (eng is None and engine_keys is not None):
            eng, req, ents = check_add(engine_keys, request_keys, entries)
        else:
            ents = check_entries(entries, for_add=True)
        seconds = check_ttl(ttl, ents)
        with self._lock:
            now = time.monotonic()
            if self._expiry:
                self._expire(now)
            self._add(eng, req, ents, None if seconds is None else now + seconds)

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """Remove exactly these entries; an engine key resolves to all its request keys."""
        k = check_hash(key, "evict key")
        kt = check_key_type(key_type)
        ents = check_entries(entries)
        with self._lock:
            if self._expiry:
                self._expire(time.monotonic())
            self._evict(k, kt, ents)

    def get_request_key(self, engine_key: int) -> int:
        """The request key most recently mapped to ``engine_key``."""
        k = check_hash(engine_key, "engine key")
        with self._lock:
            mapping = self._engine.get(k)
            if mapping is None:
                raise EngineKeyNotFoundError(k)
            self._engine.move_to_end(k)
            self._tick += 1
            mapping.tick = self._tick
            return mapping.request_keys[-1]

    def clear(self, pod_identifier: str) -> None:
        """Remove every entry of the pod, on every tier and group."""
        self.clear_with_progress(pod_identifier)

    def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int:
        """:meth:`clear`, returning the (key, entry) pairs removed.

        ``progress(done, removed)`` is called after every page of engine mappings examined.
        """
        pod = check_pod_identifier(pod_identifier)
        if progress is not None and not callable(progress):
            raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
        removed = 0
        with self._lock:
            for key in list(self._pod_keys.get(pod, ())):
                slot = self._keys[key]
                gone = [e for e in slot.entries if e.pod_identifier == pod]
                removed += len(gone)
                self._remove(key, slot, gone)
            engine_keys = list(self._engine)
        # As in the Redis backend, a clear also drops every engine mapping none of whose request
        # keys holds an entry, so a stale engine key no longer resolves. Like the Redis clear it
        # goes page by page, so lookups are never held up for long by a large index.
        for start in range(0, len(engine_keys), CLEAR_MAPPINGS_PER_PAGE):
            with self._lock:
                table, engine = self._keys, self._engine
                for engine_key in engine_keys[start : start + CLEAR_MAPPINGS_PER_PAGE]:
                    mapping = engine.get(engine_key)
                    if mapping is not None and not any(rk in table for rk in mapping.request_keys):
                        self._drop_mapping(engine_key)
            if progress is not None:
                progress(min(start + CLEAR_MAPPINGS_PER_PAGE, len(engine_keys)), removed)
        return removed

    def __len__(self) -> int:
        """Number of request keys held."""
        with self._lock:
            if self._expiry:
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
            if self._expiry:
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

    def _add(
        self,
        eng: Sequence[int] | None,
        req: Sequence[int],
        ents: Sequence[PodEntry],
        deadline: float | None = None,
    ) -> None:
        self._tick += 1
        tick = self._tick
        table = self._keys
        cap = self._entries_per_key
        added = tuple(dict.fromkeys(ents))
        # A confirmed entry of a pod replaces that pod's expiring speculative entries under
        # the key (speculative entries added without a ttl stay until evicted).
        deadlines = self._deadlines
        confirmed = {e.pod_identifier for e in added if not e.speculative} if deadlines else ()
        for key in req:
            slot = table.get(key)
            if slot is None:
                slot = table[key] = _Slot(tick)
                self._cost += KEY_COST
                held: tuple[PodEntry, ...] = ()
            else:
                table.move_to_end(key)
                slot.tick = tick
                held = slot.entries
            # Re-adding an entry refreshes it: it moves to the most recently added end.
            kept = tuple(e for e in held if e not in added) if held else ()
            if confirmed and kept:
                replaced = [
                    e for e in kept if e.pod_identifier in confirmed and (key, e) in deadlines
                ]
                if replaced:
                    for entry in replaced:
                        self._forget(key, entry)
                    kept = tuple(e for e in kept if e not in replaced)
            for entry in added:
                if entry not in held:
                    self._count(key, entry)
            merged = kept + added
            if cap is not None and len(merged) > cap:
                for entry in merged[:-cap]:
                    self._forget(key, entry)
                merged = merged[-cap:]
            slot.entries = merged
            if deadline is not None:
                self._expire_at(key, added, deadline)
            elif self._deadlines:
                for entry in added:
                    self._deadlines.pop((key, entry), None)
        if eng:
            for engine_key, request_key in infer_mappings(eng, req):
                self._map(engine_key, request_key, tick)
        self._shrink()

    def _expire_at(self, key: int, added: Sequence[PodEntry], deadline: float) -> None:
        """Give the entries just added under ``key`` (and still held) an expiry."""
        held = self._keys.get(key)
        if held is None:
            return
        for entry in added:
            if entry in held.entries:
                self._deadlines[(key, entry)] = deadline
                self._seq += 1
                heapq.heappush(self._expiry, (deadline, self._seq, key, entry))

    def _expire(self, now: float) -> None:
        """Reclaim up to :data:`EXPIRED_PER_CALL` entries whose deadline is past."""
        heap, deadlines = self._expiry, self._deadlines
        if not deadlines:
            heap.clear()
            return
        done = 0
        while heap and heap[0][0] <= now and done < EXPIRED_PER_CALL:
            deadline, _, key, entry = heapq.heappop(heap)
            if deadlines.get((key, entry)) != deadline:
                continue
            done += 1
            slot = self._keys.get(key)
            if slot is None:
                del deadlines[(key, entry)]
            else:
                self._remove(key, slot, (entry,))

    def _map(self, engine_key: int, request_key: int, tick: int) -> None:
        mapping = self._engine.get(engine_key)
        if mapping is None:
            self._engine[engine_key] = _Mapping(tick, request_key)
            self._cost += MAPPING_COST + MAPPING_REF_COST
            return
        self._engine.move_to_end(engine_key)
        mapping.tick = tick
        refs = mapping.request_keys
        if refs[-1] == request_key:
            return
        if request_key in refs:
            refs = tuple(r for r in refs if r != request_key)
        else:
            self._cost += MAPPING_REF_COST
            if len(refs) >= MAX_REQUEST_KEYS_PER_ENGINE_KEY:
                refs = refs[1:]
                self._cost -= MAPPING_REF_COST
        mapping.request_keys = (*refs, request_key)

    def _evict(self, key: int, key_type: KeyType, ents: Sequence[PodEntry]) -> None:
        table = self._keys
        if key_type is KeyType.REQUEST:
            slot = table.get(key)
            if slot is not None:
                self._remove(key, slot, ents)
            return
        mapping = self._engine.get(key)
        if mapping is None:
            return
        for request_key in mapping.request_keys:
            slot = table.get(request_key)
            if slot is not None:
                self._remove(request_key, slot, ents)
        # Empty request keys are always removed, so "holds no entry" is "is not a key".
        if not any(request_key in table for request_key in mapping.request_keys):
            self._drop_mapping(key)

    def _remove(self, key: int, slot: _Slot, gone: Sequence[PodEntry]) -> None:
        """Remove the entries in ``gone`` from a key, and the key itself once it is empty."""
        kept = []
        for entry in slot.entries:
            if entry in gone:
                self._forget(key, entry)
            else:
                kept.append(entry)
        if kept:
            if len(kept) != len(slot.entries):
                slot.entries = tuple(kept)
        else:
            del self._keys[key]
            self._cost -= KEY_COST

    def _count(self, key: int, entry: PodEntry) -> None:
        """Account for an entry newly stored under a key."""
        self._cost += estimated_entry_cost(entry)
        counts = self._pod_keys.get(entry.pod_identifier)
        if counts is None:
            self._pod_keys[entry.pod_identifier] = {key: 1}
        else:
            counts[key] = counts.get(key, 0) + 1

    def _forget(self, key: int, entry: PodEntry) -> None:
        """Account for an entry no longer stored under a key."""
        self._cost -= estimated_entry_cost(entry)
        if self._deadlines:
            self._deadlines.pop((key, entry), None)
        pod = entry.pod_identifier
        counts = self._pod_keys[pod]
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
            if not counts:
                del self._pod_keys[pod]

    def _drop_key(self, key: int) -> None:
        slot = self._keys.pop(key)
        for entry in slot.entries:
            self._forget(key, entry)
        self._cost -= KEY_COST

    def _drop_mapping(self, engine_key: int) -> None:
        mapping = self._engine.pop(engine_key)
        self._cost -= MAPPING_COST + MAPPING_REF_COST * len(mapping.request_keys)

    def _shrink(self) -> None:
        raise NotImplementedError


class InMemoryIndex(_MemoryIndex):
    """An embedded index bounded by key counts (see the module docstring)."""

    def __init__(self, config: InMemoryIndexConfig | None = None) -> None:
        cfg = InMemoryIndexConfig() if config is None else config
        if not isinstance(cfg, InMemoryIndexConfig):
            raise ConfigError(f"config must be an InMemoryIndexConfig, got {cfg!r}")
        super().__init__(cfg.pod_cache_size)
        self.config = cfg

    def _shrink(self) -> None:
        size = self.config.size
        while len(self._keys) > size:
            self._drop_key(next(iter(self._keys)))
        while len(self._engine) > size:
            self._drop_mapping(next(iter(self._engine)))


class CostAwareMemoryIndex(_MemoryIndex):
    """An embedded index bounded by an estimate of the bytes it holds (see the module docstring).

    The estimate charges :data:`KEY_COST` per request key, :func:`estimated_entry_cost` per entry
    under a key, :data:`MAPPING_COST` per engine key and :data:`MAPPING_REF_COST` per request key
    an engine key remembers. The number of entries per request key is not capped separately.
    """

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
            return self._cost

    def _shrink(self) -> None:
        keys, engine = self._keys, self._engine
        while self._cost > self._max_cost and (keys or engine):
            key = next(iter(keys), None)
            engine_key = next(iter(engine), None)
            if key is not None and (
                engine_key is None or keys[key].tick <= engine[engine_key].tick
            ):
                self._drop_key(key)
            elif engine_key is not None:
                self._drop_mapping(engine_key)

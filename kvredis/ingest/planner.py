"""Engine events → index operations, with the llm-d event-pool semantics (no I/O).

:meth:`Planner.plan` walks one decoded batch and appends :class:`~kvredis.batch.IndexOp` values
to a :class:`BatchPlan`. Resolving an engine key to its request key mostly needs no I/O (the
batch's own mappings, then the pod's :class:`EngineKeyCache`); otherwise the planner is a
generator that asks its driver (the sequencer):

* :class:`Lookup` ``(engine_key)``: send back ``Index.get_request_key``'s answer, or ``None``;
* :attr:`Barrier.FLUSH`: apply the operations planned so far before going on (a parent whose
  mapping an eviction earlier in the batch may have removed must be read after that eviction);
* :attr:`Barrier.CLEAR`: apply the operations planned so far, then clear the pod
  (``AllBlocksCleared``); the driver then calls :meth:`BatchPlan.after_clear`.

Semantics, per event in batch order:

* ``BlockStored`` → ``AddOp(engine_keys, request_keys, [PodEntry(pod, tier[, group])])``. The
  model is ``lora_name`` when present, else the endpoint's/topic's model. A non-zero parent hash
  resolves to the parent's request key; an unresolvable parent skips the event
  (``parent_misses``). ``extra_keys`` are parsed and realigned to our block size
  (:func:`kvredis.features.realign_extra_features`). With ``group_idx`` the entry is grouped and
  the :class:`~kvredis.groups.GroupCatalog` learns the group. Without a full block of tokens but
  with hashes, the event is a tier update: each engine key resolves to its request key and the
  new tier's entry is added to those keys, with no mapping.
* ``BlockRemoved`` → ``EvictOp(hash, ENGINE, [PodEntry(pod, tier[, group])])`` per hash.
* ``AllBlocksCleared`` → a clear of the pod.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvredis.batch import AddOp, EvictOp, IndexOp
from kvredis.checks import infer_mappings
from kvredis.errors import ConfigError, InvalidInputError
from kvredis.features import parse_raw_extra_keys, realign_extra_features
from kvredis.groups import GroupCatalog
from kvredis.ingest.counters import Counter
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Rejection,
    RejectReason,
)
from kvredis.types import GroupMetadata, KeyType, PodEntry

if TYPE_CHECKING:
    from kvredis.hashing import TokenProcessor

__all__ = [
    "Barrier",
    "BatchPlan",
    "EngineKeyCache",
    "Lookup",
    "PlanSteps",
    "Planner",
    "PodCaches",
]


class EngineKeyCache:
    """A bounded, thread-safe engine→request map (least recently used dropped)."""

    __slots__ = ("_data", "_limit", "_lock")

    def __init__(self, limit: int) -> None:
        self._data: OrderedDict[int, int] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, key: int) -> int | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: int, value: int) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self._limit:
                self._data.popitem(last=False)

    def pop(self, key: int) -> None:
        with self._lock:
            self._data.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class PodCaches:
    """One :class:`EngineKeyCache` per pod, filled from what this ingester stored and read."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._caches: dict[str, EngineKeyCache] = {}
        self._lock = threading.Lock()

    def get(self, pod: str) -> EngineKeyCache:
        """The pod's cache (created empty on first use)."""
        with self._lock:
            cache = self._caches.get(pod)
            if cache is None:
                cache = self._caches[pod] = EngineKeyCache(self._limit)
            return cache

    def drop(self, pod: str) -> None:
        """Forget everything cached for ``pod`` (its entries were cleared)."""
        with self._lock:
            self._caches.pop(pod, None)

    def forget_batch(self, pod: str, decoded: DecodedBatch) -> None:
        """A batch a peer applied may have changed mappings cached here: drop those."""
        cache = self.get(pod)
        for event in decoded.events:
            if isinstance(event, AllBlocksCleared):
                self.drop(pod)
                cache = self.get(pod)
            else:
                for engine_key in event.block_hashes:
                    cache.pop(engine_key)


@dataclass(frozen=True, slots=True)
class Lookup:
    """Planner request: the index's request key for ``engine_key`` (answer: int or None)."""

    engine_key: int


class Barrier(enum.Enum):
    """Planner request: apply what was planned so far (and for ``CLEAR``, clear the pod)."""

    FLUSH = "flush"
    CLEAR = "clear"


PlanSteps = Generator[Lookup | Barrier, int | None, None]
"""What :meth:`Planner.plan` returns: requests out, lookup answers in."""


class BatchPlan:
    """The operations and effects of one batch being planned (one attempt at applying it)."""

    __slots__ = (
        "batch_map",
        "cache",
        "evicted",
        "pending",
        "pending_evicts",
        "rejects",
        "stats",
    )

    def __init__(self, cache: EngineKeyCache | None) -> None:
        self.cache = cache
        """The pod's engine→request cache (None: the batch names no pod)."""
        self.pending: list[IndexOp] = []
        """Operations planned since the last barrier."""
        self.batch_map: dict[int, int] = {}
        """Engine→request mappings added by this batch so far (not yet in the pod cache)."""
        self.pending_evicts: set[int] = set()
        """Engine keys evicted by pending operations."""
        self.evicted: set[int] = set()
        """Engine keys evicted by this batch (and not re-added): the pod cache is stale there."""
        self.stats: dict[Counter, int] = {}
        """What the batch counts once it takes effect."""
        self.rejects: list[Rejection] = []
        """Events refused while planning, reported once the batch takes effect."""

    def count(self, counter: Counter, amount: int = 1) -> None:
        self.stats[counter] = self.stats.get(counter, 0) + amount

    def take(self) -> list[IndexOp]:
        """The pending operations, to be applied now as one step."""
        ops, self.pending = self.pending, []
        self.pending_evicts.clear()
        return ops

    def after_clear(self, cache: EngineKeyCache | None) -> None:
        """The pod was cleared as a step of this batch: start over from an empty cache."""
        self.cache = cache
        self.batch_map.clear()
        self.evicted.clear()
        self.pending_evicts.clear()

    def add(self, op: AddOp, mappings: list[tuple[int, int]] | None) -> None:
        self.pending.append(op)
        if mappings:
            batch_map, evicted = self.batch_map, self.evicted
            for engine_key, request_key in mappings:
                batch_map[engine_key] = request_key
                evicted.discard(engine_key)

    def evict(self, keys: Sequence[int], entries: tuple[PodEntry, ...]) -> None:
        self.pending.extend([EvictOp(key, KeyType.ENGINE, entries) for key in keys])
        batch_map = self.batch_map
        for key in keys:
            batch_map.pop(key, None)
        self.pending_evicts.update(keys)
        self.evicted.update(keys)

    def resolve(self, engine_key: int) -> Generator[Lookup | Barrier, int | None, int | None]:
        """The request key ``engine_key`` maps to, as if the batch so far were applied."""
        hit = self.batch_map.get(engine_key)
        if hit is not None:
            return hit
        if engine_key in self.evicted:
            if engine_key in self.pending_evicts:
                yield Barrier.FLUSH
            return (yield from self._lookup(engine_key, None))
        assert self.cache is not None
        cached = self.cache.get(engine_key)
        if cached is not None:
            return cached
        return (yield from self._lookup(engine_key, self.cache))

    def _lookup(
        self, engine_key: int, cache: EngineKeyCache | None
    ) -> Generator[Lookup | Barrier, int | None, int | None]:
        self.count(Counter.INDEX_LOOKUPS)
        found = yield Lookup(engine_key)
        if found is not None and cache is not None:
            cache.put(engine_key, found)
        return found

    def commit_cache(self) -> None:
        """The batch took effect: the pod cache learns its mappings and forgets its evictions."""
        self._settle_cache(took_effect=True)

    def discard_cache(self) -> None:
        """The batch may have partly applied: forget every mapping it touched."""
        self._settle_cache(took_effect=False)

    def _settle_cache(self, took_effect: bool) -> None:
        cache = self.cache
        if cache is None:
            return
        for engine_key in self.evicted:
            cache.pop(engine_key)
        for engine_key, request_key in self.batch_map.items():
            if took_effect:
                cache.put(engine_key, request_key)
            else:
                cache.pop(engine_key)


_ENTRY_CACHE_LIMIT = 4096


class Planner:
    """Turns decoded batches into index operations for one token processor."""

    def __init__(
        self, token_processor: TokenProcessor, catalog: GroupCatalog, caches: PodCaches
    ) -> None:
        self.token_processor = token_processor
        self.catalog = catalog
        self.caches = caches
        self.block_size = int(token_processor.block_size())
        if self.block_size <= 0:
            raise ConfigError(f"token processor block size must be > 0, got {self.block_size}")
        self._entries: dict[tuple[str, str, int | None], PodEntry] = {}

    def plan(
        self, plan: BatchPlan, decoded: DecodedBatch, pod: str, model: str | None
    ) -> PlanSteps:
        """Plan every event of ``decoded`` for ``pod`` into ``plan``; see the module docstring."""
        for position, event in enumerate(decoded.events):
            if isinstance(event, BlockStored):
                yield from self._stored(plan, event, pod, model, position)
            elif isinstance(event, BlockRemoved):
                self._removed(plan, event, pod, position)
            elif isinstance(event, AllBlocksCleared):
                yield Barrier.CLEAR
                plan.count(Counter.EVENTS_APPLIED)

    def _entry(
        self, plan: BatchPlan, pod: str, tier: str, group: int | None, position: int
    ) -> PodEntry | None:
        key = (pod, tier, group)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        try:
            if group is None:
                entry = PodEntry(pod, tier)
            else:
                entry = PodEntry(pod, tier, has_group=True, group_idx=group)
        except InvalidInputError as exc:
            plan.rejects.append(Rejection(RejectReason.BAD_FIELD_VALUE, str(exc), position))
            return None
        if len(self._entries) >= _ENTRY_CACHE_LIMIT:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _stored(
        self, plan: BatchPlan, ev: BlockStored, pod: str, model: str | None, position: int
    ) -> PlanSteps:
        entry = self._entry(plan, pod, ev.tier, ev.group_idx, position)
        if entry is None:
            return
        if ev.group_idx is not None:
            self.catalog.learn(
                pod,
                ev.group_idx,
                GroupMetadata(
                    ev.kv_cache_spec_kind or "", ev.block_size, ev.kv_cache_spec_sliding_window
                ),
            )
        blocks = len(ev.token_ids) // self.block_size
        if blocks == 0:
            if ev.block_hashes:
                yield from self._tier_update(plan, ev, entry)
            return
        model_name = ev.lora_name or model
        if not model_name:
            plan.rejects.append(
                Rejection(RejectReason.NO_MODEL, "no model name for hashing", position)
            )
            return
        parent = 0
        if ev.parent_block_hash:
            found = yield from plan.resolve(ev.parent_block_hash)
            if found is None:
                plan.count(Counter.PARENT_MISSES)
                return
            parent = found
        features = None
        if ev.extra_keys is not None:
            try:
                parsed = parse_raw_extra_keys(list(ev.extra_keys))
            except (ValueError, TypeError) as exc:
                plan.rejects.append(Rejection(RejectReason.BAD_EXTRA_KEYS, str(exc), position))
                return
            features = realign_extra_features(parsed, blocks)
        try:
            request_keys = self.token_processor.tokens_to_kv_block_keys(
                parent, ev.token_ids, model_name, features
            )
        except (ValueError, TypeError) as exc:
            plan.rejects.append(Rejection(RejectReason.HASHING_FAILED, str(exc), position))
            return
        if not request_keys:
            return
        request = tuple(request_keys)
        mappings = infer_mappings(ev.block_hashes, request) if ev.block_hashes else None
        plan.add(AddOp(ev.block_hashes, request, (entry,)), mappings)
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_STORED, len(ev.block_hashes))
        plan.count(Counter.REQUEST_KEYS_STORED, len(request))

    def _tier_update(self, plan: BatchPlan, ev: BlockStored, entry: PodEntry) -> PlanSteps:
        resolved: list[int] = []
        seen: set[int] = set()
        for engine_key in ev.block_hashes:
            request_key = yield from plan.resolve(engine_key)
            if request_key is not None and request_key not in seen:
                seen.add(request_key)
                resolved.append(request_key)
        if not resolved:
            plan.count(Counter.TIER_UPDATE_MISSES)
            return
        plan.add(AddOp(None, tuple(resolved), (entry,)), None)
        plan.count(Counter.TIER_UPDATES)
        plan.count(Counter.EVENTS_APPLIED)

    def _removed(self, plan: BatchPlan, ev: BlockRemoved, pod: str, position: int) -> None:
        entry = self._entry(plan, pod, ev.tier, ev.group_idx, position)
        if entry is None:
            return
        plan.evict(ev.block_hashes, (entry,))
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_REMOVED, len(ev.block_hashes))

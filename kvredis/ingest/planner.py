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
  tier is :attr:`Planner.tiers` applied to ``(medium, locality, ownership)``
  (:mod:`kvredis.tiers`), so a remote copy is an entry of its own. The hashing model is
  ``lora_name`` when present, else the endpoint's/topic's model. ``extra_keys`` are decoded by
  :func:`kvredis.features.split_extra_keys` (the LoRA name is dropped, the cache salt taken
  apart, the rest are block features). With ``group_idx`` the entry is grouped and the
  :class:`~kvredis.groups.GroupCatalog` learns the group. An event without token ids but with
  hashes is a tier update: each engine key resolves to its request key and the new tier's entry
  is added to those keys, with no mapping.
* ``BlockRemoved`` → ``EvictOp(hash, ENGINE, [PodEntry(pod, tier[, group])])`` per hash.
* ``AllBlocksCleared`` → a clear of the pod.

Chains. An event without a parent starts a chain at the model's root, salted by its cache salt
(SGLang's ``cache_salt`` field, or the salt in vLLM's first-block extra keys). An event with a
parent continues where the parent's chain ended: usually at a full index block (the parent's
engine key maps to that block's request key), but when engine blocks are smaller than index
blocks (SGLang's page size 1, vLLM's 16-token blocks under a 64-token index) a chain can end
mid-block. The planner then keeps a :class:`Tail` for the chain's last engine key: the request
key of the last full block (or the root's model and salt), the tokens past it and their
multimodal identifiers, and the engine keys holding them. The next event is hashed on from
there, so a prompt gets every full block's key however the engine cuts it into events (40+24,
7+20+37, one page at a time). An index block's engine keys are exactly the engine blocks that
hold its tokens (a tail's engine keys included), so removing any of them removes the block.

Tails are bounded: at most :data:`MAX_TAILS_PER_POD` (or ``parent_cache_size`` if smaller) per
pod, least recently used dropped, each under one index block of tokens. HA replicas agree
because a tail is a function of the event stream alone: every replica that sees a batch records
the same tails, whether it applies the batch or finds that a peer did
(:meth:`PodCaches.forget_batch` learns them then, without hashing: the base of a learned tail is
read from the index when used, through an engine key of the last full block that no later block
maps again). When a parent's tail is unknown (the replica never saw the parent's batch, a
restart, the tail was dropped) and its engine key maps to no full block, the event is skipped
and counted in ``parent_misses``: an ingester never guesses, so every key any replica writes is
the key a router computes. A shorter event that continues nothing known and names known engine
keys is taken as a tier update, as before.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvredis.batch import AddOp, EvictOp, IndexOp
from kvredis.checks import infer_mappings
from kvredis.errors import ConfigError, InvalidInputError
from kvredis.features import (
    BlockExtraFeatures,
    ExtraKeys,
    MMHash,
    realign_extra_features,
    split_extra_keys,
)
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
from kvredis.tiers import DEFAULT_TIERS, TierMap
from kvredis.types import GroupMetadata, KeyType, PodEntry

if TYPE_CHECKING:
    from kvredis.hashing import TokenProcessor

__all__ = [
    "MAX_TAILS_PER_POD",
    "Barrier",
    "BatchPlan",
    "EngineKeyCache",
    "Lookup",
    "PlanSteps",
    "Planner",
    "PodCaches",
    "Tail",
]


MAX_TAILS_PER_POD = 32_768
"""Chain ends remembered per pod (fewer when the engine-key cache is smaller): each holds less
than one index block of tokens, a few hundred bytes."""


@dataclass(frozen=True, slots=True)
class Tail:
    """Where a stored chain ends mid-block: what the next event needs to continue it exactly.

    ``base`` is the request key of the chain's last full block (0: the chain has none yet, it
    continues from the root of ``model`` under ``cache_salt``; a ``model`` of ``None`` is the
    endpoint's model); ``tokens`` are the tokens past it (fewer than one block), ``ids`` the
    multimodal identifiers of the engine blocks holding them, ``engine_keys`` those engine
    blocks (mapped to the block they complete). A tail learned from a batch a peer applied has
    ``base_engine_key`` instead of ``base``: the engine key whose mapping in the index is the
    base (the engine block holding the last token of the last full block).
    """

    base: int
    model: str | None
    cache_salt: str | None
    tokens: tuple[int, ...] = ()
    ids: tuple[MMHash, ...] = ()
    engine_keys: tuple[int, ...] = ()
    base_engine_key: int | None = None


class EngineKeyCache:
    """What one ingester knows of a pod's engine keys, bounded and thread-safe (least recently
    used dropped): engine→request mappings, and the :class:`Tail` of chains that end mid-block.
    """

    __slots__ = ("_data", "_limit", "_lock", "_tails")

    def __init__(self, limit: int) -> None:
        self._data: OrderedDict[int, int] = OrderedDict()
        self._tails: OrderedDict[int, Tail] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def get_tail(self, key: int) -> Tail | None:
        with self._lock:
            tail = self._tails.get(key)
            if tail is not None:
                self._tails.move_to_end(key)
            return tail

    def pop_tail(self, key: int) -> None:
        with self._lock:
            self._tails.pop(key, None)

    def put_tail(self, key: int, tail: Tail) -> None:
        with self._lock:
            self._tails[key] = tail
            self._tails.move_to_end(key)
            if len(self._tails) > min(self._limit, MAX_TAILS_PER_POD):
                self._tails.popitem(last=False)

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
            self._tails.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class PodCaches:
    """One :class:`EngineKeyCache` per pod, filled from what this ingester stored and read."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._caches: dict[str, EngineKeyCache] = {}
        self._lock = threading.Lock()
        self.block_size: int | None = None
        """The index block size, set by the :class:`Planner` using these caches: with it,
        :meth:`forget_batch` learns the tails of the chains a peer's batch extended."""

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
        """A batch a peer applied may have changed mappings cached here: drop those, and learn
        the tails of the chains it extended (their bases are read from the index when used), so
        that this replica continues them exactly as the peer would."""
        cache = self.get(pod)
        for event in decoded.events:
            if isinstance(event, AllBlocksCleared):
                self.drop(pod)
                cache = self.get(pod)
                continue
            prior = None
            if isinstance(event, BlockStored) and event.parent_block_hash:
                prior = cache.get_tail(event.parent_block_hash)
            for engine_key in event.block_hashes:
                cache.pop(engine_key)
            if isinstance(event, BlockStored) and self.block_size is not None:
                _learn_tail(cache, event, prior, self.block_size)


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
        "batch_tails",
        "cache",
        "evicted",
        "pending",
        "pending_evicts",
        "rejects",
        "stale_tails",
        "stats",
    )

    def __init__(self, cache: EngineKeyCache | None) -> None:
        self.cache = cache
        """The pod's engine→request cache (None: the batch names no pod)."""
        self.pending: list[IndexOp] = []
        """Operations planned since the last barrier."""
        self.batch_map: dict[int, int] = {}
        """Engine→request mappings added by this batch so far (not yet in the pod cache)."""
        self.batch_tails: dict[int, Tail] = {}
        """Chain tails recorded by this batch so far (not yet in the pod cache)."""
        self.stale_tails: set[int] = set()
        """Engine keys stored again by this batch: their cached tails no longer hold."""
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
        self.batch_tails.clear()
        self.stale_tails.clear()
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
        batch_map, batch_tails = self.batch_map, self.batch_tails
        for key in keys:
            batch_map.pop(key, None)
            batch_tails.pop(key, None)
        self.pending_evicts.update(keys)
        self.evicted.update(keys)

    def put_tail(self, engine_key: int, tail: Tail) -> None:
        self.batch_tails[engine_key] = tail
        self.stale_tails.discard(engine_key)
        self.evicted.discard(engine_key)

    def tail(self, engine_key: int) -> Tail | None:
        """The tail of the chain ending at ``engine_key``, as if the batch so far were applied."""
        hit = self.batch_tails.get(engine_key)
        if hit is not None or self.cache is None:
            return hit
        if engine_key in self.evicted or engine_key in self.stale_tails:
            return None
        return self.cache.get_tail(engine_key)

    def drop_tails(self, engine_keys: Sequence[int]) -> None:
        """These engine keys were stored again: a chain end recorded for them is stale."""
        for key in engine_keys:
            self.batch_tails.pop(key, None)
        self.stale_tails.update(engine_keys)

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
        for engine_key in self.stale_tails:
            cache.pop_tail(engine_key)
        for engine_key, request_key in self.batch_map.items():
            if took_effect:
                cache.put(engine_key, request_key)
            else:
                cache.pop(engine_key)
        for engine_key, tail in self.batch_tails.items():
            if took_effect:
                cache.put_tail(engine_key, tail)
            else:
                cache.pop(engine_key)


_ENTRY_CACHE_LIMIT = 4096


def _engine_spans(n_tokens: int, n_hashes: int, block_size: int) -> list[tuple[int, int]]:
    """The token range ``[start, end)`` of each of an event's engine blocks.

    The tokens split evenly over the hashes when they can (SGLang coalesces pages into one
    event; vLLM's partial-block events); otherwise each hash covers ``block_size`` tokens and
    the last one the rest.
    """
    if n_hashes == 0:
        return []
    size = n_tokens // n_hashes if n_tokens % n_hashes == 0 else max(block_size, 1)
    return [(min(i * size, n_tokens), min((i + 1) * size, n_tokens)) for i in range(n_hashes)]


def _continued(acc: list[MMHash], ids: list[MMHash]) -> int:
    """Length of the longest suffix of ``acc`` that is a prefix of ``ids`` (an item running on
    from one engine block into the next counts once)."""
    for size in range(min(len(acc), len(ids)), 0, -1):
        if acc[-size:] == ids[:size]:
            return size
    return 0


def _extra_keys(ev: BlockStored) -> ExtraKeys:
    """``ev.extra_keys`` decoded (raises InvalidInputError when malformed)."""
    return split_extra_keys(
        None if ev.extra_keys is None else list(ev.extra_keys),
        lora_name=ev.lora_name,
        chain_start=not ev.parent_block_hash,
    )


def _learn_tail(cache: EngineKeyCache, ev: BlockStored, prior: Tail | None, bs: int) -> None:
    """Record the tail ``ev`` leaves (a peer applied it), without hashing or I/O."""
    if not ev.token_ids or not ev.block_hashes:
        return
    try:
        extra = _extra_keys(ev)
    except (ValueError, TypeError):
        return
    if not ev.parent_block_hash:
        prior = Tail(0, ev.lora_name, ev.cache_salt or extra.cache_salt)
    elif prior is None:  # where the parent's chain ended is unknown here: learn nothing
        return
    step = _advance(prior, ev, extra.features, bs)
    if step.full and step.last_engine_key is None:
        return  # no engine key names the new base for sure: learn nothing
    cache.put_tail(ev.block_hashes[-1], step.after(prior, 0, step.last_engine_key))


@dataclass(frozen=True, slots=True)
class _Step:
    """How one ``BlockStored`` event extends a chain, computed without hashing."""

    full: int
    """Index blocks the event completes."""
    chain: tuple[int, ...]
    """Their tokens (the previous tail's first)."""
    feats: list[BlockExtraFeatures | None] | None
    """Their features."""
    groups: list[tuple[int, ...]] | None
    """Per completed block, the engine keys holding its tokens; ``None``: the event covers
    whole index blocks and the index maps its engine keys by length ratio."""
    tokens: tuple[int, ...]
    ids: tuple[MMHash, ...]
    engine_keys: tuple[int, ...]
    """The tail after the event: its tokens, their identifiers and engine keys."""
    last_engine_key: int | None
    """An engine key whose most recent mapping is the last completed block's request key, now
    and after any later event (``None`` when the event has no such key)."""

    def after(self, tail: Tail, base: int, base_engine_key: int | None) -> Tail:
        """The tail after the event, continuing from ``base`` (or ``base_engine_key``'s mapping)
        when the event completes a block, else from where ``tail`` did."""
        if not self.full:
            base, base_engine_key = tail.base, tail.base_engine_key
        return Tail(
            base,
            tail.model,
            tail.cache_salt,
            self.tokens,
            self.ids,
            self.engine_keys,
            base_engine_key,
        )


def _advance(
    tail: Tail, ev: BlockStored, features: list[BlockExtraFeatures | None] | None, bs: int
) -> _Step:
    offset = len(tail.tokens)
    tokens = ev.token_ids
    n = len(tokens)
    full = (offset + n) // bs
    hashes = ev.block_hashes
    spans = _engine_spans(n, len(hashes), ev.block_size)
    # Extra keys come one per engine block; a list of another length is spread over the
    # index blocks as a whole (from a block boundary), or else evenly over the tokens.
    fspans = spans
    realigned: list[BlockExtraFeatures | None] | None = None
    if features is not None and len(features) != len(spans):
        if offset == 0:
            realigned = realign_extra_features(features, full) if full else None
            features = None
        else:
            fspans = _engine_spans(n, len(features), ev.block_size)

    def overlapping(lo: int, hi: int, over: list[tuple[int, int]]) -> list[int]:
        """Engine blocks (indexes into ``over``) holding any event token in ``[lo, hi)``."""
        return [i for i, (s, e) in enumerate(over) if s < hi and e > lo]

    def ids_of(lo: int, hi: int, head: tuple[MMHash, ...]) -> list[MMHash]:
        out = list(head)
        if features is None or lo >= hi:
            return out
        prev: list[MMHash] = list(head)
        for i in overlapping(lo, hi, fspans):
            feat = features[i]
            cur = list(feat.mm_hashes) if feat is not None else []
            out.extend(cur[_continued(prev, cur) :])
            prev = cur
        return out

    block_ranges = [(max(j * bs - offset, 0), (j + 1) * bs - offset) for j in range(full)]
    block_feats: list[BlockExtraFeatures | None] = []
    for j, (lo, hi) in enumerate(block_ranges):
        ids = ids_of(lo, hi, tail.ids if j == 0 else ())
        block_feats.append(BlockExtraFeatures(ids) if ids else None)
    rest_lo = max(full * bs - offset, 0)
    rest = overlapping(rest_lo, n, spans)
    if full:
        tail_tokens = tuple(tokens[rest_lo:])
        tail_ids = tuple(ids_of(rest_lo, n, ()))
        tail_keys = tuple(hashes[i] for i in rest)
    else:
        tail_tokens = tail.tokens + tuple(tokens)
        tail_ids = tuple(ids_of(rest_lo, n, tail.ids))
        tail_keys = tail.engine_keys + tuple(hashes[i] for i in rest)
    groups: list[tuple[int, ...]] | None = None
    last_engine_key: int | None = None
    if full and hashes:
        if offset or tail_tokens:
            groups = [
                (tail.engine_keys if j == 0 else ())
                + tuple(hashes[i] for i in overlapping(lo, hi, spans))
                for j, (lo, hi) in enumerate(block_ranges)
            ]
            # An engine block ending inside the last full block maps to it last, and no later
            # block claims it (only the engine blocks of a tail are mapped again).
            inside = [i for i, (_, e) in enumerate(spans) if rest_lo - bs < e <= rest_lo]
            last_engine_key = hashes[inside[-1]] if inside else None
        else:
            last_engine_key = hashes[-1]  # the ratio mapping maps it to the last block, last
    return _Step(
        full,
        tail.tokens + tuple(tokens[:rest_lo]),
        block_feats if any(f is not None for f in block_feats) else realigned,
        groups,
        tail_tokens,
        tail_ids,
        tail_keys,
        last_engine_key,
    )


class Planner:
    """Turns decoded batches into index operations for one token processor."""

    def __init__(
        self,
        token_processor: TokenProcessor,
        catalog: GroupCatalog,
        caches: PodCaches,
        *,
        tiers: TierMap = DEFAULT_TIERS,
    ) -> None:
        self.token_processor = token_processor
        self.catalog = catalog
        self.caches = caches
        self.tiers = tiers
        """How an event's medium, locality and ownership name the entry's device tier."""
        self.block_size = int(token_processor.block_size())
        if self.block_size <= 0:
            raise ConfigError(f"token processor block size must be > 0, got {self.block_size}")
        caches.block_size = self.block_size
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
        tier = self.tiers.tier(ev.medium, ev.locality, ev.ownership)
        entry = self._entry(plan, pod, tier, ev.group_idx, position)
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
        if not ev.token_ids:
            if ev.block_hashes:
                yield from self._tier_update(plan, ev, entry)
            return
        model_name = ev.lora_name or model
        if not model_name:
            plan.rejects.append(
                Rejection(RejectReason.NO_MODEL, "no model name for hashing", position)
            )
            return
        chain_start = not ev.parent_block_hash
        try:
            extra = _extra_keys(ev)
        except (ValueError, TypeError) as exc:
            plan.rejects.append(Rejection(RejectReason.BAD_EXTRA_KEYS, str(exc), position))
            return
        if chain_start:
            tail = Tail(0, model_name, ev.cache_salt or extra.cache_salt)
        else:
            parent = ev.parent_block_hash
            assert parent is not None
            known = plan.tail(parent)
            if known is not None and known.base_engine_key is not None:
                base = yield from plan.resolve(known.base_engine_key)
                if base is None:
                    plan.count(Counter.PARENT_MISSES)
                    return
                known = dataclasses.replace(known, base=base, base_engine_key=None)
            if known is not None:
                tail = dataclasses.replace(known, model=known.model or model_name)
            else:
                found = yield from plan.resolve(parent)
                if found is None:
                    if len(ev.token_ids) < self.block_size and ev.block_hashes:
                        yield from self._tier_update(plan, ev, entry)
                    else:
                        plan.count(Counter.PARENT_MISSES)
                    return
                tail = Tail(found, model_name, None)
        try:
            request, groups, after = self._continue(tail, ev, extra.features)
        except (ValueError, TypeError) as exc:
            plan.rejects.append(Rejection(RejectReason.HASHING_FAILED, str(exc), position))
            return
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_STORED, len(ev.block_hashes))
        self._add(plan, ev, entry, request, groups, tail.base or None)
        if ev.block_hashes:
            plan.drop_tails(ev.block_hashes[:-1])
            plan.put_tail(ev.block_hashes[-1], after)

    def _add(
        self,
        plan: BatchPlan,
        ev: BlockStored,
        entry: PodEntry,
        request: tuple[int, ...],
        groups: list[tuple[tuple[int, ...], int]] | None,
        parent: int | None,
    ) -> None:
        """Add ``request`` (following ``parent``, the request key the chain continues from)."""
        if not request:
            return
        if groups is None:
            engine = ev.block_hashes or None
            mappings = infer_mappings(ev.block_hashes, request) if ev.block_hashes else None
            plan.add(AddOp(engine, request, (entry,), parent), mappings)
        else:
            for engine_keys, request_key in groups:
                plan.add(
                    AddOp(engine_keys or None, (request_key,), (entry,), parent),
                    [(e, request_key) for e in engine_keys],
                )
                parent = request_key
        plan.count(Counter.REQUEST_KEYS_STORED, len(request))

    def _continue(
        self, tail: Tail, ev: BlockStored, features: list[BlockExtraFeatures | None] | None
    ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]] | None, Tail]:
        """Hash ``ev`` on from ``tail`` (whose base is known): its request keys, the engine keys
        of each (``None`` when the engine's blocks line up so the index infers them) and the
        tail after it."""
        step = _advance(tail, ev, features, self.block_size)
        request: tuple[int, ...] = ()
        model = tail.model
        assert model is not None, "a continued tail names its model"
        if step.full:
            tp = self.token_processor
            if tail.base:
                keys = tp.tokens_to_kv_block_keys(tail.base, step.chain, model, step.feats)
            elif tail.cache_salt:
                keys = tp.tokens_to_kv_block_keys(
                    0, step.chain, model, step.feats, cache_salt=tail.cache_salt
                )
            else:
                keys = tp.tokens_to_kv_block_keys(0, step.chain, model, step.feats)
            request = tuple(keys)
        after = step.after(tail, request[-1] if request else tail.base, None)
        if step.groups is None:
            return request, None, after
        return request, [(g, r) for g, r in zip(step.groups, request, strict=True)], after

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
        tier = self.tiers.tier(ev.medium, ev.locality, ev.ownership)
        entry = self._entry(plan, pod, tier, ev.group_idx, position)
        if entry is None:
            return
        plan.evict(ev.block_hashes, (entry,))
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_REMOVED, len(ev.block_hashes))

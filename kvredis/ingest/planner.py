"""Engine events → index operations, with the llm-d event-pool semantics (no I/O).

:meth:`Planner.plan` walks one decoded batch and appends :class:`~kvredis.batch.IndexOp` values
to a :class:`BatchPlan`. Resolving an engine key to its request key mostly needs no I/O (the
batch's own mappings, then the pod's :class:`EngineKeyCache`); otherwise the planner is a
generator that asks its driver (the sequencer):

* :class:`Lookup` ``(engine_key)``: send back ``Index.get_request_key``'s answer, or ``None``;
* :attr:`Barrier.FLUSH`: apply the operations planned so far before going on (a parent whose
  mapping an eviction earlier in the batch may have removed must be read after that eviction);
* :class:`Reset` ``(dp_rank, device_tiers)``: apply the operations planned so far, then clear
  the pod's entries of that rank on those tiers (``AllBlocksCleared``); the driver then calls
  :meth:`BatchPlan.after_clear`.

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
* ``AllBlocksCleared`` → a clear of the pod's entries of the batch's rank on the tiers a prefix
  cache reset covers (:attr:`Planner.reset_tiers`).

Data parallelism. Every entry carries the batch's ``data_parallel_rank`` (``dp_rank``, 0 when
unset): ranks of one pod hold their copies on their own, so one rank's removal or reset leaves
the others' entries (same pod, so scores and filters fold them into the pod).

Offloaded chunks. With :attr:`Planner.offload_blocks_per_chunk` above 1, a tier update of
vLLM's offloading placeholder shape (``block_size`` 0, each hash the last block of a chunk)
credits the chunk's blocks back through the parents the engine's events named, and maps the
chunk's :func:`chunk_engine_key` to them; a removal on any tier also evicts through that key.

KV-cache groups. The engine keys of group ``g >= 1`` are mapped under
:func:`group_engine_key` (hybrid models' groups publish the same hashes for blocks of different
sizes): a group's removal resolves to exactly the request keys that group's block covered.

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

Branches. A parent can also be a page in the middle of an event (SGLang splits a radix node
where a second request diverges, publishes nothing for the split, and hangs the new node from
the page at the split). So the planner also keeps, for every other page ending inside an index
block, a :class:`Cut`: that page's position in a record of its block (the request key of the
block before, the block's tokens, identifiers and engine keys) that all the block's pages share.
A page's own mapping names the block holding its tokens, which is the right base only for a page
ending at the block's end; with pages finer than blocks (:func:`fine_pages`) such a page is also
mapped under its :func:`boundary_key`, and a parent without a tail or cut resolves through that
key alone, so a page inside a block is never taken for a block's end.

Tails and cuts are bounded per pod, least recently used dropped: at most
:data:`MAX_TAILS_PER_POD` chain ends (or ``parent_cache_size`` if smaller) and
``partial_block_pages`` cuts. HA replicas agree because tails and cuts are a function of the
event stream alone: every replica that sees a batch records the same ones, whether it applies
the batch or finds that a peer did (:meth:`PodCaches.forget_batch` learns them then, without
hashing: the base of a learned record is read from the index when used, through the boundary key
of the page that completed the block before, or for whole-block pages an engine key of that
block that no later block maps again). When a parent is unknown (the replica never saw the
parent's batch, a restart, the record was dropped) and it is not a block's end the index knows,
the event is skipped and counted in ``parent_misses``: an ingester never guesses, so every key
any replica writes is the key a router computes. A shorter event of whole-block pages that
continues nothing known and names known engine keys is taken as a tier update, as before (not
one of finer pages: their mappings name blocks the pod may hold only part of).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import threading
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

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
from kvredis.ingest.config import DEFAULT_RESET_MEDIUMS
from kvredis.ingest.counters import Counter
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Event,
    Rejection,
    RejectReason,
)
from kvredis.tiers import DEFAULT_TIERS, TierMap
from kvredis.types import GroupMetadata, KeyType, PodEntry

if TYPE_CHECKING:
    from kvredis.hashing import TokenProcessor

__all__ = [
    "DEFAULT_PARTIAL_BLOCK_PAGES",
    "MAX_TAILS_PER_POD",
    "Barrier",
    "BatchPlan",
    "Cut",
    "EngineKeyCache",
    "Lookup",
    "PlanSteps",
    "Planner",
    "PodCaches",
    "Reset",
    "Tail",
    "boundary_key",
    "chunk_engine_key",
    "fine_pages",
    "group_engine_key",
]


MAX_TAILS_PER_POD = 32_768
"""Chain ends remembered per pod (fewer when the engine-key cache is smaller): each holds less
than one index block of tokens, a few hundred bytes."""

DEFAULT_PARTIAL_BLOCK_PAGES = 65_536
"""Default of ``IngesterConfig.partial_block_pages``: other engine pages ending inside an index
block remembered per pod (the pages a branch may hang from), about 300 bytes each."""

_MASK64 = (1 << 64) - 1
_BOUNDARY_TAG = 0x6B7672656469732D  # "kvredis-"


def boundary_key(engine_key: int) -> int:
    """The engine key under which the index maps the block that page ``engine_key`` completes.

    Engines whose pages are smaller than the index block (SGLang page size 1..8, vLLM 16-token
    blocks under a 64-token index) map every page to the index block holding its tokens, so a
    page's own mapping cannot tell whether a chain may continue right after it. A page ending
    exactly at a block boundary is also mapped under this derived key (one more mapping per
    index block); a parent page whose derived key is not mapped ends inside a block, and a
    child hangs from it exactly only if this ingester remembers that block's tokens. The
    derivation is the splitmix64 finalizer of ``engine_key`` xor a fixed tag (a bijection on
    64 bits; a derived key equal to an engine page's hash is a 2^-64 accident).
    """
    z = ((engine_key ^ _BOUNDARY_TAG) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def fine_pages(engine_block_size: int, block_size: int) -> bool:
    """Whether an engine's pages (``engine_block_size`` tokens) can end inside an index block."""
    return engine_block_size <= 0 or engine_block_size % block_size != 0


def group_engine_key(engine_key: int, group_idx: int | None) -> int:
    """The key under which the index maps an engine key of KV-cache group ``group_idx``.

    Groups of a hybrid model publish the same engine hashes for different spans of tokens
    (vLLM's 32-token group reuses the hash of every second 16-token block), so a mapping shared
    by all groups would let one group's removal take away what another group's block covered.
    Group 0 and ungrouped events keep the engine key itself; group ``g >= 1`` maps it under a
    64-bit BLAKE2b digest of ``(engine_key, g)``, a key space of its own.
    """
    if not group_idx:
        return engine_key
    digest = hashlib.blake2b(
        engine_key.to_bytes(8, "big") + group_idx.to_bytes(4, "big"),
        digest_size=8,
        person=b"kvredis-group",
    ).digest()
    return int.from_bytes(digest, "big")


def chunk_engine_key(offload_key: int, tier: str) -> int:
    """The engine key under which the index maps an offloaded chunk on ``tier``, named by
    ``offload_key`` (its last block's engine key), to the request keys of all its blocks: a
    64-bit BLAKE2b digest of both, a key space of its own. The chunk's removal from that tier
    evicts through it, so it takes away exactly what its store credited, whichever ingester
    stored it (and a removal on another tier, the GPU's, is not widened)."""
    digest = hashlib.blake2b(
        offload_key.to_bytes(8, "big") + tier.encode("utf-8", "surrogatepass"),
        digest_size=8,
        person=b"kvredis-chunk",
    ).digest()
    return int.from_bytes(digest, "big")


def _group_keyed(event: Event) -> Event:
    """``event`` with its engine keys (and parent) in its group's key space."""
    if isinstance(event, AllBlocksCleared) or not event.group_idx:
        return event
    group = event.group_idx
    hashes = tuple(group_engine_key(h, group) for h in event.block_hashes)
    if isinstance(event, BlockRemoved):
        return dataclasses.replace(event, block_hashes=hashes)
    parent = event.parent_block_hash
    return dataclasses.replace(
        event,
        block_hashes=hashes,
        parent_block_hash=group_engine_key(parent, group) if parent else parent,
    )


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


class Cut(NamedTuple):
    """A page ending inside an index block, as remembered: the first ``tokens`` tokens (and
    ``ids`` identifiers, ``keys`` engine keys) of ``whole``, the record of that block shared by
    all its pages (a tuple of 4, not a :class:`Tail` each: about 300 bytes a page with
    SGLang's page size 1, see *Branches inside a block* in the README)."""

    whole: Tail
    tokens: int
    ids: int
    keys: int

    def tail(self) -> Tail:
        """The chain as it ends after this page."""
        w = self.whole
        return Tail(
            w.base,
            w.model,
            w.cache_salt,
            w.tokens[: self.tokens],
            w.ids[: self.ids],
            w.engine_keys[: self.keys],
            w.base_engine_key,
        )


def _tail_of(value: Tail | Cut | None) -> Tail | None:
    return value.tail() if isinstance(value, Cut) else value


class EngineKeyCache:
    """What one ingester knows of a pod's engine keys, bounded and thread-safe (least recently
    used dropped, each kind on its own): engine→request mappings, the :class:`Tail` of chains
    that end mid-block, a :class:`Cut` for each other page that ends inside an index block, and
    each stored engine block's parent (hashes chain, so a parent never changes: kept across
    clears).
    """

    __slots__ = ("_cut_limit", "_cuts", "_data", "_fine", "_limit", "_lock", "_parents", "_tails")

    def __init__(self, limit: int, cut_limit: int = DEFAULT_PARTIAL_BLOCK_PAGES) -> None:
        self._data: OrderedDict[int, int] = OrderedDict()
        self._tails: OrderedDict[int, Tail] = OrderedDict()
        self._parents: OrderedDict[int, int] = OrderedDict()
        self._cuts: OrderedDict[int, Cut] = OrderedDict()
        self._limit = limit
        self._cut_limit = cut_limit
        self._lock = threading.Lock()
        # KV-cache group -> whether its pages can end inside index blocks (see
        # :func:`boundary_key`): learned from the group's first stored page (any such page makes
        # it True for good); unknown until then, when a removal evicts boundary keys too. Per
        # group: a hybrid model's groups use different page sizes.
        self._fine: dict[int, bool] = {}

    def learn_pages(self, engine_block_size: int, block_size: int, group: int | None) -> bool:
        """Note a stored event's page size; whether the group's pages can end inside blocks."""
        g = group or 0
        if fine_pages(engine_block_size, block_size):
            self._fine[g] = True
        else:
            self._fine.setdefault(g, False)
        return self._fine[g]

    def fine(self, group: int | None) -> bool | None:
        """Whether the group's pages can end inside index blocks (``None``: not known yet)."""
        return self._fine.get(group or 0)

    def put_parents(self, keys: Sequence[int], parent: int | None) -> None:
        """Record the chain ``parent → keys[0] → keys[1] → ...``."""
        with self._lock:
            parents = self._parents
            for key in keys:
                if parent:
                    parents[key] = parent
                    parents.move_to_end(key)
                parent = key
            while len(parents) > self._limit:
                parents.popitem(last=False)

    def chain_back(self, key: int, length: int) -> list[int]:
        """``key`` and up to ``length - 1`` of its known ancestors, oldest first."""
        with self._lock:
            out = [key]
            while len(out) < length:
                parent = self._parents.get(out[-1])
                if parent is None:
                    break
                out.append(parent)
            return out[::-1]

    def forget_mappings(self, tails: bool = True) -> None:
        """Drop the mappings, and with ``tails`` the chain ends (the pod's entries were cleared;
        a clear of one rank's entries keeps the chain ends: the pod's other ranks go on from
        them, and a chain end only says which keys follow which tokens)."""
        with self._lock:
            self._data.clear()
            if tails:
                self._tails.clear()

    def get_tail(self, key: int) -> Tail | None:
        """Where the chain stands after page ``key`` (``None``: not remembered)."""
        with self._lock:
            tail = self._tails.get(key)
            if tail is not None:
                self._tails.move_to_end(key)
                return tail
            cut = self._cuts.get(key)
            if cut is None:
                return None
            self._cuts.move_to_end(key)
        return cut.tail()

    def pop_tail(self, key: int) -> None:
        with self._lock:
            self._tails.pop(key, None)
            self._cuts.pop(key, None)

    def put_tail(self, key: int, tail: Tail | Cut) -> None:
        with self._lock:
            if isinstance(tail, Cut):
                self._tails.pop(key, None)
                self._cuts[key] = tail
                self._cuts.move_to_end(key)
                if len(self._cuts) > self._cut_limit:
                    self._cuts.popitem(last=False)
            else:
                self._cuts.pop(key, None)
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
        self.pop_many((key,))

    def pop_many(self, keys: Iterable[int]) -> None:
        """Forget everything about these engine keys."""
        with self._lock:
            data, tails, cuts = self._data, self._tails, self._cuts
            for key in keys:
                data.pop(key, None)
                tails.pop(key, None)
                cuts.pop(key, None)

    def inside(self, key: int) -> bool:
        """Whether page ``key`` is known to end inside an index block."""
        with self._lock:
            if key in self._cuts:
                return True
            tail = self._tails.get(key)
            return tail is not None and bool(tail.tokens)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class PodCaches:
    """One :class:`EngineKeyCache` per pod, filled from what this ingester stored and read."""

    def __init__(self, limit: int, cut_limit: int = DEFAULT_PARTIAL_BLOCK_PAGES) -> None:
        self._limit = limit
        self._cut_limit = cut_limit
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
                cache = self._caches[pod] = EngineKeyCache(self._limit, self._cut_limit)
            return cache

    def drop(self, pod: str, tails: bool = True) -> None:
        """Forget the mappings (and with ``tails`` the chain ends) cached for ``pod``: its
        entries, or with ``tails=False`` those of one of its ranks, were cleared."""
        with self._lock:
            cache = self._caches.get(pod)
        if cache is not None:
            cache.forget_mappings(tails)

    def forget_batch(self, pod: str, decoded: DecodedBatch) -> None:
        """A batch a peer applied may have changed mappings cached here: drop those, and learn
        the tails of the chains it extended (their bases are read from the index when used), so
        that this replica continues them exactly as the peer would."""
        cache = self.get(pod)
        for event in map(_group_keyed, decoded.events):
            if isinstance(event, AllBlocksCleared):  # a reset of one rank's tiers
                self.drop(pod, tails=False)
                cache = self.get(pod)
                continue
            prior = None
            if isinstance(event, BlockStored) and event.parent_block_hash:
                prior = cache.get_tail(event.parent_block_hash)
            for engine_key in event.block_hashes:
                cache.pop(engine_key)
                if cache.fine(event.group_idx) is not False:
                    cache.pop(boundary_key(engine_key))
            if isinstance(event, BlockStored) and event.token_ids:
                cache.put_parents(event.block_hashes, event.parent_block_hash)
            if isinstance(event, BlockStored) and self.block_size is not None:
                _learn_tail(cache, event, prior, self.block_size)


@dataclass(frozen=True, slots=True)
class Lookup:
    """Planner request: the index's request key for ``engine_key`` (answer: int or None)."""

    engine_key: int


class Barrier(enum.Enum):
    """Planner request: apply what was planned so far."""

    FLUSH = "flush"


@dataclass(frozen=True, slots=True)
class Reset:
    """Planner request: apply what was planned so far, then clear the pod's entries of rank
    ``dp_rank`` on ``device_tiers`` (the engine reset its prefix cache). ``None``: every rank,
    every tier (the sequencer's clears of a stream's pods take the same form)."""

    dp_rank: int | None
    device_tiers: frozenset[str] | None


PlanSteps = Generator[Lookup | Barrier | Reset, int | None, None]
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
        self.batch_tails: dict[int, Tail | Cut] = {}
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

    def put_tail(self, engine_key: int, tail: Tail | Cut) -> None:
        self.batch_tails[engine_key] = tail
        self.stale_tails.discard(engine_key)
        self.evicted.discard(engine_key)

    def tail(self, engine_key: int) -> Tail | None:
        """The tail of the chain ending at ``engine_key``, as if the batch so far were applied."""
        hit = self.batch_tails.get(engine_key)
        if hit is not None or self.cache is None:
            return _tail_of(hit)
        if engine_key in self.evicted or engine_key in self.stale_tails:
            return None
        return self.cache.get_tail(engine_key)

    def inside(self, engine_key: int) -> bool:
        """Whether page ``engine_key`` is known to end inside an index block (so no
        :func:`boundary_key` of it is mapped), as if the batch so far were applied."""
        hit = self.batch_tails.get(engine_key)
        if hit is not None:
            return isinstance(hit, Cut) or bool(hit.tokens)
        if self.cache is None or engine_key in self.evicted or engine_key in self.stale_tails:
            return False
        return self.cache.inside(engine_key)

    def drop_tails(self, engine_keys: Sequence[int]) -> None:
        """These engine keys were stored again: a chain end recorded for them is stale."""
        for key in engine_keys:
            self.batch_tails.pop(key, None)
        self.stale_tails.update(engine_keys)

    def resolve(
        self, engine_key: int
    ) -> Generator[Lookup | Barrier | Reset, int | None, int | None]:
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
    ) -> Generator[Lookup | Barrier | Reset, int | None, int | None]:
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
        cache.pop_many(self.evicted)
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
    """Record the tails ``ev`` leaves (a peer applied it), without hashing or I/O: a block the
    event completes is named by the derived key of the page ending at its boundary."""
    if not ev.token_ids or not ev.block_hashes:
        return
    try:
        extra = _extra_keys(ev)
    except (ValueError, TypeError):
        return
    fine = cache.learn_pages(ev.block_size, bs, ev.group_idx)
    if not ev.parent_block_hash:
        prior = Tail(0, ev.lora_name, ev.cache_salt or extra.cache_salt)
    elif prior is None and fine:
        # A parent without a record here continues from a block's end or not at all: its
        # boundary key, mapped only if it ends a block, is the base (read when used).
        prior = Tail(0, ev.lora_name, None, base_engine_key=boundary_key(ev.parent_block_hash))
    elif prior is None:  # where the parent's chain ended is unknown here: learn nothing
        return
    step = _advance(prior, ev, extra.features, bs, fine)
    hashes = ev.block_hashes
    closing = {j: boundary_key(hashes[i]) for i, j in step.boundaries}
    wholes: dict[int, Tail | None] = {}
    for cut in step.cuts:
        j = cut[1]
        if j not in wholes:
            if j == step.full:
                wholes[j] = None  # the chain end's tail, recorded below
            elif j == 0:
                wholes[j] = step.whole(j, prior, prior.base, prior.base_engine_key)
            else:
                named = closing.get(j - 1)
                wholes[j] = None if named is None else step.whole(j, prior, 0, named)
        whole = wholes[j]
        if whole is not None:
            cache.put_tail(hashes[cut[0]], Cut(whole, cut[2], cut[3], cut[4]))
    if step.full and step.last_engine_key is None:
        return  # no engine key names the new base for sure: learn nothing more
    after = step.after(prior, 0, step.last_engine_key)
    for cut in step.cuts:
        if cut[1] == step.full:
            cache.put_tail(hashes[cut[0]], Cut(after, cut[2], cut[3], cut[4]))
    cache.put_tail(hashes[-1], after)


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
    cuts: tuple[tuple[int, int, int, int, int], ...] = ()
    """Pages but the last ending inside an index block: ``(page, block, tokens, ids, keys)``,
    the chain after that page being the first ``tokens``/``ids``/``keys`` of that block's
    record (:meth:`whole`, or the tail after the event for block ``full``)."""
    boundaries: tuple[tuple[int, int], ...] = ()
    """Pages ending exactly where a completed block ends (fine pages only): ``(page, block)``."""
    page_keys: tuple[int, ...] = ()
    """The event's engine keys (with ``boundaries``)."""

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

    def whole(self, j: int, tail: Tail, base: int, base_engine_key: int | None) -> Tail:
        """The record of completed block ``j`` that its cuts share: the chain before it (block
        ``j - 1``'s request key, or ``base_engine_key``'s mapping) and all of the block."""
        assert self.groups is not None, "cuts come with groups"
        bs = len(self.chain) // self.full
        feat = self.feats[j] if self.feats is not None else None
        return Tail(
            base,
            tail.model,
            tail.cache_salt,
            self.chain[j * bs : (j + 1) * bs],
            tuple(feat.mm_hashes) if feat is not None else (),
            self.groups[j],
            base_engine_key,
        )


def _advance(
    tail: Tail,
    ev: BlockStored,
    features: list[BlockExtraFeatures | None] | None,
    bs: int,
    fine: bool = False,
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

    # Spans are in token order (starts and ends never decrease): the engine blocks overlapping
    # a range are a run, found by bisection (a page-1 event has as many spans as tokens).
    bounds = {id(over): ([s for s, _ in over], [e for _, e in over]) for over in (spans, fspans)}

    def overlapping(lo: int, hi: int, over: list[tuple[int, int]]) -> range:
        """Engine blocks (indexes into ``over``) holding any event token in ``[lo, hi)``."""
        starts, ends = bounds[id(over)]
        return range(bisect_right(ends, lo), bisect_left(starts, hi))

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
    cuts: list[tuple[int, int, int, int, int]] = []
    boundaries: list[tuple[int, int]] = []
    if fine and hashes:
        # One pass: the pages ending in a block are the pages overlapping it from the first
        # whose last token is in it (they are contiguous), so a cut's engine keys and
        # identifiers are counted on from the previous page's.
        block, first = -1, 0
        acc: list[MMHash] = []
        prev: list[MMHash] = []
        for i, (s, e) in enumerate(spans):
            if e <= s:
                continue
            j = (offset + e - 1) // bs
            if j != block:
                block, first = j, i
                acc = list(tail.ids) if j == 0 else []
                prev = list(acc)
            if features is not None and fspans is spans:
                feat = features[i]
                cur = list(feat.mm_hashes) if feat is not None else []
                acc.extend(cur[_continued(prev, cur) :])
                prev = cur
            inside = (offset + e) % bs
            if not inside:
                boundaries.append((i, j))
            elif i < len(hashes) - 1 and realigned is None:
                keys = (len(tail.engine_keys) if j == 0 else 0) + i - first + 1
                if features is not None and fspans is not spans:
                    n_ids = len(ids_of(max(j * bs - offset, 0), e, tail.ids if j == 0 else ()))
                else:
                    n_ids = len(acc)
                cuts.append((i, j, inside, n_ids, keys))
    groups: list[tuple[int, ...]] | None = None
    last_engine_key: int | None = None
    if full and hashes:
        if offset or tail_tokens or fine:
            groups = [
                (tail.engine_keys if j == 0 else ())
                + tuple(hashes[i] for i in overlapping(lo, hi, spans))
                for j, (lo, hi) in enumerate(block_ranges)
            ]
            if fine:
                closing = [boundary_key(hashes[i]) for i, j in boundaries if j == full - 1]
                last_engine_key = closing[0] if closing else None
            else:
                # An engine block ending inside the last full block maps to it last, and no
                # later block claims it (only the engine blocks of a tail are mapped again).
                inside_last = [i for i, (_, e) in enumerate(spans) if rest_lo - bs < e <= rest_lo]
                last_engine_key = hashes[inside_last[-1]] if inside_last else None
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
        tuple(cuts),
        tuple(boundaries),
        tuple(hashes) if boundaries else (),
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
        reset_mediums: Sequence[str] = DEFAULT_RESET_MEDIUMS,
        offload_blocks_per_chunk: int = 1,
    ) -> None:
        self.token_processor = token_processor
        self.catalog = catalog
        self.caches = caches
        self.tiers = tiers
        """How an event's medium, locality and ownership name the entry's device tier."""
        self.reset_tiers = frozenset(tiers.tier(m, None, None) for m in reset_mediums)
        """The tiers ``AllBlocksCleared`` clears: those of ``reset_mediums`` (local copies)."""
        self.offload_blocks_per_chunk = offload_blocks_per_chunk
        """Engine blocks per offloaded chunk: a chunk's placeholder event (one hash, no tokens,
        ``block_size`` 0) names only its last block, and credits (or removes) them all."""
        self.block_size = int(token_processor.block_size())
        if self.block_size <= 0:
            raise ConfigError(f"token processor block size must be > 0, got {self.block_size}")
        caches.block_size = self.block_size
        self._entries: dict[tuple[str, str, int | None, int], PodEntry] = {}

    def plan(
        self, plan: BatchPlan, decoded: DecodedBatch, pod: str, model: str | None
    ) -> PlanSteps:
        """Plan every event of ``decoded`` for ``pod`` into ``plan``; see the module docstring."""
        rank = decoded.data_parallel_rank or 0
        for position, event in enumerate(map(_group_keyed, decoded.events)):
            if isinstance(event, BlockStored):
                yield from self._stored(plan, event, pod, model, position, rank)
            elif isinstance(event, BlockRemoved):
                self._removed(plan, event, pod, position, rank)
            elif isinstance(event, AllBlocksCleared):
                yield Reset(rank, self.reset_tiers)
                plan.count(Counter.EVENTS_APPLIED)

    def _entry(
        self, plan: BatchPlan, pod: str, tier: str, group: int | None, position: int, rank: int
    ) -> PodEntry | None:
        key = (pod, tier, group, rank)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        try:
            if group is None:
                entry = PodEntry(pod, tier, dp_rank=rank)
            else:
                entry = PodEntry(pod, tier, has_group=True, group_idx=group, dp_rank=rank)
        except InvalidInputError as exc:
            plan.rejects.append(Rejection(RejectReason.BAD_FIELD_VALUE, str(exc), position))
            return None
        if len(self._entries) >= _ENTRY_CACHE_LIMIT:
            self._entries.clear()
        self._entries[key] = entry
        return entry

    def _stored(
        self,
        plan: BatchPlan,
        ev: BlockStored,
        pod: str,
        model: str | None,
        position: int,
        rank: int,
    ) -> PlanSteps:
        tier = self.tiers.tier(ev.medium, ev.locality, ev.ownership)
        entry = self._entry(plan, pod, tier, ev.group_idx, position, rank)
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
            if ev.block_hashes and self.offload_blocks_per_chunk > 1 and not ev.block_size:
                yield from self._chunks_stored(plan, ev, entry)
            elif ev.block_hashes:
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
        cache = plan.cache
        if cache is None:
            fine = fine_pages(ev.block_size, self.block_size)
        else:
            fine = cache.learn_pages(ev.block_size, self.block_size, ev.group_idx)
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
                # With fine pages only a page ending at a block boundary continues from a
                # block's key alone: its derived key is mapped; a page inside a block is not.
                # Nor is a fine page's own mapping a tier update's: it names a block the pod
                # may hold only part of.
                found = yield from plan.resolve(boundary_key(parent) if fine else parent)
                if found is None:
                    if not fine and len(ev.token_ids) < self.block_size and ev.block_hashes:
                        yield from self._tier_update(plan, ev, entry, Counter.PARENT_MISSES)
                    else:
                        plan.count(Counter.PARENT_MISSES)
                    return
                tail = Tail(found, model_name, None)
        try:
            step = _advance(tail, ev, extra.features, self.block_size, fine)
            request, groups, after = self._continue(tail, step)
        except (ValueError, TypeError) as exc:
            plan.rejects.append(Rejection(RejectReason.HASHING_FAILED, str(exc), position))
            return
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_STORED, len(ev.block_hashes))
        self._add(plan, ev, entry, request, groups, tail.base or None)
        if ev.block_hashes and plan.cache is not None:
            plan.cache.put_parents(ev.block_hashes, ev.parent_block_hash)
        hashes = ev.block_hashes
        if hashes:
            plan.drop_tails(hashes[:-1])
            wholes: dict[int, Tail] = {step.full: after}
            for i, j, n_tokens, n_ids, n_keys in step.cuts:
                whole = wholes.get(j)
                if whole is None:
                    base = request[j - 1] if j else tail.base
                    whole = wholes[j] = step.whole(j, tail, base, None)
                plan.put_tail(hashes[i], Cut(whole, n_tokens, n_ids, n_keys))
            plan.put_tail(hashes[-1], after)

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
        self, tail: Tail, step: _Step
    ) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]] | None, Tail]:
        """Hash ``step`` on from ``tail`` (whose base is known): its request keys, the engine
        keys of each (``None`` when the engine's blocks line up so the index infers them; with
        fine pages, a block's group ends with the derived key of the page ending at its
        boundary) and the tail after it."""
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
        groups = list(step.groups)
        if step.boundaries:
            hashes = step.page_keys
            for i, j in step.boundaries:
                groups[j] += (boundary_key(hashes[i]),)
        return request, [(g, r) for g, r in zip(groups, request, strict=True)], after

    def _chunks_stored(self, plan: BatchPlan, ev: BlockStored, entry: PodEntry) -> PlanSteps:
        """Offloaded chunks' placeholders (``block_size`` 0, each hash a chunk's last block):
        each credits the chunk's blocks back as far as their parents are known, and maps its
        :func:`chunk_engine_key` to them for the chunk's removal."""
        applied = False
        for key in ev.block_hashes:
            chain = (
                plan.cache.chain_back(key, self.offload_blocks_per_chunk) if plan.cache else [key]
            )
            resolved: list[int] = []
            for engine_key in chain:
                request_key = yield from plan.resolve(engine_key)
                if request_key is not None and request_key not in resolved:
                    resolved.append(request_key)
            if not resolved:
                plan.count(Counter.TIER_UPDATE_MISSES)
                continue
            chunk_key = chunk_engine_key(key, entry.device_tier)
            plan.add(
                AddOp((chunk_key,), tuple(resolved), (entry,)),
                [(chunk_key, r) for r in resolved],
            )
            plan.count(Counter.TIER_UPDATES)
            applied = True
        if applied:
            plan.count(Counter.EVENTS_APPLIED)

    def _tier_update(
        self,
        plan: BatchPlan,
        ev: BlockStored,
        entry: PodEntry,
        miss: Counter = Counter.TIER_UPDATE_MISSES,
    ) -> PlanSteps:
        resolved: list[int] = []
        seen: set[int] = set()
        for engine_key in ev.block_hashes:
            request_key = yield from plan.resolve(engine_key)
            if request_key is not None and request_key not in seen:
                seen.add(request_key)
                resolved.append(request_key)
        if not resolved:
            plan.count(miss)
            return
        plan.add(AddOp(None, tuple(resolved), (entry,)), None)
        plan.count(Counter.TIER_UPDATES)
        plan.count(Counter.EVENTS_APPLIED)

    def _removed(
        self, plan: BatchPlan, ev: BlockRemoved, pod: str, position: int, rank: int
    ) -> None:
        tier = self.tiers.tier(ev.medium, ev.locality, ev.ownership)
        entry = self._entry(plan, pod, tier, ev.group_idx, position, rank)
        if entry is None:
            return
        # A page's derived key goes with it: it is mapped only if the page ends at a block
        # boundary, so the pages known to end inside a block need none; a chunk's removal
        # names its last block, so the chunk's key goes too.
        fine = plan.cache is not None and plan.cache.fine(ev.group_idx) is not False
        chunks = self.offload_blocks_per_chunk > 1
        keys: list[int] = []
        for h in ev.block_hashes:
            keys.append(h)
            if fine and not plan.inside(h):
                keys.append(boundary_key(h))
            if chunks:
                keys.append(chunk_engine_key(h, tier))
        plan.evict(keys, (entry,))
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_REMOVED, len(ev.block_hashes))

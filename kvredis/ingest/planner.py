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
  cache reset of the batch's engine covers (:meth:`Planner.reset_tiers_for`).

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
block, a record: that page's position in a record of its block (the request key of the
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
import itertools
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvredis.batch import AddOp, CheckedOps, EvictOp
from kvredis.checks import infer_mappings
from kvredis.errors import ConfigError, InvalidInputError
from kvredis.fastinit import slot_init
from kvredis.groups import GroupCatalog
from kvredis.ingest.chains import (
    DEFAULT_PARTIAL_BLOCK_PAGES,
    LEAF_FIRST_ENGINES,
    MAX_TAILS_PER_POD,
    BlockCuts,
    EngineKeyCache,
    ForgetLog,
    PageMapping,
    PageRecords,
    PodCaches,
    Step,
    Tail,
    advance,
    boundary_key,
    chunk_engine_key,
    event_extra_keys,
    fine_pages,
    group_engine_key,
    group_keyed,
    page_mapping,
    step_records,
)
from kvredis.ingest.config import DEFAULT_RESET_MEDIUMS, ENGINE_RESET_MEDIUMS
from kvredis.ingest.counters import Counter
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Engine,
    Rejection,
    RejectReason,
)
from kvredis.ingest.journal import encode_entry, recall
from kvredis.tiers import DEFAULT_TIERS, TierMap
from kvredis.types import GroupMetadata, KeyType, PodEntry

if TYPE_CHECKING:
    from kvredis.hashing import TokenProcessor

__all__ = [
    "DEFAULT_PARTIAL_BLOCK_PAGES",
    "LEAF_FIRST_ENGINES",
    "MAX_TAILS_PER_POD",
    "Barrier",
    "BatchPlan",
    "EngineKeyCache",
    "Lookup",
    "PageMapping",
    "PlanRequest",
    "PlanSteps",
    "Planner",
    "PodCaches",
    "Recall",
    "Reset",
    "Tail",
    "boundary_key",
    "chunk_engine_key",
    "fine_pages",
    "group_engine_key",
    "page_mapping",
]


@slot_init
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


@dataclass(frozen=True, slots=True)
class Recall:
    """Planner request: replay the pod's page journal into its cache (:meth:`BatchPlan.recall`),
    before the first batch of the pod that needs a page's record."""

    pod: str


PlanRequest = Lookup | Barrier | Reset | Recall
PlanSteps = Generator[PlanRequest, int | None, None]
"""What :meth:`Planner.plan` returns: requests out, lookup answers in."""


class BatchPlan:
    """The operations and effects of one batch being planned (one attempt at applying it)."""

    __slots__ = (
        "batch_map",
        "batch_tails",
        "cache",
        "chain_ends",
        "dropped_records",
        "evicted",
        "mixed",
        "pending",
        "pending_evicts",
        "recorded",
        "rejects",
        "stale_tails",
        "stats",
    )

    def __init__(self, cache: EngineKeyCache | None) -> None:
        self.cache = cache
        """The pod's engine→request cache (None: the batch names no pod)."""
        self.pending = CheckedOps()
        """Operations planned since the last barrier (all built here, in normal form)."""
        self.batch_map: dict[int, int] = {}
        """Engine→request mappings added by this batch so far (not yet in the pod cache)."""
        self.batch_tails: dict[int, Tail] = {}
        """Page records (chain ends and pages inside blocks) recorded by this batch so far (not
        yet in the pod cache)."""
        self.chain_ends: set[int] = set()
        """The pages of ``batch_tails`` that end chains."""
        self.recorded: list[Tail] = []
        """Every record this batch put in ``batch_tails`` (some pages may have left it since)."""
        self.mixed = False
        """Whether a page left ``batch_tails``, or went to another record, after it was put there
        (else every page of every record of ``recorded`` still maps to that record)."""
        self.stale_tails: set[int] = set()
        """Engine keys stored again by this batch: their cached tails no longer hold."""
        self.pending_evicts: set[int] = set()
        """Engine keys evicted by pending operations."""
        self.evicted: set[int] = set()
        """Engine keys evicted by this batch (and not re-added): the pod cache is stale there."""
        self.dropped_records: set[int] = set()
        """Pages removed by this batch that had a record (ended inside an index block)."""
        self.stats: dict[Counter, int] = {}
        """What the batch counts once it takes effect."""
        self.rejects: list[Rejection] = []
        """Events refused while planning, reported once the batch takes effect."""

    def count(self, counter: Counter, amount: int = 1) -> None:
        self.stats[counter] = self.stats.get(counter, 0) + amount

    def take(self) -> CheckedOps:
        """The pending operations, to be applied now as one step."""
        ops, self.pending = self.pending, CheckedOps()
        self.pending_evicts.clear()
        return ops

    def after_clear(self, cache: EngineKeyCache | None, tails: bool = True) -> None:
        """The pod was cleared as a step of this batch: start over from an empty cache, or
        without ``tails`` (a clear of one rank's entries, which keeps the pod's chain ends) from
        one that forgot its mappings only: the page records the batch learned before the clear
        stay, as they would had the clear come in a batch of its own."""
        self.cache = cache
        self.batch_map.clear()
        self.pending_evicts.clear()
        if not tails:
            return
        self.dropped_records.clear()
        self.batch_tails.clear()
        self.chain_ends.clear()
        self.recorded.clear()
        self.mixed = False
        self.stale_tails.clear()
        self.evicted.clear()

    def add(self, op: AddOp, mappings: list[tuple[int, int]] | None) -> None:
        self.pending.append(op)
        if mappings:
            batch_map, evicted = self.batch_map, self.evicted
            for engine_key, request_key in mappings:
                batch_map[engine_key] = request_key
                evicted.discard(engine_key)

    def evict(
        self, keys: Sequence[int], entries: tuple[PodEntry, ...], pages: Sequence[int] = ()
    ) -> None:
        """Evict ``keys`` (engine keys), and forget what is known of ``pages`` (the engine pages
        removed, of which only some may have mappings)."""
        self.pending.extend([EvictOp(key, KeyType.ENGINE, entries) for key in keys])
        batch_map, batch_tails = self.batch_map, self.batch_tails
        for key in batch_map.keys() & {*keys, *pages}:
            del batch_map[key]
        for key in batch_tails.keys() & {*keys, *pages}:
            del batch_tails[key]
            self.mixed = True
        self.pending_evicts.update(keys)
        self.evicted.update(keys)
        self.evicted.update(pages)

    def needs_recall(self, group: int | None) -> bool:
        """Whether the pod's page journal is still to be recalled before a page of ``group`` is
        looked up (not for a group whose pages are known to be whole blocks: they have no
        records)."""
        cache = self.cache
        return (
            cache is not None
            and not cache.recalled
            and cache.mapping(group) is not PageMapping.WHOLE
        )

    def recall(self, entries: Sequence[bytes]) -> int:
        """Replay the pod's page journal ``entries`` into its cache (once per pod and ingester);
        the number of page records restored."""
        cache = self.cache
        if cache is None or cache.recalled:
            return 0
        cache.recalled = True
        return recall(cache, entries)

    def journal_entry(self) -> bytes | None:
        """This batch's entry in the pod's page journal, once it took effect: the page records
        it dropped and learned (``None``: nothing to record)."""
        tails = self.batch_tails
        dropped = self.dropped_records - tails.keys()
        if not dropped and not any(value.tokens for value in tails.values()):
            return None
        return encode_entry(tails, dropped, candidates=self.recorded, whole=not self.mixed)

    def put_records(self, records: PageRecords) -> None:
        """Record each page's tail (see :func:`~kvredis.ingest.chains.step_records`)."""
        batch_tails = self.batch_tails
        for part in (records.cuts, records.tails):
            had = len(batch_tails)
            batch_tails.update(part)
            if len(batch_tails) != had + len(part):
                self.mixed = True  # a page moved from an earlier record to this one
            self.stale_tails.difference_update(part)
            self.evicted.difference_update(part)
        self.chain_ends.difference_update(records.cuts)
        self.chain_ends.update(records.tails)
        if records.made is not None:
            self.recorded.extend(records.made)
        else:
            self.recorded.extend({id(r): r for r in records.tails.values()}.values())
            self.recorded.extend({id(r): r for r in records.cuts.values()}.values())

    def tail(self, engine_key: int) -> Tail | None:
        """The tail of the chain ending at ``engine_key``, as if the batch so far were applied."""
        hit = self.batch_tails.get(engine_key)
        if hit is not None:
            return hit.after(engine_key)
        if self.cache is None:
            return None
        if engine_key in self.evicted or engine_key in self.stale_tails:
            return None
        return self.cache.get_tail(engine_key)

    def record(self, engine_key: int) -> Tail | None:
        """The record of page ``engine_key`` if it is known to end inside an index block (so no
        :func:`boundary_key` of it is mapped; :attr:`Tail.mapped` says whether the page itself
        is), as if the batch so far were applied; else ``None``."""
        hit = self.batch_tails.get(engine_key)
        if hit is not None:
            return hit if hit.tokens else None
        if self.cache is None or engine_key in self.evicted or engine_key in self.stale_tails:
            return None
        return self.cache.record(engine_key)

    def records(self, engine_keys: Sequence[int]) -> list[Tail | None]:
        """:meth:`record` of each engine key."""
        tails = self.batch_tails
        cache = self.cache
        gone = self.evicted, self.stale_tails
        if cache is not None and not tails and not gone[0] and not gone[1]:
            known = cache.records_of(engine_keys)
            found = [known.get(k) for k in engine_keys]
            return [r if r is not None and r.tokens else None for r in found]
        if cache is None:
            found = [tails.get(k) for k in engine_keys]
            return [r if r is not None and r.tokens else None for r in found]
        known = cache.records_of(
            [k for k in engine_keys if k not in tails and k not in gone[0] and k not in gone[1]]
        )
        out: list[Tail | None] = []
        for key in engine_keys:
            record = tails.get(key)
            if record is None and key not in gone[0] and key not in gone[1]:
                record = known.get(key)
            out.append(record if record is not None and record.tokens else None)
        return out

    def drop_tails(self, engine_keys: Iterable[int]) -> None:
        """These engine keys were stored again: a chain end recorded for them is stale."""
        keys = set(engine_keys)
        tails = self.batch_tails
        if tails:
            for key in tails.keys() & keys:
                del tails[key]
                self.mixed = True
        self.stale_tails |= keys

    def resolve(self, engine_key: int) -> Generator[PlanRequest, int | None, int | None]:
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
    ) -> Generator[PlanRequest, int | None, int | None]:
        self.count(Counter.INDEX_LOOKUPS)
        found = yield Lookup(engine_key)
        if found is not None and cache is not None:
            cache.put(engine_key, found)
        return found

    def commit_cache(self) -> None:
        """The batch took effect: the pod cache learns its mappings and forgets its evictions."""
        self._settle_cache(took_effect=True)

    def commit_cache_undoably(self) -> Callable[[], None]:
        """:meth:`commit_cache` before the batch is known to take effect; the function returned
        puts the pod cache back exactly as it was (the batch did not take effect: unlike
        :meth:`discard_cache`, what earlier batches taught the cache stays)."""
        cache = self.cache
        if cache is None:
            return lambda: None
        saved = cache.save({*self.batch_map, *self.batch_tails})
        forgotten: ForgetLog = []
        self._settle_cache(took_effect=True, forgotten=forgotten)
        return lambda: cache.restore(saved, forgotten)

    def discard_cache(self) -> None:
        """The batch may have partly applied: forget every mapping it touched."""
        self._settle_cache(took_effect=False)

    def _settle_cache(self, took_effect: bool, forgotten: ForgetLog | None = None) -> None:
        cache = self.cache
        if cache is None:
            return
        if took_effect:
            tails, ends = self.batch_tails, self.chain_ends
            cuts = dict(tails)  # (copied and cut at C speed: a batch has a page per token)
            at_ends = {}
            for k in ends:
                tail = cuts.pop(k, None)
                if tail is not None:
                    at_ends[k] = tail
            records = PageRecords(cuts, at_ends)
            cache.commit(self.evicted, self.stale_tails, self.batch_map, records, forgotten)
        else:
            cache.commit(
                itertools.chain(self.evicted, self.batch_map, self.batch_tails),
                self.stale_tails,
                {},
                PageRecords({}, {}),
            )


_ENTRY_CACHE_LIMIT = 4096


class Planner:
    """Turns decoded batches into index operations for one token processor."""

    def __init__(
        self,
        token_processor: TokenProcessor,
        catalog: GroupCatalog,
        caches: PodCaches,
        *,
        tiers: TierMap = DEFAULT_TIERS,
        reset_mediums: Sequence[str] | None = None,
        offload_blocks_per_chunk: int = 1,
    ) -> None:
        self.token_processor = token_processor
        self.catalog = catalog
        self.caches = caches
        self.tiers = tiers
        """How an event's medium, locality and ownership name the entry's device tier."""
        self.reset_tiers = frozenset(
            tiers.tier(m, None, None) for m in reset_mediums or DEFAULT_RESET_MEDIUMS
        )
        """The tiers ``AllBlocksCleared`` clears when the batch's engine is not known (or for
        every engine, with ``reset_mediums`` given): those of the mediums' local copies."""
        self._engine_reset_tiers: dict[Engine, frozenset[str]] = {
            engine: (
                self.reset_tiers
                if reset_mediums
                else frozenset(tiers.tier(m, None, None) for m in mediums)
            )
            for engine, mediums in ENGINE_RESET_MEDIUMS.items()
        }
        self.offload_blocks_per_chunk = offload_blocks_per_chunk
        """Engine blocks per offloaded chunk: a chunk's placeholder event (one hash, no tokens,
        ``block_size`` 0) names only its last block, and credits (or removes) them all."""
        self.block_size = int(token_processor.block_size())
        if self.block_size <= 0:
            raise ConfigError(f"token processor block size must be > 0, got {self.block_size}")
        caches.block_size = self.block_size
        self._entries: dict[tuple[str, str, int | None, int], PodEntry] = {}

    def reset_tiers_for(self, engine: Engine | None) -> frozenset[str]:
        """The tiers a prefix-cache reset (``AllBlocksCleared``) of ``engine`` clears."""
        return self.reset_tiers if engine is None else self._engine_reset_tiers[engine]

    def plan(
        self, plan: BatchPlan, decoded: DecodedBatch, pod: str, model: str | None
    ) -> PlanSteps:
        """Plan every event of ``decoded`` for ``pod`` into ``plan``; see the module docstring."""
        rank = decoded.data_parallel_rank or 0
        engine = decoded.engine
        # vLLM's offloading connector's chunks: TensorRT-LLM's tier moves are single blocks
        chunks = self.offload_blocks_per_chunk > 1 and engine is not Engine.TRTLLM
        for position, event in enumerate(map(group_keyed, decoded.events)):
            if isinstance(event, BlockStored):
                yield from self._stored(plan, event, pod, model, position, rank, engine, chunks)
            elif isinstance(event, BlockRemoved):
                yield from self._removed(plan, event, pod, position, rank, chunks)
            elif isinstance(event, AllBlocksCleared):
                yield Reset(rank, self.reset_tiers_for(decoded.engine))
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
        engine: Engine | None,
        chunks: bool = False,
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
            if ev.block_hashes and chunks and not ev.block_size:
                yield from self._chunks_stored(plan, ev, entry)
            elif ev.block_hashes:
                moved = None
                if ev.moved_from is not None:
                    old = self.tiers.tier(ev.moved_from, ev.locality, ev.ownership)
                    moved = self._entry(plan, pod, old, ev.group_idx, position, rank)
                yield from self._tier_update(plan, ev, entry, moved_from=moved)
            return
        model_name = ev.lora_name or model
        if not model_name:
            plan.rejects.append(
                Rejection(RejectReason.NO_MODEL, "no model name for hashing", position)
            )
            return
        chain_start = not ev.parent_block_hash
        try:
            extra = event_extra_keys(ev)
        except (ValueError, TypeError) as exc:
            plan.rejects.append(Rejection(RejectReason.BAD_EXTRA_KEYS, str(exc), position))
            return
        cache = plan.cache
        if cache is None:
            mapping = page_mapping(engine, ev.block_size, self.block_size)
        else:
            mapping = cache.learn_pages(ev.block_size, self.block_size, ev.group_idx, engine)
        fine = mapping is not PageMapping.WHOLE
        if chain_start:
            tail = Tail(0, model_name, ev.cache_salt or extra.cache_salt)
        else:
            parent = ev.parent_block_hash
            assert parent is not None
            if plan.needs_recall(ev.group_idx):
                yield Recall(pod)
            known = plan.tail(parent)
            if known is not None and known.base_engine_key is not None:
                base = yield from plan.resolve(known.base_engine_key)
                if base is None:
                    plan.count(Counter.PARENT_MISSES)
                    return
                known = dataclasses.replace(known, base=base, base_engine_key=None)
            if known is not None:
                tail = known if known.model else dataclasses.replace(known, model=model_name)
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
            step = advance(
                tail,
                ev,
                extra.features,
                self.block_size,
                fine,
                mapping is not PageMapping.BLOCK_END,
            )
            request, groups, after = self._continue(tail, step)
        except (ValueError, TypeError) as exc:
            plan.rejects.append(Rejection(RejectReason.HASHING_FAILED, str(exc), position))
            return
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_STORED, len(ev.block_hashes))
        self._add(plan, ev, entry, request, groups, tail.base or None, step.mapped)
        hashes = ev.block_hashes
        if hashes and plan.cache is not None and chunks:
            plan.cache.put_parents(hashes, ev.parent_block_hash)
        if hashes:

            def whole_of(cuts: BlockCuts, pages: tuple[int, ...]) -> Tail:
                j = cuts.block
                return step.whole(j, tail, request[j - 1] if j else tail.base, None, cuts, pages)

            records = step_records(step, hashes, whole_of, after)
            plan.drop_tails(set(hashes[:-1]).difference(records.cuts))
            plan.put_records(records)

    def _add(
        self,
        plan: BatchPlan,
        ev: BlockStored,
        entry: PodEntry,
        request: tuple[int, ...],
        groups: list[tuple[tuple[int, ...], int]] | None,
        parent: int | None,
        pages_mapped: bool = True,
    ) -> None:
        """Add ``request`` (following ``parent``, the request key the chain continues from):
        one operation for the event when each block has one engine key (the boundary key of its
        last page, :attr:`PageMapping.BLOCK_END`), else one per block."""
        if not request:
            return
        if groups is not None and not pages_mapped:
            ends = tuple(keys[0] for keys, _ in groups)
            plan.add(AddOp(ends, request, (entry,), parent), list(zip(ends, request, strict=True)))
        elif groups is None:
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
        self, tail: Tail, step: Step
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
        moved_from: PodEntry | None = None,
    ) -> PlanSteps:
        """Add ``entry`` to the request keys ``ev``'s engine keys resolve to (the most recent
        of each); with ``moved_from`` (a tier move), take that entry off the same keys."""
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
        if moved_from is not None and moved_from != entry:
            plan.pending.extend(EvictOp(key, KeyType.REQUEST, (moved_from,)) for key in resolved)
        plan.count(Counter.TIER_UPDATES)
        plan.count(Counter.EVENTS_APPLIED)

    def _removed(
        self,
        plan: BatchPlan,
        ev: BlockRemoved,
        pod: str,
        position: int,
        rank: int,
        chunks: bool = False,
    ) -> PlanSteps:
        tier = self.tiers.tier(ev.medium, ev.locality, ev.ownership)
        entry = self._entry(plan, pod, tier, ev.group_idx, position, rank)
        if entry is None:
            return
        if plan.needs_recall(ev.group_idx):
            yield Recall(pod)
        # What the index maps for each page: its own key (whole pages, and pages finer than
        # blocks mapped page by page), the boundary key of a page ending a block (fine pages),
        # nothing for a page known to end inside a block under the block-end mapping; a page
        # this ingester knows nothing of gets every key it may have. A chunk's removal names its
        # last block, so the chunk's key goes too.
        cache = plan.cache
        mapping = cache.mapping(ev.group_idx) if cache is not None else PageMapping.WHOLE
        hashes = ev.block_hashes
        records = plan.records(hashes)
        keys: list[int] = []
        if mapping is PageMapping.BLOCK_END and not chunks:
            # the common case of an engine evicting leaves: block ends only
            known = [h for h, r in zip(hashes, records, strict=True) if r is not None]
            plan.dropped_records.update(known)
            for h, record in zip(hashes, records, strict=True):
                if record is None:
                    keys.append(boundary_key(h))
                elif record.mapped:
                    keys.append(h)
        else:
            for h, record in zip(hashes, records, strict=True):
                if record is not None:
                    plan.dropped_records.add(h)
                    if record.mapped:
                        keys.append(h)
                elif mapping is PageMapping.BLOCK_END:
                    keys.append(boundary_key(h))
                else:
                    keys.append(h)
                    if mapping is not PageMapping.WHOLE:
                        keys.append(boundary_key(h))
                if chunks:
                    keys.append(chunk_engine_key(h, tier))
        plan.evict(keys, (entry,), ev.block_hashes)
        plan.count(Counter.EVENTS_APPLIED)
        plan.count(Counter.BLOCKS_REMOVED, len(ev.block_hashes))

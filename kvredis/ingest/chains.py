"""What the ingester remembers of the engines' chains, and how an event advances one.

The engine keys the index maps besides the engines' own (a KV-cache group's keys, an offloaded
chunk's key, the boundary key of a page that ends an index block), where a chain stands after a
page (:class:`Tail`), the bounded per-pod caches of mappings, chain ends and
parents (:class:`EngineKeyCache`, :class:`PodCaches`), and the step that hashes an event's
tokens on from where its parent's chain stands. :mod:`kvredis.ingest.planner` plans index
operations with them.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import threading
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvredis.fastinit import slot_init
from kvredis.features import (
    NO_EXTRA_KEYS,
    BlockExtraFeatures,
    ExtraKeys,
    MMHash,
    realign_extra_features,
    split_extra_keys,
)
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Engine,
    Event,
)

__all__ = [
    "DEFAULT_PARTIAL_BLOCK_PAGES",
    "LEAF_FIRST_ENGINES",
    "MAX_TAILS_PER_POD",
    "BlockCuts",
    "Boundary",
    "EngineKeyCache",
    "PageMapping",
    "PageRecords",
    "PodCaches",
    "Step",
    "Tail",
    "advance",
    "boundary_key",
    "chunk_engine_key",
    "fine_pages",
    "group_engine_key",
    "page_mapping",
    "step_records",
]


_TRIM_SHARE = 16
"""Past its bound, a pod's record table drops its oldest 1/16 at once (not one per insert)."""

MAX_TAILS_PER_POD = 32_768
"""Chain ends remembered per pod (fewer when the engine-key cache is smaller): each holds less
than one index block of tokens, a few hundred bytes."""

DEFAULT_PARTIAL_BLOCK_PAGES = 65_536
"""Default of ``IngesterConfig.partial_block_pages``: other engine pages ending inside an index
block remembered per pod (the pages a branch may hang from), about 220 bytes each."""

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


LEAF_FIRST_ENGINES: frozenset[Engine] = frozenset({Engine.SGLANG, Engine.TRTLLM})
"""Engines whose caches evict a whole leaf of their block tree at a time, never a page whose
descendants they still hold (SGLang's radix tree, TensorRT-LLM's block tree). vLLM frees blocks
one by one (a sliding window frees a chain's first blocks while its last ones stay), so it is
not one of them."""


class PageMapping(enum.Enum):
    """How the index maps an engine's pages to index blocks (:func:`page_mapping`)."""

    WHOLE = "whole"
    """Pages of whole index blocks (or several): mapped to them by length ratio."""
    EVERY_PAGE = "every_page"
    """Pages finer than blocks: every page maps to the block holding its tokens (removing any
    of them removes the block), and the page ending a block also under its
    :func:`boundary_key`."""
    BLOCK_END = "block_end"
    """Pages finer than blocks of an engine in :data:`LEAF_FIRST_ENGINES`, dividing the block:
    only the page ending a block is mapped, under its :func:`boundary_key`. Exact because such
    an engine removes a page only with the node it is in and after that node's descendants, so
    a block's tokens go no sooner than its last page; the pages inside a block have no mapping
    (their removal costs the index nothing when the ingester knows them, see
    :meth:`EngineKeyCache.record`)."""


def page_mapping(engine: Engine | None, engine_block_size: int, block_size: int) -> PageMapping:
    """How pages of ``engine_block_size`` tokens of ``engine`` (``None``: not known) map to index
    blocks of ``block_size`` tokens."""
    if not fine_pages(engine_block_size, block_size):
        return PageMapping.WHOLE
    dividing = engine_block_size > 0 and block_size % engine_block_size == 0
    if engine in LEAF_FIRST_ENGINES and dividing:
        return PageMapping.BLOCK_END
    return PageMapping.EVERY_PAGE


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


def group_keyed(event: Event) -> Event:
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


@slot_init
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

    A tail is also the *record* the pages of one event that end inside one index block share
    (one object, not one per page: about 220 bytes a page with SGLang's page size 1, its hash
    and token included, see ``docs/ingest.md``): ``pages`` in order, the chain after
    ``pages[i]`` holding the first ``page_tokens[i]`` tokens, ``page_ids[i]`` identifiers and
    ``page_keys[i]`` engine keys of it (:meth:`after`; ``page_ids``/``page_keys`` empty when
    ``ids``/``engine_keys`` are).
    """

    base: int
    model: str | None
    cache_salt: str | None
    tokens: tuple[int, ...] = ()
    ids: tuple[MMHash, ...] = ()
    engine_keys: tuple[int, ...] = ()
    base_engine_key: int | None = None
    mapped: bool = True
    """Whether ``engine_keys`` (and the pages recorded with this tail) have mappings of their own
    in the index (:attr:`PageMapping.EVERY_PAGE`); under :attr:`PageMapping.BLOCK_END` they have
    none, and ``engine_keys`` is empty."""
    pages: tuple[int, ...] = ()
    page_tokens: tuple[int, ...] = ()
    page_ids: tuple[int, ...] = ()
    page_keys: tuple[int, ...] = ()
    packed: bytes | None = field(default=None, init=False, repr=False, compare=False)
    """This record as a page journal entry packs it, once it was (see
    :mod:`kvredis.ingest.journal`): a record lives on in its pod's cache, and every compaction
    packs it again."""

    def after(self, page: int) -> Tail:
        """The chain as it ends after ``page`` (one of :attr:`pages`; a tail without pages is
        the chain after whichever page it was recorded for)."""
        pages = self.pages
        if not pages:
            return self
        i = pages.index(page)
        return Tail(
            self.base,
            self.model,
            self.cache_salt,
            self.tokens[: self.page_tokens[i]],
            self.ids[: self.page_ids[i]] if self.page_ids else (),
            self.engine_keys[: self.page_keys[i]] if self.page_keys else (),
            self.base_engine_key,
            self.mapped,
        )

    def holding(
        self,
        pages: tuple[int, ...],
        tokens: tuple[int, ...],
        ids: tuple[int, ...],
        keys: tuple[int, ...],
    ) -> Tail:
        """This tail as the record of ``pages`` (with their counts, see the class docstring)."""
        return Tail(
            self.base,
            self.model,
            self.cache_salt,
            self.tokens,
            self.ids,
            self.engine_keys,
            self.base_engine_key,
            self.mapped,
            pages,
            tokens,
            ids if self.ids else (),
            keys if self.engine_keys else (),
        )


class _Table:
    """A bounded table of page records: past ``limit``, its oldest 1/:data:`_TRIM_SHARE` is
    dropped at once (a record used is the newest again)."""

    __slots__ = ("items", "limit")

    def __init__(self, limit: int) -> None:
        self.items: dict[int, Tail] = {}
        self.limit = max(limit, 1)

    def put(self, records: Mapping[int, Tail]) -> None:
        items = self.items
        items.update(records)
        if len(items) > self.limit:
            excess = len(items) - self.limit + self.limit // _TRIM_SHARE
            for key in list(itertools.islice(items, excess)):
                del items[key]

    def use(self, key: int) -> Tail | None:
        record = self.items.pop(key, None)
        if record is not None:
            self.items[key] = record
        return record


class PageRecords(NamedTuple):
    """Records of pages (see :class:`Tail`): ``cuts`` for pages ending inside an index block,
    ``tails`` for pages ending a chain (the two are bounded apart)."""

    cuts: dict[int, Tail]
    tails: dict[int, Tail]
    made: tuple[Tail, ...] | None = None
    """Every record of ``cuts`` and ``tails``, once (``None``: not listed)."""


ForgetLog = list[tuple[dict[int, Any], int, Any]]
"""What :meth:`EngineKeyCache.commit` forgot, in order: ``(table, key, value)``."""


class CacheSnapshot(NamedTuple):
    """What :meth:`EngineKeyCache.save` found: each known key's mapping, chain end and record
    inside a block (``None``: none), and the saved keys it knew nothing of."""

    known: list[tuple[int, int | None, Tail | None, Tail | None]]
    absent: AbstractSet[int]


class EngineKeyCache:
    """What one ingester knows of a pod's engine keys, bounded and thread-safe: engine→request
    mappings (least recently used dropped), the :class:`Tail` of every chain end and the record
    of every other page that ends inside an index block (each kind bounded on its own, the
    oldest dropped first, a record refreshed when a branch uses it), and, for offloaded chunks,
    each stored engine block's parent (hashes chain, so a parent never changes: kept across
    clears).
    """

    __slots__ = (
        "_cuts",
        "_data",
        "_limit",
        "_lock",
        "_modes",
        "_parents",
        "_tails",
        "recalled",
    )

    def __init__(
        self, limit: int, cut_limit: int = DEFAULT_PARTIAL_BLOCK_PAGES, recalled: bool = True
    ) -> None:
        self.recalled = recalled
        """Whether the pod's page journal (:mod:`kvredis.ingest.journal`) was replayed here, or
        there is none to replay: until then, a batch that needs a page's record recalls it."""
        self._data: OrderedDict[int, int] = OrderedDict()
        self._tails = _Table(min(limit, MAX_TAILS_PER_POD))
        self._cuts = _Table(cut_limit)
        self._parents: OrderedDict[int, int] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        # KV-cache group -> how its pages are mapped: learned from the group's stored pages (any
        # page finer than a block makes it fine for good, and a group whose fine pages were
        # ever mapped page by page stays so); unknown until then, when a removal evicts
        # boundary keys too. Per group: a hybrid model's groups use different page sizes.
        self._modes: dict[int, PageMapping] = {}

    def learn_pages(
        self, engine_block_size: int, block_size: int, group: int | None, engine: Engine | None
    ) -> PageMapping:
        """Note a stored event's page size; how its pages are mapped (a whole-block event of a
        group whose pages were finer is mapped page by page, as before)."""
        g = group or 0
        mapping = page_mapping(engine, engine_block_size, block_size)
        known = self._modes.get(g)
        if mapping is PageMapping.WHOLE:
            if known is None:
                self._modes[g] = mapping
            elif known is not PageMapping.WHOLE:
                return PageMapping.EVERY_PAGE
        elif known in (None, PageMapping.WHOLE, mapping):
            self._modes[g] = mapping
        else:
            self._modes[g] = PageMapping.EVERY_PAGE
        return mapping

    def fine(self, group: int | None) -> bool | None:
        """Whether the group's pages can end inside index blocks (``None``: not known yet)."""
        mode = self._modes.get(group or 0)
        return None if mode is None else mode is not PageMapping.WHOLE

    def mapping(self, group: int | None) -> PageMapping | None:
        """How the group's pages were mapped so far (``None``: not known yet)."""
        return self._modes.get(group or 0)

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
                self._tails.items.clear()

    def forget_records(self) -> None:
        """Drop every page record (chain ends and pages inside blocks)."""
        with self._lock:
            self._tails.items.clear()
            self._cuts.items.clear()

    def get_tail(self, key: int) -> Tail | None:
        """Where the chain stands after page ``key`` (``None``: not remembered)."""
        with self._lock:
            record = self._tails.use(key) or self._cuts.use(key)
        return None if record is None else record.after(key)

    def pop_tail(self, key: int) -> None:
        with self._lock:
            self._tails.items.pop(key, None)
            self._cuts.items.pop(key, None)

    def put_tail(self, key: int, tail: Tail) -> None:
        """Record ``tail`` as the chain after page ``key`` (a chain end)."""
        self.put_records(PageRecords({}, {key: tail}))

    def put_records(self, records: PageRecords) -> None:
        """Record each page's tail."""
        with self._lock:
            self._put(records)

    def _put(self, records: PageRecords) -> None:
        cuts, tails, _ = records
        if cuts:
            if self._tails.items:
                for key in cuts.keys() & self._tails.items.keys():
                    del self._tails.items[key]
            self._cuts.put(cuts)
        if tails:
            for key in tails.keys() & self._cuts.items.keys():
                del self._cuts.items[key]
            self._tails.put(tails)

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

    def commit(
        self,
        dropped: Iterable[int],
        stale: set[int],
        mappings: Mapping[int, int],
        records: PageRecords,
        forgotten: ForgetLog | None = None,
    ) -> None:
        """What a batch that took effect changed: forget everything of ``dropped`` engine keys
        and the records of ``stale`` pages (stored again), then learn ``mappings`` and
        ``records``. ``forgotten``, when given, gets ``(table, key, value)`` of everything
        forgotten, for :meth:`restore` (what is learned, :meth:`save` takes before)."""
        with self._lock:
            data, tails, cuts = self._data, self._tails.items, self._cuts.items
            if not isinstance(dropped, (set, frozenset)):
                dropped = set(dropped)
            either = dropped | stale if stale else dropped  # (records go with stale pages too)
            tables: tuple[dict[int, Any], ...] = (data, tails, cuts)
            for n, table in enumerate(tables):
                gone = table.keys() & (either if n else dropped)
                if forgotten is None:
                    for key in gone:
                        del table[key]
                else:
                    pop = table.pop
                    forgotten.extend([(table, key, pop(key)) for key in gone])
            if mappings:
                data.update(mappings)
                for key in mappings:
                    data.move_to_end(key)
                while len(data) > self._limit:
                    data.popitem(last=False)
            self._put(records)

    def pop(self, key: int) -> None:
        self.pop_many((key,))

    def pop_many(self, keys: Iterable[int]) -> None:
        """Forget everything about these engine keys."""
        with self._lock:
            data, tails, cuts = self._data, self._tails.items, self._cuts.items
            for key in keys:
                data.pop(key, None)
                tails.pop(key, None)
                cuts.pop(key, None)

    def save(self, keys: Collection[int]) -> CacheSnapshot:
        """What is known of these engine keys now (mapping, chain end, record inside a block),
        for :meth:`restore` (with what a :meth:`commit` then forgot). Worked out with set
        operations: an SGLang batch names thousands of pages, few of them known here. ``keys``
        given as a set may be kept by the snapshot as it is: pass one nothing changes later."""
        with self._lock:
            data, tails, cuts = self._data, self._tails.items, self._cuts.items
            wanted = keys if isinstance(keys, (set, frozenset)) else set(keys)
            known = (wanted & data.keys()) | (wanted & tails.keys()) | (wanted & cuts.keys())
            get_data, get_tail, get_cut = data.get, tails.get, cuts.get
            return CacheSnapshot(
                [(k, get_data(k), get_tail(k), get_cut(k)) for k in known],
                wanted - known if known else wanted,  # (not copied when nothing is known)
            )

    def restore(
        self, saved: CacheSnapshot, forgotten: Sequence[tuple[dict[int, Any], int, Any]] = ()
    ) -> None:
        """Know exactly what was known before a :meth:`commit`: what it forgot (its
        ``forgotten`` log), then, of the engine keys it learned, what :meth:`save` found."""
        with self._lock:
            data, tails, cuts = self._data, self._tails.items, self._cuts.items
            for table, key, value in forgotten:
                table[key] = value
            for key in saved.absent:
                data.pop(key, None)
                tails.pop(key, None)
                cuts.pop(key, None)
            for key, value, tail, cut in saved.known:
                if value is None:
                    data.pop(key, None)
                else:
                    data[key] = value
                if tail is None:
                    tails.pop(key, None)
                else:
                    tails[key] = tail
                if cut is None:
                    cuts.pop(key, None)
                else:
                    cuts[key] = cut

    def inside(self, key: int) -> bool:
        """Whether page ``key`` is known to end inside an index block."""
        return self.record(key) is not None

    def records(self) -> PageRecords:
        """Every page known to end inside an index block, with its record."""
        with self._lock:
            cuts = dict(self._cuts.items)
            tails = {k: t for k, t in self._tails.items.items() if t.tokens}
        return PageRecords(cuts, tails)

    def records_of(self, keys: Iterable[int]) -> dict[int, Tail]:
        """The records of those of ``keys`` that have one."""
        with self._lock:
            cuts, tails = self._cuts.items, self._tails.items
            found = {k: cuts[k] for k in cuts.keys() & keys} if cuts else {}
            if tails:
                found.update((k, tails[k]) for k in tails.keys() & keys if k not in found)
            return found

    def record(self, key: int) -> Tail | None:
        """The record of page ``key`` if it is known to end inside an index block (its
        :attr:`Tail.mapped` says whether the page has a mapping of its own), else ``None``."""
        with self._lock:
            record = self._cuts.items.get(key) or self._tails.items.get(key)
        return record if record is not None and record.tokens else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class PodCaches:
    """One :class:`EngineKeyCache` per pod, filled from what this ingester stored and read."""

    def __init__(
        self, limit: int, cut_limit: int = DEFAULT_PARTIAL_BLOCK_PAGES, journaled: bool = False
    ) -> None:
        self._limit = limit
        self._cut_limit = cut_limit
        self._caches: dict[str, EngineKeyCache] = {}
        self._lock = threading.Lock()
        self.journaled = journaled
        """Whether the pods' page records are kept in a journal (:mod:`kvredis.ingest.journal`):
        a pod's cache then starts by recalling it."""
        self.block_size: int | None = None
        """The index block size, set by the :class:`~kvredis.ingest.planner.Planner` using these
        caches: with it, :meth:`forget_batch` learns the tails of the chains a peer's batch
        extended."""

    def get(self, pod: str) -> EngineKeyCache:
        """The pod's cache (created empty on first use)."""
        with self._lock:
            cache = self._caches.get(pod)
            if cache is None:
                cache = self._caches[pod] = EngineKeyCache(
                    self._limit, self._cut_limit, recalled=not self.journaled
                )
            return cache

    def drop(self, pod: str, tails: bool = True) -> None:
        """Forget the mappings (and with ``tails`` the chain ends) cached for ``pod``: its
        entries, or with ``tails=False`` those of one of its ranks, were cleared."""
        with self._lock:
            cache = self._caches.get(pod)
        if cache is not None:
            cache.forget_mappings(tails)
            if tails and self.journaled:
                cache.recalled = False  # what a peer's journal may hold about its pages

    def forget_batch(self, pod: str, decoded: DecodedBatch) -> None:
        """A batch a peer applied may have changed mappings cached here: drop those, and learn
        the tails of the chains it extended (their bases are read from the index when used), so
        that this replica continues them exactly as the peer would."""
        cache = self.get(pod)
        for event in map(group_keyed, decoded.events):
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
                _learn_tail(cache, event, prior, self.block_size, decoded.engine)


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


def event_extra_keys(ev: BlockStored) -> ExtraKeys:
    """``ev.extra_keys`` decoded (raises InvalidInputError when malformed)."""
    if ev.extra_keys is None:
        return NO_EXTRA_KEYS
    return split_extra_keys(
        None if ev.extra_keys is None else list(ev.extra_keys),
        lora_name=ev.lora_name,
        chain_start=not ev.parent_block_hash,
    )


def _learn_tail(
    cache: EngineKeyCache, ev: BlockStored, prior: Tail | None, bs: int, engine: Engine | None
) -> None:
    """Record the tails ``ev`` leaves (a peer applied it), without hashing or I/O: a block the
    event completes is named by the derived key of the page ending at its boundary."""
    if not ev.token_ids or not ev.block_hashes:
        return
    try:
        extra = event_extra_keys(ev)
    except (ValueError, TypeError):
        return
    mapping = cache.learn_pages(ev.block_size, bs, ev.group_idx, engine)
    fine = mapping is not PageMapping.WHOLE
    if not ev.parent_block_hash:
        prior = Tail(0, ev.lora_name, ev.cache_salt or extra.cache_salt)
    elif prior is None and fine:
        # A parent without a record here continues from a block's end or not at all: its
        # boundary key, mapped only if it ends a block, is the base (read when used).
        prior = Tail(0, ev.lora_name, None, base_engine_key=boundary_key(ev.parent_block_hash))
    elif prior is None:  # where the parent's chain ended is unknown here: learn nothing
        return
    step = advance(prior, ev, extra.features, bs, fine, mapping is not PageMapping.BLOCK_END)
    hashes = ev.block_hashes
    closing = {b.block: boundary_key(hashes[b.page]) for b in step.boundaries}

    def whole_of(cuts: BlockCuts, pages: tuple[int, ...]) -> Tail | None:
        j = cuts.block
        if j == 0:
            return step.whole(j, prior, prior.base, prior.base_engine_key, cuts, pages)
        named = closing.get(j - 1)
        return None if named is None else step.whole(j, prior, 0, named, cuts, pages)

    after = None
    if not step.full or step.last_engine_key is not None:  # else no key names the new base
        after = step.after(prior, 0, step.last_engine_key)
    cache.put_records(step_records(step, hashes, whole_of, after))


def step_records(
    step: Step,
    hashes: tuple[int, ...],
    whole_of: Callable[[BlockCuts, tuple[int, ...]], Tail | None],
    after: Tail | None,
) -> PageRecords:
    """The records ``step`` leaves, page by page: the pages ending inside a completed block share
    ``whole_of(cuts, pages)``, its record (``None``: not known, no record); those ending inside
    the block the chain now ends in share ``after`` with the event's last page, the chain's end
    (``None``: no record)."""
    cuts: dict[int, Tail] = {}
    tails: dict[int, Tail] = {}
    made: list[Tail] = []
    tail_cuts: BlockCuts | None = None
    for bc in step.cuts:
        if bc.block == step.full:
            tail_cuts = bc
            continue
        inside = hashes[bc.first : bc.stop]
        record = whole_of(bc, inside)
        if record is not None:
            made.append(record)
            cuts.update(zip(inside, itertools.repeat(record)))
    if after is None or not hashes:
        return PageRecords(cuts, tails, tuple(made))
    last = hashes[-1]
    if not after.tokens:
        tails[last] = after
        return PageRecords(cuts, tails, tuple(made))
    pages: tuple[int, ...] = (last,)
    tokens: tuple[int, ...] = (len(after.tokens),)
    ids: tuple[int, ...] = (len(after.ids),)
    keys: tuple[int, ...] = (len(after.engine_keys),)
    if tail_cuts is not None:
        pages = hashes[tail_cuts.first : tail_cuts.stop] + pages
        tokens, ids, keys = tail_cuts.tokens + tokens, tail_cuts.ids + ids, tail_cuts.keys + keys
    record = after.holding(pages, tokens, ids, keys)
    made.append(record)
    cuts.update(zip(pages[:-1], itertools.repeat(record)))
    tails[last] = record
    return PageRecords(cuts, tails, tuple(made))


class BlockCuts(NamedTuple):
    """The pages of an event, but its last, that end inside index block ``block`` (numbered from
    the block the chain's tail is in): ``first`` to ``stop`` (indexes into the event's pages),
    the chain after each holding the first ``tokens[i]`` tokens, ``ids[i]`` identifiers and
    ``keys[i]`` engine keys of the block's record (:meth:`Step.whole`, or the tail after the
    event for block :attr:`Step.full`)."""

    block: int
    first: int
    stop: int
    tokens: tuple[int, ...]
    ids: tuple[int, ...]
    keys: tuple[int, ...]

    def counts(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(tokens, ids, keys)``."""
        return self.tokens, self.ids, self.keys


class Boundary(NamedTuple):
    """A page of an event that ends exactly where completed block ``block`` ends."""

    page: int
    block: int


@slot_init
@dataclass(frozen=True, slots=True)
class Step:
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
    cuts: tuple[BlockCuts, ...] = ()
    """Pages but the last ending inside an index block, by block (fine pages only)."""
    boundaries: tuple[Boundary, ...] = ()
    """Pages ending exactly where a completed block ends (fine pages only)."""
    page_keys: tuple[int, ...] = ()
    """The event's engine keys (with ``boundaries``)."""
    mapped: bool = True
    """Whether every page is mapped (``groups`` hold the pages holding each block's tokens);
    else only each block's last page is (``groups`` are empty, to be given its boundary key:
    :attr:`PageMapping.BLOCK_END`)."""

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
            self.mapped,
        )

    def whole(
        self,
        j: int,
        tail: Tail,
        base: int,
        base_engine_key: int | None,
        cuts: BlockCuts | None = None,
        pages: tuple[int, ...] = (),
    ) -> Tail:
        """The record of completed block ``j`` that its cuts share: the chain before it (block
        ``j - 1``'s request key, or ``base_engine_key``'s mapping) and all of the block; with
        ``cuts``, the record of its ``pages`` (:meth:`Tail.holding`)."""
        assert self.groups is not None, "cuts come with groups"
        bs = len(self.chain) // self.full
        feat = self.feats[j] if self.feats is not None else None
        ids = tuple(feat.mm_hashes) if feat is not None else ()
        keys = self.groups[j] if self.mapped else ()
        if cuts is None:
            return Tail(
                base,
                tail.model,
                tail.cache_salt,
                self.chain[j * bs : (j + 1) * bs],
                ids,
                keys,
                base_engine_key,
                self.mapped,
            )
        return Tail(
            base,
            tail.model,
            tail.cache_salt,
            self.chain[j * bs : (j + 1) * bs],
            ids,
            keys,
            base_engine_key,
            self.mapped,
            pages,
            cuts.tokens,
            cuts.ids if ids else (),
            cuts.keys if keys else (),
        )


class _EventPages:
    """Where an event's tokens fall: each engine page's span of tokens, the spans its extra keys
    describe, and the multimodal identifiers of any range of its tokens.

    Extra keys come one per engine page; a list of another length is spread over the index
    blocks as a whole (an event starting at a block boundary: :attr:`realigned`), or else evenly
    over the tokens. Spans are in token order (starts and ends never decrease), so the pages
    overlapping a range are a run, found by bisection (a page-1 event has a span per token).
    """

    __slots__ = ("_bounds", "_even", "_pages", "_spans", "features", "fspans", "realigned", "size")

    def __init__(
        self,
        ev: BlockStored,
        features: list[BlockExtraFeatures | None] | None,
        offset: int,
        full: int,
    ) -> None:
        n, k = len(ev.token_ids), len(ev.block_hashes)
        self.size = (n, k, ev.block_size)
        self._pages = k
        self._even = n // k if k and n and n % k == 0 else 0
        """The tokens of each page when they are all the same (0: not so): then the pages
        overlapping a range are found by division."""
        self._spans: list[tuple[int, int]] | None = None
        self.fspans: list[tuple[int, int]] | None = None
        """The token range each of :attr:`features` describes (``None``: the engine pages')."""
        self.realigned: list[BlockExtraFeatures | None] | None = None
        """The features spread over the completed blocks (then :attr:`features` is None)."""
        if features is not None and len(features) != k:
            if offset == 0:
                self.realigned = realign_extra_features(features, full) if full else None
                features = None
            else:
                self.fspans = _engine_spans(n, len(features), ev.block_size)
        self.features = features
        self._bounds: dict[bool, tuple[list[int], list[int]]] = {}

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The token range ``[start, end)`` of each engine page."""
        if self._spans is None:
            self._spans = _engine_spans(*self.size)
        return self._spans

    @property
    def per_page(self) -> bool:
        """Whether the features come one per engine page."""
        return self.features is not None and self.fspans is None

    def overlapping(self, lo: int, hi: int, features: bool = False) -> range:
        """The pages (or with ``features`` the feature spans) holding any event token in
        ``[lo, hi)``."""
        if features and self.fspans is not None:
            over = self.fspans
        else:
            size = self._even
            if size:
                k = self._pages
                return range(min(lo // size, k), min(-(-hi // size), k))
            over = self.spans
        bounds = self._bounds.get(features)
        if bounds is None:
            bounds = self._bounds[features] = ([s for s, _ in over], [e for _, e in over])
        starts, ends = bounds
        return range(bisect_right(ends, lo), bisect_left(starts, hi))

    def ids_of(self, lo: int, hi: int, head: tuple[MMHash, ...]) -> list[MMHash]:
        """``head`` and then the identifiers of the event's tokens in ``[lo, hi)`` (an item
        running on from one page into the next counted once)."""
        out = list(head)
        features = self.features
        if features is None or lo >= hi:
            return out
        prev: list[MMHash] = list(head)
        for i in self.overlapping(lo, hi, features=True):
            feat = features[i]
            cur = list(feat.mm_hashes) if feat is not None else []
            out.extend(cur[_continued(prev, cur) :])
            prev = cur
        return out


def _page_ends(
    pages: _EventPages, tail: Tail, ev: BlockStored, offset: int, bs: int
) -> tuple[list[BlockCuts], list[Boundary]]:
    """Where each page of an event of fine pages ends: inside a block (a cut, for every page but
    the last) or exactly at a block's end (a boundary)."""
    n = len(ev.block_hashes)
    size = len(ev.token_ids) // n if n else 0
    if (
        pages.features is None
        and pages.realigned is None
        and size > 0
        and size * n == len(ev.token_ids)
        and bs % size == 0
        and offset % size == 0
    ):
        return _even_page_ends(n, size, tail, offset, bs)
    return _any_page_ends(pages, tail, ev, offset, bs)


def _even_page_ends(
    n: int, size: int, tail: Tail, offset: int, bs: int
) -> tuple[list[BlockCuts], list[Boundary]]:
    """:func:`_page_ends` for ``n`` pages of ``size`` tokens dividing the block, the chain's
    tail a whole number of pages and no identifiers to count: arithmetic, block by block (page
    ``i`` ends ``offset + (i + 1) * size`` tokens into the chain)."""
    cuts: list[BlockCuts] = []
    boundaries: list[Boundary] = []
    per_block = bs // size
    last_block = (offset + n * size - 1) // bs
    for j in range(last_block + 1):
        d = (j * bs - offset) // size  # the first page ending past the block's start
        first = max(d, 0)
        end_page = d + per_block - 1  # the page ending at the block's end
        stop = min(end_page, n - 1)
        if end_page < n:
            boundaries.append(Boundary(end_page, j))
        if stop <= first:
            continue
        k = stop - first
        held = len(tail.engine_keys) if j == 0 else 0
        ids = len(tail.ids) if j == 0 else 0
        cuts.append(
            BlockCuts(
                j,
                first,
                stop,
                tuple(range((first - d + 1) * size, (stop - d + 1) * size, size)),
                (ids,) * k if ids else (),
                tuple(range(held + 1, held + k + 1)),
            )
        )
    return cuts, boundaries


def _any_page_ends(
    pages: _EventPages, tail: Tail, ev: BlockStored, offset: int, bs: int
) -> tuple[list[BlockCuts], list[Boundary]]:
    """:func:`_page_ends` in general, page by page: the pages ending in a block are the pages
    overlapping it from the first whose last token is in it (they are contiguous), so a cut's
    engine keys and identifiers are counted on from the previous page's."""
    cuts: list[tuple[int, int, int, int, int]] = []
    boundaries: list[Boundary] = []
    last_page = len(ev.block_hashes) - 1
    features = pages.features
    block, first = -1, 0
    acc: list[MMHash] = []
    prev: list[MMHash] = []
    for i, (s, e) in enumerate(pages.spans):
        if e <= s:
            continue
        j = (offset + e - 1) // bs
        if j != block:
            block, first = j, i
            acc = list(tail.ids) if j == 0 else []
            prev = list(acc)
        if features is not None and pages.per_page:
            feat = features[i]
            cur = list(feat.mm_hashes) if feat is not None else []
            acc.extend(cur[_continued(prev, cur) :])
            prev = cur
        inside = (offset + e) % bs
        if not inside:
            boundaries.append(Boundary(i, j))
        elif i < last_page and pages.realigned is None:
            keys = (len(tail.engine_keys) if j == 0 else 0) + i - first + 1
            if features is not None and not pages.per_page:
                head = tail.ids if j == 0 else ()
                n_ids = len(pages.ids_of(max(j * bs - offset, 0), e, head))
            else:
                n_ids = len(acc)
            cuts.append((i, j, inside, n_ids, keys))
    grouped: list[BlockCuts] = []
    for j, group in itertools.groupby(cuts, key=lambda cut: cut[1]):
        run = list(group)
        grouped.append(
            BlockCuts(
                j,
                run[0][0],
                run[-1][0] + 1,
                tuple(c[2] for c in run),
                tuple(c[3] for c in run),
                tuple(c[4] for c in run),
            )
        )
    return grouped, boundaries


def _block_groups(
    pages: _EventPages,
    tail: Tail,
    ev: BlockStored,
    blocks: list[tuple[int, int]],
    rest_lo: int,
    bs: int,
    fine: bool,
    boundaries: Sequence[Boundary],
    map_pages: bool,
) -> tuple[list[tuple[int, ...]] | None, int | None]:
    """The engine keys holding each completed block's tokens (``None``: the event's pages line
    up with whole blocks, and the index maps them by length ratio), and the engine key whose
    mapping stays the last completed block's request key (see :attr:`Step.last_engine_key`)."""
    hashes = ev.block_hashes
    if not blocks or not hashes:
        return None, None
    if not (tail.tokens or rest_lo < len(ev.token_ids) or fine):
        return None, hashes[-1]  # the ratio mapping maps it to the last block, last
    if map_pages:
        groups = [
            (tail.engine_keys if j == 0 else ())
            + tuple(hashes[i] for i in pages.overlapping(lo, hi))
            for j, (lo, hi) in enumerate(blocks)
        ]
    else:
        groups = [() for _ in blocks]
    if fine:
        closing = [boundary_key(hashes[b.page]) for b in boundaries if b.block == len(blocks) - 1]
        return groups, closing[0] if closing else None
    # An engine block ending inside the last full block maps to it last, and no later block
    # claims it (only the engine blocks of a tail are mapped again).
    inside_last = [i for i, (_, e) in enumerate(pages.spans) if rest_lo - bs < e <= rest_lo]
    return groups, hashes[inside_last[-1]] if inside_last else None


def advance(
    tail: Tail,
    ev: BlockStored,
    features: list[BlockExtraFeatures | None] | None,
    bs: int,
    fine: bool = False,
    map_pages: bool = True,
) -> Step:
    """How ``ev`` extends the chain ending in ``tail`` (index blocks of ``bs`` tokens): the
    blocks it completes with their tokens and features, the engine keys of each, the tail after
    it, and, with ``fine`` pages, where each of its pages ends. No hashing: the caller hashes
    :attr:`Step.chain` on from the tail's base.

    Without ``map_pages`` (:attr:`PageMapping.BLOCK_END`) the pages get no mappings of their
    own: each completed block is mapped from the page ending it alone. An event in which a
    completed block has no such page (pages not dividing the block) is mapped page by page
    instead (see :attr:`Step.mapped`)."""
    offset = len(tail.tokens)
    tokens = ev.token_ids
    n = len(tokens)
    full = (offset + n) // bs
    hashes = ev.block_hashes
    if not offset and not fine and features is None and hashes and n == full * bs:
        # whole blocks from a block's start (vLLM's own block size): nothing left over
        return Step(
            full=full,
            chain=tuple(tokens),
            feats=None,
            groups=None,
            tokens=(),
            ids=(),
            engine_keys=(),
            last_engine_key=hashes[-1] if full else None,
            mapped=map_pages,
        )
    pages = _EventPages(ev, features, offset, full)
    blocks = [(max(j * bs - offset, 0), (j + 1) * bs - offset) for j in range(full)]
    block_feats: list[BlockExtraFeatures | None] = []
    if pages.features is not None or tail.ids:
        for j, (lo, hi) in enumerate(blocks):
            ids = pages.ids_of(lo, hi, tail.ids if j == 0 else ())
            block_feats.append(BlockExtraFeatures(ids) if ids else None)
    rest_lo = max(full * bs - offset, 0)
    rest = pages.overlapping(rest_lo, n)
    cuts: list[BlockCuts] = []
    boundaries: list[Boundary] = []
    if fine and hashes:
        cuts, boundaries = _page_ends(pages, tail, ev, offset, bs)
    if not map_pages and (not fine or len(boundaries) != full):
        return advance(tail, ev, features, bs, fine, map_pages=True)
    if full:
        tail_tokens = tuple(tokens[rest_lo:])
        tail_ids = tuple(pages.ids_of(rest_lo, n, ()))
        tail_keys = tuple(hashes[i] for i in rest) if map_pages else ()
    else:
        tail_tokens = tail.tokens + tuple(tokens)
        tail_ids = tuple(pages.ids_of(rest_lo, n, tail.ids))
        tail_keys = tail.engine_keys + tuple(hashes[i] for i in rest) if map_pages else ()
    groups, last_engine_key = _block_groups(
        pages, tail, ev, blocks, rest_lo, bs, fine, boundaries, map_pages
    )
    return Step(
        full=full,
        chain=tail.tokens + tuple(tokens[:rest_lo]),
        feats=block_feats if any(f is not None for f in block_feats) else pages.realigned,
        groups=groups,
        tokens=tail_tokens,
        ids=tail_ids,
        engine_keys=tail_keys,
        last_engine_key=last_engine_key,
        cuts=tuple(cuts),
        boundaries=tuple(boundaries),
        page_keys=tuple(hashes) if boundaries else (),
        mapped=map_pages,
    )

"""The page journal: what an ingester knows of a pod's pages inside index blocks, kept beside the
index, so that whichever ingester applies the pod's next batch (this one after a restart, a
replica that joined late or took over) continues its chains exactly.

An engine whose pages are finer than index blocks (SGLang's page size 1) hangs a new chain from
any page of a chain it stored long ago, and publishes only that page's 64-bit hash: the block
the child's first tokens complete also holds tokens of the parent's chain, which no event names
again. An ingester remembers, for every page ending inside a block, the chain up to it (a
:class:`~kvredis.ingest.chains.Tail` the block's pages share: the block before and the block's
tokens so far); this module keeps those records in a journal per pod:

* an entry per applied batch (appended by the ingester that applied it): the records the batch
  learned and the pages whose records it dropped (removed, stored again, or, with ``cleared``,
  every page of the pod);
* an ingester *recalls* a pod's journal (replays it into its memory) before it first plans a
  batch of the pod that needs a record (one that continues a chain or removes pages);
* the journal is *compacted* (rewritten as one entry holding what its replay leaves) once this
  process appended :data:`COMPACT_GROWTH` times what the last compaction left, at least
  :data:`COMPACT_MIN_BYTES`.

A record is a function of the engine's tokens alone (page hashes chain over content): replaying
an entry twice, or a duplicate an HA peer appended, changes nothing. A record the journal lacks
(lost with an ingester that died between applying a batch and appending its entry) is a parent
miss for a chain hanging from that page, never a wrong key.

Entry format (msgpack): ``[1, cleared, removed, records]``; ``removed`` holds 8-byte page hashes
(big-endian), each record ``[pages, tokens, ids, keys, base, base_engine_key, model, cache_salt,
block_tokens, block_ids, engine_keys, mapped]``: the pages sharing one block record (8 bytes
each), per page how many of the record's tokens, identifiers and engine keys the chain after it
holds (lists of ints; ``nil`` when the record has none), then the record
(:class:`~kvredis.ingest.chains.Tail`): its tokens as little-endian uint32, its engine keys as
8-byte hashes. At SGLang's page size 1
and 16-token blocks that is about 13 bytes a page: its hash, its token, its token count.
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import weakref
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from kvredis.features import MMHash
from kvredis.ingest.chains import EngineKeyCache, PageRecords, Tail
from kvredis.redis.layout import JOURNAL_KEY_INFIX as LAYOUT_JOURNAL_INFIX

if TYPE_CHECKING:
    from kvredis.memory.index import _MemoryIndex

__all__ = [
    "COMPACT_GROWTH",
    "COMPACT_MIN_BYTES",
    "JOURNAL_KEY_INFIX",
    "ClusterPageJournal",
    "MemoryPageJournal",
    "PageJournal",
    "RedisPageJournal",
    "compact",
    "encode_entry",
    "journal_for",
    "recall",
    "replay",
    "snapshot",
]

FORMAT = 1
COMPACT_MIN_BYTES = 1 << 18
"""A pod's journal is compacted once this process appended at least this much since the last
compaction, and :data:`COMPACT_GROWTH` times what that compaction left."""
COMPACT_GROWTH = 2
"""A compacted journal may grow this many times its size before it is compacted again: the
journal holds at most ``1 + COMPACT_GROWTH`` times what it must (compacting costs about what
appending did, once per this much growth)."""
JOURNAL_KEY_INFIX = LAYOUT_JOURNAL_INFIX.decode()
"""A pod's journal in Redis is the LIST ``<namespace>:pj:<pod>`` (a key of the namespace's
layout: :data:`kvredis.redis.layout.JOURNAL_KEY_INFIX`)."""

_BIG = sys.byteorder == "big"


def _u64s(values: Iterable[int]) -> bytes:
    out = array("Q", values)
    if not _BIG:
        out.byteswap()
    return out.tobytes()


def _from_u64s(raw: bytes) -> list[int]:
    out = array("Q")
    out.frombytes(raw)
    if not _BIG:
        out.byteswap()
    return out.tolist()


def _little(code: str, values: Iterable[int]) -> bytes:
    out = array(code, values)
    if _BIG:
        out.byteswap()
    return out.tobytes()


def _from_little(code: str, raw: bytes) -> list[int]:
    out = array(code)
    out.frombytes(raw)
    if _BIG:
        out.byteswap()
    return out.tolist()


def _fields(
    record: Tail,
    pages: Sequence[int],
    tokens: Sequence[int],
    ids: Sequence[Any],
    keys: Sequence[int],
) -> list[Any]:
    """The journal's array of one record holding ``pages`` (with their tokens, ids, keys)."""
    return [
        _u64s(pages),
        list(tokens),
        list(ids) if ids else None,
        list(keys) if keys else None,
        record.base,
        record.base_engine_key,
        record.model,
        record.cache_salt,
        _little("I", record.tokens),
        [i.hash for i in record.ids] if record.ids else None,
        _u64s(record.engine_keys) if record.engine_keys else None,
        record.mapped,
    ]


def _packed_whole(record: Tail) -> bytes:
    """The packed array of ``record`` holding all its pages (packed once, kept with it)."""
    packed = record.packed
    if packed is None:
        fields = _fields(
            record, record.pages, record.page_tokens, record.page_ids, record.page_keys
        )
        packed = msgpack.packb(fields, use_bin_type=True)
        object.__setattr__(record, "packed", packed)  # a cache: not part of its value
    return packed


def _array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items (the shortest, as ``packb`` writes it)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_entry(
    records: Mapping[int, Tail],
    removed: Iterable[int] = (),
    cleared: bool = False,
    candidates: Iterable[Tail] | None = None,
    whole: bool = False,
) -> bytes:
    """One journal entry: ``cleared`` (forget every record of the pod first), the pages whose
    records go, then ``records`` (page → the record it shares, see
    :class:`~kvredis.ingest.chains.Tail`; a tail without tokens, a block's end, is not
    recorded: the index maps it). ``candidates``: the records of ``records``, when the caller
    knows them (else they are found page by page); ``whole``: the caller knows that every page
    of every candidate maps to it in ``records`` (none was removed or recorded anew since), so
    each is packed whole without looking its pages up.

    The bytes are ``msgpack.packb([FORMAT, cleared, removed, [record arrays]])``, assembled
    from each record's packed array (a record holding all its pages is packed once)."""
    if candidates is None:
        values = list(records.values())
        candidates = dict(zip(map(id, values), values, strict=True)).values()
    out: list[bytes]
    if whole:
        unique = {id(record): record for record in candidates}.values()
        out = [_packed_whole(record) for record in unique if record.tokens]
        return _entry(out, removed, cleared)
    out = []
    done: set[int] = set()
    get = records.get
    for record in candidates:
        if not record.tokens or id(record) in done:
            continue
        done.add(id(record))
        held = list(map(get, record.pages))
        # (by identity, at C speed: comparing a page's other record field by field is slow)
        if list(map(id, held)).count(id(record)) == len(held):
            out.append(_packed_whole(record))
            continue
        out.extend(_packed_part(record, records, held))
    return _entry(out, removed, cleared)


def _packed_part(
    record: Tail, records: Mapping[int, Tail], held: list[Tail | None] | None = None
) -> list[bytes]:
    """The packed array of ``record`` holding those of its pages that ``records`` maps to it
    (``held``: what ``records`` maps its pages to, when known); none when it holds none."""
    if held is None:
        held = list(map(records.get, record.pages))
    keep = [i for i, r in enumerate(held) if r is record]
    if not keep:
        return []
    fields = _fields(
        record,
        tuple(record.pages[i] for i in keep),
        tuple(record.page_tokens[i] for i in keep),
        tuple(record.page_ids[i] for i in keep) if record.page_ids else (),
        tuple(record.page_keys[i] for i in keep) if record.page_keys else (),
    )
    return [msgpack.packb(fields, use_bin_type=True)]


def _entry(records: list[bytes], removed: Iterable[int], cleared: bool) -> bytes:
    """The entry of the packed ``records``, after ``cleared`` and the ``removed`` pages."""
    head: bytes = msgpack.packb([FORMAT, cleared, _u64s(removed)], use_bin_type=True)
    # [FORMAT, cleared, removed] packed, its 3-item header made 4, then the records' array
    return b"".join([b"\x94", head[1:], _array_header(len(records)), *records])


def _decode(blob: bytes) -> tuple[bool, list[int], list[Tail]]:
    fmt, cleared, removed, records = msgpack.unpackb(blob, raw=False)
    if fmt != FORMAT:
        raise ValueError(f"page journal entry of format {fmt!r}, this release reads {FORMAT}")
    out = []
    for pages, t, i, k, base, bek, model, salt, tokens, ids, keys, mapped in records:
        out.append(
            Tail(
                base,
                model,
                salt,
                tuple(_from_little("I", tokens)),
                tuple(MMHash(h) for h in ids) if ids else (),
                tuple(_from_u64s(keys)) if keys else (),
                bek,
                mapped,
                tuple(_from_u64s(pages)),
                tuple(t),
                tuple(i) if i else (),
                tuple(k) if k else (),
            )
        )
    return bool(cleared), _from_u64s(removed), out


def _records_of(record: Tail) -> PageRecords:
    """``record``'s pages: the last ends the chain when its chain holds all the tokens."""
    pages = record.pages
    if pages and record.page_tokens[-1] == len(record.tokens):
        return PageRecords(dict(zip(pages[:-1], itertools.repeat(record))), {pages[-1]: record})
    return PageRecords(dict(zip(pages, itertools.repeat(record))), {})


def replay(cache: EngineKeyCache, blobs: Iterable[bytes]) -> int:
    """Replay journal entries into ``cache``; the number of page records restored (an entry
    that cannot be read is skipped: its records are parent misses later, never wrong keys)."""
    restored = 0
    for blob in blobs:
        try:
            cleared, removed, records = _decode(blob)
        except Exception:
            continue
        if cleared:
            cache.forget_records()
        cache.pop_many(removed)
        for record in records:
            cache.put_records(_records_of(record))
            restored += len(record.pages)
    return restored


def recall(cache: EngineKeyCache, blobs: Iterable[bytes]) -> int:
    """Add to ``cache`` the page records the journal ``blobs`` leave that it does not know (what
    it learned itself is as recent as the journal, or more); how many it added."""
    journal = EngineKeyCache(1 << 62, 1 << 62)
    replay(journal, blobs)
    cuts, tails, _ = journal.records()
    added = PageRecords(
        {page: record for page, record in cuts.items() if cache.get_tail(page) is None},
        {page: record for page, record in tails.items() if cache.get_tail(page) is None},
    )
    cache.put_records(added)
    return len(added.cuts) + len(added.tails)


def compact(blobs: Sequence[bytes]) -> bytes:
    """The journal ``blobs`` as one entry: the records their replay leaves."""
    cache = EngineKeyCache(1 << 62, 1 << 62)
    replay(cache, blobs)
    return snapshot(cache)


def snapshot(cache: EngineKeyCache) -> bytes:
    """What ``cache`` knows of a pod's pages, as one entry that replaces its journal: the bytes
    ``encode_entry`` writes for them, found with a pass or two over the pages at C speed.

    A page the cache holds maps to a record listing it (or to one listing no pages at all), so
    a record that as many pages map to as it lists is held whole: packed as it is, its pages
    not looked up one by one (a pod holds tens of thousands of pages; a compaction of a busy
    pod's journal went by them several times in Python)."""
    cuts, tails, _ = cache.records()
    values = [*cuts.values(), *tails.values()]
    held = collections.Counter(map(id, values))
    records = dict(zip(map(id, values), values, strict=True))
    merged: dict[int, Tail] | None = None
    out: list[bytes] = []
    for rid, record in records.items():
        if not record.tokens:
            continue
        if not record.pages or held[rid] == len(record.pages):
            out.append(_packed_whole(record))
            continue
        if merged is None:
            merged = {**cuts, **tails}
        out.extend(_packed_part(record, merged))
    return _entry(out, (), True)


Snapshot = Callable[[], bytes]
"""The entry that replaces a pod's journal when it holds only what this ingester knows (its
entries, since it recalled or compacted the journal): taken from memory, not by replay."""


class PageJournal(Protocol):
    """Where the journals of the pods of one index are kept."""

    def append(self, entries: Sequence[tuple[str, bytes]]) -> None:
        """Append each ``(pod, entry)`` to that pod's journal (in one round trip)."""
        ...

    def read(self, pod: str) -> list[bytes]:
        """The pod's journal, oldest entry first."""
        ...

    def compact(
        self, pod: str, mine: int | None = None, snapshot: Snapshot | None = None
    ) -> int | None:
        """Rewrite the pod's journal as one entry unless it changed meanwhile: ``snapshot()``
        when it holds exactly ``mine`` entries (all this ingester's), else :func:`compact` of
        them. The size of that entry, or ``None`` when it was not rewritten."""
        ...

    def delete(self, pod: str) -> None:
        """Forget the pod's journal (its entries were cleared)."""
        ...


class MemoryPageJournal:
    """The journals of an embedded index's pods, in the process (kept with the index)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[bytes]] = {}
        self._lock = threading.Lock()

    def append(self, entries: Sequence[tuple[str, bytes]]) -> None:
        with self._lock:
            for pod, entry in entries:
                self._entries.setdefault(pod, []).append(entry)

    def read(self, pod: str) -> list[bytes]:
        with self._lock:
            return list(self._entries.get(pod, ()))

    def compact(
        self, pod: str, mine: int | None = None, snapshot: Snapshot | None = None
    ) -> int | None:
        with self._lock:
            entries = self._entries.get(pod)
            if entries is None or len(entries) < 2:
                return None
            blob = snapshot() if snapshot and mine == len(entries) else compact(entries)
            self._entries[pod] = [blob]
            return len(blob)

    def delete(self, pod: str) -> None:
        with self._lock:
            self._entries.pop(pod, None)

    def size(self, pod: str) -> int:
        """Bytes of the pod's journal."""
        with self._lock:
            return sum(map(len, self._entries.get(pod, ())))


class RedisPageJournal:
    """The journals of a Redis index's pods: a LIST ``<namespace>:pj:<pod>`` each, of the
    entries as they were appended."""

    def __init__(self, client: Any, namespace: str) -> None:
        self._client = client
        self._prefix = namespace.encode("utf-8", "surrogateescape") + JOURNAL_KEY_INFIX.encode()

    def key(self, pod: str) -> bytes:
        """The key of ``pod``'s journal."""
        return self._prefix + pod.encode("utf-8", "surrogateescape")

    def append(self, entries: Sequence[tuple[str, bytes]]) -> None:
        from kvredis.redis.executor import send_commands

        if entries:
            key = self.key
            send_commands(self._client, [(b"RPUSH", key(pod), entry) for pod, entry in entries])

    def read(self, pod: str) -> list[bytes]:
        return list(self._client.lrange(self.key(pod), 0, -1))

    def compact(
        self, pod: str, mine: int | None = None, snapshot: Snapshot | None = None
    ) -> int | None:
        return _compact_watched(self._client, self.key(pod), mine, snapshot)

    def delete(self, pod: str) -> None:
        self._client.delete(self.key(pod))


def _compact_watched(
    client: Any, key: bytes, mine: int | None, snapshot: Snapshot | None
) -> int | None:
    """:meth:`PageJournal.compact` of the LIST ``key`` through ``client`` (a redis-py client of
    the server holding it): read and rewritten under ``WATCH``, so an entry a peer appends
    meanwhile makes the rewrite a no-op (the next compaction includes it)."""
    import redis

    try:
        with client.pipeline(transaction=True) as pipe:
            pipe.watch(key)
            if snapshot is not None and mine is not None and pipe.llen(key) == mine:
                blob = snapshot()
            else:
                entries = pipe.lrange(key, 0, -1)
                if len(entries) < 2:
                    return None
                blob = compact(entries)
            pipe.multi()
            pipe.delete(key)
            pipe.rpush(key, blob)
            pipe.execute()
            return len(blob)
    except redis.WatchError:
        return None  # an entry was appended meanwhile: the next compaction will do


#: The error replies of a node that does not serve a slot now (the slot moved or is moving, or
#: the cluster is down): a compaction skipped, not failed.
_SLOT_MOVING = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"})


class ClusterPageJournal:
    """The journals of a Redis Cluster index's pods: a LIST ``<shard>:pj:<pod>`` each, where
    ``<shard>`` is the namespace of the shard :func:`~kvredis.redis.cluster.shards.pod_shard`
    names for the pod: in the pod layout (``kvredis-cluster/2``) the shard holding every other
    key of the pod, whose slot the journal shares, so a resharding moves it with them. A drop of
    the namespace (which drops each shard's namespace) deletes it.

    Appends, reads and deletions go as waves of the index's executor (redirections and retries
    as for its script calls; the appends of one call to the pods of several nodes in
    parallel). A compaction reads and rewrites under ``WATCH`` on the primary serving the
    journal's slot; while that slot moves between nodes (``MOVED``, ``ASK``, ``TRYAGAIN``) or the
    cluster is down it is skipped (the next one will do); any other error reply raises."""

    def __init__(self, index: Any) -> None:
        self._index = index

    def _where(self, pod: str) -> tuple[int, bytes]:
        from kvredis.redis.cluster.shards import shard_names

        core = self._index.core
        shard = core.pod_shard(pod)
        name = shard_names(core.namespace, core.count)[shard]
        key = (name + JOURNAL_KEY_INFIX + pod).encode("utf-8", "surrogateescape")
        return core.slots[shard], key

    def key(self, pod: str) -> bytes:
        """The key of ``pod``'s journal."""
        return self._where(pod)[1]

    def _wave(self, commands: Sequence[tuple[int, tuple[Any, ...]]]) -> list[Any]:
        from kvredis.redis.cluster.routing import SlotCommand
        from kvredis.redis.requests import Failure

        replies = self._index.executor.wave([SlotCommand(slot, args) for slot, args in commands])
        for reply in replies:
            if isinstance(reply, Failure):
                raise reply
        return list(replies)

    def append(self, entries: Sequence[tuple[str, bytes]]) -> None:
        where = self._where
        commands = []
        for pod, entry in entries:
            slot, key = where(pod)
            commands.append((slot, (b"RPUSH", key, entry)))
        if commands:
            self._wave(commands)

    def read(self, pod: str) -> list[bytes]:
        slot, key = self._where(pod)
        return list(self._wave([(slot, (b"LRANGE", key, 0, -1))])[0])

    def compact(
        self, pod: str, mine: int | None = None, snapshot: Snapshot | None = None
    ) -> int | None:
        import redis

        from kvredis.redis.executor import reply_text

        slot, key = self._where(pod)
        try:
            client = self._index.executor.primary_client(slot)
            return _compact_watched(client, key, mine, snapshot)
        except redis.ResponseError as exc:
            if reply_text(exc).split(" ", 1)[0] in _SLOT_MOVING:
                return None  # the slot is moving or the cluster is down: the next one will do
            raise

    def delete(self, pod: str) -> None:
        slot, key = self._where(pod)
        self._wave([(slot, (b"DEL", key))])


_EMBEDDED: weakref.WeakKeyDictionary[_MemoryIndex, MemoryPageJournal] = weakref.WeakKeyDictionary()
_EMBEDDED_LOCK = threading.Lock()


def journal_for(index: object) -> PageJournal | None:
    """Where ``index``'s pods' journals are kept: beside an embedded index (in the process, so
    that a new ingester on the same index recalls them), in the Redis of a
    :class:`~kvredis.redis.RedisIndex` or in the pods' shards of a
    :class:`~kvredis.redis.RedisClusterIndex`; ``None`` for any other index (an asyncio
    index: an ingester on it that restarts forgets the pages it knew)."""
    from kvredis.memory.index import _MemoryIndex

    observed = sys.modules.get("kvredis.observed")
    if observed is not None:  # metrics and tracing wrap the index: the journal goes beside it
        while isinstance(index, observed.ObservedIndex):
            index = index.wrapped
    if isinstance(index, _MemoryIndex):
        with _EMBEDDED_LOCK:
            journal = _EMBEDDED.get(index)
            if journal is None:
                journal = _EMBEDDED[index] = MemoryPageJournal()
            return journal
    single = sys.modules.get("kvredis.redis.index")
    if single is not None and isinstance(index, single.RedisIndex):
        return RedisPageJournal(index.client, index.namespace)
    cluster = sys.modules.get("kvredis.redis.cluster.index")
    if cluster is not None and isinstance(index, cluster.RedisClusterIndex):
        return ClusterPageJournal(index)
    return None

"""The page journal alone: entries round-trip the page records, replay and compaction leave
what the entries said, and the Redis journal's compaction never loses an entry appended
meanwhile."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvredis.errors import BackendUnavailableError
from kvredis.features import MMHash
from kvredis.ingest import BatchOutcome, EndpointConfig, EventIngester
from kvredis.ingest import backend as backend_module
from kvredis.ingest.chains import EngineKeyCache, PageRecords, Tail
from kvredis.ingest.journal import (
    ClusterPageJournal,
    MemoryPageJournal,
    RedisPageJournal,
    compact,
    encode_entry,
    journal_for,
    recall,
    replay,
    snapshot,
)
from kvredis.ingest.stream import split_position
from kvredis.memory import InMemoryIndex
from kvredis.redis.cluster.slots import key_slot
from kvredis.testing.wire import sglang_batch, sglang_pages
from kvredis.types import PodEntry
from tests.conftest import close_backend, make_backend
from tests.ingest.test_fidelity import MODEL, PROMPT, TP16, sglang_nodes
from tests.servers import local_server_kinds, server_kinds

# The record pages 101-103 share (the chain ends after 103), and a learned chain end (201).
WHOLE = Tail(
    base=2**64 - 5,
    model="lora-a",
    cache_salt="salt",
    tokens=(1, 2, 3, 4, 5, 6),
    ids=(MMHash("img-1"), MMHash("img-2")),
    engine_keys=(11, 12, 13),
    base_engine_key=None,
    mapped=True,
).holding((101, 102, 103), (2, 4, 6), (1, 2, 2), (1, 2, 3))
LEARNED = Tail(0, None, None, (9, 8, 7), (), (), 2**63 + 1, False).holding((201,), (3,), (), ())


def records() -> dict[int, Tail]:
    return {
        101: WHOLE,
        102: WHOLE,
        103: WHOLE,
        201: LEARNED,
        301: Tail(7, None, None),  # a block's end: the index maps it, nothing to record
    }


def known(cache: EngineKeyCache) -> dict[int, Tail | None]:
    return {page: cache.get_tail(page) for page in (101, 102, 103, 201, 301)}


def test_an_entry_round_trips_every_record() -> None:
    cache = EngineKeyCache(64)
    assert replay(cache, [encode_entry(records())]) == 4
    assert known(cache) == {
        101: Tail(WHOLE.base, "lora-a", "salt", (1, 2), (MMHash("img-1"),), (11,)),
        102: Tail(WHOLE.base, "lora-a", "salt", (1, 2, 3, 4), WHOLE.ids, (11, 12)),
        103: Tail(WHOLE.base, "lora-a", "salt", WHOLE.tokens, WHOLE.ids, WHOLE.engine_keys),
        201: Tail(0, None, None, (9, 8, 7), (), (), 2**63 + 1, False),
        301: None,
    }
    assert cache.record(201) == LEARNED and not LEARNED.mapped
    cuts, tails, _ = cache.records()
    assert set(cuts) == {101, 102} and set(tails) == {103, 201}  # chain ends apart


def test_removals_and_clears_replay_in_order() -> None:
    cache = EngineKeyCache(64)
    entries = [
        encode_entry(records()),
        encode_entry({}, removed=[101, 201]),
        encode_entry({201: LEARNED}),
    ]
    replay(cache, entries)
    assert cache.get_tail(101) is None and cache.get_tail(201) == LEARNED.after(201)
    replay(cache, [encode_entry({102: WHOLE}, cleared=True)])
    assert cache.get_tail(103) is None  # every record went with the clear
    assert cache.get_tail(102) == WHOLE.after(102)


def test_a_damaged_entry_is_skipped() -> None:
    cache = EngineKeyCache(64)
    assert replay(cache, [b"\xc1", encode_entry(records())[:-3], encode_entry(records())]) == 4


def test_recall_keeps_what_the_ingester_learned_itself() -> None:
    # The ingester stored page 101 again after the journal said it went: its own record stays.
    cache = EngineKeyCache(64)
    mine = Tail(5, None, None, (42,), (), (), None, False)
    cache.put_records(PageRecords({}, {101: mine}))
    added = recall(cache, [encode_entry(records()), encode_entry({}, removed=[101])])
    assert added == 3
    assert cache.get_tail(101) == mine


def test_compaction_leaves_what_the_entries_leave() -> None:
    entries = [encode_entry(records()), encode_entry({}, removed=[102]), encode_entry({})]
    one, two = EngineKeyCache(64), EngineKeyCache(64)
    replay(one, entries)
    replay(two, [compact(entries)])
    assert known(one) == known(two)
    assert len(compact(entries)) < sum(map(len, entries))


#: Redis backends keeping journals: a real Redis and Valkey, and a local cluster of each whose
#: namespace puts pod-a and pod-b on shards of their own.
STORED = [
    *[pytest.param(f"redis@{k}", marks=pytest.mark.redis) for k in server_kinds()],
    *[
        pytest.param(f"cluster_split@{k}", marks=[pytest.mark.redis, pytest.mark.cluster])
        for k in local_server_kinds()
    ],
]


def stored_journal(index: Any) -> RedisPageJournal | ClusterPageJournal:
    """The journal of a Redis backend, of the class its kind keeps."""
    found = journal_for(index)
    cluster = type(index).__name__ == "RedisClusterIndex"
    assert isinstance(found, ClusterPageJournal if cluster else RedisPageJournal), found
    return found


@pytest.fixture(params=["memory", *STORED])
def journal(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A page journal: beside an embedded index, in a real Redis and Valkey, and in the pods'
    shards of a local cluster of each."""
    if request.param == "memory":
        yield journal_for(InMemoryIndex())
        return
    index = make_backend(request.param, request)
    try:
        found = stored_journal(index)
        yield found
        found.delete("pod-a")
        found.delete("pod-b")
    finally:
        close_backend(index)


def test_a_journal_keeps_each_pods_entries_in_order(journal: Any) -> None:
    journal.append([("pod-a", b"1"), ("pod-b", b"x"), ("pod-a", b"2")])
    journal.append([("pod-a", b"3")])
    assert journal.read("pod-a") == [b"1", b"2", b"3"]
    assert journal.read("pod-b") == [b"x"]
    journal.delete("pod-a")
    assert journal.read("pod-a") == []


def test_compacting_a_journal_rewrites_it_as_one_entry(journal: Any) -> None:
    entries = [encode_entry(records()), encode_entry({}, removed=[103])]
    journal.append([("pod-a", e) for e in entries])
    size = journal.compact("pod-a")
    assert journal.read("pod-a") == [compact(entries)]
    assert size == len(compact(entries))
    assert journal.compact("pod-a") is None  # one entry: nothing to do


@pytest.mark.parametrize("backend", STORED)
def test_an_entry_appended_while_compacting_is_kept(
    request: pytest.FixtureRequest, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer appends between the compaction's read and its rewrite: the rewrite is refused (the
    # journal changed under WATCH), and the next compaction includes the entry.
    index = make_backend(backend, request)
    try:
        journal = stored_journal(index)
        peer = journal_for(index)  # another ingester's journal of the same index
        assert peer is not None and peer is not journal
        entries = [encode_entry(records()), encode_entry({}, removed=[103])]
        journal.append([("pod-a", e) for e in entries])
        late = encode_entry({401: LEARNED.holding((401,), (3,), (), ())})
        import kvredis.ingest.journal as module

        real = module.compact

        def compact_while_a_peer_appends(blobs: Any) -> bytes:
            peer.append([("pod-a", late)])
            return real(blobs)

        monkeypatch.setattr(module, "compact", compact_while_a_peer_appends)
        assert journal.compact("pod-a") is None
        assert journal.read("pod-a") == [*entries, late]
        monkeypatch.setattr(module, "compact", real)
        assert journal.compact("pod-a") is not None
        cache = EngineKeyCache(64)
        replay(cache, journal.read("pod-a"))
        assert cache.get_tail(401) == LEARNED.after(201) and cache.get_tail(103) is None
        journal.delete("pod-a")
    finally:
        close_backend(index)


@pytest.mark.redis
@pytest.mark.cluster
@pytest.mark.parametrize("kind", local_server_kinds())
def test_a_cluster_journal_lives_in_its_pods_shard_and_goes_with_the_namespace(
    request: pytest.FixtureRequest, kind: str
) -> None:
    # Each pod's journal shares the slot of the pod's shard (a resharding moves them together),
    # sits on the primary serving that slot, and is deleted with the namespace.
    index = make_backend(f"cluster_split@{kind}", request)
    try:
        journal = stored_journal(index)
        assert isinstance(journal, ClusterPageJournal)
        journal.append([("pod-a", b"a1"), ("pod-b", b"b1"), ("pod-a", b"a2")])
        core = index.core
        where = {}
        for pod, want in (("pod-a", [b"a1", b"a2"]), ("pod-b", [b"b1"])):
            key = journal.key(pod)
            slot = key_slot(key)
            assert slot == core.slots[core.pod_shard(pod)]
            assert index.executor.primary_client(slot).lrange(key, 0, -1) == want
            where[pod] = (slot, key)
        assert where["pod-a"][0] != where["pod-b"][0]
        index.add([1], [10], [PodEntry("pod-a", "gpu")])
        assert index.drop_namespace() > 0
        for slot, key in where.values():
            assert index.executor.primary_client(slot).exists(key) == 0
    finally:
        close_backend(index)


@pytest.mark.parametrize("page", [1, 4])
def test_a_snapshot_is_the_entry_of_what_the_cache_holds(page: int) -> None:
    # A pod's cache after random radix trees (branches, evictions), then pages forgotten here
    # and there (records some of whose pages went): the snapshot compaction writes is, byte for
    # byte, the entry of every page the cache holds, each record checked page by page.
    from tests.ingest.radix import RadixCache
    from tests.ingest.test_branches import Stream, workload

    rng = random.Random(page)
    caches = {pod: RadixCache(page) for pod in ("pod-a", "pod-b")}
    streams = {pod: Stream(pod, "sglang") for pod in caches}
    ing = EventIngester(InMemoryIndex(), TP16)
    for pod, events in workload(rng, caches, 80):
        streams[pod].send(sglang_batch(events), ing)
    cache = ing._planner.caches.get("pod-a")
    assert cache is not None
    for forget in (False, True):
        if forget:
            cuts, tails, _ = cache.records()
            cache.pop_many(rng.sample(sorted(cuts), len(cuts) // 5))
        cuts, tails, _ = cache.records()
        whole = encode_entry({**cuts, **tails}, cleared=True)
        assert snapshot(cache) == whole
        replayed = EngineKeyCache(1 << 30, 1 << 30)
        replay(replayed, [whole])
        again = replayed.records()
        for mine, theirs in ((cuts, again.cuts), (tails, again.tails)):
            assert {p: r.after(p) for p, r in theirs.items()} == {
                p: r.after(p) for p, r in mine.items()
            }


@pytest.mark.redis
@pytest.mark.cluster
def test_a_cluster_compaction_on_a_node_that_lost_the_slot_is_skipped(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # While the journal's slot moves, the node the slot map names answers MOVED: the compaction
    # is skipped (the next one will do) and the journal keeps every entry.
    import redis

    index = make_backend(f"cluster_split@{local_server_kinds()[0]}", request)
    try:
        journal = stored_journal(index)
        entries = [encode_entry(records()), encode_entry({}, removed=[103])]
        journal.append([("pod-a", e) for e in entries])
        slot = key_slot(journal.key("pod-a"))
        owner = index.executor.slot_map.primary(slot)
        other = next(r.primary for r in index.executor.slot_map.ranges if r.primary != owner)
        wrong = redis.Redis(host=other.host, port=other.port)
        monkeypatch.setattr(index.executor, "primary_client", lambda _slot: wrong)
        assert journal.compact("pod-a") is None
        wrong.close()
        assert journal.read("pod-a") == entries
        monkeypatch.undo()
        assert journal.compact("pod-a") == len(compact(entries))
        assert journal.read("pod-a") == [compact(entries)]
    finally:
        close_backend(index)


@pytest.mark.redis
@pytest.mark.cluster
def test_a_cluster_compaction_raises_what_is_no_moving_slot(
    request: pytest.FixtureRequest,
) -> None:
    # Only a moving slot or a cluster down skips a compaction: any other error reply (here the
    # journal's key holding a string) raises, as on one server, for the ingester to report.
    import redis

    index = make_backend(f"cluster_split@{local_server_kinds()[0]}", request)
    try:
        journal = stored_journal(index)
        key = journal.key("pod-a")
        index.executor.primary_client(key_slot(key)).set(key, b"not a list")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            journal.compact("pod-a")
    finally:
        close_backend(index)


@pytest.mark.parametrize("backend", ["memory", *STORED])
def test_a_journal_is_kept_beside_an_index_behind_metrics(
    request: pytest.FixtureRequest, backend: str
) -> None:
    # kvredis ingest --metrics-port wraps the index in InstrumentedIndex: the journal is the
    # wrapped index's, not none.
    from prometheus_client import CollectorRegistry

    from kvredis.metrics import InstrumentedIndex

    index = make_backend(backend, request)
    try:
        inner = journal_for(index)
        wrapped = InstrumentedIndex(InstrumentedIndex(index), registry=CollectorRegistry())
        found = journal_for(wrapped)
        assert found is not None and type(found) is type(inner)
        found.append([("pod-a", b"entry")])
        assert inner is not None and inner.read("pod-a") == [b"entry"]
        # and ingesters on the wrapper that restart now and then continue every branch
        from tests.ingest.radix import RadixCache
        from tests.ingest.test_branches import Stream, misses, workload

        rng = random.Random(5)
        caches = {pod: RadixCache(1) for pod in ("pod-a", "pod-b")}
        streams = {pod: Stream(pod, "sglang") for pod in caches}
        ingesters = [EventIngester(wrapped, TP16)]
        for n, (pod, events) in enumerate(workload(rng, caches, 40)):
            if n and n % 5 == 0:
                ingesters.append(EventIngester(wrapped, TP16))
            streams[pod].send(sglang_batch(events), ingesters[-1])
        assert len(ingesters) >= 5 and misses(*ingesters) == 0
    finally:
        close_backend(index)


def test_the_embedded_journal_stays_with_its_index() -> None:
    index = InMemoryIndex()
    first = journal_for(index)
    assert isinstance(first, MemoryPageJournal)
    assert journal_for(index) is first
    assert journal_for(InMemoryIndex()) is not first
    assert journal_for(object()) is None


def test_a_journal_only_this_ingester_wrote_is_compacted_from_its_memory(journal: Any) -> None:
    # Two entries, both this ingester's: the compaction writes what its memory holds. With a
    # peer's entry among them, the count does not match and the journal is replayed instead.
    entries = [encode_entry(records()), encode_entry({}, removed=[103])]
    journal.append([("pod-a", e) for e in entries])
    memory = encode_entry({201: LEARNED}, cleared=True)
    assert journal.compact("pod-a", 2, lambda: memory) == len(memory)
    assert journal.read("pod-a") == [memory]
    journal.append([("pod-a", entries[0]), ("pod-a", entries[1])])
    assert journal.compact("pod-a", 2, lambda: memory) is not None  # 3 entries: replayed
    assert journal.read("pod-a") == [compact([memory, *entries])]


# -- batches applied together: the journal holds exactly the batches that took effect ---------


def _journaled(index: Any, pod: str) -> set[int]:
    """The pages whose records the pod's journal holds."""
    journal = journal_for(index)
    assert journal is not None
    cache = EngineKeyCache(1 << 30, 1 << 30)
    replay(cache, journal.read(pod))
    return set(cache.records().cuts) | set(cache.records().tails)


def _known(ing: EventIngester, pod: str) -> set[int]:
    records = ing._planner.caches.get(pod).records()
    return set(records.cuts) | set(records.tails)


def test_a_group_whose_reply_was_lost_is_journaled_and_counted_as_applied() -> None:
    # The index applies a group of fast batches and the reply is lost; the retry finds every
    # batch applied already. They are this ingester's: journaled, counted applied (the stored
    # marks say so), and an ingester started afterwards continues a branch from inside them.
    index = InMemoryIndex()
    real = index.apply_batch
    lose = {"armed": False}

    def applies_then_loses_the_reply(*args: Any, **kwargs: Any) -> bool:
        applied = real(*args, **kwargs)
        if lose["armed"]:
            lose["armed"] = False
            raise BackendUnavailableError("connection reset after the script ran")
        return applied

    index.apply_batch = applies_then_loses_the_reply  # type: ignore[method-assign]
    ep = EndpointConfig("eng-a", pod_id="pod-a", model_name=MODEL, engine="sglang")
    payloads = sglang_nodes((7, 20, 37, 9, 23, 5, 11), 1, PROMPT, 2**63 + 1)
    ing = EventIngester(index, TP16, endpoints=[ep])
    outcomes = [ing.process(b"", s, payloads[s], ep.endpoint) for s in range(2)]
    lose["armed"] = True
    outcomes += ing.process_many([(b"", s, payloads[s], ep) for s in range(2, 7)])
    assert lose["armed"] is False  # the group's reply was lost
    assert outcomes == [BatchOutcome.APPLIED] * 7
    assert ing.counters.get("batches_applied") == 7
    assert ing.counters.get("batches_duplicate") == 0
    assert _journaled(index, "pod-a") == _known(ing, "pod-a")
    # a fresh ingester: a branch from the page holding token 30 (inside block 2, batch 2's)
    events, _ = sglang_pages(tuple(range(5000, 5040)), 1, 2**63 + 10_000, 2**63 + 1 + 30)
    again = EventIngester(index, TP16, endpoints=[ep])
    assert again.process(b"", 7, sglang_batch(events), ep.endpoint) is BatchOutcome.APPLIED
    assert again.counters.get("parent_misses") == 0


def test_a_batch_of_a_group_that_never_applied_is_not_journaled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two streams of one pod; the group's call fails, and stream y's batch then fails for
    # good. A compaction from the ingester's memory (forced at every append) happens while the
    # group is undone: the journal never holds y's batch, whose records the ingester dropped.
    monkeypatch.setattr(backend_module, "COMPACT_MIN_BYTES", 1)
    monkeypatch.setattr(backend_module, "COMPACT_GROWTH", 0)
    xs = sglang_nodes((7, 20, 9), 1, tuple(range(1000, 1100)), 2**63 + 1)
    ys = sglang_nodes((7, 20, 9), 1, tuple(range(7000, 7100)), 2**63 + 100_000)
    y_last = set(range(2**63 + 100_000 + 27, 2**63 + 100_000 + 36))
    index = InMemoryIndex()
    real = index.apply_batch
    fail = {"group": False}

    def flaky(ops: Any = None, stream: Any = None, watermark: Any = None) -> bool:
        if fail["group"]:
            fail["group"] = False
            raise RuntimeError("a script error")
        if stream == "eng-y" and watermark is not None and split_position(watermark.seq)[0] >= 2:
            raise RuntimeError("this batch cannot be applied")
        return real(ops, stream, watermark)

    index.apply_batch = flaky  # type: ignore[method-assign]
    ex = EndpointConfig("eng-x", pod_id="pod-a", model_name=MODEL, engine="sglang", stream="eng-x")
    ey = EndpointConfig("eng-y", pod_id="pod-a", model_name=MODEL, engine="sglang", stream="eng-y")
    ing = EventIngester(index, TP16, endpoints=[ex, ey])
    for s in range(2):
        assert ing.process(b"", s, xs[s], ex.endpoint) is BatchOutcome.APPLIED
        assert ing.process(b"", s, ys[s], ey.endpoint) is BatchOutcome.APPLIED
    fail["group"] = True
    outcomes = ing.process_many([(b"", 2, xs[2], ex), (b"", 2, ys[2], ey)])
    assert outcomes == [BatchOutcome.APPLIED, BatchOutcome.FAILED]
    assert not _known(ing, "pod-a") & y_last
    assert not _journaled(index, "pod-a") & y_last
    assert _journaled(index, "pod-a") == _known(ing, "pod-a")


def _reference_entry(
    records: dict[int, Tail], removed: list[int], cleared: bool, order: list[Tail]
) -> bytes:
    """The entry format spelled out: ``[FORMAT, cleared, removed, [record arrays]]``, each
    record with the pages of ``records`` it holds, packed in one ``msgpack.packb``."""
    import array
    import sys

    import msgpack

    from kvredis.ingest.journal import FORMAT

    def u64s(values: Any) -> bytes:
        out = array.array("Q", values)
        if sys.byteorder == "little":
            out.byteswap()
        return out.tobytes()

    def u32s(values: Any) -> bytes:
        out = array.array("I", values)
        if sys.byteorder == "big":
            out.byteswap()
        return out.tobytes()

    arrays = []
    for record in order:
        keep = [i for i, p in enumerate(record.pages) if records.get(p) is record]
        if not record.tokens or not keep:
            continue
        ids = [record.page_ids[i] for i in keep] if record.page_ids else None
        keys = [record.page_keys[i] for i in keep] if record.page_keys else None
        arrays.append(
            [
                u64s([record.pages[i] for i in keep]),
                [record.page_tokens[i] for i in keep],
                ids,
                keys,
                record.base,
                record.base_engine_key,
                record.model,
                record.cache_salt,
                u32s(record.tokens),
                [i.hash for i in record.ids] if record.ids else None,
                u64s(record.engine_keys) if record.engine_keys else None,
                record.mapped,
            ]
        )
    packed: bytes = msgpack.packb([FORMAT, cleared, u64s(removed), arrays], use_bin_type=True)
    return packed


@pytest.mark.parametrize("count", [0, 1, 15, 16, 300, 70_000])
def test_an_entry_is_the_format_byte_for_byte(count: int) -> None:
    """Records are packed once and their bytes reused: the entry is still exactly the format's
    msgpack, whatever the number of records (array headers of each size) and twice over."""
    import random

    rng = random.Random(count)
    records: dict[int, Tail] = {}
    order: list[Tail] = []
    page = 1
    for n in range(count):
        size = rng.randrange(1, 4)
        tail = Tail(n, "m" if n % 3 else None, "s" if n % 5 == 0 else None, (n % 7, 1, 2, 3))
        pages = tuple(range(page, page + size))
        page += size
        tail = tail.holding(pages, tuple(range(1, size + 1)), (), tuple(p + 9 for p in pages))
        order.append(tail)
        held = pages if n % 4 else pages[:1]  # some records hold only part of their pages
        records.update(dict.fromkeys(held, tail))
    removed = [rng.randrange(2**64) for _ in range(rng.randrange(0, 5))]
    for cleared in (False, True, False):
        expected = _reference_entry(records, removed, cleared, order)
        assert encode_entry(records, removed, cleared, candidates=order) == expected
        assert encode_entry(records, removed, cleared) == expected

"""The page journal alone: entries round-trip the page records, replay and compaction leave
what the entries said, and the Redis journal's compaction never loses an entry appended
meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvredis.features import MMHash
from kvredis.ingest.chains import EngineKeyCache, PageRecords, Tail
from kvredis.ingest.journal import (
    MemoryPageJournal,
    RedisPageJournal,
    compact,
    encode_entry,
    journal_for,
    recall,
    replay,
)
from kvredis.memory import InMemoryIndex
from tests.conftest import close_backend, make_backend
from tests.servers import server_kinds

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


@pytest.fixture(params=["memory", *[f"redis@{k}" for k in server_kinds()]])
def journal(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A page journal: beside an embedded index, and in a real Redis and Valkey."""
    if request.param == "memory":
        yield journal_for(InMemoryIndex())
        return
    index = make_backend(request.param, request)
    try:
        found = journal_for(index)
        assert isinstance(found, RedisPageJournal)
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


@pytest.mark.parametrize("kind", server_kinds())
def test_an_entry_appended_while_compacting_is_kept(
    request: pytest.FixtureRequest, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A peer appends between the compaction's read and its rewrite: the rewrite is refused (the
    # journal changed under WATCH), and the next compaction includes the entry.
    index = make_backend(f"redis@{kind}", request)
    try:
        journal = journal_for(index)
        assert isinstance(journal, RedisPageJournal)
        entries = [encode_entry(records()), encode_entry({}, removed=[103])]
        journal.append([("pod-a", e) for e in entries])
        late = encode_entry({401: LEARNED.holding((401,), (3,), (), ())})
        import kvredis.ingest.journal as module

        real = module.compact

        def compact_while_a_peer_appends(blobs: Any) -> bytes:
            index.client.rpush(journal.key("pod-a"), late)
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

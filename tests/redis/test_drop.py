"""drop_namespace: removes exactly one namespace, and the clients keep working afterwards."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from kvredis import (
    AddOp,
    AsyncRedisIndex,
    KVRedisError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.ingest.journal import journal_for
from kvredis.redis.codec import escape_glob
from kvredis.redis.config import config_for_existing
from kvredis.redis.layout import Layout, check_namespace

pytestmark = pytest.mark.redis

P = PodEntry("pod-a", "gpu")


def test_drop_namespace_spares_prefix_sharing_namespaces_and_foreign_keys(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    mine = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    longer = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace + "x"))
    try:
        raw.set(f"foreign-{namespace}", b"1")
        mine.add(list(range(1, 200)), list(range(1000, 1199)), [P])
        longer.add([1], [1000], [P])
        before_longer = set(raw.scan_iter(match=f"{namespace}x:*"))
        deleted = mine.drop_namespace()
        assert deleted > 0
        assert list(raw.scan_iter(match=f"{namespace}:*")) == []
        assert set(raw.scan_iter(match=f"{namespace}x:*")) == before_longer
        assert raw.get(f"foreign-{namespace}") == b"1"
        assert longer.lookup([1000]) == {1000: [P]}
        assert mine.lookup(list(range(1000, 1199))) == {}
        mine.add([7], [8], [P])
        assert mine.lookup([8]) == {8: [P]}
        assert mine.get_request_key(7) == 8
    finally:
        raw.delete(f"foreign-{namespace}")
        mine.drop_namespace()
        longer.drop_namespace()
        for c in (mine, longer):
            c.close()
        raw.close()


async def test_async_drop_namespace(redis_server_url: str, namespace: str) -> None:
    index = AsyncRedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    try:
        await index.add([1, 2], [3, 4], [P])
        assert await index.drop_namespace() > 0
        assert await index.lookup([3, 4]) == {}
    finally:
        await index.aclose()


# Pairs of names where one extends the other: the names accepted now, and those (with ':' or a
# glob character) that an earlier kvredis created, which ``kvredis drop`` still deletes.
NESTED_NAMES = [
    ("kv", "kvx"),
    ("kv", "kv-prod"),
    ("kv-prod", "kv"),
    ("kv", "kv:prod"),
    ("kv", "kv:meta"),
    ("kv", "kv:pe"),
    ("kv", "kv:wm"),
    ("kv", "kv:rr"),
    ("kv:prod", "kv"),
    ("a*b", "a*b:x"),
    ("kv", "kv:cc"),
    ("x", "x:"),
    ("kv", "kv:pjx"),
    ("kv:pjx", "kv"),
]


def _dump(raw: redis.Redis, namespace: str) -> dict[bytes, bytes]:
    """DUMP of every key of the namespace (exactly its layout's keys, nothing of longer names)."""
    layout = Layout(namespace, 16, b"")
    pattern = escape_glob(namespace.encode() + b":") + b"*"
    return {
        k: raw.dump(k)  # type: ignore[misc]
        for k in raw.scan_iter(match=pattern, count=1000)
        if layout.owns(k)
    }


@pytest.mark.parametrize(("dropped", "kept"), NESTED_NAMES)
def test_drop_and_clear_never_touch_a_namespace_whose_name_extends_theirs(
    redis_server_url: str, dropped: str, kept: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    dropped, kept = f"kvt-{tag}-{dropped}", f"kvt-{tag}-{kept}"
    raw = redis.Redis.from_url(redis_server_url)
    base = RedisIndexConfig(address=redis_server_url)
    one = RedisIndex(config_for_existing(base, dropped))
    other = RedisIndex(config_for_existing(base, kept))
    try:
        for idx in (one, other):
            idx.add([1, 2], [10, 20], [P, PodEntry("pod-b", "cpu")])
            idx.apply_batch([AddOp(None, (30,), (P,))], "s", Watermark(1, 1))
        before = _dump(raw, kept)
        assert before
        one.clear("pod-a")
        one.drop_namespace()
        after = _dump(raw, kept)
        assert set(after) == set(before), f"drop of {dropped!r} deleted keys of {kept!r}"
        assert after == before
        both = [P, PodEntry("pod-b", "cpu")]
        assert other.lookup([10, 20, 30]) == {10: both, 20: both, 30: [P]}
    finally:
        for idx in (one, other):
            idx.drop_namespace()
            idx.close()
        raw.close()


def test_drop_deletes_the_pods_page_journals(redis_server_url: str, namespace: str) -> None:
    # The page journals the ingesters keep beside the index (<ns>:pj:<pod>) are keys of the
    # namespace: dropped with it, never those of a namespace whose name extends it.
    raw = redis.Redis.from_url(redis_server_url)
    mine = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    longer = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace + "x"))
    try:
        journals = [journal_for(idx) for idx in (mine, longer)]
        for idx, journal in zip((mine, longer), journals, strict=True):
            assert journal is not None
            idx.add([1], [10], [P])
            journal.append([("pod-a", b"entry"), ("pod:b", b"entry")])
        own = [f"{namespace}:pj:pod-a".encode(), f"{namespace}:pj:pod:b".encode()]
        assert all(Layout(namespace, 16, b"").owns(k) for k in own)
        assert raw.exists(*own) == 2
        assert mine.drop_namespace() > 0
        assert raw.exists(*own) == 0
        assert journals[1] is not None and journals[1].read("pod:b") == [b"entry"]
    finally:
        mine.drop_namespace()
        longer.drop_namespace()
        for c in (mine, longer):
            c.close()
        raw.close()


@pytest.mark.parametrize("name", ["kv:pj", "kv:pj:x", "a:pj:pj"])
def test_an_old_name_that_would_own_a_shorter_namespaces_journals_is_refused(name: str) -> None:
    with pytest.raises(KVRedisError, match="':pj:'"):
        check_namespace(name)


def _race_trial(url: str) -> list[str]:
    """Three writers keep interning new entries while the namespace is dropped under them;
    returns the lookups afterwards that gave an entry not added under that key (or raised)."""
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    cfg = RedisIndexConfig(address=url, namespace=namespace)
    added: dict[int, set[PodEntry]] = {}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            with RedisIndex(cfg) as idx:
                i = 0
                while not stop.is_set():
                    key = (w << 32) + i
                    entry = PodEntry(f"w{w}-{i}", "gpu")
                    with lock:
                        added.setdefault(key, set()).add(entry)
                    idx.add([key], [key], [entry])
                    i += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.15)
    with RedisIndex(cfg) as dropper:
        dropper.drop_namespace()
    time.sleep(0.15)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    wrong: list[str] = []
    with RedisIndex(cfg) as reader:
        for key in sorted(added):
            try:
                found = reader.lookup([key]).get(key, [])
            except KVRedisError as exc:
                wrong.append(f"key {key:#x} raised {exc!r}")
                continue
            wrong += [f"key {key:#x} returned {e}" for e in found if e not in added[key]]
        reader.drop_namespace()
    return wrong


def test_drop_racing_writers_never_makes_a_lookup_return_an_entry_not_added_there(
    redis_server_url: str,
) -> None:
    wrong = [w for _ in range(6) for w in _race_trial(redis_server_url)]
    assert wrong == [], f"{len(wrong)} wrong answers, e.g. {wrong[:3]}"

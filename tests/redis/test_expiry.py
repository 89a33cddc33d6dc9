"""Speculative entries with a ttl in Redis and Valkey: the server deletes them by itself.

Each test runs on redis-server 7.0 (expiring bucket keys with a TTL) and on Valkey 9 (hash
field expiry); after the ttl the test makes no write at all and polls until the namespace is
back to what it held before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import redis

from kvredis import KeyType, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.redis import ops
from kvredis.redis.inspect import Inspector, Problem, op_check, op_dump, op_restore, op_stats
from kvredis.redis.layout import EXPIRY_FIELD, EXPIRY_KEY, Layout
from tests.conftest import drop_keys
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

SPEC = PodEntry("pod-a", speculative=True)
SPEC_C = PodEntry("pod-c", speculative=True)
CONFIRMED = PodEntry("pod-b", "gpu")
#: Longest a test waits for the server to delete what expired.
RECLAIM_WITHIN = 5.0


@pytest.fixture
def clients(redis_server_url: str, namespace: str) -> Iterator[tuple[redis.Redis, RedisIndex]]:
    """A plain client and an index on a fresh namespace."""
    raw = redis.Redis.from_url(redis_server_url)
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace)) as index:
        yield raw, index


def eventually(condition: Callable[[], bool], within: float = RECLAIM_WITHIN) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the server did not reclaim the expired entries"
        time.sleep(0.05)


def snapshot(raw: redis.Redis, namespace: str) -> dict[bytes, tuple[bytes, dict[bytes, bytes]]]:
    """Every key of the namespace with its type and (hash) content."""
    out = {}
    for key in raw.scan_iter(match=f"{namespace}:*"):
        kind = raw.type(key)
        out[key] = (kind, raw.hgetall(key) if kind == b"hash" else {})
    return out


def expiring_keys(raw: redis.Redis, namespace: str) -> list[bytes]:
    layout = Layout(namespace, 16, b"")
    return [*raw.scan_iter(match=layout.expiring_pattern()), *raw.keys(layout.sx)]


def mode_of(server_kind: str) -> str | None:
    return {"redis": EXPIRY_KEY, "valkey": EXPIRY_FIELD}.get(server_kind)


def test_expired_entries_vanish_without_any_write_and_memory_returns_to_baseline(
    own_redis_server: RedisServer, namespace: str
) -> None:
    # a server of its own: its memory is compared with a baseline, which other tests' keys and
    # scripts on a shared server would move
    redis_server_url, server_kind = own_redis_server.url, own_redis_server.kind
    raw = redis.Redis.from_url(redis_server_url)
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    try:
        meta = raw.hgetall(f"{namespace}:meta")
        if mode_of(server_kind):
            assert meta[b"expiry"].decode() == mode_of(server_kind)
        confirmed = list(range(1, 201))
        index.add(list(range(10_001, 10_201)), confirmed, [CONFIRMED])
        # The speculative entry's definition (one per pod, like every entry) stays; define it
        # before the baseline so that only what expires is compared.
        index.add(None, [5_000_000], [SPEC])
        index.evict(5_000_000, KeyType.REQUEST, [SPEC])
        before = snapshot(raw, namespace)
        layout = index._session.state.layout
        usage = {k: raw.memory_usage(k, samples=0) for k in before}

        spec_keys = [*confirmed[:100], *range(1_000_000, 1_000_500)]
        index.add(None, spec_keys, [SPEC], ttl=0.3)
        assert index.lookup(spec_keys[100:103]) == {k: [SPEC] for k in spec_keys[100:103]}
        assert index.lookup(confirmed[:1]) == {1: [CONFIRMED, SPEC]}
        assert index.score(confirmed[:3]) == {"pod-b": 3.0, "pod-a": 3.0}
        # Confirmed entries stay in compact (listpack) request buckets.
        assert raw.object("encoding", layout.request_bucket(1)) == b"listpack"
        assert len(expiring_keys(raw, namespace)) > 1
        time.sleep(0.3)
        # Never returned after the ttl, before the server deleted anything ...
        assert index.lookup(spec_keys[100:]) == {}
        assert index.lookup(confirmed) == {k: [CONFIRMED] for k in confirmed}
        assert index.score(confirmed[:3]) == {"pod-b": 3.0}
        # ... and deleted by the server itself: no write since the add.
        eventually(lambda: not expiring_keys(raw, namespace))
        assert snapshot(raw, namespace) == before
        assert {k: raw.memory_usage(k, samples=0) for k in before} == usage
        assert index.lookup(confirmed) == {k: [CONFIRMED] for k in confirmed}
    finally:
        index.close()


def test_lookups_without_live_expiring_entries_read_only_the_request_buckets(
    redis_server_url: str, namespace: str
) -> None:
    """Once every expiring entry has expired, reads cost what they cost in a namespace that never
    had one: the same commands (one HGET per key walked), plus one EXISTS of the gate per call."""
    raw = redis.Redis.from_url(redis_server_url)
    control_ns = f"{namespace}-control"
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    control = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=control_ns))

    def read_commands(ix: RedisIndex) -> dict[str, int]:
        raw.config_resetstat()
        ix.lookup([1, 2, 3, 4])
        ix.score([1, 2, 3, 4])
        stats = raw.info("commandstats")
        return {k: v["calls"] for k, v in stats.items() if k != "cmdstat_config"}

    try:
        for ix in (index, control):
            ix.add(None, [1, 2, 3], [CONFIRMED])
            ix.add(None, [7], [SPEC])
        index.add(None, [8], [SPEC], ttl=0.2)
        eventually(lambda: not expiring_keys(raw, namespace))
        commands = read_commands(index)
        assert commands == read_commands(control)
        assert commands["cmdstat_exists"] == 2
    finally:
        index.close()
        control.close()
        drop_keys(redis_server_url, control_ns)


def test_evict_removes_expiring_entries_and_their_deadlines(
    clients: tuple[redis.Redis, RedisIndex], namespace: str
) -> None:
    raw, index = clients
    index.add([100], [1, 2], [CONFIRMED])
    before = snapshot(raw, namespace)
    index.add(None, [1, 2, 3], [SPEC, SPEC_C], ttl=600)
    index.evict(3, KeyType.REQUEST, [SPEC])
    index.evict(100, KeyType.ENGINE, [SPEC, CONFIRMED])
    layout = index._session.state.layout
    assert index.lookup([1, 2, 3]) == {1: [SPEC_C], 2: [SPEC_C], 3: [SPEC_C]}
    for key in (1, 2, 3):
        items = raw.hget(layout.expiring_bucket(key), key.to_bytes(8, "big"))
        assert items is not None and len(items) == 12  # pod-c's id and deadline only
    index.evict(3, KeyType.REQUEST, [SPEC_C])
    index.evict(1, KeyType.REQUEST, [SPEC_C])
    index.evict(2, KeyType.REQUEST, [SPEC_C])
    assert index.lookup([1]) == {}
    assert not list(raw.scan_iter(match=layout.expiring_pattern()))
    after = snapshot(raw, namespace)
    # the request buckets are gone with their entries; the mapping of engine key 100 stays, as
    # in InMemoryIndex: pod-c's expiring entries still held its request keys when it was
    # evicted by engine key. Else only the dictionary, the meta record and the gate (which
    # expires with the ttl) are left
    assert index.get_request_key(100) == 2
    assert {k for k in after if k != layout.sx and not k.startswith(layout.eprefix)} == {
        k for k in before if not k.startswith((layout.rprefix, layout.eprefix))
    }


def test_clear_removes_the_pods_expiring_entries_and_reclaims_their_definitions(
    clients: tuple[redis.Redis, RedisIndex], namespace: str
) -> None:
    raw, index = clients
    index.add(None, list(range(1, 50)), [SPEC, SPEC_C], ttl=600)
    index.add(None, list(range(1, 10)), [CONFIRMED])
    index.clear("pod-a")
    layout = index._session.state.layout
    assert index.lookup([1, 20]) == {1: [CONFIRMED, SPEC_C], 20: [SPEC_C]}
    for key in raw.scan_iter(match=layout.expiring_pattern()):
        for items in raw.hgetall(key).values():
            assert len(items) == 12
    index.clear("pod-c")
    assert not list(raw.scan_iter(match=layout.expiring_pattern()))
    assert raw.hkeys(layout.pp) == [b"pod-b"]
    assert index.lookup([1, 20]) == {1: [CONFIRMED]}


def test_a_confirmation_replaces_the_expiring_entry_and_does_not_expire(
    clients: tuple[redis.Redis, RedisIndex], namespace: str
) -> None:
    raw, index = clients
    confirmed = PodEntry("pod-a", "gpu")
    index.add(None, [1, 2], [SPEC], ttl=0.3)
    index.add([9], [1], [confirmed])
    layout = index._session.state.layout
    assert raw.hget(layout.expiring_bucket(1), (1).to_bytes(8, "big")) is None
    assert index.lookup([1, 2]) == {1: [confirmed], 2: [SPEC]}
    eventually(lambda: not expiring_keys(raw, namespace))
    assert index.lookup([1, 2]) == {1: [confirmed]}


def test_without_field_expiry_a_write_drops_the_past_due_items_of_its_bucket(
    redis_server_url: str, server_kind: str, namespace: str
) -> None:
    """A bucket kept alive by new expiring entries keeps no expired ones (bounded memory)."""
    raw = redis.Redis.from_url(redis_server_url)
    config = RedisIndexConfig(address=redis_server_url, namespace=namespace, bucket_bits=1)
    index = RedisIndex(config)
    try:
        index.add(None, [2, 4, 6], [SPEC], ttl=0.1)  # one bucket: even keys
        time.sleep(0.15)
        index.add(None, [8], [SPEC], ttl=600)
        layout = index._session.state.layout
        bucket = layout.expiring_bucket(8)
        if mode_of(server_kind) == EXPIRY_KEY:
            assert raw.hkeys(bucket) == [(8).to_bytes(8, "big")]
            assert 0 < raw.pttl(bucket) <= 600_000
        eventually(lambda: raw.hkeys(bucket) == [(8).to_bytes(8, "big")])
        assert index.lookup([8]) == {8: [SPEC]}
    finally:
        index.close()


def test_a_read_only_replica_reads_expiring_entries_and_drops_them_after_the_ttl(
    own_redis_server: RedisServer,
) -> None:
    replica = RedisServer(own_redis_server.kind)
    replica.start()
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    primary_raw, replica_raw = (
        redis.Redis(port=own_redis_server.port),
        redis.Redis(port=replica.port),
    )
    writer = RedisIndex(RedisIndexConfig(address=own_redis_server.url, namespace=namespace))
    reader = None
    try:
        replica_raw.replicaof("127.0.0.1", own_redis_server.port)
        up = "master_link_status"
        eventually(lambda: replica_raw.info("replication").get(up) == "up", within=20)
        writer.add(None, [1, 2], [CONFIRMED])
        writer.add(None, [1, 2, 3], [SPEC], ttl=1.0)
        added = time.monotonic()
        eventually(lambda: replica_raw.exists(f"{namespace}:sx") == 1)
        reader = RedisIndex(RedisIndexConfig(address=replica.url, namespace=namespace))
        assert reader.lookup([1, 2, 3]) == {1: [CONFIRMED, SPEC], 2: [CONFIRMED, SPEC], 3: [SPEC]}
        time.sleep(max(0.0, added + 1.0 - time.monotonic()))
        assert reader.lookup([1, 2, 3]) == {1: [CONFIRMED], 2: [CONFIRMED]}
        assert reader.score([1, 2, 3]) == {"pod-b": 2.0}
        # the primary deletes them and the deletes reach the replica
        eventually(lambda: not expiring_keys(primary_raw, namespace))
        eventually(lambda: not replica_raw.keys(f"{namespace}:s*"))
    finally:
        if reader is not None:
            reader.close()
        writer.close()
        replica.close()


def test_check_finds_an_expiring_bucket_the_server_would_keep_and_dump_restore_keeps_expiry(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    config = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    copy_ns = f"{namespace}-copy"
    index = RedisIndex(config)
    try:
        index.add(None, [1, 2], [SPEC], ttl=600)
        layout = index._session.state.layout
        bucket, field = layout.expiring_bucket(1), (1).to_bytes(8, "big")
        fields_expire = raw.hget(layout.meta, "expiry") == EXPIRY_FIELD.encode()
        with Inspector(config) as inspector:
            assert inspector.run(op_check(layout)).findings == []
            stats = inspector.run(op_stats(layout, memory=False))
            assert (stats.expiring_entries, stats.pairs) == (2, 0)
            records: list[Mapping[str, Any]] = []
            inspector.run(op_dump(layout, records.append))
            if fields_expire:
                raw.execute_command("HPERSIST", bucket, "FIELDS", 1, field)
            else:
                raw.persist(bucket)
            report = inspector.run(op_check(layout, repair=True))
            assert [f.problem for f in report.findings] == [Problem.NO_EXPIRY]
            assert report.ok
            assert inspector.run(op_check(layout)).findings == []
            inspector.run(op_restore(f"{copy_ns}:".encode(), records))
        copy = Layout(copy_ns, layout.bucket_bits, b"")
        for key in (1, 2):
            pair = (copy.expiring_bucket(key), layout.expiring_bucket(key))
            if fields_expire:
                when = [raw.execute_command("HPEXPIRETIME", k, "FIELDS", 1, field) for k in pair]
            else:
                when = [raw.execute_command("PEXPIRETIME", k) for k in pair]
            assert when[0] == when[1] and when[0] != -1
        assert raw.get(copy.sx) == raw.get(layout.sx)
    finally:
        index.close()
        drop_keys(redis_server_url, copy_ns)


def test_a_lost_meta_record_heals_with_the_namespaces_expiry_mode(
    clients: tuple[redis.Redis, RedisIndex],
    redis_server_url: str,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raw, index = clients
    index.add(None, [1], [SPEC], ttl=600)
    layout = index._session.state.layout
    mode = raw.hget(layout.meta, "expiry")
    assert raw.hget(layout.pi, "expiry") == mode
    raw.delete(layout.meta)
    other = EXPIRY_FIELD if mode == EXPIRY_KEY.encode() else EXPIRY_KEY
    monkeypatch.setattr(ops, "expiry_mode_of", lambda _info: other)
    config = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    with RedisIndex(config) as healed:
        assert raw.hget(layout.meta, "expiry") == mode
        assert healed.lookup([1]) == {1: [SPEC]}

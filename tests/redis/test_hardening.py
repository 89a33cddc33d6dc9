"""What an unlucky operator, a failover and a hostile publisher do to the index (each case
reproduced against a real server, redis-server and Valkey)."""

from __future__ import annotations

import http.server
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    AsyncRedisIndex,
    BackendOutOfMemoryError,
    BackendUnavailableError,
    EvictOp,
    KeyType,
    NamespaceLayoutError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    UnsafeServerConfigError,
    Watermark,
)
from kvredis.redis import ops, program
from kvredis.redis.layout import Layout
from kvredis.redis.session import op_send
from tests.redis.failover import failover_ride_out
from tests.servers import Proxy, RedisServer

pytestmark = pytest.mark.redis

A = PodEntry("pod-a", "gpu")
B = PodEntry("pod-b", "cpu")


@pytest.fixture
def raw(redis_server_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server_url)
    yield client
    client.close()


@pytest.fixture
def cfg(redis_server_url: str, namespace: str) -> RedisIndexConfig:
    return RedisIndexConfig(address=redis_server_url, namespace=namespace)


def _namespace_keys(raw: redis.Redis, namespace: str) -> dict[bytes, object]:
    layout = Layout(namespace, 16, b"")
    out: dict[bytes, object] = {}
    for key in raw.scan_iter(match=layout.namespace_pattern(), count=1000):
        if layout.owns(key) and key != layout.meta:
            kind = raw.type(key)
            out[key] = (
                raw.hgetall(key)
                if kind == b"hash"
                else raw.lrange(key, 0, -1)
                if kind == b"list"
                else raw.get(key)
            )
    return out


# 3. Losing <ns>:meta alone must heal, for old and new clients alike.
def test_losing_the_meta_record_alone_heals(cfg: RedisIndexConfig, raw: redis.Redis) -> None:
    with RedisIndex(cfg) as old:
        old.add([1, 2], [10, 20], [A])
        old.add(None, [30], [B])
        raw.delete(f"{cfg.namespace}:meta")
        with RedisIndex(cfg) as new:
            assert new.lookup([10, 20, 30]) == {10: [A], 20: [A], 30: [B]}
        assert old.lookup([10, 20]) == {10: [A], 20: [A]}
        # new entries never reuse an id of the lost record
        old.add(None, [40], [PodEntry("pod-c", "gpu")])
        assert old.lookup([10, 40]) == {10: [A], 40: [PodEntry("pod-c", "gpu")]}
        assert old.lookup([30]) == {30: [B]}


# 4. A call that fails partway must write nothing.
@pytest.mark.parametrize("foreign", ["string", "list"])
def test_a_foreign_key_of_the_wrong_type_on_a_bucket_fails_the_batch_before_any_write(
    cfg: RedisIndexConfig, raw: redis.Redis, foreign: str
) -> None:
    with RedisIndex(cfg) as index:
        index.add(None, [5], [A])
        layout = Layout(cfg.namespace, index.bucket_bits, b"")
        bad = layout.request_bucket(77)
        if foreign == "string":
            raw.set(bad, "foreign")
        else:
            raw.rpush(bad, "foreign")
        before = _namespace_keys(raw, cfg.namespace)
        batch = [
            AddOp(None, (1, 2, 3), (A, PodEntry("pod-new", "gpu"))),
            EvictOp(5, KeyType.REQUEST, (A,)),
            AddOp(None, (77,), (B,)),
        ]
        with pytest.raises(NamespaceLayoutError):
            index.apply_batch(batch, "s", Watermark(1, 1))
        assert _namespace_keys(raw, cfg.namespace) == before
        assert index.get_watermark("s") is None
        with pytest.raises(NamespaceLayoutError):
            index.add([9], [1, 77], [B])
        assert _namespace_keys(raw, cfg.namespace) == before


def test_an_exhausted_id_space_found_while_interning_writes_nothing(
    cfg: RedisIndexConfig, raw: redis.Redis
) -> None:
    with RedisIndex(cfg) as index:
        index.add(None, [5], [A])
        meta, pi = f"{cfg.namespace}:meta", f"{cfg.namespace}:pi"
        top = 2**32 - 1
        # room for two ids by next_id, but one of them is already defined (a recreated record)
        raw.hset(meta, "next_id", top - 2)
        raw.hset(pi, (top - 1).to_bytes(4, "big"), raw.hget(pi, (1).to_bytes(4, "big")) or b"")
        before = _namespace_keys(raw, cfg.namespace)
        with pytest.raises(NamespaceLayoutError, match="id space"):
            index.apply_batch(
                [AddOp(None, (1,), (B,)), AddOp(None, (2,), (PodEntry("p", "t"),))],
                "s",
                Watermark(1, 1),
            )
        assert _namespace_keys(raw, cfg.namespace) == before
        assert raw.hget(meta, "next_id") == str(top - 2).encode()


# 5. A batch whose first reply was lost is reported as applied.
def test_a_batch_whose_reply_was_lost_is_reported_applied(
    redis_server_url: str, namespace: str
) -> None:
    port = int(redis_server_url.rsplit(":", 1)[1])
    proxy = Proxy(port)
    cfg = RedisIndexConfig(
        address=proxy.url, namespace=namespace, retries=3, retry_backoff=0.01, socket_timeout=2
    )
    try:
        with RedisIndex(cfg) as index:
            proxy.lose_next_reply(b"stream-lost")
            assert index.apply_batch([AddOp(None, (1,), (A,))], "stream-lost", Watermark(1, 1))
            assert proxy.lost == 1
            assert index.get_watermark("stream-lost") == Watermark(1, 1)
            # another sender's resend of the same watermark is still skipped
            with RedisIndex(cfg) as other:
                batch = [AddOp(None, (2,), (A,))]
                assert not other.apply_batch(batch, "stream-lost", Watermark(1, 1))
            assert index.lookup([2]) == {}
    finally:
        proxy.close()


# 6. Under maxmemory with noeviction: readers start and read, evict and clear work, adds fail
# with a clear error; a reader starts and reads on a read-only replica.
def _own_config(server: RedisServer, **kwargs: Any) -> RedisIndexConfig:
    base: dict[str, Any] = dict(
        address=server.url,
        namespace=f"kvt-{uuid.uuid4().hex[:12]}",
        retries=1,
        retry_backoff=0.01,
        socket_timeout=2.0,
    )
    return RedisIndexConfig(**(base | kwargs))


def test_out_of_memory_readers_start_evict_and_clear_work_adds_fail_clearly(
    own_redis_server: RedisServer,
) -> None:
    cfg = _own_config(own_redis_server)
    admin = redis.Redis(port=own_redis_server.port)
    try:
        with RedisIndex(cfg) as writer:
            writer.add([1, 2], [10, 20], [A, B])
            writer.add(None, [30], [B])
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)
            with RedisIndex(cfg) as reader:
                assert reader.lookup([10, 20]) == {10: [A, B], 20: [A, B]}
            with pytest.raises(BackendOutOfMemoryError, match="out of memory"):
                writer.add(None, [40], [A])
            writer.evict(1, KeyType.ENGINE, [A])
            assert writer.lookup([10]) == {10: [B]}
            writer.clear("pod-b")
            assert writer.lookup([10, 20, 30]) == {}
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()


def test_a_reader_starts_and_reads_on_a_read_only_replica(own_redis_server: RedisServer) -> None:
    cfg = _own_config(own_redis_server)
    replica = RedisServer(own_redis_server.kind)
    replica.start()
    admin = redis.Redis(port=replica.port)
    try:
        with RedisIndex(cfg) as writer:
            writer.add([1], [10], [A])
        admin.replicaof("127.0.0.1", own_redis_server.port)
        deadline = time.monotonic() + 10
        while admin.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "replica did not sync"
            time.sleep(0.05)
        while not admin.exists(f"{cfg.namespace}:meta"):
            assert time.monotonic() < deadline, "replica did not sync"
            time.sleep(0.05)
        with RedisIndex(replace(cfg, address=replica.url)) as reader:
            assert reader.lookup([10]) == {10: [A]}
            with pytest.raises(BackendUnavailableError, match="READONLY"):
                reader.add(None, [20], [A])
    finally:
        admin.close()
        replica.close()


# 7. A failover (primary demoted, replica promoted, the address moved) is ridden out.
def test_a_failover_is_ridden_out_within_retries(own_redis_server: RedisServer) -> None:
    longest, errors, missing = failover_ride_out(own_redis_server)
    assert errors == []
    assert missing == 0
    assert longest > 0


# 9. The eviction policy is checked when connecting.
def test_an_allkeys_eviction_policy_warns_or_raises_with_strict(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    try:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        cfg = _own_config(own_redis_server)
        with caplog.at_level(logging.WARNING), RedisIndex(cfg):
            pass
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("allkeys-lru" in m and "noeviction" in m for m in warned), warned
        with pytest.raises(UnsafeServerConfigError, match="allkeys-lru"):
            RedisIndex(replace(cfg, strict=True))
        caplog.clear()
        admin.config_set("maxmemory-policy", "volatile-lru")
        with caplog.at_level(logging.WARNING), RedisIndex(replace(cfg, strict=True)):
            pass
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


# 13. A port that is not Redis: one BackendUnavailableError naming the address.
def test_a_port_that_is_not_redis_is_a_backend_unavailable_error_naming_it() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        for password in ("", ":p@ss-word"):
            host = f"127.0.0.1:{port}"
            address = f"redis://user{password}@{host}" if password else host
            cfg = RedisIndexConfig(address=address, retries=1, socket_timeout=1.0)
            with pytest.raises(BackendUnavailableError) as info:
                RedisIndex(cfg)
            assert f"127.0.0.1:{port}" in str(info.value)
            assert "p@ss" not in str(info.value) and "ss-word" not in str(info.value)
    finally:
        server.shutdown()
        server.server_close()


async def test_async_a_port_that_is_not_redis_is_a_backend_unavailable_error() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        cfg = RedisIndexConfig(address=f"127.0.0.1:{port}", retries=0, socket_timeout=1.0)
        with pytest.raises(BackendUnavailableError, match=f"127.0.0.1:{port}"):
            await AsyncRedisIndex.create(cfg)
    finally:
        server.shutdown()
        server.server_close()


# 8. Bounded work per call: large adds and batches go in parts; a batch still applies once.
def _expected_after(index: RedisIndex, keys: list[int]) -> dict[int, list[PodEntry]]:
    return {k: v for k in keys for k, v in index.lookup([k]).items()}


def test_a_batch_in_parts_applies_at_most_once_and_survives_a_crash_between_parts(
    cfg: RedisIndexConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(program, "CALL_BUDGET", 8)
    keys = list(range(1, 41))
    batch: list[Any] = [AddOp([1000 + k], (k,), (A,)) for k in keys]
    batch += [EvictOp(k, KeyType.REQUEST, (A,)) for k in keys[:10]]
    batch += [AddOp(None, tuple(keys[:5]), (B,))]
    with RedisIndex(cfg) as index:
        state = index._session.state
        assert len(ops.batch_programs(state.layout, batch)) > 5
        # a publisher dies after the first two parts of its batch
        op = ops.op_apply_batch(state, batch, "s", Watermark(1, 1))
        for request in (next(op), op.send(1)):
            assert index._exec.run(op_send(index._session, request)) == 1
        op.close()
        assert index.get_watermark("s") is None
        # its replacement sends the same batch again: applied whole, exactly as in one call
        assert index.apply_batch(batch, "s", Watermark(1, 1))
        assert index.get_watermark("s") == Watermark(1, 1)
        result = _expected_after(index, keys)
        assert result == {k: [B] for k in keys[:5]} | {k: [A] for k in keys[10:]}
        assert all(index.get_request_key(1000 + k) == k for k in keys)
        # and once only
        assert not index.apply_batch(batch[:1], "s", Watermark(1, 1))
        # a part whose reply was lost is recognised, not applied again
        op = ops.op_apply_batch(
            state, [EvictOp(11, KeyType.REQUEST, (A,)), *batch[:20]], "s", Watermark(1, 2)
        )
        first = next(op)
        assert index._exec.run(op_send(index._session, first)) == 1
        assert index._exec.run(op_send(index._session, first)) == 1
        with pytest.raises(StopIteration):
            request: Any = op.send(1)
            while True:
                assert index._exec.run(op_send(index._session, request)) == 1
                request = op.send(1)
        assert index.get_watermark("s") == Watermark(1, 2)


def check_huge_add_applied_whole(index: Any) -> None:
    """20,000 request keys under one engine key (far beyond one call's budget) are all added;
    the evict by that engine key reaches its most recent 1024 only."""
    keys = list(range(1, 20_001))
    index.add([7], keys, [A])
    found = index.lookup(keys)
    assert len(found) == len(keys) and found[keys[-1]] == [A]
    assert index.get_request_key(7) == keys[-1]
    index.evict(7, KeyType.ENGINE, [A])
    # the engine key maps to its most recent 1024 request keys only
    assert index.lookup(keys[-1024:]) == {}
    assert index.lookup(keys[:1]) == {1: [A]}
    assert len(index.lookup(keys[:-1024])) == len(keys) - 1024


def test_a_huge_add_under_one_engine_key_is_applied_whole(cfg: RedisIndexConfig) -> None:
    with RedisIndex(cfg) as index:
        check_huge_add_applied_whole(index)


# 11. Cleared pods leave the entry dictionary; ids are never reused.
def _definitions(raw: redis.Redis, namespace: str) -> tuple[int, int, int]:
    pi = [k for k in raw.hkeys(f"{namespace}:pi") if len(k) == 4]
    return len(pi), raw.hlen(f"{namespace}:pe"), raw.hlen(f"{namespace}:pp")


def test_cleared_pods_leave_the_entry_dictionary_and_ids_are_never_reused(
    cfg: RedisIndexConfig, raw: redis.Redis
) -> None:
    pods = [PodEntry(f"pod-{i}", "gpu") for i in range(200)]
    with RedisIndex(cfg) as index, RedisIndex(cfg) as other:
        for i, pod in enumerate(pods):
            index.add([i], [i], [pod, A])
        assert other.lookup([0]) == {0: [pods[0], A]}  # other caches pod-0's id
        for pod in pods:
            index.clear(pod.pod_identifier)
        assert _definitions(raw, cfg.namespace) == (1, 1, 1)  # only pod-a's entry is left
        assert index.lookup([0, 1]) == {0: [A], 1: [A]}
        index.add(None, [5000], [pods[0]])  # interned again, under a new id
        assert raw.hget(f"{cfg.namespace}:meta", "next_id") == b"202"
        for client in (index, other, RedisIndex(cfg)):
            assert client.lookup([5000]) == {5000: [pods[0]]}
            assert client.lookup([0]) == {0: [A]}


def test_an_id_re_added_while_its_pod_was_cleared_is_skipped_not_an_error(
    cfg: RedisIndexConfig, raw: redis.Redis
) -> None:
    pod = PodEntry("pod-x", "gpu")
    with RedisIndex(cfg) as index:
        index.add(None, [1, 2], [pod, A])
        layout = Layout(cfg.namespace, index.bucket_bits, b"")
        bucket = layout.request_bucket(1)
        field = (1).to_bytes(8, "big")
        held = raw.hget(bucket, field)
        index.clear("pod-x")
        raw.hset(bucket, field, held or b"")  # what a racing add stored after the clear passed
        for client in (index, RedisIndex(cfg)):
            assert client.lookup([1, 2]) == {1: [A], 2: [A]}
            assert client.score([1, 2]) == {"pod-a": 2.0}

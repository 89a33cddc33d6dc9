"""The hardening cases of ``tests/redis/test_hardening.py`` that apply to a cluster, against
RedisClusterIndex on real redis-server 7 and Valkey 9 clusters, and what only a cluster does to
the index: scripts flushed on every node, a shard's slot resharded while in use, a slot no node
serves.

A cluster namespace is shards, each a complete single-server namespace in one slot, every pod
living in one shard (see :mod:`kvredis.redis.cluster.shards`): what the single-server suite says
of "the namespace" holds here of each shard, and each shard's part of a call is its own atomic
step.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    BackendOutOfMemoryError,
    BackendUnavailableError,
    EvictOp,
    KeyType,
    NamespaceLayoutError,
    PodEntry,
    RedisIndexConfig,
    UnsafeServerConfigError,
    Watermark,
)
from kvredis.redis import program
from kvredis.redis.cluster import writes as cluster_writes
from kvredis.redis.cluster.index import AsyncRedisClusterIndex, RedisClusterIndex
from kvredis.redis.cluster.routing import Wave
from kvredis.redis.functions import function_name
from kvredis.redis.layout import Layout
from kvredis.redis.requests import ConnectionLost, ErrorReply
from tests.conftest import TEST_PREFIX
from tests.redis.test_hardening import _namespace_keys, check_huge_add_applied_whole
from tests.servers import LocalCluster

A = PodEntry("pod-a", "gpu")
A_CPU = PodEntry("pod-a", "cpu")
B = PodEntry("pod-b", "cpu")


@pytest.fixture
def cfg(redis_cluster: LocalCluster) -> RedisIndexConfig:
    return RedisIndexConfig(
        address=redis_cluster.url,
        namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}",
        cluster_shards=8,
        retries=4,
        retry_backoff=0.02,
    )


@pytest.fixture
def index(cfg: RedisIndexConfig) -> Iterator[RedisClusterIndex]:
    with RedisClusterIndex(cfg) as built:
        yield built
        built.drop_namespace()


@contextmanager
def _node(index: RedisClusterIndex, shard: int) -> Iterator[redis.Redis]:
    """A plain client of the primary serving ``shard``."""
    port = index.executor.slot_map.primary(index.core.slots[shard]).port
    client = redis.Redis(port=port)
    try:
        yield client
    finally:
        client.close()


def _shard_of(index: RedisClusterIndex, entry: PodEntry) -> int:
    """The shard every entry of ``entry``'s pod lives in."""
    return index.core.pod_shard(entry.pod_identifier)


def _pod_on(
    index: RedisClusterIndex, shard: int, tier: str = "gpu", prefix: str = "pod"
) -> PodEntry:
    """An entry of a pod placed on ``shard``."""
    n = 0
    while index.core.pod_shard(f"{prefix}-{n}") != shard:
        n += 1
    return PodEntry(f"{prefix}-{n}", tier)


def _pod_off(
    index: RedisClusterIndex, shard: int, tier: str = "gpu", prefix: str = "pod"
) -> PodEntry:
    """An entry of a pod placed on another shard than ``shard``."""
    n = 0
    while index.core.pod_shard(f"{prefix}-{n}") == shard:
        n += 1
    return PodEntry(f"{prefix}-{n}", tier)


def _layout(index: RedisClusterIndex, shard: int) -> Layout:
    return index.core.state(shard).layout


def _shard_keys(index: RedisClusterIndex, shard: int) -> dict[bytes, object]:
    """Every key of one shard but its meta record, with its value."""
    with _node(index, shard) as raw:
        return _namespace_keys(raw, _layout(index, shard).namespace)


def _found(index: RedisClusterIndex, keys: Sequence[int]) -> dict[int, list[PodEntry]]:
    """The entries of each key on its own (not cut at the chain's first miss)."""
    return {k: v for key in keys for k, v in index.lookup([key]).items()}


# -- the single-server cases, per shard --------------------------------------------------------


def test_losing_a_shards_meta_record_alone_heals(
    index: RedisClusterIndex, cfg: RedisIndexConfig
) -> None:
    index.add([1, 2], [10, 20], [A])
    index.add(None, [30], [B])
    shard = _shard_of(index, A)
    with _node(index, shard) as raw:
        assert raw.delete(_layout(index, shard).meta) == 1
    with RedisClusterIndex(cfg) as new:
        assert new.lookup([10, 20, 30]) == {10: [A], 20: [A], 30: [B]}
    assert index.lookup([10, 20]) == {10: [A], 20: [A]}
    # new entries never reuse an id of the lost record
    c = _pod_on(index, shard, prefix="pod-c")
    forty = 40
    index.add(None, [forty], [c])
    assert index.lookup([10]) == {10: [A]} and index.lookup([forty]) == {forty: [c]}
    assert index.lookup([30]) == {30: [B]}


@pytest.mark.parametrize("foreign", ["string", "list"])
def test_a_foreign_key_of_the_wrong_type_fails_the_call_and_its_shard_writes_nothing(
    index: RedisClusterIndex, foreign: str
) -> None:
    """The shard holding the foreign key writes nothing. The other shards' segments are their
    own atomic steps, sent in the same wave: they are applied (and their watermarks advanced),
    and once the foreign key is gone the same batch is taken by the failed shard only."""
    bad_key = 77
    bad_pod = _pod_on(index, 0, "cpu", prefix="bad")  # the foreign key's shard
    shard = _shard_of(index, bad_pod)
    other, new = _pod_off(index, shard), _pod_off(index, shard, prefix="new")
    keys = list(range(1, 7))
    index.add(None, [5], [bad_pod])
    bad = _layout(index, shard).request_bucket(bad_key)
    with _node(index, shard) as raw:
        if foreign == "string":
            raw.set(bad, "foreign")
        else:
            raw.rpush(bad, "foreign")
    before = _shard_keys(index, shard)
    batch = [
        AddOp(None, tuple(keys), (other, new)),
        EvictOp(5, KeyType.REQUEST, (bad_pod,)),
        AddOp(None, (bad_key,), (bad_pod,)),
    ]
    index.core.stream_homes["s"] = shard  # the batch's verdict is the failed shard's
    with pytest.raises(NamespaceLayoutError):
        index.apply_batch(batch, "s", Watermark(1, 1))
    assert _shard_keys(index, shard) == before
    found = {k: set(v) for k, v in _found(index, keys).items()}  # the other shards' parts
    assert found == {k: {other, new} for k in keys} | {5: {bad_pod, other, new}}
    with pytest.raises(NamespaceLayoutError):
        index.add([9], [keys[0], bad_key], [bad_pod, other])
    assert _shard_keys(index, shard) == before  # other's part of the add is applied
    with _node(index, shard) as raw:
        raw.delete(bad)
    assert index.apply_batch(batch, "s", Watermark(1, 1))
    assert index.get_watermark("s") == Watermark(1, 1)
    found = {k: set(v) for k, v in _found(index, [*keys, bad_key]).items()}
    assert found == {k: {other, new} for k in keys} | {bad_key: {bad_pod, other}}
    # the others' shards took the batch once: a resend is skipped everywhere
    assert not index.apply_batch(batch, "s", Watermark(1, 1))


def test_an_exhausted_id_space_found_while_interning_writes_nothing_on_that_shard(
    index: RedisClusterIndex,
) -> None:
    shard = _shard_of(index, A)
    index.add(None, [5], [A])
    layout = _layout(index, shard)
    top = 2**32 - 1
    with _node(index, shard) as raw:
        # room for two ids by next_id, but one of them is already defined (a recreated record)
        raw.hset(layout.meta, "next_id", top - 2)
        pi = layout.meta[: -len(b"meta")] + b"pi"
        raw.hset(pi, (top - 1).to_bytes(4, "big"), raw.hget(pi, (1).to_bytes(4, "big")) or b"")
    before = _shard_keys(index, shard)
    one, two = 100, 101
    with pytest.raises(NamespaceLayoutError, match="id space"):
        index.apply_batch(
            [AddOp(None, (one,), (A_CPU,)), AddOp(None, (two,), (replace(A, device_tier="t"),))],
            "s",
            Watermark(1, 1),
        )
    assert _shard_keys(index, shard) == before
    with _node(index, shard) as raw:
        assert raw.hget(layout.meta, "next_id") == str(top - 2).encode()


def _mentions(arg: object, text: str) -> bool:
    if isinstance(arg, str):
        return text in arg
    return isinstance(arg, (bytes, bytearray, memoryview)) and text.encode() in bytes(arg)


def test_a_batch_whose_reply_was_lost_is_reported_applied(
    index: RedisClusterIndex, cfg: RedisIndexConfig
) -> None:
    """The wave carrying the batch reaches the node, and its reply is lost (what a cut
    connection does): the batch is sent again with the same token, which the pod's shard
    recognises as applied already."""
    stream = "stream-lost"
    home = _shard_of(index, A)
    home_node = index.executor.slot_map.primary(index.core.slots[home])
    exec_ = index.executor
    send = exec_._send
    lost: list[int] = []

    def lossy(wave: Wave) -> list[list[Any]]:
        replies = send(wave)
        marked = any(_mentions(arg, stream) for b in wave.batches for c in b.commands for arg in c)
        if marked and not lost:
            for i, batch in enumerate(wave.batches):
                if batch.node == home_node:
                    lost.append(len(replies[i]))
                    replies[i] = [ConnectionLost("reply lost")] * len(replies[i])
        return replies

    exec_._send = lossy  # type: ignore[method-assign]
    try:
        assert index.apply_batch([AddOp(None, (1,), (A,))], stream, Watermark(1, 1))
    finally:
        del exec_._send
    assert lost  # the reply was lost, and the batch still reported applied
    assert index.get_watermark(stream) == Watermark(1, 1)
    assert index.lookup([1]) == {1: [A]}
    # another sender's resend of the same watermark is still skipped
    with RedisClusterIndex(cfg) as other:
        assert not other.apply_batch([AddOp(None, (2,), (A,))], stream, Watermark(1, 1))
    assert index.lookup([2]) == {}


@contextmanager
def _out_of_memory(cluster: LocalCluster) -> Iterator[None]:
    primaries = [p for p, (role, _, _) in cluster.topology().items() if role == "master"]
    admins = [cluster.client(port) for port in primaries]
    try:
        for admin in admins:
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)
        yield
    finally:
        for admin in admins:
            admin.config_set("maxmemory", 0)
            admin.close()


def test_out_of_memory_readers_start_evict_and_clear_work_adds_fail_clearly(
    index: RedisClusterIndex, cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    index.add([1, 2], [10, 20], [A, B])
    index.add(None, [30], [B])
    with _out_of_memory(redis_cluster):
        with RedisClusterIndex(replace(cfg, retries=1)) as reader:
            assert reader.lookup([10, 20]) == {10: [A, B], 20: [A, B]}
            assert reader.score([10, 20]) == pytest.approx({"pod-a": 2.0, "pod-b": 1.6})
        with pytest.raises(BackendOutOfMemoryError, match="out of memory"):
            index.add(None, [40], [A])
        index.evict(1, KeyType.ENGINE, [A])
        assert index.lookup([10]) == {10: [B]}
        index.evict(20, KeyType.REQUEST, [A])
        assert index.lookup([20]) == {20: [B]}
        index.clear("pod-b")
        assert index.lookup([10, 20, 30]) == {}


def test_an_allkeys_eviction_policy_on_any_primary_warns_or_raises_with_strict(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    view = redis_cluster.topology()
    primaries = sorted(p for p, (role, _, _) in view.items() if role == "master")
    admin = redis_cluster.client(primaries[-1])
    try:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.WARNING), RedisClusterIndex(cfg):
            pass
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            "allkeys-lru" in m and "noeviction" in m and str(primaries[-1]) in m for m in warned
        ), warned
        with pytest.raises(UnsafeServerConfigError, match="allkeys-lru"):
            RedisClusterIndex(replace(cfg, strict=True))
        caplog.clear()
        admin.config_set("maxmemory-policy", "volatile-lru")
        with caplog.at_level(logging.WARNING), RedisClusterIndex(replace(cfg, strict=True)) as ok:
            ok.drop_namespace()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


@contextmanager
def _http_ports(count: int) -> Iterator[list[int]]:
    servers = [
        http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
        for _ in range(count)
    ]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [int(server.server_address[1]) for server in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _not_redis(ports: list[int], password: str = "") -> RedisIndexConfig:
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    user = f"user{password}@" if password else ""
    return RedisIndexConfig(address=f"redis+cluster://{user}{hosts}", retries=1, socket_timeout=1.0)


def test_seeds_that_are_not_redis_are_a_backend_unavailable_error_naming_them() -> None:
    with _http_ports(2) as ports:
        for password in ("", ":p@ss-word"):
            with pytest.raises(BackendUnavailableError) as info:
                RedisClusterIndex(_not_redis(ports, password))
            for port in ports:
                assert f"127.0.0.1:{port}" in str(info.value)
            assert "p@ss" not in str(info.value) and "ss-word" not in str(info.value)


async def test_async_seeds_that_are_not_redis_are_a_backend_unavailable_error() -> None:
    with _http_ports(1) as ports, pytest.raises(BackendUnavailableError) as info:
        await AsyncRedisClusterIndex.create(_not_redis(ports))
    assert f"127.0.0.1:{ports[0]}" in str(info.value)


def test_a_batch_in_parts_applies_at_most_once_per_shard_and_survives_a_crash_between_parts(
    index: RedisClusterIndex, cfg: RedisIndexConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard's segment of the batch goes in several parts (a small call budget), one part
    per wave, with engine-key evicts in the middle. A sender dies after the first wave (every
    shard took the first part of its segment); a new sender's batch is then applied whole,
    once."""
    monkeypatch.setattr(program, "CALL_BUDGET", 8)
    monkeypatch.setattr(cluster_writes, "CALL_BUDGET", 8)
    b_off = _pod_off(index, _shard_of(index, A), "cpu", prefix="b")
    keys = list(range(1, 41))
    batch: list[Any] = [AddOp([1000 + k], (k,), (A,)) for k in keys]
    batch += [EvictOp(k, KeyType.REQUEST, (A,)) for k in keys[:10]]
    batch += [EvictOp(1000 + k, KeyType.ENGINE, (A,)) for k in keys[10:15]]
    batch += [AddOp(None, tuple(keys[:10]), (b_off,))]  # two parts on b_off's shard too
    index.apply_batch(batch[:1], "warm", Watermark(1, 1))  # scripts loaded: no NOSCRIPT wave
    op = cluster_writes.op_cluster_apply_batch(index.core, batch, "s", Watermark(1, 1))
    first = next(op)
    assert isinstance(first, Wave)
    index.executor._send(first)  # the first wave reaches the nodes, then the sender dies
    op.close()
    assert index.get_watermark("s") is None
    expected = {k: [b_off] for k in keys[:10]} | {k: [A] for k in keys[15:]}
    with RedisClusterIndex(cfg) as other:
        assert other.apply_batch(batch, "s", Watermark(1, 1))
    assert index.get_watermark("s") == Watermark(1, 1)
    assert _found(index, keys) == expected
    assert all(index.get_request_key(1000 + k) == k for k in keys[15:])
    with pytest.raises(KeyError):
        index.get_request_key(1011)
    # and once only: a resend of the watermark is skipped on every shard
    assert not index.apply_batch([AddOp(None, tuple(keys), (A,))], "s", Watermark(1, 1))
    assert _found(index, keys) == expected


def test_a_huge_add_under_one_engine_key_is_applied_whole(index: RedisClusterIndex) -> None:
    check_huge_add_applied_whole(index)


def _definitions(index: RedisClusterIndex, shard: int) -> tuple[int, int, int]:
    layout = _layout(index, shard)
    base = layout.meta[: -len(b"meta")]
    with _node(index, shard) as raw:
        pi = [k for k in raw.hkeys(base + b"pi") if len(k) == 4]
        return len(pi), raw.hlen(base + b"pe"), raw.hlen(base + b"pp")


def test_cleared_pods_leave_the_entry_dictionaries_and_ids_are_never_reused(
    index: RedisClusterIndex, cfg: RedisIndexConfig
) -> None:
    pods = [PodEntry(f"pod-{i}", "gpu") for i in range(60)]
    with RedisClusterIndex(cfg) as other:
        for i, pod in enumerate(pods):
            index.add([i], [i], [pod, A])
        assert other.lookup([0]) == {0: [pods[0], A]}  # other caches pod-0's id
        shard = _shard_of(index, pods[0])
        with _node(index, shard) as raw:
            before = int(raw.hget(_layout(index, shard).meta, "next_id") or 0)
        for pod in pods:
            index.clear(pod.pod_identifier)
        for s in range(index.shards):  # only pod-a's entry is left, where it was interned
            assert _definitions(index, s) == ((1, 1, 1) if s == _shard_of(index, A) else (0, 0, 0))
        assert index.lookup([0, 1]) == {0: [A], 1: [A]}
        index.add(None, [5000], [pods[0]])  # interned again, under a new id
        with _node(index, shard) as raw:
            assert int(raw.hget(_layout(index, shard).meta, "next_id") or 0) == before + 1
        for client in (index, other):
            assert client.lookup([5000]) == {5000: [pods[0]]}
            assert client.lookup([0]) == {0: [A]}
        with RedisClusterIndex(cfg) as fresh:
            assert fresh.lookup([5000]) == {5000: [pods[0]]}


def test_an_id_re_added_while_its_pod_was_cleared_is_skipped_not_an_error(
    index: RedisClusterIndex, cfg: RedisIndexConfig
) -> None:
    pod = _pod_on(index, _shard_of(index, A), prefix="pod-x")
    one, two = 1, 2
    index.add(None, [one, two], [pod, A])
    bucket = _layout(index, _shard_of(index, A)).request_bucket(one)
    field = one.to_bytes(8, "big")
    with _node(index, _shard_of(index, A)) as raw:
        held = raw.hget(bucket, field)
        index.clear(pod.pod_identifier)
        raw.hset(bucket, field, held or b"")  # what a racing add stored after the clear passed
    with RedisClusterIndex(cfg) as fresh:
        for client in (index, fresh):
            assert client.lookup([one, two]) == {one: [A], two: [A]}
            assert client.score([one, two]) == {"pod-a": 2.0}


# -- what only a cluster does ------------------------------------------------------------------


def _flush_scripts(cluster: LocalCluster) -> None:
    for port in cluster.live_ports():
        client = cluster.client(port)
        try:
            client.script_flush()
        finally:
            client.close()


def test_scripts_flushed_on_every_node_are_reloaded_transparently(
    index: RedisClusterIndex, redis_cluster: LocalCluster
) -> None:
    keys = list(range(1, 33))
    index.add([1], keys, [A])
    _flush_scripts(redis_cluster)
    assert index.lookup(keys) == {k: [A] for k in keys}
    _flush_scripts(redis_cluster)
    index.add([2], [100, 101], [B])
    assert index.lookup([100, 101]) == {100: [B], 101: [B]}
    _flush_scripts(redis_cluster)
    index.evict(2, KeyType.ENGINE, [B])
    assert index.lookup([100]) == {}
    with pytest.raises(KeyError):
        index.get_request_key(2)
    _flush_scripts(redis_cluster)
    batch = [AddOp([3], (200, 201), (A,)), EvictOp(1, KeyType.ENGINE, (A,))]
    assert index.apply_batch(batch, "s", Watermark(1, 1))
    assert index.lookup([200, 201]) == {200: [A], 201: [A]}
    assert index.lookup(keys) == {}
    _flush_scripts(redis_cluster)
    assert index.score([200, 201]) == {"pod-a": 2.0}
    assert not index.apply_batch(batch, "s", Watermark(1, 1))


async def test_async_scripts_flushed_on_every_node_are_reloaded_transparently(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    async with AsyncRedisClusterIndex(cfg) as index:
        await index.add([1], [10, 11], [A])
        _flush_scripts(redis_cluster)
        assert await index.lookup([10, 11]) == {10: [A], 11: [A]}
        _flush_scripts(redis_cluster)
        await index.evict(1, KeyType.ENGINE, [A])
        assert await index.lookup([10]) == {}
        _flush_scripts(redis_cluster)
        assert await index.apply_batch([AddOp(None, (12,), (B,))], "s", Watermark(1, 1))
        assert await index.lookup([12]) == {12: [B]}
        await index.drop_namespace()


def _ids(cluster: LocalCluster) -> dict[int, bytes]:
    return {port: _on(cluster, port, "CLUSTER", "MYID") for port in cluster.live_ports()}


def _on(cluster: LocalCluster, port: int, *args: Any) -> Any:
    client = redis.Redis(port=port, socket_timeout=5)  # bytes replies: keys are binary
    try:
        return client.execute_command(*args)
    finally:
        client.close()


def _move_keys(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    """The first half of moving ``slot`` as ``redis-cli --cluster reshard`` does: IMPORTING on
    the target, MIGRATING on the source, then the slot's keys, a few at a time."""
    ids = _ids(cluster)
    _on(cluster, target, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    _on(cluster, source, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    while True:
        keys = _on(cluster, source, "CLUSTER", "GETKEYSINSLOT", slot, 5)
        if not keys:
            break
        _on(cluster, source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        time.sleep(0.01)  # the index runs in between: some of its keys moved, some not


def _hand_over(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    """The second half: the slot belongs to the target (SETSLOT NODE on every primary)."""
    ids = _ids(cluster)
    primaries = [p for p, (role, _, _) in cluster.topology().items() if role == "master"]
    for port in (target, source, *[p for p in primaries if p not in (source, target)]):
        _on(cluster, port, "CLUSTER", "SETSLOT", slot, "NODE", ids[target])


def _migrate_slot(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    _move_keys(cluster, slot, source, target)
    _hand_over(cluster, slot, source, target)


def _count_redirections(index: RedisClusterIndex) -> dict[str, int]:
    """Count the MOVED, ASK and TRYAGAIN replies the index's waves get from now on."""
    seen = dict.fromkeys(("MOVED", "ASK", "TRYAGAIN"), 0)
    exec_ = index.executor
    send = exec_._send

    def counting(wave: Wave) -> list[list[Any]]:
        replies = send(wave)
        for reply in (r for batch in replies for r in batch):
            if isinstance(reply, ErrorReply) and reply.code in seen:
                seen[reply.code] += 1
        return replies

    exec_._send = counting  # type: ignore[method-assign]
    return seen


def _exercise(index: RedisClusterIndex, keys: list[int], step: int) -> None:
    """Add, evict, read and batch in the shard of ``keys``, checking every answer."""
    k = keys[step % len(keys)]
    c = _pod_on(index, _shard_of(index, A), prefix=f"pod-c{step}")
    index.add(None, [k], [c])
    assert c in index.lookup([k])[k]
    index.evict(k, KeyType.REQUEST, [c])
    assert c not in index.lookup([k]).get(k, [])
    assert len(index.lookup(keys)) == len(keys)
    assert index.score(keys[:4], pod_identifier_set=["pod-a"]) == {"pod-a": 4.0}
    assert index.apply_batch([AddOp(None, (k,), (B,))], "s", Watermark(1, step))


def test_a_shard_resharded_while_in_use_keeps_every_operation_answering(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    """A shard's slot moves to another primary for real, three times.

    1. Its keys have moved, the slot is not handed over yet: the source answers ASK. The
       index's scripts do not follow it (at the target a key not moved yet would read as
       missing): the read waits until the slot is handed over, and answers right.
    2. Moved while the index is idle: its stale map gets MOVED, and every operation follows.
    3. Moved key batch by key batch while the index adds, evicts, reads and batches in that
       shard: every call answers, and answers right.
    """
    with RedisClusterIndex(replace(cfg, retries=10, retry_backoff=0.02)) as index:
        shard = _shard_of(index, A)
        assert _shard_of(index, B) == shard  # pod-a and pod-b: one shard, one slot
        slot = index.core.slots[shard]
        keys = list(range(1, 65))
        index.add([1], keys, [A])
        index.apply_batch([AddOp(None, tuple(keys), (B,))], "s", Watermark(1, 1))
        source = index.executor.slot_map.primary(slot).port
        target = next(n.port for n in index.executor.slot_map.primaries if n.port != source)
        seen = _count_redirections(index)
        _move_keys(redis_cluster, slot, source, target)
        timer = threading.Timer(0.3, _hand_over, args=(redis_cluster, slot, source, target))
        timer.start()
        try:
            assert index.lookup(keys) == {k: [A, B] for k in keys}
        finally:
            timer.join(30)
        assert seen["ASK"] >= 1 and seen["TRYAGAIN"] == 0
        # Once the cluster settled, the next call finds the slot at the target.
        redis_cluster.wait_converged()
        assert index.lookup(keys) == {k: [A, B] for k in keys}
        assert index.executor.slot_map.primary(slot).port == target
        _migrate_slot(redis_cluster, slot, target, source)
        assert index.executor.slot_map.primary(slot).port == target  # stale now
        step = 2
        _exercise(index, keys, step)
        assert seen["MOVED"] >= 1
        assert index.executor.slot_map.primary(slot).port == source  # refreshed
        mover = threading.Thread(target=_migrate_slot, args=(redis_cluster, slot, source, target))
        mover.start()
        try:
            while mover.is_alive():
                step += 1
                _exercise(index, keys, step)
        finally:
            mover.join(60)
        step += 1
        _exercise(index, keys, step)
        assert index.executor.slot_map.primary(slot).port == target
        with RedisClusterIndex(cfg) as fresh:
            assert fresh.lookup(keys) == index.lookup(keys) == {k: [A, B] for k in keys}
            assert fresh.get_watermark("s") == Watermark(1, step)
        index.evict(1, KeyType.ENGINE, [A])
        assert index.lookup(keys) == {k: [B] for k in keys}
        index.drop_namespace()
        _migrate_slot(redis_cluster, slot, target, source)  # as the cluster was
    redis_cluster.wait_converged()


# -- a score whose pods live in one shard: the single-server score on that shard's node --------


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _score_calls(index: RedisClusterIndex) -> list[tuple[str, Any]]:
    """Record the score calls the index's waves send from now on: which script was called
    (``score``, the single-server one, or ``score_shards``) and the reply it got, in order."""
    registry = index.core.registry
    names = {function_name(s): s for s in ("score", "score_shards")}
    shas = {registry[s].sha: s for s in ("score", "score_shards")}
    seen: list[tuple[str, Any]] = []
    exec_ = index.executor
    send = exec_._send

    def recording(wave: Wave) -> list[list[Any]]:
        replies = send(wave)
        for batch, answered in zip(wave.batches, replies, strict=True):
            for command, reply in zip(batch.commands, answered, strict=True):
                verb, callee = _text(command[0]).upper(), _text(command[1])
                script = names.get(callee) if verb.startswith("FCALL") else shas.get(callee)
                if verb in ("FCALL", "FCALL_RO", "EVALSHA") and script:
                    seen.append((script, reply))
        return replies

    exec_._send = recording  # type: ignore[method-assign]
    return seen


def _error_code(reply: Any) -> str | None:
    return reply.code if isinstance(reply, ErrorReply) else None


def test_a_one_shard_score_meeting_a_stale_shard_reloads_it_and_scores_the_new_namespace(
    index: RedisClusterIndex, cfg: RedisIndexConfig
) -> None:
    """The namespace dropped and made again by another client: the single-server score that
    the node of the filter's one shard runs answers KVREDIS_STALE; the shard is reloaded and
    scored, and the next score runs the single-server score again."""
    keys = list(range(1, 17))
    index.add(None, keys, [A])
    assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 16.0}
    with RedisClusterIndex(cfg) as other:
        other.drop_namespace()
    with RedisClusterIndex(cfg) as other:
        other.add(None, keys[:5], [A])
    seen = _score_calls(index)
    assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 5.0}
    assert seen and seen[0][0] == "score", seen
    assert _error_code(seen[0][1]) == "KVREDIS_STALE", seen[0]
    del seen[:]
    assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 5.0}
    assert [(script, type(reply)) for script, reply in seen] == [("score", list)]


@pytest.mark.parametrize("use_functions", [False, True], ids=["evalsha", "functions"])
def test_a_one_shard_score_on_a_node_lacking_the_script_or_library_loads_it(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster, use_functions: bool
) -> None:
    """Scripts (EVALSHA) or the function library flushed on every node: the single-server
    score that the node of the filter's one shard runs finds it missing, the score still
    answers right, and the next one runs the single-server score there directly."""
    keys = list(range(1, 17))
    with RedisClusterIndex(replace(cfg, use_functions=use_functions)) as index:
        try:
            index.add(None, keys, [A])
            assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 16.0}
            _flush_scripts(redis_cluster)
            if use_functions:
                for port, (role, _, _) in redis_cluster.topology().items():
                    if role == "master":
                        _on(redis_cluster, port, "FUNCTION", "FLUSH")
            seen = _score_calls(index)
            assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 16.0}
            assert seen and seen[0][0] == "score", seen
            assert index.core.registry.missing(seen[0][1]), seen[0]
            del seen[:]
            assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 16.0}
            assert [(script, type(reply)) for script, reply in seen] == [("score", list)]
            assert index.score(keys) == {"pod-a": 16.0}  # every node loaded again
        finally:
            index.drop_namespace()


def test_a_one_shard_score_follows_its_shard_s_slot_moved_and_moving(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    """The filter's one shard's slot moved while the index is idle: its single-server score
    meets MOVED; moved again, key batch by key batch, and not handed over yet: it meets ASK
    (or TRYAGAIN). Each score answers right."""
    with RedisClusterIndex(replace(cfg, retries=10, retry_backoff=0.02)) as index:
        slot = index.core.slots[_shard_of(index, A)]
        keys = list(range(1, 33))
        index.add(None, keys, [A])
        assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 32.0}
        source = index.executor.slot_map.primary(slot).port
        target = next(n.port for n in index.executor.slot_map.primaries if n.port != source)
        seen = _score_calls(index)
        _migrate_slot(redis_cluster, slot, source, target)
        assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 32.0}
        assert seen and seen[0][0] == "score" and _error_code(seen[0][1]) == "MOVED", seen
        del seen[:]
        _move_keys(redis_cluster, slot, target, source)
        timer = threading.Timer(0.3, _hand_over, args=(redis_cluster, slot, target, source))
        timer.start()
        try:
            assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 32.0}
        finally:
            timer.join(30)
        assert seen and seen[0][0] == "score", seen
        assert _error_code(seen[0][1]) in ("ASK", "TRYAGAIN"), seen[0]
        redis_cluster.wait_converged()
        assert index.score(keys, pod_identifier_set=["pod-a"]) == {"pod-a": 32.0}
        index.drop_namespace()
    redis_cluster.wait_converged()


def test_a_slot_without_an_owner_past_the_retries_is_backend_unavailable(
    cfg: RedisIndexConfig, redis_cluster: LocalCluster
) -> None:
    with RedisClusterIndex(replace(cfg, retries=1, retry_backoff=0.01)) as index:
        index.add(None, [1], [A])
        slot = index.core.slots[_shard_of(index, A)]
        owner = index.executor.slot_map.primary(slot).port
        ids = _ids(redis_cluster)
        for port in redis_cluster.live_ports():
            with suppress(redis.ResponseError):  # already unassigned in this node's view
                _on(redis_cluster, port, "CLUSTER", "DELSLOTS", slot)
        try:
            with pytest.raises(BackendUnavailableError, match=r"CLUSTERDOWN|serves slot"):
                index.lookup([1])
            with pytest.raises(BackendUnavailableError, match=r"CLUSTERDOWN|serves slot"):
                index.add(None, [1], [B])
        finally:
            _on(redis_cluster, owner, "CLUSTER", "ADDSLOTS", slot)
            assert ids[owner]
            redis_cluster.wait_converged()
        assert index.lookup([1]) == {1: [A]}
        index.drop_namespace()

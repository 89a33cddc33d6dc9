"""The Redis key layout: buckets, namespaces, round trips, scoring and clear."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvredis import (
    AddOp,
    AsyncRedisIndex,
    EvictOp,
    InvalidInputError,
    KeyType,
    LongestPrefixScorer,
    NamespaceLayoutError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.redis.config import config_for_existing
from kvredis.redis.layout import (
    KEYS_PER_BUCKET,
    LAYOUT_VERSION,
    MAX_BUCKET_BITS,
    MIN_BUCKET_BITS,
    Layout,
    bucket_bits_for,
    bucket_of,
    check_namespace,
)
from kvredis.redis.ops import op_clear, op_lookup
from kvredis.redis.requests import Pipeline, Request, ScriptCall
from kvredis.redis.session import op_send
from kvredis.redis.state import CoreState
from kvredis.types import MAX_BLOCK_HASH
from tests.redis.namespace_state import read_namespace
from tests.servers import RedisServer

ENGINE, REQUEST = KeyType.ENGINE, KeyType.REQUEST
A, B, C = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu"), PodEntry("pod-c", "cpu")
EDGES = [0, 1, 255, 256, 65535, 65536, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 2, MAX_BLOCK_HASH]

ODD_TEXTS = [
    "pod:with:colons",
    "pod|pipe,comma;semi",
    'quote"double',
    "quote'single",
    "nul\x00inside",
    "tab\tnew\nline",
    "ünïcødé-ポッド-🚀",
    "back\\slash*glob?[x]",
    "{hashtag}",
    "lone\ud800surrogate",
    "x" * 1024,
]


def _ns() -> str:
    return f"kvt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def raw(redis_server_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def make(redis_server_url: str) -> Iterator[Any]:
    """Build RedisIndex clients on the session server; all are closed at the end."""
    made: list[RedisIndex] = []

    def build(namespace: str | None = None, **kwargs: Any) -> RedisIndex:
        cfg = RedisIndexConfig(address=redis_server_url, namespace=_ns(), **kwargs)
        if namespace is not None:  # also a name only an earlier kvredis created (with ':')
            cfg = config_for_existing(cfg, namespace)
        made.append(RedisIndex(cfg))
        return made[-1]

    try:
        yield build
    finally:
        for idx in made:
            idx.close()


# -- buckets ----------------------------------------------------------------------------------


@settings(deadline=None, max_examples=200)
@given(st.integers(min_value=0, max_value=MAX_BLOCK_HASH), st.integers(min_value=1, max_value=24))
def test_bucket_is_the_low_bits_and_names_carry_them_big_endian(value: int, bits: int) -> None:
    layout = Layout("ns", bits, b"g")
    bucket = bucket_of(value, bits)
    assert bucket == value % (1 << bits)
    suffix = layout.request_bucket(value)[len(b"ns:r:") :]
    assert len(suffix) == (bits + 7) // 8 and int.from_bytes(suffix, "big") == bucket
    assert layout.engine_bucket(value) == b"ns:e:" + suffix


@pytest.mark.parametrize("bits", [1, 7, 8, 12, 16, 20, 24])
def test_python_and_lua_agree_on_buckets(make: Any, raw: redis.Redis, bits: int) -> None:
    rng = random.Random(bits)
    keys = EDGES + [rng.getrandbits(64) for _ in range(40)]
    engine = [k ^ 0x5A5A5A5A5A5A5A5A for k in keys]
    idx = make(bucket_bits=bits)
    idx.add(engine, keys, [A])
    layout = idx._session.state.layout
    for key, engine_key in zip(keys, engine, strict=True):
        assert raw.hexists(layout.request_bucket(key), key.to_bytes(8, "big"))
        assert raw.hexists(layout.engine_bucket(engine_key), engine_key.to_bytes(8, "big"))
    # Engine evicts make Lua compute the request buckets from the stored mapping.
    for engine_key in engine:
        idx.evict(engine_key, ENGINE, [A])
    assert idx.lookup(keys[:1]) == {}
    assert read_namespace(raw, idx.namespace).keys == sorted(
        [layout.meta, layout.pe, layout.pi, layout.pp]
    )


@settings(deadline=None, max_examples=300)
@given(st.integers(min_value=0, max_value=2**40), st.integers(min_value=1, max_value=64))
def test_bucket_bits_for_an_index_give_buckets_of_32_to_64_keys(keys: int, shards: int) -> None:
    bits = bucket_bits_for(keys, shards)
    assert MIN_BUCKET_BITS <= bits <= MAX_BUCKET_BITS
    per_bucket = -(-keys // shards) / 2**bits
    if MIN_BUCKET_BITS < bits < MAX_BUCKET_BITS:
        assert KEYS_PER_BUCKET / 2 < per_bucket <= KEYS_PER_BUCKET
    elif bits == MIN_BUCKET_BITS:
        assert per_bucket <= KEYS_PER_BUCKET
    else:
        assert per_bucket > KEYS_PER_BUCKET / 2
    assert bucket_bits_for(keys + 1, shards) >= bits  # more keys never fewer buckets


@pytest.mark.parametrize(("keys", "shards"), [(-1, 1), (1.5, 1), (True, 1), (10, 0), (10, "2")])
def test_bucket_bits_for_refuses_what_is_no_count(keys: Any, shards: Any) -> None:
    with pytest.raises(InvalidInputError):
        bucket_bits_for(keys, shards)


def test_an_index_sized_by_bucket_bits_for_keeps_its_buckets_small_listpacks(
    make: Any, raw: redis.Redis
) -> None:
    # 6,000 keys (with an engine key each) in 64-key adds: the buckets hold 32 to 64 fields on
    # average, none near the listpack limit, every one listpack-encoded.
    rng = random.Random(6)
    keys = [rng.getrandbits(64) for _ in range(6000)]
    bits = bucket_bits_for(len(keys))
    idx = make(bucket_bits=bits)
    for j in range(0, len(keys), 64):
        idx.add([k ^ 0xA5 for k in keys[j : j + 64]], keys[j : j + 64], [A])
    layout = idx._session.state.layout
    for prefix in (layout.rprefix, layout.eprefix):
        buckets = [k for k in raw.scan_iter(prefix + b"*", count=1000) if layout.owns(k)]
        sizes = [raw.hlen(k) for k in buckets]
        assert len(buckets) == 2**bits
        assert KEYS_PER_BUCKET / 2 < sum(sizes) / len(sizes) <= KEYS_PER_BUCKET
        assert max(sizes) < 128
        assert {raw.object("encoding", k) for k in buckets} == {b"listpack"}


# -- namespaces --------------------------------------------------------------------------------


def test_namespaces_share_a_server_without_touching_foreign_keys(
    make: Any, raw: redis.Redis
) -> None:
    base = _ns()
    mine, neighbour, nested = make(base), make(base + "2"), make(base + ":sub")
    foreign = {
        b"user:1": ("string", b"alice"),
        base.encode() + b"-other:r:\x00\x01": ("string", b"x"),
        b"other:r:\x00\x01": ("hash", {b"\x00" * 8: b"\x00\x00\x00\x01"}),
        base.encode() + b":r:zz": ("string", b"squatter"),  # matches our SCAN pattern
    }
    for key, (kind, value) in foreign.items():
        if kind == "string":
            raw.set(key, value)
        else:
            raw.hset(key, mapping=value)  # type: ignore[arg-type]
    keys = [1, 2, 3, 4]
    for idx in (mine, neighbour, nested):
        idx.add(keys, keys, [A, B])
    before = {
        ns: read_namespace(raw, ns).requests for ns in (neighbour.namespace, nested.namespace)
    }
    mine.clear("pod-a")
    mine.evict(1, ENGINE, [B])
    assert mine.lookup(keys) == {}
    assert mine.lookup(keys[1:]) == {k: [B] for k in keys[1:]}
    for idx in (neighbour, nested):
        assert idx.lookup(keys) == {k: [A, B] for k in keys}
        assert read_namespace(raw, idx.namespace).requests == before[idx.namespace]
    for key, (kind, value) in foreign.items():
        assert (raw.get(key) if kind == "string" else raw.hgetall(key)) == value
    assert all(k.startswith(base.encode() + b":") for k in read_namespace(raw, mine.namespace).keys)


def test_a_client_only_creates_the_documented_keys(make: Any, raw: redis.Redis) -> None:
    idx = make()
    idx.add([9], [1, 2], [A, C])
    idx.apply_batch([AddOp((8,), (3,), (B,))], "stream", Watermark(0, 1))
    layout = idx._session.state.layout
    names = set(read_namespace(raw, idx.namespace).keys)
    fixed = {layout.meta, layout.pe, layout.pi, layout.pp, layout.wm}
    assert fixed <= names
    assert names - fixed == {
        layout.request_bucket(1),
        layout.request_bucket(2),
        layout.request_bucket(3),
        layout.engine_bucket(9),
        layout.engine_bucket(8),
    }
    meta = raw.hgetall(layout.meta)
    assert meta[b"layout"] == LAYOUT_VERSION.encode() and meta[b"bucket_bits"] == b"16"
    assert meta[b"next_id"] == b"3"  # three distinct entries interned


def test_bucket_bits_are_fixed_by_the_first_client(make: Any) -> None:
    ns = _ns()
    first = make(ns, bucket_bits=12)
    first.add(None, [77], [A])
    second = make(ns, bucket_bits=20)
    assert second.bucket_bits == 12
    assert second.lookup([77]) == {77: [A]}


def test_a_namespace_of_another_layout_is_refused(redis_server_url: str, raw: redis.Redis) -> None:
    ns = _ns()
    raw.hset(f"{ns}:meta", mapping={"layout": "someone-else/9", "bucket_bits": 16, "gen": "x"})
    with pytest.raises(NamespaceLayoutError, match="someone-else"):
        RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=ns))
    other = _ns()
    raw.set(f"{other}:meta", "a string")
    with pytest.raises(NamespaceLayoutError):
        RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=other))


def test_a_recreated_namespace_invalidates_cached_entry_ids(make: Any, raw: redis.Redis) -> None:
    ns = _ns()
    first = make(ns)
    first.add(None, [1], [A])
    assert first.lookup([1]) == {1: [A]}  # first now caches id 1 = pod-a
    for key in read_namespace(raw, ns).keys:
        raw.delete(key)
    second = make(ns)
    second.add(None, [2], [B])  # id 1 of the new incarnation is pod-b
    assert first.lookup([2]) == {2: [B]}
    first.add(None, [3], [C])
    assert second.lookup([3]) == {3: [C]}
    assert read_namespace(raw, ns).problems == []


# -- round trips -------------------------------------------------------------------------------


def _client_commands(server: RedisServer, call: Any) -> list[str]:
    """Names of the commands clients (not scripts) sent while ``call()`` ran, seen by MONITOR."""
    watcher, marker = redis.Redis(port=server.port), redis.Redis(port=server.port)
    try:
        marker.ping()  # connected before monitoring starts
        with watcher.monitor() as monitor:
            call()
            marker.echo("kvredis-test-marker")
            seen = []
            for item in monitor.listen():
                if item["command"] == "ECHO kvredis-test-marker":
                    return seen
                if item["client_type"] != "lua":
                    seen.append(item["command"].split()[0].upper())
    finally:
        watcher.close()
        marker.close()
    raise AssertionError("monitor ended early")


def test_each_public_call_is_one_round_trip(own_redis_server: RedisServer) -> None:
    cfg = RedisIndexConfig(address=own_redis_server.url, namespace=_ns())
    chain = list(range(1000, 1512))
    with RedisIndex(cfg) as idx:
        idx.add(chain, chain, [A, B])
        calls = {
            "lookup": lambda: idx.lookup(chain, {"pod-a"}),
            "score": lambda: idx.score(chain, {"gpu": 0.5}),
            "add": lambda: idx.add(chain[:64], chain[:64], [C]),
            "evict": lambda: idx.evict(chain[0], ENGINE, [C]),
            "get_request_key": lambda: idx.get_request_key(chain[1]),
            "apply_batch": lambda: idx.apply_batch(
                [AddOp(None, (5,), (A,)), EvictOp(5, REQUEST, (A,))] * 20, "s", Watermark(1, 1)
            ),
        }
        for name, call in calls.items():
            call()  # scripts loaded, caches warm
            verbs = (["FCALL"], ["FCALL_RO"]) if idx.registry.active else (["EVALSHA"],)
            assert _client_commands(own_redis_server, call) in verbs, name


def test_odd_pod_ids_and_tiers_round_trip_through_another_client(make: Any) -> None:
    ns = _ns()
    writer, reader = make(ns), make(ns)
    odd = [PodEntry(t, t[::-1] or "x") for t in ODD_TEXTS]
    odd += [PodEntry(ODD_TEXTS[4], "gpu", True, True, 2**31 - 1)]
    keys = EDGES
    writer.add(list(reversed(keys)), keys, odd)
    got = reader.lookup(keys)  # a fresh client decodes the server's definitions
    assert list(got) == keys and all(
        set(v) == set(odd) and len(v) == len(odd) for v in got.values()
    )
    for entry in odd:
        only = reader.lookup(keys, {entry.pod_identifier})
        expected = {e for e in odd if e.pod_identifier == entry.pod_identifier}
        assert {k: set(v) for k, v in only.items()} == {k: expected for k in keys}
    weights = {e.device_tier: 0.25 for e in odd[:3]}
    assert reader.score(keys, weights) == LongestPrefixScorer(weights).score(keys, got)
    reader.evict(keys[0], ENGINE, [odd[-1]])  # maps to the last request key
    assert odd[-1] not in reader.lookup([keys[-1]])[keys[-1]]
    for entry in odd:
        reader.clear(entry.pod_identifier)
    assert writer.lookup(keys) == {}
    for bad in (PodEntry("", "gpu"), PodEntry("pod", "")):
        with pytest.raises(ValueError):
            writer.add(None, [1], [bad])


def test_many_entries_on_one_key(make: Any, raw: redis.Redis) -> None:
    idx = make()
    many = [PodEntry(f"pod-{i}", tier) for i in range(40) for tier in ("gpu", "cpu")]
    idx.add([1], [2, 3], many)  # 320-byte values: the bucket leaves the listpack encoding
    assert [set(v) for v in idx.lookup([2, 3]).values()] == [set(many)] * 2
    idx.evict(1, ENGINE, many[:-1])
    assert idx.lookup([2, 3]) == {2: [many[-1]], 3: [many[-1]]}
    assert idx.score([2, 3]) == {"pod-39": 0.8 + 0.8}
    assert read_namespace(raw, idx.namespace).problems == []


# -- score -------------------------------------------------------------------------------------

weights_strategy = st.dictionaries(
    st.sampled_from(["gpu", "cpu", "disk", "storage"]),
    st.sampled_from([0.0, 0.1, 1 / 3, 0.7, 0.8, 1.0, 2.5, 1e-9, 123456.789]),
    max_size=4,
)


@pytest.fixture(scope="module")
def score_index(redis_server_url: str) -> Iterator[RedisIndex]:
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=_ns())) as idx:
        yield idx


@settings(
    deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(min_value=0, max_value=2**32),
    weights=st.none() | weights_strategy,
    use_filter=st.booleans(),
)
def test_server_score_equals_client_scorer_exactly(
    score_index: RedisIndex, seed: int, weights: dict[str, float] | None, use_filter: bool
) -> None:
    rng = random.Random(seed)
    chain = [rng.getrandbits(64) for _ in range(rng.randint(1, 60))]
    pods = [f"pod-{i}" for i in range(rng.randint(1, 5))]
    for pod in pods:
        for tier in rng.sample(["gpu", "cpu", "disk", "storage"], rng.randint(1, 3)):
            start = rng.randint(0, 3) if rng.random() < 0.3 else 0
            held = chain[start : start + rng.randint(0, len(chain))]
            if held:
                score_index.add(None, held, [PodEntry(pod, tier)])
    pod_set = set(rng.sample(pods, rng.randint(1, len(pods)))) if use_filter else None
    expected = LongestPrefixScorer(weights).score(chain, score_index.lookup(chain, pod_set))
    assert score_index.score(chain, weights, pod_set) == expected


async def test_async_score_and_lookup_match_the_sync_client(redis_server_url: str) -> None:
    cfg = RedisIndexConfig(address=redis_server_url, namespace=_ns())
    chain = list(range(50, 80))
    with RedisIndex(cfg) as sync_idx:
        sync_idx.add(None, chain, [A, C])
        sync_idx.add(None, chain[:10], [B])
        async with AsyncRedisIndex(cfg) as async_idx:
            assert await async_idx.lookup(chain) == sync_idx.lookup(chain)
            for weights in (None, {"cpu": 3.0}, {}):
                assert await async_idx.score(chain, weights) == sync_idx.score(chain, weights)
            assert await async_idx.score(chain, None, {"pod-b"}) == {"pod-b": 10.0}


def test_score_rejects_bad_weights(make: Any) -> None:
    idx = make()
    for bad in ({"gpu": "high"}, {"gpu": float("nan")}, {1: 1.0}):
        with pytest.raises(InvalidInputError):
            idx.score([1], bad)


# -- watermarks --------------------------------------------------------------------------------

WATERMARKS = [
    Watermark(e, s) for e in (-1, 0, 9, 10, 2**62, 2**63 - 1) for s in (-1, 0, 9, 10, 2**63 - 1)
]


@settings(
    deadline=None, max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.sampled_from(WATERMARKS), min_size=1, max_size=12))
def test_watermark_comparison_matches_python_ordering(
    score_index: RedisIndex, marks: list[Watermark]
) -> None:
    stream = uuid.uuid4().hex
    stored: Watermark | None = None
    for mark in marks:
        applied = score_index.apply_batch([], stream, mark)
        assert applied == (stored is None or mark > stored)
        if applied:
            stored = mark
        assert score_index.get_watermark(stream) == stored


# -- clear -------------------------------------------------------------------------------------


def test_clear_reports_progress_and_drops_mappings_left_without_holders(
    make: Any, raw: redis.Redis
) -> None:
    idx = make(bucket_bits=8, clear_fields_per_call=64)
    rng = random.Random(5)
    only_a = [rng.getrandbits(64) for _ in range(300)]
    shared = [rng.getrandbits(64) for _ in range(100)]
    idx.add(only_a, only_a, [A, PodEntry("pod-a", "cpu")])
    idx.add(shared, shared, [A])
    idx.add(None, shared, [B])
    calls: list[tuple[int, int]] = []
    idx.clear("pod-a", lambda done, removed: calls.append((done, removed)))
    assert len(calls) > 2
    assert calls == sorted(calls) and calls[-1][1] == 2 * 300 + 100
    state = read_namespace(raw, idx.namespace)
    assert state.problems == []
    assert set(state.requests) == set(shared)
    assert set(state.engines) == set(shared)
    assert idx.get_request_key(shared[0]) == shared[0]
    calls.clear()
    idx.clear("pod-a", lambda done, removed: calls.append((done, removed)))
    assert all(removed == 0 for _, removed in calls)
    idx.clear("pod-never-seen", lambda done, removed: calls.append((-1, -1)))
    assert (-1, -1) not in calls


def _send(index: RedisIndex, request: Request) -> Any:
    """The reply to one request of a hand-driven operation, sent by ``index``'s executor."""
    return index._exec.run(op_send(index._session, request))


def test_clear_pages_do_bounded_work(make: Any) -> None:
    """Drive the sans-IO clear by hand and look at every script call and its reply."""
    idx = make(bucket_bits=10)
    rng = random.Random(9)
    keys = [rng.getrandbits(64) for _ in range(6000)]
    for start in range(0, len(keys), 500):
        idx.add(None, keys[start : start + 500], [A, B])
    state: CoreState = idx._session.state
    op = op_clear(state, "pod-a", None, fields_per_call=256)
    examined: list[int] = []
    request: Any = next(op)
    try:
        while True:
            reply = _send(idx, request)
            if isinstance(request, ScriptCall) and request.script not in ("retire", "reclaim"):
                examined.append(int(reply[1]))
            elif isinstance(request, Pipeline):
                examined.append(int(reply[0][1]))
            request = op.send(reply)
    except StopIteration as stop:
        assert stop.value == len(keys)
    assert sum(examined) >= len(keys)
    assert max(examined) <= 4 * 256 + 64
    assert idx.lookup(keys[:1]) == {keys[0]: [B]}


def test_lookups_teach_a_client_the_whole_dictionary_in_bounded_steps(make: Any) -> None:
    ns = _ns()
    writer, reader = make(ns), make(ns)
    pods = [PodEntry(f"pod-{i}", "gpu") for i in range(300)]
    for i, entry in enumerate(pods):
        writer.add(None, [10_000 + i], [entry])
    state: CoreState = reader._session.state

    def lookup_reply(key: int) -> Any:
        op = op_lookup(state, [key], None)
        call = next(op)
        reply = _send(reader, call)
        try:
            op.send(reply)
        except StopIteration as stop:
            assert stop.value == {key: [pods[key - 10_000]]}
        return reply

    first = lookup_reply(10_299)  # hits the newest entry only
    assert int(first[0]) == 256 and len(first[1]) == 2 * 257  # ids 1..256 plus the hit id 300
    second = lookup_reply(10_000)
    assert int(second[0]) == 300 and len(second[1]) == 2 * 44  # the rest: ids 257..300
    third = lookup_reply(10_150)
    assert int(third[0]) == 300 and third[1] == []  # nothing left to learn
    assert reader.lookup([10_000 + i for i in range(3)], {"pod-1"}) == {}
    assert reader.lookup([10_001], {"pod-1"}) == {10_001: [pods[1]]}


@pytest.mark.parametrize("name", ["kv:c:x", "kv:c", "kv:s:x", "kv:s", "kv:r:1", "kv:e", "a:c:b:c"])
def test_names_whose_keys_would_collide_with_a_shorter_namespace_are_refused(name: str) -> None:
    with pytest.raises(InvalidInputError, match="':c:'"):
        check_namespace(name)


def test_runs_expiring_and_request_buckets_have_disjoint_names() -> None:
    layout = Layout("kv", 16, b"g")
    run = layout.run_key(b"\x00\x00\x00\x01")
    expiring, request = layout.expiring_bucket(1), layout.request_bucket(1)
    assert run == b"kv:c:\x00\x00\x00\x01" and expiring == b"kv:s:\x00\x01"
    assert len({run, expiring, request}) == 3
    assert all(layout.owns(k) for k in (run, expiring, request))
    assert not layout.owns(b"kv:c:\x00\x00\x00")

"""A score or a lookup in parts (a chain longer than one call's part, 4,096 keys; on a cluster,
the waves of per-node calls) never credits a pod with more than it held at one instant, whatever
writes come between its parts: stamps (``lua/includes/stamps.lua``, :mod:`kvredis.redis.stamps`).

First the issue's scenario (a pod holds keys 1..4096; between part 1 and part 2 of an 8,192-key
score a writer evicts key 1 and adds 4097..8192: 8192 was credited, where 4096 before the write
or nothing after it is true) and its variants (a clear, expiring entries that lapse), on a
single server and a cluster, sync and async, Redis and Valkey; then each write that takes
entries away, one by one, against the stamps a lookup returns."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvredis import (
    AddOp,
    EvictOp,
    KeyType,
    PodEntry,
    RedisClusterIndex,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.redis.cluster import ops as cluster_ops
from kvredis.redis.codec import hash_blob
from kvredis.redis.ops import SCORE_KEYS_PER_CALL
from kvredis.redis.requests import ScriptCall
from kvredis.redis.session import op_send
from kvredis.redis.stamps import StampBook
from tests.conftest import CLUSTER_BACKENDS, REDIS_BACKENDS, close_backend, make_backend

pytestmark = pytest.mark.redis

REQUEST = KeyType.REQUEST
POD = PodEntry("pod-a", "gpu")
OTHER = PodEntry("pod-b", "gpu")
SPEC = PodEntry("pod-s", "gpu", speculative=True)
N = SCORE_KEYS_PER_CALL
KEYS = list(range(10**9, 10**9 + 2 * N))


#: The read scripts a chain in parts calls once per part (per node, on a cluster).
READS = frozenset({"score", "lookup", "lookup_shards", "score_shards", "lookup_union"})


def _namespaces(call: ScriptCall) -> set[bytes]:
    """The meta keys (one per namespace or cluster shard) a read call reads."""
    names = [*call.keys, *call.args]
    return {bytes(a) for a in names if isinstance(a, bytes) and a.endswith(b":meta")}


class Between:
    """Runs ``write`` once, right before the first read call that reads a namespace (a shard,
    on a cluster) an earlier call of the read already read: the read's second part (on a
    cluster, the first call of its second wave)."""

    def __init__(self, index: Any, write: Callable[[], None]) -> None:
        target = getattr(index, "inner", index)
        core = getattr(target, "core", None)
        self.registry = core.registry if core is not None else target.registry
        self.write = write
        self.done = False
        self.seen: set[bytes] = set()
        self.calls: list[ScriptCall] = []
        self._call_command = self.registry.call_command

    def __enter__(self) -> Between:
        self.registry.call_command = self._call
        return self

    def __exit__(self, *exc: object) -> None:
        self.registry.call_command = self._call_command

    def _call(self, call: ScriptCall) -> Any:
        if not self.done and call.script in READS and call not in self.calls:
            # (a call sent again, after NOSCRIPT or a lost connection, is the same part)
            self.calls.append(call)
            names = _namespaces(call)
            if names & self.seen:
                self.done = True
                self.write()
            self.seen |= names
        return self._call_command(call)


Pair = tuple[Any, Any, bool]


@pytest.fixture(params=[*REDIS_BACKENDS, *CLUSTER_BACKENDS])
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    """A backend, a second (sync) client of the same namespace that writes between the parts of
    the first one's reads, and whether it is a cluster. On a cluster one node's call walks at
    most 1,024 keys of the chain, so that a pod's 4,096 keys take more than one wave."""
    index = make_backend(request.param, request)
    config = getattr(index, "inner", index).config
    cluster = bool(config.cluster)
    if cluster:
        monkeypatch.setattr(cluster_ops, "LOOKUP_KEYS_PER_CALL", 1024)
    writer = RedisClusterIndex(config) if cluster else RedisIndex(config)
    try:
        yield index, writer, cluster
    finally:
        writer.close()
        close_backend(index)


def _credit_check(got: float, cluster: bool) -> None:
    """The pod held keys 1..4096 before the write and no prefix after it: 4096 on a single server
    (the first part's score); on a cluster at most that (the keys its first wave read)."""
    if cluster:
        assert 0 < got <= N
    else:
        assert got == N


def test_a_score_in_parts_never_credits_more_than_the_pod_held(pair: Pair) -> None:
    index, writer, cluster = pair
    index.add(None, KEYS[:N], [POD])

    def write() -> None:
        writer.evict(KEYS[0], REQUEST, [POD])
        writer.add(None, KEYS[N:], [POD])

    with Between(index, write) as between:
        got = index.score(KEYS)
    assert between.done  # the write came between two parts
    _credit_check(got["pod-a"], cluster)
    assert index.score(KEYS) == {}  # after the write: key 1 is gone
    assert index.score(KEYS[1:]) == {"pod-a": 2 * N - 1}


def test_a_lookup_in_parts_never_lists_more_than_the_pod_held(pair: Pair) -> None:
    index, writer, cluster = pair
    index.add(None, KEYS[:N], [POD])

    def write() -> None:
        writer.evict(KEYS[0], REQUEST, [POD])
        writer.add(None, KEYS[N:], [POD])

    with Between(index, write) as between:
        got = index.lookup(KEYS)
    assert between.done
    assert list(got) == KEYS[: len(got)] and all(v == [POD] for v in got.values())
    _credit_check(len(got), cluster)


def test_score_by_rank_in_parts_never_credits_more_than_the_rank_held(pair: Pair) -> None:
    index, writer, cluster = pair
    rank = PodEntry("pod-a", "gpu", dp_rank=2)
    index.add(None, KEYS[:N], [rank])

    def write() -> None:
        writer.evict(KEYS[0], REQUEST, [rank])
        writer.add(None, KEYS[N:], [rank])

    with Between(index, write) as between:
        got = index.score_by_rank(KEYS)
    assert between.done and set(got) == {"pod-a"} and set(got["pod-a"]) == {2}
    _credit_check(got["pod-a"][2], cluster)


def test_a_clear_between_parts_cuts_the_pod_back(pair: Pair) -> None:
    index, writer, cluster = pair
    index.add(None, KEYS[:N], [POD])

    def write() -> None:
        writer.clear("pod-a")
        writer.add(None, KEYS[N:], [POD])

    with Between(index, write) as between:
        got = index.score(KEYS)
    assert between.done
    _credit_check(got["pod-a"], cluster)


def test_expiring_entries_that_lapse_between_parts_are_not_credited_with_later_ones(
    pair: Pair,
) -> None:
    """Expiring entries leave without a write: the pod's first 4096 keys are held by
    speculative entries that lapse between the parts, while its last 4096 were added with a
    long ttl meanwhile."""
    index, writer, cluster = pair
    ttl = 2.0
    start = time.monotonic()
    index.add(None, KEYS[:N], [SPEC], ttl=ttl)

    def write() -> None:
        assert time.monotonic() < start + ttl - 0.3, "the first part came too late to test this"
        writer.add(None, KEYS[N:], [SPEC], ttl=60)
        time.sleep(max(0.0, start + ttl + 0.3 - time.monotonic()))  # the first ones lapse

    with Between(index, write) as between:
        got = index.score(KEYS)
    assert between.done
    _credit_check(got["pod-s"], cluster)
    assert index.score(KEYS) == {}


def test_adds_and_other_pods_writes_between_parts_cut_no_pod(pair: Pair) -> None:
    """Only what takes a pod's entries away breaks its stamp: a pod that only gained keys
    between the parts is credited as it is after the write (a state it was in), and another
    pod's eviction does not touch it."""
    index, writer, _ = pair
    index.add(None, KEYS[:N], [POD])
    index.add(None, KEYS, [OTHER])

    def write() -> None:
        writer.add(None, KEYS[N:], [POD])
        writer.evict(KEYS[-1], REQUEST, [OTHER])

    with Between(index, write) as between:
        got = index.score(KEYS)
    assert between.done
    assert got["pod-a"] == 2 * N  # what it holds after the write
    assert got["pod-b"] <= 2 * N


# -- each write that takes entries away, against the stamps of a lookup -------------------------


@pytest.fixture(params=[p for p in REDIS_BACKENDS if str(p.values[0]).startswith("redis@")])
def single(request: pytest.FixtureRequest) -> Iterator[RedisIndex]:
    index = make_backend(request.param, request)
    try:
        yield index
    finally:
        close_backend(index)


def stamps(index: RedisIndex, keys: list[int], carried: dict[bytes, bytes] | None = None) -> Any:
    """The stamps part of a ``lookup`` call's reply over ``keys`` (as a first part of a longer
    chain, or carrying ``carried``), as pod -> stamp."""
    layout, cache = index._session.state.snapshot()
    flat: list[Any] = [len(carried or {})]
    for pod, stamp in (carried or {}).items():
        flat += (pod, stamp)
    args = (layout.gen, layout.rprefix, layout.bucket_bits, cache.floor, 0, hash_blob(keys), 1)
    call = ScriptCall(
        "lookup", (layout.meta, layout.pi, layout.pp, layout.sx), (*args, *flat), read=True
    )
    reply = index._exec.run(op_send(index._session, call))
    pairs = reply[2]
    return {bytes(pairs[i]): bytes(pairs[i + 1]) for i in range(0, len(pairs), 2)}


def broken_by(index: RedisIndex, keys: list[int], write: Callable[[], None]) -> set[str]:
    """The pods whose stamps (read over ``keys``) ``write`` breaks; checks that the others'
    still hold."""
    before = stamps(index, keys)
    assert before and all(before.values())
    write()
    after = stamps(index, keys, before)
    assert set(after) >= set(before)
    return {pod.decode() for pod in before if not after[pod]}


def test_every_write_that_takes_entries_away_breaks_the_pods_stamp(single: RedisIndex) -> None:
    index = single
    keys = KEYS[:8]
    gpu0, gpu1 = PodEntry("pod-a", "gpu"), PodEntry("pod-a", "cpu", dp_rank=1)
    index.add(list(range(1, 9)), keys, [gpu0, gpu1, OTHER])
    # adds break nothing (a pod that gains keys still holds what an earlier part read)
    assert broken_by(index, keys, lambda: index.add(None, KEYS[:20], [gpu0, OTHER])) == set()
    # an evict of an entry no key holds removes nothing
    absent = PodEntry("pod-a", "x")
    assert broken_by(index, keys, lambda: index.evict(keys[0], REQUEST, [absent])) == set()
    # an evict by request key, by engine key, in a batch: the pod that lost the entry only
    assert broken_by(index, keys, lambda: index.evict(keys[5], REQUEST, [gpu1])) == {"pod-a"}
    assert broken_by(index, keys, lambda: index.evict(3, KeyType.ENGINE, [OTHER])) == {"pod-b"}
    batch = [AddOp(None, tuple(keys), (OTHER,)), EvictOp(keys[6], REQUEST, (gpu0,))]
    assert broken_by(index, keys, lambda: index.apply_batch(batch)) == {"pod-a"}
    # a clear of some entries, then of the whole pod
    assert broken_by(index, keys, lambda: index.clear_entries("pod-b", dp_rank=0)) == {"pod-b"}
    index.add(None, keys, [OTHER])
    # pod-b lost nothing since its clear ended: its stamp is that of every such pod, which the
    # end of any clear changes (the ended clear's pod loses its stamp field)
    assert broken_by(index, keys, lambda: index.clear("pod-a")) == {"pod-a", "pod-b"}
    index.add(None, keys, [gpu0])
    assert broken_by(index, keys, lambda: None) == set()  # a finished clear leaves none broken


def test_expiring_entries_break_the_stamp_when_they_lapse_or_leave(single: RedisIndex) -> None:
    index = single
    keys = KEYS[:6]
    confirmed = PodEntry("pod-s", "gpu")
    index.add(None, keys, [OTHER])
    index.add(None, keys, [SPEC], ttl=60)
    # a longer ttl keeps what an earlier part read; a shorter one breaks it
    assert broken_by(index, keys, lambda: index.add(None, keys, [SPEC], ttl=120)) == set()
    assert broken_by(index, keys, lambda: index.add(None, keys[:2], [SPEC], ttl=30)) == {"pod-s"}
    # the engine confirms the block: its speculative entries leave
    assert broken_by(index, keys, lambda: index.add(None, keys[:1], [confirmed])) == {"pod-s"}
    # a speculative entry held without a ttl that is given one will leave by itself
    plain = PodEntry("pod-p", "gpu", speculative=True)
    index.add(None, keys, [plain])
    assert broken_by(index, keys, lambda: index.add(None, keys[:3], [plain], ttl=60)) == {"pod-p"}
    # an expiring entry lapses between two parts: no write, and still the stamp breaks
    lapsing = PodEntry("pod-l", "gpu", speculative=True)
    index.add(None, keys, [lapsing], ttl=0.3)
    assert broken_by(index, keys, lambda: time.sleep(0.5)) >= {"pod-l"}


def test_a_recreated_namespace_breaks_every_stamp(single: RedisIndex) -> None:
    book = StampBook()
    book.bind(b"gen-1")
    book.take([b"pod-a", b"g0@", b"pod-b", b""])
    assert book.args() == [2, b"pod-a", b"g0@", b"pod-b", b""]
    book.take([b"pod-a", b"g0@", b"pod-b", b""])  # pod-b carried "" comes back "": dropped
    assert book.dropped == {"pod-b"} and list(book.stamps) == [b"pod-a"]
    book.bind(b"gen-2")  # the namespace was dropped and made again: "g0@" means nothing now
    assert book.dropped == {"pod-a", "pod-b"} and book.args() == [0]
    # and through the client: a lookup in parts across a drop keeps only the first part
    index = single
    index.add(None, KEYS[:N], [POD])
    other = RedisIndex(RedisIndexConfig(address=index.config.address, namespace=index.namespace))

    def recreate() -> None:
        other.drop_namespace()
        other.add(None, KEYS, [POD])

    try:
        with Between(index, recreate) as between:
            got = index.lookup(KEYS)
        assert between.done
        assert list(got) == KEYS
    finally:
        other.close()


def test_stamps_are_checked(single: RedisIndex) -> None:
    """A carried stamp that is not one the functions made is refused (KVREDIS_INVALID)."""
    from kvredis import InvalidInputError

    for bad in (b"no-at-sign", b"@", b"3@soon", b"3@nan"):
        with pytest.raises(InvalidInputError):
            stamps(single, KEYS[:2], {b"pod-a": bad})
    assert stamps(single, KEYS[:2], {b"pod-a": b""}) == {b"pod-a": b""}

"""Bounded work with fragmented chain runs: a write whose keys reach more chain-run ranges than
one call may rewrite is refused by the server before its first write (``KVREDIS_BUDGET``), and
the client sends it in smaller calls, keeping the order of its ops, the batch's at-most-once
fence and its watermark. Every backend on real servers: single server and cluster, sync and
async; the embedded index is the model of the results."""

from __future__ import annotations

import random
import struct
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    Batch,
    CallBudgetError,
    EvictOp,
    InMemoryIndex,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.index import apply_batches_in_turn
from kvredis.redis import ops
from kvredis.redis.cluster.placement import Segment
from kvredis.redis.cluster.writes import part_args
from kvredis.redis.layout import RUN_MAX, RUN_READ_COST, RUN_WORK_LIMIT, WALK_WORK_LIMIT
from kvredis.redis.requests import ScriptCall
from kvredis.scoring import LongestPrefixScorer
from tests.conftest import (
    CLUSTER_BACKENDS,
    REDIS_BACKENDS,
    TEST_PREFIX,
    close_backend,
    make_backend,
)
from tests.redis.checks import check_findings

pytestmark = pytest.mark.redis
#: The cluster backends placing pods A, B and C on one shard (not cluster_split): one shard's
#: call reaches every run, which is what the budgets below bound.
ONE_SHARD_CLUSTERS = [p for p in CLUSTER_BACKENDS if "cluster_split" not in str(p.values[0])]

A, B, C = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu"), PodEntry("pod-c", "cpu")
#: Each fragmented run below has RUN_MAX ranges: a write may reach WRITE_RUNS (3) of them
#: (lua/includes/writes.lua), a walk WALK_RUNS (7: lua/includes/walk.lua).
RUN = RUN_MAX
WRITE_RUNS = RUN_WORK_LIMIT // (RUN + RUN_READ_COST)
WALK_RUNS = WALK_WORK_LIMIT // (RUN + RUN_READ_COST)
CHAINS = 2 * WRITE_RUNS
WALK_CHAINS = WALK_RUNS + 5
ENGINE = 10**12


class Fleet:
    """A backend and the embedded model, written and read together, with the servers behind
    the backend (to count refused script calls)."""

    def __init__(self, index: Any, servers: Sequence[redis.Redis], chains: int = CHAINS) -> None:
        self.index, self.model, self.servers = index, InMemoryIndex(), servers
        index.lookup([1])  # connected: a cluster client knows its shards
        target = getattr(index, "inner", index)
        core = getattr(target, "core", None)
        if core is not None:  # on a cluster, one shard holds A, B and C: one call reaches every run
            assert len({core.pod_shard(e.pod_identifier) for e in (A, B, C)}) == 1
        self.chains = chains_in(chains)

    def both(self, method: str, *args: Any) -> Any:
        got = getattr(self.index, method)(*args)
        expected = getattr(self.model, method)(*args)
        return got, expected

    def fragment(self) -> None:
        """Each chain stored by one add (one run), then every other key evicted: RUN ranges."""
        for chain in self.chains:
            self.both("add", [k + ENGINE for k in chain], chain, [A])
        evicts = [EvictOp(k, KeyType.REQUEST, (A,)) for c in self.chains for k in c[1::2]]
        self.both("apply_batch", evicts)

    def refused(self) -> int:
        """Calls the servers refused as over budget so far (INFO errorstats)."""
        stats = (server.info("errorstats") for server in self.servers)
        return sum(_count(s.get("errorstat_KVREDIS_BUDGET", {})) for s in stats)

    def script_calls(self) -> int:
        """Script calls the servers took so far (INFO commandstats)."""
        total = 0
        for server in self.servers:
            stats = server.info("commandstats")
            for name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall", "cmdstat_fcall_ro"):
                total += int(stats.get(name, {}).get("calls", 0))
        return total

    def checked(self) -> None:
        """``check`` finds no problem (per shard on a cluster)."""
        config = getattr(self.index, "inner", self.index).config
        assert check_findings(config) == []

    def agree(self, keys: Sequence[int]) -> None:
        for key in keys:  # key by key: the chains are fragmented
            got, expected = self.both("lookup", [key])
            assert {k: set(v) for k, v in got.items()} == {
                k: set(v) for k, v in expected.items()
            }, key


def _count(stat: Any) -> int:
    """The ``count`` of an INFO errorstats line (redis-py before 5.0.2 leaves it ``count=n``)."""
    if isinstance(stat, str):
        stat = dict(pair.split("=", 1) for pair in stat.split(","))
    return int(stat.get("count", 0))


def chains_in(count: int) -> list[list[int]]:
    """``count`` chains of RUN request keys."""
    keys = iter(range(1, 10**9))
    return [[next(keys) for _ in range(RUN)] for _ in range(count)]


def fragmented(request: pytest.FixtureRequest, chains: int) -> Iterator[Fleet]:
    """A fleet of the backend ``request.param`` with ``chains`` fragmented chains."""
    index = make_backend(request.param, request)
    client, _, kind = request.param.partition("@")
    if "cluster" in client:
        cluster = request.getfixturevalue("cluster_pool").get(kind)
        servers = [cluster.client(port) for port in cluster.ports]
    else:
        servers = [redis.Redis.from_url(request.getfixturevalue("server_pool").url(kind))]
    try:
        f = Fleet(index, servers, chains)
        f.fragment()
        yield f
    finally:
        close_backend(index)
        for server in servers:
            server.close()


@pytest.fixture(params=[*REDIS_BACKENDS, *ONE_SHARD_CLUSTERS])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    yield from fragmented(request, CHAINS)


@pytest.fixture(params=[*REDIS_BACKENDS, *ONE_SHARD_CLUSTERS])
def walk_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    yield from fragmented(request, WALK_CHAINS)


def test_a_walk_reaching_many_fragmented_runs_goes_on_in_parts(walk_fleet: Fleet) -> None:
    fleet = walk_fleet
    keys = [chain[4] for chain in fleet.chains]  # one held key in each fragmented run
    calls = fleet.script_calls()
    got, expected = fleet.both("lookup", keys)
    assert len(got) == len(keys)
    assert {k: set(v) for k, v in got.items()} == {k: set(v) for k, v in expected.items()}
    assert fleet.script_calls() - calls >= 2  # the walk stopped at its limit and went on
    weights = {"gpu": 1.0, "cpu": 0.5}
    fleet.both("add", None, keys[: len(keys) // 2], [C])  # pod-c drops out half way
    scores = fleet.index.score(keys, weights)
    assert scores == LongestPrefixScorer(weights).score(keys, fleet.model.lookup(keys))
    assert scores["pod-c"] == 0.5 * (len(keys) // 2) and scores["pod-a"] == len(keys)
    with_filter, _ = fleet.both("lookup", keys, {"pod-c"})
    assert list(with_filter) == keys[: len(keys) // 2]


def test_an_add_reaching_many_fragmented_runs_is_split_and_applied_whole(fleet: Fleet) -> None:
    keys = [chain[4] for chain in fleet.chains]  # held keys, one in each fragmented run
    before = fleet.refused()
    fleet.both("add", None, keys, [C])
    assert fleet.refused() > before  # the whole call was refused, then sent in halves
    fleet.agree(keys)
    fleet.agree([chain[6] for chain in fleet.chains])  # their neighbours kept what they held
    got, expected = fleet.both("lookup", [k + 1 for k in keys])  # holes stay holes
    assert got == expected == {}


def test_a_split_batch_keeps_its_order_fence_and_watermark(fleet: Fleet) -> None:
    at = [chain[8] for chain in fleet.chains]
    batch: list[Any] = [AddOp(None, (k,), (B,)) for k in at]  # add pod-b, then evict it again:
    batch += [EvictOp(k, KeyType.REQUEST, (B,)) for k in at]  # applied out of order it stays
    batch += [AddOp(None, (k,), (C,)) for k in at]
    batch += [EvictOp(chain[10] + ENGINE, KeyType.ENGINE, (A,)) for chain in fleet.chains]
    before = fleet.refused()
    applied, _ = fleet.both("apply_batch", batch, "stream", Watermark(2, 7))
    assert applied is True
    assert fleet.refused() > before
    assert fleet.index.get_watermark("stream") == Watermark(2, 7)
    fleet.agree(at + [chain[10] for chain in fleet.chains])
    # at most once: the same batch again is skipped, and changes nothing
    fleet.both("add", None, at, [B])
    assert fleet.index.apply_batch(batch, "stream", Watermark(2, 7)) is False
    fleet.agree(at)
    assert all(B in fleet.index.lookup([k])[k] for k in at)


def test_an_unfenced_batch_reaching_many_runs_is_applied_in_order(fleet: Fleet) -> None:
    at = [chain[12] for chain in fleet.chains]
    batch: list[Any] = [AddOp(None, (k,), (B,)) for k in at]
    batch += [EvictOp(k, KeyType.REQUEST, (A, B)) for k in at]
    fleet.both("apply_batch", batch)
    fleet.agree(at + [chain[14] for chain in fleet.chains])
    assert fleet.index.lookup(at[:1]) == {}


def test_an_evict_by_engine_key_reaching_many_fragmented_runs_goes_by_request_key(
    fleet: Fleet,
) -> None:
    keys = [chain[4] for chain in fleet.chains]
    engine = 7 * ENGINE  # one engine key for a held key in each fragmented run
    fleet.both("add", [engine], keys, [C])
    before = fleet.refused()
    fleet.both("evict", engine, KeyType.ENGINE, [A])
    assert fleet.refused() > before
    fleet.agree(keys)  # pod-c still holds them: the mapping stays
    assert fleet.index.get_request_key(engine) == keys[-1]
    fleet.both("evict", engine, KeyType.ENGINE, [C])
    got, expected = fleet.both("lookup", keys[:1])
    assert got == expected == {}
    with pytest.raises(KeyError):  # nothing held any more: the mapping is gone
        fleet.index.get_request_key(engine)


@pytest.fixture
def single(redis_server_url: str) -> Iterator[tuple[RedisIndex, redis.Redis]]:
    ns = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=ns))
    raw = redis.Redis.from_url(redis_server_url)
    yield index, raw
    index.drop_namespace()
    index.close()
    raw.close()


def test_the_server_refuses_an_over_budget_call_before_its_first_write(
    single: tuple[RedisIndex, redis.Redis],
) -> None:
    index, raw = single
    fleet = Fleet(index, [raw])
    fleet.fragment()
    ns = index.config.namespace
    before = raw_state(raw, ns)
    keys = [chain[4] for chain in fleet.chains]
    program = ops.program_of(index._session.state.layout, [("A", keys, [], [C])])
    call = ops.add_call(program, 0)
    with pytest.raises(CallBudgetError, match="chain runs") as refused:
        send(index, call)
    assert (refused.value.ops, refused.value.keys) == (0, WRITE_RUNS)  # what fits: in runs
    assert raw_state(raw, ns) == before  # nothing written, not even the new entry's definition
    # one key fewer than the limit's worth of runs goes through in one call
    fits = ops.add_call(ops.program_of(program.layout, [("A", keys[:WRITE_RUNS], [], [C])]), 0)
    send(index, fits)
    assert all(C in index.lookup([k])[k] for k in keys[:WRITE_RUNS])


def raw_state(raw: redis.Redis, namespace: str) -> dict[bytes, Any]:
    """Every key of the namespace and its whole value."""
    return {key: raw.dump(key) for key in raw.scan_iter(match=f"{namespace}:*", count=1000)}


def send(index: RedisIndex, call: ScriptCall) -> Any:
    """Send one script call through the index's own executor (EVALSHA, error translation)."""
    return index._exec.run(ops.op_send(index._session, call))


@pytest.fixture
def two(redis_server_url: str) -> Iterator[tuple[Fleet, Fleet]]:
    """Two namespaces on one server, as two shards of a cluster namespace on one node are."""
    raw = redis.Redis.from_url(redis_server_url)
    pair = []
    for _ in range(2):
        ns = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
        pair.append(
            Fleet(RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=ns)), [raw])
        )
    yield pair[0], pair[1]
    for fleet in pair:
        fleet.index.drop_namespace()
        fleet.index.close()
    raw.close()


def test_the_parts_of_one_node_call_share_the_write_limit(two: tuple[Fleet, Fleet]) -> None:
    """``apply_parts`` runs one part per shard; the parts' run work adds up, so a call of many
    parts is bounded like one of many ops."""
    for fleet in two:
        fleet.chains = fleet.chains[:WRITE_RUNS]  # one part fits, two do not
        fleet.fragment()
    parts: list[Any] = []
    for shard, fleet in enumerate(two):
        layout = fleet.index._session.state.layout
        evicts = [("R", chain[8], [A]) for chain in fleet.chains]
        parts += part_args(ops.program_of(layout, evicts), 1, 1, Segment(shard, shard, ()), "ab")
    first = two[0].index._session.state.layout
    keys = (first.meta, first.pe, first.pi, first.pp, first.wm, first.wp, first.sx)
    call = ScriptCall("apply_parts", keys, [1024, *parts])
    reply = send(two[0].index, call)
    # the second part's first run is past the call's limit: refused before it wrote (alone,
    # on the per-shard path, it fits)
    assert reply[0] == 1 and bytes(reply[1]).startswith(b"KVREDIS_BUDGET 0 0")
    assert all(two[0].index.lookup([c[8]]) == {} for c in two[0].chains)  # applied
    assert all(two[1].index.lookup([c[8]]) == {c[8]: [A]} for c in two[1].chains)  # untouched


def test_the_walks_of_one_node_call_share_the_walk_limit(two: tuple[Fleet, Fleet]) -> None:
    for fleet in two:
        fleet.chains = chains_in(WALK_RUNS // 2 + 1)  # one walk fits, two do not
        fleet.fragment()
    chain = [c[4] for c in two[0].chains]
    assert chain == [c[4] for c in two[1].chains]
    args: list[Any] = [0, struct.pack(f">{len(chain)}Q", *chain)]
    for fleet in two:
        layout, cache = fleet.index._session.state.snapshot()
        args += (layout.meta, layout.pi, layout.pp, layout.sx, layout.gen, layout.rprefix)
        args += (layout.bucket_bits, cache.floor, 1, 1, 0, 0)
    first = two[0].index._session.state.layout
    call = ScriptCall("lookup_union", (first.meta, first.pi, first.pp, first.sx), args)
    whole, cut = send(two[0].index, call)
    # walked to the chain's end: known, defs, how, where, stamps, then one run of hits
    assert whole[2:4] == [2, len(chain) + 1] and whole[4] == []
    assert len(whole) == 7 and whole[6] == [len(chain), whole[6][1]]
    assert cut[2] == 1  # stopped at the work limit: the client walks that shard on


def test_random_batches_over_fragmented_runs_match_the_model(fleet: Fleet) -> None:
    """Seeded random batches of adds (with engine keys), evicts by request and engine key,
    fenced and not, each reaching many fragmented runs: split however the server refuses them,
    they leave what the model holds."""
    rng = random.Random(11)
    keys = [k for chain in fleet.chains for k in chain[2::2]]  # held keys, in every run
    pods = [A, B, C]
    engine_of: dict[int, int] = {}
    watermark = 0
    refused = fleet.refused()
    for round_ in range(12):
        batch: list[Any] = []
        for _ in range(rng.randint(4, 14)):
            kind = rng.random()
            picked = rng.sample(keys, rng.randint(1, 8))
            entries = tuple(rng.sample(pods, rng.randint(1, 2)))
            if kind < 0.45:
                engine = 10**13 + rng.randint(1, 5)  # a few engine keys mapping many:1/1:many
                engine_of.update(dict.fromkeys(picked, engine))
                batch.append(AddOp((engine,), tuple(picked), entries))
            elif kind < 0.8:
                batch.append(EvictOp(picked[0], KeyType.REQUEST, entries))
            else:
                engine = rng.choice([e for e in set(engine_of.values())] or [10**13])
                batch.append(EvictOp(engine, KeyType.ENGINE, entries))
        if rng.random() < 0.5:
            watermark += 1
            got, expected = fleet.both("apply_batch", batch, "s", Watermark(1, watermark))
            assert got is expected is True
        else:
            fleet.both("apply_batch", batch)
        probe = rng.sample(keys, 40)
        fleet.agree(probe)
        fleet.checked()
        for engine in set(engine_of.values()):
            try:
                expected_key: int | None = fleet.model.get_request_key(engine)
            except KeyError:
                expected_key = None
            try:
                got_key: int | None = fleet.index.get_request_key(engine)
            except KeyError:
                got_key = None
            assert got_key == expected_key, (round_, engine)
    assert fleet.refused() > refused  # the batches did reach the limit
    assert fleet.index.get_watermark("s") == (Watermark(1, watermark) if watermark else None)


def test_batches_applied_together_reaching_many_runs_go_one_by_one(fleet: Fleet) -> None:
    """Several small fenced batches whose keys together reach too many fragmented runs: the
    server refuses the joint call before any write, and the client sends each batch on its
    own; the answers, entries and watermarks are those of apply_batch one by one."""
    target = getattr(fleet.index, "inner", fleet.index)
    if not callable(getattr(target, "apply_batches", None)):
        pytest.skip(f"{type(target).__name__} has no apply_batches")
    at = [chain[16] for chain in fleet.chains]
    batches = [
        Batch(
            [AddOp(None, (k,), (B,)), EvictOp(k, KeyType.REQUEST, (A,))],
            f"s{i % 2}",
            Watermark(0, i // 2),
        )
        for i, k in enumerate(at)
    ]
    before, calls = fleet.refused(), fleet.script_calls()
    got = fleet.index.apply_batches(batches)
    assert got == apply_batches_in_turn(fleet.model, batches) == [True] * len(at)
    if getattr(target, "core", None) is None:
        assert fleet.refused() > before
    else:  # apply_parts answers a part over the limit in its reply (no error reply to count):
        # the parts after it went on in calls of their own
        assert fleet.script_calls() - calls >= 2
    fleet.agree(at)
    assert fleet.index.get_watermark("s0") == Watermark(0, (len(at) - 1) // 2)
    assert fleet.index.apply_batches(batches[:1]) == [False]

"""Chain runs (request keys stored together, ``<ns>:c:<id>``): exact walks whatever the key sets.

Every case compares RedisIndex with the embedded index (the model of the Index contract) and
reads the namespace straight from Redis afterwards (tests/redis/namespace_state.py checks the
run invariants: refs and run positions agree, no trailing holes, no empty runs).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from kvredis import (
    InMemoryIndex,
    KeyType,
    NamespaceLayoutError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.redis.codec import encode_entry
from kvredis.redis.inspect import Inspector, Problem, op_check, op_dump, op_restore, op_stats
from kvredis.redis.layout import Layout
from kvredis.scoring import LongestPrefixScorer
from tests.redis.namespace_state import read_namespace

pytestmark = pytest.mark.redis

A, B, C = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu"), PodEntry("pod-c", "gpu")
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}


class Pair:
    """RedisIndex and the embedded model, written and read together."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url, self.namespace = url, namespace
        self.redis = RedisIndex(RedisIndexConfig(address=url, namespace=namespace))
        self.model = InMemoryIndex()
        self.raw = redis.Redis.from_url(url)
        self.inspector = Inspector(RedisIndexConfig(address=url, namespace=namespace))

    def add(self, keys: Sequence[int], entries: Sequence[PodEntry], engine: bool = True) -> None:
        eng = [k + 10**12 for k in keys] if engine else None
        self.redis.add(eng, keys, entries)
        self.model.add(eng, keys, entries)

    def evict(self, key: int, kind: KeyType, entries: Sequence[PodEntry]) -> None:
        self.redis.evict(key, kind, entries)
        self.model.evict(key, kind, entries)

    def clear(self, pod: str) -> None:
        self.redis.clear(pod)
        self.model.clear(pod)

    def agree(self, chain: Sequence[int]) -> dict[int, list[PodEntry]]:
        got = self.redis.lookup(chain)
        assert {k: set(v) for k, v in got.items()} == {
            k: set(v) for k, v in self.model.lookup(chain).items()
        }, chain
        expected = LongestPrefixScorer(WEIGHTS).score(chain, self.model.lookup(chain))
        assert self.redis.score(chain, WEIGHTS) == expected  # bit-identical
        return got

    def consistent(self) -> None:
        state = read_namespace(self.raw, self.namespace)
        assert state.problems == []

    def checked(self) -> None:
        """``kvredis check`` finds nothing wrong: every state the API produces is legitimate."""
        layout = self.inspector.layout()
        assert layout is not None
        report = self.inspector.run(op_check(layout))
        assert report.findings == [], report.findings

    def runs(self) -> list[bytes]:
        return list(self.raw.scan_iter(match=f"{self.namespace}:c:*"))

    def in_runs(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` are held through a run (their record is a 6-byte ref)."""
        layout = Layout(self.namespace, 16, b"")
        values = [
            self.raw.hget(layout.request_bucket(k), k.to_bytes(8, "big")) or b"" for k in keys
        ]
        return sum(len(v) == 6 for v in values)

    def close(self) -> None:
        self.redis.close()
        self.raw.close()
        self.inspector.close()


@pytest.fixture
def pair(redis_server_url: str, namespace: str) -> Iterator[Pair]:
    p = Pair(redis_server_url, namespace)
    yield p
    p.close()


def test_a_chain_is_stored_as_one_run_and_read_from_any_key(pair: Pair) -> None:
    chain = list(range(1, 101))
    pair.add(chain, [A])
    assert len(pair.runs()) == 1
    assert pair.agree(chain) == {k: [A] for k in chain}
    assert pair.agree([2, 3]) == {2: [A], 3: [A]}  # a lookup starting inside the run
    pair.agree([50, 51, 7, 8])  # jumps back inside the run
    pair.agree([1, 2, 1, 2])  # keys repeated
    pair.agree([100, 101])  # past the run's end
    pair.agree([5, 7, 6])  # the run's keys out of order
    pair.consistent()


def test_a_chain_holding_a_runs_keys_out_of_place_counts_only_what_is_in_place(
    pair: Pair,
) -> None:
    # The walk compares a run's span with the chain where the chain enters the run; the run's
    # keys found later in the chain, shifted, prove nothing.
    run = list(range(1, 21))
    pair.add(run, [A])
    assert pair.agree([1, 99, *run]) == {1: [A]}
    assert pair.agree([1, 1, *run[1:]]) == {k: [A] for k in run}  # a key repeated, then in place
    assert pair.agree([*run[:5], 2, *run[5:]]) == {k: [A] for k in run}  # all held, in any order
    for cut in range(1, 21):  # the chain leaves the run after every possible key
        assert pair.agree([*run[:cut], 500, *run[cut:]]) == {k: [A] for k in run[:cut]}
        assert pair.agree(run[:cut]) == {k: [A] for k in run[:cut]}  # ends inside the run
        pair.agree([*run[cut:], *run])  # enters inside, goes past the end, then again
    pair.consistent()


def test_short_key_sets_stay_inline(pair: Pair) -> None:
    pair.add([1, 2, 3], [A])
    pair.add([9], [B])
    assert pair.runs() == []
    pair.agree([1, 2, 3, 9])
    pair.consistent()


def test_divergent_tails_and_a_second_pod_split_the_ranges(pair: Pair) -> None:
    prefix = list(range(1, 41))
    t1, t2 = list(range(100, 120)), list(range(200, 230))
    pair.add(prefix + t1, [A])
    pair.add(prefix + t2, [B])  # the prefix gains pod-b, t2 is a new run
    pair.add(t1[:5], [C])  # a middle part of a run gains pod-c
    for chain in (prefix + t1, prefix + t2, prefix[:10] + t2, t1, t2, prefix + t1[:3] + t2):
        pair.agree(chain)
    pair.consistent()


def test_evict_in_the_middle_of_a_run_ends_the_walk_there(pair: Pair) -> None:
    chain = list(range(1, 65))
    pair.add(chain, [A, B])
    pair.evict(30 + 10**12, KeyType.ENGINE, [A])  # pod-a loses key 30
    pair.evict(31 + 10**12, KeyType.ENGINE, [A, B])  # key 31 loses everything: a hole
    got = pair.agree(chain)
    assert len(got) == 30 and got[30] == [B]
    pair.agree(chain[31:])  # the keys after the hole still walk
    pair.agree([31])
    pair.consistent()
    # re-added: the hole's key is held again (on its own), and the chain walks through
    pair.add([31], [C])
    assert len(pair.agree(chain)) == 64
    pair.consistent()


def test_a_hole_key_stored_again_after_the_run_tail_joins_the_run_again(pair: Pair) -> None:
    chain = list(range(1, 21))
    pair.add(chain, [A])
    pair.evict(5 + 10**12, KeyType.ENGINE, [A])  # key 5: a hole
    pair.add([20, 5, 99, 98], [B])  # 5, 99 and 98 follow the run's last key: the run grows
    assert len(pair.runs()) == 1
    for probe in (chain, [*chain, 5, 99, 98], [4, 5, 6], [5, 99], [20, 5, 99, 98]):
        pair.agree(probe)
    pair.consistent()


def test_evicting_the_tail_trims_the_run_and_the_last_key_deletes_it(pair: Pair) -> None:
    chain = list(range(1, 17))
    pair.add(chain, [A])
    for key in reversed(chain[8:]):
        pair.evict(key + 10**12, KeyType.ENGINE, [A])
        pair.consistent()
    pair.agree(chain)
    for key in chain[:8]:
        pair.evict(key + 10**12, KeyType.ENGINE, [A])
    assert pair.runs() == []
    assert pair.agree(chain) == {}
    pair.consistent()
    assert list(pair.raw.scan_iter(match=f"{pair.namespace}:[res]:*")) == []


def test_clearing_one_pod_of_a_shared_run_keeps_the_other(pair: Pair) -> None:
    chain = list(range(1, 51))
    pair.add(chain, [A])
    pair.add(chain[:30], [B])
    pair.add(chain[10:], [C])
    pair.clear("pod-a")
    pair.agree(chain)
    pair.agree(chain[10:])
    pair.consistent()
    pair.clear("pod-b")
    pair.clear("pod-c")
    assert pair.agree(chain) == {}
    assert pair.runs() == []
    pair.consistent()


def test_a_long_add_fills_runs_of_at_most_the_run_size(pair: Pair) -> None:
    chain = list(range(1, 2501))
    pair.add(chain, [A], engine=False)
    assert len(pair.runs()) >= 3
    assert len(pair.agree(chain)) == 2500
    pair.add(list(range(2501, 2600)), [A], engine=False)  # extends the last run
    pair.agree(list(range(1, 2600)))
    pair.consistent()


def test_batches_of_adds_and_evicts_agree_with_the_model(pair: Pair) -> None:
    from kvredis import AddOp, EvictOp

    chain = list(range(1, 40))
    ops = [
        AddOp(None, tuple(chain), (A,)),
        EvictOp(10, KeyType.REQUEST, (A,)),
        AddOp(None, tuple(chain[5:20]), (B,)),
        EvictOp(39, KeyType.REQUEST, (A,)),
        AddOp(None, (10, 11, 12, *range(500, 520)), (C,)),
    ]
    pair.redis.apply_batch(ops)
    pair.model.apply_batch(ops)
    for probe in (chain, chain[9:], [10, 11, 12, *range(500, 520)], list(range(500, 520))):
        pair.agree(probe)
    pair.consistent()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_key_sets_agree_with_the_model(pair: Pair, seed: int) -> None:
    rng = random.Random(seed)
    pods = [A, B, C]
    universe = list(range(1, 120))
    chains = [rng.sample(universe, rng.randint(1, 40)) for _ in range(12)]
    for _ in range(60):
        roll = rng.random()
        chain = rng.choice(chains)
        if roll < 0.45:
            start = rng.randrange(len(chain))
            pair.add(chain[start : start + rng.randint(1, 30)], rng.sample(pods, rng.randint(1, 2)))
        elif roll < 0.8:
            key = rng.choice(chain)
            kind = rng.choice([KeyType.REQUEST, KeyType.ENGINE])
            pair.evict(key + (10**12 if kind is KeyType.ENGINE else 0), kind, [rng.choice(pods)])
        elif roll < 0.85:
            pair.clear(rng.choice(pods).pod_identifier)
        for probe in (chain, chain[rng.randrange(len(chain)) :], rng.sample(universe, 10)):
            pair.agree(probe)
        for key in chain:
            assert _mapped(pair.redis, key + 10**12) == _mapped(pair.model, key + 10**12)
        pair.checked()
    pair.consistent()


def _mapped(index: Any, engine_key: int) -> int | None:
    try:
        return int(index.get_request_key(engine_key))
    except KeyError:
        return None


@pytest.mark.parametrize("seed", [4, 5])
def test_random_steps_with_expiring_entries_and_engine_keys_stay_clean_for_check(
    pair: Pair, seed: int
) -> None:
    """Adds with engine keys, speculative adds with a ttl (some expiring during the test, next
    to later deadlines in the same field or bucket), evicts by request and by engine key and
    clears, checked against the model and by ``check`` after every step."""
    rng = random.Random(seed)
    pods = [A, B, S_CONFIRMED]
    speculative = [S, S_OTHER]
    universe = list(range(1, 80))
    chains = [rng.sample(universe, rng.randint(1, 24)) for _ in range(8)]
    for _ in range(45):
        roll = rng.random()
        chain = rng.choice(chains)
        start = rng.randrange(len(chain))
        keys = chain[start : start + rng.randint(1, 20)]
        if roll < 0.3:
            pair.add(keys, rng.sample(pods, rng.randint(1, 2)), engine=rng.random() < 0.8)
        elif roll < 0.5:  # a long ttl, then a short one on the same keys: both in one field
            entries = [rng.choice(speculative)]
            pair.model.add(None, keys, entries, ttl=60.0)
            pair.redis.add(None, keys, entries, ttl=60.0)
            short = [e for e in speculative if e not in entries]
            pair.model.add(None, keys, short, ttl=0.05)
            pair.redis.add(None, keys, short, ttl=0.05)
            time.sleep(0.12)  # past the short deadline for both
        elif roll < 0.85:
            key = rng.choice(chain)
            kind = rng.choice([KeyType.REQUEST, KeyType.ENGINE])
            target = key + (10**12 if kind is KeyType.ENGINE else 0)
            pair.evict(target, kind, [rng.choice([*pods, *speculative])])
        else:
            pair.clear(rng.choice([*pods, *speculative]).pod_identifier)
        for probe in (chain, chain[rng.randrange(len(chain)) :]):
            pair.agree(probe)
        pair.checked()
    pair.consistent()
    # --repair reclaims the expired items and keeps what the reference answers for (the live
    # items keep their field expiry, the mappings without holders stay)
    layout = pair.inspector.layout()
    assert layout is not None
    repaired = pair.inspector.run(op_check(layout, repair=True))
    assert repaired.findings == []
    assert all(n.repaired for n in repaired.notes if n.problem is Problem.EXPIRED_SPECULATIVE)
    assert not any(n.repaired for n in repaired.notes if n.problem is Problem.DANGLING_MAPPING)
    after = pair.inspector.run(op_check(layout))
    assert after.findings == []
    assert {n.problem for n in after.notes} <= {Problem.DANGLING_MAPPING}
    for chain in chains:
        pair.agree(chain)


# -- speculative entries with a ttl on keys of runs (the expiring buckets, includes/expiry) ----

S = PodEntry("pod-s", speculative=True)
S_CONFIRMED = PodEntry("pod-s", "gpu")
S_OTHER = PodEntry("pod-b", speculative=True)
#: Long enough for the checks made while the entries are live.
TTL = 1.0


def add_expiring(pair: Pair, keys: Sequence[int], entries: Sequence[PodEntry]) -> None:
    """Add with the ttl, the model first (its deadline is then never later than the server's)."""
    pair.model.add(None, keys, entries, ttl=TTL)
    pair.redis.add(None, keys, entries, ttl=TTL)


def expire(pair: Pair) -> None:
    """Wait until the server deleted the gate of the expiring buckets (without writing)."""
    gate = Layout(pair.namespace, 1, b"").sx
    deadline = time.monotonic() + TTL + 5.0
    while pair.raw.exists(gate):
        assert time.monotonic() < deadline, "the gate did not expire"
        time.sleep(0.05)


def expiring_items(pair: Pair, key: int) -> bytes | None:
    layout = pair.redis._session.state.layout
    value: bytes | None = pair.raw.hget(layout.expiring_bucket(key), key.to_bytes(8, "big"))
    return value


def test_expiring_entries_on_keys_of_a_run_hit_while_live_and_the_chain_ends_after(
    pair: Pair,
) -> None:
    chain = list(range(1, 33))
    pair.add(chain, [A])
    tail = list(range(40, 46))  # keys with no request record at all
    add_expiring(pair, chain[8:16] + tail, [S])
    assert len(pair.runs()) == 1  # an expiring add never writes into runs
    layout = pair.redis._session.state.layout
    assert all(pair.raw.hget(layout.request_bucket(k), k.to_bytes(8, "big")) is None for k in tail)
    got = pair.agree(chain + tail)  # the walk goes on past the run into expiring-only keys
    assert len(got) == 38 and got[9] == [A, S] and got[40] == [S] and got[1] == [A]
    assert len(pair.agree(tail + chain)) == 38  # and into the run after expiring-only keys
    pair.agree(chain[8:16] + tail)  # pod-s holds the whole of this chain
    pair.consistent()
    expire(pair)
    assert pair.agree(chain + tail) == {k: [A] for k in chain}
    assert pair.agree(tail) == {}
    assert pair.redis.score(chain + tail, WEIGHTS) == {"pod-a": 32.0}
    pair.consistent()


def test_an_expiring_entry_bridges_a_hole_of_a_run_until_it_expires(pair: Pair) -> None:
    chain = list(range(1, 41))
    pair.add(chain, [A])
    pair.evict(20 + 10**12, KeyType.ENGINE, [A])  # key 20 becomes a hole of the run
    assert len(pair.agree(chain)) == 19
    add_expiring(pair, [20], [S])
    assert len(pair.agree(chain)) == 40  # the chain continues through the hole while live
    assert pair.agree(chain)[20] == [S]
    pair.agree(chain[19:])  # a walk starting at the hole
    pair.consistent()
    expire(pair)
    assert len(pair.agree(chain)) == 19
    pair.consistent()


def test_a_confirmation_inside_a_run_replaces_the_pods_expiring_entries_there(
    pair: Pair,
) -> None:
    chain = list(range(1, 33))
    pair.add(chain, [A])
    add_expiring(pair, chain[:16], [S])
    pair.add(chain[4:8], [S_CONFIRMED])  # keys 5..8, held through the run
    for key in chain[4:8]:
        assert expiring_items(pair, key) is None
    for key in (1, 4, 9, 16):
        assert expiring_items(pair, key) is not None
    got = pair.agree(chain)
    assert got[5] == [A, S_CONFIRMED] and got[1] == [A, S]
    pair.consistent()
    expire(pair)
    got = pair.agree(chain)
    assert got[5] == [A, S_CONFIRMED] and got[1] == [A] and len(got) == 32
    pair.consistent()


def test_a_speculative_entry_moves_between_runs_and_expiring_buckets(pair: Pair) -> None:
    chain = list(range(1, 21))
    add_expiring(pair, chain, [S])
    assert pair.runs() == []
    pair.add(chain, [S])  # the same entries without a ttl: they stop expiring
    assert len(pair.runs()) == 1
    assert all(expiring_items(pair, k) is None for k in chain)
    pair.consistent()
    add_expiring(pair, chain, [S])  # with a ttl again: out of the run, which empties and goes
    assert pair.runs() == []
    assert pair.agree(chain) == {k: [S] for k in chain}
    pair.consistent()
    expire(pair)
    assert pair.agree(chain) == {}


def test_evict_and_clear_remove_a_pods_entries_from_runs_and_expiring_buckets(
    pair: Pair,
) -> None:
    chain = list(range(1, 33))
    pair.add(chain, [A, S_CONFIRMED])
    add_expiring(pair, [*chain[16:], 50, 51], [S])  # inside the run, and past it
    add_expiring(pair, [60], [S_OTHER])  # another pod's expiring entry stays
    pair.evict(20 + 10**12, KeyType.ENGINE, [S])  # engine key of a run position
    assert expiring_items(pair, 20) is None
    pair.evict(21, KeyType.REQUEST, [S, S_CONFIRMED])
    assert expiring_items(pair, 21) is None
    pair.agree([*chain, 50, 51])
    pair.consistent()
    pair.clear("pod-s")
    layout = pair.redis._session.state.layout
    assert all(expiring_items(pair, k) is None for k in [*chain, 50, 51])
    assert expiring_items(pair, 60) is not None
    assert pair.raw.hget(layout.pp, b"pod-s") is None
    assert pair.agree([*chain, 50, 51]) == {k: [A] for k in chain}
    assert pair.agree([60]) == {60: [S_OTHER]}
    pair.consistent()


def test_check_and_dump_restore_keep_runs_and_expiring_buckets_apart(
    pair: Pair, namespace: str
) -> None:
    chain = list(range(1, 33))
    pair.add(chain, [A])
    add_expiring(pair, [*chain[:10], 70], [S])
    config = RedisIndexConfig(address=pair.url, namespace=namespace)
    with Inspector(config) as inspector:
        layout = inspector.layout()
        assert layout is not None
        assert inspector.run(op_check(layout)).findings == []
        stats = inspector.run(op_stats(layout, memory=False))
        assert (stats.runs, stats.expiring_entries, stats.pairs) == (1, 11, 32)
        records: list[dict[str, object]] = []
        inspector.run(op_dump(layout, records.append))
        copy = f"{namespace}-copy"
        inspector.run(op_restore(copy.encode() + b":", records))
    with RedisIndex(RedisIndexConfig(address=pair.url, namespace=copy)) as restored:
        assert restored.lookup([*chain, 70]) == pair.redis.lookup([*chain, 70])
    assert read_namespace(pair.raw, copy).problems == []
    pair.raw.delete(*pair.raw.scan_iter(match=f"{copy}:*"))


def test_check_repairs_an_id_held_both_in_a_run_and_as_an_expiring_entry(
    pair: Pair, namespace: str
) -> None:
    chain = list(range(1, 33))
    pair.add(chain, [A])  # a run
    pair.add([80], [A])  # inline
    add_expiring(pair, [3, 80], [S])
    layout = pair.redis._session.state.layout
    a_id = pair.raw.hget(layout.pe, encode_entry(A))
    assert a_id is not None
    for key in (3, 80):  # a foreign write: pod-a's id also as an expiring item of the key
        items = expiring_items(pair, key)
        assert items is not None
        pair.raw.hset(layout.expiring_bucket(key), key.to_bytes(8, "big"), items + a_id + items[4:])
    assert any("both ways" in p for p in read_namespace(pair.raw, namespace).problems)
    config = RedisIndexConfig(address=pair.url, namespace=namespace)
    with Inspector(config) as inspector:
        report = inspector.run(op_check(layout, repair=True))
        # (on Valkey the foreign HSETs also dropped the fields' expiry: no_expiry)
        assert sorted(f.field for f in report.findings if f.problem is Problem.HELD_TWICE) == [
            k.to_bytes(8, "big") for k in (3, 80)
        ]
        assert inspector.run(op_check(layout)).findings == []
    pair.consistent()
    pair.agree([*chain, 80])


def test_a_namespace_of_the_previous_layout_is_refused(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    raw.hset(
        f"{namespace}:meta", mapping={"layout": "kvredis-kvblock/1", "bucket_bits": 16, "gen": "g"}
    )
    with pytest.raises(NamespaceLayoutError, match="kvredis-kvblock/1"):
        RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    raw.close()


def test_check_finds_and_repairs_broken_refs_and_runs(pair: Pair) -> None:
    chain = list(range(1, 41))
    pair.add(chain, [A])
    pair.add(list(range(100, 130)), [B])
    layout = Layout(pair.namespace, 16, b"")
    runs = sorted(pair.runs())
    raw = pair.raw
    # a ref deleted (its run position unreferenced), a ref pointing elsewhere, a run deleted
    raw.hdel(layout.request_bucket(5), (5).to_bytes(8, "big"))
    raw.hset(layout.request_bucket(6), (6).to_bytes(8, "big"), runs[0][-4:] + b"\x00\x09")
    raw.delete(runs[1])
    config = RedisIndexConfig(address=pair.url, namespace=pair.namespace)
    with Inspector(config) as inspector:
        loaded = inspector.layout()
        assert loaded is not None
        report = inspector.run(op_check(loaded))
        found = {f.problem for f in report.findings}
        assert {Problem.UNREFERENCED_POSITION, Problem.DANGLING_REF} <= found
        assert not report.ok
        repaired = inspector.run(op_check(loaded, repair=True))
        assert repaired.ok
        # the refs repaired away leave their engine mappings without holders: notes, kept
        again = inspector.run(op_check(loaded, repair=True))
        assert again.findings == []
        assert {f.problem for f in again.notes} == {Problem.DANGLING_MAPPING}
        assert not any(f.repaired for f in again.notes)
        assert pair.redis.get_request_key(106 + 10**12) == 106
    pair.consistent()
    got = pair.redis.lookup(chain)
    assert got[5] == [A]  # the unreferenced position got its ref back
    assert 6 not in got
    assert pair.redis.lookup(list(range(100, 130))) == {}  # its run was lost


def test_check_passes_on_runs_with_holes_and_dump_restore_round_trips(
    pair: Pair, redis_server_url: str
) -> None:
    chain = list(range(1, 80))
    pair.add(chain, [A, B])
    pair.add(chain[20:50], [C])
    pair.evict(40 + 10**12, KeyType.ENGINE, [A, B, C])
    pair.evict(41, KeyType.REQUEST, [C])
    config = RedisIndexConfig(address=redis_server_url, namespace=pair.namespace)
    records: list[dict[str, object]] = []
    with Inspector(config) as inspector:
        layout = inspector.layout()
        assert layout is not None
        assert inspector.run(op_check(layout)).findings == []
        inspector.run(op_dump(layout, records.append))
    before = {k: set(v) for k, v in pair.redis.lookup(chain).items()}
    after_hole = {k: set(v) for k, v in pair.redis.lookup(chain[41:]).items()}
    pair.redis.drop_namespace()
    with Inspector(config) as inspector:
        inspector.run(op_restore(f"{pair.namespace}:".encode(), records))
    fresh = RedisIndex(config)
    try:
        assert {k: set(v) for k, v in fresh.lookup(chain).items()} == before
        assert {k: set(v) for k, v in fresh.lookup(chain[41:]).items()} == after_hole
    finally:
        fresh.close()
    pair.consistent()


# -- keys appended one event at a time (an AddOp's parent key) ----------------------------------


def _apply(pair: Pair, ops: Sequence[Any]) -> None:
    pair.redis.apply_batch(ops)
    pair.model.apply_batch(ops)


def test_one_key_adds_after_a_runs_last_key_join_the_run(pair: Pair) -> None:
    from kvredis import AddOp

    prompt = list(range(1, 21))
    _apply(pair, [AddOp(None, tuple(prompt), (A,))])
    chain = list(prompt)
    for key in range(100, 140):  # decode blocks, one event each
        _apply(pair, [AddOp(None, (key,), (A,), chain[-1])])
        chain.append(key)
    assert len(pair.runs()) == 1 and pair.in_runs(chain) == len(chain)
    # one range: the appended positions hold what the run's last range holds (merged)
    assert len(pair.raw.hget(pair.runs()[0], "r") or b"") == 4 + 4
    assert pair.agree(chain) == {k: [A] for k in chain}
    pair.agree(chain[25:])
    pair.agree([*chain[:30], 7, *chain[30:]])
    pair.consistent()


def test_several_appends_in_one_batch_and_a_second_pod_join_the_run(pair: Pair) -> None:
    from kvredis import AddOp

    prompt = list(range(1, 11))
    _apply(pair, [AddOp(None, tuple(prompt), (A,))])
    ops = [AddOp(None, (200 + j,), (A,), 199 + j if j else prompt[-1]) for j in range(5)]
    _apply(pair, ops)
    chain = [*prompt, *range(200, 205)]
    _apply(pair, [AddOp(None, tuple(chain), (B,))])  # pod-b holds the whole chain
    _apply(pair, [AddOp(None, (300,), (B,), chain[-1])])
    assert len(pair.runs()) == 1
    pair.agree([*chain, 300])
    pair.consistent()


def test_a_short_chain_continued_one_key_at_a_time_becomes_a_run(pair: Pair) -> None:
    from kvredis import AddOp

    _apply(pair, [AddOp(None, (1, 2, 3), (A,))])  # a chain start of three keys: inline
    assert pair.runs() == []
    chain = [1, 2, 3]
    for key in range(10, 30):
        _apply(pair, [AddOp(None, (key,), (A,), chain[-1])])
        chain.append(key)
    assert len(pair.runs()) == 1  # the keys after the inline start, together
    assert pair.in_runs(chain) == len(chain) - 3
    assert pair.agree(chain) == {k: [A] for k in chain}
    # a branch from inside the run starts a run of its own; a parent nobody holds adds inline
    _apply(pair, [AddOp(None, (500, 501), (B,), 15)])
    _apply(pair, [AddOp(None, (600,), (B,), 12345)])
    assert len(pair.runs()) == 2
    for probe in (chain, [*chain[:8], 500, 501], [600], [*chain, 600]):
        pair.agree(probe)
    pair.consistent()


def test_appends_after_an_evicted_tail_and_a_full_run(pair: Pair) -> None:
    from kvredis import AddOp, EvictOp

    chain = list(range(1, 1025))  # one full run
    _apply(pair, [AddOp(None, tuple(chain), (A,))])
    _apply(pair, [AddOp(None, (2000,), (A,), 1024), AddOp(None, (2001,), (A,), 2000)])
    assert len(pair.runs()) == 2
    _apply(pair, [EvictOp(2001, KeyType.REQUEST, (A,))])  # the tail goes: the run is cut back
    _apply(pair, [AddOp(None, (2002,), (A,), 2000)])
    pair.agree([*chain, 2000, 2002])
    pair.agree([*chain, 2000, 2001])
    assert len(pair.runs()) == 2
    pair.consistent()


def _run_of(pair: Pair, key: int) -> bytes:
    """The run id in request key ``key``'s ref."""
    layout = Layout(pair.namespace, 16, b"")
    ref = pair.raw.hget(layout.request_bucket(key), key.to_bytes(8, "big")) or b""
    assert len(ref) == 6, key
    return ref[:4]


def test_a_run_past_the_append_limit_is_not_rewritten_for_a_few_appended_keys(
    pair: Pair,
) -> None:
    from kvredis import AddOp
    from kvredis.redis.layout import RUN_APPEND_MAX

    prompt = list(range(1, RUN_APPEND_MAX + 41))  # a prefill past the limit
    _apply(pair, [AddOp(None, tuple(prompt), (A,))])
    (long_run,) = pair.runs()
    keys_before = pair.raw.hget(long_run, "k")
    chain = list(prompt)
    for key in range(5000, 5000 + RUN_APPEND_MAX + 5):  # decode: one key per event
        _apply(pair, [AddOp(None, (key,), (A,), chain[-1])])
        chain.append(key)
    # the long run is left as it was; the appended keys fill runs of their own after it, each
    # extended while it is short, then followed by the next
    assert pair.raw.hget(long_run, "k") == keys_before
    decode = chain[len(prompt) :]
    first, later = _run_of(pair, decode[0]), _run_of(pair, decode[-1])
    assert first != long_run[-4:] and later not in (first, long_run[-4:])
    # extended while it holds RUN_APPEND_MAX keys or fewer: RUN_APPEND_MAX + 1 in all
    assert {_run_of(pair, k) for k in decode[: RUN_APPEND_MAX + 1]} == {first}
    assert _run_of(pair, decode[RUN_APPEND_MAX + 1]) == later
    assert pair.raw.hstrlen(f"{pair.namespace}:c:".encode() + first, "k") == 8 * (
        RUN_APPEND_MAX + 1
    )
    assert len(pair.runs()) == 3 and pair.in_runs(chain) == len(chain)
    assert pair.agree(chain) == {k: [A] for k in chain}
    pair.agree(chain[100:])
    pair.agree([*chain[: len(prompt) + 3], 7])
    pair.consistent()


def test_a_long_run_is_extended_by_a_chunk_of_its_share_and_a_batch_of_few_keys_is_not(
    pair: Pair,
) -> None:
    from kvredis import AddOp
    from kvredis.redis.layout import RUN_APPEND_SHARE

    prompt = list(range(1, 401))
    _apply(pair, [AddOp(None, tuple(prompt), (A,))])
    (long_run,) = pair.runs()
    # a prefill chunk of an eighth of the run joins it
    chunk = tuple(range(1000, 1000 + len(prompt) // RUN_APPEND_SHARE))
    _apply(pair, [AddOp(None, chunk, (A,), prompt[-1])])
    assert pair.runs() == [long_run] and _run_of(pair, chunk[-1]) == long_run[-4:]
    chain = [*prompt, *chunk]
    # five one-key appends in one batch (fewer than RUN_MIN keys, 5 x 8 < 450): a run of their
    # own after the long one, which a later append of one key joins
    ops = [AddOp(None, (2000 + j,), (B,), 1999 + j if j else chain[-1]) for j in range(5)]
    _apply(pair, ops)
    _apply(pair, [AddOp(None, (2005,), (B,), 2004)])
    tail = list(range(2000, 2006))
    assert len(pair.runs()) == 2 and {_run_of(pair, k) for k in tail} != {long_run[-4:]}
    assert len({_run_of(pair, k) for k in tail}) == 1
    pair.agree([*chain, *tail])
    pair.agree(tail)
    # one key fewer than an eighth of a long run: a run of its own after it
    other = list(range(3001, 3401))
    _apply(pair, [AddOp(None, tuple(other), (C,))])
    other_run = _run_of(pair, other[-1])
    short = tuple(range(4000, 4000 + len(other) // RUN_APPEND_SHARE - 1))
    _apply(pair, [AddOp(None, short, (C,), other[-1])])
    assert len({_run_of(pair, k) for k in short}) == 1 and _run_of(pair, short[0]) != other_run
    assert pair.raw.hstrlen(f"{pair.namespace}:c:".encode() + other_run, "k") == 8 * len(other)
    pair.agree([*other, *short])
    pair.consistent()


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_appends_branches_and_evictions_agree_with_the_model(pair: Pair, seed: int) -> None:
    from kvredis import AddOp, EvictOp

    rng = random.Random(seed)
    pods = [A, B, C]
    next_key = iter(range(1000, 10**6))
    chains: list[list[int]] = [[next(next_key) for _ in range(rng.randint(1, 12))]]
    _apply(pair, [AddOp(None, tuple(chains[0]), (A,))])
    for _ in range(80):
        roll = rng.random()
        ops: list[Any] = []
        for _ in range(rng.randint(1, 4)):
            chain = rng.choice(chains)
            if roll < 0.55:  # appends: one key, or a short event, after the chain's end
                new = [next(next_key) for _ in range(rng.choice([1, 1, 1, 3, 9]))]
                parent = chain[-1] if rng.random() < 0.9 else rng.choice(chain)
                if parent != chain[-1]:  # a branch
                    chain = chain[: chain.index(parent) + 1]
                    chains.append(chain)
                ops.append(AddOp(None, tuple(new), (rng.choice(pods),), parent))
                chain.extend(new)
            elif roll < 0.65:  # a pod stores a whole chain
                ops.append(AddOp(None, tuple(chain), (rng.choice(pods),)))
            else:
                ops.append(EvictOp(rng.choice(chain), KeyType.REQUEST, (rng.choice(pods),)))
        _apply(pair, ops)
        for probe in (rng.choice(chains), chains[-1][rng.randrange(len(chains[-1])) :]):
            pair.agree(probe)
    for chain in chains:
        pair.agree(chain)
    pair.consistent()


def _ingest_vllm(pair: Pair, events: Sequence[Any], seq: int) -> None:
    from kvredis.ingest import EventIngester
    from tests.ingest.wire import vllm_batch

    ing = pair.__dict__.setdefault("ingester", EventIngester(pair.redis, _TP16))
    ing.process("kv@pod-a@base-model", seq, vllm_batch(list(events)), endpoint="pod-a")


def _tp16() -> Any:
    from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig

    return ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))


_TP16 = _tp16()


def test_vllm_prefill_then_decode_events_through_the_ingester_fill_one_run(pair: Pair) -> None:
    """vLLM stores a prompt in prefill chunks, then one one-block event per 16 generated tokens:
    every block joins the prompt's run, so the chain is walked with one read of one run."""
    from tests.ingest.wire import vllm_stored

    tokens = list(range(5000, 5000 + 16 * 40))
    prefill = [vllm_stored(list(range(1, 21)), None, tokens[: 16 * 20], 16)]
    _ingest_vllm(pair, prefill, 0)
    for j in range(20, 40):  # decode: one block per event, each its own engine batch
        block = vllm_stored([j + 1], j, tokens[16 * j : 16 * (j + 1)], 16)
        _ingest_vllm(pair, [block], j - 19)
    keys = _TP16.tokens_to_kv_block_keys(0, tokens, "base-model")
    assert len(keys) == 40
    assert len(pair.runs()) == 1 and pair.in_runs(keys) == 40
    assert len(pair.redis.lookup(keys)) == 40
    pair.consistent()


def test_vllm_decode_after_a_long_prompt_through_the_ingester_leaves_the_prompt_run_alone(
    pair: Pair,
) -> None:
    """A prompt past the append limit, then one one-block event per 16 generated tokens: the
    decode blocks go into a run of their own after the prompt's, which is not rewritten."""
    from kvredis.redis.layout import RUN_APPEND_MAX
    from tests.ingest.wire import vllm_stored

    n, out = RUN_APPEND_MAX + 72, 30
    tokens = list(range(5000, 5000 + 16 * (n + out)))
    prefill = [
        vllm_stored(
            list(range(1 + c, 1 + min(c + 128, n))),
            c or None,
            tokens[16 * c : 16 * min(c + 128, n)],
            16,
        )
        for c in range(0, n, 128)
    ]
    _ingest_vllm(pair, prefill, 0)
    keys = _TP16.tokens_to_kv_block_keys(0, tokens, "base-model")
    prompt_runs = {_run_of(pair, k) for k in keys[:n]}
    stored = {r: pair.raw.hget(f"{pair.namespace}:c:".encode() + r, "k") for r in prompt_runs}
    for j in range(n, n + out):
        block = vllm_stored([j + 1], j, tokens[16 * j : 16 * (j + 1)], 16)
        _ingest_vllm(pair, [block], j - n + 1)
    assert len(keys) == n + out
    decode_runs = {_run_of(pair, k) for k in keys[n:]}
    assert len(decode_runs) == 1 and not decode_runs & prompt_runs
    assert {
        r: pair.raw.hget(f"{pair.namespace}:c:".encode() + r, "k") for r in prompt_runs
    } == stored
    assert len(pair.redis.lookup(keys)) == n + out
    pair.consistent()


@pytest.mark.parametrize(
    "weights",
    [
        {"gpu": 1.0, "cpu": 0.5},  # multiples of 2^-10: a range adds in one step
        {"gpu": 0.8, "cpu": 0.1},  # not: added key by key
        {"gpu": 2.0**41, "cpu": 3.0},  # sums past the exact bound: key by key
    ],
)
def test_scores_of_long_runs_stay_bit_identical_whatever_the_weights(
    pair: Pair, weights: dict[str, float]
) -> None:
    chain = list(range(1, 901))
    pair.add(chain, [A])
    pair.add(chain[:700], [B])
    pair.add(chain[:300], [C])
    for probe in (chain, chain[:650], chain[100:]):
        expected = LongestPrefixScorer(weights).score(probe, pair.model.lookup(probe))
        assert pair.redis.score(probe, weights) == expected

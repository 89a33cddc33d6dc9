"""The chain datasets of the server-side benchmarks (scripts/_chains.py) and their loaders.

Shape: counts, sharing, who holds what, determinism. Loaders: kvredis and the reference layout
loaded from the same dataset answer every chain alike, and the fast reference client scores as
``LongestPrefixScorer`` does.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import redis

from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import PodEntry
from scripts import reference_layout
from tests.servers import RedisServer

# The benchmarks import their siblings by bare name (see scripts/_bench.py).
sys.modules.setdefault("reference_layout", reference_layout)
chains: ModuleType = importlib.import_module("scripts._chains")

REFERENCE_DB = 1


def small() -> object:
    """The 20k-chain shape at 1/200 (5 families, 100 chains)."""
    return chains.TWENTY_K_CHAINS.scaled(1 / 200)


def test_twenty_k_chains_counts() -> None:
    spec = chains.TWENTY_K_CHAINS
    assert (spec.families, spec.prefix_blocks, spec.tails_per_family, spec.tail_blocks) == (
        1000, 384, 20, 128,
    )
    assert spec.chains == 20_000
    assert spec.chain_blocks == 512
    assert spec.distinct_keys == 2_944_000
    assert spec.pods == 8
    quick = spec.scaled(1 / 20)
    assert (quick.families, quick.chains, quick.distinct_keys) == (50, 1000, 147_200)


def test_chains_share_their_family_prefix_and_nothing_else() -> None:
    data = chains.build(small())
    spec = data.spec
    assert data.chains == 100
    all_keys: set[int] = set()
    for family in range(spec.families):
        prefix = data.prefix(family)
        assert len(prefix) == 384
        for t in range(20):
            chain = data.chain(family * 20 + t)
            assert len(chain) == 512
            assert chain[:384] == prefix
            assert chain[384:] == data.tail(family, t)
        family_keys = set(prefix).union(*(data.tail(family, t) for t in range(20)))
        assert len(family_keys) == 384 + 20 * 128
        assert not family_keys & all_keys
        all_keys |= family_keys
    assert len(all_keys) == data.distinct_keys() == spec.distinct_keys
    assert all(0 <= k < 2**64 for k in all_keys)


def test_holders_are_seeded_and_prefixes_held_by_the_union() -> None:
    data = chains.build(small())
    counts = {len(h) for h in data.holders}
    assert counts == {1, 2, 3}
    assert all(list(h) == sorted(set(h)) and min(h) >= 0 and max(h) < 8 for h in data.holders)
    for family in range(data.spec.families):
        union = set().union(*data.holders[family * 20 : (family + 1) * 20])
        assert data.family_holders(family) == tuple(sorted(union))
    again = chains.build(small())
    assert again.holders == data.holders and again.chain(7) == data.chain(7)
    other = chains.build(dataclasses.replace(small(), seed=2))  # type: ignore[type-var]
    assert other.chain(0) != data.chain(0)


def test_events_and_runs_write_the_same_entries() -> None:
    data = chains.build(small())

    def pairs_of_runs() -> list[tuple[int, int]]:
        return [(k, pod) for keys, holders in data.runs() for k in keys for pod in holders]

    from_runs = pairs_of_runs()
    from_events = [(k, e.pod) for e in data.events() for k in e.request_keys]
    assert len(from_runs) == len(set(from_runs)) == data.entries()
    assert sorted(from_events) == sorted(from_runs)  # each pair reported once
    # each pod's first event of a family is the whole chain, the next ones its tail
    sizes = {len(e.request_keys) for e in data.events()}
    assert sizes == {512, 128}
    # parts split the families between workers without overlap
    halves = [set(map(tuple, (k for k, _ in data.runs(p, 2)))) for p in range(2)]
    assert not halves[0] & halves[1]
    assert len(halves[0]) + len(halves[1]) == len(list(data.runs()))


def test_engine_keys_are_a_bijection_of_request_keys() -> None:
    data = chains.build(small())
    keys = data.chain(0) + data.chain(21)
    engine = [chains.engine_key(k) for k in keys]
    assert len(set(engine)) == len(set(keys))
    assert all(0 <= e < 2**64 for e in engine)
    assert chains.Event(0, keys[:3]).engine_keys == engine[:3]


def test_hot_chain_and_random_keys() -> None:
    hot = chains.build(chains.HOT_CHAIN)
    assert hot.chains == 1 and len(hot.chain(0)) == 512
    assert hot.holders == [(0, 1, 2, 3)]
    assert [p.device_tier for p in hot.pods] == ["gpu", "gpu", "cpu", "cpu"]
    assert hot.entries() == 512 * 4
    spec = chains.random_keys(1_000_000, 64)
    assert (spec.families, spec.chain_blocks, spec.chains, spec.holders) == (
        1953, 512, 1953, (64, 64),
    )
    few = chains.build(chains.random_keys(4096, 16, holders=(1, 4)))
    assert few.chains == 8 and few.distinct_keys() == 4096
    assert all(1 <= len(h) <= 4 for h in few.holders)
    with pytest.raises(ValueError):
        chains.random_keys(4096, 4, holders=(2, 5))


def test_random_chains_are_whole_chains_of_the_dataset() -> None:
    data = chains.build(small())
    every = {tuple(data.chain(c)) for c in range(data.chains)}
    picked = data.random_chains(random.Random(3), 50)
    assert len(picked) == 50 and all(tuple(c) in every for c in picked)
    assert picked == data.random_chains(random.Random(3), 50)


@pytest.fixture
def server(own_redis_server: RedisServer) -> Iterator[RedisServer]:
    yield own_redis_server
    redis.Redis(port=own_redis_server.port).flushall()


@pytest.mark.parametrize("per_event", [False, True], ids=["runs", "events"])
def test_loaders_agree_on_every_chain(server: RedisServer, per_event: bool) -> None:
    data = chains.build(small())
    config = RedisIndexConfig(address=f"{server.url}/0", namespace="kvt-chains")
    kv_load = chains.load_kvredis(config, data, processes=2, per_event=per_event)
    ref_load = chains.load_reference("127.0.0.1", server.port, REFERENCE_DB, data, processes=2)
    assert kv_load.entries == ref_load.entries == data.entries()
    ref_client = redis.Redis(port=server.port, db=REFERENCE_DB)
    ref = reference_layout.ReferenceLayout(ref_client)
    conn = reference_layout.RespConnection("127.0.0.1", server.port, REFERENCE_DB)
    fast = reference_layout.FastReferenceClient(conn, chains.WEIGHTS)
    scorer = LongestPrefixScorer(chains.WEIGHTS)
    try:
        with RedisIndex(config) as index:
            for c in [0, 1, 19, 20, 57, data.chains - 1]:
                keys = data.chain(c)
                expected = {k: set(v) for k, v in ref.lookup(keys).items()}
                assert len(expected) == 512
                assert {k: set(v) for k, v in index.lookup(keys).items()} == expected
                assert {k: set(v) for k, v in fast.lookup(keys).items()} == expected
                want = scorer.score(keys, ref.lookup(keys))
                family = c // 20
                names = {p: data.pods[p].pod_identifier for p in data.family_holders(family)}
                assert set(want) == set(names.values())  # the prefix holders score
                full = {names[p] for p in data.holders[c]}  # the chain holders score more
                assert min(want[n] for n in full) > max(
                    (want[n] for n in set(want) - full), default=0.0
                )
                assert index.score(keys, chains.WEIGHTS) == want
                assert fast.score(keys, fast.encode_lookup(keys)) == want
                # the engine keys map to their request keys
                assert index.get_request_key(chains.engine_key(keys[3])) == keys[3]
                assert ref.get_request_key(chains.engine_key(keys[3])) == keys[3]
    finally:
        conn.close()
        ref_client.close()


def test_fast_client_cuts_and_scores_like_the_scorer(server: RedisServer) -> None:
    ref_client = redis.Redis(port=server.port, db=REFERENCE_DB)
    ref = reference_layout.ReferenceLayout(ref_client)
    conn = reference_layout.RespConnection("127.0.0.1", server.port, REFERENCE_DB)
    weights = {"gpu": 1.0, "cpu": 0.3}
    fast = reference_layout.FastReferenceClient(conn, weights)
    rng = random.Random(5)
    keys = [rng.getrandbits(64) for _ in range(40)]
    a, b, c = PodEntry("a", "gpu"), PodEntry("b", "cpu"), PodEntry("a", "cpu")
    ref.add(None, keys[:30], [a])
    ref.add(None, keys[:10] + keys[12:25], [b])  # b drops out at key 10
    ref.add(None, keys[5:20], [c])  # a second tier of pod a in the middle
    try:
        for chain in (keys, keys[3:], keys[31:], keys[:1], []):
            want = LongestPrefixScorer(weights).score(chain, ref.lookup(chain))
            assert fast.score(chain) == want
            got = fast.lookup(chain)
            assert {k: set(v) for k, v in got.items()} == {
                k: set(v) for k, v in ref.lookup(chain).items()
            }
        ref_client.set("123", "not a hash")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            fast.score([123])
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            fast.lookup([123])
        assert fast.score(keys[:2]) == {"a": 2.0, "b": 0.6}  # the connection is still usable
    finally:
        conn.close()
        ref_client.close()

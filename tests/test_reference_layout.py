"""The Go-style reference layout the Redis benchmarks compare against, on a real redis-server.

Checks the stored shape (bare decimal hashes, JSON field names, ``engine:`` ZSETs), the round trips
each operation makes, and that its answers agree with ``InMemoryIndex`` on the same workload.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.errors import EngineKeyNotFoundError, InvalidInputError
from kvredis.memory import InMemoryIndex
from kvredis.types import KeyType, PodEntry
from scripts.reference_layout import (
    ReferenceLayout,
    decode_field,
    encode_field,
    engine_to_request_mapping,
)
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

REFERENCE_DB = 1


@pytest.fixture
def client(own_redis_server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis.Redis(host="127.0.0.1", port=own_redis_server.port, db=REFERENCE_DB)
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def ref(client: redis.Redis) -> ReferenceLayout:
    return ReferenceLayout(client)


def as_sets(result: dict[int, list[PodEntry]]) -> dict[int, frozenset[PodEntry]]:
    return {k: frozenset(v) for k, v in result.items()}


def test_field_is_go_json_of_the_pod_entry() -> None:
    assert encode_field(PodEntry("pod-a", "gpu")) == (
        '{"PodIdentifier":"pod-a","DeviceTier":"gpu","Speculative":false,'
        '"HasGroup":false,"GroupIdx":0}'
    )
    grouped = encode_field(PodEntry("p", "cpu", speculative=True, has_group=True, group_idx=3))
    assert grouped.endswith('"Speculative":true,"HasGroup":true,"GroupIdx":3}')


def test_field_escapes_like_encoding_json() -> None:
    field = encode_field(PodEntry('a<b>&"c"\u2028é', "gpu"))
    assert '"PodIdentifier":"a\\u003cb\\u003e\\u0026\\"c\\"\\u2028é"' in field


def test_undecodable_fields_are_skipped() -> None:
    assert decode_field(b"pod-a@gpu") is None
    assert decode_field(b"[1,2]") is None
    assert decode_field(b'{"PodIdentifier":"p"}') == PodEntry("p", "")


@settings(max_examples=60, deadline=None)
@given(
    pod=st.text(min_size=1, max_size=40),
    tier=st.text(min_size=1, max_size=10),
    speculative=st.booleans(),
    group=st.one_of(st.none(), st.integers(0, 2**31 - 1)),
)
def test_field_round_trips(pod: str, tier: str, speculative: bool, group: int | None) -> None:
    entry = PodEntry(pod, tier, speculative, group is not None, group or 0)
    assert decode_field(encode_field(entry).encode()) == entry


def test_mapping_follows_the_length_ratio() -> None:
    assert engine_to_request_mapping([1, 2], [10, 20]) == {1: [10], 2: [20]}
    assert engine_to_request_mapping([1, 2, 3, 4], [10]) == {1: [10], 2: [10], 3: [10], 4: [10]}
    assert engine_to_request_mapping([1], [10, 20, 30]) == {1: [10, 20, 30]}
    assert engine_to_request_mapping([], [10]) == {}


def test_stored_layout(ref: ReferenceLayout, client: redis.Redis) -> None:
    big = 2**64 - 1
    a, b = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
    ref.add([7, big], [100, 200], [a, b])
    ref.add([9], [300, 400], [a])
    keys = {k.decode() for k in client.scan_iter(count=1000)}
    assert keys == {"100", "200", "300", "400", "engine:7", f"engine:{big}", "engine:9"}
    assert client.type("100") == b"hash"
    assert client.hgetall("100") == {encode_field(a).encode(): b"", encode_field(b).encode(): b""}
    assert client.type("engine:9") == b"zset"
    assert client.zrange("engine:9", 0, -1, withscores=True) == [(b"300", 0.0), (b"400", 1.0)]
    assert client.zrange(f"engine:{big}", 0, -1) == [b"200"]
    assert ref.get_request_key(9) == 400
    assert ref.get_request_key(big) == 200
    with pytest.raises(EngineKeyNotFoundError):
        ref.get_request_key(8)


def test_round_trips_per_operation(ref: ReferenceLayout, client: redis.Redis) -> None:
    a, b = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu")
    ref.add(list(range(1, 65)), list(range(1001, 1065)), [a, b])
    assert ref.round_trips == 1
    ref.round_trips = 0
    assert len(ref.lookup(list(range(1001, 1065)))) == 64
    assert ref.round_trips == 1
    ref.round_trips = 0
    ref.evict(1, KeyType.ENGINE, [a])
    assert ref.round_trips == 4
    assert client.exists("engine:1") == 1
    ref.round_trips = 0
    ref.evict(1, KeyType.ENGINE, [b])
    assert ref.round_trips == 4
    assert client.exists("engine:1", "1001") == 0
    ref.round_trips = 0
    ref.evict(1, KeyType.ENGINE, [b])
    assert ref.round_trips == 1
    ref.round_trips = 0
    ref.evict(1002, KeyType.REQUEST, [a, b])
    assert ref.round_trips == 2
    assert client.exists("1002") == 0


def test_lookup_cuts_the_chain_client_side(ref: ReferenceLayout) -> None:
    a, b = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu")
    ref.add(None, [1, 2, 3, 5], [a])
    ref.add(None, [1, 2], [b])
    assert as_sets(ref.lookup([1, 2, 3, 4, 5])) == {
        1: frozenset({a, b}),
        2: frozenset({a, b}),
        3: frozenset({a}),
    }
    assert as_sets(ref.lookup([1, 2, 3], {"pod-b"})) == {1: frozenset({b}), 2: frozenset({b})}
    assert ref.lookup([4, 1]) == {}
    assert ref.lookup([]) == {}


def test_bad_input_is_rejected_like_every_backend(ref: ReferenceLayout) -> None:
    with pytest.raises(InvalidInputError):
        ref.add(None, [], [PodEntry("p", "gpu")])
    with pytest.raises(InvalidInputError):
        ref.add(None, [1], [PodEntry("", "gpu")])
    with pytest.raises(InvalidInputError):
        ref.evict(1, KeyType.ENGINE, [])
    with pytest.raises(InvalidInputError):
        ref.lookup([2**64])


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_in_memory_index(ref: ReferenceLayout, seed: int) -> None:
    """A random add/evict/clear workload gives the same lookups on both sides."""
    rng = random.Random(seed)
    mem = InMemoryIndex()
    pods = ["pod-a", "pod-b", 'pod "c"@x']
    tiers = ["gpu", "cpu"]
    # Engine key e always maps to the same request keys, as content-derived engine hashes do.
    chains = {e: [10_000 + 3 * e + j for j in range(rng.randint(1, 3))] for e in range(1, 40)}
    speculative_keys = list(range(50_000, 50_020))

    def random_entries() -> list[PodEntry]:
        out = []
        for _ in range(rng.randint(1, 2)):
            group = rng.random() < 0.3
            out.append(
                PodEntry(
                    rng.choice(pods),
                    rng.choice(tiers),
                    has_group=group,
                    group_idx=rng.randint(0, 2) if group else 0,
                )
            )
        return out

    all_keys = sorted({k for ks in chains.values() for k in ks} | set(speculative_keys))
    for step in range(300):
        roll = rng.random()
        if roll < 0.45:
            engine = sorted(rng.sample(sorted(chains), rng.randint(1, 3)))
            entries = random_entries()
            for e in engine:
                mem.add([e], chains[e], entries)
                ref.add([e], chains[e], entries)
        elif roll < 0.55:
            keys = rng.sample(speculative_keys, rng.randint(1, 4))
            entry = PodEntry(rng.choice(pods), "gpu", speculative=True)
            mem.add(None, keys, [entry])
            ref.add(None, keys, [entry])
        elif roll < 0.8:
            e = rng.choice(sorted(chains))
            entries = random_entries()
            mem.evict(e, KeyType.ENGINE, entries)
            ref.evict(e, KeyType.ENGINE, entries)
        elif roll < 0.92:
            k = rng.choice(all_keys)
            entries = random_entries()
            mem.evict(k, KeyType.REQUEST, entries)
            ref.evict(k, KeyType.REQUEST, entries)
        elif roll < 0.96:
            pod = rng.choice(pods)
            mem.clear(pod)
            ref.clear(pod)
        if step % 10 == 0:
            for keys in ([k] for k in all_keys):
                assert as_sets(ref.lookup(keys)) == as_sets(mem.lookup(keys)), (step, keys)
            chain = [k for e in sorted(chains)[:10] for k in chains[e]]
            assert as_sets(ref.lookup(chain)) == as_sets(mem.lookup(chain))
            wanted = {rng.choice(pods)}
            assert as_sets(ref.lookup(chain, wanted)) == as_sets(mem.lookup(chain, wanted))
    final = [as_sets(ref.lookup([k])) for k in all_keys]
    assert final == [as_sets(mem.lookup([k])) for k in all_keys]
    assert any(final), "the workload should leave some entries behind"


def test_clear_removes_the_pod_everywhere(ref: ReferenceLayout, client: redis.Redis) -> None:
    a_gpu, a_cpu = PodEntry("pod-a", "gpu"), PodEntry("pod-a", "cpu")
    a_group = PodEntry("pod-a", "gpu", has_group=True, group_idx=1)
    b = PodEntry("pod-b", "gpu")
    ref.add([1, 2, 3], [11, 12, 13], [a_gpu, a_cpu, a_group])
    ref.add([4], [12], [b])
    ref.clear("pod-a")
    assert as_sets(ref.lookup([12])) == {12: frozenset({b})}
    assert client.exists("11", "13") == 0
    assert ref.lookup([11]) == {}

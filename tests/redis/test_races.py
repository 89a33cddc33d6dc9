"""Wrong answers the layout could give: a clear racing adds of the same pod, and an engine
mapping whose request key only an expiring entry still holds.

Every case runs on redis-server 7 and Valkey 9, on a single server and on a local cluster,
compares the answers with InMemoryIndex (the reference semantics) and runs ``kvredis check``
(:func:`kvredis.redis.inspect.op_check`, on every shard of a cluster) afterwards.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvredis import (
    EngineKeyNotFoundError,
    InMemoryIndex,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.ops import evict_call, op_clear
from kvredis.redis.program import program_of
from kvredis.redis.requests import ScriptCall
from kvredis.redis.session import op_send
from tests.conftest import TEST_PREFIX
from tests.redis.checks import check_findings
from tests.servers import local_server_kinds, server_kinds

pytestmark = pytest.mark.redis

P = PodEntry("pod-p", "gpu")
Q = PodEntry("pod-q", "gpu")
A = PodEntry("a", "gpu")
B_SPEC = PodEntry("b", "gpu", speculative=True)
#: Long enough never to pass during a test.
TTL = 600.0
#: How long the concurrency tests hammer one namespace (bounded: the loops stop then).
RACE_SECONDS = 2.5


class Topology:
    """Clients of one fresh namespace on a single server or on a cluster, and its check."""

    def __init__(self, kind: str, server: str, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        namespace = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
        if kind == "cluster":
            url = request.getfixturevalue("cluster_pool").get(server).url
        else:
            url = request.getfixturevalue("server_pool").url(server)
        self.config = RedisIndexConfig(address=url, namespace=namespace)
        self.clients: list[Any] = []

    def client(self) -> Any:
        """A new client of the namespace (its own connections)."""
        cls = RedisClusterIndex if self.kind == "cluster" else RedisIndex
        made = cls(self.config)
        self.clients.append(made)
        return made

    def findings(self) -> list[str]:
        """What ``kvredis check`` reports (on every shard of a cluster namespace), as
        ``"<problem> <detail>"`` lines; its notes (legitimate states) are not findings."""
        return [f"{f.problem.value} {f.detail}" for f in check_findings(self.config)]

    def close(self) -> None:
        if self.clients:
            self.clients[0].drop_namespace()
        for made in self.clients:
            made.close()


@pytest.fixture(
    params=[
        *(pytest.param(("server", kind), id=f"server@{kind}") for kind in server_kinds()),
        *(
            pytest.param(("cluster", kind), id=f"cluster@{kind}", marks=pytest.mark.cluster)
            for kind in local_server_kinds()
        ),
    ]
)
def topology(request: pytest.FixtureRequest) -> Iterator[Topology]:
    """A fresh namespace on each server kind, on a single server and on a local cluster."""
    kind, server = request.param
    built = Topology(kind, server, request)
    try:
        yield built
    finally:
        built.close()


def _request_key(index: Any, engine_key: int) -> int | None:
    try:
        return int(index.get_request_key(engine_key))
    except EngineKeyNotFoundError:
        return None


def _no_empty_entry_lists(found: dict[int, list[PodEntry]]) -> None:
    assert all(found.values()), f"a hit without entries: {found}"


# -- 1. a clear racing adds of the same pod ------------------------------------------------------


def test_an_add_of_the_pod_after_every_page_of_its_clear_survives_it_and_reads_exactly(
    topology: Topology,
) -> None:
    """The issue's repro, made deterministic: while P is cleared, another client adds P at key
    1 after every page the clear sends (the clear's progress callback). Adds that happen once
    the clear is under way are the model's adds after the clear: key 1 holds P, readable."""
    index, other = topology.client(), topology.client()
    model = InMemoryIndex()
    for idx in (index, model):
        idx.add([101], [1], [P])
        idx.add([102], [2], [Q])
    pages = 0

    def add_p(_done: int, _removed: int) -> None:
        nonlocal pages
        pages += 1
        other.add([101], [1], [P])

    index.clear("pod-p", add_p)
    model.clear("pod-p")
    model.add([101], [1], [P])
    assert pages > 0
    got = index.lookup([1, 2])
    _no_empty_entry_lists(got)
    assert got == model.lookup([1, 2]) == {1: [P], 2: [Q]}
    assert _request_key(index, 101) == 1
    assert topology.findings() == []
    # a second clear removes every entry of P and its mapping
    index.clear("pod-p")
    model.clear("pod-p")
    assert index.lookup([1, 2]) == model.lookup([1, 2]) == {}
    assert index.lookup([2]) == {2: [Q]}
    assert _request_key(index, 101) is None is _request_key(model, 101)
    assert topology.findings() == []


@pytest.mark.parametrize("server", server_kinds())
def test_an_entry_held_under_its_retired_and_its_new_id_reads_once(
    server: str, request: pytest.FixtureRequest
) -> None:
    """Between a clear's first step (its ids retired) and its pass over a key, an add of the
    same entry there holds it under two ids for a moment: a read returns it once."""
    topology = Topology("server", server, request)
    try:
        index, other = topology.client(), topology.client()
        index.add(None, [1, 2], [P, Q])
        op = op_clear(index._session.state, "pod-p")
        retire = next(op)
        assert isinstance(retire, ScriptCall) and retire.script == "retire"
        reply = index._exec.run(op_send(index._session, retire))
        other.add(None, [1], [P])  # a new id: the old one is retired
        assert index.lookup([1, 2]) == {1: [Q, P], 2: [P, Q]}
        try:
            request = op.send(reply)
            while True:
                request = op.send(index._exec.run(op_send(index._session, request)))
        except StopIteration:
            pass
        assert index.lookup([1, 2]) == {1: [Q, P], 2: [Q]}
        assert topology.findings() == []
    finally:
        topology.close()


def test_an_interrupted_clear_is_finished_by_clearing_again(topology: Topology) -> None:
    """A clear that stops after its first page (its client died): the pod's entries are out of
    reach for new adds, which intern new ids; the next clear removes the old entries and the
    new ones, and leaves nothing undefined behind."""
    index, other = topology.client(), topology.client()
    chain = list(range(1, 41))
    index.add([100 + k for k in chain], chain, [P, Q])

    class Interrupted(Exception):
        pass

    def die(_done: int, _removed: int) -> None:
        raise Interrupted

    with pytest.raises(Interrupted):
        index.clear("pod-p", die)
    other.add(None, [1, 500], [P])  # racing the dead clear: P under a new id
    for found in (index.lookup(chain), index.lookup([1, 500])):
        _no_empty_entry_lists(found)
    assert topology.findings() == []
    index.clear("pod-p")
    assert index.lookup(chain) == {k: [Q] for k in chain}
    assert index.lookup([500]) == {}
    assert topology.findings() == []


def test_clears_racing_adds_of_the_same_pod_in_threads_leave_exact_answers(
    topology: Topology,
) -> None:
    """Real threads, each with its own client, for a bounded time: one clears P over and over
    while others add P (at key 1 and on a chain that forms runs) and read. No read ever shows a
    hit without entries; afterwards the namespace is what the model says."""
    clearer, adder, chain_adder, reader = (topology.client() for _ in range(4))
    chain = list(range(1000, 1040))
    clearer.add([101], [1], [P])
    clearer.add([102], [2], [Q])
    clearer.add(None, chain, [Q])
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"clears": 0, "adds": 0, "reads": 0}

    def loop(name: str, body: Any) -> None:
        try:
            while not stop.is_set():
                body()
                counts[name] += 1
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            stop.set()

    def read() -> None:
        for found in (reader.lookup([1, 2]), reader.lookup(chain)):
            _no_empty_entry_lists(found)
        assert set(reader.lookup([2])) == {2}

    rng = random.Random(7)

    def add_chain() -> None:
        start = rng.randrange(len(chain) - 10)
        chain_adder.add(None, chain[start : start + 10], [P])

    threads = [
        threading.Thread(target=loop, args=("clears", lambda: clearer.clear("pod-p"))),
        threading.Thread(target=loop, args=("adds", lambda: adder.add([101], [1], [P]))),
        threading.Thread(target=loop, args=("adds", add_chain)),
        threading.Thread(target=loop, args=("reads", read)),
    ]
    for t in threads:
        t.start()
    time.sleep(RACE_SECONDS)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert counts["clears"] > 0 and counts["adds"] > 0 and counts["reads"] > 0
    # whatever the interleaving: key 1 holds P or nothing, never an unreadable entry
    got = clearer.lookup([1, 2])
    assert got in ({1: [P], 2: [Q]}, {}), got
    assert topology.findings() == []
    # an add after the last clear is present; a clear after it removes all of P
    adder.add([101], [1], [P])
    assert clearer.lookup([1, 2]) == {1: [P], 2: [Q]}
    clearer.clear("pod-p")
    assert clearer.lookup([1, 2]) == {}
    assert clearer.lookup(chain) == {k: [Q] for k in chain}
    assert _request_key(clearer, 101) is None
    assert _request_key(clearer, 102) == 2
    assert topology.findings() == []


# -- 2. an engine mapping held only by an expiring entry -----------------------------------------


def _held_by_a_speculative_entry(index: Any) -> None:
    index.add([111], [1], [A])
    index.add(None, [1], [B_SPEC], ttl=TTL)


@pytest.mark.parametrize("how", ["clear", "evict"])
def test_a_mapping_stays_while_an_expiring_entry_holds_its_request_key(
    topology: Topology, how: str
) -> None:
    index = topology.client()
    model = InMemoryIndex()
    for idx in (index, model):
        _held_by_a_speculative_entry(idx)
        if how == "clear":
            idx.clear("a")
        else:
            idx.evict(111, KeyType.ENGINE, [A])
    assert _request_key(model, 111) == 1
    assert _request_key(index, 111) == 1
    assert index.lookup([1]) == model.lookup([1]) == {1: [B_SPEC]}
    assert topology.findings() == []
    # the evict by engine key still reaches the speculative entry, then the mapping goes
    for idx in (index, model):
        idx.evict(111, KeyType.ENGINE, [B_SPEC])
    assert index.lookup([1]) == model.lookup([1]) == {}
    assert _request_key(index, 111) is None is _request_key(model, 111)
    assert topology.findings() == []


@pytest.mark.parametrize("server", server_kinds())
def test_an_evict_by_engine_key_split_by_request_key_keeps_a_mapping_held_by_expiring_entries(
    server: str, request: pytest.FixtureRequest
) -> None:
    """The form an evict by engine key over budget takes (its first request keys evicted by
    request key, then the rest with ``first``): the first keys count as holders through their
    live expiring entries too."""
    topology = Topology("server", server, request)
    try:
        index = topology.client()
        model = InMemoryIndex()
        for idx in (index, model):
            idx.add([111], [1, 2], [A])
            idx.add(None, [1], [B_SPEC], ttl=TTL)
        program = program_of(index._session.state.layout, [("R", 1, [A]), ("E", 111, [A], 1)])
        index._exec.run(op_send(index._session, evict_call(program)))
        model.evict(111, KeyType.ENGINE, [A])
        assert index.lookup([1]) == model.lookup([1]) == {1: [B_SPEC]}
        assert index.lookup([2]) == model.lookup([2]) == {}
        assert _request_key(index, 111) == _request_key(model, 111) == 2
        assert topology.findings() == []
    finally:
        topology.close()


# -- differential: random steps against the model, checked after every step ---------------------


class MappingModel:
    """The engine-key mappings the index keeps, modelled: one InMemoryIndex given every op on a
    single server; on a cluster placing pods, one per shard, each given the ops of its own pods
    only (each shard keeps the mappings its pods' adds recorded and applies the single-server
    rules inside itself: an evict by request key leaves a mapping, a clear drops those left
    without holders in the pod's shard only, docs/design/cluster.md). A mapping is found when
    any shard has it (``get_request_key``: the lowest-numbered shard's)."""

    def __init__(self, index: Any) -> None:
        core = getattr(index, "core", None)
        self.shard: Any = (lambda pod: 0) if core is None else core.pod_shard
        self.models: dict[int, InMemoryIndex] = {}

    def _model(self, pod: str) -> InMemoryIndex:
        return self.models.setdefault(self.shard(pod), InMemoryIndex())

    def add(self, engines: Any, keys: list[int], entries: list[PodEntry], ttl: Any) -> None:
        by_shard: dict[int, list[PodEntry]] = {}
        for entry in entries:
            by_shard.setdefault(self.shard(entry.pod_identifier), []).append(entry)
        for group in by_shard.values():
            self._model(group[0].pod_identifier).add(engines, keys, group, ttl=ttl)

    def evict(self, key: int, kind: KeyType, entries: list[PodEntry]) -> None:
        for entry in entries:
            self._model(entry.pod_identifier).evict(key, kind, [entry])

    def clear(self, pod: str) -> None:
        self._model(pod).clear(pod)

    def request_key(self, engine_key: int) -> int | None:
        for shard in sorted(self.models):
            found = _request_key(self.models[shard], engine_key)
            if found is not None:
                return found
        return None


def _random_steps(index: Any, topology: Topology, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    model = InMemoryIndex()
    mappings = MappingModel(index)
    pods = [P, Q, A, B_SPEC, PodEntry("pod-p", "cpu", speculative=True)]
    chains = [list(range(base, base + rng.choice([3, 12]))) for base in (1, 40, 80, 120)]
    engine = 10**9
    for step in range(steps):
        chain = rng.choice(chains)
        start = rng.randrange(len(chain))
        keys = chain[start : start + rng.randint(1, len(chain))]
        roll = rng.random()
        if roll < 0.4:
            entries = rng.sample(pods, rng.randint(1, 2))
            ttl = TTL if all(e.speculative for e in entries) and rng.random() < 0.7 else None
            engines = [engine + k for k in keys] if rng.random() < 0.7 else None
            for idx in (index, model, mappings):
                idx.add(engines, keys, entries, ttl=ttl)
        elif roll < 0.75:
            kind = rng.choice([KeyType.ENGINE, KeyType.REQUEST])
            key = keys[0] + (engine if kind is KeyType.ENGINE else 0)
            entries = [rng.choice(pods)]
            for idx in (index, model, mappings):
                idx.evict(key, kind, entries)
        else:
            pod = rng.choice(pods).pod_identifier
            for idx in (index, model, mappings):
                idx.clear(pod)
        for probe in chains:
            got = index.lookup(probe)
            _no_empty_entry_lists(got)
            expected = model.lookup(probe)
            assert {k: set(v) for k, v in got.items()} == {
                k: set(v) for k, v in expected.items()
            }, (step, probe)
            for key in probe:
                assert _request_key(index, engine + key) == mappings.request_key(engine + key), (
                    step,
                    key,
                )
        # the mappings are compared above (an evict by request key leaves them)
        assert topology.findings() == [], step


def test_random_adds_evicts_and_clears_with_expiring_entries_match_the_model(
    topology: Topology,
) -> None:
    _random_steps(topology.client(), topology, seed=21, steps=40)

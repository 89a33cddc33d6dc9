"""Reads from replicas on a single server (``read_from_replicas``).

Without a server: how ``INFO replication`` parses, the replica set's choice and timing (a stepped
clock), and the route of one operation's reads driven with scripted outcomes. With real servers
(a primary and two replicas of each kind): where reads and writes land (``INFO commandstats``),
that replica answers equal primary answers once replicated, and that reads keep answering while
replicas die, refuse (``MASTERDOWN``) or lack the scripts.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvredis import AsyncRedisIndex, KeyType, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.errors import BackendError
from kvredis.redis.replicas import (
    DISCOVER,
    MIN_REFRESH_SECONDS,
    ReadRoute,
    Replica,
    ReplicaSet,
    parse_replicas,
)
from kvredis.redis.requests import Command, ConnectionLost, ErrorReply, ScriptCall
from kvredis.redis.scripts import ScriptRegistry
from tests.servers import LocalReplication

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
R1, R2 = Replica("10.0.0.1", 6380), Replica("10.0.0.2", 6381)
INFO_TEXT = (
    "# Replication\r\nrole:master\r\nconnected_slaves:4\r\n"
    "slave0:ip=10.0.0.1,port=6380,state=online,offset=42,lag=0\r\n"
    "slave1:ip=10.0.0.9,port=6390,state=wait_bgsave,offset=0,lag=0\r\n"
    "slave2:ip=10.0.0.2,port=6381,state=online,offset=42,lag=1,type=replica\r\n"
    "slave3:ip=10.0.0.3,port=6382,state=online,offset=7,lag=60\r\n"
    "master_repl_offset:42\r\n"
)
READ = Command(("EVALSHA", "abc", 0), read=True)


# -- without a server -------------------------------------------------------------------------


def test_info_replication_lists_the_online_replicas_in_order() -> None:
    assert parse_replicas(INFO_TEXT) == [R1, R2]
    assert parse_replicas(INFO_TEXT.encode()) == [R1, R2]
    parsed = {  # as redis-py parses it
        "role": "master",
        "slave1": {"ip": "::1", "port": 7001, "state": "online", "offset": 1, "lag": 0},
        "slave0": {"ip": "10.0.0.1", "port": 6380, "state": "online"},
        "slave2": {"ip": "10.0.0.3", "port": 6382, "state": "send_bulk"},
    }
    assert parse_replicas(parsed) == [R1, Replica("::1", 7001)]
    assert str(Replica("::1", 7001)) == "[::1]:7001"
    assert parse_replicas("role:master\r\nconnected_slaves:0\r\n") == []
    assert parse_replicas({"slave0": "ip=h,port=x,state=online"}) == []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_set_takes_turns_sets_failed_replicas_aside_and_asks_again() -> None:
    clock = Clock()
    replicas = ReplicaSet(refresh_seconds=5.0, down_seconds=3.0, clock=clock)
    assert replicas.pick() is None  # nothing known yet: the primary
    assert replicas.claim_refresh() and not replicas.claim_refresh()
    replicas.update(INFO_TEXT)
    assert [replicas.pick() for _ in range(4)] == [R2, R1, R2, R1]
    replicas.failed(R1, ConnectionLost("refused"))
    assert [replicas.pick() for _ in range(3)] == [R2, R2, R2]
    assert not replicas.claim_refresh()  # asked again soon, not at once
    clock.now += MIN_REFRESH_SECONDS
    assert replicas.claim_refresh()
    replicas.update(INFO_TEXT)  # still listed, but still set aside
    assert replicas.pick() == R2
    clock.now += 3.0
    assert {replicas.pick() for _ in range(2)} == {R1, R2}
    clock.now += 5.0
    assert replicas.claim_refresh()
    replicas.update(ConnectionLost("primary down"))  # keeps what it knew
    assert replicas.replicas == (R1, R2)
    replicas.update(ErrorReply("NOPERM this user has no permissions to run 'info'"))
    assert replicas.replicas == () and replicas.pick() is None


def test_spread_reads_take_turns_with_the_primary() -> None:
    """``read_from_replicas="spread"``: the primary (None) takes its turn with the replicas, so
    a replica adds its share of the reads instead of taking them all."""
    clock = Clock()
    replicas = ReplicaSet(refresh_seconds=5.0, down_seconds=3.0, clock=clock, spread=True)
    assert replicas.pick() is None
    replicas.update(INFO_TEXT)
    picks = [replicas.pick() for _ in range(6)]
    assert sorted(map(str, picks)) == sorted(map(str, [None, R1, R2] * 2)), picks
    replicas.failed(R1, ConnectionLost("refused"))
    assert {replicas.pick() for _ in range(4)} == {None, R2}


def _drive(route: ReadRoute, command: Command, outcomes: list[Any]) -> tuple[list[Any], Any]:
    """Run ``route.route(command)`` answering with ``outcomes``; (what it sent, its result)."""
    steps = route.route(command)
    sent = [steps.send(None)]
    try:
        for outcome in outcomes:
            sent.append(steps.send(outcome))
    except StopIteration as stop:
        return sent, stop.value
    raise AssertionError(f"the route wants more than {outcomes}")


def _known(*replicas: Replica) -> ReplicaSet:
    replica_set = ReplicaSet(clock=Clock())
    assert replica_set.claim_refresh()
    lines = (f"slave{i}:ip={r.host},port={r.port},state=online" for i, r in enumerate(replicas))
    replica_set.update("\n".join(lines))
    return replica_set


def test_the_first_read_of_an_operation_discovers_then_every_read_sticks_to_its_replica() -> None:
    replica_set = ReplicaSet(clock=Clock())
    route = ReadRoute(replica_set)
    write = Command(("HSET", "k", "f", "v"))
    assert _drive(route, write, ["w"]) == ([(None, write)], "w")
    sent, result = _drive(route, READ, [INFO_TEXT, ErrorReply("NOSCRIPT No matching script")])
    assert sent == [(None, DISCOVER), (R2, READ)]
    assert isinstance(result, ErrorReply)  # the core reloads the script...
    load = Command(("SCRIPT", "LOAD", b"src"), read=True)
    assert _drive(route, load, ["abc"]) == ([(R2, load)], "abc")  # ...on the same replica
    assert _drive(route, READ, ["r"]) == ([(R2, READ)], "r")
    other = ReadRoute(replica_set)  # the next operation takes the next replica, no discovery
    assert _drive(other, READ, ["r"]) == ([(R1, READ)], "r")
    assert _drive(ReadRoute(ReplicaSet(clock=Clock())), READ, ["", "p"])[0][1] == (None, READ)


@pytest.mark.parametrize(
    "failure",
    [
        ConnectionLost("Connection refused"),
        ErrorReply("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is 'no'"),
        ErrorReply("LOADING Redis is loading the dataset in memory"),
        ErrorReply("BUSY Redis is busy running a script"),
    ],
)
def test_a_replica_that_cannot_serve_is_set_aside_and_the_primary_answers(failure: Any) -> None:
    replica_set = _known(R1)
    route = ReadRoute(replica_set)
    assert _drive(route, READ, [failure, "p"]) == ([(R1, READ), (None, READ)], "p")
    assert _drive(route, READ, ["p"]) == ([(None, READ)], "p")  # the rest of the operation too
    assert replica_set.pick() is None  # and the next operations, for a while


def test_a_replica_behind_the_namespace_defers_to_the_primary_without_being_set_aside() -> None:
    replica_set = _known(R1)
    stale = ErrorReply("KVREDIS_STALE namespace layout changed or was removed; reload it")
    assert _drive(ReadRoute(replica_set), READ, [stale, stale]) == (
        [(R1, READ), (None, READ)],
        stale,  # the primary says so too: the core reloads the namespace
    )
    assert replica_set.pick() == R1
    invalid = ErrorReply("KVREDIS_INVALID bad input")  # any server says the same: no retry
    assert _drive(ReadRoute(replica_set), READ, [invalid]) == ([(R1, READ)], invalid)


@pytest.mark.parametrize(
    "missing",
    [
        ErrorReply("ERR Function not found"),
        ErrorReply("KVREDIS_VERSION library api 3, the client calls api 4"),
    ],
)
def test_a_replica_without_the_library_yet_defers_to_the_primary_without_being_set_aside(
    missing: ErrorReply,
) -> None:
    """A replica gets a function library only by replication: a read sent just after the
    primary loaded it finds it missing (or an older release) there, and the primary answers."""
    replica_set = _known(R1)
    route = ReadRoute(replica_set)
    assert _drive(route, READ, [missing, "p"]) == ([(R1, READ), (None, READ)], "p")
    assert _drive(route, READ, ["p"]) == ([(None, READ)], "p")  # the rest of the operation
    assert replica_set.pick() == R1  # the next operation asks the replica again
    noscript = ErrorReply("NOSCRIPT No matching script")  # a script it loads itself
    assert _drive(ReadRoute(replica_set), READ, [noscript]) == ([(R1, READ)], noscript)


def test_only_no_writes_scripts_can_be_sent_as_reads() -> None:
    registry = ScriptRegistry()
    assert {n for n in registry.names() if registry[n].no_writes} == {
        "lookup",
        "lookup_shards",
        "lookup_union",
        "ping",
        "request_key",
        "score",
        "score_shards",
    }
    assert registry.call_command(ScriptCall("lookup", (), (), read=True)).read
    source = registry["lookup"].source
    load = registry.load_command("lookup", read=True)
    assert load == Command(("SCRIPT", "LOAD", source), read=True)
    with pytest.raises(BackendError, match="may write"):
        registry.call_command(ScriptCall("add", (), (), read=True))


# -- a primary with two replicas --------------------------------------------------------------


def _config(
    url: str, namespace: str, read_from_replicas: bool = True, scripts: bool = False
) -> RedisIndexConfig:
    """``scripts``: calls by EVALSHA (for tests of what SCRIPT FLUSH on a replica does)."""
    return RedisIndexConfig(
        address=url,
        namespace=namespace,
        read_from_replicas=read_from_replicas,
        socket_timeout=1.0,
        connect_timeout=1.0,
        use_functions="auto" if not scripts else False,
    )


@pytest.fixture
def namespace_name() -> str:
    return f"kvt-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def primary_index(replicated_server: LocalReplication, namespace_name: str) -> Iterator[RedisIndex]:
    """A client of the primary only, holding 32 chains of 4 keys (replicated)."""
    index = RedisIndex(_config(replicated_server.url, namespace_name, read_from_replicas=False))
    for chain in range(32):
        keys = [chain * 100 + i for i in range(4)]
        index.add(None, keys, [A] if chain % 2 else [A, B])
    index.evict(3, KeyType.REQUEST, [A])
    replicated_server.wait_replicated()
    try:
        yield index
    finally:
        index.drop_namespace()
        index.close()


CHAINS = [[chain * 100 + i for i in range(6)] for chain in range(32)]


def _evalsha(servers: LocalReplication) -> list[int]:
    """Script calls (EVALSHA, FCALL, FCALL_RO) so far on the primary and on each replica (0 for
    a dead one)."""
    live = servers.live_replicas()
    return [
        sum(servers.calls(s.port, name) for name in ("evalsha", "fcall", "fcall_ro"))
        if s is servers.primary or s in live
        else 0
        for s in (servers.primary, *servers.replicas)
    ]


def _delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


def test_reads_go_to_the_replicas_in_turn_and_writes_to_the_primary(
    replicated_server: LocalReplication, primary_index: RedisIndex, namespace_name: str
) -> None:
    expected = [(primary_index.lookup(c), primary_index.score(c)) for c in CHAINS]
    with RedisIndex(_config(replicated_server.url, namespace_name)) as index:
        for chain in CHAINS[:4]:  # every replica loads the scripts
            index.lookup(chain)
            index.score(chain)
        before = _evalsha(replicated_server)
        got = [(index.lookup(c), index.score(c)) for c in CHAINS]
        primary, *replicas = _delta(_evalsha(replicated_server), before)
        assert got == expected
        assert primary == 0 and sum(replicas) == 2 * len(CHAINS)
        assert min(replicas) >= len(CHAINS) // 2  # round-robin
        before = _evalsha(replicated_server)
        for i in range(10):
            index.add([9000 + i], [5000 + i], [A])
        index.evict(5000, KeyType.REQUEST, [A])
        assert index.get_request_key(9001) == 5001  # on the primary: no lag
        primary, *replicas = _delta(_evalsha(replicated_server), before)
        assert primary >= 12 and replicas == [0, 0]  # (+1 NOSCRIPT of request_key)


def test_async_reads_go_to_the_replicas(
    replicated_server: LocalReplication, primary_index: RedisIndex, namespace_name: str
) -> None:
    expected = [(primary_index.lookup(c, {"pod-b"}), primary_index.score(c)) for c in CHAINS]

    async def reads() -> list[Any]:
        async with AsyncRedisIndex(_config(replicated_server.url, namespace_name)) as index:
            await index.lookup(CHAINS[0])
            await index.lookup(CHAINS[1])
            before = _evalsha(replicated_server)
            got = [(await index.lookup(c, {"pod-b"}), await index.score(c)) for c in CHAINS]
            await index.add(None, [7000], [B])
            primary, *replicas = _delta(_evalsha(replicated_server), before)
            assert primary == 1 and sum(replicas) == 2 * len(CHAINS)
            assert min(replicas) > 0
            return got

    assert asyncio.run(reads()) == expected


def _reading_while(index: RedisIndex, expected: list[Any], event: Callable[[], None]) -> None:
    """Two threads look up every chain over and over while ``event()`` happens; every answer
    must be the expected one."""
    failures: list[BaseException] = []
    answered = [0]
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                for chain, want in zip(CHAINS, expected, strict=True):
                    assert index.lookup(chain) == want
                    answered[0] += 1
        except BaseException as exc:
            failures.append(exc)

    def wait_for(count: int) -> None:
        while answered[0] < count and not failures:
            stop.wait(0.01)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_for(100)
        event()
        wait_for(answered[0] + 200)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not failures, failures


def test_reads_keep_answering_while_replicas_die(
    replicated_server: LocalReplication, primary_index: RedisIndex, namespace_name: str
) -> None:
    expected = [primary_index.lookup(c) for c in CHAINS]
    try:
        with RedisIndex(_config(replicated_server.url, namespace_name)) as index:
            _reading_while(index, expected, lambda: replicated_server.kill_replica(0))
            before = _evalsha(replicated_server)
            assert [index.lookup(c) for c in CHAINS] == expected
            primary, _, survivor = _delta(_evalsha(replicated_server), before)
            assert (primary, survivor) == (0, len(CHAINS))
            _reading_while(index, expected, lambda: replicated_server.kill_replica(1))
            before = _evalsha(replicated_server)
            assert [index.lookup(c) for c in CHAINS] == expected
            assert _delta(_evalsha(replicated_server), before)[0] == len(CHAINS)
    finally:
        replicated_server.revive_replica(0)
        replicated_server.revive_replica(1)


def test_async_reads_keep_answering_when_a_replica_dies(
    replicated_server: LocalReplication, primary_index: RedisIndex, namespace_name: str
) -> None:
    expected = [primary_index.score(c) for c in CHAINS]

    async def reads() -> None:
        async with AsyncRedisIndex(_config(replicated_server.url, namespace_name)) as index:
            assert [await index.score(c) for c in CHAINS] == expected
            replicated_server.kill_replica(1)
            assert [await index.score(c) for c in CHAINS] == expected
            assert index._exec.replicas is not None
            survivor = replicated_server.replicas[0].port
            assert index._exec.replicas.pick() == Replica("127.0.0.1", survivor)

    try:
        asyncio.run(reads())
    finally:
        replicated_server.revive_replica(1)


def test_a_replica_that_refuses_reads_or_lost_its_scripts_is_worked_around(
    replicated_server: LocalReplication, primary_index: RedisIndex, namespace_name: str
) -> None:
    expected = [primary_index.lookup(c) for c in CHAINS]
    refusing = replicated_server.replicas[0]
    with RedisIndex(_config(replicated_server.url, namespace_name, scripts=True)) as index:
        assert index._exec.replicas is not None
        index._exec.replicas.refresh_seconds = 60.0  # the refusing replica stays listed
        assert [index.lookup(c) for c in CHAINS] == expected  # replicas listed, scripts loaded
        for replica in replicated_server.replicas:
            with replicated_server._admin(replica.port) as admin:
                admin.script_flush()
        loads = [replicated_server.calls(r.port, "script|load") for r in replicated_server.replicas]
        before = _evalsha(replicated_server)
        assert [index.lookup(c) for c in CHAINS] == expected
        assert _delta(_evalsha(replicated_server), before)[0] == 0  # reloaded on the replicas
        assert all(
            replicated_server.calls(r.port, "script|load") == n + 1
            for r, n in zip(replicated_server.replicas, loads, strict=True)
        )
        with replicated_server._admin(refusing.port) as admin:
            admin.config_set("replica-serve-stale-data", "no")
            admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # link down: MASTERDOWN
        try:
            before = _evalsha(replicated_server)
            assert [index.lookup(c) for c in CHAINS] == expected
            primary, _, other = _delta(_evalsha(replicated_server), before)
            assert primary >= 1 and other >= len(CHAINS) // 2  # the refusal went to the primary
        finally:
            with replicated_server._admin(refusing.port) as admin:
                admin.config_set("replica-serve-stale-data", "yes")
                admin.execute_command("REPLICAOF", "127.0.0.1", replicated_server.primary.port)
            replicated_server.wait_synced()


def test_without_replicas_the_primary_answers_every_read(redis_server_url: str) -> None:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    with RedisIndex(_config(redis_server_url, namespace)) as index:
        try:
            index.add([1], [10, 11], [A])
            assert index.lookup([10, 11, 12]) == {10: [A], 11: [A]}
            assert index.score([10, 11]) == {"pod-a": 2.0}
            assert index._exec.replicas is not None and index._exec.replicas.replicas == ()
        finally:
            index.drop_namespace()

    async def reads() -> None:
        async with AsyncRedisIndex(_config(redis_server_url, namespace)) as index:
            await index.add(None, [20], [B])
            assert await index.lookup([20]) == {20: [B]}
            await index.drop_namespace()

    asyncio.run(reads())


def test_the_json_config_turns_it_on() -> None:
    cfg = RedisIndexConfig.from_dict({"address": "redis://h:6379", "readFromReplicas": True})
    assert cfg.read_from_replicas and not cfg.cluster

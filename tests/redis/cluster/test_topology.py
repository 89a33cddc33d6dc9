"""The slot map: parsed from scripted and real CLUSTER SHARDS / CLUSTER SLOTS replies, checked
against where a real cluster puts keys."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from kvredis.errors import BackendError, BackendUnavailableError
from kvredis.redis.cluster.slots import key_slot
from kvredis.redis.cluster.topology import (
    ClusterNode,
    SlotMap,
    SlotRange,
    op_slot_map,
    parse_cluster_shards,
    parse_cluster_slots,
)
from kvredis.redis.requests import Command, ErrorReply, Op
from tests.servers import LocalCluster

A, B, C = ClusterNode("10.0.0.1", 7000), ClusterNode("10.0.0.2", 7001), ClusterNode("h3", 7002)
RA, RB = ClusterNode("10.0.0.4", 7003), ClusterNode("10.0.0.5", 7004)


def _node(id_: bytes, port: int, role: bytes, health: bytes = b"online", **extra: Any) -> list:
    fields: list[Any] = [b"id", id_, b"port", port, b"ip", b"10.9.9.9"]
    for name, value in extra.items():
        fields += [name.replace("_", "-").encode(), value]
    return [*fields, b"role", role, b"replication-offset", 7, b"health", health]


SHARDS_RAW = [
    [
        b"slots", [0, 5460, 16000, 16383],
        b"nodes", [
            _node(b"a" * 40, 7000, b"master", endpoint=b"10.0.0.1"),
            _node(b"d" * 40, 7003, b"replica", endpoint=b"10.0.0.4"),
        ],
    ],
    [
        b"slots", [5461, 15999],
        b"nodes", [
            _node(b"e" * 40, 7004, b"replica", endpoint=b"10.0.0.5"),
            _node(b"x" * 40, 7009, b"replica", b"loading", endpoint=b"10.0.0.6"),
            _node(b"y" * 40, 7010, b"replica", b"fail", endpoint=b"10.0.0.7"),
            _node(b"b" * 40, 7001, b"master", endpoint=b"10.0.0.2", tls_port=7101),
        ],
    ],
]  # fmt: skip


def test_shards_in_raw_resp2_form() -> None:
    slot_map = parse_cluster_shards(SHARDS_RAW, "10.0.0.1")
    assert slot_map.ranges == (
        SlotRange(0, 5460, A, (RA,)),
        SlotRange(5461, 15999, B, (RB,)),  # the loading and failed replicas are left out
        SlotRange(16000, 16383, A, (RA,)),
    )
    assert slot_map.complete and slot_map.missing() == []
    assert slot_map.primaries == (A, B)
    assert slot_map.nodes == (A, B, RA, RB)
    assert slot_map.primary(0).node_id == "a" * 40
    # TLS: the tls-port where a node reports one
    assert parse_cluster_shards(SHARDS_RAW, "x", tls=True).primary(6000) == ClusterNode(
        "10.0.0.2", 7101
    )


def test_shards_as_a_client_library_parses_them() -> None:
    parsed = [
        {
            "slots": [0, 16383],
            "nodes": [{"id": "a", "port": 7000, "ip": "10.0.0.1", "role": "master"}],
        }
    ]
    assert parse_cluster_shards(parsed, "h") == SlotMap([SlotRange(0, 16383, A)])


def test_unknown_endpoints_fall_back_to_the_ip_then_to_the_host_asked() -> None:
    shard = [b"slots", [0, 16383], b"nodes", [_node(b"a", 1, b"master", endpoint=b"?")]]
    assert parse_cluster_shards([shard], "asked").primary(0).host == "10.9.9.9"
    node = [b"id", b"a", b"port", 1, b"ip", b"", b"endpoint", b"", b"role", b"master"]
    shard = [b"slots", [0, 16383], b"nodes", [node]]
    assert parse_cluster_shards([shard], "asked").primary(0) == ClusterNode("asked", 1)


def test_a_shard_without_primary_leaves_its_slots_missing() -> None:
    shards = [
        [b"slots", [0, 99], b"nodes", [_node(b"a", 1, b"master")]],
        [b"slots", [100, 199], b"nodes", [_node(b"b", 2, b"replica")]],
    ]
    slot_map = parse_cluster_shards(shards, "h")
    assert not slot_map.complete
    assert slot_map.missing() == [(100, 16383)]
    with pytest.raises(BackendUnavailableError, match="slot 150"):
        slot_map.primary(150)


def test_slots_reply() -> None:
    reply = [
        [0, 5460, [b"10.0.0.1", 7000, b"a" * 40, {}], [b"10.0.0.4", 7003, b"d" * 40, {}]],
        [5461, 10922, [b"10.0.0.2", 7001, b"b" * 40]],
        [10923, 16383, [b"", 7002, b"c" * 40, []], [b"?", 7005, b"f" * 40]],
    ]
    slot_map = parse_cluster_slots(reply, "h3")
    assert slot_map.ranges == (
        SlotRange(0, 5460, A, (RA,)),
        SlotRange(5461, 10922, B),
        SlotRange(10923, 16383, C, (ClusterNode("h3", 7005),)),
    )


@pytest.mark.parametrize(
    "reply",
    [
        None,
        b"nope",
        [[b"slots", [0, b"x"], b"nodes", [_node(b"a", 1, b"master")]]],
        [[b"slots"]],
        [[b"slots", [0, 1], b"nodes", [[b"port", b"p", b"role", b"master"]]]],
        [[b"slots", [0, 20000], b"nodes", [_node(b"a", 1, b"master")]]],
        [
            [b"slots", [0, 10], b"nodes", [_node(b"a", 1, b"master")]],
            [b"slots", [10, 20], b"nodes", [_node(b"b", 2, b"master")]],
        ],
    ],
)
def test_malformed_shards_replies_raise_backend_errors(reply: Any) -> None:
    with pytest.raises(BackendError):
        parse_cluster_shards(reply, "h")


@pytest.mark.parametrize("reply", [None, [[0, 1]], [[0, 1, [b"h"]]], [[0, b"z", [b"h", 1]]]])
def test_malformed_slots_replies_raise_backend_errors(reply: Any) -> None:
    with pytest.raises(BackendError):
        parse_cluster_slots(reply, "h")


def test_grouping_keeps_the_order_of_keys_and_nodes() -> None:
    slot_map = SlotMap([SlotRange(0, 8191, A, (RA,)), SlotRange(8192, 16383, B)])
    keys = [f"key-{i}".encode() for i in range(40)]
    groups = slot_map.group(keys)
    first = slot_map.primary(key_slot(keys[0]))
    assert list(groups) == [first, B if first == A else A]  # in the order of their first key
    assert sorted(i for positions in groups.values() for i in positions) == list(range(40))
    for node, positions in groups.items():
        assert positions == sorted(positions)
        assert all(slot_map.primary(key_slot(keys[i])) == node for i in positions)
    # reads go to a replica where there is one, to the primary elsewhere
    reads = slot_map.group(keys, read=True)
    assert set(reads) == {RA, B}
    assert reads[RA] == groups[A]
    assert slot_map.reader(0, pick=5) == RA and slot_map.reader(9000, pick=1) == B


def test_nodes_are_known_by_address() -> None:
    assert ClusterNode("h", 1, "id-1") == ClusterNode("h", 1) != ClusterNode("h", 2)
    assert str(ClusterNode("::1", 7000)) == "[::1]:7000"
    assert "0-8191: 10.0.0.1:7000 +10.0.0.4:7003" in repr(
        SlotMap([SlotRange(0, 8191, A, (RA,)), SlotRange(8192, 16383, B)])
    )


def _drive(op: Op[Any], replies: Iterator[Any]) -> Any:
    """Run a sans-IO operation on scripted replies (a Failure is thrown in)."""
    try:
        request = next(op)
        while True:
            assert isinstance(request, Command)
            reply = next(replies)
            request = op.throw(reply) if isinstance(reply, ErrorReply) else op.send(reply)
    except StopIteration as stop:
        return stop.value


def test_op_slot_map_falls_back_to_cluster_slots() -> None:
    slots_reply = [[0, 16383, [b"", 7000, b"a"]]]
    unknown = ErrorReply("ERR unknown subcommand 'SHARDS'. Try CLUSTER HELP.")
    slot_map = _drive(op_slot_map("10.0.0.1"), iter([unknown, slots_reply]))
    assert slot_map == SlotMap([SlotRange(0, 16383, A)])
    assert _drive(op_slot_map("h"), iter([SHARDS_RAW])).primary(9000) == B
    with pytest.raises(ErrorReply):
        _drive(op_slot_map("h"), iter([ErrorReply("CLUSTERDOWN The cluster is down")]))


# -- against the real clusters -----------------------------------------------------------------


def _raw(port: int, *args: Any) -> Any:
    """A reply as it comes off the wire (no redis-py response callback)."""
    import redis

    connection = redis.Connection(port=port)
    try:
        connection.send_command(*args)
        return connection.read_response()
    finally:
        connection.disconnect()


def _run(op: Op[Any], port: int) -> Any:
    import redis

    client = redis.Redis(port=port)
    try:
        request = next(op)
        while True:
            assert isinstance(request, Command)
            request = op.send(client.execute_command(*request.args))
    except StopIteration as stop:
        return stop.value
    finally:
        client.close()


def _expected(cluster: LocalCluster) -> list[tuple[int, int, int, set[int]]]:
    """(first slot, last slot, primary port, replica ports) per range, from CLUSTER NODES."""
    topology = cluster.topology()
    ranges = []
    for port, (role, _, slots) in topology.items():
        if role != "master":
            continue
        replicas = {p for p, (_, master, _) in topology.items() if master == port}
        for part in slots.split():
            first, _, last = part.partition("-")
            ranges.append((int(first), int(last or first), port, replicas))
    return sorted(ranges)


def test_the_map_of_every_node_agrees_with_cluster_nodes(redis_cluster: LocalCluster) -> None:
    expected = _expected(redis_cluster)
    for port in redis_cluster.live_ports():
        for slot_map in (
            parse_cluster_shards(_raw(port, "CLUSTER", "SHARDS"), "127.0.0.1"),
            parse_cluster_slots(_raw(port, "CLUSTER", "SLOTS"), "127.0.0.1"),
            _run(op_slot_map("127.0.0.1"), port),
        ):
            assert slot_map.complete
            got = [
                (r.start, r.end, r.primary.port, {n.port for n in r.replicas})
                for r in slot_map.ranges
            ]
            assert got == expected
            assert all(n.host == "127.0.0.1" for n in slot_map.nodes)


def test_keys_land_where_the_map_says(redis_cluster: LocalCluster) -> None:
    import redis

    cluster = redis_cluster
    port = redis_cluster.ports[0]
    slot_map = parse_cluster_shards(_raw(port, "CLUSTER", "SHARDS"), "127.0.0.1")
    rng = random.Random(7)
    keys = [b"kvt-slot:" + rng.randbytes(8) for _ in range(600)]
    groups = slot_map.group(keys)
    assert len(groups) == 3
    clients = {node: redis.Redis(port=node.port) for node in slot_map.nodes}
    try:
        for node, positions in groups.items():
            pipe = clients[node].pipeline(transaction=False)
            for i in positions:
                pipe.set(keys[i], i)
            assert pipe.execute() == [True] * len(positions)  # no MOVED: the owner took them
        replicas = {n for r in slot_map.ranges for n in r.replicas}
        cluster.wait_replicated()
        for node, positions in slot_map.group(keys, read=True).items():
            assert node in replicas
            clients[node].execute_command("READONLY")  # replicas serve their primary's slots
            assert clients[node].get(keys[positions[0]]) == str(positions[0]).encode()
        # a primary that does not own a key sends the client on with MOVED
        first, other = list(groups)[:2]
        with pytest.raises(redis.ResponseError, match=str(key_slot(keys[groups[first][0]]))):
            clients[other].get(keys[groups[first][0]])
    finally:
        for node, positions in groups.items():
            pipe = clients[node].pipeline(transaction=False)
            for i in positions:
                pipe.delete(keys[i])
            pipe.execute()
        for client in clients.values():
            client.close()

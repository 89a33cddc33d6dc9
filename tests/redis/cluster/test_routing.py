"""The wave operation, stepped with scripted replies: grouping, MOVED, ASK, failovers, limits."""

from __future__ import annotations

from typing import Any

import pytest

from kvredis.errors import BackendUnavailableError
from kvredis.redis.cluster.routing import (
    NodeBatch,
    RefreshSlotMap,
    SlotCommand,
    Wave,
    WavePolicy,
    op_wave,
)
from kvredis.redis.cluster.topology import ClusterNode, SlotMap, SlotRange
from kvredis.redis.requests import ConnectionLost, ErrorReply, Sleep

A, B, C = ClusterNode("a", 1), ClusterNode("b", 2), ClusterNode("c", 3)
RA = ClusterNode("ra", 4)
MAP = SlotMap([SlotRange(0, 8191, A, (RA,)), SlotRange(8192, 16383, B)])
MOVED_MAP = SlotMap([SlotRange(0, 99, C), SlotRange(100, 8191, A), SlotRange(8192, 16383, B)])
POLICY = WavePolicy(retries=2, backoff=0.1, max_redirects=3, server="the test cluster")


class Steps:
    """Drives op_wave: answers map requests itself, waves with a function of the wave."""

    def __init__(self, maps: list[SlotMap]) -> None:
        self.maps = maps
        self.requests: list[Any] = []

    def run(self, op: Any, answer: Any) -> Any:
        try:
            request = next(op)
            while True:
                self.requests.append(request)
                if isinstance(request, RefreshSlotMap):
                    reply: Any = self.maps.pop(0) if request.force else MAP
                elif isinstance(request, Sleep):
                    reply = None
                else:
                    assert isinstance(request, Wave)
                    reply = [answer(batch) for batch in request.batches]
                request = op.send(reply)
        except StopIteration as stop:
            return stop.value

    @property
    def waves(self) -> list[Wave]:
        return [r for r in self.requests if isinstance(r, Wave)]


def _echo(batch: NodeBatch) -> list[Any]:
    return [f"{batch.node.host}:{' '.join(map(str, args))}" for args in batch.commands]


def test_one_pipeline_per_node_in_one_wave_replies_in_order() -> None:
    commands = [SlotCommand(s, ("GET", f"k{s}")) for s in (9000, 5, 16000, 6, 8191)]
    steps = Steps([])
    assert steps.run(op_wave(commands, POLICY), _echo) == [
        "b:GET k9000", "a:GET k5", "b:GET k16000", "a:GET k6", "a:GET k8191",
    ]  # fmt: skip
    (wave,) = steps.waves
    assert wave.batches == (
        NodeBatch(B, (("GET", "k9000"), ("GET", "k16000"))),
        NodeBatch(A, (("GET", "k5"), ("GET", "k6"), ("GET", "k8191"))),
    )


def test_a_read_wave_goes_to_replicas_after_readonly() -> None:
    commands = [SlotCommand(s, ("GET", f"k{s}")) for s in (1, 9000)]
    steps = Steps([])
    assert steps.run(op_wave(commands, POLICY, read=True), _echo) == ["ra:GET k1", "b:GET k9000"]
    assert steps.waves[0].batches[0] == NodeBatch(RA, (("READONLY",), ("GET", "k1")))


def test_moved_sends_to_the_named_node_and_refreshes_the_map() -> None:
    commands = [SlotCommand(50, ("SET", "x", 1)), SlotCommand(9000, ("SET", "y", 2))]

    def answer(batch: NodeBatch) -> list[Any]:
        if batch.node == A:
            return [ErrorReply("MOVED 50 :3")]  # the host of the node that replied
        return ["OK"] * len(batch.commands)

    steps = Steps([MOVED_MAP])
    assert steps.run(op_wave(commands, POLICY), answer) == ["OK", "OK"]
    first, second = steps.waves
    assert [b.node for b in first.batches] == [A, B]
    assert second.batches == (NodeBatch(ClusterNode("a", 3), (("SET", "x", 1),)),)
    assert RefreshSlotMap(force=True) in steps.requests


def test_ask_sends_asking_first_and_keeps_the_map() -> None:
    commands = [SlotCommand(50, ("GET", "x"))]
    replies = iter([[ErrorReply("ASK 50 c:3")], ["OK", "value"]])
    steps = Steps([])
    assert steps.run(op_wave(commands, POLICY), lambda batch: next(replies)) == ["value"]
    assert steps.waves[1].batches == (NodeBatch(C, (("ASKING",), ("GET", "x"))),)
    assert RefreshSlotMap(force=True) not in steps.requests


def test_a_lost_node_is_retried_after_backoff_on_a_fresh_map() -> None:
    commands = [SlotCommand(50, ("GET", "x")), SlotCommand(9000, ("GET", "y"))]
    calls: list[ClusterNode] = []

    def answer(batch: NodeBatch) -> list[Any]:
        calls.append(batch.node)
        if batch.node == A:
            return [ConnectionLost("refused")]
        return [f"from {batch.node.host}"]

    steps = Steps([MOVED_MAP])
    assert steps.run(op_wave(commands, POLICY), answer) == ["from c", "from b"]
    assert calls == [A, B, C]  # only the failed command is sent again
    assert Sleep(0.1) in steps.requests


@pytest.mark.parametrize(
    "reply", ["TRYAGAIN Multiple keys request", "CLUSTERDOWN The cluster is down", "LOADING x"]
)
def test_transient_cluster_replies_are_retried(reply: str) -> None:
    replies = iter([[ErrorReply(reply)], ["fine"]])
    steps = Steps([MAP])
    result = steps.run(op_wave([SlotCommand(1, ("GET", "x"))], POLICY), lambda b: next(replies))
    assert result == ["fine"]


def test_other_error_replies_are_results() -> None:
    error = ErrorReply("WRONGTYPE Operation against a key holding the wrong kind of value")
    result = Steps([]).run(op_wave([SlotCommand(1, ("GET", "x"))], POLICY), lambda b: [error])
    assert result == [error]


def test_retries_are_bounded() -> None:
    steps = Steps([MAP] * 5)
    with pytest.raises(BackendUnavailableError, match="cannot reach the test cluster: refused"):
        steps.run(
            op_wave([SlotCommand(1, ("GET", "x"))], POLICY), lambda b: [ConnectionLost("refused")]
        )
    assert [r for r in steps.requests if isinstance(r, Sleep)] == [Sleep(0.1), Sleep(0.2)]


def test_redirections_are_bounded() -> None:
    steps = Steps([MAP] * 10)
    with pytest.raises(BackendUnavailableError, match="4 MOVED/ASK redirections"):
        moved = ErrorReply("MOVED 1 b:2")
        steps.run(op_wave([SlotCommand(1, ("GET", "x"))], POLICY), lambda b: [moved])


def test_a_slot_no_node_serves_is_retried_then_unavailable() -> None:
    partial = SlotMap([SlotRange(0, 10, A)])
    op = op_wave([SlotCommand(500, ("GET", "x"))], POLICY)
    request = next(op)
    sleeps = 0
    with pytest.raises(BackendUnavailableError, match="slot 500"):
        while True:
            sleeps += isinstance(request, Sleep)
            request = op.send(partial if isinstance(request, RefreshSlotMap) else None)
    assert sleeps == 2

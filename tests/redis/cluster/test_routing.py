"""The wave operation, stepped with scripted replies: grouping, MOVED, ASK, failovers, limits."""

from __future__ import annotations

from typing import Any

import pytest

from kvredis.errors import BackendUnavailableError
from kvredis.redis.cluster.routing import (
    ClusterState,
    NodeBatch,
    SlotCommand,
    Wave,
    WavePolicy,
    op_refresh,
    op_wave,
)
from kvredis.redis.cluster.topology import ClusterNode, SlotMap, SlotRange
from kvredis.redis.requests import ConnectionLost, ErrorReply, Sleep

A, B, C = ClusterNode("a", 1), ClusterNode("b", 2), ClusterNode("c", 3)
RA = ClusterNode("ra", 4)
MAP = SlotMap([SlotRange(0, 8191, A, (RA,)), SlotRange(8192, 16383, B)])
MOVED_MAP = SlotMap([SlotRange(0, 99, C), SlotRange(100, 8191, A), SlotRange(8192, 16383, B)])
POLICY = WavePolicy(retries=2, backoff=0.1, max_redirects=3, server="the test cluster")
SHARDS = ("CLUSTER", "SHARDS")


def _shards(slot_map: SlotMap) -> list[Any]:
    """A CLUSTER SHARDS reply telling ``slot_map``."""

    def node(n: ClusterNode, role: str) -> dict[str, Any]:
        return {"id": n.host, "port": n.port, "endpoint": n.host, "role": role}

    return [
        {
            "slots": [r.start, r.end],
            "nodes": [node(r.primary, "master"), *(node(n, "replica") for n in r.replicas)],
        }
        for r in slot_map.ranges
    ]


class Steps:
    """Drives op_wave on a state that knows MAP: answers CLUSTER SHARDS with the next of
    ``maps``, other waves with a function of each batch."""

    def __init__(self, maps: list[SlotMap]) -> None:
        self.maps = maps
        self.state = ClusterState([A])
        self.state.slot_map = MAP
        self.requests: list[Any] = []

    def run(self, op: Any, answer: Any) -> Any:
        try:
            request = next(op)
            while True:
                self.requests.append(request)
                if isinstance(request, Sleep):
                    reply: Any = None
                elif request.batches[0].commands == (SHARDS,):
                    reply = [[_shards(self.maps.pop(0))]]
                else:
                    reply = [answer(batch) for batch in request.batches]
                request = op.send(reply)
        except StopIteration as stop:
            return stop.value

    def wave(self, commands: list[SlotCommand], answer: Any, read: bool = False) -> Any:
        return self.run(op_wave(self.state, commands, POLICY, read), answer)

    @property
    def waves(self) -> list[Wave]:
        return [
            r for r in self.requests if isinstance(r, Wave) and r.batches[0].commands != (SHARDS,)
        ]

    @property
    def refreshes(self) -> int:
        waves = [r for r in self.requests if isinstance(r, Wave)]
        return sum(w.batches[0].commands == (SHARDS,) for w in waves)


def _echo(batch: NodeBatch) -> list[Any]:
    return [f"{batch.node.host}:{' '.join(map(str, args))}" for args in batch.commands]


def test_one_pipeline_per_node_in_one_wave_replies_in_order() -> None:
    commands = [SlotCommand(s, ("GET", f"k{s}")) for s in (9000, 5, 16000, 6, 8191)]
    steps = Steps([])
    assert steps.wave(commands, _echo) == [
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
    assert steps.wave(commands, _echo, read=True) == ["ra:GET k1", "b:GET k9000"]
    assert steps.waves[0].batches[0] == NodeBatch(RA, (("READONLY",), ("GET", "k1")))


def test_moved_sends_to_the_named_node_and_refreshes_the_map() -> None:
    commands = [SlotCommand(50, ("SET", "x", 1)), SlotCommand(9000, ("SET", "y", 2))]

    def answer(batch: NodeBatch) -> list[Any]:
        if batch.node == A:
            return [ErrorReply("MOVED 50 :3")]  # the host of the node that replied
        return ["OK"] * len(batch.commands)

    steps = Steps([MOVED_MAP])
    assert steps.wave(commands, answer) == ["OK", "OK"]
    first, second = steps.waves
    assert [b.node for b in first.batches] == [A, B]
    assert second.batches == (NodeBatch(ClusterNode("a", 3), (("SET", "x", 1),)),)
    assert steps.refreshes == 1 and steps.state.slot_map == MOVED_MAP


def test_ask_sends_asking_first_and_keeps_the_map() -> None:
    commands = [SlotCommand(50, ("GET", "x"))]
    replies = iter([[ErrorReply("ASK 50 c:3")], ["OK", "value"]])
    steps = Steps([])
    assert steps.wave(commands, lambda batch: next(replies)) == ["value"]
    assert steps.waves[1].batches == (NodeBatch(C, (("ASKING",), ("GET", "x"))),)
    assert steps.refreshes == 0


def test_a_lost_node_is_retried_after_backoff_on_a_fresh_map() -> None:
    commands = [SlotCommand(50, ("GET", "x")), SlotCommand(9000, ("GET", "y"))]
    calls: list[ClusterNode] = []

    def answer(batch: NodeBatch) -> list[Any]:
        calls.append(batch.node)
        if batch.node == A:
            return [ConnectionLost("refused")]
        return [f"from {batch.node.host}"]

    steps = Steps([MOVED_MAP])
    assert steps.wave(commands, answer) == ["from c", "from b"]
    assert calls == [A, B, C]  # only the failed command is sent again
    assert Sleep(0.1) in steps.requests


@pytest.mark.parametrize(
    "reply", ["TRYAGAIN Multiple keys request", "CLUSTERDOWN The cluster is down", "LOADING x"]
)
def test_transient_cluster_replies_are_retried(reply: str) -> None:
    replies = iter([[ErrorReply(reply)], ["fine"]])
    steps = Steps([MAP])
    result = steps.wave([SlotCommand(1, ("GET", "x"))], lambda b: next(replies))
    assert result == ["fine"]


def test_other_error_replies_are_results() -> None:
    error = ErrorReply("WRONGTYPE Operation against a key holding the wrong kind of value")
    result = Steps([]).wave([SlotCommand(1, ("GET", "x"))], lambda b: [error])
    assert result == [error]


def test_retries_are_bounded() -> None:
    steps = Steps([MAP] * 5)
    with pytest.raises(BackendUnavailableError, match="cannot reach the test cluster: refused"):
        steps.wave([SlotCommand(1, ("GET", "x"))], lambda b: [ConnectionLost("refused")])
    assert [r for r in steps.requests if isinstance(r, Sleep)] == [Sleep(0.1), Sleep(0.2)]


def test_redirections_are_bounded() -> None:
    steps = Steps([MAP] * 10)
    with pytest.raises(BackendUnavailableError, match="4 MOVED/ASK redirections"):
        moved = ErrorReply("MOVED 1 b:2")
        steps.wave([SlotCommand(1, ("GET", "x"))], lambda b: [moved])


def test_a_slot_no_node_serves_is_retried_then_unavailable() -> None:
    partial = SlotMap([SlotRange(0, 10, A)])
    steps = Steps([partial, partial])
    steps.state.slot_map = partial
    with pytest.raises(BackendUnavailableError, match="slot 500"):
        steps.wave([SlotCommand(500, ("GET", "x"))], _echo)
    assert [r for r in steps.requests if isinstance(r, Sleep)] == [Sleep(0.1), Sleep(0.2)]


def test_the_map_comes_from_the_first_node_that_tells_it() -> None:
    state = ClusterState([A, B, C])
    op = op_refresh(state, "the test cluster")
    asked = [next(op)]
    asked.append(op.send([[ConnectionLost("refused")]]))
    asked.append(op.send([[ErrorReply("NOPERM no permission for 'cluster|shards'")]]))
    with pytest.raises(StopIteration) as done:
        op.send([[_shards(MOVED_MAP)]])
    assert done.value.value == MOVED_MAP == state.slot_map
    assert [w.batches for w in asked] == [(NodeBatch(n, (SHARDS,)),) for n in (A, B, C)]
    # later refreshes ask the nodes of the map first
    assert state.candidates() == [C, A, B]


def test_no_node_telling_the_map_is_unavailable() -> None:
    op = op_refresh(ClusterState([A, B]), "the test cluster")
    next(op)
    op.send([[ConnectionLost("refused")]])
    with pytest.raises(BackendUnavailableError, match=r"no node of the test cluster.*b:2: refused"):
        op.send([[ConnectionLost("refused")]])
    with pytest.raises(ValueError, match="seed"):
        ClusterState([])


def test_a_slot_being_migrated_spends_retries_not_redirections() -> None:
    """A multi-key command on a slot whose keys are half moved: the source answers ASK, the
    target TRYAGAIN (until the migration ends), again and again. Each round is a retry with
    backoff; the redirections count again after each, so the wave rides out as many rounds as
    it has retries, more than ``max_redirects``."""
    policy = WavePolicy(retries=6, backoff=0.1, max_redirects=3, server="the test cluster")
    rounds = [[[ErrorReply("ASK 1 c:3")], ["OK", ErrorReply("TRYAGAIN Multiple keys")]]] * 5
    replies = iter([r for pair in rounds for r in pair] + [[ErrorReply("ASK 1 c:3")], ["OK", 7]])
    steps = Steps([MAP] * 5)
    op = op_wave(steps.state, [SlotCommand(1, ("EVALSHA", "x", 2, "k1", "k2"))], policy)
    assert steps.run(op, lambda b: next(replies)) == [7]
    assert sum(isinstance(r, Sleep) for r in steps.requests) == 5

"""The wave operation, stepped with scripted replies: grouping, MOVED, ASK, failovers, limits."""

from __future__ import annotations

from typing import Any

import pytest

from kvredis.errors import BackendUnavailableError
from kvredis.redis.cluster.routing import (
    MIGRATION_POLL,
    ClusterState,
    NodeBatch,
    SlotCommand,
    Wave,
    WavePolicy,
    migrating,
    non_local_key,
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


def test_a_plain_command_follows_ask_but_a_script_waits_at_its_slots_node() -> None:
    """A script may touch keys it does not declare: at the target of a migration those not
    moved yet would read as missing, so ASK to a script is a wait (no ASKING), and the script
    goes to its slot's node again until the slot is handed over (MOVED)."""
    script = SlotCommand(1, ("EVALSHA", "x", 2, "k1", "k2"))
    plain = SlotCommand(2, ("HGET", "h", "f"))
    replies = iter(  # one per batch
        [
            [ErrorReply("ASK 1 c:3"), ErrorReply("ASK 2 c:3")],
            [ErrorReply("ASK 1 c:3")],  # the script at a again
            ["OK", "value"],  # the HGET at c, after ASKING
            [ErrorReply("MOVED 1 c:3")],  # handed over
            [7],
        ]
    )
    steps = Steps([MOVED_MAP])
    assert steps.wave([script, plain], lambda b: next(replies)) == [7, "value"]
    waves = steps.waves
    assert waves[1].batches == (
        NodeBatch(A, (script.args,)),
        NodeBatch(C, (("ASKING",), plain.args)),
    )
    assert waves[2].batches == (NodeBatch(A, (script.args,)),)
    assert waves[3].batches == (NodeBatch(C, (script.args,)),)
    assert [r for r in steps.requests if isinstance(r, Sleep)] == [Sleep(0.1), Sleep(0.1)]
    assert steps.refreshes == 1


@pytest.mark.parametrize(
    "reply",
    [
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "ERR Script attempted to access a non local key in a cluster node script: 1f, on @user_"
        "script:2.",  # Redis 7
        "ERR Attempted to access a non local key in a cluster node script: on @user_script:2.",
    ],
)
def test_a_migrating_slot_is_polled_within_migration_wait_not_retries(reply: str) -> None:
    """TRYAGAIN and a script's non-local key: the slot is being migrated. The command is sent
    again after short pauses (doubling from the backoff, at most MIGRATION_POLL), as long as
    the waits stay within ``migration_wait``, however many ``retries`` the policy has; with
    nothing but ASKs on the way it needs no redirection budget either."""
    policy = WavePolicy(retries=1, backoff=0.02, max_redirects=1, migration_wait=1.0)
    steps = Steps([])
    rounds = iter([[ErrorReply(reply)]] * 8 + [[ErrorReply("ASK 1 c:3")]] * 3 + [["done"]])
    op = op_wave(steps.state, [SlotCommand(1, ("EVALSHA", "x", 1, "k"))], policy)
    assert steps.run(op, lambda b: next(rounds)) == ["done"]
    sleeps = [r.seconds for r in steps.requests if isinstance(r, Sleep)]
    assert sleeps == [0.02, 0.04, 0.08] + [MIGRATION_POLL] * 8
    assert steps.refreshes == 0 and all(b.node == A for w in steps.waves for b in w.batches)


def test_a_migration_that_does_not_settle_is_unavailable_after_migration_wait() -> None:
    policy = WavePolicy(backoff=0.05, migration_wait=0.3, server="the test cluster")
    steps = Steps([])
    op = op_wave(steps.state, [SlotCommand(7, ("GET", "k"))], policy)
    with pytest.raises(BackendUnavailableError, match=r"slot 7 is being migrated.*0\.3 s"):
        steps.run(op, lambda b: [ErrorReply("TRYAGAIN Multiple keys request")])
    assert sum(r.seconds for r in steps.requests if isinstance(r, Sleep)) <= 0.3
    fast = WavePolicy(migration_wait=0.0)
    op = op_wave(steps.state, [SlotCommand(7, ("GET", "k"))], fast)
    with pytest.raises(BackendUnavailableError, match="being migrated"):
        steps.run(op, lambda b: [ErrorReply("TRYAGAIN Multiple keys request")])


def test_which_replies_say_a_slot_is_migrating() -> None:
    script, plain = ("EVALSHA", "x", 1, "k"), ("GET", "k")
    non_local = ErrorReply("ERR Script attempted to access a non local key in a cluster node")
    assert non_local_key(non_local) and not non_local_key(ErrorReply("ERR other"))
    assert migrating(plain, non_local) and migrating(plain, ErrorReply("TRYAGAIN x"))
    assert migrating(script, ErrorReply("ASK 1 c:3")) and migrating(
        (b"fcall", "f"), ErrorReply("ASK 1 c:3")
    )
    assert not migrating(plain, ErrorReply("ASK 1 c:3"))
    assert not migrating(script, ErrorReply("MOVED 1 c:3")) and not migrating(script, "OK")
    assert not migrating(script, ConnectionLost("refused"))

"""One parallel wave of commands over a cluster, as a sans-IO operation that follows MOVED
and ASK and rides out failovers.

:func:`op_wave` takes commands, each with the slot it targets, groups them by the node serving
the slot (:meth:`~kvredis.redis.cluster.topology.SlotMap.group_slots`) and yields one
:class:`Wave`: every node gets its commands as one pipeline, and an executor sends all of them
at once (one round trip per involved node, in parallel). Then, per command:

- a reply, or an error reply that is no redirection and not transient, is its result (error
  replies stay :class:`~kvredis.redis.requests.Failure` values, as in a pipeline);
- ``MOVED``: the slot lives elsewhere now: the command goes to the named node in the next wave,
  and the slot map is refreshed (:func:`op_refresh`: ``CLUSTER SHARDS`` asked of the nodes
  of the current map, then of the seeds, until one answers);
- ``ASK``: the slot is migrating and the key is already at the named node: a plain command
  goes there in the next wave, preceded by ``ASKING`` (the map stays). A script call does not:
  it may touch keys it does not declare, and at the target those not moved yet would read as
  missing (a wrong answer) or be created there (and the migration's ``MIGRATE`` of the
  source's copy then fails with ``BUSYKEY``). It waits for the migration instead (below);
- ``TRYAGAIN`` (a multi-key command on a slot whose keys are split between two nodes), a
  script refused for touching a key of a slot this node does not serve or is migrating away
  (:func:`non_local_key`), and ``ASK`` on a script call: the slot is being migrated; the
  command is sent to its slot's node again after a short :class:`~kvredis.redis.requests.Sleep`
  (polling: :meth:`WavePolicy.migration_delay`), for at most the policy's ``migration_wait``
  seconds in all (the client's ``socket_timeout``; a slot of a few thousand keys migrates in
  well under a second). The migration ends with the slot handed over, which the old node
  answers with ``MOVED``;
- a lost connection, or ``CLUSTERDOWN``/``LOADING``/``BUSY``/``MASTERDOWN``/``READONLY`` (a
  failover in progress): after a :class:`~kvredis.redis.requests.Sleep` with backoff the map
  is refreshed and the command sent to its slot's node again.

Redirections count against ``max_redirects`` (afresh after each wait or retry) and retries
against the policy's ``retries``; past either, or past ``migration_wait``, the wave raises
:class:`~kvredis.errors.BackendUnavailableError`. Read waves (``read=True``) go to replicas
where the map has healthy ones (each of those pipelines starts with ``READONLY``). Every command
must be safe to send twice (a command whose reply was lost, or a script that stopped at a
non-local key after writing some keys, is sent again).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvredis.errors import BackendUnavailableError, KVRedisError
from kvredis.redis.cluster.redirect import RedirectKind, parse_redirect
from kvredis.redis.cluster.topology import ClusterNode, SlotMap, op_slot_map
from kvredis.redis.requests import Arg, Command, ConnectionLost, ErrorReply, Failure, Sleep

T = TypeVar("T")

#: Error replies a node gives while a slot or the cluster is in flux (retried, map refreshed).
TRANSIENT_CLUSTER_REPLIES = frozenset(
    {"TRYAGAIN", "CLUSTERDOWN", "LOADING", "BUSY", "MASTERDOWN", "READONLY"}
)
#: What a node says when a script touched a key of a slot it does not serve, or of a slot it is
#: migrating away whose key is gone (Redis 7: "Script attempted to access a non local key in a
#: cluster node ...", Valkey 9: "Attempted to access a non local key in a cluster node ...").
NON_LOCAL_KEY = "access a non local key"
#: Commands that run a script (which may touch keys it does not declare).
SCRIPT_COMMANDS = frozenset({b"EVALSHA", b"EVAL", b"EVALSHA_RO", b"EVAL_RO", b"FCALL", b"FCALL_RO"})
#: Longest pause between two attempts of a command on a migrating slot (seconds).
MIGRATION_POLL = 0.1
#: Shortest such pause (also with ``retry_backoff=0``).
MIGRATION_POLL_MIN = 0.005
#: Redirections one wave follows at most (a slot moving twice while the wave runs is rare).
DEFAULT_MAX_REDIRECTS = 5


@dataclass(frozen=True, slots=True)
class SlotCommand:
    """A command and the slot of the keys it touches."""

    slot: int
    args: tuple[Arg, ...]


@dataclass(frozen=True, slots=True)
class NodeBatch:
    """Commands for one node, sent as one pipeline (no MULTI)."""

    node: ClusterNode
    commands: tuple[tuple[Arg, ...], ...]


@dataclass(frozen=True, slots=True)
class Wave:
    """Pipelines for several nodes, sent in parallel. The reply is one list per batch, in
    order: the replies of its commands, a :class:`Failure` in place of each that failed (a
    batch whose node could not be reached has a ConnectionLost for every command)."""

    batches: tuple[NodeBatch, ...]


WaveRequest = Wave | Sleep
#: A cluster operation: yields waves and sleeps.
WaveOp = Generator[WaveRequest, Any, T]


class ClusterState:
    """What a cluster client knows: its seed nodes, and the slot map it last fetched."""

    def __init__(self, seeds: Sequence[ClusterNode], tls: bool = False) -> None:
        if not seeds:
            raise ValueError("a cluster needs at least one seed node")
        self.seeds = tuple(seeds)
        self.tls = tls
        self.slot_map: SlotMap | None = None

    def candidates(self) -> list[ClusterNode]:
        """Nodes to ask for the slot map: those of the current map, then the seeds."""
        known = self.slot_map.nodes if self.slot_map is not None else ()
        return list(dict.fromkeys((*known, *self.seeds)))


def op_refresh(state: ClusterState, server: str = "the cluster") -> WaveOp[SlotMap]:
    """Fetch the slot map from the first node that tells it (see :func:`op_slot_map`) and keep
    it in ``state``; BackendUnavailableError when none does."""
    errors: list[str] = []
    for node in state.candidates():
        op = op_slot_map(node.host, state.tls)
        try:
            request = next(op)
            while True:
                assert isinstance(request, Command)  # op_slot_map sends plain commands
                ((reply,),) = yield Wave((NodeBatch(node, (request.args,)),))
                request = op.throw(reply) if isinstance(reply, Failure) else op.send(reply)
        except StopIteration as stop:
            state.slot_map = stop.value
            return state.slot_map
        except (Failure, KVRedisError) as exc:  # this node cannot tell: ask the next one
            errors.append(f"{node}: {exc}")
        finally:
            op.close()
    raise BackendUnavailableError(f"no node of {server} told its slot map: {'; '.join(errors)}")


@dataclass(frozen=True, slots=True)
class WavePolicy:
    """How often a wave retries (failovers) and follows redirections before giving up."""

    retries: int = 2
    backoff: float = 0.05
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    #: the cluster as named in errors, e.g. ``"redis cluster at redis+cluster://a:1,b:2"``
    server: str = "the cluster"
    #: seconds a command waits in all for a slot being migrated (0: it does not wait)
    migration_wait: float = 2.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1``: exponential, at most one second."""
        return float(min(1.0, self.backoff * (2**attempt)))

    def migration_delay(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` on a migrating slot: exponential from
        ``backoff``, between :data:`MIGRATION_POLL_MIN` and :data:`MIGRATION_POLL`."""
        return float(min(MIGRATION_POLL, max(MIGRATION_POLL_MIN, self.backoff * (2**attempt))))


def non_local_key(reply: object) -> bool:
    """Whether ``reply`` is a script refused for touching a key its node does not serve (now)."""
    return isinstance(reply, ErrorReply) and NON_LOCAL_KEY in reply.message


def migrating(command: Sequence[Arg], reply: object) -> bool:
    """Whether ``reply`` to ``command`` says the command's slot is being migrated (it is sent
    again once the migration is over): ``TRYAGAIN``, a non-local key, ``ASK`` to a script."""
    if not isinstance(reply, ErrorReply):
        return False
    if reply.code == "TRYAGAIN" or NON_LOCAL_KEY in reply.message:
        return True
    return reply.code == "ASK" and _is_script(command)


def _is_script(command: Sequence[Arg]) -> bool:
    name = command[0] if command else b""
    raw = name.encode() if isinstance(name, str) else name
    return isinstance(raw, bytes) and raw.upper() in SCRIPT_COMMANDS


def _retryable(reply: Failure) -> bool:
    if isinstance(reply, ConnectionLost):
        return True
    return isinstance(reply, ErrorReply) and reply.code in TRANSIENT_CLUSTER_REPLIES


def op_wave(
    state: ClusterState,
    commands: Sequence[SlotCommand],
    policy: WavePolicy,
    read: bool = False,
    pick: int = 0,
    spread: bool = False,
) -> WaveOp[list[Any]]:
    """Send ``commands`` in parallel waves until each has its reply; the replies in order.
    A read wave (``read``) goes to replica number ``pick`` of each slot (``spread``: node
    number ``pick`` of the slot's primary and replicas)."""
    slot_map = state.slot_map or (yield from op_refresh(state, policy.server))
    results: list[Any] = [None] * len(commands)
    # position -> (node, asking); None: the slot map decides
    targets: dict[int, tuple[ClusterNode, bool] | None] = dict.fromkeys(range(len(commands)))
    attempt = redirects = waits = 0
    waited = 0.0
    while targets:
        try:
            batches, positions = _plan(commands, targets, slot_map, read, pick, spread)
        except BackendUnavailableError as exc:  # a slot no node serves (yet)
            failure: Failure = ConnectionLost(str(exc))
            slot_map = yield from _backoff(state, policy, attempt, failure)
            attempt += 1
            continue
        replies = yield Wave(batches)
        moved = False
        failed: Failure | None = None
        migration: tuple[int, ErrorReply] | None = None
        for batch, batch_positions, batch_replies in zip(batches, positions, replies, strict=True):
            for position, reply in zip(batch_positions, batch_replies, strict=True):
                if position is None:  # ASKING / READONLY
                    continue
                redirect = parse_redirect(reply.message) if isinstance(reply, ErrorReply) else None
                if migrating(commands[position].args, reply):
                    targets[position] = None
                    migration = (commands[position].slot, reply)
                elif redirect is not None:
                    node = _node_of(redirect.address(batch.node.host))
                    targets[position] = (node, redirect.kind is RedirectKind.ASK)
                    moved = moved or redirect.kind is RedirectKind.MOVED
                    redirects += 1
                elif isinstance(reply, Failure) and _retryable(reply):
                    targets[position] = None
                    failed = reply
                else:
                    results[position] = reply
                    del targets[position]
        if redirects > policy.max_redirects:
            raise BackendUnavailableError(
                f"{policy.server}: gave up after {redirects} MOVED/ASK redirections "
                "(slots keep moving); try again"
            )
        if failed is not None:
            slot_map = yield from _backoff(state, policy, attempt, failed)
            attempt += 1
            redirects = 0
        elif moved:
            slot_map = yield from op_refresh(state, policy.server)
        elif migration is not None:
            delay = policy.migration_delay(waits)
            if waited + delay > policy.migration_wait:
                slot, reply = migration
                raise BackendUnavailableError(
                    f"{policy.server}: slot {slot} is being migrated between nodes and did not "
                    f"settle within {policy.migration_wait:g} s (socket_timeout): {reply.message}"
                )
            yield Sleep(delay)
            waited += delay
            waits += 1
            redirects = 0
    return results


def _backoff(
    state: ClusterState, policy: WavePolicy, attempt: int, failure: Failure
) -> WaveOp[SlotMap]:
    if attempt >= policy.retries:
        raise BackendUnavailableError(f"cannot reach {policy.server}: {failure.message}")
    yield Sleep(policy.delay(attempt))
    try:
        return (yield from op_refresh(state, policy.server))
    except BackendUnavailableError:  # no node answers yet: keep the map, retry later
        assert state.slot_map is not None
        return state.slot_map


def _node_of(address: tuple[str, int]) -> ClusterNode:
    return ClusterNode(address[0], address[1])


def _plan(
    commands: Sequence[SlotCommand],
    targets: dict[int, tuple[ClusterNode, bool] | None],
    slot_map: SlotMap,
    read: bool,
    pick: int,
    spread: bool = False,
) -> tuple[tuple[NodeBatch, ...], list[list[int | None]]]:
    """The batches of the next wave, and per batch the position of each command (None for
    the ASKING / READONLY commands the plan adds)."""
    replicas = {node for r in slot_map.ranges for node in r.replicas} if read else set()
    plan: dict[ClusterNode, tuple[list[tuple[Arg, ...]], list[int | None]]] = {}
    for position, target in targets.items():
        slot = commands[position].slot
        if target is None:
            node = slot_map.reader(slot, pick, spread) if read else slot_map.primary(slot)
            asking = False
        else:
            node, asking = target
        if node not in plan:
            plan[node] = ([("READONLY",)], [None]) if node in replicas else ([], [])
        args, positions = plan[node]
        if asking:
            args.append(("ASKING",))
            positions.append(None)
        args.append(commands[position].args)
        positions.append(position)
    batches = tuple(NodeBatch(node, tuple(args)) for node, (args, _) in plan.items())
    return batches, [positions for _, positions in plan.values()]

"""The core of the cluster index's operations: :class:`ClusterCore` (the namespace's shards, the
slot map, the policies) and the combinators that run single-server operations on shards in
waves (:func:`op_parallel`, one round trip per involved node), with the WAIT a write wave ends
with; connecting (slot map, descriptor, server checks, scripts or the function library on
every primary). The operations themselves are :mod:`.ops` (reads, clear, drop) and
:mod:`.writes` (adds, evicts, batches, watermarks)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

from kvredis.errors import (
    BackendUnavailableError,
    NamespaceMissingError,
    translate,
)
from kvredis.redis.cluster.redirect import parse_redirect
from kvredis.redis.cluster.routing import (
    TRANSIENT_CLUSTER_REPLIES,
    ClusterState,
    NodeBatch,
    SlotCommand,
    Wave,
    WaveOp,
    WavePolicy,
    migrating,
    op_wave,
)
from kvredis.redis.cluster.shards import (
    CLUSTER_LAYOUT,
    Descriptor,
    check_cluster_namespace,
    check_shards,
    descriptor_key,
    parse_descriptor,
    pod_shard,
    shard_names,
    shard_of,
    shard_slot,
    shards_of,
    stream_shard,
)
from kvredis.redis.cluster.topology import ClusterNode, SlotMap
from kvredis.redis.layout import (
    Layout,
    check_bucket_bits,
    check_namespace,
)
from kvredis.redis.ops import (
    WAIT_FIRST_S,
    WAIT_LONGEST_S,
    expiry_mode_of,
    op_load_namespace,
    op_run,
)
from kvredis.redis.requests import (
    Command,
    ConnectionLost,
    ErrorReply,
    Failure,
    Op,
    Pipeline,
    Sleep,
)
from kvredis.redis.scripts import ScriptRegistry
from kvredis.redis.session import (
    RetryPolicy,
    Session,
    check_eviction_policy,
    op_drive,
    typed_error,
)
from kvredis.redis.state import CoreState, namespace_missing_error, refused_by_acl

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: Engine keys whose mappings one ``unmap`` call drops at most.
UNMAP_PER_CALL = 256
#: Engine buckets one page of the clear's mapping pass reads.
MAPPING_PAGE = 64


#: Read plans kept per node choice: reads rotate over a slot's nodes, and 60 turns cover
#: slots of 1 to 6 nodes alike.
READ_TURNS = 60

#: Where reads (lookups and scores) go: the primaries, the replicas of each slot, or every node
#: of each slot in turn (the primary and its replicas).
ReadFrom = Literal["primary", "replicas", "spread"]


class ClusterCore:
    """What one cluster index client carries: the cluster's state and its namespace's shards.

    Shared by the client's threads: the shards' states are thread-safe, the rest is set once
    when connecting (the stream homes are a cache: a lost update costs one extra node).
    """

    def __init__(
        self,
        namespace: str,
        bucket_bits: int,
        shards: int,
        cluster: ClusterState,
        wave_policy: WavePolicy,
        policy: RetryPolicy,
        read_from: ReadFrom = "primary",
    ) -> None:
        self.namespace = check_cluster_namespace(check_namespace(namespace))
        self.bucket_bits = check_bucket_bits(bucket_bits)
        self.configured_shards = check_shards(shards)
        self.cluster = cluster
        self.wave_policy = wave_policy
        #: Waves of calls grouped by node with the current slot map: no retry, no redirection,
        #: no wait for a migrating slot (a failure sends the work down the per-shard path, which
        #: has all three).
        self.fast_policy = dataclasses.replace(
            wave_policy, retries=0, max_redirects=0, migration_wait=0.0
        )
        self.policy = policy
        self.registry = ScriptRegistry()
        self.read_from: ReadFrom = read_from
        #: replicas every write waits for (``WAIT``; 0: none), and for how long at most
        self.wait_replicas = 0
        self.wait_timeout_ms = 1000
        self.expiry_mode = "key"
        #: seconds to wait for a missing namespace's creator (RedisIndexConfig's option)
        self.wait_for_namespace = 0.0
        #: the namespace's descriptor (after connecting), and when it was read (monotonic s)
        self.descriptor = Descriptor(CLUSTER_LAYOUT, self.configured_shards)
        self.descriptor_read_at = 0.0
        #: the clock of descriptor refreshes (seconds, monotonic; injected by tests)
        self.clock: Callable[[], float] = time.monotonic
        self.sessions: list[Session] = []
        self.slots: list[int] = []
        #: stream -> the shard its last fenced batch was decided on (where an empty batch of
        #: the stream goes)
        self.stream_homes: dict[str, int] = {}
        self._shard_args: dict[int, tuple[Layout, tuple[Any, ...]]] = {}
        self._plans: dict[tuple[Any, ...], tuple[SlotMap, tuple[Layout, ...], Any]] = {}
        self._picks = itertools.count()

    @property
    def count(self) -> int:
        """The number of shards (after connecting)."""
        return len(self.sessions)

    @property
    def by_pod(self) -> bool:
        """Whether every pod lives in one shard (the namespace is in the pod layout)."""
        return self.descriptor.by_pod

    @property
    def read_from_replicas(self) -> bool:
        """Whether reads may go to replicas."""
        return self.read_from != "primary"

    def adopt(self, count: int) -> None:
        """Set up the ``count`` shards of the namespace."""
        if self.sessions and len(self.sessions) == count:
            return
        sessions, slots = [], []
        for name in shard_names(self.namespace, count):
            state = CoreState(name, self.bucket_bits)
            state.expiry_mode = self.expiry_mode
            state.wait_for_namespace = self.wait_for_namespace
            sessions.append(Session(state, self.registry, self.policy))
            slots.append(shard_slot(name))
        self.sessions, self.slots = sessions, slots

    def pod_shard(self, pod: str) -> int:
        """The shard every entry of ``pod`` lives in (pod layout)."""
        return pod_shard(pod, len(self.sessions))

    def pods_shards(self, pods: frozenset[str] | None) -> list[int]:
        """The shards a read with the pod filter ``pods`` involves, in order: every shard
        without a filter (or while pods are not placed), else the shards of its pods."""
        if pods is None or not self.by_pod:
            return list(range(len(self.sessions)))
        return sorted({self.pod_shard(p) for p in pods if isinstance(p, str)})

    def stream_home(self, stream: str) -> int:
        """The shard a fenced batch of ``stream`` without entries goes to: the shard its last
        batch was decided on, else a hash of the stream's name."""
        home = self.stream_homes.get(stream)
        return stream_shard(stream, len(self.sessions)) if home is None else home

    def shard(self, key: int) -> int:
        """The shard of a request or engine key in the key layout."""
        return shard_of(key, len(self.sessions))

    def state(self, shard: int) -> CoreState:
        """The namespace state of one shard."""
        return self.sessions[shard].state

    def shard_args(self, shard: int) -> tuple[Any, ...]:
        """The keys and namespace of one shard as a read names them (``:meta``, ``:pi``,
        ``:pp``, ``:sx``, generation, request bucket prefix, bucket bits), for the layout it
        has loaded (kept while that layout is current)."""
        layout = self.sessions[shard].state.layout
        known = self._shard_args.get(shard)
        if known is None or known[0] is not layout:
            args = (layout.meta, layout.pi, layout.pp, layout.sx, layout.gen, layout.rprefix,
                    layout.bucket_bits)  # fmt: skip
            known = self._shard_args[shard] = (layout, args)
        return known[1]

    def run(self, shard: int, factory: Callable[[CoreState], Op[T]]) -> Op[T]:
        """``factory(state)`` on one shard, with namespace loading and stale reloads."""
        session = self.sessions[shard]
        return op_run(session, lambda: factory(session.state))

    def by_shard(self, keys: Iterable[int]) -> dict[int, list[int]]:
        """``keys`` grouped by their shard in the key layout, each group in the order given."""
        ordered = list(keys)
        groups: dict[int, list[int]] = {}
        for key, shard in zip(ordered, shards_of(ordered, len(self.sessions)), strict=True):
            groups.setdefault(shard, []).append(key)
        return groups

    def read_plan(
        self,
        slot_map: SlotMap,
        shards: Sequence[int],
        pick: int,
        build: Callable[[ClusterCore, dict[ClusterNode, list[int]]], list[T]],
    ) -> list[T] | None:
        """``build(core, shards grouped by the node a read numbered pick goes to)``, kept while
        the slot map, the shards' layouts and the node choice are the same (a router's scores
        all take the same plan); None when a shard's slot has no node in the map."""
        turn = 0 if self.read_from == "primary" else pick % READ_TURNS
        key = (id(build), tuple(shards), turn)
        layouts = tuple(self.sessions[s].state.layout for s in shards)
        known = self._plans.get(key)
        if (
            known is not None
            and known[0] is slot_map
            and all(a is b for a, b in zip(known[1], layouts, strict=True))
        ):
            return cast("list[T]", known[2])
        by_node: dict[ClusterNode, list[int]] = {}
        reader = self.reader(slot_map, pick)
        try:
            for shard in shards:
                by_node.setdefault(reader(self.slots[shard]), []).append(shard)
        except BackendUnavailableError:
            return None
        plan = build(self, by_node)
        if len(self._plans) > 256:
            self._plans.clear()
        self._plans[key] = (slot_map, layouts, plan)
        return plan

    def pick(self) -> int:
        """A different node index for each read (spreads reads over a slot's nodes)."""
        return next(self._picks)

    def reader(self, slot_map: SlotMap, pick: int) -> Callable[[int], ClusterNode]:
        """The node a read of a slot goes to, for the read numbered ``pick``."""
        if self.read_from == "primary":
            return slot_map.primary
        spread = self.read_from == "spread"
        return lambda slot: slot_map.reader(slot, pick, spread)


# -- running per-shard operations in waves -----------------------------------------------------


def op_parallel(
    core: ClusterCore, ops: Mapping[int, Op[T]], read: bool = False
) -> WaveOp[dict[int, T]]:
    """Run one driven operation per shard (each yields commands, pipelines and sleeps, as
    :func:`kvredis.redis.ops.op_drive` does) in lockstep: the requests all of them wait for go
    out as one wave; the results by shard.

    ``read=True`` sends the wave to replicas when the client reads from replicas.
    """
    live = dict(ops)
    pending: dict[int, Any] = {}
    results: dict[int, T] = {}

    def step(shard: int, outcome: Any, throw: bool) -> None:
        op = live[shard]
        try:
            request = op.throw(outcome) if throw else op.send(outcome)
        except StopIteration as stop:
            results[shard] = stop.value
            del live[shard]
            pending.pop(shard, None)
            return
        pending[shard] = request

    try:
        for shard in list(live):
            step(shard, None, False)
        while pending:
            sleeping = [s for s, r in pending.items() if isinstance(r, Sleep)]
            if sleeping:
                yield Sleep(max(pending[s].seconds for s in sleeping))
                for shard in sleeping:
                    step(shard, None, False)
                continue
            commands: list[SlotCommand] = []
            spans: list[tuple[int, int, int | None]] = []
            for shard, request in pending.items():
                slot = core.slots[shard]
                if isinstance(request, Command):
                    spans.append((shard, len(commands), None))
                    commands.append(SlotCommand(slot, request.args))
                elif isinstance(request, Pipeline):
                    spans.append((shard, len(commands), len(request.items)))
                    for item in request.items:
                        if not isinstance(item, Command):  # op_send sends scripts as EVALSHA
                            raise TypeError(f"a wave sends commands, not {item!r}")
                        commands.append(SlotCommand(slot, item.args))
                else:
                    raise TypeError(f"a wave sends commands, pipelines and sleeps, not {request!r}")
            replies = yield from write_wave(core, commands, core.wave_policy, read)
            for shard, start, n in spans:
                if n is None:
                    reply = replies[start]
                    step(shard, reply, isinstance(reply, Failure))
                else:
                    step(shard, list(replies[start : start + n]), False)
    finally:
        for op in live.values():
            op.close()
    return results


#: Commands the cluster operations send that write nothing (no WAIT after them).
_READS = frozenset(
    {
        b"HGET",
        b"HMGET",
        b"HEXISTS",
        b"HGETALL",
        b"SCAN",
        b"INFO",
        b"PING",
        b"SCRIPT",
        b"TIME",
        b"FCALL_RO",
    }
)


def write_wave(
    core: ClusterCore, commands: Sequence[SlotCommand], policy: WavePolicy, read: bool = False
) -> WaveOp[list[Any]]:
    """One wave of ``commands``; the replies. A read wave goes to replicas when the client
    reads from replicas; any other ends each written primary's pipeline with ``WAIT`` when the
    client waits for replicas (:func:`_waits`, :func:`_watch_waits`)."""
    waits = [] if read else _waits(core, commands)
    on_replicas = read and core.read_from_replicas
    wave = op_wave(
        core.cluster,
        [*commands, *waits],
        policy,
        read=on_replicas,
        pick=core.pick(),
        spread=core.read_from == "spread",
    )
    return (yield from (_watch_waits(core, wave, len(waits)) if waits else wave))


def _waits(core: ClusterCore, commands: Sequence[SlotCommand]) -> list[SlotCommand]:
    """With ``core.wait_replicas``: one ``WAIT`` per node a wave writes to, sent after its
    commands in the same pipeline (routed by one of the node's slots). Calls of ``no-writes``
    scripts and plain reads write nothing."""
    if not core.wait_replicas:
        return []
    registry = core.registry
    reads = {
        registry[n].sha
        for n in registry.names()
        if b"no-writes" in registry[n].source.split(b"\n", 1)[0]
    }
    slots = [
        c.slot
        for c in commands
        if _name(c.args[0]) not in _READS
        and not (_name(c.args[0]) == b"EVALSHA" and c.args[1] in reads)
    ]
    slot_map = core.cluster.slot_map
    by_node: dict[object, int] = {}
    for slot in slots:
        try:
            by_node[slot_map.primary(slot) if slot_map else slot] = slot
        except BackendUnavailableError:  # no node serves it (yet): op_wave retries it
            by_node[slot] = slot
    wait = ("WAIT", core.wait_replicas, core.wait_timeout_ms)
    return [SlotCommand(slot, wait) for slot in by_node.values()]


def _name(arg: Any) -> bytes:
    return (arg.encode() if isinstance(arg, str) else bytes(arg)).upper()


def _watch_waits(core: ClusterCore, wave: WaveOp[list[Any]], waits: int) -> WaveOp[list[Any]]:
    """Run a wave whose last ``waits`` commands are ``WAIT`` s (:func:`_waits`); the replies of
    the others.

    Raises BackendUnavailableError when a ``WAIT`` saw fewer replicas than asked, or when a
    node's pipeline came back split (:func:`_split_by_wait`): the wave then sends the writes or
    the ``WAIT`` again without the other, and nothing tells whether replicas hold the writes.
    """
    unconfirmed = False
    try:
        request = next(wave)
        while True:
            reply = yield request
            if isinstance(request, Wave):
                unconfirmed = unconfirmed or any(
                    _split_by_wait(batch.commands, replies)
                    for batch, replies in zip(request.batches, reply, strict=True)
                )
            request = wave.send(reply)
    except StopIteration as stop:
        replies = list(stop.value)
    finally:
        wave.close()
    waited = replies[len(replies) - waits :]
    refused = next((r for r in waited if isinstance(r, Failure)), None)
    acked = 0 if refused else min((int(r) for r in waited), default=0)
    if unconfirmed or refused or acked < core.wait_replicas:
        if unconfirmed:
            seen = "a node's pipeline came back split between the write and its WAIT"
        elif refused is not None:  # e.g. the node was demoted to a replica meanwhile
            seen = f"its WAIT failed ({refused.message})"
        else:
            seen = (
                f"{acked} of the {core.wait_replicas} replicas it waits for acknowledged it within "
                f"{core.wait_timeout_ms} ms"
            )
        raise BackendUnavailableError(
            f"{core.wave_policy.server}: a write is applied on its primary, but {seen}: it may "
            "be lost in a failover (sending it again is safe)"
        )
    return replies[: len(replies) - waits]


def _split_by_wait(commands: Sequence[Sequence[Any]], replies: Sequence[Any]) -> bool:
    """Whether a node's pipeline that ends with ``WAIT`` came back split: the ``WAIT`` is to
    be sent again (the node failed after answering the writes) but not every write is, or
    some write is (a redirection, a transient error, a lost connection) but the ``WAIT`` is
    not."""
    waited, written = False, []
    for command, reply in zip(commands, replies, strict=True):
        name = _name(command[0])
        if name == b"WAIT":
            waited = _resent(reply)
        elif name not in (b"ASKING", b"READONLY"):
            written.append(_resent(reply) or migrating(command, reply))
    has_wait = any(_name(c[0]) == b"WAIT" for c in commands)
    return has_wait and (not all(written) if waited else any(written))


def _resent(reply: Any) -> bool:
    """Whether :func:`~kvredis.redis.cluster.routing.op_wave` sends a command again after
    this reply."""
    if isinstance(reply, ConnectionLost):
        return True
    if not isinstance(reply, ErrorReply):
        return False
    return reply.code in TRANSIENT_CLUSTER_REPLIES or parse_redirect(reply.message) is not None


def on_shards(
    core: ClusterCore,
    factories: Mapping[int, Callable[[CoreState], Op[T]]],
    read: bool = False,
) -> WaveOp[dict[int, T]]:
    ops = {shard: core.run(shard, factory) for shard, factory in factories.items()}
    return (yield from op_parallel(core, ops, read))


def on_every_shard(
    core: ClusterCore, factory: Callable[[CoreState], Op[T]], read: bool = False
) -> WaveOp[dict[int, T]]:
    return (yield from on_shards(core, dict.fromkeys(range(core.count), factory), read))


def slot_command(core: ClusterCore, slot: int, *args: Any) -> WaveOp[Any]:
    (reply,) = yield from op_wave(core.cluster, [SlotCommand(slot, args)], core.wave_policy)
    return wave_reply(reply)


def wave_reply(reply: Any) -> Any:
    """A reply of a wave, or its error raised (op_wave retried what can be retried)."""
    if isinstance(reply, Failure):
        raise translate(reply.message)
    return reply


def group_by_node(
    core: ClusterCore, shards: Iterable[int], node_of: Callable[[int], Any]
) -> tuple[dict[Any, list[int]], list[int]]:
    """The shards grouped by the node ``node_of(slot)`` names, and those whose slot the cached
    slot map has no node for (they take the per-shard path, which refreshes the map)."""
    by_node: dict[Any, list[int]] = {}
    unmapped: list[int] = []
    for shard in shards:
        try:
            by_node.setdefault(node_of(core.slots[shard]), []).append(shard)
        except BackendUnavailableError:
            unmapped.append(shard)
    return by_node, unmapped


# -- connecting --------------------------------------------------------------------------------


def op_cluster_connect(core: ClusterCore, strict: bool = False, create: bool = True) -> WaveOp[int]:
    """Fetch the slot map, read (or create) the namespace's descriptor (its layout and shard
    count: :class:`~kvredis.redis.cluster.shards.Descriptor`), learn how expiring
    entries expire, load every shard's namespace, and check every primary's eviction policy
    (:func:`~kvredis.redis.ops.check_eviction_policy`: ``allkeys-*`` warns, or with ``strict``
    raises); the shard count. With ``create=False`` a namespace without a descriptor raises
    :class:`~kvredis.errors.NamespaceMissingError` instead of being created."""
    desc = descriptor_key(core.namespace)
    slot = shard_slot(desc.decode())
    read = [SlotCommand(slot, ("HMGET", desc, "layout", "shards"))]
    replies = yield from op_wave(
        core.cluster, [*read, SlotCommand(slot, ("INFO", "server"))], core.wave_policy
    )
    info = replies[-1]
    found = parse_descriptor(wave_reply(replies[0]), core.namespace)
    if found is None and not create:
        raise NamespaceMissingError(f"cluster namespace {core.namespace!r} does not exist")
    if found is None and core.wait_for_namespace > 0:  # its creator makes it: wait
        found = yield from _op_wait_for_descriptor(core, read)
    if found is None:  # written only when missing: a reader starts on a full node
        replies = yield from op_wave(
            core.cluster,
            [
                SlotCommand(slot, ("HSETNX", desc, "shards", core.configured_shards)),
                SlotCommand(slot, ("HSETNX", desc, "layout", CLUSTER_LAYOUT)),
                *read,
            ],
            core.wave_policy,
        )
        refusal = next((r for r in replies if isinstance(r, Failure)), None)
        if refusal is not None and refused_by_acl(refusal.message):
            stand_in = CoreState(core.namespace)
            stand_in.address = core.wave_policy.server
            raise namespace_missing_error(stand_in, refusal.message)
        found = parse_descriptor([wave_reply(r) for r in replies][-1], core.namespace)
        assert found is not None  # just written
    if not isinstance(info, Failure):
        core.expiry_mode = expiry_mode_of(info)
    core.descriptor = found
    core.descriptor_read_at = core.clock()
    count = found.shards
    core.adopt(count)
    for session in core.sessions:
        session.state.expiry_mode = core.expiry_mode
    yield from op_load_scripts(core)
    ops = {
        shard: op_drive(session, op_load_namespace(session.state, False, session.registry.api))
        for shard, session in enumerate(core.sessions)
    }
    yield from op_parallel(core, ops)
    assert core.cluster.slot_map is not None  # fetched by the first wave
    primaries = core.cluster.slot_map.primaries
    infos = yield Wave(tuple(NodeBatch(node, (("INFO", "memory"),)) for node in primaries))
    for node, (info,) in zip(primaries, infos, strict=True):
        if isinstance(info, Failure):  # INFO not permitted, or the node is gone: no check
            logger.debug("cannot read INFO memory from %s: %s", node, info.message)
        else:
            check_eviction_policy(info, f"primary {node} of {core.wave_policy.server}", strict)
    return count


def _op_wait_for_descriptor(core: ClusterCore, read: list[SlotCommand]) -> WaveOp[Descriptor]:
    """Read the descriptor until it exists, for at most ``core.wait_for_namespace`` seconds
    (as :func:`~kvredis.redis.ops.op_load_namespace` waits on one server)."""
    waited, pause = 0.0, WAIT_FIRST_S
    logger.info(
        "cluster namespace %r does not exist yet: waiting up to %g s for its creator",
        core.namespace,
        core.wait_for_namespace,
    )
    while True:
        step = min(pause, core.wait_for_namespace - waited)
        if step <= 0:
            stand_in = CoreState(core.namespace)
            stand_in.wait_for_namespace = core.wait_for_namespace
            stand_in.address = core.wave_policy.server
            raise namespace_missing_error(stand_in, None)
        yield Sleep(step)
        waited += step
        pause = min(WAIT_LONGEST_S, pause * 2)
        replies = yield from op_wave(core.cluster, read, core.wave_policy)
        found = parse_descriptor(wave_reply(replies[0]), core.namespace)
        if found is not None:
            return found


def op_load_scripts(core: ClusterCore) -> WaveOp[None]:
    """Decide how calls are sent, on every primary of the slot map (the registry's
    ``op_choose``: the ``kvredis`` function library, loaded where it is missing or older, its
    replicas get it by replication), then, when calls go by EVALSHA, load every script on every
    node in one wave. Best effort: a node that fails now gets the library or its scripts on its
    first miss, so first calls cost one round trip."""
    slot_map = core.cluster.slot_map
    if slot_map is None:
        return
    registry = core.registry
    # a shard each primary serves: its namespace records the newest api of its clients
    states: dict[Any, CoreState] = {}
    for shard, slot in enumerate(core.slots):
        with contextlib.suppress(BackendUnavailableError):
            states.setdefault(slot_map.primary(slot), core.state(shard))
    for node in slot_map.primaries:
        try:
            server = f"primary {node} of {core.policy.server}"
            yield from op_on_node(node, registry.op_choose(server, states.get(node)))
        except BackendUnavailableError as exc:
            logger.debug("cannot check the function library on %s: %s", node, exc)
    if registry.active:
        return
    loads = tuple(registry.load_command(name).args for name in registry.names())
    yield Wave(tuple(NodeBatch(node, loads) for node in slot_map.nodes))


def op_on_node(node: Any, op: Op[T]) -> WaveOp[T]:
    """Run ``op`` (plain commands only) against one node; error replies are thrown into it as
    :mod:`kvredis.errors` exceptions carrying the reply (as :func:`~kvredis.redis.session.op_drive`
    throws them), a lost node as BackendUnavailableError."""
    try:
        request = next(op)
        while True:
            if not isinstance(request, Command):
                raise TypeError(f"only commands can be sent to one node, got {request!r}")
            ((reply,),) = yield Wave((NodeBatch(node, (request.args,)),))
            if isinstance(reply, ErrorReply):
                request = op.throw(typed_error(reply))
            elif isinstance(reply, Failure):
                request = op.throw(BackendUnavailableError(f"{node}: {reply.message}"))
            else:
                request = op.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        op.close()

"""Node calls: one script call that carries the work of every shard one node holds (sans-IO).

A read or write of a cluster namespace touches some shards; the shards one node holds go in one
script call to that node (``score_shards``, ``lookup_union``, ``apply_parts``: the single-server
Lua code run per shard), every node's call in one wave, so an operation costs one round trip
and one script call per involved node. The calls are grouped by the cached slot map and sent
without retries or redirections (:attr:`~.core.ClusterCore.fast_policy`): a call that meets a
redirection, a failure or a missing script comes back as ``None``, and the operation sends the
work of its shards again by the per-shard path (the single-server operations run on each shard
with their retries, redirections and reloads: :func:`~.core.on_shards`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvredis.errors import BackendUnavailableError
from kvredis.redis.cluster.core import ClusterCore, write_wave
from kvredis.redis.cluster.routing import (
    TRANSIENT_CLUSTER_REPLIES,
    NodeBatch,
    SlotCommand,
    Wave,
    WaveOp,
    non_local_key,
    op_refresh,
    op_wave,
)
from kvredis.redis.cluster.topology import ClusterNode, SlotMap
from kvredis.redis.requests import TRANSIENT_REPLIES, ErrorReply, Failure, ScriptCall
from kvredis.redis.session import typed_error


@dataclass(frozen=True, slots=True)
class NodeCall:
    """One script call to the node holding ``slot``; ``items`` say what each element of its
    reply is about (a shard, a part: the caller's own values, in reply order). A ``single``
    call runs one single-server script whose reply is one item: its reply (or the Lua error
    that stopped it) comes back as a one-element list."""

    slot: int
    call: ScriptCall
    items: tuple[Any, ...]
    single: bool = False
    #: the node it goes to (None: the slot map's node for ``slot``, found when sending)
    node: ClusterNode | None = None


def group_shards(
    core: ClusterCore, shards: Iterable[int], node_of: Callable[[int], ClusterNode]
) -> tuple[dict[ClusterNode, list[int]], list[int]]:
    """The shards grouped by the node ``node_of(slot)`` names, in the order given, and those
    whose slot the cached slot map has no node for (they take the per-shard path, which
    refreshes the map)."""
    by_node: dict[ClusterNode, list[int]] = {}
    unmapped: list[int] = []
    for shard in shards:
        try:
            by_node.setdefault(node_of(core.slots[shard]), []).append(shard)
        except BackendUnavailableError:
            unmapped.append(shard)
    return by_node, unmapped


def op_slot_map(core: ClusterCore) -> WaveOp[SlotMap]:
    """The cached slot map (fetched when there is none yet)."""
    return core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))


def _part_error(reply: ErrorReply) -> bool:
    """Whether an error reply of a single-server script is its own (it stopped that script
    before its first write: a Lua error, a foreign key), not the node's or the call's."""
    message = reply.message
    return message.startswith(("KVREDIS_", "WRONGTYPE")) and not non_local_key(reply)


def op_node_calls(
    core: ClusterCore, calls: Sequence[NodeCall], read: bool = False, pick: int = 0
) -> WaveOp[list[list[Any] | None]]:
    """Send ``calls`` in one wave, each to its slot's node (a read: the node
    :meth:`~.core.ClusterCore.reader` picks for ``pick``); per call its reply (a list), or
    ``None`` where the call did not get through (a redirection, a node in trouble, a script or
    function the node lacks: it is loaded there for next time). Any other error reply is
    raised as its :mod:`kvredis.errors` exception."""
    on_replicas = read and core.read_from_replicas
    if all(c.node is not None for c in calls) and (read or not core.wait_replicas):
        replies = yield from _op_direct(core, calls, on_replicas)
    else:
        replies = yield from _op_routed(core, calls, read, pick)
    if replies is None:
        return [None] * len(calls)
    return (yield from _take(core, calls, replies, on_replicas, pick))


def _op_direct(
    core: ClusterCore, calls: Sequence[NodeCall], on_replicas: bool
) -> WaveOp[list[Any] | None]:
    """One wave of ``calls`` to the nodes they name, as they are (a replica's pipeline opens
    with ``READONLY``); the replies in order."""
    batches: dict[ClusterNode, list[Any]] = {}
    positions: dict[ClusterNode, list[int]] = {}
    replicas: frozenset[ClusterNode] = frozenset()
    if on_replicas and core.cluster.slot_map is not None:
        replicas = core.cluster.slot_map.replica_nodes
    for position, call in enumerate(calls):
        node = call.node
        assert node is not None
        if node not in batches:
            batches[node] = [("READONLY",)] if node in replicas else []
            positions[node] = []
        batches[node].append(core.registry.call_command(call.call).args)
        positions[node].append(position)
    wave = Wave(tuple(NodeBatch(node, tuple(cmds)) for node, cmds in batches.items()))
    answered = yield wave
    replies: list[Any] = [None] * len(calls)
    for node, node_replies in zip(batches, answered, strict=True):
        offset = len(node_replies) - len(positions[node])
        if offset and isinstance(node_replies[0], Failure):
            return None  # READONLY refused: the node is in trouble (the per-shard path)
        for position, reply in zip(positions[node], node_replies[offset:], strict=True):
            replies[position] = reply
    return replies


def _op_routed(
    core: ClusterCore, calls: Sequence[NodeCall], read: bool, pick: int
) -> WaveOp[list[Any] | None]:
    """One wave of ``calls`` routed by their slots (a write ending with ``WAIT`` when the
    client waits for replicas); None when the wave failed as a whole."""
    commands = [SlotCommand(c.slot, core.registry.call_command(c.call).args) for c in calls]
    on_replicas = read and core.read_from_replicas
    try:
        if read:
            replies = yield from op_wave(
                core.cluster,
                commands,
                core.fast_policy,
                read=on_replicas,
                pick=pick,
                spread=core.read_from == "spread",
            )
        else:
            replies = yield from write_wave(core, commands, core.fast_policy)
    except BackendUnavailableError:  # a redirection, a node in trouble, a WAIT short of
        return None  # replicas: the per-shard path (which waits too)
    return list(replies)


def _take(
    core: ClusterCore,
    calls: Sequence[NodeCall],
    replies: Sequence[Any],
    on_replicas: bool,
    pick: int,
) -> WaveOp[list[list[Any] | None]]:
    """Each call's reply as a list, None where the call did not get through; loads what a node
    lacked."""
    out: list[list[Any] | None] = []
    reload: list[NodeCall] = []
    for call, reply in zip(calls, replies, strict=True):
        missing = core.registry.missing(reply)
        if isinstance(reply, ErrorReply) and call.single and _part_error(reply) and not missing:
            out.append([reply.message])
        elif isinstance(reply, list):
            out.append(reply if not call.single else [reply])
        elif call.single and not isinstance(reply, Failure) and reply is not None:
            out.append([reply])
        elif isinstance(reply, ErrorReply):
            if missing:
                reload.append(call)
            elif (
                reply.code not in TRANSIENT_REPLIES
                and reply.code not in TRANSIENT_CLUSTER_REPLIES
                and not reply.message.startswith(("MOVED", "ASK"))
                and not non_local_key(reply)
            ):
                raise typed_error(reply)
            out.append(None)
        else:
            out.append(None)
    if reload and not core.registry.active:  # the library: each shard's call settles it
        loads = [core.registry.load_command(c.call.script, c.call.read) for c in reload]
        yield from op_wave(
            core.cluster,
            [SlotCommand(c.slot, load.args) for c, load in zip(reload, loads, strict=True)],
            core.wave_policy,
            read=on_replicas and loads[0].read,  # a function library loads on the primary
            pick=pick,
            spread=core.read_from == "spread",
        )
    return out

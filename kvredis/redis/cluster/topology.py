"""The slot map of a cluster: which node serves which slots, and keys grouped by node.

:class:`SlotMap` holds the primary and the replicas of every slot range. It is parsed from the
reply of ``CLUSTER SHARDS`` (Redis 7+, Valkey: :func:`parse_cluster_shards`) or, on servers
without it, ``CLUSTER SLOTS`` (:func:`parse_cluster_slots`); :func:`op_slot_map` asks one node
with the first and falls back to the second. Replies are accepted raw (flat RESP2 arrays) and as
a client library parses them (mappings), with bytes or str fields.

A node is known by its address: a node named by a MOVED reply (no id) is the same node as the
one ``CLUSTER SHARDS`` listed with its id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvredis.errors import BackendError, BackendUnavailableError
from kvredis.redis.cluster.slots import SLOT_COUNT, key_slot
from kvredis.redis.requests import Command, ErrorReply, Op, error_reply

#: Endpoints a node reports when it does not know its own address (use the host asked).
_UNKNOWN_HOSTS = frozenset({"", "?"})


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One node of a cluster, by address (``node_id`` is informative: not compared)."""

    host: str
    port: int
    node_id: str = field(default="", compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.host, self.port)))

    def __hash__(self) -> int:  # nodes key the dicts every wave builds: hashed once
        return self._hash

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class SlotRange:
    """Slots ``start..end`` (inclusive), served by ``primary``; ``replicas`` are those healthy
    enough to read from."""

    start: int
    end: int
    primary: ClusterNode
    replicas: tuple[ClusterNode, ...] = ()


class SlotMap:
    """Which node serves each of the 16384 slots.

    Ranges must not overlap; slots no range covers are *missing* (the cluster is not fully
    covered, or the reply was taken in the middle of a change): asking for their node raises
    :class:`~kvredis.errors.BackendUnavailableError`.
    """

    __slots__ = ("_by_slot", "ranges", "replica_nodes")

    def __init__(self, ranges: Iterable[SlotRange]) -> None:
        self.ranges: tuple[SlotRange, ...] = tuple(sorted(ranges, key=lambda r: r.start))
        by_slot: list[SlotRange | None] = [None] * SLOT_COUNT
        for slot_range in self.ranges:
            if not 0 <= slot_range.start <= slot_range.end < SLOT_COUNT:
                raise BackendError(
                    f"slot range {slot_range.start}-{slot_range.end} is outside 0-{SLOT_COUNT - 1}"
                )
            for slot in range(slot_range.start, slot_range.end + 1):
                if by_slot[slot] is not None:
                    raise BackendError(f"slot {slot} is claimed by two ranges of the slot map")
                by_slot[slot] = slot_range
        self._by_slot = by_slot
        #: every replica node of the map
        self.replica_nodes = frozenset(node for r in self.ranges for node in r.replicas)

    def range_of(self, slot: int) -> SlotRange:
        """The range holding ``slot`` (BackendUnavailableError if no node serves it)."""
        found = self._by_slot[slot]
        if found is None:
            raise BackendUnavailableError(
                f"no node of the cluster serves slot {slot} (the cluster is not fully covered)"
            )
        return found

    def primary(self, slot: int) -> ClusterNode:
        """The primary serving ``slot``."""
        return self.range_of(slot).primary

    def reader(self, slot: int, pick: int = 0, spread: bool = False) -> ClusterNode:
        """A node to read ``slot`` from: replica number ``pick`` (modulo their number), or the
        primary when the slot has no healthy replica; with ``spread``, node number ``pick`` of
        the primary and its healthy replicas."""
        slot_range = self.range_of(slot)
        replicas = slot_range.replicas
        if spread:
            index = pick % (len(replicas) + 1)
            return replicas[index - 1] if index else slot_range.primary
        if not replicas:
            return slot_range.primary
        return replicas[pick % len(replicas)]

    @property
    def primaries(self) -> tuple[ClusterNode, ...]:
        """Every primary serving slots, once each, in slot order."""
        return tuple(dict.fromkeys(r.primary for r in self.ranges))

    @property
    def nodes(self) -> tuple[ClusterNode, ...]:
        """Every node of the map (primaries, then replicas), once each."""
        replicas = (node for r in self.ranges for node in r.replicas)
        return tuple(dict.fromkeys((*self.primaries, *replicas)))

    def missing(self) -> list[tuple[int, int]]:
        """The slot ranges no node serves, as inclusive ``(start, end)`` pairs."""
        gaps: list[tuple[int, int]] = []
        start: int | None = None
        for slot, owner in enumerate(self._by_slot):
            if owner is None and start is None:
                start = slot
            elif owner is not None and start is not None:
                gaps.append((start, slot - 1))
                start = None
        if start is not None:
            gaps.append((start, SLOT_COUNT - 1))
        return gaps

    @property
    def complete(self) -> bool:
        """Whether every slot is served."""
        return all(owner is not None for owner in self._by_slot)

    def group(
        self, keys: Sequence[bytes | str], *, read: bool = False, pick: int = 0
    ) -> dict[ClusterNode, list[int]]:
        """The positions of ``keys`` grouped by the node that serves them.

        Nodes come in the order of their first key, positions in ascending order, so a chain of
        keys split over nodes keeps its order on every node. ``read=True`` sends each slot to
        :meth:`reader` (a replica when there is one) instead of its primary.
        """
        return self.group_slots([key_slot(key) for key in keys], read=read, pick=pick)

    def group_slots(
        self, slots: Sequence[int], *, read: bool = False, pick: int = 0
    ) -> dict[ClusterNode, list[int]]:
        """:meth:`group` for keys whose slots are already known."""
        groups: dict[ClusterNode, list[int]] = {}
        for position, slot in enumerate(slots):
            node = self.reader(slot, pick) if read else self.primary(slot)
            groups.setdefault(node, []).append(position)
        return groups

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlotMap):
            return NotImplemented
        return self.ranges == other.ranges

    def __hash__(self) -> int:
        return hash(self.ranges)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{r.start}-{r.end}: {r.primary}" + "".join(f" +{n}" for n in r.replicas)
            for r in self.ranges
        )
        return f"SlotMap({shown})"


# -- parsing -----------------------------------------------------------------------------------


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _fields(value: Any, what: str) -> dict[str, Any]:
    """A reply element that is a map (a mapping, or a flat key/value array) as a str dict."""
    if isinstance(value, Mapping):
        return {_text(k): v for k, v in value.items()}
    if isinstance(value, (list, tuple)) and len(value) % 2 == 0:
        return {_text(value[i]): value[i + 1] for i in range(0, len(value), 2)}
    raise BackendError(f"malformed {what} in a CLUSTER reply: {value!r}")


def _int(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BackendError(f"malformed {what} in a CLUSTER reply: {value!r}") from None


def _host(reported: Any, replied_host: str) -> str:
    text = "" if reported is None else _text(reported)
    return replied_host if text in _UNKNOWN_HOSTS else text


def parse_cluster_shards(reply: Any, replied_host: str, tls: bool = False) -> SlotMap:
    """The slot map in a ``CLUSTER SHARDS`` reply, asked of a node at ``replied_host``.

    Each node is addressed by its ``endpoint`` (else its ``ip``; a node that does not know its
    address means ``replied_host``), and its ``tls-port`` when ``tls`` (else ``port``). A
    shard's primary is its ``master`` node (an online one if there are several); its replicas
    are the ``replica`` nodes whose health is ``online`` (those loading or failed are left out).
    A shard without a primary leaves its slots missing.
    """
    if not isinstance(reply, (list, tuple)):
        raise BackendError(f"malformed CLUSTER SHARDS reply: {reply!r}")
    ranges: list[SlotRange] = []
    for shard_value in reply:
        shard = _fields(shard_value, "shard")
        slots = [_int(s, "slot") for s in shard.get("slots") or ()]
        primaries: list[tuple[bool, ClusterNode]] = []
        replicas: list[ClusterNode] = []
        for node_value in shard.get("nodes") or ():
            info = _fields(node_value, "shard node")
            host = _host(info.get("endpoint"), "") or _host(info.get("ip"), replied_host)
            port_value = info.get("tls-port") if tls and info.get("tls-port") else info.get("port")
            node = ClusterNode(host, _int(port_value, "port"), _text(info.get("id", "")))
            online = _text(info.get("health", "online")) == "online"
            if _text(info.get("role")) == "master":
                primaries.append((online, node))
            elif online:
                replicas.append(node)
        if not primaries or len(slots) % 2:
            continue
        primary = next((node for online, node in primaries if online), primaries[0][1])
        for i in range(0, len(slots), 2):
            ranges.append(SlotRange(slots[i], slots[i + 1], primary, tuple(replicas)))
    return SlotMap(ranges)


def parse_cluster_slots(reply: Any, replied_host: str) -> SlotMap:
    """The slot map in a ``CLUSTER SLOTS`` reply, asked of a node at ``replied_host``.

    Every element is ``start, end, primary, replica...``, each node as ``host, port, id[,
    metadata]``; an empty or ``?`` host means ``replied_host``. CLUSTER SLOTS says nothing of
    replica health: every replica listed counts.
    """
    if not isinstance(reply, (list, tuple)):
        raise BackendError(f"malformed CLUSTER SLOTS reply: {reply!r}")
    ranges: list[SlotRange] = []
    for element in reply:
        if not isinstance(element, (list, tuple)) or len(element) < 3:
            raise BackendError(f"malformed CLUSTER SLOTS element: {element!r}")
        nodes: list[ClusterNode] = []
        for node_value in element[2:]:
            if not isinstance(node_value, (list, tuple)) or len(node_value) < 2:
                raise BackendError(f"malformed node in a CLUSTER SLOTS element: {node_value!r}")
            node_id = _text(node_value[2]) if len(node_value) > 2 else ""
            port = _int(node_value[1], "port")
            nodes.append(ClusterNode(_host(node_value[0], replied_host), port, node_id))
        start, end = _int(element[0], "slot"), _int(element[1], "slot")
        ranges.append(SlotRange(start, end, nodes[0], tuple(nodes[1:])))
    return SlotMap(ranges)


def op_slot_map(replied_host: str, tls: bool = False) -> Op[SlotMap]:
    """Ask one node for the slot map: ``CLUSTER SHARDS``, or ``CLUSTER SLOTS`` where the
    server does not know SHARDS (before Redis 7)."""
    try:
        reply = yield Command(("CLUSTER", "SHARDS"))
    except (ErrorReply, BackendError) as failure:
        reply = error_reply(failure)  # "ERR unknown subcommand": a server before CLUSTER SHARDS
        if reply is None or "unknown" not in reply.message.lower():
            raise
        return parse_cluster_slots((yield Command(("CLUSTER", "SLOTS"))), replied_host)
    return parse_cluster_shards(reply, replied_host, tls)

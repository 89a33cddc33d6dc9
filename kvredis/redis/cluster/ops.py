"""The index operations on a cluster, as sans-IO wave operations (see :mod:`.routing`).

A cluster namespace is a set of shards (:mod:`.shards`), each a complete single-server
namespace living in one slot. An operation splits its keys by shard and groups the shards by
node: lookups and writes send one script call per node (``lua/lookup_shards.lua``,
``lua/apply_shards.lua``: the single-server Lua code run per shard), all nodes in one
:class:`~kvredis.redis.cluster.routing.Wave`, so a wave costs one round trip and one script
call per involved node (:func:`op_shard_lookups`, :func:`op_node_writes`). Where the cached slot
map is out of date, or a shard stale, those shards take the per-shard path: the single-server
operation (:mod:`kvredis.redis.ops`, unchanged, with its NOSCRIPT reload, retries and stale
reload) on each shard, run in lockstep by :func:`op_parallel`. The other operations (clear,
drop, watermarks, request keys) always take it.

- lookup: every shard walks its part of the chain (in chain order) and stops at its first
  miss; the merge walks the whole chain and stops at the first key no shard reported. Exact,
  because a shard reports every hit before its own first miss. A long chain goes in waves:
  one node's call walks at most ``LOOKUP_KEYS_PER_CALL`` keys, and a shard's next part is sent
  only while its keys hit and come before the first miss found so far.
- score: the lookup, then :class:`~kvredis.scoring.LongestPrefixScorer` on the client (the same
  floats as the server-side scorer).
- add: request keys go to their shards, each engine -> request mapping to the engine key's
  shard (so the most recent mapping of an engine key is decided in one place).
- evict by engine key: read the mapping (engine key's shard), evict from each request key
  (request keys' shards) and probe whether each still holds an entry, then drop the mapping
  with a compare-and-delete (``unmap``) if none does. Three waves instead of one atomic step.
- apply_batch: the batch is cut into steps (runs of adds and request-key evicts; runs of
  engine-key evicts). With a watermark, every shard gets the first step as part 1 of a
  fenced batch (the fence of ``lua/apply_batch.lua``, in ``lua/includes/fence.lua``): a shard
  whose watermark is at or past the batch skips it, and later steps run only on the shards
  that took it. A batch with more than one
  step ends with an empty last part that advances each shard's watermark, so a batch cut short
  (a crash) is taken again in full by the next sender (its operations are set operations).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark, check_batch, check_stream
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    EntrySelection,
    check_add,
    check_entries,
    check_hash,
    check_key_type,
    check_pod_identifier,
    check_ttl,
    infer_mappings,
    pod_filter,
)
from kvredis.errors import (
    BackendOutOfMemoryError,
    BackendUnavailableError,
    CallBudgetError,
    InvalidInputError,
    NamespaceMissingError,
    translate,
)
from kvredis.index import ClearProgress
from kvredis.redis.cluster.redirect import parse_redirect
from kvredis.redis.cluster.routing import (
    NON_LOCAL_KEY,
    TRANSIENT_CLUSTER_REPLIES,
    ClusterState,
    NodeBatch,
    SlotCommand,
    Wave,
    WaveOp,
    WavePolicy,
    migrating,
    non_local_key,
    op_refresh,
    op_wave,
)
from kvredis.redis.cluster.shards import (
    CLUSTER_LAYOUT,
    check_cluster_namespace,
    check_shards,
    descriptor_key,
    parse_descriptor,
    shard_names,
    shard_of,
    shard_slot,
    shards_of,
)
from kvredis.redis.codec import blob_hashes, hash_blob, hash_field, pack_hashes
from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    Layout,
    check_bucket_bits,
    check_namespace,
    expiring_item_deadline,
)
from kvredis.redis.ops import (
    DEFAULT_CLEAR_FIELDS_PER_CALL,
    LOOKUP_KEYS_PER_CALL,
    add_call,
    batch_call,
    batch_fence,
    expiry_mode_of,
    op_clear_passes,
    op_drop_namespace,
    op_evict,
    op_get_request_key,
    op_get_watermark,
    op_load_namespace,
    op_lookup,
    op_parts,
    op_reclaim,
    op_reset_watermark,
    op_run,
    pod_args,
    read_lookup_reply,
    score_weights,
    walk_cut,
)
from kvredis.redis.program import (
    CALL_BUDGET,
    Program,
    Unit,
    compress_pairs,
    program_of,
    programs_of,
    split_add,
)
from kvredis.redis.requests import (
    Command,
    ConnectionLost,
    ErrorReply,
    Failure,
    Op,
    Pipeline,
    ScriptCall,
    Sleep,
)
from kvredis.redis.scripts import ScriptRegistry
from kvredis.redis.session import (
    TRANSIENT_REPLIES,
    RetryPolicy,
    Session,
    check_eviction_policy,
    op_drive,
)
from kvredis.redis.state import CoreState, EntryCache
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import Entries, Keys, KeyType, PodEntry

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: Engine keys whose mappings one ``unmap`` call drops at most.
UNMAP_PER_CALL = 256
#: Engine buckets one page of the clear's mapping pass reads.
MAPPING_PAGE = 64


class ClusterCore:
    """What one cluster index client carries: the cluster's state and its namespace's shards.

    Shared by the client's threads: the shards' states are thread-safe, the rest is set once
    when connecting.
    """

    def __init__(
        self,
        namespace: str,
        bucket_bits: int,
        shards: int,
        cluster: ClusterState,
        wave_policy: WavePolicy,
        policy: RetryPolicy,
        read_from_replicas: bool = False,
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
        self.read_from_replicas = read_from_replicas
        #: replicas every write waits for (``WAIT``; 0: none), and for how long at most
        self.wait_replicas = 0
        self.wait_timeout_ms = 1000
        self.expiry_mode = "key"
        self.sessions: list[Session] = []
        self.slots: list[int] = []
        self._picks = itertools.count()

    @property
    def count(self) -> int:
        """The number of shards (after connecting)."""
        return len(self.sessions)

    def adopt(self, count: int) -> None:
        """Set up the ``count`` shards of the namespace."""
        if self.sessions and len(self.sessions) == count:
            return
        sessions, slots = [], []
        for name in shard_names(self.namespace, count):
            state = CoreState(name, self.bucket_bits)
            state.expiry_mode = self.expiry_mode
            sessions.append(Session(state, self.registry, self.policy))
            slots.append(shard_slot(name))
        self.sessions, self.slots = sessions, slots

    def shard(self, key: int) -> int:
        """The shard of a request or engine key."""
        return shard_of(key, len(self.sessions))

    def state(self, shard: int) -> CoreState:
        """The namespace state of one shard."""
        return self.sessions[shard].state

    def run(self, shard: int, factory: Callable[[CoreState], Op[T]]) -> Op[T]:
        """``factory(state)`` on one shard, with namespace loading and stale reloads."""
        session = self.sessions[shard]
        return op_run(session, lambda: factory(session.state))

    def by_shard(self, keys: Iterable[int]) -> dict[int, list[int]]:
        """``keys`` grouped by shard, each group in the order given."""
        ordered = list(keys)
        groups: dict[int, list[int]] = {}
        for key, shard in zip(ordered, shards_of(ordered, len(self.sessions)), strict=True):
            groups.setdefault(shard, []).append(key)
        return groups

    def home(self, stream: str) -> int:
        """The shard whose fence decides a stream's batches."""
        digest = hashlib.blake2b(stream.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return self.shard(int.from_bytes(digest, "big"))

    def pick(self) -> int:
        """A different replica index for each read (spreads reads over replicas)."""
        return next(self._picks)


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
            replies = yield from _write_wave(core, commands, core.wave_policy, read)
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
        b"HGET", b"HMGET", b"HEXISTS", b"HGETALL", b"SCAN", b"INFO", b"PING", b"SCRIPT", b"TIME",
        b"FCALL_RO",
    }
)


def _write_wave(
    core: ClusterCore, commands: Sequence[SlotCommand], policy: WavePolicy, read: bool = False
) -> WaveOp[list[Any]]:
    """One wave of ``commands``; the replies. A read wave goes to replicas when the client
    reads from replicas; any other ends each written primary's pipeline with ``WAIT`` when the
    client waits for replicas (:func:`_waits`, :func:`_watch_waits`)."""
    waits = [] if read else _waits(core, commands)
    on_replicas = read and core.read_from_replicas
    wave = op_wave(core.cluster, [*commands, *waits], policy, read=on_replicas, pick=core.pick())
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
    acked = min((int(_reply(r)) for r in replies[len(replies) - waits :]), default=0)
    if unconfirmed or acked < core.wait_replicas:
        seen = (
            "a node's pipeline came back split between the write and its WAIT"
            if unconfirmed
            else (
                f"{acked} of the {core.wait_replicas} replicas it waits for acknowledged it within "
                f"{core.wait_timeout_ms} ms"
            )
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


def _on_shards(
    core: ClusterCore,
    factories: Mapping[int, Callable[[CoreState], Op[T]]],
    read: bool = False,
) -> WaveOp[dict[int, T]]:
    ops = {shard: core.run(shard, factory) for shard, factory in factories.items()}
    return (yield from op_parallel(core, ops, read))


def _everywhere(
    core: ClusterCore, factory: Callable[[CoreState], Op[T]], read: bool = False
) -> WaveOp[dict[int, T]]:
    return (yield from _on_shards(core, dict.fromkeys(range(core.count), factory), read))


def _command(core: ClusterCore, slot: int, *args: Any) -> WaveOp[Any]:
    (reply,) = yield from op_wave(core.cluster, [SlotCommand(slot, args)], core.wave_policy)
    return _reply(reply)


def _reply(reply: Any) -> Any:
    """A reply of a wave, or its error raised (op_wave retried what can be retried)."""
    if isinstance(reply, Failure):
        raise translate(reply.message)
    return reply


# -- connecting --------------------------------------------------------------------------------


def op_cluster_connect(core: ClusterCore, strict: bool = False, create: bool = True) -> WaveOp[int]:
    """Fetch the slot map, read (or create) the namespace's descriptor, learn how expiring
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
    count = parse_descriptor(_reply(replies[0]), core.namespace)
    if count is None and not create:
        raise NamespaceMissingError(f"cluster namespace {core.namespace!r} does not exist")
    if count is None:  # written only when missing: a reader starts on a full node
        replies = yield from op_wave(
            core.cluster,
            [
                SlotCommand(slot, ("HSETNX", desc, "shards", core.configured_shards)),
                SlotCommand(slot, ("HSETNX", desc, "layout", CLUSTER_LAYOUT)),
                *read,
            ],
            core.wave_policy,
        )
        count = parse_descriptor([_reply(r) for r in replies][-1], core.namespace)
        assert count is not None  # just written
    if not isinstance(info, Failure):
        core.expiry_mode = expiry_mode_of(info)
    core.adopt(count)
    for session in core.sessions:
        session.state.expiry_mode = core.expiry_mode
    yield from op_load_scripts(core)
    ops = {
        shard: op_drive(session, op_load_namespace(session.state, ping=False))
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
    for node in slot_map.primaries:
        try:
            yield from op_on_node(
                node, registry.op_choose(f"primary {node} of {core.policy.server}")
            )
        except BackendUnavailableError as exc:
            logger.debug("cannot check the function library on %s: %s", node, exc)
    if registry.active:
        return
    loads = tuple(registry.load(name).args for name in registry.names())
    yield Wave(tuple(NodeBatch(node, loads) for node in slot_map.nodes))


def op_on_node(node: Any, op: Op[T]) -> WaveOp[T]:
    """Run ``op`` (plain commands only) against one node; error replies are thrown into it as
    :mod:`kvredis.errors` exceptions, a lost node as BackendUnavailableError."""
    try:
        request = next(op)
        while True:
            if not isinstance(request, Command):
                raise TypeError(f"only commands can be sent to one node, got {request!r}")
            ((reply,),) = yield Wave((NodeBatch(node, (request.args,)),))
            if isinstance(reply, ErrorReply):
                request = op.throw(translate(reply.message))
            elif isinstance(reply, Failure):
                request = op.throw(BackendUnavailableError(f"{node}: {reply.message}"))
            else:
                request = op.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        op.close()


# -- reads -------------------------------------------------------------------------------------


def op_cluster_lookup(
    core: ClusterCore, request_keys: Keys, pod_identifier_set: Any, shared: bool = False
) -> WaveOp[dict[int, Any]]:
    """``Index.lookup`` over the shards: waves of one ``lookup_shards`` call per involved node
    (:func:`op_shard_lookups`), each call walking at most :data:`LOOKUP_KEYS_PER_CALL` keys
    (its shards share them); a shard's next part is sent only while its keys hit and come
    before the first miss found so far. ``shared``: keys holding the same entries share one
    tuple (for the scorer) instead of a list each."""
    keys, _ = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    if not keys:
        return {}
    shards = shards_of(keys, core.count)
    groups: dict[int, list[int]] = {}
    places: dict[int, list[int]] = {}  # shard -> the chain position of each of its keys
    for place, (key, shard) in enumerate(zip(keys, shards, strict=True)):
        groups.setdefault(shard, []).append(key)
        places.setdefault(shard, []).append(place)
    walked = dict.fromkeys(groups, 0)
    horizon = len(keys)  # the chain position of the first miss found so far
    hits: dict[int, Any] = {}
    while True:
        going = [s for s in groups if walked[s] < len(groups[s]) and places[s][walked[s]] < horizon]
        if not going:
            break
        per = yield from _keys_per_shard(core, going)
        parts = {s: groups[s][walked[s] : walked[s] + per] for s in going}
        found = yield from op_shard_lookups(core, parts, pods, shared)
        for shard, part in parts.items():
            got = found.get(shard, {})  # a key is found only by its own shard
            hits.update(got)
            n = next((i for i, key in enumerate(part) if key not in got), len(part))
            if n < len(part):  # the shard's first miss: the chain ends there at the latest
                horizon = min(horizon, places[shard][walked[shard] + n])
                walked[shard] = len(groups[shard])
            else:
                walked[shard] += n
    merged: dict[int, Any] = {}
    for key in keys:
        entries = hits.get(key)
        if entries is None:
            break
        merged[key] = entries
    return merged


def _keys_per_shard(core: ClusterCore, shards: Sequence[int]) -> WaveOp[int]:
    """How many keys each of ``shards`` may walk in the next wave, so that the shards one node
    holds walk at most :data:`LOOKUP_KEYS_PER_CALL` keys together (at least one each)."""
    slot_map = core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))
    per_node: dict[Any, int] = {}
    for shard in shards:
        try:
            node: Any = slot_map.primary(core.slots[shard])
        except BackendUnavailableError:  # no owner known yet: the per-shard path finds it
            node = None
        per_node[node] = per_node.get(node, 0) + 1
    return max(1, LOOKUP_KEYS_PER_CALL // max(per_node.values()))


def _group_by_node(
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


def op_shard_lookups(
    core: ClusterCore,
    groups: Mapping[int, list[int]],
    pods: frozenset[str] | None,
    shared: bool = False,
) -> WaveOp[dict[int, dict[int, Any]]]:
    """Each shard's part of a chain walked, as ``{shard: {key: entries}}`` (hits up to the
    shard's first miss).

    The shards a node holds are walked by one ``lookup_shards`` call, so a wave costs one script
    call per node, not per shard. The slot map the calls are grouped by may be out of date
    (a slot moved, a failover): a call that meets a redirection or a failure, and a shard
    whose generation changed, are walked again by the per-shard path (:func:`op_parallel`,
    which follows redirections, reloads scripts and namespaces and retries)."""
    read = core.read_from_replicas
    pick = core.pick()
    slot_map = core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))
    by_node, unmapped = _group_by_node(
        core, groups, lambda slot: slot_map.reader(slot, pick) if read else slot_map.primary(slot)
    )
    filter_args = pod_args(pods)
    commands: list[SlotCommand] = []
    plan: list[list[tuple[int, EntryCache]]] = []
    for shards in by_node.values():
        call_keys: list[Any] = []
        call_args: list[Any] = [*filter_args]
        caches = []
        for shard in shards:
            layout, cache = core.state(shard).snapshot()
            names = (layout.meta, layout.pi, layout.pp, layout.sx)
            call_keys = call_keys or list(names)
            call_args += (*names, layout.gen, layout.rprefix, layout.bucket_bits, cache.floor)
            part = groups[shard]  # checked by the caller
            call_args.append(hash_blob(part))
            caches.append((shard, cache))
        call = core.registry.evalsha(ScriptCall("lookup_shards", call_keys, call_args))
        commands.append(SlotCommand(core.slots[shards[0]], call.args))
        plan.append(caches)
    try:
        replies = yield from op_wave(core.cluster, commands, core.fast_policy, read=read, pick=pick)
    except BackendUnavailableError:  # a redirection or a node in trouble: the careful path
        replies = [None] * len(commands)
    results: dict[int, dict[int, Any]] = {}
    again: list[int] = list(unmapped)
    reload: list[int] = []
    for caches, reply in zip(plan, replies, strict=True):
        if not isinstance(reply, list):
            if isinstance(reply, ErrorReply) and core.registry.missing(reply.message):
                reload.append(caches[0][0])
            again += (shard for shard, _ in caches)
            continue
        for (shard, cache), part in zip(caches, reply, strict=True):
            if not isinstance(part, list) or walk_cut(part):
                # "STALE": the shard is reloaded on the way; a walk stopped at its work
                # limit: the per-shard lookup walks on in parts
                again.append(shard)
                continue
            found: dict[int, Any] = {}
            read_lookup_reply(cache, part, groups[shard], 0, found, shared)
            results[shard] = found
    if reload:
        load = core.registry.load("lookup_shards", read)  # a function library: on primaries
        commands = [SlotCommand(core.slots[shard], load.args) for shard in reload]
        yield from op_wave(core.cluster, commands, core.wave_policy, read=load.read, pick=pick)
    if again:
        factories = {shard: _lookup_factory(groups[shard], pods) for shard in again}
        results.update((yield from _on_shards(core, factories, read=True)))
    return results


def _lookup_factory(
    keys: list[int], pods: frozenset[str] | None
) -> Callable[[CoreState], Op[dict[int, list[PodEntry]]]]:
    return lambda state: op_lookup(state, keys, pods)


def op_cluster_score(
    core: ClusterCore, request_keys: Keys, medium_weights: Any, pod_identifier_set: Any
) -> WaveOp[dict[str, float]]:
    """Per-pod longest-prefix scores: the cluster lookup, scored on the client."""
    scorer = LongestPrefixScorer(score_weights(medium_weights))
    keys, _ = pack_hashes(request_keys, "request key")
    found = yield from op_cluster_lookup(core, keys, pod_identifier_set, shared=True)
    return scorer.score(keys, found)


def op_cluster_get_request_key(core: ClusterCore, engine_key: int) -> WaveOp[int]:
    """``Index.get_request_key``: one call on the engine key's shard."""
    key = check_hash(engine_key, "engine key")
    shard = core.shard(key)
    found = yield from _on_shards(core, {shard: lambda s: op_get_request_key(s, key)})
    return found[shard]


# -- writes ------------------------------------------------------------------------------------


def _add_units(
    core: ClusterCore, engine_keys: Keys | None, request_keys: Keys, entries: Entries
) -> dict[int, list[Unit]]:
    """An add split into per-shard units: request keys to their shards, each mapping to the
    engine key's shard, each piece within the call budget."""
    ents = tuple(dict.fromkeys(entries))
    pairs = infer_mappings(engine_keys, request_keys) if engine_keys else []
    pairs = compress_pairs(pairs, MAX_REQUEST_KEYS_PER_ENGINE_KEY)
    keys = core.by_shard(request_keys)
    pairs_by: dict[int, list[tuple[int, int]]] = {}
    for pair in pairs:
        pairs_by.setdefault(core.shard(pair[0]), []).append(pair)
    units: dict[int, list[Unit]] = {}
    for shard in dict.fromkeys((*keys, *pairs_by)):
        pieces = split_add(keys.get(shard, []), pairs_by.get(shard, []), len(ents))
        units[shard] = [("A", part, part_pairs, ents) for part, part_pairs in pieces]
    return units


def op_cluster_add(
    core: ClusterCore,
    engine_keys: Keys | None,
    request_keys: Keys,
    entries: Entries,
    ttl: float | None = None,
) -> WaveOp[None]:
    """``Index.add``: one wave, the shards' ``add`` calls in parallel."""
    eng, req, ents = check_add(engine_keys, request_keys, entries)
    seconds = check_ttl(ttl, ents)
    ttl_ms = 0 if seconds is None else max(1, math.ceil(seconds * 1000))
    units = _add_units(core, eng, req, ents)
    if ttl_ms:  # one add op per program: the per-shard path sends each as an ``add`` call
        plans = {shard: _single_plan(u) for shard, u in units.items()}
    else:
        plans = {shard: _unfenced_plan(u) for shard, u in units.items()}
    yield from op_node_writes(core, plans, batch_fence(None, None), secrets.token_hex(8), ttl_ms)


def _single_plan(units: Sequence[Unit]) -> PartsPlan:
    """Each unit a program of its own."""
    return lambda state: ([program_of(state.layout, [unit]) for unit in units], 1, 0)


def op_cluster_evict(
    core: ClusterCore, key: int, key_type: KeyType, entries: Entries
) -> WaveOp[None]:
    """``Index.evict``: by request key one call on its shard; by engine key
    :func:`op_engine_evicts`."""
    k = check_hash(key, "evict key")
    kt = check_key_type(key_type)
    ents = check_entries(entries)
    if kt is KeyType.REQUEST:
        yield from _on_shards(core, {core.shard(k): lambda s: op_evict(s, k, kt, ents)})
    else:
        yield from op_engine_evicts(core, [EvictOp(k, kt, tuple(ents))], None)


#: A shard's parts of a write, built from the shard's current layout: (programs, first,
#: after): the programs are parts ``first, first + 1, ...`` of a batch of ``after`` parts more
#: (unfenced writes ignore the numbering).
PartsPlan = Callable[[CoreState], tuple[list[Program], int, int]]


def _unfenced_plan(units: Sequence[Unit]) -> PartsPlan:
    """Units as unfenced parts, empty programs left out."""
    return lambda state: ([p for p in programs_of(state.layout, units) if p.count], 1, 0)


def _part_args(program: Program, part: int, parts: int, ms: int) -> list[Any]:
    layout = program.layout
    args: list[Any] = [
        *(layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.wp, layout.sx),
        *(layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits, ms, part, parts),
        *program.entry_args(),
        program.count,
        *program.ops,
    ]
    return [len(args), *args]


def op_node_writes(
    core: ClusterCore,
    plans: Mapping[int, PartsPlan],
    fence: Sequence[Any],
    token: str,
    ms: int = 0,
    probes: Mapping[int, Sequence[int]] | None = None,
    grown: dict[int, int] | None = None,
) -> WaveOp[tuple[dict[int, bool], set[int]]]:
    """Write the shards' parts, one ``apply_shards`` call per node (more when a node's parts
    outgrow the call budget), all nodes in one wave; then, in the same pipelines, probe whether
    each of ``probes`` (request keys, by shard) still holds an entry. Returns whether each
    shard took every part (False: its fence skipped the batch) and the held probes.

    A node whose calls meet a redirection, a failure or a stale shard has its shards written
    by the per-shard path instead (:func:`op_parallel`); parts sent again carry the same token,
    so a part that did apply is recognised (fenced) or applies again as the set operation it
    is (unfenced). So has, from that part on, a shard whose part met a key its node does not
    serve now (the slot moved or is being migrated: the per-shard path follows it), and a
    shard whose part the server refused as over budget: the per-shard path splits it
    (:func:`~kvredis.redis.ops.op_parts`) and adds to ``grown`` the parts the shard's batch
    gained."""
    probes = probes or {}
    slot_map = core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))
    by_node, unmapped = _group_by_node(core, dict.fromkeys((*plans, *probes)), slot_map.primary)
    head: list[Any] = [MAX_REQUEST_KEYS_PER_ENGINE_KEY, *fence, token]
    commands: list[SlotCommand] = []
    # per node: its shards, then per command: ("call", shards of its parts) or ("probe", key)
    layout_of: list[tuple[list[int], list[tuple[str, Any]]]] = []
    for shards in by_node.values():
        slot = core.slots[shards[0]]
        entries: list[tuple[str, Any]] = []
        calls: list[tuple[list[Any], list[int], list[Any]]] = []
        cost = 0
        for shard in shards:
            state = core.state(shard)
            programs, first, after = plans[shard](state) if shard in plans else ([], 1, 0)
            last = first + len(programs) - 1 + after
            for part, program in enumerate(programs, first):
                if not calls or (cost + program.cost > CALL_BUDGET and calls[-1][1]):
                    layout = state.layout
                    calls.append(
                        (
                            [
                                layout.meta,
                                layout.pe,
                                layout.pi,
                                layout.pp,
                                layout.wm,
                                layout.wp,
                                layout.sx,
                            ],
                            [],
                            [],
                        )
                    )
                    cost = 0
                calls[-1][1].append(shard)
                calls[-1][2].extend(_part_args(program, part, last, ms))
                cost += program.cost
        for keys, part_shards, args in calls:
            call = core.registry.evalsha(ScriptCall("apply_shards", keys, [*head, *args]))
            commands.append(SlotCommand(slot, call.args))
            entries.append(("call", part_shards))
        for shard in shards:
            asked = probes.get(shard, ())
            if not asked:
                continue
            layout = core.state(shard).layout
            for command in _probe_commands(layout, asked):
                commands.append(SlotCommand(slot, command.args))
            entries.append(("clock", None))
            for key in asked:
                entries += (("probe", key), ("timed", key))
        layout_of.append((shards, entries))
    try:
        replies = yield from _write_wave(core, commands, core.fast_policy)
    except BackendUnavailableError:  # a redirection, a node in trouble, a WAIT short of
        replies = [None] * len(commands)  # replicas: the careful path (which waits too)
    taken: dict[int, bool] = {}
    held: set[int] = set()
    error: Exception | None = None
    again: list[int] = list(unmapped)
    skip: dict[int, int] = {}  # shard -> its parts applied before one refused as over budget
    reload: list[int] = []
    at = 0
    for shards, entries in layout_of:
        node_replies = replies[at : at + len(entries)]
        at += len(entries)
        node_ok = True
        for (kind, _), reply in zip(entries, node_replies, strict=True):
            if kind == "call" and not isinstance(reply, list):
                node_ok = False
                if isinstance(reply, ErrorReply):
                    if core.registry.missing(reply.message):
                        reload.append(core.slots[shards[0]])
                    elif (
                        reply.code not in TRANSIENT_REPLIES
                        and not reply.message.startswith(("MOVED", "ASK"))
                        and not non_local_key(reply)
                    ):
                        raise translate(reply.message)
        if not node_ok:
            again += shards
            continue
        refused, failed = _take_node_replies(core, entries, node_replies, taken, held)
        error = error or failed
        for shard, applied in refused.items():
            skip[shard] = applied
            again.append(shard)
        for shard in shards:
            taken.setdefault(shard, True)
    if reload:
        load = core.registry.load("apply_shards").args
        yield from op_wave(
            core.cluster, [SlotCommand(slot, load) for slot in reload], core.wave_policy
        )
    if again:
        factories = {
            shard: _parts_factory(
                plans.get(shard), fence, token, ms, probes.get(shard, ()), skip.get(shard, 0)
            )
            for shard in again
        }
        for shard, (ok, shard_held, added) in (yield from _on_shards(core, factories)).items():
            taken[shard] = ok
            held |= shard_held
            if grown is not None and added:
                grown[shard] = grown.get(shard, 0) + added
    if error is not None:
        raise error
    return taken, held


def _take_node_replies(
    core: ClusterCore,
    entries: Sequence[tuple[str, Any]],
    replies: Sequence[Any],
    taken: dict[int, bool],
    held: set[int],
) -> tuple[dict[int, int], Exception | None]:
    """Take in one node's ``apply_shards`` and probe replies (``entries`` say what each was):
    whether each shard took its parts (into ``taken``), the held probes (into ``held``).
    Returns, by shard, how many of its parts applied before one the server refused as over
    budget or for a key of a slot it does not serve now (those shards go on by the per-shard
    path, and their probes are read there), and the first other error a part met."""
    sent: dict[int, int] = {}
    refused: dict[int, int] = {}
    error: Exception | None = None
    now = 0
    for (kind, what), reply in zip(entries, replies, strict=True):
        if kind == "clock":
            now = _clock_ms(reply)
            continue
        if kind in ("probe", "timed"):
            holds = _live_items(reply, now) if kind == "timed" else bool(int(reply))
            if holds and core.shard(what) not in refused:
                held.add(what)
            continue
        for shard, one in zip(what, reply, strict=True):
            sent[shard] = sent.get(shard, 0) + 1
            if isinstance(one, bytes):  # the error that stopped this shard's part
                message = one.decode("utf-8", "replace")
                exc = translate(message)
                # over budget: the per-shard path splits it; a key of the shard this node
                # does not serve now (its slot moved or is migrating): the per-shard path
                # follows the slot. The shard's parts after it in later calls of this
                # pipeline were skipped (fenced) or applied early (unfenced): they are sent
                # again after it, set operations ending as in order
                if not isinstance(exc, CallBudgetError) and NON_LOCAL_KEY not in message:
                    error = error or exc
                elif shard not in refused:
                    refused[shard] = sent[shard] - 1
                one = 0
            taken[shard] = taken.get(shard, True) and bool(int(one))
    return refused, error


def _parts_factory(
    plan: PartsPlan | None,
    fence: Sequence[Any],
    token: str,
    ms: int,
    probes: Sequence[int],
    skip: int = 0,
) -> Callable[[CoreState], Op[tuple[bool, set[int], int]]]:
    """One shard's parts but the first ``skip`` as single-shard ``apply_batch`` calls (``add``
    calls when they carry a ttl), in order, stopping at the first skipped part (a part the
    server refuses as over budget is split: :func:`~kvredis.redis.ops.op_parts`); then the
    probes. Returns whether every part applied, the held probes and the parts splitting
    added."""

    def call(program: Program, part: int, parts: int) -> ScriptCall:
        if ms:  # a ttl: each program is one add op (see op_cluster_add)
            return add_call(program, ms)
        return batch_call(program, fence, token, part, parts)

    runs: list[bool] = []

    def factory(state: CoreState) -> Op[tuple[bool, set[int], int]]:
        # Run again after the shard was recreated (stale), the batch starts over from its first
        # part: the parts counted done, and any renumbering, went with the old namespace.
        start = 0 if runs else skip
        runs.append(True)
        ok, added = True, 0
        if plan is not None:
            programs, first, after = plan(state)
            ok, added = yield from op_parts(programs[start:], call, first + start, after, not ms)
        if not probes:
            return ok, set(), added
        replies = yield Pipeline(tuple(_probe_commands(state.layout, probes)))
        return ok, _probe_held(probes, replies), added

    return factory


def _probe_commands(layout: Layout, keys: Sequence[int]) -> list[Command]:
    """The probes of whether request keys of one shard hold an entry: the server clock (TIME),
    then per key HEXISTS of its request bucket field and HGET of its expiring bucket field (an
    entry counts while its deadline is after the clock, as everywhere in the index)."""
    commands = [Command(("TIME",))]
    for key in keys:
        field = hash_field(key)
        commands.append(Command(("HEXISTS", layout.request_bucket(key), field)))
        commands.append(Command(("HGET", layout.expiring_bucket(key), field)))
    return commands


def _probe_held(keys: Sequence[int], replies: Sequence[Any]) -> set[int]:
    """The keys that :func:`_probe_commands` found holding an entry."""
    now = _clock_ms(replies[0])
    return {
        key
        for i, key in enumerate(keys)
        if int(replies[1 + 2 * i]) or _live_items(replies[2 + 2 * i], now)
    }


def _clock_ms(reply: Any) -> int:
    """A TIME reply in ms."""
    return int(reply[0]) * 1000 + int(reply[1]) // 1000


def _live_items(reply: Any, now: int) -> bool:
    """Whether an expiring bucket field (or None) holds an item whose deadline is after now."""
    if not reply:
        return False
    items = bytes(reply)
    if len(items) % EXPIRING_ITEM_WIDTH:
        return False
    return any(
        expiring_item_deadline(items[i : i + EXPIRING_ITEM_WIDTH]) > now
        for i in range(0, len(items), EXPIRING_ITEM_WIDTH)
    )


def _evict_call(state: CoreState, key: int, entries: Entries) -> ScriptCall:
    call = next(op_evict(state, key, KeyType.REQUEST, entries))  # its one request
    assert isinstance(call, ScriptCall)
    return call


def _evicts_each(units: Sequence[Unit], probes: Sequence[int]) -> Callable[[CoreState], Op[Any]]:
    """A shard op for a node out of memory: request-key evicts as ``evict`` calls (which such a
    node still runs), then the probes; the held probes."""

    def factory(state: CoreState) -> Op[set[int]]:
        yield Pipeline(tuple(_evict_call(state, u[1], u[2]) for u in units))
        if not probes:
            return set()
        replies = yield Pipeline(tuple(_probe_commands(state.layout, probes)))
        return _probe_held(probes, replies)

    return factory


def op_engine_evicts(
    core: ClusterCore, evicts: Sequence[EvictOp], shards: set[int] | None
) -> WaveOp[None]:
    """Evictions by engine key, in order: read the mappings, evict from their request keys
    while probing whether those still hold entries, drop the mappings none of whose request
    keys does (compare-and-delete). Evicts of different engine keys whose request keys do not
    overlap share their waves. ``shards``: only these shards are written (None: all)."""
    todo = list(evicts)
    while todo:
        run: list[EvictOp] = []
        for op in todo:
            if any(op.key == other.key for other in run):
                break
            run.append(op)
        todo = todo[len(run) :]
        mappings = yield from _read_mappings(core, [op.key for op in run])
        groups: list[list[EvictOp]] = [[]]
        taken: set[int] = set()
        for op in run:
            targets = set(blob_hashes(mappings.get(op.key)))
            if targets & taken:
                groups.append([])
                taken = set()
            groups[-1].append(op)
            taken |= targets
        for group in groups:
            yield from _evict_group(core, group, mappings, shards)


def _read_mappings(core: ClusterCore, engine_keys: Sequence[int]) -> WaveOp[dict[int, bytes]]:
    """The stored mapping (request keys blob) of each engine key that has one."""

    def reader(keys: list[int]) -> Callable[[CoreState], Op[dict[int, bytes]]]:
        def factory(state: CoreState) -> Op[dict[int, bytes]]:
            layout = state.layout
            replies = yield Pipeline(
                tuple(Command(("HGET", layout.engine_bucket(k), hash_field(k))) for k in keys)
            )
            return {k: bytes(r) for k, r in zip(keys, replies, strict=True) if r}

        return factory

    found = yield from _on_shards(
        core, {s: reader(keys) for s, keys in core.by_shard(dict.fromkeys(engine_keys)).items()}
    )
    return {k: v for part in found.values() for k, v in part.items()}


def _evict_group(
    core: ClusterCore,
    group: Sequence[EvictOp],
    mappings: Mapping[int, bytes],
    shards: set[int] | None,
) -> WaveOp[None]:
    units: dict[int, list[Unit]] = {}
    probes: dict[int, list[int]] = {}
    for op in group:
        for key in blob_hashes(mappings.get(op.key)):
            shard = core.shard(key)
            if shards is not None and shard not in shards:
                continue
            units.setdefault(shard, []).append(("R", key, op.entries))
            probes.setdefault(shard, []).append(key)
    plans = {s: _unfenced_plan(u) for s, u in units.items()}
    shard_probes = {s: list(dict.fromkeys(keys)) for s, keys in probes.items()}
    try:
        _, held = yield from op_node_writes(
            core, plans, batch_fence(None, None), secrets.token_hex(8), probes=shard_probes
        )
    except BackendOutOfMemoryError:  # a full node refuses apply_shards, not evict calls
        found = yield from _on_shards(
            core, {s: _evicts_each(units[s], shard_probes[s]) for s in units}
        )
        held = set().union(*found.values())
    drops: dict[int, list[tuple[int, bytes]]] = {}
    for op in group:
        mapping = mappings.get(op.key)
        if not mapping:
            continue
        keys = blob_hashes(mapping)
        if any(k in held or (shards is not None and core.shard(k) not in shards) for k in keys):
            continue
        shard = core.shard(op.key)
        if shards is None or shard in shards:
            drops.setdefault(shard, []).append((op.key, mapping))
    if drops:
        yield from _unmap(core, drops)


def _unmap(core: ClusterCore, drops: Mapping[int, Sequence[tuple[int, bytes]]]) -> WaveOp[int]:
    """Drop mappings that still read as given (``unmap``); the number dropped."""

    def factory(pairs: Sequence[tuple[int, bytes]]) -> Callable[[CoreState], Op[int]]:
        def op(state: CoreState) -> Op[int]:
            layout = state.layout
            dropped = 0
            for start in range(0, len(pairs), UNMAP_PER_CALL):
                args: list[Any] = [layout.gen, layout.eprefix, layout.bucket_bits]
                for key, mapping in pairs[start : start + UNMAP_PER_CALL]:
                    args += (hash_field(key), mapping)
                dropped += int((yield ScriptCall("unmap", (layout.meta,), args)))
            return dropped

        return op

    done = yield from _on_shards(core, {s: factory(p) for s, p in drops.items()})
    return sum(done.values())


def _steps(plan: Sequence[IndexOp]) -> list[tuple[bool, list[IndexOp]]]:
    """The batch cut into steps: (True, engine-key evicts) or (False, adds and request-key
    evicts), in order."""
    steps: list[tuple[bool, list[IndexOp]]] = []
    for op in plan:
        engine = isinstance(op, EvictOp) and op.key_type is KeyType.ENGINE
        if not steps or steps[-1][0] != engine:
            steps.append((engine, []))
        steps[-1][1].append(op)
    return steps


def _step_units(core: ClusterCore, ops: Sequence[IndexOp]) -> dict[int, list[Unit]]:
    units: dict[int, list[Unit]] = {}
    for op in ops:
        if isinstance(op, AddOp):
            for shard, part in _add_units(
                core, op.engine_keys, op.request_keys, op.entries
            ).items():
                units.setdefault(shard, []).extend(part)
        else:
            units.setdefault(core.shard(op.key), []).append(
                ("R", op.key, tuple(dict.fromkeys(op.entries)))
            )
    return units


def op_cluster_apply_batch(
    core: ClusterCore,
    ops: Sequence[IndexOp],
    stream: str | None,
    watermark: Watermark | None,
) -> WaveOp[bool]:
    """``BatchIndex.apply_batch`` over the shards (see the module's docstring for what stays
    atomic). Returns False when every shard had taken this batch or a later one already."""
    plan = check_batch(ops, stream, watermark)
    fenced = stream is not None and watermark is not None
    if not plan and not fenced:
        return True
    steps = _steps(plan)
    first: list[IndexOp] = []
    if steps and not steps[0][0]:
        first = steps.pop(0)[1]
    units = _step_units(core, first)
    fence = batch_fence(stream, watermark)
    token = secrets.token_hex(8)
    closing = fenced and bool(steps)
    targets = range(core.count) if fenced else list(units)

    def opening(shard_units: list[Unit]) -> PartsPlan:
        return lambda state: (programs_of(state.layout, shard_units), 1, 1 if closing else 0)

    opened = {s: opening(units.get(s, [])) for s in targets}
    grown: dict[int, int] = {}  # parts a shard's opening gained by splitting
    taken, _ = yield from op_node_writes(core, opened, fence, token, grown=grown)
    shards = {s for s, ok in taken.items() if ok} if fenced else None
    # The stream's home shard decides what the caller is told: of senders racing with the same
    # batch exactly one is told it applied it (each shard's part went to exactly one of them).
    applied = not fenced or taken[core.home(stream or "")]
    if shards is not None and not shards:
        return applied
    for engine, step in steps:
        if engine:
            evicts = [op for op in step if isinstance(op, EvictOp)]
            yield from op_engine_evicts(core, evicts, shards)
        else:
            plans = {
                s: _unfenced_plan(u)
                for s, u in _step_units(core, step).items()
                if shards is None or s in shards
            }
            yield from op_node_writes(core, plans, batch_fence(None, None), token)
    if closing and shards:

        def closer(shard: int) -> PartsPlan:
            def plan(state: CoreState) -> tuple[list[Program], int, int]:
                opening_parts = len(programs_of(state.layout, units.get(shard, [])))
                return [Program(state.layout)], opening_parts + grown.get(shard, 0) + 1, 0

            return plan

        yield from op_node_writes(core, {s: closer(s) for s in shards}, fence, token)
    return applied


def op_cluster_get_watermark(core: ClusterCore, stream: str) -> WaveOp[Watermark | None]:
    """The stream's watermark: the lowest of the shards' (None if a shard has none), so a batch
    counts as applied only once every shard took it."""
    name = check_stream(stream)
    found = yield from _everywhere(core, lambda s: op_get_watermark(s, name))
    marks = list(found.values())
    if not marks or any(m is None for m in marks):
        return None
    return min(m for m in marks if m is not None)


def op_cluster_reset_watermark(
    core: ClusterCore, stream: str, watermark: Watermark | None
) -> WaveOp[None]:
    """Overwrite (or delete) the stream's watermark on every shard."""
    name = check_stream(stream)
    yield from _everywhere(core, lambda s: op_reset_watermark(s, name, watermark))


# -- clear and drop ----------------------------------------------------------------------------


def op_cluster_clear(
    core: ClusterCore,
    pod_identifier: str,
    progress: ClearProgress | None = None,
    fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL,
    selection: EntrySelection | None = None,
) -> WaveOp[int]:
    """``Index.clear`` on every shard in parallel (each pages its own keys on its node), then
    one pass over the engine mappings: a mapping none of whose request keys holds an entry any
    more is dropped. The pairs removed. With ``selection`` (``clear_entries``) each shard
    removes only the pod's entries it matches."""
    done: dict[int, tuple[int, int]] = {}

    def reporter(shard: int) -> ClearProgress:
        def report(keys: int, removed: int) -> None:
            done[shard] = (keys, removed)
            if progress is not None:
                progress(sum(d[0] for d in done.values()), sum(d[1] for d in done.values()))

        return report

    check_pod_identifier(pod_identifier)
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
    factories = {
        shard: _clear_factory(pod_identifier, reporter(shard), fields_per_call, selection)
        for shard in range(core.count)
    }
    cleared = yield from _on_shards(core, factories)
    retired = {shard: ids for shard, (_n, ids) in cleared.items() if ids}
    if retired:  # the mapping pass, then the reclaim: a clear cut short before it runs it again
        yield from op_clear_mappings(core)
        yield from _on_shards(
            core, {shard: _reclaim_factory(pod_identifier, ids) for shard, ids in retired.items()}
        )
    return sum(n for n, _ids in cleared.values())


def _clear_factory(
    pod: str, report: ClearProgress, per_call: int, selection: EntrySelection | None
) -> Callable[[CoreState], Op[tuple[int, bytes]]]:
    return lambda state: op_clear_passes(
        state, pod, report, per_call, mappings=False, selection=selection
    )


def _reclaim_factory(pod: str, ids: bytes) -> Callable[[CoreState], Op[None]]:
    return lambda state: op_reclaim(state, pod, ids)


def op_clear_mappings(core: ClusterCore) -> WaveOp[int]:
    """Drop every engine mapping none of whose request keys holds an entry; the number
    dropped. Each shard pages its engine buckets; a page's request keys are probed on their
    shards in one wave, and the mappings left without holders are dropped (compare-and-delete)."""
    dropped = 0
    for shard in range(core.count):
        cursor: int | None = None
        while cursor != 0:
            page = yield from _on_shards(core, {shard: _mapping_page(cursor or 0)})
            cursor, mappings = page[shard]
            if not mappings:
                continue
            wanted = {k for mapping in mappings.values() for k in blob_hashes(mapping)}
            held = yield from _probe(core, wanted)
            drops = [
                (e, m) for e, m in mappings.items() if not any(k in held for k in blob_hashes(m))
            ]
            if drops:
                dropped += yield from _unmap(core, {shard: drops})
    return dropped


def _mapping_page(cursor: int) -> Callable[[CoreState], Op[tuple[int, dict[int, bytes]]]]:
    def op(state: CoreState) -> Op[tuple[int, dict[int, bytes]]]:
        layout = state.layout
        next_cursor, keys = yield Command(
            ("SCAN", cursor, "MATCH", layout.engine_pattern(), "COUNT", MAPPING_PAGE)
        )
        mappings: dict[int, bytes] = {}
        if keys:
            replies = yield Pipeline(tuple(Command(("HGETALL", k)) for k in keys))
            for reply in replies:
                for field, value in _hash_items(reply):
                    if len(field) == 8 and value and len(value) % 8 == 0:
                        mappings[int.from_bytes(field, "big")] = value
        return int(next_cursor), mappings

    return op


def _hash_items(reply: Any) -> list[tuple[bytes, bytes]]:
    """The (field, value) pairs of an HGETALL reply (a flat list, or a map in RESP3)."""
    if isinstance(reply, dict):
        return [(bytes(k), bytes(v)) for k, v in reply.items()]
    if isinstance(reply, (list, tuple)):
        return [(bytes(reply[i]), bytes(reply[i + 1])) for i in range(0, len(reply) - 1, 2)]
    return []


def _probe(core: ClusterCore, keys: Iterable[int]) -> WaveOp[set[int]]:
    """Which of the request keys hold an entry (stored inline or in a run)."""
    _, held = yield from op_node_writes(
        core, {}, batch_fence(None, None), secrets.token_hex(8), probes=core.by_shard(keys)
    )
    return held


def op_cluster_drop(core: ClusterCore) -> WaveOp[int]:
    """Drop every shard (each scans its own node), then the descriptor; keys deleted."""
    deleted = yield from _everywhere(core, op_drop_namespace)
    desc = descriptor_key(core.namespace)
    removed = yield from _command(core, shard_slot(desc.decode()), "DEL", desc)
    return sum(deleted.values()) + int(removed)

"""The cluster index's writes as sans-IO wave operations: adds and evicts (one script call per
involved node, each shard's part fenced by its own watermark, :func:`op_node_writes`), evicts by
engine key in three waves, fenced batches in steps, watermarks (see :mod:`.ops` for the
design)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark, check_batch, check_stream
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    check_add,
    check_entries,
    check_hash,
    check_key_type,
    check_ttl,
    infer_mappings,
)
from kvredis.errors import (
    BackendOutOfMemoryError,
    BackendUnavailableError,
    CallBudgetError,
    lua_error_code,
)
from kvredis.redis.cluster.core import (
    UNMAP_PER_CALL,
    ClusterCore,
    group_by_node,
    on_every_shard,
    on_shards,
    write_wave,
)
from kvredis.redis.cluster.routing import (
    SlotCommand,
    WaveOp,
    non_local_key,
    op_refresh,
    op_wave,
)
from kvredis.redis.codec import blob_hashes, hash_field
from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    Layout,
    expiring_item_deadline,
)
from kvredis.redis.ops import (
    add_call,
    batch_call,
    batch_fence,
    op_evict,
    op_get_watermark,
    op_parts,
    op_reset_watermark,
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
    TRANSIENT_REPLIES,
    Command,
    ErrorReply,
    Op,
    Pipeline,
    ScriptCall,
)
from kvredis.redis.session import typed_error
from kvredis.redis.state import CoreState
from kvredis.types import Entries, Keys, KeyType

T = TypeVar("T")

#: The code of an error reply refusing a call as over budget (the client splits the call).
OVER_BUDGET = lua_error_code(CallBudgetError)


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
        yield from on_shards(core, {core.shard(k): lambda s: op_evict(s, k, kt, ents)})
    else:
        yield from op_engine_evicts(core, [EvictOp(k, kt, tuple(ents))], None)


#: A shard's parts of a write, built from the shard's current layout: (programs, first,
#: after): the programs are parts ``first, first + 1, ...`` of a batch of ``after`` parts more
#: (unfenced writes ignore the numbering).
PartsPlan = Callable[[CoreState], tuple[list[Program], int, int]]


def _unfenced_plan(units: Sequence[Unit]) -> PartsPlan:
    """Units as unfenced parts, empty programs left out."""
    return lambda state: ([p for p in programs_of(state.layout, units) if p.count], 1, 0)


def _record_keys(layout: Layout) -> tuple[bytes, ...]:
    """A shard's records an ``apply_shards`` part names (as its call's keys, and again in the
    part's arguments), in the script's order."""
    return (layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.wp, layout.sx)


def _part_args(program: Program, part: int, parts: int, ms: int) -> list[Any]:
    layout = program.layout
    args: list[Any] = [
        *_record_keys(layout),
        *(layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits, ms, part, parts),
        *program.entry_args(),
        program.count,
        *program.ops,
    ]
    return [len(args), *args]


@dataclass(frozen=True, slots=True)
class PartsCall:
    """A reply that is one ``apply_shards`` call's: per part, in order, the shard it wrote."""

    shards: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Clock:
    """A reply that is the server clock (``TIME``) the probes after it compare deadlines with."""


@dataclass(frozen=True, slots=True)
class Probe:
    """A reply that says whether request key ``key`` holds an entry: its request bucket field
    (``HEXISTS``), or its expiring bucket field (``timed``: live items against the clock)."""

    key: int
    timed: bool


NodeReply = PartsCall | Clock | Probe
"""What one reply of a node's pipeline is (:func:`op_node_writes`)."""


class NodeWrites(NamedTuple):
    """One node's share of a wave of writes: its shards, the commands sent to it, and what each
    of their replies is."""

    shards: list[int]
    commands: list[SlotCommand]
    replies: list[NodeReply]


class WaveOutcome(NamedTuple):
    """What a wave's replies said (:func:`_settle_wave`)."""

    taken: dict[int, bool]
    """Whether each shard took every part (False: its fence skipped the batch)."""
    held: set[int]
    """The probed request keys that hold an entry."""
    again: list[int]
    """The shards to write by the per-shard path."""
    skip: dict[int, int]
    """Per shard going again: its parts applied before the one refused."""
    reload: list[int]
    """Slots of nodes that miss the library's function (load it there first)."""
    error: Exception | None
    """The first error a part met that no path can cure."""


def _parts_calls(
    core: ClusterCore, shards: Sequence[int], plans: Mapping[int, PartsPlan], ms: int
) -> list[tuple[list[Any], list[int], list[Any]]]:
    """The ``apply_shards`` calls of one node's shards: per call its keys, the shard of each of
    its parts and the parts' arguments; a call holds parts until they outgrow the call budget
    (one part always fits)."""
    calls: list[tuple[list[Any], list[int], list[Any]]] = []
    cost = 0
    for shard in shards:
        state = core.state(shard)
        programs, first, after = plans[shard](state) if shard in plans else ([], 1, 0)
        last = first + len(programs) - 1 + after
        for part, program in enumerate(programs, first):
            if not calls or (cost + program.cost > CALL_BUDGET and calls[-1][1]):
                calls.append((list(_record_keys(state.layout)), [], []))
                cost = 0
            calls[-1][1].append(shard)
            calls[-1][2].extend(_part_args(program, part, last, ms))
            cost += program.cost
    return calls


def _node_writes(
    core: ClusterCore,
    shards: list[int],
    plans: Mapping[int, PartsPlan],
    probes: Mapping[int, Sequence[int]],
    head: Sequence[Any],
    ms: int,
) -> NodeWrites:
    """One node's commands: its shards' parts in ``apply_shards`` calls, then the probes."""
    slot = core.slots[shards[0]]
    commands: list[SlotCommand] = []
    replies: list[NodeReply] = []
    for keys, part_shards, args in _parts_calls(core, shards, plans, ms):
        call = core.registry.call_command(ScriptCall("apply_shards", keys, [*head, *args]))
        commands.append(SlotCommand(slot, call.args))
        replies.append(PartsCall(tuple(part_shards)))
    for shard in shards:
        asked = probes.get(shard, ())
        if not asked:
            continue
        layout = core.state(shard).layout
        commands += (SlotCommand(slot, c.args) for c in _probe_commands(layout, asked))
        replies.append(Clock())
        for key in asked:
            replies += (Probe(key, timed=False), Probe(key, timed=True))
    return NodeWrites(shards, commands, replies)


def _node_failed(core: ClusterCore, node: NodeWrites, replies: Sequence[Any]) -> tuple[bool, bool]:
    """Whether a node's pipeline failed as a whole (a call not answered with a list), and
    whether a reason is a missing function (the library to load on the node). An error no other
    path can cure is raised."""
    failed = missing = False
    for kind, reply in zip(node.replies, replies, strict=True):
        if not isinstance(kind, PartsCall) or isinstance(reply, list):
            continue
        failed = True
        if core.registry.missing(reply):
            missing = True
        elif (
            isinstance(reply, ErrorReply)
            and reply.code not in TRANSIENT_REPLIES
            and not reply.message.startswith(("MOVED", "ASK"))
            and not non_local_key(reply)
        ):
            raise typed_error(reply)
    return failed, missing


def _settle_wave(
    core: ClusterCore, nodes: Sequence[NodeWrites], replies: Sequence[Any], unmapped: list[int]
) -> WaveOutcome:
    """Read a wave's replies, node by node (a node that failed as a whole goes again)."""
    out = WaveOutcome({}, set(), list(unmapped), {}, [], None)
    at = 0
    error: Exception | None = None
    for node in nodes:
        node_replies = replies[at : at + len(node.replies)]
        at += len(node.replies)
        failed, missing = _node_failed(core, node, node_replies)
        if failed:
            if missing:
                out.reload.append(core.slots[node.shards[0]])
            out.again.extend(node.shards)
            continue
        refused, failure = _take_node_replies(core, node.replies, node_replies, out.taken, out.held)
        error = error or failure
        for shard, applied in refused.items():
            out.skip[shard] = applied
            out.again.append(shard)
        for shard in node.shards:
            out.taken.setdefault(shard, True)
    return out._replace(error=error)


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

    A node whose calls meet a redirection, a failure or a stale shard has its shards written by the
    per-shard path instead (:func:`~kvredis.redis.cluster.core.op_parallel`); parts sent again carry
    the same token, so a part that did apply is recognised (fenced) or applies again as the set
    operation it is (unfenced). So has, from that part on, a shard whose part met a key its node
    does not serve now (the slot moved or is being migrated: the per-shard path follows it), and a
    shard whose part the server refused as over budget: the per-shard path splits it
    (:func:`~kvredis.redis.ops.op_parts`) and adds to ``grown`` the parts the shard's batch
    gained."""
    probes = probes or {}
    slot_map = core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))
    by_node, unmapped = group_by_node(core, dict.fromkeys((*plans, *probes)), slot_map.primary)
    head: list[Any] = [MAX_REQUEST_KEYS_PER_ENGINE_KEY, *fence, token]
    nodes = [_node_writes(core, shards, plans, probes, head, ms) for shards in by_node.values()]
    commands = [command for node in nodes for command in node.commands]
    try:
        replies = yield from write_wave(core, commands, core.fast_policy)
    except BackendUnavailableError:  # a redirection, a node in trouble, a WAIT short of
        replies = [None] * len(commands)  # replicas: the careful path (which waits too)
    out = _settle_wave(core, nodes, replies, list(unmapped))
    if out.reload and not core.registry.active:  # the library: each shard's call settles it
        load = core.registry.load_command("apply_shards").args
        yield from op_wave(
            core.cluster, [SlotCommand(slot, load) for slot in out.reload], core.wave_policy
        )
    taken, held = out.taken, out.held
    if out.again:
        factories = {
            shard: _parts_factory(
                plans.get(shard), fence, token, ms, probes.get(shard, ()), out.skip.get(shard, 0)
            )
            for shard in out.again
        }
        for shard, (ok, shard_held, added) in (yield from on_shards(core, factories)).items():
            taken[shard] = ok
            held |= shard_held
            if grown is not None and added:
                grown[shard] = grown.get(shard, 0) + added
    if out.error is not None:
        raise out.error
    return taken, held


def _take_node_replies(
    core: ClusterCore,
    kinds: Sequence[NodeReply],
    replies: Sequence[Any],
    taken: dict[int, bool],
    held: set[int],
) -> tuple[dict[int, int], Exception | None]:
    """Take in one node's ``apply_shards`` and probe replies (``kinds`` say what each is):
    whether each shard took its parts (into ``taken``), the held probes (into ``held``).
    Returns, by shard, how many of its parts applied before one the server refused as over
    budget or for a key of a slot it does not serve now (those shards go on by the per-shard
    path, and their probes are read there), and the first other error a part met."""
    sent: dict[int, int] = {}
    refused: dict[int, int] = {}
    error: Exception | None = None
    now = 0
    for kind, reply in zip(kinds, replies, strict=True):
        if isinstance(kind, Clock):
            now = _clock_ms(reply)
            continue
        if isinstance(kind, Probe):
            holds = _live_items(reply, now) if kind.timed else bool(int(reply))
            if holds and core.shard(kind.key) not in refused:
                held.add(kind.key)
            continue
        for shard, one in zip(kind.shards, reply, strict=True):
            sent[shard] = sent.get(shard, 0) + 1
            if isinstance(one, bytes):  # the error that stopped this shard's part
                failure = ErrorReply(one.decode("utf-8", "replace"))
                # over budget: the per-shard path splits it; a key of the shard this node
                # does not serve now (its slot moved or is migrating): the per-shard path
                # follows the slot. The shard's parts after it in later calls of this
                # pipeline were skipped (fenced) or applied early (unfenced): they are sent
                # again after it, set operations ending as in order
                if failure.code != OVER_BUDGET and not non_local_key(failure):
                    error = error or typed_error(failure)
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

    found = yield from on_shards(
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
        found = yield from on_shards(
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
        yield from unmap_mappings(core, drops)


def unmap_mappings(
    core: ClusterCore, drops: Mapping[int, Sequence[tuple[int, bytes]]]
) -> WaveOp[int]:
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

    done = yield from on_shards(core, {s: factory(p) for s, p in drops.items()})
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
    found = yield from on_every_shard(core, lambda s: op_get_watermark(s, name))
    marks = list(found.values())
    if not marks or any(m is None for m in marks):
        return None
    return min(m for m in marks if m is not None)


def op_cluster_reset_watermark(
    core: ClusterCore, stream: str, watermark: Watermark | None
) -> WaveOp[None]:
    """Overwrite (or delete) the stream's watermark on every shard."""
    name = check_stream(stream)
    yield from on_every_shard(core, lambda s: op_reset_watermark(s, name, watermark))

"""The cluster index's writes as sans-IO wave operations: adds, evicts, batches and watermarks in
a namespace placed by pod.

Every write is cut into :class:`~.placement.Segment` s, one per shard its entries reach (an
engine batch is one pod's: one segment). A segment is what one shard applies atomically, as the
single-server index would: its ops become the single-server write programs
(:func:`~kvredis.redis.ops.batch_programs`), parts ``1..n`` of a batch fenced by the stream's
watermark in that shard (one part unless the segment outgrows one call's work budget). The
segments go out as :class:`~.calls.NodeCall` s: every part one node takes in a wave travels in
one ``apply_parts`` call (a single part: the single-server ``apply_batch`` or ``add`` call
itself), every node's call in one wave, so a write costs one round trip and one script call per
node it involves. What a call cannot do (the slot map is out of date, a node fails, a shard was
recreated, a part is over budget or meets a slot being migrated) goes by the per-shard path from
the part it reached: the single-server operations on each shard, with their redirections,
reloads, retries and splits (:func:`~kvredis.redis.ops.op_parts`).

Order and fences: a shard applies its segments in call order, each at most once (its stream's
watermark in that shard fences it; a part sent again carries its token and is recognised).
Segments of different shards are independent (a shard's data is its pods'), so they go in
parallel. A batch's outcome is its deciding segment's (:mod:`.placement`); once a batch of a
stream is not applied, the stream's later batches in the call are not applied either (reported
False): within one node call the script stops them, and a stream whose segments are on several
nodes goes one batch per wave.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvredis.batch import (
    AddOp,
    Batch,
    EvictOp,
    IndexOp,
    Watermark,
    check_batches,
    check_stream,
)
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    check_add,
    check_entries,
    check_hash,
    check_key_type,
    check_ttl,
)
from kvredis.errors import (
    CallBudgetError,
    StaleNamespaceError,
    lua_error_code,
)
from kvredis.redis.cluster.calls import NodeCall, group_shards, op_node_calls, op_slot_map
from kvredis.redis.cluster.core import ClusterCore, on_every_shard, on_shards
from kvredis.redis.cluster.placement import (
    Segment,
    add_segments,
    batch_segments,
    evict_segments,
)
from kvredis.redis.cluster.routing import WaveOp, non_local_key
from kvredis.redis.cluster.topology import ClusterNode
from kvredis.redis.codec import blob_hashes, hash_field, text_bytes
from kvredis.redis.layout import Layout
from kvredis.redis.ops import (
    add_call,
    batch_call,
    batch_fence,
    batch_programs,
    evict_call,
    op_get_watermark,
    op_parts,
    op_reset_watermark,
)
from kvredis.redis.program import (
    CALL_BUDGET,
    Program,
    add_pieces,
    piece_parents,
    program_of,
)
from kvredis.redis.requests import Arg, Command, ErrorReply, Op, Pipeline, ScriptCall
from kvredis.redis.session import typed_error
from kvredis.redis.state import CoreState
from kvredis.types import Entries, Keys, KeyType

#: The code of an error reply refusing a call as over budget (the client splits the call).
OVER_BUDGET = lua_error_code(CallBudgetError)
#: The code of an error reply refusing a part of a shard whose generation is not the client's.
STALE = lua_error_code(StaleNamespaceError)


def segment_programs(layout: Layout, segment: Segment) -> list[Program]:
    """The single-server write programs of a segment, each one call's part (at least one)."""
    if not segment.ttl_ms:
        return batch_programs(layout, segment.ops)
    op = segment.ops[0]  # Index.add with a ttl: its pieces, one add op each (lua/add.lua)
    assert isinstance(op, AddOp)
    entries = list(dict.fromkeys(op.entries))
    pieces = add_pieces(op.engine_keys, op.request_keys, entries)
    return [
        program_of(layout, [("A", keys, pairs, entries, parent)])
        for (keys, pairs), parent in zip(pieces, piece_parents(pieces, None), strict=True)
    ]


@dataclass(slots=True)
class SegmentRun:
    """A segment on its way: its parts (built from its shard's layout) and how far they got.

    ``outcome`` is None while under way, then whether every part applied. ``careful``: the
    segment goes on by the per-shard path from part ``done`` on."""

    segment: Segment
    programs: list[Program]
    done: int = 0
    outcome: bool | None = None
    careful: bool = False

    @property
    def shard(self) -> int:
        return self.segment.shard

    @property
    def stream(self) -> str | None:
        return self.segment.stream if self.segment.fenced else None

    def call(self, program: Program, part: int, parts: int, token: str) -> ScriptCall:
        """The single-server call of one part (``apply_batch``, or ``add`` with a ttl)."""
        segment = self.segment
        if segment.evict:
            return evict_call(program)
        if segment.ttl_ms:
            return add_call(program, segment.ttl_ms)
        return batch_call(
            program, batch_fence(segment.stream, segment.watermark), token, part, parts
        )


@dataclass(slots=True)
class WritePlan:
    """The segments of one write call and what is known of them: the state of the schedule
    that sends their parts (:func:`op_write_segments`)."""

    runs: list[SegmentRun]
    token: str
    #: stream -> the first batch of the call that was not applied (later ones are not applied)
    stopped: dict[str, int] = field(default_factory=dict)
    #: streams whose segments are on more than one node: one batch per wave
    spread: set[str] = field(default_factory=set)
    error: Exception | None = None

    def pending(self) -> list[SegmentRun]:
        """The runs under way, after settling those their stream's stop rules out."""
        out = []
        for run in self.runs:
            if run.outcome is not None:
                continue
            stream = run.stream
            if (
                stream is not None
                and self.stopped.get(stream, run.segment.batch) < run.segment.batch
            ):
                run.outcome = False
                continue
            out.append(run)
        return out

    def ready(self, run: SegmentRun, pending: Sequence[SegmentRun]) -> bool:
        """Whether ``run`` may be sent now: the earlier batches of its stream are settled where
        the stream is on several nodes."""
        stream = run.stream
        if stream is None or stream not in self.spread:
            return True
        batch = run.segment.batch
        return not any(r.stream == stream and r.segment.batch < batch for r in pending)

    def took(self, run: SegmentRun, applied: bool, core: ClusterCore) -> None:
        """Record that the next part of ``run`` applied, or that its fence skipped it."""
        if applied:
            run.done += 1
            if run.done == len(run.programs):
                self.finished(run, True, core)
        else:
            self.finished(run, False, core)

    def finished(self, run: SegmentRun, applied: bool, core: ClusterCore) -> None:
        """Record the outcome of a whole segment."""
        segment = run.segment
        run.outcome = applied
        run.careful = False
        if applied:
            run.done = len(run.programs)
            if segment.decides and run.stream is not None:
                core.stream_homes[run.stream] = segment.shard
        else:
            self.stop(run)

    def stop(self, run: SegmentRun) -> None:
        """A deciding segment was not applied: its stream's later batches are not either."""
        stream = run.stream
        if stream is not None and run.segment.decides:
            batch = run.segment.batch
            self.stopped[stream] = min(self.stopped.get(stream, batch), batch)

    def go_careful(self, shard: int) -> None:
        """Send every pending segment of ``shard`` by the per-shard path from now on."""
        for run in self.runs:
            if run.shard == shard and run.outcome is None:
                run.careful = True

    def failed(self, run: SegmentRun, message: str) -> None:
        """A part stopped with an error reply before its first write."""
        failure = ErrorReply(message)
        if failure.code in (STALE, OVER_BUDGET) or non_local_key(failure):
            # reloads the shard, follows the slot, or splits the part over budget
            self.go_careful(run.shard)
            return
        self.error = self.error or typed_error(failure)
        run.outcome = False
        self.stop(run)
        self.go_careful(run.shard)  # its later segments: after it, in order


def part_args(program: Program, part: int, parts: int, segment: Segment, token: str) -> list[Arg]:
    """Part ``part`` of ``parts`` of a segment in an ``apply_parts`` call: its length, then
    its arguments (see ``lua/apply_parts.lua``)."""
    layout = program.layout
    stream, epoch, seq = batch_fence(segment.stream, segment.watermark)
    args: list[Arg] = [
        *(layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.wp, layout.sx),
        *(layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits, segment.ttl_ms),
        *(stream, epoch, seq, token, part, parts),
        segment.batch,
        1 if segment.decides else 0,
        *program.entry_args(),
        program.count,
        *program.ops,
    ]
    return [len(args), *args]


def _node_call(
    core: ClusterCore, parts: list[tuple[SegmentRun, int]], token: str, node: ClusterNode
) -> NodeCall:
    """The call of one node's parts in a wave: the single-server script for one part, else
    ``apply_parts``."""
    slot = core.slots[parts[0][0].shard]
    if len(parts) == 1:
        run, index = parts[0]
        call = run.call(run.programs[index], index + 1, len(run.programs), token)
        return NodeCall(slot, call, tuple(parts), single=True, node=node)
    layout = parts[0][0].programs[parts[0][1]].layout
    args: list[Arg] = [MAX_REQUEST_KEYS_PER_ENGINE_KEY]
    for run, index in parts:
        args += part_args(run.programs[index], index + 1, len(run.programs), run.segment, token)
    keys = (layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.wp, layout.sx)
    return NodeCall(slot, ScriptCall("apply_parts", keys, args), tuple(parts), node=node)


def _node_parts(
    plan: WritePlan, runs: Sequence[SegmentRun], pending: Sequence[SegmentRun]
) -> list[tuple[SegmentRun, int]]:
    """The parts one node takes in the next wave, in order: its runs' remaining parts while
    they fit the call's work budget (at least one part), stopping at a run not ready or one
    whose parts do not all fit (what follows on its shard must come after it)."""
    out: list[tuple[SegmentRun, int]] = []
    cost = 0
    for run in runs:
        if not plan.ready(run, pending):
            break
        remaining = range(run.done, len(run.programs))
        whole = True
        for index in remaining:
            program_cost = run.programs[index].cost
            if out and cost + program_cost > CALL_BUDGET:
                whole = False
                break
            out.append((run, index))
            cost += program_cost
        if not whole:
            break
    return out


def _take_replies(
    core: ClusterCore, plan: WritePlan, call: NodeCall, replies: list[Any] | None
) -> None:
    """Take in one node call's replies (None: the call did not get through)."""
    if replies is None:
        for run, _ in call.items:
            plan.go_careful(run.shard)
        return
    for (run, _index), reply in zip(call.items, replies, strict=True):
        if run.outcome is not None or run.careful:
            continue
        if isinstance(reply, bytes | str):
            plan.failed(run, reply.decode() if isinstance(reply, bytes) else reply)
        elif int(reply) == -1:
            continue  # not run: its stream stopped (see pending()), or its shard failed before
        elif run.stream is None or int(reply) == 1:  # (an add call answers 0: applied)
            plan.took(run, True, core)
        else:
            plan.took(run, False, core)


def _careful_factory(plan: WritePlan, run: SegmentRun) -> Callable[[CoreState], Op[bool]]:
    """The per-shard path of one segment, from its part ``done`` on: the single-server calls
    in order (a part refused as over budget is split), stopping at a part its fence skipped.
    Run again after the shard was recreated (stale), the segment starts over from its first
    part, built from the new layout."""

    def factory(state: CoreState) -> Op[bool]:
        layout = state.layout
        if not run.programs or run.programs[0].layout is not layout:
            run.programs = segment_programs(layout, run.segment)
            run.done = 0
        first = run.done
        applied, _ = yield from op_parts(
            run.programs[first:],
            lambda program, part, parts: run.call(program, part, parts, plan.token),
            first + 1,
            0,
            run.segment.fenced,
        )
        return applied

    return factory


def op_careful_round(core: ClusterCore, plan: WritePlan) -> WaveOp[None]:
    """One round of the per-shard path: each shard with careful segments runs its next one
    (when ready), all shards in lockstep."""
    pending = plan.pending()
    chosen: dict[int, SegmentRun] = {}
    blocked: set[int] = set()
    for run in pending:
        if run.shard in chosen or run.shard in blocked:
            continue
        if not run.careful or not plan.ready(run, pending):
            blocked.add(run.shard)  # a fast segment of the shard comes first
            continue
        chosen[run.shard] = run
    if not chosen:
        return
    factories = {shard: _careful_factory(plan, run) for shard, run in chosen.items()}
    done = yield from on_shards(core, factories)
    for shard, applied in done.items():
        plan.finished(chosen[shard], applied, core)


def op_fast_wave(core: ClusterCore, plan: WritePlan) -> WaveOp[bool]:
    """One wave of node calls for the segments not gone careful; whether it sent any."""
    pending = plan.pending()
    fast = [r for r in pending if not r.careful]
    if not fast:
        return False
    slot_map = yield from op_slot_map(core)
    careful_shards = {r.shard for r in pending if r.careful}
    shards = list(dict.fromkeys(r.shard for r in fast if r.shard not in careful_shards))
    by_node, unmapped = group_shards(core, shards, slot_map.primary)
    for shard in unmapped:
        plan.go_careful(shard)
    node_of = {shard: node for node, group in by_node.items() for shard in group}
    node_runs: dict[ClusterNode, list[SegmentRun]] = {}
    for run in fast:
        node = node_of.get(run.shard)
        if node is not None and not run.careful:
            node_runs.setdefault(node, []).append(run)
    calls: list[NodeCall] = []
    for node, runs in node_runs.items():
        merged: list[tuple[SegmentRun, int]] = []
        for run, index in _node_parts(plan, runs, pending):
            if run.segment.evict:  # its own call: the evict script runs out of memory too
                if merged:
                    calls.append(_node_call(core, merged, plan.token, node))
                    merged = []
                calls.append(_node_call(core, [(run, index)], plan.token, node))
            else:
                merged.append((run, index))
        if merged:
            calls.append(_node_call(core, merged, plan.token, node))
    if not calls:
        return False
    replies = yield from op_node_calls(core, calls)
    for call, reply in zip(calls, replies, strict=True):
        _take_replies(core, plan, call, reply)
    return True


def op_write_segments(
    core: ClusterCore, segments: Sequence[Segment], token: str | None = None
) -> WaveOp[list[bool]]:
    """Apply ``segments`` (see the module docstring); whether each was applied whole. Raises
    the first error a segment met (after the others went as far as they could). In a namespace
    of the key layout (being converted) their evicts reach the entries' old places first
    (:func:`op_converting_evicts`)."""
    if not core.by_pod:
        segments = yield from op_converting_evicts(core, segments)
    return (yield from op_apply_segments(core, segments, token))


def op_apply_segments(
    core: ClusterCore, segments: Sequence[Segment], token: str | None = None
) -> WaveOp[list[bool]]:
    """:func:`op_write_segments` once the segments are the pod layout's."""
    token = token or secrets.token_hex(8)
    runs = [SegmentRun(s, segment_programs(core.state(s.shard).layout, s)) for s in segments]
    plan = WritePlan(runs, token)
    slot_map = yield from op_slot_map(core)
    nodes: dict[str, set[Any]] = {}
    for run in runs:
        if run.stream is not None:
            try:
                node: Any = slot_map.primary(core.slots[run.shard])
            except Exception:  # no node serves it yet: the per-shard path finds it
                node = None
            nodes.setdefault(run.stream, set()).add(node)
    plan.spread = {stream for stream, where in nodes.items() if len(where) > 1}
    while plan.pending():
        sent = yield from op_fast_wave(core, plan)
        if any(r.careful for r in plan.pending()):
            yield from op_careful_round(core, plan)
        elif not sent:
            break
    if plan.error is not None:
        raise plan.error
    return [bool(run.outcome) for run in runs]


# -- a namespace of the key layout being converted ------------------------------------------------


def _read_engine_mappings(
    core: ClusterCore, wanted: dict[int, set[int]]
) -> WaveOp[dict[int, list[int]]]:
    """The request keys each engine key maps to in the given shards (by shard: the engine keys
    to read there), merged per engine key in shard order."""

    def reader(keys: list[int]) -> Callable[[CoreState], Op[dict[int, bytes]]]:
        def factory(state: CoreState) -> Op[dict[int, bytes]]:
            layout = state.layout
            replies = yield Pipeline(
                tuple(Command(("HGET", layout.engine_bucket(k), hash_field(k))) for k in keys)
            )
            return {k: bytes(r) for k, r in zip(keys, replies, strict=True) if r}

        return factory

    found = yield from on_shards(core, {s: reader(sorted(k)) for s, k in wanted.items()})
    out: dict[int, list[int]] = {}
    for shard in sorted(found):
        for key, blob in found[shard].items():
            merged = out.setdefault(key, [])
            merged += (k for k in blob_hashes(blob) if k not in merged)
    return out


def op_converting_evicts(core: ClusterCore, segments: Sequence[Segment]) -> WaveOp[list[Segment]]:
    """The evicts of ``segments`` in a namespace of the key layout that ``kvredis migrate``
    converts (:mod:`.migrate`): a pod's entries may still be where the key layout put them (the
    request key's shard) as well as in the pod's shard. An evict by engine key becomes evicts
    by request key of every request key the engine key maps to (in its own shard, where the
    key layout keeps mappings, and in the pod's shard); no mapping is dropped meanwhile (the
    conversion's last step drops those left without holders). In order: the evicts reach the
    entries' old places (one wave), then each pod's counter in its shard is raised (one wave;
    the mover copies a pod's pairs only while it has not moved), then the segments, with their
    evicts by request key, go as usual. Returns the segments to apply."""
    wanted: dict[int, set[int]] = {}
    for segment in segments:
        for op in segment.ops:
            if isinstance(op, EvictOp) and op.key_type is KeyType.ENGINE:
                wanted.setdefault(core.shard(op.key), set()).add(op.key)
                wanted.setdefault(segment.shard, set()).add(op.key)
    mapped = (yield from _read_engine_mappings(core, wanted)) if wanted else {}
    old_places: dict[int, list[IndexOp]] = {}
    bumps: dict[int, set[str]] = {}
    out: list[Segment] = []
    for segment in segments:
        ops: list[IndexOp] = []
        for op in segment.ops:
            if not isinstance(op, EvictOp):
                ops.append(op)
                continue
            keys = [op.key] if op.key_type is KeyType.REQUEST else mapped.get(op.key, [])
            evicts = [EvictOp(k, KeyType.REQUEST, op.entries) for k in keys]
            for evict in evicts:
                old_places.setdefault(core.shard(evict.key), []).append(evict)
            ops += evicts
            bumps.setdefault(segment.shard, set()).update(e.pod_identifier for e in op.entries)
        out.append(dataclasses.replace(segment, ops=tuple(ops), evict=False))
    if old_places:
        olds = [Segment(0, shard, tuple(ops)) for shard, ops in sorted(old_places.items())]
        yield from op_apply_segments(core, olds)
    if bumps:
        yield from on_shards(core, {s: _bump(pods) for s, pods in bumps.items()})
    return out


def _bump(pods: set[str]) -> Callable[[CoreState], Op[None]]:
    """Raise the pods' counters in one shard (``<shard>:mv``: see :mod:`.migrate`)."""

    def factory(state: CoreState) -> Op[None]:
        key = state.layout.mv
        yield Pipeline(tuple(Command(("HINCRBY", key, text_bytes(p), 1)) for p in sorted(pods)))

    return factory


# -- the index's writes --------------------------------------------------------------------------


def op_cluster_apply_batches(core: ClusterCore, batches: Sequence[Batch]) -> WaveOp[list[bool]]:
    """``BatchIndex.apply_batches``: each batch as ``apply_batch`` would apply it, in order,
    except that once a batch of a stream is not applied, the stream's later batches in the call
    are not applied either (reported False). One wave for batches whose streams each live on
    one node (an ingester's: one pod per stream)."""
    checked = check_batches(batches)  # every batch before anything applies
    segments: list[Segment] = []
    owners: list[tuple[int, bool]] = []  # per segment: its batch, whether it decides
    empty: list[bool] = []
    for number, (plan, stream, watermark) in enumerate(checked):
        fenced = stream is not None and watermark is not None
        empty.append(not plan and not fenced)
        if not plan and not fenced:
            continue
        home = core.stream_home(stream) if stream is not None else 0
        for segment in batch_segments(number, plan, stream, watermark, core.pod_shard, home):
            segments.append(segment)
            owners.append((number, segment.decides))
    outcomes = yield from op_write_segments(core, segments)
    verdicts = [True] * len(batches)
    for (number, decides), outcome in zip(owners, outcomes, strict=True):
        if decides:
            verdicts[number] = outcome
    return [True if empty[i] else verdicts[i] for i in range(len(batches))]


def op_cluster_apply_batch(
    core: ClusterCore,
    ops: Sequence[IndexOp],
    stream: str | None,
    watermark: Watermark | None,
) -> WaveOp[bool]:
    """``BatchIndex.apply_batch``: :func:`op_cluster_apply_batches` of one batch."""
    (applied,) = yield from op_cluster_apply_batches(core, [Batch(ops, stream, watermark)])
    return applied


def op_cluster_add(
    core: ClusterCore,
    engine_keys: Keys | None,
    request_keys: Keys,
    entries: Entries,
    ttl: float | None = None,
) -> WaveOp[None]:
    """``Index.add``: one segment per shard of the entries' pods (one call per node)."""
    eng, req, ents = check_add(engine_keys, request_keys, entries)
    seconds = check_ttl(ttl, ents)
    ttl_ms = 0 if seconds is None else max(1, math.ceil(seconds * 1000))
    segments = add_segments(eng, req, ents, core.pod_shard, ttl_ms)
    yield from op_write_segments(core, segments)


def op_cluster_evict(
    core: ClusterCore, key: int, key_type: KeyType, entries: Entries
) -> WaveOp[None]:
    """``Index.evict``: on each shard of the entries' pods, the single-server evict (by engine
    key through that shard's mapping: every shard keeps the mappings its pods' adds made)."""
    k = check_hash(key, "evict key")
    kt = check_key_type(key_type)
    ents = check_entries(entries)
    yield from op_write_segments(core, evict_segments(k, kt, ents, core.pod_shard))


def op_cluster_get_watermark(core: ClusterCore, stream: str) -> WaveOp[Watermark | None]:
    """The stream's watermark: the highest of the shards' (a stream's batches go to the shard
    of its pod; the other shards hold older ones, or none)."""
    name = check_stream(stream)
    found = yield from on_every_shard(core, lambda s: op_get_watermark(s, name))
    marks = [m for m in found.values() if m is not None]
    return max(marks) if marks else None


def op_cluster_reset_watermark(
    core: ClusterCore, stream: str, watermark: Watermark | None
) -> WaveOp[None]:
    """Overwrite (or delete) the stream's watermark on every shard."""
    name = check_stream(stream)
    yield from on_every_shard(core, lambda s: op_reset_watermark(s, name, watermark))
    core.stream_homes.pop(name, None)

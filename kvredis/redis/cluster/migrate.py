"""Converting a cluster namespace of the key layout (``kvredis-cluster/1``) to the pod layout
(``kvredis-cluster/2``) in place, online: ``kvredis migrate`` on a cluster address.

The shards stay (same names, same count, same slots); what moves is each pod's entries, from the
shards their request keys hashed to, to the pod's shard, and the engine-key mappings, from the
engine key's shard to the shards of the pods that use them.

While the descriptor names the key layout, this kvredis reads and writes the namespace as one
being converted (:mod:`.ops`, :mod:`.writes`): an add goes to the pod's shard only; an evict
(or clear) reaches the entries' old places first, then raises the pod's counter in the pod's
shard (``<shard>:mv``), then reaches the pod's shard; a read merges every shard's entries key by
key and scores them on the client; no mapping is dropped. The mover:

1. for each shard ``i``, page by page (``SCAN`` of its request buckets, then of its expiring
   buckets): reads the counters of every shard, then the page's pairs (runs resolved, ids
   defined, retired ids left out), and stores the pairs of each pod placed on another shard
   ``j`` there (``lua/move_pairs.lua``: unless the pod's counter moved since it was read, which
   means an evict or clear of the pod reached ``j`` meanwhile: the page is read again), then
   evicts them from ``i``. A pair is in ``i``, or in ``j``, or both, at every moment, so a read
   sees every entry; an evict reaching ``i`` before ``j`` (in that order) cannot be undone by
   a copy. Expiring entries keep their deadline (their remaining ttl);
2. for each shard, page by page (its engine buckets): copies every mapping into every other
   shard as older than the shard's own (``lua/move_mappings.lua``);
3. in every shard, drops the mappings none of whose request keys holds an entry there (the
   single-server clear's mapping pass: each shard now maps its own pods' keys), deletes the
   counters, and names the pod layout in the descriptor: clients read it again within
   :data:`DESCRIPTOR_REFRESH_SECONDS` and go to one call per node.

The descriptor's ``move`` field records where the mover is (shard, phase, ``SCAN`` cursor), so a
migration cut short goes on where it stopped when run again; every step is idempotent. The pairs
it moves are stored one record per request key (their chain order is lost with the key
layout's runs); the pods' next stores form runs again.

Clients of kvredis before the pod layout must be stopped (or upgraded) before migrating: they
place entries by key hash whatever the descriptor says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvredis.checks import MAX_REQUEST_KEYS_PER_ENGINE_KEY
from kvredis.errors import NamespaceLayoutError, NamespaceMissingError
from kvredis.redis.cluster.core import ClusterCore, on_shards, slot_command
from kvredis.redis.cluster.routing import WaveOp
from kvredis.redis.cluster.shards import (
    CLUSTER_LAYOUT,
    KEY_LAYOUT,
    Descriptor,
    descriptor_key,
    parse_descriptor,
    shard_slot,
)
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    REF_WIDTH,
    decode_entry,
    decode_ref,
    decode_run,
    text_bytes,
)
from kvredis.redis.layout import EXPIRING_ITEM_WIDTH, Layout
from kvredis.redis.ops import op_reclaim
from kvredis.redis.program import Program, Programs, programs_of
from kvredis.redis.requests import Command, Op, Pipeline, ScriptCall
from kvredis.redis.state import CoreState
from kvredis.types import KeyType, PodEntry

T = TypeVar("T")

#: Bucket keys one page of the mover reads (each a HGETALL).
BUCKETS_PER_PAGE = 32
#: Times a page is read again because an evict of its pods raced the copy, before giving up.
PAGE_ATTEMPTS = 20
#: Seconds a client converting a namespace goes before reading its descriptor again.
DESCRIPTOR_REFRESH_SECONDS = 5.0
#: The phases of one shard, in order: request buckets, expiring buckets, engine buckets.
PHASES = ("r", "s", "e")

#: progress(done, total): shards done, of ``total``.
MoveProgress = Callable[[int, int], None]


def _noop(_done: int, _total: int) -> None:
    return None


@dataclass
class ClusterMigrationReport:
    """What :func:`op_cluster_migrate` did: the layout converted from (``None``: the namespace
    was in the pod layout already), whether it resumed a migration cut short, the pairs and
    mappings copied, the pages read again because of a racing evict, and the seconds taken."""

    namespace: str
    shards: int
    source: str | None
    resumed: bool = False
    pairs: int = 0
    expiring: int = 0
    mappings: int = 0
    retried_pages: int = 0
    dropped_mappings: int = 0
    seconds: float = 0.0

    @property
    def migrated(self) -> bool:
        return self.source is not None


@dataclass(frozen=True, slots=True)
class Where:
    """The mover's place: shard, phase, ``SCAN`` cursor (``final``: every shard is done)."""

    shard: int
    phase: str
    cursor: int
    final: bool = False

    def text(self) -> str:
        return "final" if self.final else f"{self.shard}:{self.phase}:{self.cursor}"

    @classmethod
    def parse(cls, raw: object) -> Where:
        text = bytes(raw).decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        if text == "final":
            return cls(0, "", 0, True)
        try:
            shard, phase, cursor = text.split(":")
            if phase not in PHASES:
                raise ValueError(phase)
            return cls(int(shard), phase, int(cursor))
        except ValueError:
            raise NamespaceLayoutError(f"malformed migration progress {text!r}") from None


@dataclass
class Page:
    """One page of a shard's buckets, read: pairs by target shard, and what it saw."""

    cursor: int
    #: target shard -> (request key, entry, deadline ms or 0) to copy there
    pairs: dict[int, list[tuple[int, PodEntry, int]]] = field(default_factory=dict)
    #: engine key -> its mapping (request keys blob)
    mappings: dict[bytes, bytes] = field(default_factory=dict)


# -- reading a shard's page ---------------------------------------------------------------------


def _scan(cursor: int, pattern: bytes) -> Command:
    return Command(("SCAN", cursor, "MATCH", pattern, "COUNT", BUCKETS_PER_PAGE))


def _items(reply: Any) -> list[tuple[bytes, bytes]]:
    if isinstance(reply, dict):
        return [(bytes(k), bytes(v)) for k, v in reply.items()]
    return [(bytes(reply[i]), bytes(reply[i + 1])) for i in range(0, len(reply) - 1, 2)]


def _op_read_page(
    state: CoreState, shard: int, phase: str, cursor: int, shard_of: Callable[[str], int]
) -> Op[Page]:
    """One page of shard ``shard``'s buckets of ``phase``: the pairs of pods placed elsewhere
    (request and expiring buckets), or the mappings (engine buckets)."""
    layout = state.layout
    pattern = {
        "r": layout.request_pattern(),
        "s": layout.expiring_pattern(),
        "e": layout.engine_pattern(),
    }[phase]
    next_cursor, keys = yield _scan(cursor, pattern)
    page = Page(int(next_cursor))
    if not keys:
        return page
    buckets = yield Pipeline(tuple(Command(("HGETALL", k)) for k in keys))
    fields = [item for reply in buckets for item in _items(reply)]
    if phase == "e":
        page.mappings = {
            f: v for f, v in fields if len(f) == HASH_WIDTH and v and len(v) % HASH_WIDTH == 0
        }
        return page
    now = 0
    held: list[tuple[bytes, bytes, int]] = []  # request key, ids, deadline (0: none)
    if phase == "r":
        refs = [(f, v) for f, v in fields if len(f) == HASH_WIDTH and len(v) == REF_WIDTH]
        held += [
            (f, v, 0)
            for f, v in fields
            if len(f) == HASH_WIDTH and len(v) != REF_WIDTH and v and len(v) % ID_WIDTH == 0
        ]
        runs = sorted({decode_ref(v)[0] for _, v in refs})
        if runs:
            records = yield Pipeline(
                tuple(Command(("HMGET", layout.run_key(r), "k", "r")) for r in runs)
            )
            decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
            for run, (run_keys, ranges) in zip(runs, records, strict=True):
                if run_keys is not None and ranges is not None:
                    try:
                        decoded[run] = decode_run(bytes(run_keys), bytes(ranges))
                    except NamespaceLayoutError:
                        continue
            for f, v in refs:
                run, pos = decode_ref(v)
                positions = decoded.get(run, [])
                if 1 <= pos <= len(positions) and positions[pos - 1][0] == f:
                    run_ids = positions[pos - 1][1]
                    if run_ids:
                        held.append((f, run_ids, 0))
    else:
        clock = yield Command(("TIME",))
        now = int(clock[0]) * 1000 + int(clock[1]) // 1000
        width = EXPIRING_ITEM_WIDTH
        for f, items in fields:
            if len(f) != HASH_WIDTH or len(items) % width:
                continue
            for at in range(0, len(items), width):
                deadline = int.from_bytes(items[at + ID_WIDTH : at + width], "big")
                if deadline > now:
                    held.append((f, items[at : at + ID_WIDTH], deadline - now))
    ids = sorted({v[i : i + ID_WIDTH] for _, v, _ in held for i in range(0, len(v), ID_WIDTH)})
    if not ids:
        return page
    definitions = yield Command(("HMGET", layout.pi, *ids))
    retired = yield Command(("HVALS", layout.pr))
    gone = {r[i : i + ID_WIDTH] for r in retired for i in range(0, len(r), ID_WIDTH)}
    entries: dict[bytes, PodEntry] = {}
    for entry_id, encoded in zip(ids, definitions, strict=True):
        if encoded and entry_id not in gone:
            try:
                entries[entry_id] = decode_entry(bytes(encoded))
            except NamespaceLayoutError:
                continue
    for f, v, ttl in held:
        key = int.from_bytes(f, "big")
        for i in range(0, len(v), ID_WIDTH):
            entry = entries.get(v[i : i + ID_WIDTH])
            if entry is None:
                continue
            target = shard_of(entry.pod_identifier)
            if target != shard:
                page.pairs.setdefault(target, []).append((key, entry, ttl))
    return page


# -- writing a page's pairs and mappings --------------------------------------------------------


def _op_counters(state: CoreState) -> Op[dict[bytes, bytes]]:
    reply = yield Command(("HGETALL", state.layout.mv))
    return dict(_items(reply))


def _copy_programs(
    layout: Layout, pairs: Sequence[tuple[int, PodEntry, int]]
) -> list[tuple[int, Program]]:
    """The pairs as add programs for the target's layout, grouped by ttl and entry: (ttl ms,
    program) each."""
    by_ttl: dict[int, dict[PodEntry, list[int]]] = {}
    for key, entry, ttl in pairs:
        by_ttl.setdefault(ttl, {}).setdefault(entry, []).append(key)
    out: list[tuple[int, Program]] = []
    for ttl, groups in sorted(by_ttl.items()):
        units: list[tuple[Any, ...]] = [("A", keys, [], [e]) for e, keys in groups.items()]
        out += [(ttl, program) for program in programs_of(layout, units) if program.count]
    return out


def _op_copy_pairs(
    state: CoreState, pairs: Sequence[tuple[int, PodEntry, int]], seen: Mapping[bytes, bytes]
) -> Op[set[str]]:
    """Store ``pairs`` in this (target) shard unless their pods' counters moved since ``seen``
    was read; the pods whose counters moved (their pairs are not stored: read again)."""
    layout = state.layout
    pods = sorted({text_bytes(entry.pod_identifier) for _, entry, _ in pairs})
    checks: list[Any] = [len(pods)]
    for pod in pods:
        checks += (pod, seen.get(pod, b""))
    moved: set[str] = set()
    for ttl, program in _copy_programs(layout, pairs):
        reply = yield ScriptCall(
            "move_pairs",
            (layout.meta, layout.pe, layout.pi, layout.pp, layout.sx, layout.mv),
            [
                *program.bucket_args(),
                MAX_REQUEST_KEYS_PER_ENGINE_KEY,
                ttl,
                *checks,
                *program.entry_args(),
                program.count,
                *program.ops,
            ],
        )
        moved |= {bytes(p).decode("utf-8", "surrogatepass") for p in reply}
        if moved:
            break
    return moved


def _op_evict_moved(state: CoreState, pairs: Sequence[tuple[int, PodEntry, int]]) -> Op[None]:
    """Evict the moved pairs from the shard they were read from."""
    programs = Programs(state.layout)
    by_key: dict[int, list[PodEntry]] = {}
    for key, entry, _ in pairs:
        by_key.setdefault(key, []).append(entry)
    for key, entries in by_key.items():
        programs.evict(key, KeyType.REQUEST, entries)
    for program in programs.items:
        if program.count:
            layout = program.layout
            yield ScriptCall(
                "evict",
                (layout.meta, layout.pe, layout.sx),
                [*program.bucket_args(), *program.entry_args(), program.count, *program.ops],
            )


def _op_copy_mappings(state: CoreState, mappings: Mapping[bytes, bytes]) -> Op[int]:
    layout = state.layout
    written = 0
    items = sorted(mappings.items())
    for start in range(0, len(items), 256):
        args: list[Any] = [layout.gen, layout.eprefix, layout.bucket_bits]
        args.append(MAX_REQUEST_KEYS_PER_ENGINE_KEY)
        for engine, keys in items[start : start + 256]:
            args += (engine, keys)
        written += int((yield ScriptCall("move_mappings", (layout.meta,), args)))
    return written


def _op_drop_unheld(state: CoreState) -> Op[int]:
    """The single-server clear's mapping pass over one shard: the mappings none of whose
    request keys holds an entry there are dropped; the number dropped."""
    layout = state.layout
    dropped = 0
    cursor: int | None = None
    while cursor != 0:
        reply = yield _scan(cursor or 0, layout.engine_pattern())
        cursor, keys = int(reply[0]), list(reply[1])
        if keys:
            result = yield ScriptCall(
                "clear_mappings",
                (layout.meta, layout.sx, *keys),
                (layout.gen, layout.rprefix, layout.bucket_bits),
            )
            dropped += int(result[0])
    return dropped


# -- the migration ------------------------------------------------------------------------------


def op_read_descriptor(core: ClusterCore) -> WaveOp[tuple[Descriptor | None, bytes | None]]:
    """The namespace's descriptor and the mover's progress (``None``: none recorded)."""
    desc = descriptor_key(core.namespace)
    reply = yield from slot_command(core, shard_slot(desc.decode()), "HMGET", desc, "layout",
                                    "shards", "move")  # fmt: skip
    found = parse_descriptor(list(reply[:2]), core.namespace)
    return found, reply[2]


def _set_progress(core: ClusterCore, where: Where) -> WaveOp[None]:
    desc = descriptor_key(core.namespace)
    yield from slot_command(core, shard_slot(desc.decode()), "HSET", desc, "move", where.text())


def op_cluster_migrate(
    core: ClusterCore, progress: MoveProgress = _noop
) -> WaveOp[ClusterMigrationReport]:
    """Convert the (connected) namespace of ``core`` to the pod layout (see the module
    docstring); a namespace of the pod layout is left alone."""
    started = time.monotonic()
    found, moving = yield from op_read_descriptor(core)
    if found is None:
        raise NamespaceMissingError(f"cluster namespace {core.namespace!r} does not exist")
    count = found.shards
    report = ClusterMigrationReport(core.namespace, count, None)
    if found.layout == CLUSTER_LAYOUT:
        report.seconds = time.monotonic() - started
        return report
    report.source = KEY_LAYOUT
    core.descriptor = found
    core.adopt(count)
    where = Where(0, PHASES[0], 0) if moving is None else Where.parse(moving)
    report.resumed = moving is not None
    if moving is None:
        yield from _set_progress(core, where)
    while not where.final:
        progress(where.shard, count)
        where = yield from _op_step(core, where, report)
        yield from _set_progress(core, where)
    progress(count, count)
    yield from on_shards(core, {s: _forgetter(s, core.pod_shard) for s in range(count)})
    dropped = yield from on_shards(core, dict.fromkeys(range(count), _op_drop_unheld))
    report.dropped_mappings = sum(dropped.values())
    yield from on_shards(core, dict.fromkeys(range(count), _op_delete_counters))
    desc = descriptor_key(core.namespace)
    slot = shard_slot(desc.decode())
    yield from slot_command(core, slot, "HSET", desc, "layout", CLUSTER_LAYOUT)
    yield from slot_command(core, slot, "HDEL", desc, "move")
    core.descriptor = Descriptor(CLUSTER_LAYOUT, count)
    report.seconds = time.monotonic() - started
    return report


def _forgetter(shard: int, shard_of: Callable[[str], int]) -> Callable[[CoreState], Op[None]]:
    """Delete from one shard's entry dictionary the definitions of pods placed elsewhere (their
    pairs moved: no key of the shard holds them), as a clear's last step does."""

    def op(state: CoreState) -> Op[None]:
        layout = state.layout
        names = yield Pipeline((Command(("HKEYS", layout.pp)), Command(("HKEYS", layout.pr))))
        pods = sorted({bytes(p) for reply in names for p in reply})
        for raw in pods:
            pod = raw.decode("utf-8", "surrogatepass")
            if shard_of(pod) == shard:
                continue
            keys = (layout.meta, layout.pe, layout.pi, layout.pp, layout.pr)
            ids = yield ScriptCall("retire", keys, (layout.gen, raw))
            if ids:
                yield from op_reclaim(state, pod, bytes(ids))

    return op


def _op_delete_counters(state: CoreState) -> Op[None]:
    yield Command(("DEL", state.layout.mv))


def _next(where: Where, cursor: int, count: int) -> Where:
    if cursor:
        return Where(where.shard, where.phase, cursor)
    phase = PHASES.index(where.phase) + 1
    if phase < len(PHASES):
        return Where(where.shard, PHASES[phase], 0)
    if where.shard + 1 < count:
        return Where(where.shard + 1, PHASES[0], 0)
    return Where(0, "", 0, True)


def _op_step(core: ClusterCore, where: Where, report: ClusterMigrationReport) -> WaveOp[Where]:
    """One page of the mover; where it goes on."""
    shard, phase = where.shard, where.phase
    for _ in range(PAGE_ATTEMPTS):
        counters = {}
        if phase != "e":
            counters = yield from on_shards(core, dict.fromkeys(range(core.count), _op_counters))

        def reader(state: CoreState) -> Op[Page]:
            return _op_read_page(state, shard, phase, where.cursor, core.pod_shard)

        page = (yield from on_shards(core, {shard: reader}))[shard]
        if phase == "e":
            if page.mappings:
                targets = [s for s in range(core.count) if s != shard]
                mappings = page.mappings
                done = yield from on_shards(
                    core,
                    dict.fromkeys(targets, _mapping_copier(mappings)),
                )
                report.mappings += len(page.mappings) if done else 0
            return _next(where, page.cursor, core.count)
        if not page.pairs:
            return _next(where, page.cursor, core.count)
        copies = {target: _copier(pairs, counters[target]) for target, pairs in page.pairs.items()}
        moved = yield from on_shards(core, copies)
        stored = [p for target, pairs in page.pairs.items() if not moved[target] for p in pairs]
        if stored:
            yield from on_shards(core, {shard: _evicter(stored)})
            if phase == "r":
                report.pairs += len(stored)
            else:
                report.expiring += len(stored)
        if not any(moved.values()):
            return _next(where, page.cursor, core.count)
        report.retried_pages += 1  # an evict raced the copy: read the page again
    raise NamespaceLayoutError(
        f"shard {shard} of {core.namespace!r}: evicts kept racing the copy of one page "
        f"({PAGE_ATTEMPTS} attempts); run kvredis migrate again"
    )


def _mapping_copier(mappings: Mapping[bytes, bytes]) -> Callable[[CoreState], Op[int]]:
    return lambda state: _op_copy_mappings(state, mappings)


def _evicter(pairs: Sequence[tuple[int, PodEntry, int]]) -> Callable[[CoreState], Op[None]]:
    return lambda state: _op_evict_moved(state, pairs)


def _copier(
    pairs: Sequence[tuple[int, PodEntry, int]], seen: Mapping[bytes, bytes]
) -> Callable[[CoreState], Op[set[str]]]:
    return lambda state: _op_copy_pairs(state, pairs, seen)


def op_converting(core: ClusterCore, op: WaveOp[T]) -> WaveOp[T]:
    """``op``, after reading the descriptor again when the namespace is in the key layout and
    it was last read :data:`DESCRIPTOR_REFRESH_SECONDS` ago or more: once the mover named the
    pod layout, the client reads and writes as in it."""
    now = core.clock()
    if not core.by_pod and now - core.descriptor_read_at >= DESCRIPTOR_REFRESH_SECONDS:
        core.descriptor_read_at = now
        try:
            found, _ = yield from op_read_descriptor(core)
        except BaseException:
            op.close()
            raise
        if found is not None and found.shards == core.count:
            core.descriptor = found
    return (yield from op)

"""``kvredis check``: the layout's invariants, verified and repaired.

The invariants :func:`op_check` verifies (``repair=True`` also fixes them). Every one of these
is a state no call of the index API produces (a foreign write, a lost key, a bug):

=========================  ===============================================  =====================
problem                    what it means                                    repair
=========================  ===============================================  =====================
``missing_pe``             ``pi`` defines an id ``pe`` does not point to    add it to ``pe``
``missing_pi``             ``pe`` names an id ``pi`` does not define        define it from ``pe``
``undecodable_entry``      a ``pi`` definition that does not decode         drop the id
``pod_record_missing``     an id missing from its pod's ``pp`` list         append it
``pod_record_stray``       a ``pp`` (or ``pr``: retired) id undefined or    remove it
                           of another pod
``duplicate_definition``   two ids define the same entry                    (reported only)
``empty_field``            a bucket field with nothing in it                delete the field
``malformed_field``        a field or value of the wrong shape              delete the field
``unknown_id``             a request key (or run range) holding an          remove the id
                           undefined id
``duplicate_id``           an id listed twice under one request key         keep one
``misplaced_field``        a field in a bucket its hash does not select     move it
``wrong_type``             a key of the layout that is not a hash (``sx``:  (reported only)
                           a string)
``no_expiry``              an expiring bucket (or field, with hash field    set it to the latest
                           expiry) the server would never delete            deadline held
``expiry_gate``            the gate ``sx`` ends before an expiring entry    move it to the latest
                           (lookups would not see that entry)               deadline
``malformed_run``          a run whose fields do not decode                 delete it and its refs
``dangling_ref``           a ref to a run position that is not its key's,   delete the ref
                           or holds nothing
``unreferenced_position``  a held run position its key does not point to    point the key at it,
                                                                            or make it a hole
``held_twice``             an id held under a request key both in its       remove the expiring
                           request record (inline or run) and as an         item
                           expiring entry
=========================  ===============================================  =====================

Three kinds are notes (:data:`INFORMATIONAL`, in :attr:`CheckReport.notes`): states the API does
produce, reported for the operator's information, never a failure:

- ``dangling_mapping``: an engine key none of whose request keys holds an entry any more (an
  evict by request key leaves the mapping, as the reference index does; ``get_request_key``
  still answers it, so a repair never drops it; ``clear`` drops such mappings);
- ``expired_speculative``: expiring entries past their deadline still stored in a field or
  bucket that holds a later deadline (reads skip them; the server deletes them with the latest
  deadline). ``--repair`` reclaims them (the reference no longer holds them);
- ``clear_pending``: a pod with retired entry ids (``pr``): a clear of it is under way, or was
  interrupted; running that pod's clear again finishes it (nothing to repair).

Repairs are plain commands, not one atomic step: run ``check --repair`` while no writer uses the
namespace (stop the ingesters first), or a concurrent write may be undone.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvredis.errors import NamespaceLayoutError
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    REF_WIDTH,
    decode_entry,
    decode_ref,
    decode_run,
    encode_ref,
    encode_run,
)
from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    EXPIRY_FIELD,
    Layout,
    expiring_item_deadline,
)
from kvredis.redis.reading import (
    KEYS_PER_PIPELINE,
    Dictionary,
    ScanProgress,
    chunks,
    fixed_keys,
    no_progress,
    op_dictionary,
    op_namespace_keys,
    op_read_hashes,
    split_hashes,
    split_ids,
    type_name,
)
from kvredis.redis.requests import Command, Op, Pipeline
from kvredis.types import PodEntry


class Problem(enum.Enum):
    """What :func:`op_check` can find (see the module docstring)."""

    MISSING_PE = "missing_pe"
    MISSING_PI = "missing_pi"
    UNDECODABLE_ENTRY = "undecodable_entry"
    POD_RECORD_MISSING = "pod_record_missing"
    POD_RECORD_STRAY = "pod_record_stray"
    DUPLICATE_DEFINITION = "duplicate_definition"
    EMPTY_FIELD = "empty_field"
    MALFORMED_FIELD = "malformed_field"
    UNKNOWN_ID = "unknown_id"
    DUPLICATE_ID = "duplicate_id"
    MISPLACED_FIELD = "misplaced_field"
    DANGLING_MAPPING = "dangling_mapping"
    WRONG_TYPE = "wrong_type"
    EXPIRED_SPECULATIVE = "expired_speculative"
    NO_EXPIRY = "no_expiry"
    EXPIRY_GATE = "expiry_gate"
    MALFORMED_RUN = "malformed_run"
    DANGLING_REF = "dangling_ref"
    UNREFERENCED_POSITION = "unreferenced_position"
    HELD_TWICE = "held_twice"
    CLEAR_PENDING = "clear_pending"


#: The kinds :func:`op_check` reports as notes: states the index API produces (see the module
#: docstring); never a failure.
INFORMATIONAL = frozenset(
    {Problem.DANGLING_MAPPING, Problem.EXPIRED_SPECULATIVE, Problem.CLEAR_PENDING}
)


class ClearScope(NamedTuple):
    """What an unfinished clear was removing: the tiers and data-parallel ranks of the retired
    entries (``clear_pending``)."""

    tiers: tuple[str, ...]
    dp_ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Finding:
    """One broken invariant: where, what, and whether it was repaired."""

    problem: Problem
    key: bytes
    field: bytes | None
    detail: str
    repaired: bool = False
    shard: int | None = None
    """On a cluster: the shard whose key it is (the key name carries the shard's hash tag)."""
    scope: ClearScope | None = None
    """For ``clear_pending``: what the unfinished clear was removing."""

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (key and field as text, non-UTF-8 bytes escaped; ``shard`` only on
        a cluster)."""
        out: dict[str, Any] = {
            "problem": self.problem.value,
            "key": show_bytes(self.key),
            "field": None if self.field is None else self.field.hex(),
            "detail": self.detail,
            "repaired": self.repaired,
        }
        if self.shard is not None:
            out["shard"] = self.shard
        if self.scope is not None:
            out["scope"] = {"tiers": list(self.scope.tiers), "dp_ranks": list(self.scope.dp_ranks)}
        return out


def show_bytes(data: bytes) -> str:
    """Key bytes as printable text: UTF-8 where it decodes, Python escapes (``\\x00``) for the
    rest and for control characters (bucket suffixes are binary)."""
    text = data.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


@dataclass
class CheckReport:
    """The outcome of :func:`op_check`."""

    namespace: str
    keys_checked: int = 0
    findings: list[Finding] = field(default_factory=list)
    """Broken invariants: states no call of the index API produces."""
    notes: list[Finding] = field(default_factory=list)
    """Legitimate states worth knowing (:data:`INFORMATIONAL`); never a failure."""

    @property
    def ok(self) -> bool:
        """Whether nothing is left broken (no finding, or every finding repaired)."""
        return all(f.repaired for f in self.findings)

    def counts(self) -> dict[str, int]:
        """Findings per problem."""
        return dict(sorted(Tally(f.problem.value for f in self.findings).items()))

    def note_counts(self) -> dict[str, int]:
        """Notes per kind."""
        return dict(sorted(Tally(f.problem.value for f in self.notes).items()))


def merge_checks(namespace: str, shards: Sequence[CheckReport]) -> CheckReport:
    """The check of a cluster namespace: every shard's findings and notes, each naming its
    shard (shard order), and the keys checked summed."""
    merged = CheckReport(namespace)
    for i, report in enumerate(shards):
        merged.keys_checked += report.keys_checked
        merged.findings += [dataclasses.replace(f, shard=i) for f in report.findings]
        merged.notes += [dataclasses.replace(f, shard=i) for f in report.notes]
    return merged


class _Checker:
    """Collects findings and the commands that repair them."""

    def __init__(self, layout: Layout, repair: bool) -> None:
        self.layout = layout
        self.repair = repair
        self.findings: list[Finding] = []
        self.notes: list[Finding] = []
        self.fixes: list[Command] = []
        self.fields_expire = False
        """Whether expiring entries use hash field expiry (HSET drops a field's expiry)."""
        self.foreign: set[bytes] = set()
        """Keys of the layout holding another type: reported, never written to."""
        self._fixing: set[Command] = set()

    def found(
        self,
        problem: Problem,
        key: bytes,
        fld: bytes | None,
        detail: str,
        *fix: Command,
        scope: ClearScope | None = None,
    ) -> None:
        """Record a finding (a note for the :data:`INFORMATIONAL` kinds); with ``repair``, and
        unless a fix writes to a foreign key, queue its fix (a command once)."""
        writable = not any(f.args[1] in self.foreign for f in fix)
        fixable = bool(fix) and self.repair and writable
        found = Finding(problem, key, fld, detail, fixable, scope=scope)
        (self.notes if problem in INFORMATIONAL else self.findings).append(found)
        if fixable:
            for command in fix:  # a run rewrite repairs several findings: written once
                if command not in self._fixing:
                    self._fixing.add(command)
                    self.fixes.append(command)


def _check_dictionary(c: _Checker, d: Dictionary) -> set[bytes]:
    """Check ``pe``/``pi``/``pp``; returns the ids that stay defined after repair."""
    lay = c.layout
    for entry_id, why in d.undecodable.items():
        fixes = [Command(("HDEL", lay.pi, entry_id))]
        enc = d.pi[entry_id]
        if d.pe.get(enc) == entry_id:
            fixes.append(Command(("HDEL", lay.pe, enc)))
        c.found(Problem.UNDECODABLE_ENTRY, lay.pi, entry_id, why, *fixes)
    seen: dict[bytes, bytes] = {}
    retired = d.retired()
    for entry_id, enc in sorted(d.pi.items()):
        if entry_id in d.undecodable:
            continue
        if entry_id in retired:  # out of pe, and maybe defined again under a new id
            continue
        if enc in seen:
            c.found(
                Problem.DUPLICATE_DEFINITION,
                lay.pi,
                entry_id,
                f"defines the same entry as id {seen[enc].hex()}",
            )
        seen.setdefault(enc, entry_id)
        if enc not in d.pe:
            c.found(
                Problem.MISSING_PE,
                lay.pe,
                enc,
                f"entry {d.entries[entry_id]} (id {entry_id.hex()}) is not in pe",
                Command(("HSET", lay.pe, enc, entry_id)),
            )
    defined = set(d.entries)
    for enc, entry_id in d.pe.items():
        if entry_id not in d.pi:
            try:
                entry: PodEntry | None = decode_entry(enc)
            except NamespaceLayoutError:
                entry = None
            if entry is not None and len(entry_id) == ID_WIDTH:
                c.found(
                    Problem.MISSING_PI,
                    lay.pi,
                    entry_id,
                    f"id of {entry} is not defined in pi",
                    Command(("HSETNX", lay.pi, entry_id, enc)),
                )
                if c.repair:
                    d.entries[entry_id] = entry
                    defined.add(entry_id)
            else:
                c.found(
                    Problem.MALFORMED_FIELD,
                    lay.pe,
                    enc,
                    "pe maps an undecodable entry to an undefined id",
                    Command(("HDEL", lay.pe, enc)),
                )
    _check_pod_records(c, d, defined, retired)
    return defined if c.repair else set(d.entries)


def _check_pod_records(
    c: _Checker, d: Dictionary, defined: set[bytes], retired: set[bytes]
) -> None:
    """Check the pods' records: their retired ids (``pr``), then their ids (``pp``)."""
    _check_retired_records(c, d, defined)
    _check_pod_lists(c, d, defined, retired)


def _owned_by(d: Dictionary, defined: set[bytes], pod: bytes) -> Callable[[bytes], bool]:
    """Whether an id is defined, as an entry of ``pod``."""
    return lambda i: (
        i in defined and d.entries[i].pod_identifier.encode("utf-8", "surrogatepass") == pod
    )


def _check_retired_records(c: _Checker, d: Dictionary, defined: set[bytes]) -> None:
    """A pod with retired ids is a clear under way (a note); a retired id must be defined, as an
    entry of that pod."""
    lay = c.layout
    for pod, stored in sorted(d.pr.items()):
        ids = split_ids(stored) if len(stored) % ID_WIDTH == 0 else []
        if ids:
            retired_entries = [d.entries[i] for i in ids if i in d.entries]
            tiers = tuple(sorted({e.device_tier for e in retired_entries}))
            ranks = tuple(sorted({e.dp_rank for e in retired_entries}))
            c.found(
                Problem.CLEAR_PENDING,
                lay.pr,
                pod,
                f"pod {show_bytes(pod)!r}: a clear of it is under way or was interrupted "
                f"({len(ids)} retired entries, tiers {', '.join(tiers) or '-'}); if no clear of "
                "it runs, run that clear again",
                scope=ClearScope(tiers, ranks),
            )
        owned = _owned_by(d, defined, pod)
        stray = [i for i in ids if not owned(i)]
        if stray or len(stored) % ID_WIDTH:
            kept = [i for i in dict.fromkeys(ids) if i not in stray]
            c.found(
                Problem.POD_RECORD_STRAY,
                lay.pr,
                pod,
                f"pod {show_bytes(pod)!r} has {len(stray)} retired ids it does not own",
                Command(("HSET", lay.pr, pod, b"".join(kept)))
                if kept
                else Command(("HDEL", lay.pr, pod)),
            )


def _check_pod_lists(c: _Checker, d: Dictionary, defined: set[bytes], retired: set[bytes]) -> None:
    """A pod's list (``pp``) holds exactly its defined ids that are not retired."""
    lay = c.layout
    expected: dict[bytes, list[bytes]] = {}
    for entry_id in sorted(defined - retired):
        pod = d.entries[entry_id].pod_identifier.encode("utf-8", "surrogatepass")
        expected.setdefault(pod, []).append(entry_id)
    for pod in sorted(set(expected) | set(d.pp)):
        stored = d.pp.get(pod, b"")
        ids = split_ids(stored) if len(stored) % ID_WIDTH == 0 else []
        want = expected.get(pod, [])
        owned = _owned_by(d, defined, pod)
        stray = [i for i in ids if not owned(i)]
        missing = [i for i in want if i not in ids]
        if not stray and not missing and len(stored) % ID_WIDTH == 0:
            continue
        kept = [i for i in dict.fromkeys(ids) if i not in stray] + missing
        fix = (
            Command(("HSET", lay.pp, pod, b"".join(kept)))
            if kept
            else Command(("HDEL", lay.pp, pod))
        )
        name = show_bytes(pod)
        if stray or len(stored) % ID_WIDTH:
            c.found(
                Problem.POD_RECORD_STRAY,
                lay.pp,
                pod,
                f"pod {name!r} lists {len(stray)} ids it does not own",
                *([] if missing else [fix]),
            )
        if missing:
            c.found(
                Problem.POD_RECORD_MISSING,
                lay.pp,
                pod,
                f"pod {name!r} does not list {len(missing)} of its ids",
                fix,
            )


def _well_formed(c: _Checker, key: bytes, fld: bytes, value: bytes, width: int, kind: str) -> bool:
    """A bucket field must be an 8-byte hash holding a non-empty list of ``width``-byte items."""
    if len(fld) == HASH_WIDTH and value and len(value) % width == 0:
        return True
    if len(fld) != HASH_WIDTH or len(value) % width:
        detail = f"{kind} field of {len(fld)} bytes with a {len(value)}-byte list"
        c.found(Problem.MALFORMED_FIELD, key, fld, detail, Command(("HDEL", key, fld)))
    else:
        detail = f"{kind} key holding nothing"
        c.found(Problem.EMPTY_FIELD, key, fld, detail, Command(("HDEL", key, fld)))
    return False


#: A chain run as decoded (:func:`~kvredis.redis.codec.decode_run`): per position, in order,
#: the request key stored there and its ids (empty: a hole).
Run = list[tuple[bytes, bytes]]


class RunPosition(NamedTuple):
    """A position of a chain run (1-based), as a ref names it."""

    run_id: bytes
    position: int


class RefField(NamedTuple):
    """A request key held through a run: the request bucket holding its ref, and the ref."""

    bucket: bytes
    ref: bytes


class ExpiringField(NamedTuple):
    """A field of an expiring bucket: the bucket, and its items (entry id + deadline each)."""

    bucket: bytes
    items: bytes


class EngineMapping(NamedTuple):
    """A well-formed engine mapping: its engine bucket, engine key field and request keys."""

    bucket: bytes
    field: bytes
    request_keys: list[bytes]


class ExpiryProbe(NamedTuple):
    """What must expire by itself by ``deadline``: an expiring bucket key, or one of its
    fields where fields expire (``field`` set)."""

    key: bytes
    field: bytes | None
    deadline: int


class _RunFinding(NamedTuple):
    """A finding of a run position, reported once the run's rewrite is known."""

    problem: Problem
    field: bytes
    detail: str
    fix: list[Command]


def _check_request_bucket(
    c: _Checker,
    key: bytes,
    fields: dict[bytes, bytes],
    defined: set[bytes],
    refs: dict[bytes, RefField],
) -> None:
    lay = c.layout
    for fld, value in fields.items():
        if len(fld) == HASH_WIDTH and len(value) == REF_WIDTH:
            refs[fld] = RefField(key, value)  # checked against the runs (_check_runs)
            continue
        if not _well_formed(c, key, fld, value, ID_WIDTH, "request"):
            continue
        ids = split_ids(value)
        kept = [i for i in dict.fromkeys(ids) if i in defined]
        unknown = [i for i in ids if i not in defined]
        home = lay.request_bucket(int.from_bytes(fld, "big"))
        new_value = b"".join(kept)
        write = (
            [Command(("HDEL", key, fld))] if not kept else [Command(("HSET", key, fld, new_value))]
        )
        if unknown:
            c.found(Problem.UNKNOWN_ID, key, fld, f"{len(unknown)} undefined ids", *write)
        elif len(kept) != len(ids):
            c.found(Problem.DUPLICATE_ID, key, fld, f"{len(ids) - len(kept)} ids repeated", *write)
        if home != key:
            move = [Command(("HDEL", key, fld))]
            if kept:
                move.insert(0, Command(("HSET", home, fld, new_value)))
            c.found(Problem.MISPLACED_FIELD, key, fld, f"belongs in {show_bytes(home)}", *move)


def _check_engine_bucket(
    c: _Checker, key: bytes, fields: dict[bytes, bytes]
) -> list[EngineMapping]:
    """Check shapes; returns the well-formed mappings, to probe."""
    lay = c.layout
    probe = []
    for fld, value in fields.items():
        if not _well_formed(c, key, fld, value, HASH_WIDTH, "engine"):
            continue
        home = lay.engine_bucket(int.from_bytes(fld, "big"))
        if home != key:
            c.found(
                Problem.MISPLACED_FIELD,
                key,
                fld,
                f"belongs in {show_bytes(home)}",
                Command(("HSET", home, fld, value)),
                Command(("HDEL", key, fld)),
            )
        probe.append(EngineMapping(key, fld, split_hashes(value)))
    return probe


class _BucketPass:
    """One pass over the bucket keys (:func:`~kvredis.redis.reading.op_read_hashes` calls
    :meth:`visit` with each): checks each bucket on its own, and gathers what the checks that
    span buckets need (runs and the refs to them, request records, expiring items, mappings)."""

    def __init__(self, c: _Checker, defined: set[bytes], now: int) -> None:
        self.c = c
        self.defined = defined
        self.now = now
        self.refs: dict[bytes, RefField] = {}
        """Request key -> where its ref is (the last bucket seen holding one)."""
        self.inline: dict[bytes, bytes] = {}
        """Request key -> the ids of its inline record (not a ref)."""
        self.timed: dict[bytes, ExpiringField] = {}
        """Request key -> its expiring field of a well-formed length."""
        self.expiring: dict[bytes, dict[bytes, int]] = {}
        """Expiring bucket -> field -> the latest deadline it keeps."""
        self.runs: dict[bytes, Run] = {}
        """Run id -> the run, for the runs that decode."""
        self.mappings: list[EngineMapping] = []

    def visit(self, key: bytes, fields: dict[bytes, bytes]) -> None:
        c, lay = self.c, self.c.layout
        if key.startswith(lay.rprefix):
            _check_request_bucket(c, key, fields, self.defined, self.refs)
            self.inline.update((f, v) for f, v in fields.items() if len(v) != REF_WIDTH)
        elif key.startswith(lay.sprefix):
            self.expiring[key] = _check_expiring_bucket(c, key, fields, self.defined, self.now)
            self.timed.update(
                (f, ExpiringField(key, v))
                for f, v in fields.items()
                if len(v) % EXPIRING_ITEM_WIDTH == 0
            )
        elif key.startswith(lay.cprefix):
            try:
                self.runs[key[len(lay.cprefix) :]] = decode_run(
                    fields.get(b"k", b""), fields.get(b"r", b"")
                )
            except NamespaceLayoutError as exc:
                c.found(Problem.MALFORMED_RUN, key, None, str(exc), Command(("DEL", key)))
        else:
            self.mappings += _check_engine_bucket(c, key, fields)

    def held(self) -> dict[bytes, bytes]:
        """Request key -> the ids of its request record: inline, or at the run position its
        ref names (where that position is its own)."""
        held = dict(self.inline)
        for fld, ref in self.refs.items():
            rid, pos = decode_ref(ref.ref)
            run = self.runs.get(rid, [])
            if 1 <= pos <= len(run) and run[pos - 1][0] == fld:
                held[fld] = run[pos - 1][1]
        return held


def op_check(
    layout: Layout,
    repair: bool = False,
    progress: ScanProgress = no_progress,
    mappings: bool = True,
) -> Op[CheckReport]:
    """Verify every invariant of the layout (see the module docstring); with ``repair`` fix them.

    Returns what was found (and repaired). ``progress(done, total)`` follows the bucket pages.
    ``mappings=False`` skips the ``dangling_mapping`` notes (a shard of a cluster namespace holds
    engine keys whose request keys live in other shards).

    The steps: the expiry mode; the types of the namespace's fixed keys; the entry dictionary;
    the types of the bucket keys; one pass over the buckets (each checked on its own); then what
    spans buckets: engine mappings, runs and refs, entries held twice, expiry; last, with
    ``repair``, the fixes, in the order of the findings.
    """
    c = _Checker(layout, repair)
    report = CheckReport(layout.namespace)
    mode = yield Command(("HGET", layout.meta, "expiry"))
    c.fields_expire = mode is not None and bytes(mode).decode() == EXPIRY_FIELD
    gate_is_string = yield from _op_check_fixed_types(c)
    defined = _check_dictionary(c, (yield from op_dictionary(layout, c.foreign)))
    keys = yield from op_namespace_keys(layout)
    report.keys_checked = len(keys)
    fixed = set(fixed_keys(layout))
    buckets = [k for k in keys if k not in fixed and k != layout.sx]
    yield from _op_check_bucket_types(c, buckets)
    scan = _BucketPass(c, defined, (yield from _op_server_ms()))
    yield from op_read_hashes(buckets, scan.visit, progress)
    if mappings:
        yield from _check_mappings(c, scan.mappings)
    _check_runs(c, scan.runs, scan.refs, set(scan.inline), defined)
    # before the expiry probes: a rewritten field gets its expiry back after its HSET
    _check_held_twice(c, scan.held(), scan.timed, defined, scan.now)
    yield from _check_expiry(c, scan.expiring, gate_is_string)
    for fixes in chunks(c.fixes, KEYS_PER_PIPELINE):
        yield Pipeline(tuple(fixes))
    report.findings = c.findings
    report.notes = c.notes
    return report


def _op_check_fixed_types(c: _Checker) -> Op[bool]:
    """The namespace's fixed keys must be hashes, the gate ``sx`` a string (or absent): another
    type is reported, and the key marked foreign (never written to). Whether the gate is a
    string."""
    lay = c.layout
    fixed = fixed_keys(lay)
    types = yield Pipeline(tuple(Command(("TYPE", k)) for k in fixed))
    for key, t in zip(fixed, types, strict=True):
        if type_name(t) not in ("hash", "none"):
            c.foreign.add(key)
            c.found(Problem.WRONG_TYPE, key, None, f"a {type_name(t)}, not a hash: delete it")
    gate_type = type_name((yield Command(("TYPE", lay.sx))))
    if gate_type not in ("string", "none"):
        c.foreign.add(lay.sx)
        c.found(Problem.WRONG_TYPE, lay.sx, None, f"a {gate_type}, not a string")
    return gate_type == "string"


def _op_check_bucket_types(c: _Checker, buckets: Sequence[bytes]) -> Op[None]:
    """Every bucket key must be a hash (or gone since it was listed)."""
    types: list[Any] = []
    for chunk in chunks(buckets, KEYS_PER_PIPELINE):
        types += yield Pipeline(tuple(Command(("TYPE", k)) for k in chunk))
    for key, t in zip(buckets, types, strict=True):
        if type_name(t) not in ("hash", "none"):
            what = f"a {type_name(t)}, not a bucket hash: delete it"
            c.found(Problem.WRONG_TYPE, key, None, what)


def _op_server_ms() -> Op[int]:
    """The server clock (TIME) in ms: expiring deadlines are on it."""
    sec, usec = yield Command(("TIME",))
    return int(sec) * 1000 + int(usec) // 1000


def _check_mappings(c: _Checker, mappings: Sequence[EngineMapping]) -> Op[None]:
    """Note engine mappings none of whose request keys holds an entry, with or without expiry
    (HEXISTS, pipelined): legitimate (an evict by request key leaves them, and
    ``get_request_key`` still answers them), so never repaired."""
    lay = c.layout
    probes = [
        (i, bucket(int.from_bytes(r, "big")), r)
        for i, mapping in enumerate(mappings)
        for r in mapping.request_keys
        for bucket in (lay.request_bucket, lay.expiring_bucket)
    ]
    held = [False] * len(mappings)
    for chunk in chunks(probes, KEYS_PER_PIPELINE):
        replies = yield Pipeline(tuple(Command(("HEXISTS", b, r)) for _, b, r in chunk))
        for (i, _b, _r), exists in zip(chunk, replies, strict=True):
            held[i] = held[i] or bool(int(exists))
    for mapping, ok in zip(mappings, held, strict=True):
        if not ok:
            n = len(mapping.request_keys)
            detail = f"none of its {n} request keys holds an entry (clear drops it)"
            c.found(Problem.DANGLING_MAPPING, mapping.bucket, mapping.field, detail)


def _check_runs(
    c: _Checker,
    runs: Mapping[bytes, Run],
    refs: Mapping[bytes, RefField],
    inline: set[bytes],
    defined: set[bytes],
) -> None:
    """Check refs against runs and runs against refs, and the ids of runs (undefined ones).

    Repairs rewrite a run once with all its changed positions (a position left without ids
    becomes a hole and its key's ref goes). Runs never hold expiring entries (those live in the
    expiring buckets).
    """
    valid = _check_refs(c, runs, refs)
    elsewhere = refs.keys() | inline  # keys with a record of their own besides a run position
    for rid, run in runs.items():
        found, edits = _check_run_positions(c, rid, run, valid, elsewhere, defined)
        run_key = c.layout.run_key(rid)
        for problem, fld, detail, fix in found:
            c.found(problem, run_key, fld, detail, *fix, *_rewrite(run_key, run, edits))


def _check_refs(
    c: _Checker, runs: Mapping[bytes, Run], refs: Mapping[bytes, RefField]
) -> dict[bytes, RunPosition]:
    """Report the refs that do not name a held position of their own key's; returns the
    others, by request key."""
    valid: dict[bytes, RunPosition] = {}
    for fld, (key, value) in refs.items():
        rid, pos = decode_ref(value)
        run = runs.get(rid)
        if run and 1 <= pos <= len(run) and run[pos - 1][0] == fld and run[pos - 1][1]:
            valid[fld] = RunPosition(rid, pos)
        else:
            c.found(
                Problem.DANGLING_REF,
                key,
                fld,
                f"points at {rid.hex()}:{pos}, which is not its",
                Command(("HDEL", key, fld)),
            )
    return valid


def _check_run_positions(
    c: _Checker,
    rid: bytes,
    run: Run,
    valid: Mapping[bytes, RunPosition],
    elsewhere: Set[bytes],
    defined: set[bytes],
) -> tuple[list[_RunFinding], dict[int, bytes]]:
    """The findings of a run's held positions (one its key does not point at, or holding
    undefined or repeated ids), and the edits (position -> its new ids) of the rewrite that
    repairs them. ``valid``: the refs that name their key's position; ``elsewhere``: the keys
    with a record of their own (inline, or a ref)."""
    found: list[_RunFinding] = []
    edits: dict[int, bytes] = {}
    for pos, (fld, ids) in enumerate(run, 1):
        if not ids:
            continue
        home = c.layout.request_bucket(int.from_bytes(fld, "big"))
        if valid.get(fld) != (rid, pos):
            if fld in elsewhere:  # the key is held elsewhere
                edits[pos] = b""
                fix = []
            else:
                fix = [Command(("HSET", home, fld, encode_ref(rid, pos)))]
            detail = f"position {pos} not pointed at by its key"
            found.append(_RunFinding(Problem.UNREFERENCED_POSITION, fld, detail, fix))
            continue
        kept = [i for i in dict.fromkeys(split_ids(ids)) if i in defined]
        if len(kept) * ID_WIDTH != len(ids):
            detail = f"{len(ids) // ID_WIDTH - len(kept)} undefined or repeated ids"
            fix = [] if kept else [Command(("HDEL", home, fld))]
            found.append(_RunFinding(Problem.UNKNOWN_ID, fld, detail, fix))
            edits[pos] = b"".join(kept)
    return found, edits


def _rewrite(run_key: bytes, run: Run, edits: Mapping[int, bytes]) -> list[Command]:
    """The commands that store ``run`` with ``edits`` (position -> ids) made: none without
    edits, the run's deletion when no key is left."""
    if not edits:
        return []
    keys, ranges = encode_run([(k, edits.get(p, ids)) for p, (k, ids) in enumerate(run, 1)])
    if not keys:
        return [Command(("DEL", run_key))]
    return [Command(("DEL", run_key)), Command(("HSET", run_key, b"k", keys, b"r", ranges))]


def _check_expiring_bucket(
    c: _Checker, key: bytes, fields: dict[bytes, bytes], defined: set[bytes], now: int
) -> dict[bytes, int]:
    """Check an expiring bucket; returns field -> latest deadline of what it keeps."""
    lay = c.layout
    latest: dict[bytes, int] = {}
    for fld, value in fields.items():
        if not _well_formed(c, key, fld, value, EXPIRING_ITEM_WIDTH, "expiring"):
            continue
        items = [
            value[i : i + EXPIRING_ITEM_WIDTH] for i in range(0, len(value), EXPIRING_ITEM_WIDTH)
        ]
        unknown = [i for i in items if i[:ID_WIDTH] not in defined]
        due = [i for i in items if i not in unknown and expiring_item_deadline(i) <= now]
        kept = [i for i in items if i not in unknown and i not in due]
        write = _expiring_write(c, key, fld, kept)
        if unknown:
            c.found(Problem.UNKNOWN_ID, key, fld, f"{len(unknown)} undefined ids", *write)
        if due:
            detail = f"{len(due)} expired entries still held (reclaimable)"
            c.found(Problem.EXPIRED_SPECULATIVE, key, fld, detail, *([] if unknown else write))
        home = lay.expiring_bucket(int.from_bytes(fld, "big"))
        if home != key:
            move = [Command(("HDEL", key, fld))]
            if kept:
                move[:0] = _expiring_write(c, home, fld, kept)
            c.found(Problem.MISPLACED_FIELD, key, fld, f"belongs in {show_bytes(home)}", *move)
        elif kept:
            latest[fld] = max(expiring_item_deadline(i) for i in kept)
    return latest


def _expiring_write(c: _Checker, key: bytes, fld: bytes, kept: Sequence[bytes]) -> list[Command]:
    """The commands that make a field of an expiring bucket hold ``kept`` (deleted if empty),
    with its field expiry set again where fields expire (an HSET drops it)."""
    if not kept:
        return [Command(("HDEL", key, fld))]
    write = [Command(("HSET", key, fld, b"".join(kept)))]
    if c.fields_expire:
        at = str(max(expiring_item_deadline(i) for i in kept))
        write.append(Command(("HPEXPIREAT", key, at, "FIELDS", 1, fld)))
    return write


def _check_held_twice(
    c: _Checker,
    held: Mapping[bytes, bytes],
    timed: Mapping[bytes, ExpiringField],
    defined: set[bytes],
    now: int,
) -> None:
    """An entry id is held under a request key in its request record (inline or in a run) or as
    an expiring entry, never both. The repair keeps the request record (it never expires) and
    rewrites the expiring field without those ids (nor undefined or past-due items), with its
    field expiry set again (HSET drops it)."""
    for fld, (key, value) in timed.items():
        ids = set(split_ids(held.get(fld, b"")))
        items = [
            value[i : i + EXPIRING_ITEM_WIDTH] for i in range(0, len(value), EXPIRING_ITEM_WIDTH)
        ]
        twice = [i for i in items if i[:ID_WIDTH] in ids]
        if not twice:
            continue
        kept = [
            i
            for i in items
            if i not in twice and i[:ID_WIDTH] in defined and expiring_item_deadline(i) > now
        ]
        detail = f"{len(twice)} ids also held in its request record"
        c.found(Problem.HELD_TWICE, key, fld, detail, *_expiring_write(c, key, fld, kept))


def _check_expiry(
    c: _Checker, expiring: Mapping[bytes, Mapping[bytes, int]], gate: bool
) -> Op[None]:
    """Every expiring bucket (or field, with hash field expiry) must expire by itself, and the
    gate must last as long as the latest expiring entry."""
    lay = c.layout
    fields_expire = c.fields_expire
    probes: list[ExpiryProbe] = []
    for key, latest in expiring.items():
        if not latest:
            continue
        if fields_expire:
            probes += [ExpiryProbe(key, f, d) for f, d in latest.items()]
        else:
            probes.append(ExpiryProbe(key, None, max(latest.values())))
    for chunk in chunks(probes, KEYS_PER_PIPELINE):
        replies = yield Pipeline(
            tuple(
                Command(("HPEXPIRETIME", k, "FIELDS", 1, f)) if f else Command(("PEXPIRETIME", k))
                for k, f, _ in chunk
            )
        )
        for (key, fld, deadline), reply in zip(chunk, replies, strict=True):
            when = int(reply[0] if isinstance(reply, (list, tuple)) else reply)
            if when >= 0:
                continue
            at = str(deadline)
            fix = (
                Command(("HPEXPIREAT", key, at, "FIELDS", 1, fld))
                if fld
                else Command(("PEXPIREAT", key, at))
            )
            c.found(Problem.NO_EXPIRY, key, fld, "the server would never delete it", fix)
    latest_all = max((probe.deadline for probe in probes), default=0)
    if latest_all:
        stored = (yield Command(("GET", lay.sx))) if gate else None
        try:
            held = int(stored) if stored is not None else 0
        except ValueError:
            held = 0
        if held < latest_all:
            at = str(latest_all)
            c.found(
                Problem.EXPIRY_GATE,
                lay.sx,
                None,
                "ends before the latest expiring entry (lookups would not see it)",
                Command(("SET", lay.sx, at, "PXAT", at)),
            )

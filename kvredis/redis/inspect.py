"""Reading a namespace as an operator does: statistics, the invariant check and its repair, dump.

Everything here reads the key layout of :mod:`kvredis.redis.layout` (the key names come from a
:class:`~kvredis.redis.layout.Layout`, the encodings from :mod:`kvredis.redis.codec`) and is
written, like the index operations, as sans-IO generators (``op_*``) that yield requests; an
:class:`Inspector` drives them with a :class:`~kvredis.redis.executor.SyncExecutor` and the
retry/translation combinators of :mod:`kvredis.redis.ops` (on a cluster,
:class:`~kvredis.redis.cluster.inspect.ClusterInspector` runs them on every shard and merges
the results with :func:`merge_stats`, :func:`merge_checks` and :func:`merge_watermarks`).
Nothing here creates a namespace: :func:`op_read_layout` returns ``None`` for one that does not
exist.

Every scan is bounded: SCAN MATCH on the namespace's own key patterns (never ``KEYS``), HSCAN on
the dictionary hashes, and pipelines of at most :data:`KEYS_PER_PIPELINE` keys.

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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvredis.errors import BackendError, BackendUnavailableError, NamespaceLayoutError
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    REF_WIDTH,
    bytes_text,
    decode_entry,
    decode_ref,
    decode_run,
    encode_ref,
    encode_run,
)
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.executor import SyncExecutor
from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    EXPIRY_FIELD,
    EXPIRY_KEY,
    PI_RECORD_FIELDS,
    Layout,
    expiring_item_deadline,
    meta_key,
)
from kvredis.redis.ops import (
    RetryPolicy,
    Session,
    check_not_cluster,
    decode_watermark,
    expiry_mode_of,
    op_drive,
)
from kvredis.redis.requests import Command, Op, Pipeline
from kvredis.redis.scripts import ScriptRegistry
from kvredis.redis.state import CoreState
from kvredis.types import PodEntry

__all__ = [
    "DUMP_FORMAT",
    "INFORMATIONAL",
    "CheckReport",
    "Dictionary",
    "Finding",
    "Inspector",
    "NamespaceStats",
    "Problem",
    "ServerInfo",
    "merge_checks",
    "merge_stats",
    "merge_watermarks",
    "op_check",
    "op_dictionary",
    "op_dump",
    "op_namespace_keys",
    "op_read_layout",
    "op_restore",
    "op_server_info",
    "op_server_layout",
    "op_stats",
    "op_watermarks",
]

T = TypeVar("T")

#: Keys per pipelined read (HGETALL, TYPE, MEMORY USAGE) and per SCAN page.
KEYS_PER_PIPELINE = 256
#: Fields per HSCAN page and per HSET of a restore.
FIELDS_PER_CALL = 1000
#: ``format`` of the header record of a dump.
DUMP_FORMAT = "kvredis-dump/1"

#: progress(done, total): keys processed so far, of ``total``.
Progress = Callable[[int, int], None]


def _noop(_done: int, _total: int) -> None:
    return None


# -- reading ------------------------------------------------------------------------------------


def op_read_layout(namespace: str, address: str | None = None) -> Op[Layout | None]:
    """The namespace's layout, from its meta record; ``None`` if it has none (never creates it).

    A meta record of another layout version or with bad fields raises NamespaceLayoutError
    (naming ``address`` in the command that fixes it).
    """
    state = CoreState(namespace)
    state.address = address
    reply = yield Command(("HMGET", meta_key(namespace), "layout", "bucket_bits", "gen"))
    if not any(reply):
        return None
    return state.adopt(reply)


def op_server_layout(
    namespace: str, server: str, address: str | None = None
) -> Op[Layout | None]:
    """:func:`op_read_layout` on a single server, once ``INFO cluster`` shows it is no cluster
    node (:class:`~kvredis.errors.ClusterModeError` otherwise, naming ``server``; a server that
    does not permit INFO is taken as it is)."""
    try:
        info = yield Command(("INFO", "cluster"))
    except BackendUnavailableError:
        raise
    except BackendError:
        info = None
    if info is not None:
        check_not_cluster(info, server)
    return (yield from op_read_layout(namespace, address))


def op_scan(pattern: bytes, count: int = KEYS_PER_PIPELINE) -> Op[list[bytes]]:
    """Every key matching ``pattern`` (SCAN MATCH; sorted, without repeats)."""
    found: set[bytes] = set()
    cursor = -1
    while cursor != 0:
        cursor_reply, keys = yield Command(
            ("SCAN", max(cursor, 0), "MATCH", pattern, "COUNT", count)
        )
        cursor = int(cursor_reply)
        found.update(bytes(k) for k in keys)
    return sorted(found)


def _fixed_keys(layout: Layout) -> list[bytes]:
    return [layout.meta, layout.pe, layout.pi, layout.pp, layout.pr, layout.wm, layout.wp]


def op_namespace_keys(layout: Layout) -> Op[list[bytes]]:
    """Every key of the namespace's layout: its records (and the gate ``sx``), then its
    request, engine and expiring buckets, then its runs.

    Only the layout's own names and bucket patterns are read, so the keys of another namespace
    are never included, whatever the two names.
    """
    fixed = [*_fixed_keys(layout), layout.sx]
    exists = yield Pipeline(tuple(Command(("EXISTS", k)) for k in fixed))
    keys = [k for k, n in zip(fixed, exists, strict=True) if int(n)]
    keys += yield from op_scan(layout.request_pattern())
    keys += yield from op_scan(layout.engine_pattern())
    keys += yield from op_scan(layout.expiring_pattern())
    keys += yield from op_scan(layout.run_pattern())
    return keys


def op_hscan(key: bytes) -> Op[dict[bytes, bytes]]:
    """Every field of a hash, read page by page (HSCAN)."""
    out: dict[bytes, bytes] = {}
    cursor = -1
    while cursor != 0:
        cursor_reply, flat = yield Command(("HSCAN", key, max(cursor, 0), "COUNT", FIELDS_PER_CALL))
        cursor = int(cursor_reply)
        if isinstance(flat, dict):
            out.update((bytes(f), bytes(v)) for f, v in flat.items())
        else:
            out.update((bytes(flat[i]), bytes(flat[i + 1])) for i in range(0, len(flat), 2))
    return out


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _as_dict(reply: Any) -> dict[bytes, bytes]:
    if isinstance(reply, dict):
        return {bytes(f): bytes(v) for f, v in reply.items()}
    return {bytes(reply[i]): bytes(reply[i + 1]) for i in range(0, len(reply), 2)}


def op_read_hashes(
    keys: Sequence[bytes], visit: Callable[[bytes, dict[bytes, bytes]], None], progress: Progress
) -> Op[None]:
    """HGETALL every key (pipelined), calling ``visit(key, fields)`` for each hash key.

    A key that is not a hash is visited with an empty dict only if its TYPE is ``none``; keys of
    another type are skipped (see :func:`op_check`, which reports them).
    """
    done = 0
    for chunk in _chunks(keys, KEYS_PER_PIPELINE):
        types = yield Pipeline(tuple(Command(("TYPE", k)) for k in chunk))
        hashes = [k for k, t in zip(chunk, types, strict=True) if _type(t) == "hash"]
        if hashes:
            replies = yield Pipeline(tuple(Command(("HGETALL", k)) for k in hashes))
            for key, reply in zip(hashes, replies, strict=True):
                visit(key, _as_dict(reply))
        done += len(chunk)
        progress(done, len(keys))


def _type(reply: Any) -> str:
    return (bytes(reply) if not isinstance(reply, str) else reply.encode()).decode()


def _ids(value: bytes) -> list[bytes]:
    return [value[i : i + ID_WIDTH] for i in range(0, len(value), ID_WIDTH)]


def _hashes(value: bytes) -> list[bytes]:
    return [value[i : i + HASH_WIDTH] for i in range(0, len(value), HASH_WIDTH)]


@dataclass
class Dictionary:
    """The entry dictionary as stored (``pe``, ``pi``, ``pp``, ``pr``) and what of it decodes."""

    pe: dict[bytes, bytes]
    pi: dict[bytes, bytes]
    pp: dict[bytes, bytes]
    pr: dict[bytes, bytes] = field(default_factory=dict)
    """pod -> its retired ids (a clear under way: ``lua/retire.lua``)."""
    entries: dict[bytes, PodEntry] = field(default_factory=dict)
    """id -> entry, for every ``pi`` definition that decodes."""
    undecodable: dict[bytes, str] = field(default_factory=dict)
    """id -> why its ``pi`` definition does not decode."""

    def __post_init__(self) -> None:
        for entry_id, enc in self.pi.items():
            try:
                if len(entry_id) != ID_WIDTH:
                    raise NamespaceLayoutError(f"id {entry_id!r} is not {ID_WIDTH} bytes")
                self.entries[entry_id] = decode_entry(enc)
            except NamespaceLayoutError as exc:
                self.undecodable[entry_id] = str(exc)

    def retired(self) -> set[bytes]:
        """The ids a clear under way retired: defined, but out of ``pe`` and ``pp``."""
        return {i for ids in self.pr.values() for i in _ids(ids) if len(ids) % ID_WIDTH == 0}


def op_dictionary(layout: Layout, unreadable: Collection[bytes] = ()) -> Op[Dictionary]:
    """Read the entry dictionary (``pe``, ``pi``, ``pp``, ``pr``) with HSCAN; a key in
    ``unreadable`` (one that is not a hash) reads as empty."""

    def read(key: bytes) -> Op[dict[bytes, bytes]]:
        if key in unreadable:
            return {}
        return (yield from op_hscan(key))

    pe = yield from read(layout.pe)
    pi = yield from read(layout.pi)
    for name in PI_RECORD_FIELDS:
        pi.pop(name, None)
    pp = yield from read(layout.pp)
    pr = yield from read(layout.pr)
    return Dictionary(pe, pi, pp, pr)


# -- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the server says about itself."""

    server: str
    """``redis`` or ``valkey``."""
    version: str
    maxmemory_policy: str
    used_memory: int


def _info_fields(reply: Any) -> dict[str, str]:
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    text = bytes(reply).decode("utf-8", "replace") if not isinstance(reply, str) else reply
    out = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            out[name.strip()] = value.strip()
    return out


def op_server_info() -> Op[ServerInfo]:
    """Server kind, version, eviction policy and memory in use (INFO server, INFO memory)."""
    server = _info_fields((yield Command(("INFO", "server"))))
    memory = _info_fields((yield Command(("INFO", "memory"))))
    valkey = server.get("valkey_version") or ("" if server.get("server_name") != "valkey" else "?")
    return ServerInfo(
        server="valkey" if valkey else "redis",
        version=valkey or server.get("redis_version", "?"),
        maxmemory_policy=memory.get("maxmemory_policy", "?"),
        used_memory=int(memory.get("used_memory", "0") or 0),
    )


@dataclass
class NamespaceStats:
    """What a namespace holds (see :func:`op_stats`)."""

    namespace: str
    bucket_bits: int
    keys: int = 0
    """Keys of the namespace (records and buckets)."""
    request_buckets: int = 0
    engine_buckets: int = 0
    runs: int = 0
    """Runs (request keys stored together, ``<ns>:c:<id>``)."""
    request_keys: int = 0
    """Request keys holding at least one entry."""
    pairs: int = 0
    """(request key, entry) pairs."""
    engine_keys: int = 0
    """Engine keys with a mapping."""
    engine_mappings: int = 0
    """(engine key, request key) mappings."""
    expiring_entries: int = 0
    """(request key, entry) pairs of speculative entries added with a ttl, past due or not (not
    in ``pairs``; the live ones count in ``pods``)."""
    expiring_live: int = 0
    """Those of ``expiring_entries`` before their deadline."""
    pairs_total: int = 0
    """``pairs`` + ``expiring_live``: the total of ``pods``."""
    dictionary_entries: int = 0
    watermarks: int = 0
    bytes_used: int = 0
    """MEMORY USAGE summed over the namespace's keys."""
    pods: dict[str, dict[str, int]] = field(default_factory=dict)
    """pod -> tier -> (request key, entry) pairs, expiring entries before their deadline
    included (a speculative entry's tier is ``""``)."""
    shards: list[NamespaceStats] = field(default_factory=list)
    """On a cluster: each shard's own statistics, shard 0 first (see :func:`merge_stats`)."""

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``shards``, a list of the shards' dicts, only on a cluster)."""
        out = {n: getattr(self, n) for n in self.__dataclass_fields__ if n != "shards"}
        if self.shards:
            out["shards"] = [{"shard": i, **s.as_json()} for i, s in enumerate(self.shards)]
        return out


#: The counters of :class:`NamespaceStats` a merge sums.
_SUMMED = (
    "keys",
    "request_buckets",
    "engine_buckets",
    "runs",
    "request_keys",
    "pairs",
    "engine_keys",
    "engine_mappings",
    "expiring_entries",
    "dictionary_entries",
    "watermarks",
    "bytes_used",
)


def merge_stats(namespace: str, shards: Sequence[NamespaceStats]) -> NamespaceStats:
    """The statistics of a cluster namespace: its shards' counters summed, their pods merged
    (pairs per tier summed), each shard's own in ``shards``. ``watermarks`` counts stored
    watermarks over all shards (a stream's watermark is stored once per shard)."""
    merged = NamespaceStats(namespace, shards[0].bucket_bits if shards else 0)
    pods: dict[str, dict[str, int]] = {}
    for shard in shards:
        for name in _SUMMED:
            setattr(merged, name, getattr(merged, name) + getattr(shard, name))
        for pod, tiers in shard.pods.items():
            mine = pods.setdefault(pod, {})
            for tier, count in tiers.items():
                mine[tier] = mine.get(tier, 0) + count
    merged.pods = dict(sorted(pods.items()))
    merged.shards = list(shards)
    return merged


def op_stats(layout: Layout, progress: Progress = _noop, memory: bool = True) -> Op[NamespaceStats]:
    """Count everything in the namespace, reading every bucket once (pipelined).

    ``progress(done, total)`` is called after every page of keys. With ``memory`` the bytes
    used are summed with MEMORY USAGE.
    """
    stats = NamespaceStats(layout.namespace, layout.bucket_bits)
    keys = yield from op_namespace_keys(layout)
    stats.keys = len(keys)
    dictionary = yield from op_dictionary(layout)
    stats.dictionary_entries = len(dictionary.pi)
    stats.watermarks = int((yield Command(("HLEN", layout.wm))))
    per_id: Tally[bytes] = Tally()
    live: Tally[bytes] = Tally()
    sec, usec = yield Command(("TIME",))
    now = int(sec) * 1000 + int(usec) // 1000

    def visit(key: bytes, fields: dict[bytes, bytes]) -> None:
        if key.startswith(layout.rprefix):
            stats.request_buckets += 1
            stats.request_keys += len(fields)
            for value in fields.values():
                if len(value) != REF_WIDTH:  # refs: counted with their runs
                    per_id.update(_ids(value))
        elif key.startswith(layout.cprefix):
            stats.runs += 1
            try:
                positions = decode_run(fields.get(b"k", b""), fields.get(b"r", b""))
            except NamespaceLayoutError:
                return
            for _key, ids in positions:
                per_id.update(_ids(ids))
        elif key.startswith(layout.eprefix):
            stats.engine_buckets += 1
            stats.engine_keys += len(fields)
            stats.engine_mappings += sum(len(v) // HASH_WIDTH for v in fields.values())
        elif key.startswith(layout.sprefix):
            for value in fields.values():
                for i in range(0, len(value) - EXPIRING_ITEM_WIDTH + 1, EXPIRING_ITEM_WIDTH):
                    stats.expiring_entries += 1
                    item = value[i : i + EXPIRING_ITEM_WIDTH]
                    if expiring_item_deadline(item) > now:
                        live[item[:ID_WIDTH]] += 1

    kinds = (layout.rprefix, layout.eprefix, layout.sprefix, layout.cprefix)
    buckets = [k for k in keys if k.startswith(kinds)]
    yield from op_read_hashes(buckets, visit, progress)
    stats.pairs = sum(per_id.values())
    stats.expiring_live = sum(live.values())
    stats.pairs_total = stats.pairs + stats.expiring_live
    pods: dict[str, dict[str, int]] = {}
    for entry_id, count in (per_id + live).items():
        entry = dictionary.entries.get(entry_id)
        pod, tier = (entry.pod_identifier, entry.device_tier) if entry else ("?", "?")
        tiers = pods.setdefault(pod, {})
        tiers[tier] = tiers.get(tier, 0) + count
    stats.pods = dict(sorted(pods.items()))
    if memory:
        for chunk in _chunks(keys, KEYS_PER_PIPELINE):
            sizes = yield Pipeline(
                tuple(Command(("MEMORY", "USAGE", k, "SAMPLES", 0)) for k in chunk)
            )
            stats.bytes_used += sum(int(s or 0) for s in sizes)
    return stats


def op_watermarks(layout: Layout) -> Op[dict[str, str]]:
    """The stored watermarks: stream -> value as stored (``"epoch:position"``)."""
    stored = yield from op_hscan(layout.wm)
    return {bytes_text(k): v.decode("utf-8", "replace") for k, v in sorted(stored.items())}


def merge_watermarks(shards: Sequence[Mapping[str, str]]) -> dict[str, tuple[str, int]]:
    """The watermarks of a cluster namespace: stream -> (the lowest stored value over the
    shards holding one, how many shards hold one). A batch counts as applied only once every
    shard took it, so the lowest is the stream's position (``get_watermark`` answers ``None``
    while a shard holds none). A value that does not decode counts as the lowest."""

    def order(value: str) -> tuple[int, int, int]:
        try:
            mark = decode_watermark(value.encode("utf-8", "surrogateescape"))
        except NamespaceLayoutError:
            return (0, -1, -1)
        return (1, mark.epoch, mark.seq)

    held: dict[str, list[str]] = {}
    for stored in shards:
        for stream, value in stored.items():
            held.setdefault(stream, []).append(value)
    return {s: (min(v, key=order), len(v)) for s, v in sorted(held.items())}


# -- check and repair ---------------------------------------------------------------------------


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

    def as_json(self) -> dict[str, Any]:
        """A JSON-ready dict (key and field as text, non-UTF-8 bytes escaped; ``shard`` only on
        a cluster)."""
        out: dict[str, Any] = {
            "problem": self.problem.value,
            "key": _show(self.key),
            "field": None if self.field is None else self.field.hex(),
            "detail": self.detail,
            "repaired": self.repaired,
        }
        if self.shard is not None:
            out["shard"] = self.shard
        return out


def _show(data: bytes) -> str:
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
        self, problem: Problem, key: bytes, fld: bytes | None, detail: str, *fix: Command
    ) -> None:
        writable = not any(f.args[1] in self.foreign for f in fix)
        fixable = bool(fix) and self.repair and writable
        found = Finding(problem, key, fld, detail, fixable)
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
    lay = c.layout
    for pod, stored in sorted(d.pr.items()):
        ids = _ids(stored) if len(stored) % ID_WIDTH == 0 else []
        if ids:
            c.found(
                Problem.CLEAR_PENDING,
                lay.pr,
                pod,
                f"pod {_show(pod)!r}: a clear of it is under way or was interrupted "
                f"({len(ids)} retired entry ids); if none runs, run that pod's clear again",
            )
        stray = [
            i
            for i in ids
            if i not in defined
            or d.entries[i].pod_identifier.encode("utf-8", "surrogatepass") != pod
        ]
        if stray or len(stored) % ID_WIDTH:
            kept = [i for i in dict.fromkeys(ids) if i not in stray]
            c.found(
                Problem.POD_RECORD_STRAY,
                lay.pr,
                pod,
                f"pod {_show(pod)!r} has {len(stray)} retired ids it does not own",
                Command(("HSET", lay.pr, pod, b"".join(kept)))
                if kept
                else Command(("HDEL", lay.pr, pod)),
            )
    expected: dict[bytes, list[bytes]] = {}
    for entry_id in sorted(defined - retired):
        pod = d.entries[entry_id].pod_identifier.encode("utf-8", "surrogatepass")
        expected.setdefault(pod, []).append(entry_id)
    for pod in sorted(set(expected) | set(d.pp)):
        stored = d.pp.get(pod, b"")
        ids = _ids(stored) if len(stored) % ID_WIDTH == 0 else []
        want = expected.get(pod, [])
        stray = [
            i
            for i in ids
            if i not in defined
            or d.entries[i].pod_identifier.encode("utf-8", "surrogatepass") != pod
        ]
        missing = [i for i in want if i not in ids]
        if not stray and not missing and len(stored) % ID_WIDTH == 0:
            continue
        kept = [i for i in dict.fromkeys(ids) if i not in stray] + missing
        fix = (
            Command(("HSET", lay.pp, pod, b"".join(kept)))
            if kept
            else Command(("HDEL", lay.pp, pod))
        )
        name = _show(pod)
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


def _check_request_bucket(
    c: _Checker,
    key: bytes,
    fields: dict[bytes, bytes],
    defined: set[bytes],
    refs: dict[bytes, tuple[bytes, bytes]],
) -> None:
    lay = c.layout
    for fld, value in fields.items():
        if len(fld) == HASH_WIDTH and len(value) == REF_WIDTH:
            refs[fld] = (key, value)  # checked against the runs (_check_runs)
            continue
        if not _well_formed(c, key, fld, value, ID_WIDTH, "request"):
            continue
        ids = _ids(value)
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
            c.found(Problem.MISPLACED_FIELD, key, fld, f"belongs in {_show(home)}", *move)


def _check_engine_bucket(
    c: _Checker, key: bytes, fields: dict[bytes, bytes]
) -> list[tuple[bytes, bytes, list[bytes]]]:
    """Check shapes; returns the well-formed mappings ``(field, value, request keys)`` to probe."""
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
                f"belongs in {_show(home)}",
                Command(("HSET", home, fld, value)),
                Command(("HDEL", key, fld)),
            )
        probe.append((fld, value, _hashes(value)))
    return probe


def op_check(
    layout: Layout, repair: bool = False, progress: Progress = _noop, mappings: bool = True
) -> Op[CheckReport]:
    """Verify every invariant of the layout (see the module docstring); with ``repair`` fix them.

    Returns what was found (and repaired). ``progress(done, total)`` follows the bucket pages.
    ``mappings=False`` skips the ``dangling_mapping`` notes (a shard of a cluster namespace holds
    engine keys whose request keys live in other shards).
    """
    c = _Checker(layout, repair)
    report = CheckReport(layout.namespace)
    mode = yield Command(("HGET", layout.meta, "expiry"))
    c.fields_expire = mode is not None and bytes(mode).decode() == EXPIRY_FIELD
    fixed = _fixed_keys(layout)
    types = yield Pipeline(tuple(Command(("TYPE", k)) for k in fixed))
    for key, t in zip(fixed, types, strict=True):
        if _type(t) not in ("hash", "none"):
            c.foreign.add(key)
            c.found(Problem.WRONG_TYPE, key, None, f"a {_type(t)}, not a hash: delete it")
    gate_type = yield Command(("TYPE", layout.sx))
    if _type(gate_type) not in ("string", "none"):
        c.foreign.add(layout.sx)
        c.found(Problem.WRONG_TYPE, layout.sx, None, f"a {_type(gate_type)}, not a string")
    dictionary = yield from op_dictionary(layout, c.foreign)
    defined = _check_dictionary(c, dictionary)
    keys = yield from op_namespace_keys(layout)
    buckets = [k for k in keys if k not in fixed and k != layout.sx]
    report.keys_checked = len(keys)
    btypes: list[Any] = []
    for chunk in _chunks(buckets, KEYS_PER_PIPELINE):
        btypes += yield Pipeline(tuple(Command(("TYPE", k)) for k in chunk))
    for key, t in zip(buckets, btypes, strict=True):
        if _type(t) not in ("hash", "none"):
            c.found(Problem.WRONG_TYPE, key, None, f"a {_type(t)}, not a bucket hash: delete it")
    probe_mappings = mappings
    found_mappings: list[tuple[bytes, bytes, list[bytes]]] = []
    map_keys: list[bytes] = []
    sec, usec = yield Command(("TIME",))
    now = int(sec) * 1000 + int(usec) // 1000
    expiring: dict[bytes, dict[bytes, int]] = {}

    refs: dict[bytes, tuple[bytes, bytes]] = {}
    runs: dict[bytes, list[tuple[bytes, bytes]]] = {}
    inline: set[bytes] = set()
    held: dict[bytes, bytes] = {}  # request key -> its inline ids
    timed: dict[bytes, tuple[bytes, bytes]] = {}  # request key -> (expiring bucket, items)

    def visit(key: bytes, fields: dict[bytes, bytes]) -> None:
        if key.startswith(layout.rprefix):
            _check_request_bucket(c, key, fields, defined, refs)
            inline.update(f for f, v in fields.items() if len(v) != REF_WIDTH)
            held.update((f, v) for f, v in fields.items() if len(v) != REF_WIDTH)
        elif key.startswith(layout.sprefix):
            expiring[key] = _check_expiring_bucket(c, key, fields, defined, now)
            timed.update(
                (f, (key, v)) for f, v in fields.items() if len(v) % EXPIRING_ITEM_WIDTH == 0
            )
        elif key.startswith(layout.cprefix):
            try:
                runs[key[len(layout.cprefix) :]] = decode_run(
                    fields.get(b"k", b""), fields.get(b"r", b"")
                )
            except NamespaceLayoutError as exc:
                c.found(Problem.MALFORMED_RUN, key, None, str(exc), Command(("DEL", key)))
        else:
            for m in _check_engine_bucket(c, key, fields):
                found_mappings.append(m)
                map_keys.append(key)

    yield from op_read_hashes(buckets, visit, progress)
    if probe_mappings:
        yield from _check_mappings(c, found_mappings, map_keys)
    _check_runs(c, runs, refs, inline, defined)
    for fld, (_key, ref) in refs.items():
        rid, pos = decode_ref(ref)
        run = runs.get(rid, [])
        if 1 <= pos <= len(run) and run[pos - 1][0] == fld:
            held[fld] = run[pos - 1][1]
    # before the expiry probes: a rewritten field gets its expiry back after its HSET
    _check_held_twice(c, held, timed, defined, now)
    yield from _check_expiry(c, expiring, _type(gate_type) == "string")
    if c.fixes:
        for fixes in _chunks(c.fixes, KEYS_PER_PIPELINE):
            yield Pipeline(tuple(fixes))
    report.findings = c.findings
    report.notes = c.notes
    return report


def _check_mappings(
    c: _Checker, mappings: list[tuple[bytes, bytes, list[bytes]]], keys: list[bytes]
) -> Op[None]:
    """Note engine mappings none of whose request keys holds an entry, with or without expiry
    (HEXISTS, pipelined): legitimate (an evict by request key leaves them, and
    ``get_request_key`` still answers them), so never repaired."""
    lay = c.layout
    probes = [
        (i, bucket(int.from_bytes(r, "big")), r)
        for i, (_f, _v, refs) in enumerate(mappings)
        for r in refs
        for bucket in (lay.request_bucket, lay.expiring_bucket)
    ]
    held = [False] * len(mappings)
    for chunk in _chunks(probes, KEYS_PER_PIPELINE):
        replies = yield Pipeline(tuple(Command(("HEXISTS", b, r)) for _, b, r in chunk))
        for (i, _b, _r), exists in zip(chunk, replies, strict=True):
            held[i] = held[i] or bool(int(exists))
    for (fld, _value, refs), key, ok in zip(mappings, keys, held, strict=True):
        if not ok:
            detail = f"none of its {len(refs)} request keys holds an entry (clear drops it)"
            c.found(Problem.DANGLING_MAPPING, key, fld, detail)


def _check_runs(
    c: _Checker,
    runs: dict[bytes, list[tuple[bytes, bytes]]],
    refs: dict[bytes, tuple[bytes, bytes]],
    inline: set[bytes],
    defined: set[bytes],
) -> None:
    """Check refs against runs and runs against refs, and the ids of runs (undefined ones).

    Repairs rewrite a run once with all its changed positions (a position left without ids
    becomes a hole and its key's ref goes). Runs never hold expiring entries (those live in the
    expiring buckets).
    """
    lay = c.layout
    edits: dict[bytes, dict[int, bytes]] = {}
    notes: dict[bytes, list[tuple[Problem, bytes, str, list[Command]]]] = {}
    valid: dict[bytes, tuple[bytes, int]] = {}
    for fld, (key, value) in refs.items():
        rid, pos = decode_ref(value)
        run = runs.get(rid)
        if run and 1 <= pos <= len(run) and run[pos - 1][0] == fld and run[pos - 1][1]:
            valid[fld] = (rid, pos)
        else:
            c.found(
                Problem.DANGLING_REF,
                key,
                fld,
                f"points at {rid.hex()}:{pos}, which is not its",
                Command(("HDEL", key, fld)),
            )
    for rid, run in runs.items():
        run_key = lay.run_key(rid)
        for pos, (fld, ids) in enumerate(run, 1):
            if not ids:
                continue
            home = lay.request_bucket(int.from_bytes(fld, "big"))
            if valid.get(fld) != (rid, pos):
                if fld in refs or fld in inline:  # the key is held elsewhere
                    edits.setdefault(rid, {})[pos] = b""
                    fix = []
                else:
                    fix = [Command(("HSET", home, fld, encode_ref(rid, pos)))]
                detail = f"position {pos} not pointed at by its key"
                notes.setdefault(rid, []).append((Problem.UNREFERENCED_POSITION, fld, detail, fix))
                continue
            kept = [i for i in dict.fromkeys(_ids(ids)) if i in defined]
            if len(kept) * ID_WIDTH != len(ids):
                detail = f"{len(ids) // ID_WIDTH - len(kept)} undefined or repeated ids"
                fix = [] if kept else [Command(("HDEL", home, fld))]
                notes.setdefault(rid, []).append((Problem.UNKNOWN_ID, fld, detail, fix))
                edits.setdefault(rid, {})[pos] = b"".join(kept)
        for problem, fld, detail, fix in notes.get(rid, []):
            c.found(problem, run_key, fld, detail, *fix, *_rewrite(run_key, run, edits.get(rid)))


def _rewrite(
    run_key: bytes, run: list[tuple[bytes, bytes]], edits: dict[int, bytes] | None
) -> list[Command]:
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
            c.found(Problem.MISPLACED_FIELD, key, fld, f"belongs in {_show(home)}", *move)
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
    timed: Mapping[bytes, tuple[bytes, bytes]],
    defined: set[bytes],
    now: int,
) -> None:
    """An entry id is held under a request key in its request record (inline or in a run) or as
    an expiring entry, never both. The repair keeps the request record (it never expires) and
    rewrites the expiring field without those ids (nor undefined or past-due items), with its
    field expiry set again (HSET drops it)."""
    for fld, (key, value) in timed.items():
        ids = set(_ids(held.get(fld, b"")))
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
    probes: list[tuple[bytes, bytes | None, int]] = []
    for key, latest in expiring.items():
        if not latest:
            continue
        if fields_expire:
            probes += [(key, f, d) for f, d in latest.items()]
        else:
            probes.append((key, None, max(latest.values())))
    for chunk in _chunks(probes, KEYS_PER_PIPELINE):
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
    latest_all = max((d for _, _, d in probes), default=0)
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


# -- dump and restore ---------------------------------------------------------------------------


def op_dump(
    layout: Layout, write: Callable[[Mapping[str, Any]], None], progress: Progress = _noop
) -> Op[int]:
    """Export every key of the namespace as records ``{"key", "fields"}`` (see the CLI's dump).

    ``key`` is the key name without the ``<ns>:`` prefix and ``fields`` a list of
    ``[field, value]`` pairs, all hex-encoded bytes; a hash larger than
    :data:`FIELDS_PER_CALL` fields is written as several records of the same key. Expiring
    buckets carry their deadlines in their values; their expiry and the gate ``sx`` are derived
    from them on restore. The meta record comes last. Returns the number of keys exported.
    """
    keys = yield from op_namespace_keys(layout)
    prefix = len(layout.meta) - len(b"meta")
    exported = 0

    def visit(key: bytes, fields: dict[bytes, bytes]) -> None:
        nonlocal exported
        exported += 1
        items = sorted(fields.items())
        for chunk in _chunks(items, FIELDS_PER_CALL):
            write({"key": key[prefix:].hex(), "fields": [[f.hex(), v.hex()] for f, v in chunk]})

    records = [k for k in keys if k not in (layout.meta, layout.sx)]
    yield from op_read_hashes(records, visit, progress)
    if layout.meta in keys:
        yield from op_read_hashes([layout.meta], visit, progress)
    return exported


#: The relative key names (after ``<ns>:``) of the records a restore treats specially.
_META, _PI, _EXPIRING = b"meta", b"pi", b"s:"


def op_restore(layout_prefix: bytes, records: Iterable[Mapping[str, Any]]) -> Op[int]:
    """Write dump records under ``layout_prefix`` (``b"<ns>:"``); the meta record last.

    The expiring buckets get their expiry back from the deadlines they hold (per field with
    hash field expiry, per bucket key otherwise), and the gate ``<ns>:sx`` the latest of them.
    A namespace dumped with hash field expiry and restored to a server without it switches to
    bucket key expiry (``expiry`` in the meta and ``pi`` records). Returns the fields written.
    """
    written = 0
    meta: list[bytes] = []
    batch: list[Command] = []
    expiring: dict[bytes, dict[bytes, int]] = {}
    restored_pi = False
    for record in records:
        rel = bytes.fromhex(record["key"])
        key = layout_prefix + rel
        flat: list[bytes] = []
        for f, v in record["fields"]:
            flat += [bytes.fromhex(f), bytes.fromhex(v)]
        if not flat:
            continue
        written += len(flat) // 2
        if rel == _META:
            meta += flat
            continue
        restored_pi = restored_pi or rel == _PI
        if rel.startswith(_EXPIRING):
            latest = expiring.setdefault(key, {})
            for i in range(0, len(flat), 2):
                value = flat[i + 1]
                deadlines = [
                    expiring_item_deadline(value[j : j + EXPIRING_ITEM_WIDTH])
                    for j in range(0, len(value), EXPIRING_ITEM_WIDTH)
                ]
                latest[flat[i]] = max(deadlines, default=0)
        batch.append(Command(("HSET", key, *flat)))
        if len(batch) >= KEYS_PER_PIPELINE:
            yield Pipeline(tuple(batch))
            batch = []
    if batch:
        yield Pipeline(tuple(batch))
    mode = dict(zip(meta[::2], meta[1::2], strict=True)).get(b"expiry", EXPIRY_KEY.encode())
    if mode == EXPIRY_FIELD.encode():
        mode = expiry_mode_of((yield Command(("INFO", "server")))).encode()
        if meta:
            meta += [b"expiry", mode]
        if restored_pi:
            yield Command(("HSET", layout_prefix + _PI, "expiry", mode))
    yield from _restore_expiry(layout_prefix, expiring, mode == EXPIRY_FIELD.encode())
    if meta:
        yield Command(("HSET", layout_prefix + _META, *meta))
    return written


def _restore_expiry(
    layout_prefix: bytes, expiring: Mapping[bytes, Mapping[bytes, int]], fields_expire: bool
) -> Op[None]:
    commands: list[Command] = []
    for key, latest in expiring.items():
        if fields_expire:
            commands += [
                Command(("HPEXPIREAT", key, str(d), "FIELDS", 1, f)) for f, d in latest.items()
            ]
        elif latest:
            commands.append(Command(("PEXPIREAT", key, str(max(latest.values())))))
    for chunk in _chunks(commands, KEYS_PER_PIPELINE):
        yield Pipeline(tuple(chunk))
    gate = max((d for latest in expiring.values() for d in latest.values()), default=0)
    if gate:
        yield Command(("SET", layout_prefix + b"sx", str(gate), "PXAT", str(gate)))


# -- driving ------------------------------------------------------------------------------------


class Inspector:
    """Runs the ``op_*`` functions of this module against one server (the operator's client).

    Uses the connection settings of ``config`` and the same retries and error translation as
    the index: an unreachable server raises BackendUnavailableError naming the address.
    """

    def __init__(self, config: RedisIndexConfig) -> None:
        self.config = config
        self._exec = SyncExecutor(config)
        self._session = Session(
            CoreState(config.namespace, config.bucket_bits),
            ScriptRegistry(),
            RetryPolicy(config.retries, config.retry_backoff, config.server()),
        )

    def run(self, op: Op[T]) -> T:
        """Run one operation to its end."""
        return self._exec.run(op_drive(self._session, op))

    def ping(self) -> None:
        """Check that the server answers (BackendUnavailableError otherwise)."""
        self.run(_op_ping())

    def layout(self) -> Layout | None:
        """The namespace's layout, or ``None`` if it does not exist.

        Raises :class:`~kvredis.errors.ClusterModeError` when the server is a node of a Redis
        Cluster (its namespaces are sharded: use
        :class:`~kvredis.redis.cluster.inspect.ClusterInspector`), and
        :class:`~kvredis.errors.NamespaceLayoutError` naming the command that fixes a namespace
        of another layout.
        """
        address = self.config.parsed_address().display
        return self.run(op_server_layout(self.config.namespace, self.config.server(), address))

    def close(self) -> None:
        """Close the connections."""
        self._exec.close()

    def __enter__(self) -> Inspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _op_ping() -> Op[None]:
    yield Command(("PING",))

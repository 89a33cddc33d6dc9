"""Reading a namespace's layout from the server with plain commands: its meta record, its keys
(bounded ``SCAN``/``HSCAN`` over the namespace's own key patterns), hashes in pipelined pages, and
the entry dictionary. :mod:`kvredis.redis.check`, :mod:`kvredis.redis.dump` and
:mod:`kvredis.redis.inspect` build on it."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvredis.errors import BackendError, BackendUnavailableError, NamespaceLayoutError
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    decode_entry,
)
from kvredis.redis.layout import (
    PI_RECORD_FIELDS,
    Layout,
    meta_key,
)
from kvredis.redis.requests import Command, Op, Pipeline
from kvredis.redis.session import check_not_cluster
from kvredis.redis.state import CoreState
from kvredis.types import PodEntry

T = TypeVar("T")

#: Keys per pipelined read (HGETALL, TYPE, MEMORY USAGE) and per SCAN page.
KEYS_PER_PIPELINE = 256
#: Fields per HSCAN page and per HSET of a restore.
FIELDS_PER_CALL = 1000
#: ``format`` of the header record of a dump.
DUMP_FORMAT = "kvredis-dump/1"

#: progress(done, total): keys processed so far, of ``total``.
ScanProgress = Callable[[int, int], None]


def no_progress(_done: int, _total: int) -> None:
    return None



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


def fixed_keys(layout: Layout) -> list[bytes]:
    return [layout.meta, layout.pe, layout.pi, layout.pp, layout.pr, layout.wm, layout.wp]


def op_namespace_keys(layout: Layout) -> Op[list[bytes]]:
    """Every key of the namespace's layout: its records (and the gate ``sx``), then its
    request, engine and expiring buckets, then its runs.

    Only the layout's own names and bucket patterns are read, so the keys of another namespace
    are never included, whatever the two names.
    """
    fixed = [*fixed_keys(layout), layout.sx]
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


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _as_dict(reply: Any) -> dict[bytes, bytes]:
    if isinstance(reply, dict):
        return {bytes(f): bytes(v) for f, v in reply.items()}
    return {bytes(reply[i]): bytes(reply[i + 1]) for i in range(0, len(reply), 2)}


def op_read_hashes(
    keys: Sequence[bytes],
    visit: Callable[[bytes, dict[bytes, bytes]], None],
    progress: ScanProgress,
) -> Op[None]:
    """HGETALL every key (pipelined), calling ``visit(key, fields)`` for each hash key.

    A key that is not a hash is visited with an empty dict only if its TYPE is ``none``; keys of
    another type are skipped (see :func:`~kvredis.redis.check.op_check`, which reports them).
    """
    done = 0
    for chunk in chunks(keys, KEYS_PER_PIPELINE):
        types = yield Pipeline(tuple(Command(("TYPE", k)) for k in chunk))
        hashes = [k for k, t in zip(chunk, types, strict=True) if type_name(t) == "hash"]
        if hashes:
            replies = yield Pipeline(tuple(Command(("HGETALL", k)) for k in hashes))
            for key, reply in zip(hashes, replies, strict=True):
                visit(key, _as_dict(reply))
        done += len(chunk)
        progress(done, len(keys))


def type_name(reply: Any) -> str:
    return (bytes(reply) if not isinstance(reply, str) else reply.encode()).decode()


def split_ids(value: bytes) -> list[bytes]:
    return [value[i : i + ID_WIDTH] for i in range(0, len(value), ID_WIDTH)]


def split_hashes(value: bytes) -> list[bytes]:
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
        return {i for ids in self.pr.values() for i in split_ids(ids) if len(ids) % ID_WIDTH == 0}


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

"""A cluster namespace's dump as the dump of one single-server namespace (sans-IO): what
``kvredis restore`` of a cluster dump into one server writes.

A cluster namespace is ``shards`` complete namespaces of the single-server layout
(:mod:`kvredis.redis.cluster.shards`), each holding its share of the request and engine keys
(a key lives in exactly one shard), each with its own entry dictionary and run ids. Merged:

- entry ids are renumbered from 1: an entry live in several shards (in their ``pe``) gets one
  id, a retired or otherwise unlisted one (a clear under way) an id of its own; every id list
  (request buckets, runs, expiring items, ``pp``, ``pr``) is rewritten with the new ids, in its
  order;
- run ids are shifted: shard *i*'s run *n* becomes run ``offset[i] + n``, the offsets the
  shards' run high-water marks summed, and every ref to a run with it;
- bucket keys keep their names (the shards share the bucket bits, and their request keys are
  disjoint, so a bucket's fields from every shard together are the merged bucket);
- a stream's watermark is the lowest of the shards' when every shard holds one (what the
  cluster's ``get_watermark`` answers), else none (its next batch starts over); batches being
  applied in parts (``wp``) are left out;
- the meta record gets a new generation, the merged ``next_id`` and ``next_run``, and field
  expiry only when every shard used it.

The records are read twice (the dictionaries first): ``records()`` returns a fresh iterator of
the dump's key records (each with its ``shard``) at each call.

A namespace placed by pod (``kvredis-cluster/2``, :func:`merge_pod_shards`) holds a request key
in every shard one of whose pods holds it, so the same bucket field comes from several shards.
Merged as above, and besides:

- a request key held in one shard keeps its value (inline ids, or its ref into the shard's run);
  a key held in several shards gets their ids together, inline, in shard order (whatever order
  the dump's records come in), and each run position that held it becomes a hole (a run left
  without held positions is dropped, trailing holes are cut off);
- an engine key's request keys are the union of the shards' mappings, the lowest shard's last
  (most recent last: ``get_request_key`` answers what the cluster answered, the lowest shard's
  mapping's); the union is not cut to ``MAX_REQUEST_KEYS_PER_ENGINE_KEY``, so an evict by that
  engine key still reaches every request key a shard mapped it to;
- an expiring bucket field's items are the shards' items together, in shard order;
- a stream's watermark is the highest a shard holds (a stream's batches go to its pod's shard).

It holds the request buckets and the runs of every shard in memory while it merges (about the
size of the namespace's request keys and runs).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvredis.errors import NamespaceLayoutError
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    REF_WIDTH,
    RUN_ID_WIDTH,
    decode_run,
    encode_run,
)
from kvredis.redis.inspect import merge_watermarks
from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    EXPIRY_FIELD,
    EXPIRY_KEY,
    LAYOUT_VERSION,
    PI_RECORD_FIELDS,
)
from kvredis.redis.reading import FIELDS_PER_CALL, chunks

__all__ = ["merge_pod_shards", "merge_shards"]

Records = Callable[[], Iterable[Mapping[str, Any]]]
_DICTIONARY = (b"pe", b"pi", b"pp", b"pr", b"wm", b"meta")
_MAX_ID = 2**32 - 1


@dataclass
class _Shard:
    """What pass 1 learns of one shard."""

    pi: dict[bytes, bytes] = field(default_factory=dict)
    pe: dict[bytes, bytes] = field(default_factory=dict)
    pp: dict[bytes, bytes] = field(default_factory=dict)
    pr: dict[bytes, bytes] = field(default_factory=dict)
    wm: dict[bytes, bytes] = field(default_factory=dict)
    meta: dict[bytes, bytes] = field(default_factory=dict)
    top_run: int = 0
    ids: dict[bytes, bytes] = field(default_factory=dict)  # old id -> new id


def _fields(record: Mapping[str, Any]) -> Iterator[tuple[bytes, bytes]]:
    for f, v in record["fields"]:
        yield bytes.fromhex(f), bytes.fromhex(v)


def _number(value: bytes | None) -> int:
    try:
        return int(value or b"0")
    except ValueError:
        raise NamespaceLayoutError(f"a shard's record holds {value!r} for a number") from None


def _read_dictionaries(records: Records, count: int) -> list[_Shard]:
    shards = [_Shard() for _ in range(count)]
    for record in records():
        shard = record.get("shard", 0)
        if not isinstance(shard, int) or not 0 <= shard < count:
            raise NamespaceLayoutError(f"a record names shard {shard!r} of {count}")
        rel = bytes.fromhex(record["key"])
        into = shards[shard]
        if rel in _DICTIONARY:
            getattr(into, rel.decode()).update(_fields(record))
        elif rel.startswith(b"c:") and len(rel) == 2 + RUN_ID_WIDTH:
            into.top_run = max(into.top_run, int.from_bytes(rel[2:], "big"))
    return shards


def _new_id(n: int) -> bytes:
    if n > _MAX_ID:
        raise NamespaceLayoutError("the shards hold more entry ids than one namespace can")
    return n.to_bytes(ID_WIDTH, "big")


def _renumber(shards: list[_Shard]) -> dict[bytes, bytes]:
    """Give every shard's ids new ones (``shard.ids``); the merged ``pi`` (new id -> entry)."""
    by_entry: dict[bytes, bytes] = {}
    merged: dict[bytes, bytes] = {}
    for shard in shards:
        live = set(shard.pe.values())
        for old, entry in sorted(shard.pi.items()):
            if old in PI_RECORD_FIELDS or len(old) != ID_WIDTH:
                continue
            if old in live and entry in by_entry:
                shard.ids[old] = by_entry[entry]
                continue
            new = _new_id(len(merged) + 1)
            merged[new] = entry
            shard.ids[old] = new
            if old in live:
                by_entry[entry] = new
    return merged


def _ids(shard: _Shard, value: bytes, width: int = ID_WIDTH) -> bytes:
    """An id list (or a list of ``width``-byte items starting with an id) with new ids."""
    if len(value) % width:
        raise NamespaceLayoutError(f"an id list of {len(value)} bytes")
    out = bytearray()
    for at in range(0, len(value), width):
        old = value[at : at + ID_WIDTH]
        new = shard.ids.get(old)
        if new is None:
            raise NamespaceLayoutError(f"id {old.hex()} is held but not defined in its shard")
        out += new + value[at + ID_WIDTH : at + width]
    return bytes(out)


def _ranges(shard: _Shard, keys: bytes, ranges: bytes) -> bytes:
    """A run's ``r`` field with new ids (the same ranges)."""
    decode_run(keys, ranges)  # checks it
    out = bytearray()
    at = 0
    while at < len(ranges):
        count = int.from_bytes(ranges[at + 2 : at + 4], "big")
        end = at + 4 + ID_WIDTH * count
        out += ranges[at : at + 4] + _ids(shard, ranges[at + 4 : end])
        at = end
    return bytes(out)


def _record(key: bytes, fields: list[tuple[bytes, bytes]]) -> Iterator[dict[str, Any]]:
    for chunk in chunks(sorted(fields), FIELDS_PER_CALL):
        yield {"key": key.hex(), "fields": [[f.hex(), v.hex()] for f, v in chunk]}


def merge_shards(records: Records, count: int) -> Iterator[dict[str, Any]]:
    """The key records of one single-server namespace holding what the ``count`` shards of
    ``records()`` hold (see the module docstring), the meta record last."""
    shards, present, pi, bits, run_id, total_runs = _prologue(records, count)
    for record in records():
        number = record.get("shard", 0)
        shard = shards[number]
        rel = bytes.fromhex(record["key"])
        kind = rel[:2]
        fields = list(_fields(record))
        if rel in _DICTIONARY or rel in (b"wp", b"mx"):
            continue
        if kind == b"r:":
            fields = [
                (f, run_id(number, v[:RUN_ID_WIDTH]) + v[RUN_ID_WIDTH:])
                if len(v) == REF_WIDTH
                else (f, _ids(shard, v))
                for f, v in fields
            ]
        elif kind == b"s:":
            fields = [(f, _ids(shard, v, EXPIRING_ITEM_WIDTH)) for f, v in fields]
        elif kind == b"c:" and len(rel) == 2 + RUN_ID_WIDTH:
            held = dict(fields)
            keys = held.get(b"k", b"")
            fields = [(b"k", keys), (b"r", _ranges(shard, keys, held.get(b"r", b"")))]
            rel = b"c:" + run_id(number, rel[2:])
        elif kind != b"e:":
            raise NamespaceLayoutError(f"a shard holds a key kvredis does not write: {rel!r}")
        yield from _record(rel, fields)
    yield from _dictionaries(shards, present, pi, total_runs, bits)


#: A shard's run id (shard number, old id) -> its merged id: shard *i*'s run *n* becomes run
#: ``offset[i] + n``.
RunId = Callable[[int, bytes], bytes]


def _prologue(
    records: Records, count: int
) -> tuple[list[_Shard], list[_Shard], dict[bytes, bytes], int | None, RunId, int]:
    """Pass 1 of a merge: the shards' dictionaries, those present, the merged ``pi``, the
    bucket bits, the merged run ids and the merged run count."""
    shards = _read_dictionaries(records, count)
    present = [s for s in shards if s.meta or s.pi]
    bits = {_number(s.meta.get(b"bucket_bits") or s.pi.get(b"bucket_bits")) for s in present}
    if len(bits) > 1:
        raise NamespaceLayoutError(f"the shards have different bucket bits: {sorted(bits)}")
    layouts = {s.meta.get(b"layout", b"") for s in present if s.meta}
    if layouts - {LAYOUT_VERSION.encode()}:
        raise NamespaceLayoutError(f"a shard is in layout {sorted(layouts)!r}")
    pi = _renumber(shards)
    offsets, total_runs = [], 0
    for shard in shards:
        offsets.append(total_runs)
        top = max(shard.top_run, _number(shard.meta.get(b"next_run") or shard.pi.get(b"next_run")))
        total_runs += top
    if total_runs > _MAX_ID:
        raise NamespaceLayoutError("the shards hold more runs than one namespace can")

    def run_id(shard: int, old: bytes) -> bytes:
        return (offsets[shard] + int.from_bytes(old, "big")).to_bytes(RUN_ID_WIDTH, "big")

    return shards, present, pi, bits.pop() if bits else None, run_id, total_runs


#: A run of one shard: (shard number, its old run id).
_RunName = tuple[int, bytes]


def merge_pod_shards(records: Records, count: int) -> Iterator[dict[str, Any]]:
    """The key records of one single-server namespace holding what the ``count`` shards of a
    namespace placed by pod hold (see the module docstring), the meta record last."""
    shards, present, pi, bits, run_id, total_runs = _prologue(records, count)
    runs: dict[_RunName, list[tuple[bytes, bytes]]] = {}  # positions, ids renumbered
    request: dict[bytes, dict[bytes, list[tuple[int, bytes]]]] = {}  # bucket -> field -> values
    # bucket -> field -> shard -> its value (the dump's records come in no set shard order)
    engine: dict[bytes, dict[bytes, dict[int, bytes]]] = {}
    expiring: dict[bytes, dict[bytes, dict[int, bytes]]] = {}
    for record in records():
        number = record.get("shard", 0)
        shard = shards[number]
        rel = bytes.fromhex(record["key"])
        kind = rel[:2]
        if rel in _DICTIONARY or rel in (b"wp", b"mx", b"mv"):
            continue
        fields = list(_fields(record))
        if kind == b"r:":
            bucket = request.setdefault(rel, {})
            for f, v in fields:
                bucket.setdefault(f, []).append(
                    (number, v if len(v) == REF_WIDTH else _ids(shard, v))
                )
        elif kind == b"s:":
            into = expiring.setdefault(rel, {})
            for f, v in fields:
                into.setdefault(f, {})[number] = _ids(shard, v, EXPIRING_ITEM_WIDTH)
        elif kind == b"e:":
            mapped = engine.setdefault(rel, {})
            for f, v in fields:
                if len(v) % HASH_WIDTH:
                    raise NamespaceLayoutError(f"an engine key maps to a blob of {len(v)} bytes")
                mapped.setdefault(f, {})[number] = v
        elif kind == b"c:" and len(rel) == 2 + RUN_ID_WIDTH:
            held = dict(fields)
            positions = decode_run(held.get(b"k", b""), held.get(b"r", b""))
            runs[(number, rel[2:])] = [(k, _ids(shard, ids)) for k, ids in positions]
        else:
            raise NamespaceLayoutError(f"a shard holds a key kvredis does not write: {rel!r}")

    def resolve(number: int, value: bytes) -> bytes:
        """The ids a shard's value gives its key (a ref: its run position's, made a hole)."""
        if len(value) != REF_WIDTH:
            return value
        run = runs.get((number, value[:RUN_ID_WIDTH]))
        pos = int.from_bytes(value[RUN_ID_WIDTH:], "big")
        if run is None or not 1 <= pos <= len(run):
            return b""  # a ref naming no position: the key is not held through it
        key, ids = run[pos - 1]
        run[pos - 1] = (key, b"")
        return ids

    for rel, bucket in request.items():
        merged: list[tuple[bytes, bytes]] = []
        for f, values in bucket.items():
            values.sort(key=lambda held: held[0])  # shard order
            if len(values) == 1:
                number, value = values[0]
                if len(value) == REF_WIDTH:
                    merged.append((f, run_id(number, value[:RUN_ID_WIDTH]) + value[RUN_ID_WIDTH:]))
                else:
                    merged.append((f, value))
                continue
            ids = b"".join(dict.fromkeys(
                i for number, value in values for i in _chunks(resolve(number, value))
            ))  # fmt: skip
            if ids:
                merged.append((f, ids))
        yield from _record(rel, merged)
    for (owner, old), positions in runs.items():
        if not any(held for _key, held in positions):
            continue  # every position held elsewhere now (or a hole)
        run_keys, ranges = encode_run(positions)
        yield from _record(b"c:" + run_id(owner, old), [(b"k", run_keys), (b"r", ranges)])
    for rel, mapped in engine.items():
        yield from _record(rel, [(f, _mapping(by_shard)) for f, by_shard in mapped.items()])
    for rel, timed in expiring.items():
        yield from _record(
            rel,
            [(f, b"".join(by_shard[n] for n in sorted(by_shard))) for f, by_shard in timed.items()],
        )
    yield from _dictionaries(shards, present, pi, total_runs, bits, by_pod=True)


def _mapping(by_shard: Mapping[int, bytes]) -> bytes:
    """An engine key's request keys from the mappings of the shards holding one (shard ->
    request keys, most recent last): every shard's, each once, the lowest shard's last (its
    last key is what the cluster's ``get_request_key`` answers: the lowest shard's mapping)."""
    keys: dict[bytes, None] = {}
    for number in sorted(by_shard, reverse=True):
        held = by_shard[number]
        for at in range(0, len(held), HASH_WIDTH):
            key = held[at : at + HASH_WIDTH]
            keys.pop(key, None)
            keys[key] = None
    return b"".join(keys)


def _dictionaries(
    shards: list[_Shard],
    present: list[_Shard],
    pi: dict[bytes, bytes],
    total_runs: int,
    bits: int | None,
    by_pod: bool = False,
) -> Iterator[dict[str, Any]]:
    pe: dict[bytes, bytes] = {}
    pods: dict[bytes, dict[bytes, None]] = {}
    retired: dict[bytes, dict[bytes, None]] = {}
    for shard in shards:
        for entry, old in shard.pe.items():
            new = shard.ids.get(old)
            if new is None:
                raise NamespaceLayoutError(f"entry id {old.hex()} is listed but not defined")
            pe[entry] = new
        for pod, ids in shard.pp.items():
            pods.setdefault(pod, {}).update(dict.fromkeys(_chunks(_ids(shard, ids))))
        for pod, ids in shard.pr.items():
            retired.setdefault(pod, {}).update(dict.fromkeys(_chunks(_ids(shard, ids))))
    modes = {s.meta.get(b"expiry", EXPIRY_KEY.encode()) for s in shards if s.meta}
    expiry = EXPIRY_FIELD.encode() if modes == {EXPIRY_FIELD.encode()} else EXPIRY_KEY.encode()
    record = [
        (b"next_id", str(len(pi)).encode()),
        (b"next_run", str(total_runs).encode()),
        (b"expiry", expiry),
    ]
    if bits is not None:
        record.append((b"bucket_bits", str(bits).encode()))
    yield from _record(b"pe", list(pe.items()))
    yield from _record(b"pi", [*pi.items(), *record])
    yield from _record(b"pp", [(p, b"".join(ids)) for p, ids in pods.items() if ids])
    yield from _record(b"pr", [(p, b"".join(ids)) for p, ids in retired.items() if ids])
    marks = merge_watermarks(
        [{k.decode("utf-8", "surrogateescape"): v.decode("utf-8", "surrogateescape")
          for k, v in s.wm.items()} for s in shards],
        highest=by_pod,
    )  # fmt: skip
    yield from _record(
        b"wm",
        [
            (k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
            for k, (v, held) in marks.items()
            if by_pod or held == len(present)
        ],
    )
    if any(s.meta for s in shards):
        meta = [
            (b"layout", LAYOUT_VERSION.encode()),
            (b"gen", secrets.token_hex(8).encode()),
            *record,
        ]
        yield from _record(b"meta", meta)


def _chunks(ids: bytes) -> Iterator[bytes]:
    return (ids[i : i + ID_WIDTH] for i in range(0, len(ids), ID_WIDTH))

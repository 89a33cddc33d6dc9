"""``kvredis dump`` / ``restore``: a namespace exported as JSON-lines records (one per key,
byte for byte, with its expiry) and loaded back, into the same or another namespace or server."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    EXPIRY_FIELD,
    EXPIRY_KEY,
    Layout,
    expiring_item_deadline,
)
from kvredis.redis.ops import (
    expiry_mode_of,
)
from kvredis.redis.reading import (
    FIELDS_PER_CALL,
    KEYS_PER_PIPELINE,
    ScanProgress,
    chunks,
    no_progress,
    op_namespace_keys,
    op_read_hashes,
)
from kvredis.redis.requests import Command, Op, Pipeline


def op_dump(
    layout: Layout, write: Callable[[Mapping[str, Any]], None], progress: ScanProgress = no_progress
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
        for chunk in chunks(items, FIELDS_PER_CALL):
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
    for chunk in chunks(commands, KEYS_PER_PIPELINE):
        yield Pipeline(tuple(chunk))
    gate = max((d for latest in expiring.values() for d in latest.values()), default=0)
    if gate:
        yield Command(("SET", layout_prefix + b"sx", str(gate), "PXAT", str(gate)))

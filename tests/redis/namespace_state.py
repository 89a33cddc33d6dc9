"""Read a kvredis namespace straight from Redis (no kvredis client), for invariant checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from kvredis import PodEntry
from kvredis.redis.codec import decode_entry, escape_glob


@dataclass
class NamespaceState:
    """Everything a namespace holds, decoded."""

    requests: dict[int, list[PodEntry]] = field(default_factory=dict)
    engines: dict[int, list[int]] = field(default_factory=dict)
    expiring: dict[int, list[PodEntry]] = field(default_factory=dict)
    """request key -> its expiring entries (live or not yet deleted), from ``<ns>:s:<bucket>``"""
    problems: list[str] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    unheld_mappings: list[int] = field(default_factory=list)
    """engine keys none of whose request keys holds an entry: legitimate (an evict by request key
    leaves the mapping, as the reference index does), so not a problem"""


def read_namespace(client: redis.Redis, namespace: str) -> NamespaceState:
    """Decode every request and engine bucket of ``namespace`` and note layout violations.

    Violations: an empty or malformed value, a repeated id or request key within a value, an id
    without definition, an id held
    under a request key both in its request record and as an expiring entry
    (``<ns>:s:<bucket>``, 12-byte items); for runs (``<ns>:c:<id>``: keys ``k`` and ranges ``r``
    of u16 last position, u16 count, ids): a malformed run, a trailing hole or a run without
    held position, a ref (6-byte request value: run id, u16 position) that does not point at its
    own key at a held position, a held position without its key's ref, a key held at two
    positions of a run.
    """
    ns = namespace.encode()
    state = NamespaceState()
    state.keys = sorted(client.scan_iter(match=escape_glob(ns + b":") + b"*", count=1000))
    # 4-byte ids; the other fields (next_id, bucket_bits) are the meta record's backup
    defs = {k: decode_entry(v) for k, v in client.hgetall(ns + b":pi").items() if len(k) == 4}
    rprefix, eprefix = ns + b":r:", ns + b":e:"
    sprefix, cprefix = ns + b":s:", ns + b":c:"
    runs: dict[bytes, list[tuple[bytes, bytes]]] = {}  # run id -> (key, ids) per position
    expiring_ids: dict[int, list[bytes]] = {}
    for key in state.keys:
        if client.type(key) != b"hash":
            continue
        if key.startswith(cprefix) and len(key) == len(cprefix) + 4:
            runs[key[len(cprefix) :]] = _read_run(client, key, state.problems)
        elif key.startswith(sprefix) and len(key) <= len(sprefix) + 3:
            for fld, value in client.hgetall(key).items():
                h = int.from_bytes(fld, "big")
                if not value or len(value) % 12 or len(fld) != 8:
                    state.problems.append(f"malformed expiring field {key!r} {fld!r}={value!r}")
                ids = [value[i : i + 4] for i in range(0, len(value), 12)]
                expiring_ids[h] = ids
                state.expiring[h] = [defs[i] for i in ids if i in defs]
    ref_of: dict[bytes, tuple[bytes, int]] = {}
    for key in state.keys:
        if client.type(key) != b"hash":
            continue  # not written by kvredis (a squatter in the namespace)
        if key.startswith(rprefix):
            for fld, value in client.hgetall(key).items():
                h = int.from_bytes(fld, "big")
                if len(value) == 6:
                    rid, pos = value[:4], int.from_bytes(value[4:], "big")
                    ref_of[fld] = (rid, pos)
                    run = runs.get(rid, [])
                    if not 1 <= pos <= len(run) or run[pos - 1][0] != fld or not run[pos - 1][1]:
                        state.problems.append(f"request key {h} has a bad ref {value!r}")
                        continue
                    value = run[pos - 1][1]
                ids = [value[i : i + 4] for i in range(0, len(value), 4)]
                if not value or len(value) % 4 or len(fld) != 8:
                    state.problems.append(f"malformed request field {key!r} {fld!r}={value!r}")
                if len(set(ids)) != len(ids):
                    state.problems.append(f"request key {h} repeats an id: {value!r}")
                missing = [i for i in ids if i not in defs]
                if missing:
                    state.problems.append(f"request key {h} has undefined ids {missing}")
                state.requests[h] = [defs[i] for i in ids if i in defs]
        elif key.startswith(eprefix):
            for fld, value in client.hgetall(key).items():
                refs = [int.from_bytes(value[i : i + 8], "big") for i in range(0, len(value), 8)]
                if not value or len(value) % 8 or len(fld) != 8:
                    state.problems.append(f"malformed engine field {key!r} {fld!r}={value!r}")
                if len(set(refs)) != len(refs):
                    state.problems.append(f"engine key {fld!r} repeats a request key")
                state.engines[int.from_bytes(fld, "big")] = refs
    for h, ids in expiring_ids.items():
        held = {defs.get(i) for i in ids} & set(state.requests.get(h, []))
        if held:
            state.problems.append(f"request key {h} holds {held} both ways")
    for rid, run in runs.items():
        for pos, (fld, ids) in enumerate(run, 1):
            if ids and ref_of.get(fld) != (rid, pos):
                state.problems.append(f"run {rid!r} position {pos} has no ref from its key")
    for engine_key, mapped in state.engines.items():
        if not any(state.requests.get(r) or state.expiring.get(r) for r in mapped):
            state.unheld_mappings.append(engine_key)
    return state


def _read_run(client: redis.Redis, key: bytes, problems: list[str]) -> list[tuple[bytes, bytes]]:
    keys, ranges = client.hmget(key, "k", "r")
    if keys is None or ranges is None or len(keys) % 8:
        problems.append(f"malformed run {key!r}")
        return []
    out: list[tuple[bytes, bytes]] = []
    at = 0
    while at < len(ranges):
        last, count = (
            int.from_bytes(ranges[at : at + 2], "big"),
            int.from_bytes(ranges[at + 2 : at + 4], "big"),
        )
        ids = ranges[at + 4 : at + 4 + 4 * count]
        at += 4 + 4 * count
        if last <= len(out) or last * 8 > len(keys):
            problems.append(f"malformed ranges in run {key!r}")
            return []
        for pos in range(len(out), last):
            out.append((keys[pos * 8 : pos * 8 + 8], ids))
    if len(out) * 8 != len(keys) or not out or not out[-1][1]:
        problems.append(f"run {key!r} ends in a hole or covers {len(out)} of {len(keys) // 8}")
    held = [k for k, ids in out if ids]
    if len(set(held)) != len(held):
        problems.append(f"run {key!r} holds a key at two positions")
    return out

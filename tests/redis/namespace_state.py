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
    problems: list[str] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


def read_namespace(client: redis.Redis, namespace: str) -> NamespaceState:
    """Decode every request and engine bucket of ``namespace`` and note layout violations.

    Violations: an empty or malformed value, a repeated id or request key within a value, an id
    without definition, an engine mapping none of whose request keys holds an entry.
    """
    ns = namespace.encode()
    state = NamespaceState()
    state.keys = sorted(client.scan_iter(match=escape_glob(ns + b":") + b"*", count=1000))
    # 4-byte ids; the other fields (next_id, bucket_bits) are the meta record's backup
    defs = {k: decode_entry(v) for k, v in client.hgetall(ns + b":pi").items() if len(k) == 4}
    rprefix, eprefix = ns + b":r:", ns + b":e:"
    for key in state.keys:
        if client.type(key) != b"hash":
            continue  # not written by kvredis (a squatter in the namespace)
        if key.startswith(rprefix):
            for fld, value in client.hgetall(key).items():
                h = int.from_bytes(fld, "big")
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
    for engine_key, refs in state.engines.items():
        if not any(state.requests.get(r) for r in refs):
            state.problems.append(f"engine key {engine_key} maps only to empty request keys {refs}")
    return state

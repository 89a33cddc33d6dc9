"""A client of the previous releases' scripts (layout kvredis-kvblock/1), for migration tests.

The ``.lua`` files under ``<commit>/`` are those of two /1 releases (see README.md):
:class:`V1Namespace` loads one with SCRIPT LOAD and calls it with the arguments that release's
client built, enough to fill a namespace (adds with engine keys and ttls, evicts, fenced
batches) and to read it back (lookups, request keys) as that release answered.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from kvredis.redis.codec import decode_entry, encode_entry, hash_blob, hash_field
from kvredis.redis.scripts import _read_lua, expand
from kvredis.types import KeyType, PodEntry

V1 = "kvredis-kvblock/1"
#: The release with the sorted set of deadlines, and the one with the expiring buckets.
SORTED_SET_RELEASE = "dc8cf00"
EXPIRING_BUCKETS_RELEASE = "249e91a"
RELEASES = (SORTED_SET_RELEASE, EXPIRING_BUCKETS_RELEASE)
MAX_REQUEST_KEYS_PER_ENGINE_KEY = 8
ID_WIDTH = 4


def _load(raw: redis.Redis, release: str) -> dict[str, str]:
    sources = _read_lua(Path(__file__).parent / release)
    names = [n for n in sources if not n.startswith("includes/")]
    return {n: str(raw.script_load(expand(n, sources))) for n in names}


class V1Namespace:
    """One namespace written and read through the layout /1 scripts."""

    def __init__(
        self,
        raw: redis.Redis,
        namespace: str,
        release: str = SORTED_SET_RELEASE,
        expiry: str = "key",
        bucket_bits: int = 16,
    ) -> None:
        self.raw, self.namespace, self.release = raw, namespace, release
        self.sha = _load(raw, release)
        ns = namespace.encode()
        self.meta, self.pe, self.pi, self.pp = ns + b":meta", ns + b":pe", ns + b":pi", ns + b":pp"
        self.wm, self.wp, self.sx = ns + b":wm", ns + b":wp", ns + b":sx"
        self.rprefix, self.eprefix = ns + b":r:", ns + b":e:"
        token = secrets.token_hex(8)
        args = [V1, bucket_bits, token] + ([expiry] if release != SORTED_SET_RELEASE else [])
        reply = self._call("namespace", (self.meta, self.pi), args)
        self.gen, self.bits = reply[2], int(reply[1])
        self.definitions: dict[bytes, PodEntry | None] = {}

    def _call(self, name: str, keys: Sequence[bytes], args: Sequence[Any]) -> Any:
        return self.raw.evalsha(self.sha[name], len(keys), *keys, *args)

    def _bucket_args(self) -> list[Any]:
        return [self.gen, self.rprefix, self.eprefix, self.bits]

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
        ttl_ms: int = 0,
    ) -> None:
        """``add`` with engine keys mapped one to one onto the request keys (or none)."""
        unique = list(dict.fromkeys(entries))
        pairs = [k for pair in zip(engine_keys or [], request_keys, strict=False) for k in pair]
        self._call(
            "add",
            (self.meta, self.pe, self.pi, self.pp, self.sx),
            [
                *self._bucket_args(),
                MAX_REQUEST_KEYS_PER_ENGINE_KEY,
                ttl_ms,
                len(unique),
                *(encode_entry(e) for e in unique),
                "A",
                len(unique),
                *range(1, len(unique) + 1),
                hash_blob(list(request_keys)),
                hash_blob(pairs),
            ],
        )

    def _evict_op(self, key: int, key_type: KeyType, first: int, n: int) -> list[Any]:
        tag = "R" if key_type is KeyType.REQUEST else "E"
        return [tag, hash_field(key), n, *range(first, first + n)]

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        unique = list(dict.fromkeys(entries))
        keys = (
            (self.meta, self.pe)
            if self.release == SORTED_SET_RELEASE
            else (self.meta, self.pe, self.sx)
        )
        self._call(
            "evict",
            keys,
            [
                *self._bucket_args(),
                len(unique),
                *(encode_entry(e) for e in unique),
                *self._evict_op(key, key_type, 1, len(unique)),
            ],
        )

    def apply_evict_batch(
        self, stream: str, epoch: int, seq: int, key: int, entries: Sequence[PodEntry]
    ) -> None:
        """A fenced ``apply_batch`` of one evict by request key (it sets the watermark)."""
        unique = list(dict.fromkeys(entries))
        self._call(
            "apply_batch",
            (self.meta, self.pe, self.pi, self.pp, self.wm, self.wp, self.sx),
            [
                *self._bucket_args(),
                MAX_REQUEST_KEYS_PER_ENGINE_KEY,
                stream,
                epoch,
                seq,
                secrets.token_hex(8),
                1,
                1,
                len(unique),
                *(encode_entry(e) for e in unique),
                1,
                *self._evict_op(key, KeyType.REQUEST, 1, len(unique)),
            ],
        )

    def lookup(self, request_keys: Sequence[int]) -> dict[int, list[PodEntry]]:
        reply = self._call(
            "lookup",
            (self.meta, self.pi, self.pp, self.sx),
            [self.gen, self.rprefix, self.bits, 0, 0, hash_blob(list(request_keys))],
        )
        flat = reply[1]
        for i in range(0, len(flat), 2):
            self.definitions[bytes(flat[i])] = decode_entry(flat[i + 1]) if flat[i + 1] else None
        out: dict[int, list[PodEntry]] = {}
        for key, ids in zip(request_keys, reply[2:], strict=False):
            found = [self.definitions[ids[j : j + ID_WIDTH]] for j in range(0, len(ids), ID_WIDTH)]
            out[key] = [e for e in found if e is not None]
        return out

    def get_request_key(self, engine_key: int) -> int | None:
        reply = self._call(
            "request_key",
            (self.meta,),
            [self.gen, self.eprefix, self.bits, hash_field(engine_key)],
        )
        return None if reply is None else int.from_bytes(reply, "big")

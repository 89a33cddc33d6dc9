"""The reference the Redis benchmarks compare against: how the Go llm-d RedisIndex keeps the index.

Layout (one Redis database holds nothing else, because the Go index uses bare key names):

- one HASH per request key, named by the bare unsigned decimal hash (``"1234567890"``), with one
  field per pod entry. The field name is the ``encoding/json`` rendering of the Go ``PodEntry``
  struct, ``{"PodIdentifier":"pod-a","DeviceTier":"gpu","Speculative":false,"HasGroup":false,
  "GroupIdx":0}``, and the value is the empty string;
- one ZSET per engine key, named ``engine:<decimal engine hash>``, whose members are the decimal
  request keys mapped to it, scored by their position in that engine key's mapping.

Access, round trip by round trip, as the Go code makes them:

- ``lookup``: one pipeline with an HKEYS for every request key of the chain (the whole chain is
  read even when it breaks early), then every field is JSON-decoded and the chain is cut
  client-side at the first key with no (filtered) entry. 1 round trip.
- ``add``: one pipeline with a ZADD per inferred engine-to-request mapping and an HSET per
  (request key, entry). 1 round trip.
- ``evict`` by engine key: ZRANGE of the engine ZSET; then for each of its request keys a
  pipeline of HDELs followed by a prune script (delete the hash if HLEN is 0); then a prune script
  that deletes the engine ZSET only if all its request keys are empty.
  ``2 + 2 * len(request keys)`` round trips (4 for a 1:1 mapping).
- ``evict`` by request key: the HDEL pipeline and the prune script. 2 round trips.
- ``get_request_key``: ``ZRANGE engine:<k> 0 0 REV``. 1 round trip.
- ``clear``: SCAN ``*`` COUNT 1024 over the whole database; for every key that is not an engine
  ZSET: HKEYS, decode, HDEL of the pod's fields and the prune script (3 round trips per key
  holding the pod, 1 per other key).

Scripts run the way go-redis ``Script.Run`` does: EVALSHA, loading the script on NOSCRIPT.
Every method counts its round trips in :attr:`ReferenceLayout.round_trips`.

:class:`FastReferenceClient` is the same lookup (and lookup + ``LongestPrefixScorer``) on a
client fast enough to saturate one server from a few Python processes: a raw socket
(:class:`RespConnection`) sending pre-encoded RESP, replies parsed by ``hiredis.Reader`` (hiredis
comes with the ``redis[hiredis]`` dependency), and each distinct field JSON-decoded once.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import cast

import hiredis
import redis

from kvredis.checks import (
    check_add,
    check_entries,
    check_hash,
    check_key_type,
    check_pod_identifier,
    pod_filter,
)
from kvredis.errors import EngineKeyNotFoundError
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType, PodEntry

ENGINE_PREFIX = "engine:"
SCAN_BATCH = 1024

_PRUNE_REQUEST_KEY = """
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

_PRUNE_ENGINE_KEY = """
for i = 2, #KEYS do
  if redis.call('HLEN', KEYS[i]) > 0 then
    return 0
  end
end
redis.call('DEL', KEYS[1])
return 1
"""

# encoding/json escapes these in strings by default (HTML-safe output); Python's json does not.
_GO_EXTRA_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def encode_field(entry: PodEntry) -> str:
    """The hash field name Go's ``json.Marshal(PodEntry)`` produces for ``entry``."""
    text = json.dumps(
        {
            "PodIdentifier": entry.pod_identifier,
            "DeviceTier": entry.device_tier,
            "Speculative": entry.speculative,
            "HasGroup": entry.has_group,
            "GroupIdx": entry.group_idx,
        },
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return text.translate(_GO_EXTRA_ESCAPES)


def decode_field(field: bytes | str) -> PodEntry | None:
    """A hash field name back to a ``PodEntry``; ``None`` for a field that does not decode.

    Like ``json.Unmarshal`` into the Go struct: missing members take their zero value, unknown
    members are ignored.
    """
    try:
        obj = json.loads(field)
        return PodEntry(
            obj.get("PodIdentifier", ""),
            obj.get("DeviceTier", ""),
            obj.get("Speculative", False),
            obj.get("HasGroup", False),
            obj.get("GroupIdx", 0),
        )
    except (ValueError, AttributeError, TypeError):
        return None


def engine_key_name(engine_key: int) -> str:
    """Name of the ZSET holding the request keys of ``engine_key``."""
    return f"{ENGINE_PREFIX}{engine_key}"


def engine_to_request_mapping(
    engine_keys: Sequence[int], request_keys: Sequence[int]
) -> dict[int, list[int]]:
    """Each engine key's ordered request keys, by the proportional length-ratio rule."""
    mappings: dict[int, list[int]] = {}
    ne, nr = len(engine_keys), len(request_keys)
    if ne == 0 or nr == 0:
        return mappings
    n = max(ne, nr)
    for i in range(n):
        mappings.setdefault(engine_keys[i * ne // n], []).append(request_keys[i * nr // n])
    return mappings


class ReferenceLayout:
    """The Go llm-d RedisIndex layout and access pattern, on a redis-py client.

    The client should select a database used by nothing else (the layout has no namespace).
    Input is validated with the same checks as every kvredis backend, so both sides of a
    benchmark accept the same operations.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.round_trips = 0
        self._prune_request_key = client.register_script(_PRUNE_REQUEST_KEY)
        self._prune_engine_key = client.register_script(_PRUNE_ENGINE_KEY)

    def lookup(
        self, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None = None
    ) -> dict[int, list[PodEntry]]:
        """HKEYS of every key in one pipeline, decode, cut at the first key with no entry."""
        keys = [check_hash(k, "request key") for k in request_keys]
        wanted = pod_filter(pod_identifier_set)
        if not keys:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(str(key))
        replies = pipe.execute()
        self.round_trips += 1
        out: dict[int, list[PodEntry]] = {}
        for key, fields in zip(keys, replies, strict=True):
            pods: list[PodEntry] = []
            for field in fields:
                entry = decode_field(field)
                if entry is None:
                    continue
                if wanted is None or entry.pod_identifier in wanted:
                    pods.append(entry)
            if not pods:
                break
            out[key] = pods
        return out

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
    ) -> None:
        """ZADD every engine mapping and HSET every (request key, entry) in one pipeline."""
        eng, req, ents = check_add(engine_keys, request_keys, entries)
        pipe = self.client.pipeline(transaction=False)
        if eng is not None:
            for ek, rks in engine_to_request_mapping(eng, req).items():
                name = engine_key_name(ek)
                for position, rk in enumerate(rks):
                    pipe.zadd(name, {str(rk): position})
        fields = [encode_field(e) for e in ents]
        for rk in req:
            name = str(rk)
            for field in fields:
                pipe.hset(name, field, "")
        pipe.execute()
        self.round_trips += 1

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        """Remove the entries from the key; an engine key resolves through its ZSET first."""
        key = check_hash(key, "key")
        kind = check_key_type(key_type)
        fields = [encode_field(e) for e in check_entries(entries)]
        if kind is KeyType.REQUEST:
            self._evict_from_request_key(str(key), fields)
            return
        request_keys = self._request_keys(key)
        if not request_keys:
            return
        for rk in request_keys:
            self._evict_from_request_key(rk, fields)
        self._prune_engine_key(keys=[engine_key_name(key), *request_keys])
        self.round_trips += 1

    def evict_many(self, engine_keys: Sequence[int], entries: Sequence[PodEntry]) -> None:
        """A removal event's engine keys, written well: every mapping read in one pipeline
        (a ZRANGE per engine key), then every entry dropped in another (an HDEL and the prune
        script per request key, the engine-key prune script per engine key). 2 round trips
        whatever the number of keys, where :meth:`evict` pays ``2 + 2 * len(request keys)`` per
        engine key, as the Go index's own per-key ``Evict`` does."""
        keys = [check_hash(k, "engine key") for k in engine_keys]
        fields = [encode_field(e) for e in check_entries(entries)]
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrange(engine_key_name(key), 0, -1)
        members = pipe.execute()
        self.round_trips += 1
        pipe = self.client.pipeline(transaction=False)
        queued = False
        for key, found in zip(keys, members, strict=True):
            request_keys = [m.decode() if isinstance(m, bytes) else str(m) for m in found]
            if not request_keys:
                continue
            for rk in request_keys:
                pipe.hdel(rk, *fields)
                self._prune_request_key(keys=[rk], client=pipe)
            self._prune_engine_key(keys=[engine_key_name(key), *request_keys], client=pipe)
            queued = True
        if queued:
            pipe.execute()
            self.round_trips += 1

    def get_request_key(self, engine_key: int) -> int:
        """The highest-scored request key of the engine key's ZSET."""
        key = check_hash(engine_key, "engine key")
        members = self.client.zrange(engine_key_name(key), 0, 0, desc=True)
        self.round_trips += 1
        if not members:
            raise EngineKeyNotFoundError(key)
        return int(cast(bytes, members[0]))

    def clear(self, pod_identifier: str) -> None:
        """SCAN the database and remove the pod's fields key by key."""
        pod = check_pod_identifier(pod_identifier)
        cursor = 0
        while True:
            cursor, names = self.client.scan(cursor, match="*", count=SCAN_BATCH)
            self.round_trips += 1
            for name in names:
                text = name.decode() if isinstance(name, bytes) else str(name)
                if text.startswith(ENGINE_PREFIX):
                    continue
                fields = self.client.hkeys(name)
                self.round_trips += 1
                stale = [
                    f
                    for f in fields
                    if (e := decode_field(f)) is not None and e.pod_identifier == pod
                ]
                if not stale:
                    continue
                self.client.hdel(name, *stale)
                self._prune_request_key(keys=[name])
                self.round_trips += 2
            if cursor == 0:
                break

    def _request_keys(self, engine_key: int) -> list[str]:
        members = self.client.zrange(engine_key_name(engine_key), 0, -1)
        self.round_trips += 1
        return [m.decode() if isinstance(m, bytes) else str(m) for m in members]

    def _evict_from_request_key(self, name: str, fields: list[str]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for field in fields:
            pipe.hdel(name, field)
        pipe.execute()
        self._prune_request_key(keys=[name])
        self.round_trips += 2


def encode_command(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(parts)


def _reply_end(buf: bytes, pos: int) -> int:
    """Where the reply at ``buf[pos:]`` ends (an array of bulk strings), -1 if incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return -1
    if buf[pos] == 0x2D:  # "-": an error reply
        raise redis.ResponseError(buf[pos + 1 : end].decode(errors="replace"))
    if buf[pos] != 0x2A:  # "*"
        raise ConnectionError(f"expected an array reply, got {buf[pos:end]!r}")
    at = end + 2
    for _ in range(int(buf[pos + 1 : end])):
        end = buf.find(b"\r\n", at)
        if end < 0:
            return -1
        at = end + 2 + int(buf[at + 1 : end]) + 2
    return at if at <= len(buf) else -1


class RespConnection:
    """A minimal RESP client: pre-encoded commands out over a raw socket, replies parsed by
    ``hiredis.Reader``. Error replies raise ``redis.ResponseError``."""

    def __init__(self, host: str, port: int, db: int = 0) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = hiredis.Reader()
        if db:
            self.pipeline([encode_command(b"SELECT", str(db).encode())])

    def send(self, payload: bytes) -> None:
        """Send pre-encoded commands."""
        self._sock.sendall(payload)

    def replies(self, n: int) -> list[object]:
        """The next ``n`` replies."""
        out: list[object] = []
        reader = self._reader
        while len(out) < n:
            reply = reader.gets()
            if reply is False:
                data = self._sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("server closed the connection")
                reader.feed(data)
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise redis.ResponseError(str(reply))
            out.append(reply)
        return out

    def reply_runs(self, n: int) -> list[tuple[bytes, int]]:
        """The next ``n`` replies, each an array of bulk strings (or an empty array), as runs of
        byte-identical replies: (the raw RESP of one reply, how many in a row). A reply equal to
        the one before costs one byte comparison, no parsing. Reads the socket itself: call it
        only when every earlier reply has been read."""
        runs: list[tuple[bytes, int]] = []
        buf, pos, got = b"", 0, 0
        while got < n:
            if runs:
                last, count = runs[-1]
                if buf.startswith(last, pos):
                    runs[-1] = (last, count + 1)
                    pos += len(last)
                    got += 1
                    continue
            end = _reply_end(buf, pos)
            if end < 0:
                data = self._sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("server closed the connection")
                buf, pos = buf[pos:] + data, 0
                continue
            runs.append((buf[pos:end], 1))
            pos = end
            got += 1
        if pos != len(buf):
            raise ConnectionError("more replies than commands sent")
        return runs

    def pipeline(self, commands: Sequence[bytes]) -> list[object]:
        """Send the encoded ``commands`` in one write and read their replies."""
        self.send(b"".join(commands))
        return self.replies(len(commands))

    def close(self) -> None:
        self._sock.close()


class FastReferenceClient:
    """The reference lookup on a :class:`RespConnection`: one HKEYS pipeline per chain, cut at
    the first key with no entry, optionally scored as ``LongestPrefixScorer`` scores it.

    A chain is sent as the bytes of :meth:`encode_lookup`, so callers can encode their chains
    before timing. Client-side work is kept small so that the server is what saturates: each
    distinct field (and reply) is decoded once and remembered, and :meth:`score` takes a run of
    byte-identical replies (keys held by the same pods) in one step
    (:meth:`RespConnection.reply_runs`), adding the weights key by key so that the floats are
    the scorer's own.
    """

    def __init__(
        self, conn: RespConnection, medium_weights: Mapping[str, float] | None = None
    ) -> None:
        self.conn = conn
        self.scorer = LongestPrefixScorer(medium_weights)
        self._decoded: dict[bytes, PodEntry | None] = {}
        self._weights: dict[bytes, dict[str, float]] = {}

    @staticmethod
    def encode_lookup(request_keys: Iterable[int]) -> bytes:
        """The HKEYS pipeline of a chain."""
        return b"".join(encode_command(b"HKEYS", b"%d" % k) for k in request_keys)

    def _fields(self, request_keys: Sequence[int], payload: bytes | None) -> list[list[bytes]]:
        self.conn.send(payload if payload is not None else self.encode_lookup(request_keys))
        return cast(list[list[bytes]], self.conn.replies(len(request_keys)))

    def _entry(self, field: bytes) -> PodEntry | None:
        decoded = self._decoded
        if field not in decoded:
            decoded[field] = decode_field(field)
        return decoded[field]

    def lookup(
        self, request_keys: Sequence[int], payload: bytes | None = None
    ) -> dict[int, list[PodEntry]]:
        """Entries per key along the chain (as :meth:`ReferenceLayout.lookup` without a pod
        filter); ``payload`` is the chain's :meth:`encode_lookup`, encoded here if omitted."""
        if not request_keys:
            return {}
        out: dict[int, list[PodEntry]] = {}
        for key, fields in zip(request_keys, self._fields(request_keys, payload), strict=True):
            pods = [e for f in fields if (e := self._entry(f)) is not None]
            if not pods:
                break
            out[key] = pods
        return out

    def _pod_weights(self, reply: bytes) -> dict[str, float]:
        """Each pod holding a key whose HKEYS reply is ``reply`` (raw RESP), and its best tier
        weight there."""
        best = self._weights.get(reply)
        if best is None:
            reader = hiredis.Reader()
            reader.feed(reply)
            best = {}
            for field in cast(list[bytes], reader.gets()):
                entry = self._entry(field)
                if entry is None:
                    continue
                w = self.scorer.weight(entry.device_tier)
                if w > best.get(entry.pod_identifier, -math.inf):
                    best[entry.pod_identifier] = w
            self._weights[reply] = best
        return best

    def score(self, request_keys: Sequence[int], payload: bytes | None = None) -> dict[str, float]:
        """Per-pod longest-prefix scores of the chain, equal to ``LongestPrefixScorer.score``
        of :meth:`lookup`."""
        if not request_keys:
            return {}
        self.conn.send(payload if payload is not None else self.encode_lookup(request_keys))
        scores: dict[str, float] = {}
        active: dict[str, float] | None = None
        for reply, run in self.conn.reply_runs(len(request_keys)):
            best = self._pod_weights(reply)
            active = best if active is None else {p: w for p, w in best.items() if p in active}
            if not active:
                break
            for pod, w in active.items():
                total = scores.get(pod)
                todo = run
                if total is None:
                    total, todo = w, run - 1
                for _ in range(todo):
                    total += w
                scores[pod] = total
        return scores

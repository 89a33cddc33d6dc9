"""The operator's view of a namespace: statistics and watermarks here, the invariant check and its
repair in :mod:`kvredis.redis.check`, dump and restore in :mod:`kvredis.redis.dump`, the reads
they share in :mod:`kvredis.redis.reading` (their public names are re-exported here).

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
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvredis.errors import NamespaceLayoutError
from kvredis.redis.calls import CallChoice
from kvredis.redis.check import INFORMATIONAL, CheckReport, Finding, Problem, merge_checks, op_check
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    REF_WIDTH,
    bytes_text,
    decode_run,
)
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.dump import op_dump, op_restore
from kvredis.redis.executor import SyncExecutor
from kvredis.redis.layout import (
    EXPIRING_ITEM_WIDTH,
    Layout,
    expiring_item_deadline,
)
from kvredis.redis.ops import decode_watermark
from kvredis.redis.reading import (
    DUMP_FORMAT,
    KEYS_PER_PIPELINE,
    Dictionary,
    ScanProgress,
    T,
    chunks,
    no_progress,
    op_dictionary,
    op_hscan,
    op_namespace_keys,
    op_read_hashes,
    op_read_layout,
    op_scan,
    op_server_layout,
    split_ids,
)
from kvredis.redis.requests import Command, Op, Pipeline
from kvredis.redis.session import RetryPolicy, Session, op_drive
from kvredis.redis.state import CoreState

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
    "op_scan",
    "op_server_info",
    "op_server_layout",
    "op_stats",
    "op_watermarks",
]


# -- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the server says about itself."""

    server: str
    """``redis`` or ``valkey``."""
    version: str
    maxmemory_policy: str
    used_memory: int


def info_fields(reply: Any) -> dict[str, str]:
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
    server = info_fields((yield Command(("INFO", "server"))))
    memory = info_fields((yield Command(("INFO", "memory"))))
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


def op_stats(
    layout: Layout, progress: ScanProgress = no_progress, memory: bool = True
) -> Op[NamespaceStats]:
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
                    per_id.update(split_ids(value))
        elif key.startswith(layout.cprefix):
            stats.runs += 1
            try:
                positions = decode_run(fields.get(b"k", b""), fields.get(b"r", b""))
            except NamespaceLayoutError:
                return
            for _key, ids in positions:
                per_id.update(split_ids(ids))
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
        for chunk in chunks(keys, KEYS_PER_PIPELINE):
            sizes = yield Pipeline(
                tuple(Command(("MEMORY", "USAGE", k, "SAMPLES", 0)) for k in chunk)
            )
            stats.bytes_used += sum(int(s or 0) for s in sizes)
    return stats


def op_watermarks(layout: Layout) -> Op[dict[str, str]]:
    """The stored watermarks: stream -> value as stored (``"epoch:position"``)."""
    stored = yield from op_hscan(layout.wm)
    return {bytes_text(k): v.decode("utf-8", "replace") for k, v in sorted(stored.items())}


def merge_watermarks(
    shards: Sequence[Mapping[str, str]], highest: bool = False
) -> dict[str, tuple[str, int]]:
    """The watermarks of a cluster namespace: stream -> (the lowest stored value over the
    shards holding one, or with ``highest`` the highest, how many shards hold one). In the key
    layout a batch counts as applied only once every shard took it, so the lowest is the
    stream's position; in the pod layout a stream's batches go to its pod's shard, so the
    highest is. A value that does not decode counts as the lowest."""

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
    pick = max if highest else min
    return {s: (pick(v, key=order), len(v)) for s, v in sorted(held.items())}



# -- driving ------------------------------------------------------------------------------------


class Inspector:
    """Runs the ``op_*`` functions of this module against one server (the operator's client).

    Uses the connection settings of ``config`` and the same retries and error translation as
    the index: an unreachable server raises BackendUnavailableError naming the address.
    """

    def __init__(self, config: RedisIndexConfig) -> None:
        self.config = config
        self._exec = SyncExecutor(config)
        self._calls = CallChoice(config.use_functions, config.server())
        self._session = Session(
            CoreState(config.namespace, config.bucket_bits),
            self._calls.registry,
            RetryPolicy(config.retries, config.retry_backoff, config.server()),
        )

    def run(self, op: Op[T]) -> T:
        """Run one operation to its end (script calls through the function library where the
        server offers it: :class:`~kvredis.redis.calls.CallChoice`)."""
        return self._exec.run(op_drive(self._session, self._calls.op(op)))

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

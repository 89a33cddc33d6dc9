"""The operator's reads and repairs on a cluster namespace: :class:`ClusterInspector`.

A cluster namespace is ``count`` shards, each a complete single-server namespace in one slot
(:mod:`.shards`). The inspector reads the descriptor ``<ns>:cluster`` for the shard count, then
runs the single-server operator operations of :mod:`kvredis.redis.inspect` (``op_stats``,
``op_check``, ``op_dump``, ``op_restore``, ``op_watermarks``) on every shard at once, each on
the node owning its slot (:func:`~kvredis.redis.cluster.core.op_parallel`: one wave per step,
one round trip per node), and merges what they return: statistics summed with each shard's own
kept (a request key held by pods of several shards counts once in each), findings naming their
shard, watermarks at their highest over the shards (in the key layout: their lowest).

A dump of a cluster namespace holds every shard's records, each tagged with its shard; a restore
writes each record to the same shard of the target namespace and gives the target the dump's
shard count and layout (a pod's shard depends on the count, so the count travels with the
data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from kvredis.errors import ConfigError, NamespaceMissingError, translate
from kvredis.redis.cluster.core import ClusterCore, op_parallel
from kvredis.redis.cluster.executor import SyncClusterExecutor
from kvredis.redis.cluster.routing import SlotCommand, WaveOp, op_wave
from kvredis.redis.cluster.shards import (
    CLUSTER_LAYOUT,
    Descriptor,
    descriptor_key,
    parse_descriptor,
    shard_names,
    shard_slot,
)
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.inspect import (
    CheckReport,
    NamespaceStats,
    ServerInfo,
    merge_checks,
    merge_stats,
    merge_watermarks,
    op_check,
    op_dump,
    op_read_layout,
    op_restore,
    op_scan,
    op_server_info,
    op_stats,
    op_watermarks,
)
from kvredis.redis.layout import Layout
from kvredis.redis.requests import Failure, Op
from kvredis.redis.session import RetryPolicy, op_drive

__all__ = ["ClusterInspector", "ShardProgress"]

T = TypeVar("T")

#: progress(done, total) over all shards: keys processed so far, of ``total``.
ShardProgress = Callable[[int, int], None]


def _noop(_done: int, _total: int) -> None:
    return None


class _Progress:
    """Sums the progress of every shard into one ``progress(done, total)``."""

    def __init__(self, progress: ShardProgress) -> None:
        self.progress = progress
        self.seen: dict[int, tuple[int, int]] = {}

    def of(self, shard: int) -> ShardProgress:
        def report(done: int, total: int) -> None:
            self.seen[shard] = (done, total)
            values = self.seen.values()
            self.progress(sum(d for d, _ in values), sum(t for _, t in values))

        return report


class ClusterInspector:
    """Runs the operator operations of :mod:`kvredis.redis.inspect` on every shard of a
    cluster namespace (the operator's client on ``redis+cluster://``).

    Nothing here creates a namespace: :meth:`shards` is ``None`` while the namespace has no
    descriptor, and the other methods then raise
    :class:`~kvredis.errors.NamespaceMissingError`.
    """

    def __init__(self, config: RedisIndexConfig) -> None:
        if not isinstance(config, RedisIndexConfig) or not config.cluster:
            raise ConfigError(
                f"{config!r} names no cluster: use redis+cluster://host:port (or Inspector for "
                "a single server)"
            )
        self.config = config
        self._exec = SyncClusterExecutor(config)
        self.core = ClusterCore(
            config.namespace,
            config.bucket_bits,
            config.cluster_shards,
            self._exec.cluster_state,
            self._exec.wave_policy,
            RetryPolicy(config.retries, config.retry_backoff, config.server()),
        )
        self._layouts: dict[int, Layout] | None = None

    @property
    def namespace(self) -> str:
        """The cluster namespace."""
        return self.config.namespace

    def run(self, op: WaveOp[T]) -> T:
        """Run one cluster operation to its end."""
        return self._exec.run(op)

    def slot_command(self, *args: Any) -> Any:
        """One command on the node of the namespace's descriptor; its reply."""
        desc = descriptor_key(self.namespace)
        slot = shard_slot(desc.decode())
        (reply,) = self.run(
            op_wave(self.core.cluster, [SlotCommand(slot, args)], self.core.wave_policy)
        )
        if isinstance(reply, Failure):
            raise translate(reply.message)
        return reply

    def descriptor(self) -> Descriptor | None:
        """The namespace's descriptor (layout and shard count); ``None`` if it has none."""
        desc = descriptor_key(self.namespace)
        reply = self.slot_command("HMGET", desc, "layout", "shards")
        found = parse_descriptor(reply, self.namespace)
        if found is not None:
            self.core.descriptor = found
            self.core.adopt(found.shards)
        return found

    def shard_count(self) -> int | None:
        """The namespace's shard count, from its descriptor; ``None`` if it has none."""
        found = self.descriptor()
        return None if found is None else found.shards

    def shards(self) -> dict[int, Layout] | None:
        """Each shard's layout by shard number (a shard without a meta record is left out:
        it holds nothing); ``None`` if the namespace does not exist."""
        count = self.shard_count()
        if count is None:
            return None
        names = shard_names(self.namespace, count)
        found = self.run_each({i: op_read_layout(names[i]) for i in range(count)})
        self._layouts = {i: layout for i, layout in sorted(found.items()) if layout is not None}
        return self._layouts

    def _existing(self) -> dict[int, Layout]:
        layouts = self._layouts if self._layouts is not None else self.shards()
        if layouts is None:
            raise NamespaceMissingError(
                f"cluster namespace {self.namespace!r} does not exist at {self.config.server()}"
            )
        return layouts

    def run_each(self, ops: Mapping[int, Op[T]]) -> dict[int, T]:
        """Run one single-server operation per shard, all shards in lockstep (each request of
        each shard goes to the node owning the shard's slot); the results by shard."""
        sessions = self.core.sessions
        driven = {i: op_drive(sessions[i], op) for i, op in ops.items()}
        return self.run(op_parallel(self.core, driven))

    def server_info(self) -> tuple[ServerInfo, int]:
        """What the node of shard 0 says about itself, and how many primaries the cluster has."""
        if not self.core.sessions:
            self.core.adopt(1)
        info = self.run_each({0: op_server_info()})[0]
        slot_map = self.core.cluster.slot_map
        return info, len(slot_map.primaries) if slot_map is not None else 0

    def stats(self, progress: ShardProgress = _noop, memory: bool = True) -> NamespaceStats:
        """:func:`~kvredis.redis.inspect.op_stats` on every shard, merged
        (:func:`~kvredis.redis.inspect.merge_stats`)."""
        layouts = self._existing()
        sums = _Progress(progress)
        found = self.run_each({i: op_stats(lay, sums.of(i), memory) for i, lay in layouts.items()})
        return merge_stats(self.namespace, [found[i] for i in sorted(found)])

    def check(self, repair: bool = False, progress: ShardProgress = _noop) -> CheckReport:
        """:func:`~kvredis.redis.inspect.op_check` (and its repair) on every shard, merged:
        each finding names its shard. In the pod layout a shard's mappings name request keys of
        the same shard, so they are probed for holders as on one server; in the key layout they
        are not (their request keys live in other shards: no ``dangling_mapping`` note)."""
        layouts = self._existing()
        sums = _Progress(progress)
        by_pod = self.core.by_pod
        ops = {i: op_check(lay, repair, sums.of(i), mappings=by_pod) for i, lay in layouts.items()}
        found = self.run_each(ops)
        return merge_checks(self.namespace, [found[i] for i in sorted(found)])

    def watermarks(self) -> dict[str, tuple[str, int]]:
        """Per stream, its stored watermark (the highest over the shards: a stream's batches go
        to its pod's shard; in the key layout the lowest, as every shard took every batch) and
        how many shards hold one (:func:`~kvredis.redis.inspect.merge_watermarks`)."""
        layouts = self._existing()
        found = self.run_each({i: op_watermarks(lay) for i, lay in layouts.items()})
        return merge_watermarks([found[i] for i in sorted(found)], highest=self.core.by_pod)

    def dump(
        self, write: Callable[[Mapping[str, Any]], None], progress: ShardProgress = _noop
    ) -> int:
        """Every shard's records (:func:`~kvredis.redis.inspect.op_dump`), each with its shard
        number as ``shard``; the number of keys exported."""
        layouts = self._existing()
        sums = _Progress(progress)

        def tagged(shard: int) -> Callable[[Mapping[str, Any]], None]:
            return lambda record: write({**record, "shard": shard})

        found = self.run_each(
            {i: op_dump(lay, tagged(i), sums.of(i)) for i, lay in layouts.items()}
        )
        return sum(found.values())

    def holds_keys(self) -> bool:
        """Whether the namespace has a descriptor, or any key under the names of the shards
        the configuration would give it (``cluster_shards``)."""
        if self.shard_count() is not None:
            return True
        self.core.adopt(self.config.cluster_shards)
        names = shard_names(self.namespace, self.core.count)
        probes = {
            i: op_scan(Layout(names[i], 1, b"").namespace_pattern()) for i in range(len(names))
        }
        return any(self.run_each(probes).values())

    @property
    def layout_name(self) -> str:
        """The cluster layout of the namespace (after :meth:`shards`)."""
        return self.core.descriptor.layout

    def restore(
        self,
        shards: int,
        records: Callable[[int], Iterable[Mapping[str, Any]]],
        layout: str = CLUSTER_LAYOUT,
    ) -> int:
        """Write a dump of ``shards`` shards of the cluster layout ``layout`` into this (empty)
        namespace: the descriptor with that shard count and layout, then each shard's records
        (``records(shard)``) into the same shard (:func:`~kvredis.redis.inspect.op_restore`,
        shard by shard); the fields written."""
        desc = descriptor_key(self.namespace)
        self.slot_command("HSET", desc, "layout", layout, "shards", shards)
        self.core.descriptor = Descriptor(layout, shards)
        self.core.adopt(shards)
        names = shard_names(self.namespace, shards)
        written = 0
        for i in range(shards):
            prefix = names[i].encode() + b":"
            written += self.run_each({i: op_restore(prefix, records(i))})[i]
        self._layouts = None
        return written

    def close(self) -> None:
        """Close every node's connections."""
        self._exec.close()

    def __enter__(self) -> ClusterInspector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Which shard each part of a write goes to, in a namespace placed by pod (sans-IO).

Every entry of a pod lives in the pod's shard (:func:`~.shards.pod_shard`), so a write is cut by
its entries: an op whose entries belong to pods of several shards becomes one op per shard, each
with that shard's entries (the same keys, the same engine keys: each shard records the mappings
its own pods' adds make). A batch becomes one :class:`Segment` per shard it touches, in shard
order; an engine batch (one pod) is one segment. Nothing here talks to a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark
from kvredis.types import KeyType, PodEntry

#: The shard of a pod (a :func:`~.shards.pod_shard` with the namespace's shard count bound).
ShardOf = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class Segment:
    """The ops of one batch (or one add or evict) that one shard applies, atomically.

    ``batch`` numbers the batches of one call in order. ``decides``: this segment's outcome is
    its batch's (the segment on the stream's home shard, or the batch's first; the only segment
    of a batch of one pod). ``ttl_ms`` is the ttl of the speculative entries its adds store (0:
    none; only for ``Index.add``, whose ops are unfenced). ``evict``: the segment of an
    ``Index.evict``, sent as the single-server ``evict`` call (which a server out of memory
    still runs).
    """

    batch: int
    shard: int
    ops: tuple[IndexOp, ...]
    stream: str | None = None
    watermark: Watermark | None = None
    decides: bool = True
    ttl_ms: int = 0
    evict: bool = False

    @property
    def fenced(self) -> bool:
        """Whether the segment is fenced by its stream's watermark."""
        return self.stream is not None and self.watermark is not None


def entries_by_shard(
    entries: Sequence[PodEntry], shard_of: ShardOf
) -> dict[int, tuple[PodEntry, ...]]:
    """``entries`` grouped by their pod's shard, each group in the order given."""
    groups: dict[int, list[PodEntry]] = {}
    for entry in entries:
        groups.setdefault(shard_of(entry.pod_identifier), []).append(entry)
    return {shard: tuple(group) for shard, group in groups.items()}


def ops_by_shard(ops: Sequence[IndexOp], shard_of: ShardOf) -> dict[int, list[IndexOp]]:
    """Checked ops cut by shard: each shard gets, in order, every op holding entries of its pods,
    with those entries only. Shards come in ascending order. One pass; an op whose entries are
    all one shard's is kept as it is (the usual case: an engine batch is one pod's)."""
    out: dict[int, list[IndexOp]] = {}
    for op in ops:
        entries = op.entries
        first = shard_of(entries[0].pod_identifier)
        if all(shard_of(e.pod_identifier) == first for e in entries[1:]):
            out.setdefault(first, []).append(op)
            continue
        for shard, part in entries_by_shard(entries, shard_of).items():
            out.setdefault(shard, []).append(replace(op, entries=part))
    return dict(sorted(out.items()))


def batch_segments(
    batch: int,
    ops: Sequence[IndexOp],
    stream: str | None,
    watermark: Watermark | None,
    shard_of: ShardOf,
    home: int,
) -> list[Segment]:
    """The segments of one checked batch: one per shard its entries reach (an empty batch:
    one empty segment on ``home``, so a fenced one still advances its stream). The segment on
    ``home`` decides the batch's outcome, or, when the batch does not reach ``home``, its first
    segment."""
    parts = ops_by_shard(ops, shard_of) or {home: []}
    deciding = home if home in parts else next(iter(parts))
    return [
        Segment(batch, shard, tuple(part), stream, watermark, shard == deciding)
        for shard, part in parts.items()
    ]


def evict_segments(
    key: int, key_type: KeyType, entries: Sequence[PodEntry], shard_of: ShardOf
) -> list[Segment]:
    """The segments of ``Index.evict`` (checked arguments): one per shard of the entries."""
    return [
        Segment(0, shard, (EvictOp(key, key_type, part),), decides=i == 0, evict=True)
        for i, (shard, part) in enumerate(sorted(entries_by_shard(entries, shard_of).items()))
    ]


def add_segments(
    engine_keys: Sequence[int] | None,
    request_keys: Sequence[int],
    entries: Sequence[PodEntry],
    shard_of: ShardOf,
    ttl_ms: int = 0,
) -> list[Segment]:
    """The segments of ``Index.add`` (checked arguments): one per shard of the entries, each
    with the whole chain and every mapping."""
    eng = None if engine_keys is None else tuple(engine_keys)
    req = tuple(request_keys)
    return [
        Segment(0, shard, (AddOp(eng, req, part),), decides=i == 0, ttl_ms=ttl_ms)
        for i, (shard, part) in enumerate(sorted(entries_by_shard(entries, shard_of).items()))
    ]

"""Calls failed, wrong answers and the longest call while a shard's slot is resharded under a
mixed workload, on a local cluster (3 primaries, 3 replicas), with the client's defaults.

Two phases (``tests/redis/cluster/reshard.py``):

- ``migrating``: one thread adds, evicts (by request and engine key), batches, looks up and
  scores over 8 shards, checking every answer against an InMemoryIndex fed the same writes,
  another only writes (checked at the end), while the slot of the shard holding ``pod-0`` (a
  pod both write for) is moved key batch by key batch (SETSLOT IMPORTING/MIGRATING, in both
  orders, then GETKEYSINSLOT + MIGRATE, then SETSLOT NODE), there and back, ``--moves``
  times;
- ``writes-only``: a client that only writes (adds and batches for a pod on each of two shards
  of one primary: one call on that node) after one of those shards was moved to another
  primary while it was idle.

Run:  .venv/bin/python scripts/bench_cluster_reshard.py [--server valkey] [--moves 4] [--quick]
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from _bench import bench_parser, write_json


def main() -> None:
    parser = bench_parser(__doc__, "one move there and back per phase")
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--moves", type=int, default=4, help="moves there and back (default 4)")
    parser.add_argument("--keys", type=int, default=800, help="request keys in use (default 800)")
    args = parser.parse_args()
    # imported once _bench put this checkout first on the path
    from kvredis import RedisIndexConfig
    from kvredis.redis.cluster.index import RedisClusterIndex
    from tests.redis.cluster.reshard import (
        Workload,
        owner,
        primaries,
        reshard,
        run_during,
        writer_pods,
    )
    from tests.servers import LocalCluster

    moves = 1 if args.quick else args.moves
    cluster = LocalCluster(args.server)
    cluster.start()
    result: dict[str, Any] = {"server": args.server, "moves": moves}
    try:
        cfg = RedisIndexConfig(
            address=cluster.url, namespace=f"bench-{uuid.uuid4().hex[:8]}", cluster_shards=8
        )
        with RedisClusterIndex(cfg) as index:
            half = args.keys // 2
            workload = Workload(index, range(1, half + 1))
            writes = Workload(
                index, range(half + 1, args.keys + 1), 8, "ingest", False, writer_pods(index)
            )
            for _ in range(10):
                workload.step()
                writes.step()
            slot = index.core.slots[index.core.pod_shard("pod-0")]  # a shard both clients write
            home = owner(cluster, slot)
            away = next(p for p in primaries(cluster) if p != home)
            began = time.monotonic()
            migrated = 0
            for move in range(moves):
                for source, target in ((home, away), (away, home)):
                    moved: list[int] = []

                    def mover(
                        s: int = source, t: int = target, m: int = move, into: list[int] = moved
                    ) -> None:
                        into.append(reshard(cluster, slot, s, t, importing_first=m % 2 == 0))

                    run_during([workload, writes], mover)
                    migrated += moved[0]
            workload.check_all()
            writes.check_all()
            spent = time.monotonic() - began
            print(f"{args.server}: {2 * moves} slot moves ({migrated} Redis keys) in {spent:.1f} s")
            for name, run in (("mixed", workload), ("writes-only", writes)):
                outcome = run.outcome
                print(f"  {name} client during the moves: {outcome.summary()}")
                for error in outcome.errors[:3]:
                    print(f"    e.g. {error[:160]}")
                result[name] = {
                    "calls": outcome.calls,
                    "failed": outcome.failed,
                    "mismatches": outcome.mismatches,
                    "longest_ms": {k: round(v * 1000, 1) for k, v in outcome.longest.items()},
                }
            index.drop_namespace()
        result["writes_only_after_move"] = _writes_only(cluster, cfg, moves)
    finally:
        cluster.close()
    if args.json:
        write_json(args.json, result)


def _writes_only(cluster: Any, cfg: Any, moves: int) -> dict[str, Any]:
    from kvredis import AddOp, PodEntry, Watermark
    from kvredis.redis.cluster.index import RedisClusterIndex
    from tests.redis.cluster.reshard import owner, primaries, reshard

    calls = failed = 0
    longest = 0.0
    with RedisClusterIndex(cfg) as index:
        by_node: dict[int, list[int]] = {}
        for shard, slot in enumerate(index.core.slots):
            by_node.setdefault(owner(cluster, slot), []).append(shard)
        first, second = next(s[:2] for s in by_node.values() if len(s) > 1)
        # a pod on each of two shards of one primary: their writes are one call on that node
        # until the second shard's slot moves
        entries = [PodEntry(_pod_on(index, shard), "gpu") for shard in (first, second)]
        slot = index.core.slots[second]
        home = owner(cluster, slot)
        away = next(p for p in primaries(cluster) if p != home)
        for move in range(moves):
            for source, target in ((home, away), (away, home)):
                reshard(cluster, slot, source, target, pause=0)
                for step in range(50):
                    keys = [1 + (step * 4 + i) % 400 for i in range(4)]
                    mark = Watermark(move, step + 100 * (target == home))
                    for kind in ("add", "apply_batch"):
                        began = time.monotonic()
                        calls += 1
                        try:
                            if kind == "add":
                                index.add(None, keys, entries)
                            else:
                                ops = [AddOp(None, tuple(keys), tuple(entries))]
                                index.apply_batch(ops, "w", mark)
                        except Exception:  # counted
                            failed += 1
                        longest = max(longest, time.monotonic() - began)
        index.drop_namespace()
    print(
        f"writes-only client after each of {2 * moves} slot moves: {calls} writes, "
        f"{failed} failed, longest {longest * 1000:.0f} ms"
    )
    return {"calls": calls, "failed": failed, "longest_ms": round(longest * 1000, 1)}


def _pod_on(index: Any, shard: int) -> str:
    """A pod name the namespace places on ``shard``."""
    return next(f"pod-w{n}" for n in range(10_000) if index.core.pod_shard(f"pod-w{n}") == shard)


if __name__ == "__main__":
    main()

"""Acknowledged writes lost when a cluster primary dies: the fault workload run N times per mode
on a local 3+3 cluster, printing lost/acknowledged per run.

The workload (``tests/redis/cluster/faults.py``): two threads add chains of 64-512 blocks by
engine key and evict their tails by engine key, one sends watermarked batches, one looks up and
scores; a primary is killed (SIGKILL) after a second and revived as a replica once its replica
took over; every acknowledged write is then checked against the index. Modes:

- ``kill``: the plain crash, with retries covering the failover (``retries=12``);
- ``default-retries``: the same with the default ``retries=2``: how often the workload itself
  had to retry a call (BackendUnavailableError) during the failover;
- ``lagging``: the primary's replication link is cut 0.3 s before the crash (its replica
  reconnects too late): what a replica lagging behind a dying primary loses;
- ``lagging-wait``: the same with ``cluster_wait_replicas=1`` (``WAIT`` after every write).

Run:  .venv/bin/python scripts/bench_cluster_failover.py [--runs 3] [--server valkey] [--quick]
"""

from __future__ import annotations

from typing import Any

from _bench import bench_parser, write_json

MODES: dict[str, dict[str, Any]] = {
    "kill": {},
    "default-retries": {"retries": 2},
    "lagging": {"lag": 0.3},
    "lagging-wait": {"lag": 0.3, "wait_replicas": 1},
}


def main() -> None:
    parser = bench_parser(__doc__, "one run per mode")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    args = parser.parse_args()
    from tests.redis.cluster.faults import fault_run  # on the path once _bench is imported
    from tests.servers import LocalCluster

    runs = 1 if args.quick else args.runs
    cluster = LocalCluster(args.server)
    cluster.start()
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        print(f"{args.server} cluster, 3 primaries + 3 replicas, {runs} run(s) per mode")
        for mode in args.modes:
            for run in range(runs):
                outcome = fault_run(cluster, seed=run, **MODES[mode])
                print(f"{mode:16} run {run + 1}: {outcome.line()}", flush=True)
                if outcome.errors:
                    print(f"{'':16} errors: {outcome.errors[:3]}")
                results.setdefault(mode, []).append(
                    {
                        "lost": outcome.lost,
                        "acknowledged": outcome.acknowledged,
                        "acknowledged_of_killed_primary_pods": outcome.at_risk,
                        "killed_primary_pods": outcome.victim_pods,
                        "lost_after_failover": outcome.lost_after,
                        "acknowledged_after_failover": outcome.acknowledged_after,
                        "retried_by_workload": outcome.retried,
                        "errors": len(outcome.errors),
                        "longest_call_s": round(outcome.longest, 3),
                        "failover_s": round(outcome.failover, 3),
                    }
                )
        print()
        for mode, rows in results.items():
            lost = sum(r["lost"] for r in rows)
            acked = sum(r["acknowledged"] for r in rows)
            after = sum(r["lost_after_failover"] for r in rows)
            retried = sum(r["retried_by_workload"] for r in rows)
            per_run = ", ".join(f"{r['lost']}/{r['acknowledged']}" for r in rows)
            print(
                f"{mode:16} lost/acknowledged per run: {per_run}; total {lost}/{acked}, "
                f"{after} started after the failover; {retried} retried by the workload"
            )
    finally:
        cluster.close()
    if args.json:
        write_json(args.json, {"server": args.server, "runs": runs, "modes": results})


if __name__ == "__main__":
    main()

"""The index's calls by Redis Functions (FCALL) against EVALSHA: Redis CPU and the router's wall
latency per call, on one server and on a cluster.

An ``EVALSHA`` runs the whole script each call, so every call first defines the script's local
functions and tables (its includes) before the body runs. The ``kvredis`` function library
(:mod:`kvredis.redis.functions`) runs that top level once, at ``FUNCTION LOAD``, and an ``FCALL``
runs the body alone. This benchmark makes two clients of one namespace, one with
``use_functions=False`` (EVALSHA) and one with the library (the default), and calls the index
operations through each in alternating rounds. Per row it reports the Redis CPU per index call
(the ``usec`` of every command in ``INFO commandstats``, summed over the servers, divided by the
calls; on a cluster also per node a call involves) and the client's wall time per call (median
of the rounds). The server (each node) is pinned to core 0 and this client to core 1 when the
machine has two.

Dataset: a 512-block chain held by 4 pods (2 on gpu, 2 on cpu). Rows: a lookup missing at its
first key, lookups and scores of 16 and 512 blocks, an add of 16 keys (held already: the same
work every call), and a fenced apply_batch of 16 adds (a new sequence number every call).

Run:  .venv/bin/python scripts/bench_functions.py [--quick] [--server redis|valkey]
          [--cluster N] [--json PATH]
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import redis

from kvredis import AddOp, PodEntry, RedisIndexConfig, Watermark
from kvredis.redis import new_redis_index

from _bench import LocalCluster, RedisServer, bench_parser, write_json

PODS = [PodEntry(f"pod-{i}", "gpu" if i < 2 else "cpu") for i in range(4)]
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}
CHAIN = list(range(1, 513))
MODES = ("EVALSHA", "FCALL")


def _rows(index: Any, seqs: itertools.count[int], stream: str) -> dict[str, Callable[[], Any]]:
    adds = [AddOp(None, tuple(range(10**6, 10**6 + 16)), (PODS[0],))]
    return {
        "lookup, miss at the first key": lambda: index.lookup([10**9]),
        "lookup, 16 blocks": lambda: index.lookup(CHAIN[:16]),
        "lookup, 512 blocks": lambda: index.lookup(CHAIN),
        "score, 16 blocks": lambda: index.score(CHAIN[:16], WEIGHTS),
        "score, 512 blocks": lambda: index.score(CHAIN, WEIGHTS),
        "add, 16 keys": lambda: index.add(None, CHAIN[:16], [PODS[1]]),
        "apply_batch, 16 adds": lambda: index.apply_batch(adds, stream, Watermark(1, next(seqs))),
    }


def _cpu(clients: list[redis.Redis]) -> tuple[float, int]:
    """Redis CPU (µs) of every command since the last reset, summed over ``clients``' servers,
    and how many of them served a script call."""
    total, busy = 0.0, 0
    for client in clients:
        stats = client.info("commandstats")
        used = {
            k: v for k, v in stats.items() if not k.startswith(("cmdstat_config", "cmdstat_info"))
        }
        total += sum(float(v["usec"]) for v in used.values())
        calls = ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_fcall_ro")
        busy += any(int(stats.get(name, {}).get("calls", 0)) for name in calls)
    return total, busy


def measure(
    address: str, clients: list[redis.Redis], rounds: int, calls: int
) -> dict[str, dict[str, float]]:
    namespace = f"kvbench-{uuid.uuid4().hex[:8]}"
    indexes = {
        mode: new_redis_index(
            RedisIndexConfig(address=address, namespace=namespace, use_functions=mode == "FCALL")
        )
        for mode in MODES
    }
    try:
        for pod in PODS:
            indexes["EVALSHA"].add(None, CHAIN, [pod])
        seqs = itertools.count(1)
        rows = {mode: _rows(indexes[mode], seqs, f"s-{mode}") for mode in MODES}
        out: dict[str, dict[str, float]] = {}
        for label in rows["EVALSHA"]:
            cpu: dict[str, list[float]] = {m: [] for m in MODES}
            wall: dict[str, list[float]] = {m: [] for m in MODES}
            nodes = 0
            for mode in MODES:
                assert rows[mode][label]() == rows["EVALSHA"][label]() or label.startswith(
                    ("add", "apply")
                ), label  # the same result both ways
            for _ in range(rounds):
                for mode in MODES:
                    call = rows[mode][label]
                    for client in clients:
                        client.config_resetstat()
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    wall[mode].append((time.perf_counter() - start) / calls * 1e6)
                    used, busy = _cpu(clients)
                    cpu[mode].append(used / calls)
                    nodes = max(nodes, busy)
            evalsha, fcall = (statistics.median(cpu[m]) for m in MODES)
            out[label] = {
                "evalsha_cpu_us": round(evalsha, 1),
                "fcall_cpu_us": round(fcall, 1),
                "fcall/evalsha": round(fcall / evalsha, 2),
                "saved_cpu_us": round(evalsha - fcall, 1),
                "nodes": nodes,
                "evalsha_wall_us": round(statistics.median(wall["EVALSHA"]), 1),
                "fcall_wall_us": round(statistics.median(wall["FCALL"]), 1),
            }
        indexes["FCALL"].drop_namespace()
        return out
    finally:
        for index in indexes.values():
            index.close()


def _pin(pids: list[int]) -> None:
    if (os.cpu_count() or 1) > 1:  # servers on core 0, this client on core 1
        for pid in pids:
            os.sched_setaffinity(pid, {0})
        os.sched_setaffinity(0, {1})


def run(kind: str, cluster: int, rounds: int, calls: int) -> dict[str, Any]:
    with ExitStack() as stack:
        if cluster:
            nodes = LocalCluster(kind, primaries=cluster, replicas=0)
            stack.callback(nodes.close)
            nodes.start()
            address = nodes.url
            ports = nodes.ports
            pids = [pid for pid in (node.pid for node in nodes.nodes) if pid is not None]
        else:
            server = RedisServer(kind)
            stack.callback(server.close)
            server.start()
            address, ports = server.url, [server.port]
            pids = [server.pid] if server.pid is not None else []
        _pin(pids)
        clients = [redis.Redis(port=port) for port in ports]
        for client in clients:
            stack.callback(client.close)
        return measure(address, clients, rounds, calls)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "3 rounds of 100 calls per row")
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="N", help="a cluster of N primaries (0: none)"
    )
    args = parser.parse_args(argv)
    rounds, calls = (3, 100) if args.quick else (7, 1000)
    result = run(args.server, args.cluster, rounds, calls)
    where = f"cluster of {args.cluster} primaries" if args.cluster else "one server"
    print(f"{args.server}, {where}: per index call, median of {rounds} rounds of {calls} calls")
    print(
        f"{'row':<32} {'CPU EVALSHA':>11} {'FCALL':>7} {'ratio':>6} {'saved':>6} {'nodes':>5} "
        f"{'wall EVALSHA':>12} {'FCALL':>7}"
    )
    for label, row in result.items():
        print(
            f"{label:<32} {row['evalsha_cpu_us']:>11} {row['fcall_cpu_us']:>7} "
            f"{row['fcall/evalsha']:>5}x {row['saved_cpu_us']:>6} {row['nodes']:>5} "
            f"{row['evalsha_wall_us']:>12} {row['fcall_wall_us']:>7}"
        )
    if args.json:
        write_json(args.json, {"server": args.server, "cluster": args.cluster, "rows": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

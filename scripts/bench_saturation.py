"""Saturation: K client processes scoring random whole chains, kvredis against the Go layout.

Loads the 20k-chain dataset (scripts/_chains.py: 1,000 families x 384-block prefix + 20 x
128-block tails, 8 pods) into one server, kvredis in database 0 under its own namespace, the
reference layout (scripts/reference_layout.py) in database 1; request keys only, unless
``--engine-keys`` (scoring reads no engine mapping, and loading them doubles the load time).
Then, for K = 1, 2, 4, 8 client processes and each side in turn, every client scores random
whole chains back to back for a fixed time: kvredis by ``RedisIndex.score`` (one EVALSHA), the
reference by one HKEYS pipeline per chain and ``LongestPrefixScorer``'s result computed on the
client by ``FastReferenceClient`` (a raw socket with pre-encoded RESP; replies parsed by
hiredis, identical replies compared as bytes), so that a few Python processes can saturate the
server. Both sides' scores are checked against each other first. The time of each K is split
into ``--rounds`` windows per side, the sides alternating, so both see the same machine state.

The server is pinned to CPU 0 and the clients to CPU 1 (``sched_setaffinity``, as ``taskset``
does) when the machine has two CPUs or more. Reported per run: ops/s, p50/p99 latency, the
server's CPU (``INFO cpu`` deltas of used_cpu_sys + used_cpu_user over the timed window, minus
the idle rate measured before), ops per server-core-second (ops/s divided by that fraction) and
the clients' own CPU (``time.process_time`` of each client over its timed loop, summed), in % of
one core and per op: with the clients on one core, a server below 100% while the clients are
near 100% means the clients, not the server, set the rate.

Run:  .venv/bin/python scripts/bench_saturation.py [--quick] [--json PATH] [--server redis|valkey]
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from threading import Barrier

import redis

from kvredis.redis import RedisIndex, RedisIndexConfig

from _bench import RedisServer, bench_parser, percentile, write_json
from _chains import TWENTY_K_CHAINS, WEIGHTS, Dataset, build, load_kvredis, load_reference
from reference_layout import FastReferenceClient, RespConnection

REFERENCE_DB = 1
SERVER_CPU = 0
CLIENT_CPU = 1
#: chains each client cycles through (picked at random from the dataset, encoded before timing)
CHAINS_PER_CLIENT = 256
SIDES = ("kvredis", "reference")


@dataclass
class Run:
    """One timed run: ``clients`` processes of one side scoring chains for ``seconds``."""

    side: str
    clients: int
    seconds: float
    ops: int
    ops_per_s: float
    p50_us: float
    p99_us: float
    server_cpu_pct: float
    ops_per_server_core_s: float | None
    #: CPU the client processes used over their timed loops (``time.process_time``), in % of
    #: one core, and per op
    client_cpu_pct: float = 0.0
    client_cpu_us_per_op: float = 0.0


@dataclass
class Result:
    """A whole benchmark: the dataset, the load times and every run."""

    server: str
    dataset: dict[str, object]
    load_seconds: dict[str, float]
    idle_server_cpu_pct: float
    seconds_per_run: float
    rounds: int
    cpus: int | None
    runs: list[Run]


@dataclass(frozen=True)
class Target:
    """Where the clients find the data."""

    host: str
    port: int
    namespace: str


def pin(pid: int, cpu: int) -> None:
    """Pin ``pid`` to ``cpu`` when the machine has more than one CPU."""
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(pid, {cpu})


def server_cpu(client: redis.Redis) -> float:
    """CPU seconds the server has used (user + sys, main thread and children)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _client(
    side: str,
    target: Target,
    data: Dataset,
    seed: int,
    seconds: float,
    start: Barrier,
    out: multiprocessing.connection.Connection,
) -> None:
    """One client process: warm up, wait at ``start`` for the others, then score random chains
    for ``seconds`` and send back the latencies (µs) of its calls and the CPU seconds it used."""
    pin(0, CLIENT_CPU)
    rng = random.Random(seed)
    chains = data.random_chains(rng, CHAINS_PER_CLIENT)
    latencies: list[float] = []
    if side == "kvredis":
        config = RedisIndexConfig(
            address=f"redis://{target.host}:{target.port}/0", namespace=target.namespace
        )
        index = RedisIndex(config)

        def call(i: int) -> object:
            return index.score(chains[i], WEIGHTS)

        close = index.close
    else:
        conn = RespConnection(target.host, target.port, REFERENCE_DB)
        ref = FastReferenceClient(conn, WEIGHTS)
        payloads = [ref.encode_lookup(c) for c in chains]

        def call(i: int) -> object:
            return ref.score(chains[i], payloads[i])

        close = conn.close
    try:
        for i in range(min(8, len(chains))):
            call(i)  # warm up: connection, scripts, decode cache
        start.wait()
        i = 0
        n = len(chains)
        clock = time.perf_counter_ns
        cpu = time.process_time()
        stop_at = clock() + int(seconds * 1e9)
        while clock() < stop_at:
            t = clock()
            call(i % n)
            latencies.append((clock() - t) / 1000.0)
            i += 1
        out.send((latencies, time.process_time() - cpu))
    finally:
        close()
        out.close()


def idle_rate(client: redis.Redis, seconds: float) -> float:
    """Server CPU seconds per second with no clients but this one's INFO calls."""
    before, t = server_cpu(client), time.perf_counter()
    time.sleep(seconds)
    return (server_cpu(client) - before) / (time.perf_counter() - t)


@dataclass
class Window:
    """What one timed window of one side measured."""

    latencies: list[float]
    seconds: float
    server_cpu_s: float
    client_cpu_s: float


def timed_window(
    side: str, clients: int, seconds: float, target: Target, data: Dataset, probe: redis.Redis,
    seed: int,
) -> Window:
    """Start ``clients`` processes of ``side``, time ``seconds`` of their calls."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(clients + 1)
    pipes, procs = [], []
    for c in range(clients):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_client,
            args=(side, target, data, seed * 1000 + c, seconds, start, send),
        )
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    start.wait(timeout=60)
    cpu0, t0 = server_cpu(probe), time.perf_counter()
    time.sleep(seconds)
    cpu1, t1 = server_cpu(probe), time.perf_counter()
    latencies: list[float] = []
    client_cpu = 0.0
    for recv, proc in zip(pipes, procs, strict=True):
        got, used = recv.recv()
        latencies.extend(got)
        client_cpu += used
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{side} client exited with {proc.exitcode}")
    return Window(latencies, t1 - t0, cpu1 - cpu0, client_cpu)


def summarize(side: str, clients: int, windows: list[Window], idle: float) -> Run:
    """One side's windows at one K as a run."""
    latencies = [x for w in windows for x in w.latencies]
    window = sum(w.seconds for w in windows)
    busy = max(0.0, sum(w.server_cpu_s for w in windows) / window - idle)
    ops_per_s = len(latencies) / window
    client_cpu = sum(w.client_cpu_s for w in windows)
    return Run(
        side=side,
        clients=clients,
        seconds=round(window, 3),
        ops=len(latencies),
        ops_per_s=ops_per_s,
        p50_us=statistics.median(latencies) if latencies else 0.0,
        p99_us=percentile(latencies, 0.99) if latencies else 0.0,
        server_cpu_pct=100.0 * busy,
        ops_per_server_core_s=ops_per_s / busy if busy > 0 else None,
        client_cpu_pct=100.0 * client_cpu / window,
        client_cpu_us_per_op=1e6 * client_cpu / len(latencies) if latencies else 0.0,
    )


def check_agree(target: Target, data: Dataset, seed: int, n: int = 8) -> None:
    """Both sides give the same scores for ``n`` random chains."""
    chains = data.random_chains(random.Random(seed), n)
    config = RedisIndexConfig(
        address=f"redis://{target.host}:{target.port}/0", namespace=target.namespace
    )
    conn = RespConnection(target.host, target.port, REFERENCE_DB)
    with RedisIndex(config) as index:
        ref = FastReferenceClient(conn, WEIGHTS)
        for chain in chains:
            got, expected = index.score(chain, WEIGHTS), ref.score(chain)
            if got != expected:
                raise AssertionError(f"sides disagree on a chain: {got} != {expected}")
    conn.close()


def run(
    server_kind: str,
    scale: float,
    seconds: float,
    client_counts: list[int],
    seed: int,
    engine_keys: bool = False,
    rounds: int = 1,
) -> Result:
    data = build(TWENTY_K_CHAINS.scaled(scale))
    server = RedisServer(server_kind)
    server.start()
    try:
        assert server.proc is not None
        pin(server.proc.pid, SERVER_CPU)
        pin(0, CLIENT_CPU)
        target = Target("127.0.0.1", server.port, f"bench-{uuid.uuid4().hex[:8]}")
        config = RedisIndexConfig(address=f"{server.url}/0", namespace=target.namespace)
        kv_load = load_kvredis(config, data, with_engine_keys=engine_keys)
        ref_load = load_reference(
            target.host, target.port, REFERENCE_DB, data, with_engine_keys=engine_keys
        )
        check_agree(target, data, seed)
        probe = redis.Redis(host=target.host, port=target.port)
        idle = idle_rate(probe, min(1.0, seconds))
        runs = []
        for clients in client_counts:
            # the sides alternate in rounds, so that both see the same machine state
            windows: dict[str, list[Window]] = {side: [] for side in SIDES}
            for r in range(rounds):
                for side in SIDES:
                    windows[side].append(
                        timed_window(
                            side, clients, seconds / rounds, target, data, probe, seed + r
                        )
                    )
            runs += [summarize(side, clients, windows[side], idle) for side in SIDES]
        probe.close()
    finally:
        server.close()
    dataset: dict[str, object] = {
        "name": data.spec.name,
        "scale": scale,
        "chains": data.chains,
        "chain_blocks": data.spec.chain_blocks,
        "pods": data.spec.pods,
        "distinct_keys": data.distinct_keys(),
        "entries": data.entries(),
        "engine_keys": engine_keys,
    }
    loads = {"kvredis": kv_load.seconds, "reference": ref_load.seconds}
    return Result(
        server_kind, dataset, loads, 100.0 * idle, seconds, rounds, os.cpu_count(), runs
    )


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(result: Result) -> None:
    runs = result.runs
    ds = result.dataset
    print(
        f"{ds['name']} (scale {ds['scale']:g}): {ds['chains']:,} chains of "
        f"{ds['chain_blocks']} blocks, {ds['pods']} pods, {ds['distinct_keys']:,} keys, "
        f"{ds['entries']:,} entries; server {result.server}; load "
        f"{result.load_seconds['kvredis']:.1f} s (kvredis), "
        f"{result.load_seconds['reference']:.1f} s (reference)"
    )
    header = (
        f"{'side':<10} {'K':>2} {'ops/s':>8} {'p50 µs':>8} {'p99 µs':>8} {'server CPU':>10} "
        f"{'ops/core-s':>10} {'vs ref':>7} {'client CPU':>10} {'µs/op':>6}"
    )
    print(header)
    print("-" * len(header))
    per_core = {(r.side, r.clients): r.ops_per_server_core_s for r in runs}
    for r in runs:
        ratio = ""
        ref = per_core.get(("reference", r.clients))
        if r.side == "kvredis" and ref and r.ops_per_server_core_s:
            ratio = f"{r.ops_per_server_core_s / ref:.2f}x"
        print(
            f"{r.side:<10} {r.clients:>2} {fmt(r.ops_per_s):>8} {fmt(r.p50_us):>8} "
            f"{fmt(r.p99_us):>8} {fmt(r.server_cpu_pct, '.0f') + '%':>10} "
            f"{fmt(r.ops_per_server_core_s):>10} {ratio:>7} "
            f"{fmt(r.client_cpu_pct, '.0f') + '%':>10} {fmt(r.client_cpu_us_per_op):>6}"
        )
    print(
        "ops = whole-chain scores; server CPU = INFO cpu delta over the window minus idle "
        f"({result.idle_server_cpu_pct:.1f}%); ops/core-s = ops/s / server CPU fraction; "
        "client CPU = the client processes' CPU (they share one core) in % of one core, and "
        "per op"
    )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "1/20 of the dataset, 1 s per run (seconds)")
    parser.add_argument("--server", choices=["redis", "valkey"], default="redis")
    parser.add_argument("--scale", type=float, default=None, help="fraction of the 20k chains")
    parser.add_argument(
        "--seconds", type=float, default=None, help="timed seconds per side and K (default 12)"
    )
    parser.add_argument("--clients", default="1,2,4,8", help="client process counts, e.g. 1,2,4")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=None, help="alternations of the sides per K (default 3)"
    )
    parser.add_argument(
        "--engine-keys",
        action="store_true",
        help="also load the engine-to-request mappings (scoring never reads them; ~2x the load)",
    )
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else (0.05 if args.quick else 1.0)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 12.0)
    counts = [int(c) for c in args.clients.split(",")]
    rounds = args.rounds or (1 if args.quick else 3)
    result = run(args.server, scale, seconds, counts, args.seed, args.engine_keys, rounds)
    print_table(result)
    if args.json:
        write_json(args.json, asdict(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

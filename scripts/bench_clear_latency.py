"""Lookup latency while RedisIndex.clear removes a pod holding 1M entries.

Starts its own redis-server (or uses ``--url``), loads ``--entries`` request keys held by the
victim pod (every 4th also held by a bystander pod, so the clear must leave those keys in place)
plus a 128-block chain held by the victim and three other pods. A second process then looks the
chain up in a loop, first for a quiet baseline, then while the main process runs
``clear(victim)``. Reported: lookup p50/p99/max during the clear, the clear's duration, entries/s,
the number of pages (progress callbacks) and, on its own server, every command that ran for
1 ms or more on the server during the clear (SLOWLOG), so a batch size that blocks Redis for
too long shows up by name. Target: lookup p99 under 10 ms during the clear.

Run:  .venv/bin/python scripts/bench_clear_latency.py [--quick]
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import redis

from kvredis.batch import AddOp
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.redis.scripts import ScriptRegistry
from kvredis.types import PodEntry

from _bench import bench_parser, percentile, redis_server, write_json

TARGET_P99_MS = 10.0
CHAIN = 128
KEYS_PER_OP = 512
OPS_PER_CALL = 8
VICTIM = PodEntry("victim-pod", "gpu")
BYSTANDER = PodEntry("bystander-pod", "gpu")
OTHERS = [PodEntry(f"other-pod-{i}", "cpu") for i in range(3)]


#: Commands running at least this long are logged (SLOWLOG) during the clear.
SLOW_US = 1000


@dataclass
class ServerTime:
    """Commands (script name, or command word) that ran >= SLOW_US on the server in the clear."""

    command: str
    slow_calls: int
    p99_ms: float
    max_ms: float


@dataclass
class Result:
    """Figures of one run."""

    entries: int
    load_seconds: float
    clear_seconds: float
    entries_per_second: float
    progress_calls: int
    fields_per_call: int
    server: list[ServerTime]
    baseline_lookups: int
    baseline_p50_ms: float
    baseline_p99_ms: float
    lookups_during_clear: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @property
    def verdict(self) -> str:
        return "PASS" if self.p99_ms < TARGET_P99_MS else "MISS"


def lookup_loop(
    address: str, namespace: str, chain: list[int], go: Event, stop: Event, out: Connection
) -> None:
    """Child process: look ``chain`` up until ``stop``; send (start_ns, latency_ns) pairs."""
    index = RedisIndex(RedisIndexConfig(address=address, namespace=namespace))
    samples: list[tuple[int, int]] = []
    try:
        index.lookup(chain)
        go.set()
        while not stop.is_set():
            start = time.monotonic_ns()
            index.lookup(chain)
            samples.append((start, time.monotonic_ns() - start))
    finally:
        index.close()
    out.send(samples)
    out.close()


def load(index: RedisIndex, entries: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Store the workload; returns (victim-only keys sample, shared keys sample)."""
    ops: list[AddOp] = []
    victim_only: list[int] = []
    shared: list[int] = []
    done = 0
    while done < entries:
        n = min(KEYS_PER_OP, entries - done)
        req = tuple(rng.getrandbits(64) for _ in range(n))
        eng = tuple(rng.getrandbits(64) for _ in range(n))
        ops.append(AddOp(eng, req, (VICTIM,)))
        both = req[::4]
        ops.append(AddOp(None, both, (BYSTANDER,)))
        if len(victim_only) < 64:
            victim_only.append(req[1])
            shared.append(req[0])
        done += n
        if len(ops) >= OPS_PER_CALL:
            index.apply_batch(ops)
            ops = []
    if ops:
        index.apply_batch(ops)
    return victim_only, shared


def start_command_log(address: str) -> None:
    """Make the (own) server log commands of SLOW_US or more in SLOWLOG."""
    conn = redis.Redis.from_url(address)
    try:
        conn.config_set("slowlog-max-len", 1_000_000)
        conn.config_set("slowlog-log-slower-than", SLOW_US)
        conn.slowlog_reset()
    finally:
        conn.close()


def server_times(address: str) -> list[ServerTime]:
    """Slow commands logged since :func:`start_command_log`, grouped by script or command."""
    names = {s.sha: s.name for s in (ScriptRegistry()[n] for n in ScriptRegistry().names())}
    conn = redis.Redis.from_url(address)
    try:
        conn.config_set("slowlog-log-slower-than", 10_000)
        log = conn.slowlog_get(-1)
        conn.slowlog_reset()
    finally:
        conn.close()
    by: dict[str, list[float]] = {}
    for item in log:
        if bytes(item.get("client_address") or b"").startswith(b"?"):
            continue  # a command a script ran; its time is part of the script's
        words = bytes(item["command"]).split(b" ")
        name = words[0].decode("ascii", "replace").upper()
        if name in ("SLOWLOG", "CONFIG"):
            continue
        if name == "EVALSHA" and len(words) > 1:
            name = names.get(words[1].decode("ascii", "replace"), "EVALSHA ?")
        by.setdefault(name, []).append(item["duration"] / 1000.0)
    return [
        ServerTime(k, len(v), percentile(v, 0.99), max(v))
        for k, v in sorted(by.items(), key=lambda kv: -len(kv[1]))
    ]


def run(
    entries: int,
    url: str | None,
    baseline_seconds: float,
    seed: int,
    fields_per_call: int | None,
) -> Result:
    rng = random.Random(seed)
    with redis_server(url) as address:
        namespace = f"bench-clear-{uuid.uuid4().hex[:8]}"
        config = RedisIndexConfig(address=address, namespace=namespace)
        if fields_per_call is not None:
            config = dataclasses.replace(config, clear_fields_per_call=fields_per_call)
        index = RedisIndex(config)
        try:
            start = time.perf_counter()
            victim_only, shared = load(index, entries, rng)
            chain = [rng.getrandbits(64) for _ in range(CHAIN)]
            index.add(None, chain, [VICTIM, *OTHERS])
            load_seconds = time.perf_counter() - start
            print(f"loaded {entries:,} victim entries in {load_seconds:.1f} s", flush=True)
            assert all(len(v) == 2 for v in index.lookup(shared[:1]).values())

            ctx = mp.get_context("spawn")
            go, stop = ctx.Event(), ctx.Event()
            receiver, sender = ctx.Pipe(duplex=False)
            child = ctx.Process(
                target=lookup_loop, args=(address, namespace, chain, go, stop, sender)
            )
            child.start()
            sender.close()
            if not go.wait(60):
                raise SystemExit("the lookup process did not start")
            base_from = time.monotonic_ns()
            time.sleep(baseline_seconds)
            base_to = time.monotonic_ns()

            calls = 0
            if url is None:
                start_command_log(address)

            def progress(_done: int, _total: int) -> None:
                nonlocal calls
                calls += 1

            clear_from = time.monotonic_ns()
            index.clear(VICTIM.pod_identifier, progress=progress)
            clear_to = time.monotonic_ns()
            timings = server_times(address) if url is None else []
            time.sleep(0.05)
            stop.set()
            samples: list[tuple[int, int]] = receiver.recv()
            child.join(30)

            after = index.lookup(chain)
            assert len(after) == CHAIN and all(VICTIM not in v for v in after.values())
            assert index.lookup(victim_only[:1]) == {}
            survivors = index.lookup(shared)
            assert len(survivors) == len(shared)
            assert all(v == [BYSTANDER] for v in survivors.values())
        finally:
            index.drop_namespace()  # leave nothing behind on a --url server
            index.close()

    base = [lat / 1e6 for t, lat in samples if base_from <= t and t + lat <= base_to]
    during = [lat / 1e6 for t, lat in samples if t + lat >= clear_from and t <= clear_to]
    if not during or not base:
        raise SystemExit("no lookups were measured; the clear was too short to sample")
    clear_seconds = (clear_to - clear_from) / 1e9
    return Result(
        entries=entries,
        load_seconds=load_seconds,
        clear_seconds=clear_seconds,
        entries_per_second=entries / clear_seconds,
        progress_calls=calls,
        fields_per_call=config.clear_fields_per_call,
        server=timings,
        baseline_lookups=len(base),
        baseline_p50_ms=statistics.median(base),
        baseline_p99_ms=percentile(base, 0.99),
        lookups_during_clear=len(during),
        p50_ms=statistics.median(during),
        p99_ms=percentile(during, 0.99),
        max_ms=max(during),
    )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "50k entries (seconds)")
    parser.add_argument("--entries", type=int, default=None, help="victim entries (default 1M)")
    parser.add_argument("--url", default=None, help="use this Redis instead of starting one")
    parser.add_argument(
        "--fields-per-call",
        type=int,
        default=None,
        help="RedisIndexConfig.clear_fields_per_call (default: the library's)",
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    entries = args.entries or (50_000 if args.quick else 1_000_000)
    r = run(entries, args.url, 0.5 if args.quick else 2.0, args.seed, args.fields_per_call)
    print(
        f"clear of {r.entries:,} entries: {r.clear_seconds:.2f} s, "
        f"{r.entries_per_second:,.0f} entries/s, {r.progress_calls} progress callbacks"
    )
    print(
        f"server: commands of >= {SLOW_US / 1000:g} ms during the clear "
        f"(clear_fields_per_call {r.fields_per_call}):"
        + ("" if r.server else " none")
    )
    for t in r.server:
        print(
            f"  {t.command:<16} {t.slow_calls:>6,} calls  p99 {t.p99_ms:6.2f} ms  "
            f"max {t.max_ms:6.2f} ms"
        )
    print(
        f"lookup of a {CHAIN}-block chain, quiet:        p50 {r.baseline_p50_ms:.2f} ms  "
        f"p99 {r.baseline_p99_ms:.2f} ms  ({r.baseline_lookups} lookups)"
    )
    print(
        f"lookup of a {CHAIN}-block chain, during clear: p50 {r.p50_ms:.2f} ms  "
        f"p99 {r.p99_ms:.2f} ms  max {r.max_ms:.2f} ms  ({r.lookups_during_clear} lookups)"
    )
    print(f"target p99 < {TARGET_P99_MS:g} ms: {r.verdict}")
    if args.json:
        write_json(args.json, {**asdict(r), "verdict": r.verdict})
    return 0 if r.verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Latency of RedisIndex against the Go llm-d Redis layout, side by side on one loopback server.

Starts its own redis-server on a free port (or uses ``--url``). kvredis runs in database 0 under
its own namespace, the reference layout (scripts/reference_layout.py) in database 1. Calls of the
two sides alternate in small rounds so both see the same machine state; each side's answers are
checked against the other's before anything is timed.

Run:  .venv/bin/python scripts/bench_redis.py [--quick] [--json PATH]
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis

from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType, PodEntry

from _bench import REPO, bench_parser, percentile, redis_server, write_json
from reference_layout import ReferenceLayout

REFERENCE_DB = 1
CHAIN = 512
MISS_AT = 16
EVENT_BLOCKS = 64
PODS = [PodEntry(f"pod-{i}", "gpu" if i < 2 else "cpu") for i in range(4)]
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}


@dataclass
class Row:
    """One benchmarked operation: latency percentiles of both sides and their ratio."""

    op: str
    kvredis_p50_us: float
    kvredis_p99_us: float
    reference_p50_us: float | None
    reference_p99_us: float | None
    ratio: float | None
    target: float | None
    strict: bool
    calls: int
    reference_round_trips: float | None

    @property
    def verdict(self) -> str:
        if self.target is None or self.ratio is None:
            return ""
        ok = self.ratio > self.target if self.strict else self.ratio >= self.target
        return "PASS" if ok else "MISS"


def timed(fn: Callable[[int], object], calls: range) -> list[float]:
    """Latency (µs) of ``fn(i)`` for each ``i`` in ``calls``."""
    out = []
    for i in calls:
        start = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - start) / 1000.0)
    return out


def alternate(
    kv: Callable[[int], object],
    ref: Callable[[int], object] | None,
    calls: int,
    round_size: int = 10,
) -> tuple[list[float], list[float]]:
    """Latencies (µs) of ``calls`` calls of each side, alternating rounds of ``round_size``.

    Each callable gets the call number, so a side can use fresh keys per call.
    """
    kv_lat: list[float] = []
    ref_lat: list[float] = []
    done = 0
    while done < calls:
        batch = range(done, min(calls, done + round_size))
        gc.collect()
        kv_lat.extend(timed(kv, batch))
        if ref is not None:
            gc.collect()
            ref_lat.extend(timed(ref, batch))
        done = batch.stop
    return kv_lat, ref_lat


def row(
    op: str,
    lat: tuple[list[float], list[float]],
    target: float | None = None,
    strict: bool = False,
    reference_round_trips: float | None = None,
) -> Row:
    kv_lat, ref_lat = lat
    kv50 = statistics.median(kv_lat)
    ref50 = statistics.median(ref_lat) if ref_lat else None
    return Row(
        op=op,
        kvredis_p50_us=kv50,
        kvredis_p99_us=percentile(kv_lat, 0.99),
        reference_p50_us=ref50,
        reference_p99_us=percentile(ref_lat, 0.99) if ref_lat else None,
        ratio=None if ref50 is None else ref50 / kv50,
        target=target,
        strict=strict,
        calls=len(kv_lat),
        reference_round_trips=reference_round_trips,
    )


def fresh_keys(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def same(a: dict[int, list[PodEntry]], b: dict[int, list[PodEntry]]) -> bool:
    return {k: set(v) for k, v in a.items()} == {k: set(v) for k, v in b.items()}


def host_port(url: str) -> tuple[str, int]:
    """The host and port of the server at ``url``."""
    conn = redis.Redis.from_url(url)
    kw = conn.connection_pool.connection_kwargs
    conn.close()
    return str(kw.get("host", "127.0.0.1")), int(kw.get("port", 6379))


def run(calls: int, url: str | None, seed: int) -> list[Row]:
    rng = random.Random(seed)
    rows: list[Row] = []
    with redis_server(url) as address:
        host, port = host_port(address)
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        ref_client = redis.Redis(host=host, port=port, db=REFERENCE_DB)
        if url is not None and ref_client.dbsize():
            ref_client.close()
            raise SystemExit(f"database {REFERENCE_DB} of {url} must be empty for the reference")
        ref = ReferenceLayout(ref_client)
        kv = RedisIndex(RedisIndexConfig(address=f"redis://{host}:{port}/0", namespace=namespace))
        raw_client = redis.Redis(host=host, port=port, db=0)
        try:
            rows = _bench(kv, ref, ref_client, raw_client, calls, rng)
        finally:
            for name in raw_client.scan_iter(match=f"{namespace}*", count=1000):
                raw_client.unlink(name)
            ref_client.flushdb()
            kv.close()
            ref_client.close()
            raw_client.close()
    return rows


def _bench(
    kv: RedisIndex,
    ref: ReferenceLayout,
    ref_client: redis.Redis,
    raw_client: redis.Redis,
    calls: int,
    rng: random.Random,
) -> list[Row]:
    rows: list[Row] = []

    def measure(
        op: str,
        kv_call: Callable[[int], object],
        ref_call: Callable[[int], object] | None,
        n: int = calls,
        target: float | None = None,
        strict: bool = False,
    ) -> None:
        before = ref.round_trips
        lat = alternate(kv_call, ref_call, n)
        trips = (ref.round_trips - before) / len(lat[1]) if lat[1] else None
        rows.append(row(op, lat, target, strict, trips))

    # The floor: one EVALSHA of a script that does nothing.
    ping_sha = raw_client.script_load((REPO / "lua" / "ping.lua").read_text())
    measure("no-op EVALSHA round trip (floor)", lambda _i: raw_client.evalsha(ping_sha, 0), None,
            max(calls, 200))

    # A 512-block chain held by 4 pods (2 on gpu, 2 on cpu).
    chain = fresh_keys(rng, CHAIN)
    engine = fresh_keys(rng, CHAIN)
    for pod in PODS:
        kv.add(engine, chain, [pod])
        ref.add(engine, chain, [pod])
    hit = kv.lookup(chain)
    assert len(hit) == CHAIN and same(hit, ref.lookup(chain)), "setup: sides disagree"
    measure(f"lookup {CHAIN} blocks x {len(PODS)} pods",
            lambda _i: kv.lookup(chain), lambda _i: ref.lookup(chain), target=5.0)

    # A request that shares the first 16 blocks and then diverges (its later keys are new).
    diverged = chain[:MISS_AT] + fresh_keys(rng, CHAIN - MISS_AT)
    miss = kv.lookup(diverged)
    assert len(miss) == MISS_AT and same(miss, ref.lookup(diverged)), "setup: sides disagree"
    measure(f"lookup, miss at block {MISS_AT} (tail absent)",
            lambda _i: kv.lookup(diverged), lambda _i: ref.lookup(diverged), target=10.0)
    # Only block 16 is missing; the blocks after it exist (the reference still reads them all).
    holed = [*chain[:MISS_AT], rng.getrandbits(64), *chain[MISS_AT + 1 :]]
    assert same(kv.lookup(holed), ref.lookup(holed)), "setup: sides disagree"
    measure(f"lookup, miss at block {MISS_AT} (tail present)",
            lambda _i: kv.lookup(holed), lambda _i: ref.lookup(holed), target=10.0)

    scorer = LongestPrefixScorer(WEIGHTS)

    def ref_score() -> dict[str, float]:
        return scorer.score(chain, ref.lookup(chain))

    expected = ref_score()
    got = kv.score(chain, WEIGHTS)
    assert got == expected, (got, expected)
    measure(f"score {CHAIN} blocks (reference: lookup + LongestPrefixScorer)",
            lambda _i: kv.score(chain, WEIGHTS), lambda _i: ref_score(), target=10.0)

    # How much of the reference lookup is the client decoding JSON fields (information only).
    def raw_pipeline() -> None:
        pipe = ref_client.pipeline(transaction=False)
        for key in chain:
            pipe.hkeys(str(key))
        pipe.execute()

    measure("  (reference HKEYS pipeline alone, no decode)", lambda _i: raw_pipeline(), None)

    # Add: a 64-block event of one pod, fresh keys per call, engine keys mapped 1:1.
    events = [
        (fresh_keys(rng, EVENT_BLOCKS), fresh_keys(rng, EVENT_BLOCKS)) for _ in range(calls)
    ]
    adder = PodEntry("pod-add", "gpu")
    measure(f"add {EVENT_BLOCKS}-block event",
            lambda i: kv.add(events[i][0], events[i][1], [adder]),
            lambda i: ref.add(events[i][0], events[i][1], [adder]),
            target=1.0)
    probe = events[0][1]
    assert same(kv.lookup(probe), ref.lookup(probe)), "add: sides disagree"

    # Evict by engine key: the engine keys just added, one call per key (a BlockRemoved hash);
    # each call removes the key's last entry, so both sides also prune the key and the mapping.
    to_evict = [ek for eng, _ in events for ek in eng][:calls]
    measure("evict by engine key",
            lambda i: kv.evict(to_evict[i], KeyType.ENGINE, [adder]),
            lambda i: ref.evict(to_evict[i], KeyType.ENGINE, [adder]),
            len(to_evict), target=1.0, strict=True)
    gone = events[0][1][:1]
    assert kv.lookup(gone) == {} == ref.lookup(gone), "evict: sides disagree"
    return rows


def fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.1f}{unit}"


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'operation':<58} {'kvredis p50':>11} {'p99':>9} {'ref p50':>10} {'p99':>9} "
        f"{'ref RTs':>7} {'ratio':>7} {'target':>7} {'':>4}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        target = "" if r.target is None else ((">" if r.strict else ">=") + f"{r.target:g}x")
        print(
            f"{r.op:<58} {fmt(r.kvredis_p50_us):>11} {fmt(r.kvredis_p99_us):>9} "
            f"{fmt(r.reference_p50_us):>10} {fmt(r.reference_p99_us):>9} "
            f"{fmt(r.reference_round_trips):>7} {fmt(r.ratio, 'x'):>7} {target:>7} {r.verdict:>4}"
        )
    print(
        "latencies in microseconds; ratio = reference p50 / kvredis p50; ref RTs = round trips "
        "per reference call (every kvredis call is one EVALSHA)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "few calls per op (seconds)")
    parser.add_argument("--calls", type=int, default=None, help="timed calls per op and side")
    parser.add_argument(
        "--url",
        default=None,
        help="redis://host:port of a server to use instead of starting one (db 1 must be empty)",
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    calls = args.calls or (40 if args.quick else 400)
    rows = run(calls, args.url, args.seed)
    print_table(rows)
    if args.json:
        payload = [{**asdict(r), "verdict": r.verdict} for r in rows]
        write_json(args.json, {"calls": calls, "rows": payload})
    missed = [r.op for r in rows if r.verdict == "MISS"]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

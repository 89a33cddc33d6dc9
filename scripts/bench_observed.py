"""Cost of observing an index: lookup and add latency bare vs InstrumentedIndex vs TracedIndex.

Runs the same calls against one Redis through the bare RedisIndex, the Prometheus wrapper, the
OpenTelemetry wrapper (SDK tracer provider, spans dropped by a no-op processor) and both stacked,
alternating the variants round by round, and prints median microseconds per call and the ratio
to the bare index. ``--url`` benchmarks an existing server (its namespace is dropped afterwards).
"""

from __future__ import annotations

import functools
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvredis import PodEntry, RedisIndex, RedisIndexConfig
from kvredis.metrics import InstrumentedIndex
from kvredis.tracing import TracedIndex

from _bench import bench_parser, redis_server, write_json


def _timed(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = bench_parser(__doc__, "500 calls per variant and round, 3 rounds")
    parser.add_argument("--url", help="benchmark this server instead of a fresh redis-server")
    args = parser.parse_args()
    calls, rounds = (500, 3) if args.quick else (5000, 5)
    with redis_server(args.url) as url:
        bare = RedisIndex(
            RedisIndexConfig(address=url, namespace=f"bench-obs-{uuid.uuid4().hex[:8]}")
        )
        provider = TracerProvider()
        variants: dict[str, Any] = {
            "bare RedisIndex": bare,
            "InstrumentedIndex": InstrumentedIndex(bare, registry=CollectorRegistry()),
            "TracedIndex (SDK)": TracedIndex(bare, tracer_provider=provider),
            "both": TracedIndex(
                InstrumentedIndex(bare, registry=CollectorRegistry()), tracer_provider=provider
            ),
        }
        keys = list(range(1, 33))
        bare.add(None, keys, [PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")])
        results: dict[str, dict[str, list[float]]] = {
            n: {"lookup": [], "add": []} for n in variants
        }
        try:
            for r in range(rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for name in order:
                    index = variants[name]
                    lookup = functools.partial(index.lookup, keys)
                    add = functools.partial(index.add, None, keys[:4], [PodEntry("pod-c", "gpu")])
                    results[name]["lookup"].append(_timed(lookup, calls))
                    results[name]["add"].append(_timed(add, calls))
        finally:
            bare.drop_namespace()
            bare.close()
            provider.shutdown()
    base = {op: statistics.median(results["bare RedisIndex"][op]) for op in ("lookup", "add")}
    print(f"{'variant':20} {'lookup us':>10} {'ratio':>6} {'add us':>10} {'ratio':>6}")
    rows = []
    for name, ops in results.items():
        lookup, add = statistics.median(ops["lookup"]), statistics.median(ops["add"])
        rows.append({"variant": name, "lookup_us": lookup, "add_us": add})
        print(
            f"{name:20} {lookup:10.1f} {lookup / base['lookup']:6.2f} "
            f"{add:10.1f} {add / base['add']:6.2f}"
        )
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()

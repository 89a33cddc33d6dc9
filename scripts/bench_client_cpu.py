"""Client CPU per index call: kvredis's connection pools against redis-py's own, side by side.

Every router replica and every ingester pays the client side of each call it makes: packing the
request, a connection from the pool and back, the round trip, the reply. redis-py's blocking
pool takes a connection out of a queue and puts it back under locks, records each move for its
observability hooks and checks the process id; kvredis's pools (``kvredis.redis.executor``) hand
a released connection straight to the next caller, checked as redis-py checks it. This
benchmark runs the same calls through an index on each kind of pool, one server, the two
alternating segment by segment (a thread's CPU per call, ``time.thread_time``), and prints the
median per call and the ratio:

* ``score``: a router's score of a 64-block chain that 4 pods hold 16 to 64 blocks of;
* ``lookup``: the same chain's lookup;
* ``add``: an add of 4 keys already held (a small write, the ingester's ``process`` path);
* ``score (asyncio)``: ``score`` on ``AsyncRedisIndex``.

With ``--instructions`` each call is also counted by valgrind's callgrind (instructions per
call: a child process making N calls against one making none), a measure a noisy machine does
not blur; it needs ``valgrind`` and takes about a minute.

Run:  .venv/bin/python scripts/bench_client_cpu.py [--quick] [--instructions] [--json PATH]
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _bench import RedisServer, bench_parser, callgrind_instructions, write_json

OPS = ("score", "lookup", "add", "score (asyncio)")
POOLS = ("kvredis", "redis-py")
CHAIN = 64
"""Blocks in the chain every call names."""


def chain() -> list[int]:
    """The chain's request keys (the same in every process)."""
    rnd = random.Random(5)
    return [rnd.getrandbits(63) for _ in range(CHAIN)]


def fill(url: str, namespace: str) -> None:
    """Store the chain: pod p holds its first 16 * (p + 1) blocks."""
    from kvredis.redis import RedisIndex, RedisIndexConfig
    from kvredis.types import PodEntry

    keys = chain()
    index = RedisIndex(RedisIndexConfig(address=url, namespace=namespace, bucket_bits=10))
    try:
        for p in range(4):
            part = keys[: 16 * (p + 1)]
            index.add(part, part, [PodEntry(f"pod-{p}", "gpu")])
    finally:
        index.close()


def _plain_pool(index: Any, asyncio_pool: bool) -> None:
    """Put ``index`` on redis-py's own blocking pool, with the connection settings of its own."""
    import redis
    import redis.asyncio

    from kvredis.redis.executor import _takes_command_name

    executor = index._exec
    ours = executor.pool
    lib: Any = redis.asyncio if asyncio_pool else redis
    pool = lib.BlockingConnectionPool(
        connection_class=ours.connection_class,
        max_connections=ours.max_connections,
        timeout=ours.timeout,
        **ours.connection_kwargs,
    )
    executor.pool = pool
    executor.client = lib.Redis(connection_pool=pool)
    executor._named = _takes_command_name(pool)


def sync_call(url: str, namespace: str, op: str, pool: str) -> tuple[Callable[[], Any], Any]:
    """One call of ``op`` on an index on the ``pool`` kind of pool, and the index."""
    from kvredis.redis import RedisIndex, RedisIndexConfig
    from kvredis.types import PodEntry

    index = RedisIndex(RedisIndexConfig(address=url, namespace=namespace, bucket_bits=10))
    if pool == "redis-py":
        _plain_pool(index, False)
    keys = chain()
    if op == "score":
        return (lambda: index.score(keys)), index
    if op == "lookup":
        return (lambda: index.lookup(keys)), index
    entries = [PodEntry("pod-0", "gpu")]
    return (lambda: index.add(keys[:4], keys[:4], entries)), index


def async_index(url: str, namespace: str, pool: str) -> Any:
    from kvredis.redis import AsyncRedisIndex, RedisIndexConfig

    index = AsyncRedisIndex(RedisIndexConfig(address=url, namespace=namespace, bucket_bits=10))
    if pool == "redis-py":
        _plain_pool(index, True)
    return index


def measure(url: str, namespace: str, op: str, segments: int, calls: int) -> dict[str, float]:
    """Median client CPU (µs) per call of ``op`` on each kind of pool, alternating segments."""
    samples: dict[str, list[float]] = {p: [] for p in POOLS}
    if op == "score (asyncio)":
        keys = chain()

        async def run() -> None:
            indexes = {p: async_index(url, namespace, p) for p in POOLS}
            try:
                for index in indexes.values():
                    for _ in range(20):
                        await index.score(keys)
                for s in range(segments):
                    for p in POOLS if s % 2 == 0 else POOLS[::-1]:
                        index = indexes[p]
                        start = time.thread_time()
                        for _ in range(calls):
                            await index.score(keys)
                        samples[p].append((time.thread_time() - start) * 1e6 / calls)
            finally:
                for index in indexes.values():
                    await index.close()

        asyncio.run(run())
    else:
        made = {p: sync_call(url, namespace, op, p) for p in POOLS}
        try:
            for call, _ in made.values():
                for _ in range(20):
                    call()
            for s in range(segments):
                for p in POOLS if s % 2 == 0 else POOLS[::-1]:
                    call = made[p][0]
                    start = time.thread_time()
                    for _ in range(calls):
                        call()
                    samples[p].append((time.thread_time() - start) * 1e6 / calls)
        finally:
            for _, index in made.values():
                index.close()
    return {p: statistics.median(samples[p]) for p in POOLS}


def child(url: str, namespace: str, op: str, pool: str, calls: int) -> None:
    """Make ``calls`` calls of ``op`` on the ``pool`` kind of pool (after one, to connect)."""
    if op == "score (asyncio)":
        keys = chain()

        async def run() -> None:
            index = async_index(url, namespace, pool)
            try:
                for _ in range(calls + 1):
                    await index.score(keys)
            finally:
                await index.close()

        asyncio.run(run())
        return
    call, index = sync_call(url, namespace, op, pool)
    try:
        for _ in range(calls + 1):
            call()
    finally:
        index.close()


def instructions(url: str, namespace: str, op: str, pool: str, calls: int) -> int:
    """Instructions (callgrind's ``Ir``) of a child process making ``calls`` calls."""
    return callgrind_instructions([__file__, "--child", url, namespace, op, pool, str(calls)])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
        return
    parser = bench_parser(__doc__, "fewer and shorter segments")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count each call's instructions under valgrind (callgrind)",
    )
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
    segments, calls = (4, 100) if args.quick else (20, 500)
    counted = (20, 120) if args.quick else (200, 1200)
    namespace = "bench-client-cpu"
    server = RedisServer(args.server)
    server.start()
    rows: list[dict[str, Any]] = []
    try:
        fill(server.url, namespace)
        print(
            f"client CPU per call, median of {segments} alternating segments of {calls} calls"
            f" ({server.kind}): kvredis's pools / redis-py's",
            flush=True,
        )
        for op in OPS:
            cpu = measure(server.url, namespace, op, segments, calls)
            row: dict[str, Any] = {
                "op": op,
                "cpu_us": cpu,
                "ratio": cpu["kvredis"] / cpu["redis-py"],
            }
            line = (
                f"  {op:<16} {cpu['kvredis']:7.1f} / {cpu['redis-py']:7.1f} µs"
                f"  ({row['ratio']:.2f}x)"
            )
            if args.instructions:
                low, high = counted
                per = {
                    p: (
                        instructions(server.url, namespace, op, p, high)
                        - instructions(server.url, namespace, op, p, low)
                    )
                    / (high - low)
                    for p in POOLS
                }
                row["instructions"] = per
                row["instructions_ratio"] = per["kvredis"] / per["redis-py"]
                line += (
                    f"; instructions {per['kvredis'] / 1e3:.1f}k / {per['redis-py'] / 1e3:.1f}k"
                    f" ({row['instructions_ratio']:.2f}x)"
                )
            rows.append(row)
            print(line, flush=True)
    finally:
        server.close()
    if args.json:
        write_json(args.json, {"server": args.server, "results": rows})


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()

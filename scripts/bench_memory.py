#!/usr/bin/env python3
"""Benchmark the embedded indexes and the Indexer; every figure is a ratio to a run in-process.

References, measured in the same run:
  * lookup: a bare loop of ``dict.get`` over the same keys (the floor for any Python index);
  * score_tokens: computing the block keys alone (the hashing every router pays anyway).
Also reports how close the cost-aware index's byte estimate is to what tracemalloc measures.

    .venv/bin/python scripts/bench_memory.py           # full run (about a minute)
    .venv/bin/python scripts/bench_memory.py --quick   # a few seconds
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.indexer import Indexer
from kvredis.memory import CostAwareMemoryIndex, InMemoryIndex
from kvredis.types import KeyType, PodEntry

from _bench import bench_parser

MODEL = "bench/model"


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Per-call latencies in seconds."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(name: str, samples: list[float], ref: list[float] | None = None) -> None:
    p50 = statistics.median(samples)
    p99 = sorted(samples)[int(len(samples) * 0.99) - 1]
    line = f"{name:<44} p50 {p50 * 1e6:9.1f} us  p99 {p99 * 1e6:9.1f} us"
    if ref is not None:
        line += f"  {p50 / statistics.median(ref):6.2f}x reference"
    print(line)


def bench_backend(
    make: Callable[[], InMemoryIndex | CostAwareMemoryIndex],
    processor: ChunkedTokenDatabase,
    prompts: list[list[int]],
    keys: list[list[int]],
    pods: int,
    repeat: int,
) -> None:
    index = make()
    entries = [PodEntry(f"pod-{p}", "gpu") for p in range(pods)]
    engine = [[k ^ 0x5A5A5A5A5A5A5A5A for k in chain] for chain in keys]
    t0 = time.perf_counter()
    adds = 0
    for chain, eng in zip(keys, engine, strict=True):
        for i in range(0, len(chain), 64):
            for entry in entries:
                index.add(eng[i : i + 64], chain[i : i + 64], [entry])
                adds += 1
    fill = time.perf_counter() - t0
    print(f"-- {type(index).__name__}: {adds / fill:,.0f} adds/s of 64-block events")

    floor_table = {k: entries for chain in keys for k in chain}
    first = keys[0]

    def reference() -> object:
        get = floor_table.get
        return [get(k) for k in first]

    ref = timed(reference, repeat)
    summary("dict.get loop over 512 keys (reference)", ref)
    summary("lookup 512-block chain, 4 pods", timed(lambda: index.lookup(first), repeat), ref)
    missing = [*keys[1][:16], 12345, *keys[1][16:]]
    summary("lookup with a miss at block 16", timed(lambda: index.lookup(missing), repeat), ref)
    summary(
        "lookup filtered to 1 pod", timed(lambda: index.lookup(keys[2], {"pod-1"}), repeat), ref
    )

    indexer = Indexer(index, processor)
    hashing = timed(lambda: processor.tokens_to_kv_block_keys(0, prompts[3], MODEL), repeat)
    summary("hash 8192 tokens (reference)", hashing)
    summary(
        "score_tokens 8192 tokens (hash+lookup+score)",
        timed(lambda: indexer.score_tokens(prompts[3], MODEL), repeat),
        hashing,
    )

    victims = iter([(e, entry) for eng in engine[4:] for e in eng for entry in entries])

    def evict_one() -> None:
        engine_key, entry = next(victims)
        index.evict(engine_key, KeyType.ENGINE, [entry])

    summary("evict by engine key", timed(evict_one, repeat))
    t0 = time.perf_counter()
    index.clear("pod-0")
    took = (time.perf_counter() - t0) * 1e3
    print(f"{'clear pod-0 (' + format(len(index), ',') + ' keys left)':<44} {took:9.1f} ms")


def bench_estimate(n: int) -> None:
    print("-- cost-aware estimate vs tracemalloc")
    for npods in (1, 4):
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        index = CostAwareMemoryIndex()
        for p in range(npods):
            for i in range(0, n, 64):
                ks = list(range(i + 1, min(i + 65, n + 1)))
                index.add([k << 20 for k in ks], ks, [PodEntry(f"pod-{p}", "gpu")])
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        print(
            f"{n:,} keys x {npods} pods: estimate {index.cost() / n:6.0f} B/key, "
            f"allocated {used / n:6.0f} B/key, ratio {index.cost() / used:.2f}"
        )


def main() -> None:
    parser = bench_parser(__doc__, "small sizes, a few seconds", with_json=False)
    args = parser.parse_args()
    chains, repeat = (40, 200) if args.quick else (400, 2000)
    chain_len, pods = 512, 4
    rng = random.Random(1)
    processor = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))
    prompts = [[rng.randrange(1, 128_000) for _ in range(chain_len * 16)] for _ in range(chains)]
    keys = [processor.tokens_to_kv_block_keys(0, p, MODEL) for p in prompts]
    print(
        f"== {chains} chains x {chain_len} blocks x {pods} pods "
        f"({chains * chain_len:,} request keys)"
    )
    for make in (InMemoryIndex, CostAwareMemoryIndex):
        bench_backend(make, processor, prompts, keys, pods, repeat)
    bench_estimate(20_000 if args.quick else 200_000)


if __name__ == "__main__":
    main()

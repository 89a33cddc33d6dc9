#!/usr/bin/env python3
"""Benchmark the embedded indexes and the Indexer; every figure is a ratio to a run in-process.

References, measured in the same run and on the same data:
  * the hot paths (add, lookup, evict) against :class:`DictOfSets`, the least any Python index
    does: a dict of request key -> set of PodEntry, a dict of engine key -> request key, a lookup
    that walks the chain and stops at the first miss; no bounds, no checks, no bookkeeping.
    Calls of the two alternate, so both see the same machine load;
  * score_tokens: computing the block keys alone (the hashing every router pays anyway).
Also reports how close the cost-aware index's byte estimate is to what tracemalloc measures.

    .venv/bin/python scripts/bench_memory.py               # full run (about a minute)
    .venv/bin/python scripts/bench_memory.py --quick       # a few seconds
    .venv/bin/python scripts/bench_memory.py --json -      # also the figures as JSON
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.indexer import Indexer
from kvredis.memory import CostAwareMemoryIndex, InMemoryIndex
from kvredis.types import KeyType, PodEntry

from _bench import bench_parser, write_json

MODEL = "bench/model"
#: Calls timed together in one sample (so the timer's own cost stays out of the figures).
CALLS_PER_SAMPLE = 10


class DictOfSets:
    """The reference index: dict of sets, engine keys mapped 1:1, nothing else."""

    def __init__(self) -> None:
        self.keys: dict[int, set[PodEntry]] = {}
        self.engine: dict[int, int] = {}

    def add(
        self, engine: Sequence[int] | None, request: Sequence[int], entries: Sequence[PodEntry]
    ) -> None:
        keys = self.keys
        for key in request:
            held = keys.get(key)
            if held is None:
                keys[key] = set(entries)
            else:
                held.update(entries)
        if engine:
            self.engine.update(zip(engine, request, strict=True))

    def lookup(self, request_keys: Sequence[int]) -> dict[int, list[PodEntry]]:
        out, keys = {}, self.keys
        for key in request_keys:
            held = keys.get(key)
            if not held:
                break
            out[key] = list(held)
        return out

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        request_key = self.engine.get(key) if key_type is KeyType.ENGINE else key
        held = self.keys.get(request_key)  # type: ignore[arg-type]
        if held is not None:
            held.difference_update(entries)
            if not held:
                del self.keys[request_key]  # type: ignore[arg-type]


Op = Callable[[Any], object]


def side_by_side(ref: Op, idx: Op, args: Iterator[object], samples: int) -> tuple[float, float]:
    """Median µs per call of ``ref`` and of ``idx``, given the same arguments, alternating."""
    ref_t, idx_t = [], []
    clock = time.perf_counter
    for _ in range(samples):
        batch = [next(args) for _ in range(CALLS_PER_SAMPLE)]
        for fn, out in ((ref, ref_t), (idx, idx_t)):
            t0 = clock()
            for arg in batch:
                fn(arg)
            out.append(clock() - t0)
    scale = 1e6 / CALLS_PER_SAMPLE
    return statistics.median(ref_t) * scale, statistics.median(idx_t) * scale


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
    line = f"{name:<46} p50 {p50 * 1e6:9.1f} us  p99 {p99 * 1e6:9.1f} us"
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
) -> dict[str, Any]:
    index, ref = make(), DictOfSets()
    name = type(index).__name__
    entries = [PodEntry(f"pod-{p}", "gpu") for p in range(pods)]
    engine = [[k ^ 0x5A5A5A5A5A5A5A5A for k in chain] for chain in keys]
    events = [
        (eng[i : i + 64], chain[i : i + 64], [entry])
        for chain, eng in zip(keys, engine, strict=True)
        for i in range(0, len(chain), 64)
        for entry in entries
    ]
    gc.collect()
    t0 = time.perf_counter()
    for eng_keys, req_keys, ents in events:
        index.add(eng_keys, req_keys, ents)
    fill = time.perf_counter() - t0
    for eng_keys, req_keys, ents in events:
        ref.add(eng_keys, req_keys, ents)
    print(f"-- {name}: {len(events) / fill:,.0f} adds/s of 64-block events while filling")

    # Fresh 64-block events of one entry each (new keys, as engines report new blocks).
    rng = random.Random(2)
    fresh = (
        (
            [rng.getrandbits(64) for _ in range(64)],
            [rng.getrandbits(64) for _ in range(64)],
            [entries[n % pods]],
        )
        for n in iter(int, 1)
    )
    # The events of chains 4.. again, from pods that do not hold them yet (keys held by others).
    others = [PodEntry(f"pod-{p}", "gpu") for p in range(pods, 2 * pods)]
    again = (
        (eng_keys, req_keys, [other])
        for other in others
        for eng_keys, req_keys, _ in events[len(entries) * 8 * 4 :: len(entries)]
    )
    hit, miss = keys[0], [*keys[1][:16], 12345, *keys[1][16:]]
    victims = ((e, KeyType.ENGINE, [entry]) for eng in engine[4:] for e in eng for entry in entries)
    rows = {
        "add 64-block event, 1 entry, new keys": (
            lambda a: ref.add(*a),
            lambda a: index.add(*a),
            fresh,
        ),
        "add 64-block event, 1 entry, to keys held": (
            lambda a: ref.add(*a),
            lambda a: index.add(*a),
            again,
        ),
        f"lookup {len(hit)}-block chain, {pods} pods, all hit": (
            ref.lookup,
            index.lookup,
            iter(lambda: hit, None),
        ),
        f"lookup {len(miss)} keys, miss at block 16": (
            ref.lookup,
            index.lookup,
            iter(lambda: miss, None),
        ),
        "evict 1 entry by engine key": (
            lambda a: ref.evict(*a),
            lambda a: index.evict(*a),
            victims,
        ),
    }
    results = []
    samples = max(20, repeat // CALLS_PER_SAMPLE)
    print(f"{'vs DictOfSets (median per call)':<46} {'reference':>10} {name:>21} {'ratio':>7}")
    for label, (ref_op, idx_op, args) in rows.items():
        ref_us, idx_us = side_by_side(ref_op, idx_op, args, samples)
        results.append(
            {"row": label, "dict_of_sets_us": ref_us, "index_us": idx_us, "ratio": idx_us / ref_us}
        )
        print(f"{label:<46} {ref_us:8.2f} us {idx_us:18.2f} us {idx_us / ref_us:6.2f}x")

    summary("lookup filtered to 1 pod", timed(lambda: index.lookup(keys[2], {"pod-1"}), repeat))
    indexer = Indexer(index, processor)
    hashing = timed(lambda: processor.tokens_to_kv_block_keys(0, prompts[3], MODEL), repeat)
    summary("hash 8192 tokens (reference)", hashing)
    summary(
        "score_tokens 8192 tokens (hash+lookup+score)",
        timed(lambda: indexer.score_tokens(prompts[3], MODEL), repeat),
        hashing,
    )
    t0 = time.perf_counter()
    index.clear("pod-0")
    took = (time.perf_counter() - t0) * 1e3
    print(f"{'clear pod-0 (' + format(len(index), ',') + ' keys left)':<46} {took:9.1f} ms")
    return {"backend": name, "versus_dict_of_sets": results, "clear_ms": took}


def bench_estimate(n: int) -> list[dict[str, Any]]:
    print("-- cost-aware estimate vs tracemalloc")
    out = []
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
        out.append(
            {
                "keys": n,
                "pods": npods,
                "estimate_per_key": index.cost() / n,
                "allocated_per_key": used / n,
            }
        )
    return out


def main() -> None:
    parser = bench_parser(__doc__, "small sizes, a few seconds")
    args = parser.parse_args()
    chains, repeat = (40, 400) if args.quick else (400, 4000)
    chain_len, pods = 512, 4
    rng = random.Random(1)
    processor = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))
    prompts = [[rng.randrange(1, 128_000) for _ in range(chain_len * 16)] for _ in range(chains)]
    keys = [processor.tokens_to_kv_block_keys(0, p, MODEL) for p in prompts]
    print(
        f"== {chains} chains x {chain_len} blocks x {pods} pods "
        f"({chains * chain_len:,} request keys)"
    )
    backends = [
        bench_backend(make, processor, prompts, keys, pods, repeat)
        for make in (InMemoryIndex, CostAwareMemoryIndex)
    ]
    estimate = bench_estimate(20_000 if args.quick else 200_000)
    if args.json:
        write_json(args.json, {"chains": chains, "backends": backends, "estimate": estimate})


if __name__ == "__main__":
    main()

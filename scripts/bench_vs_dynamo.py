#!/usr/bin/env python3
"""Benchmark the embedded and Redis indexes against NVIDIA Dynamo's in-process radix tree.

One dataset loaded into each side: ``--chains`` chains of 512 random request keys, each held
whole by 4 of 8 pods (128 chains: 262,144 (block, pod) entries), one event per (pod, chain),
with its engine keys. Dynamo's ``RadixTree`` gets them as ``stored`` KV events
(``apply_event(worker, json)``; the request key is the block's ``tokens_hash``, the engine key
its ``block_hash``), kvredis' indexes as ``add(engine_keys, request_keys, [PodEntry])``, a
``RedisIndex`` on its own ``redis-server`` the same way.

Measured in one process, ratios against Dynamo's ``find_matches``:
  * whole-chain query latency (512 blocks, every chain in turn; and chains that leave their
    holders at block 256): Dynamo ``find_matches(keys).scores``, ``InMemoryIndex.score``,
    ``CostAwareMemoryIndex.score``, ``lookup`` + ``LongestPrefixScorer``, ``RedisIndex.score``
    (wall time, loopback). Every query's scores are asserted equal on every side (Dynamo counts
    blocks: the weights are ``{"gpu": 1.0}``);
    The round trip of a Redis ``PING`` is printed too: the floor under ``RedisIndex.score``,
    and what the score adds to it;
  * memory per entry: the growth of the process's resident set (``/proc/self/statm``) while
    each side loads (Dynamo's tree lives in Rust, outside Python's allocator, so this is the
    one measure both sides share), and for kvredis also what ``tracemalloc`` counts.

Dynamo is not a dependency of kvredis: install its wheel into a throwaway venv that also has
this checkout, and run the script from there (without it, the Dynamo rows are skipped)::

    python3 -m venv /tmp/dynvenv
    /tmp/dynvenv/bin/pip install -e . ai-dynamo-runtime
    /tmp/dynvenv/bin/python scripts/bench_vs_dynamo.py            # about a minute
    .venv/bin/python scripts/bench_vs_dynamo.py --quick            # seconds, no Dynamo rows
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from kvredis.memory import CostAwareMemoryIndex, InMemoryIndex
from kvredis.redis import RedisIndexConfig, new_redis_index
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import PodEntry

from _bench import bench_parser, percentile, redis_server, write_json
from _chains import engine_key

CHAIN_BLOCKS = 512
PODS = 8
HOLDERS = 4
WEIGHTS = {"gpu": 1.0}
INSTALL_HINT = (
    "Dynamo's radix tree (PyPI ai-dynamo-runtime, `from dynamo._core import RadixTree`) is not "
    "installed here: its rows are skipped. To compare, install it into a throwaway venv with "
    "this checkout: python3 -m venv /tmp/dynvenv && /tmp/dynvenv/bin/pip install -e . "
    "ai-dynamo-runtime, then run /tmp/dynvenv/bin/python scripts/bench_vs_dynamo.py"
)

MEMORY_INDEXES: dict[str, Callable[[], Any]] = {
    "InMemoryIndex": InMemoryIndex,
    "CostAwareMemoryIndex": CostAwareMemoryIndex,
}

Scores = dict[str, float]
Query = Callable[[list[int]], Scores]


def rss_bytes() -> int:
    """The resident set of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dataset(chains: int, seed: int = 22) -> list[tuple[list[int], list[int]]]:
    """Per chain: its request keys and the pods holding it whole."""
    rng = random.Random(seed)
    return [
        (
            [rng.getrandbits(64) for _ in range(CHAIN_BLOCKS)],
            sorted(rng.sample(range(PODS), HOLDERS)),
        )
        for _ in range(chains)
    ]


def load_kvredis(index: Any, data: list[tuple[list[int], list[int]]]) -> None:
    entries = [PodEntry(f"pod-{p}", "gpu") for p in range(PODS)]
    for keys, holders in data:
        engine = [engine_key(k) for k in keys]
        for pod in holders:
            index.add(engine, keys, [entries[pod]])


def dynamo_events(data: list[tuple[list[int], list[int]]]) -> list[tuple[int, bytes]]:
    """One ``stored`` event per (pod, chain): the chain from the root, block by block."""
    out = []
    for n, (keys, holders) in enumerate(data):
        blocks = [{"block_hash": engine_key(k), "tokens_hash": k} for k in keys]
        for pod in holders:
            event = {"event_id": n, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}
            out.append((pod, json.dumps(event).encode()))
    return out


def dynamo_query(tree: Any) -> Query:
    def query(keys: list[int]) -> Scores:
        found = tree.find_matches(keys).scores
        return {f"pod-{worker}": float(blocks) for (worker, _rank), blocks in found.items()}

    return query


def timed(query: Query, queries: list[list[int]], repeat: int) -> list[float]:
    """Per-call seconds of ``query`` over ``queries``, ``repeat`` rounds."""
    clock, out = time.perf_counter, []
    for _ in range(repeat):
        for keys in queries:
            t0 = clock()
            query(keys)
            out.append(clock() - t0)
    return out


def _rss_child(side: str, chains: int) -> float:
    """In a fresh process: build the dataset, then the resident-set growth per entry while
    ``side`` loads it."""
    data = dataset(chains)
    built: object
    if side == "dynamo":
        from dynamo._core import RadixTree  # type: ignore[import-not-found, unused-ignore]

        events = dynamo_events(data)
        gc.collect()
        before = rss_bytes()
        built = RadixTree()
        for worker, event in events:
            built.apply_event(worker, event)  # type: ignore[attr-defined]
        built.find_matches(data[0][0])  # type: ignore[attr-defined]  # (applied on its thread)
    else:
        gc.collect()
        before = rss_bytes()
        built = MEMORY_INDEXES[side]()
        load_kvredis(built, data)
    gc.collect()
    return (rss_bytes() - before) / (chains * CHAIN_BLOCKS * HOLDERS)


def rss_per_entry(side: str, chains: int) -> float:
    """:func:`_rss_child` in a spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return float(pool.apply(_rss_child, (side, chains)))


def traced_per_entry(side: str, data: list[Any], entries: int) -> float:
    """What tracemalloc counts for an index loaded with ``data``, per entry."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = MEMORY_INDEXES[side]()
    load_kvredis(index, data)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    return used / entries


def main() -> None:
    parser = bench_parser(__doc__, "8 chains, few rounds; a few seconds")
    parser.add_argument("--chains", type=int, help="chains of 512 blocks (default 128)")
    parser.add_argument("--redis-url", help="benchmark this Redis instead of starting one")
    args = parser.parse_args()
    chains = args.chains or (8 if args.quick else 128)
    repeat = 3 if args.quick else 20
    data = dataset(chains)
    entries = chains * CHAIN_BLOCKS * HOLDERS
    rng = random.Random(7)
    whole = [keys for keys, _ in data]
    half = [[*keys[:256], *(rng.getrandbits(64) for _ in range(256))] for keys, _ in data]
    shape = f"{chains} chains x {CHAIN_BLOCKS} blocks x {HOLDERS} of {PODS} pods"
    print(f"== {shape}: {entries:,} (block, pod) entries")

    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        RadixTree = None
        print(INSTALL_HINT)

    sides: dict[str, Query] = {}
    memory: dict[str, dict[str, float]] = {}
    if RadixTree is not None:
        memory["dynamo RadixTree"] = {"rss_bytes_per_entry": rss_per_entry("dynamo", chains)}
        tree = RadixTree()
        for worker, event in dynamo_events(data):
            tree.apply_event(worker, event)
        sides["dynamo find_matches"] = dynamo_query(tree)
    indexes: dict[str, Any] = {}
    for name, make in MEMORY_INDEXES.items():
        memory[name] = {
            "rss_bytes_per_entry": rss_per_entry(name, chains),
            "traced_bytes_per_entry": traced_per_entry(name, data, entries),
        }
        index = indexes[name] = make()
        load_kvredis(index, data)
        sides[f"{name}.score"] = lambda keys, index=index: index.score(keys, WEIGHTS)
    scorer = LongestPrefixScorer(WEIGHTS)
    embedded = indexes["InMemoryIndex"]
    sides["InMemoryIndex lookup + LongestPrefixScorer"] = lambda keys: scorer.score(
        keys, embedded.lookup(keys)
    )

    with redis_server(args.redis_url) as url:
        redis = new_redis_index(RedisIndexConfig(address=url, namespace="bench-dynamo"))
        try:
            load_kvredis(redis, data)
            sides["RedisIndex.score (wall)"] = lambda keys: redis.score(keys, WEIGHTS)
            rows = run_queries(sides, {"whole chain": whole, "leaves at block 256": half}, repeat)
            ping = timed(lambda _keys: {"": float(redis.client.ping())}, whole, repeat)
            floor = statistics.median(ping) * 1e6
            print(f"{'(Redis PING round trip, the floor)':<46} p50 {floor:8.1f} us")
            rows.append({"query": "PING", "side": "redis", "p50_us": floor})
            # What the index adds to the round trip any Redis call pays on this machine (the
            # round trip alone differs several-fold between machines of one kind).
            p50 = {r["side"]: r["p50_us"] for r in rows if r["query"] == "whole chain"}
            beyond = p50["RedisIndex.score (wall)"] - floor
            line = f"{'RedisIndex.score beyond one PING (whole chain)':<46} p50 {beyond:8.1f} us"
            if "dynamo find_matches" in p50:
                line += f"  {beyond / p50['dynamo find_matches']:6.2f}x dynamo find_matches"
            print(line)
            rows.append({"query": "beyond PING", "side": "redis", "p50_us": beyond})
        finally:
            redis.drop_namespace()
            redis.close()

    report_memory(memory)
    if args.json:
        write_json(
            args.json,
            {"chains": chains, "entries": entries, "dynamo": RadixTree is not None,
             "queries": rows, "memory": memory},
        )  # fmt: skip


def run_queries(
    sides: dict[str, Query], query_sets: dict[str, list[list[int]]], repeat: int
) -> list[dict[str, Any]]:
    """Check every side gives the same scores on every query, then time each side."""
    rows = []
    for label, queries in query_sets.items():
        reference = next(iter(sides))
        for keys in queries:
            want = sides[reference](keys)
            for name, query in sides.items():
                got = query(keys)
                assert got == want, f"{name} scored {got}, {reference} {want}"
        print(f"-- {label} ({len(queries[0])} keys; every side gave the same scores)")
        base = None
        for name, query in sides.items():
            samples = timed(query, queries, repeat)
            p50 = statistics.median(samples) * 1e6
            p99 = percentile(samples, 0.99) * 1e6
            base = base or p50
            ratio = p50 / base
            print(f"{name:<46} p50 {p50:8.1f} us  p99 {p99:8.1f} us  {ratio:6.2f}x {reference}")
            rows.append(
                {"query": label, "side": name, "p50_us": p50, "p99_us": p99, "ratio": ratio}
            )
    return rows


def report_memory(memory: dict[str, dict[str, float]]) -> None:
    print("-- memory per (block, pod) entry")
    base = memory.get("dynamo RadixTree", {}).get("rss_bytes_per_entry")
    for name, row in memory.items():
        line = f"{name:<46} RSS {row['rss_bytes_per_entry']:7.1f} B"
        if "traced_bytes_per_entry" in row:
            line += f"  tracemalloc {row['traced_bytes_per_entry']:7.1f} B"
        if base:
            line += f"  {row['rss_bytes_per_entry'] / base:5.2f}x Dynamo (RSS)"
        print(line)


if __name__ == "__main__":
    main()

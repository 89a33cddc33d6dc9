#!/usr/bin/env python3
"""Benchmark the embedded and Redis indexes against NVIDIA Dynamo's in-process radix tree.

Two datasets (``--shape``, both by default), each loaded into every side:

* ``chains``: ``--chains`` chains of 512 random request keys, each held whole by 4 of 8 pods
  (128 chains: 262,144 (block, pod) entries);
* ``families``: ``--families`` families of a 384-block prefix with 8 tails of 128 blocks (8
  chains of 512 blocks sharing the prefix), each chain held by 1-4 of 8 pods: the first holds
  it whole, each other one a random prefix of 64-384 blocks of it (150 families: about 0.45M
  (block, pod) entries over 211,200 blocks). The holders of a block vary along the chain, as
  in a fleet where pods evicted different amounts of a shared system prompt.

One event per (pod, chain) held, the pod's blocks from the root, with their engine keys.
Dynamo's ``RadixTree`` gets them as ``stored`` KV events (``apply_event(worker, json)``; the
request key is the block's ``tokens_hash``, the engine key its ``block_hash``), kvredis' indexes
as ``add(engine_keys, request_keys, [PodEntry])``, a ``RedisIndex`` on its own ``redis-server``
the same way.

Measured in one process, ratios against Dynamo's ``find_matches``:
  * whole-chain query latency (512 blocks, every chain in turn, the sides timed in interleaved
    rounds; and chains that leave their holders at block 256): Dynamo
    ``find_matches(keys).scores``, ``InMemoryIndex.score``, ``CostAwareMemoryIndex.score``,
    ``lookup`` + ``LongestPrefixScorer``, ``RedisIndex.score``
    (wall time, loopback). Every query's scores are asserted equal on every side (Dynamo counts
    blocks: the weights are ``{"gpu": 1.0}``);
    The round trip of a Redis ``PING`` is printed too: the floor under ``RedisIndex.score``,
    and what the score adds to it;
  * memory per (block, pod) entry: the growth of the process's resident set
    (``/proc/self/statm``) while each side loads (Dynamo's tree lives in Rust, outside Python's
    allocator, so this is the one measure both sides share), and for kvredis also what
    ``tracemalloc`` counts. kvredis gets the keys as fresh ints, as from a hasher (what the index
    keeps of them is its own), Dynamo its events as JSON built beforehand.

Dynamo is not a dependency of kvredis: install its wheel into a throwaway venv that also has
this checkout, and run the script from there (without it, the Dynamo rows are skipped)::

    python3 -m venv /tmp/dynvenv
    /tmp/dynvenv/bin/pip install -e . ai-dynamo-runtime
    /tmp/dynvenv/bin/python scripts/bench_vs_dynamo.py            # a few minutes
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
from dataclasses import dataclass
from typing import Any

from kvredis.memory import CostAwareMemoryIndex, InMemoryIndex
from kvredis.redis import RedisIndexConfig, new_redis_index
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import PodEntry

from _bench import bench_parser, percentile, redis_server, write_json
from _chains import engine_key

CHAIN_BLOCKS = 512
PODS = 8
#: chains shape: pods holding each chain whole
HOLDERS = 4
#: families shape: prefix and tail lengths, tails per family, pods per chain, partial prefixes
PREFIX_BLOCKS = 384
TAIL_BLOCKS = 128
TAILS = 8
FAMILY_HOLDERS = (1, 4)
PARTIAL_BLOCKS = (64, 384)
#: queries timed per side and query set (every chain in turn, as many rounds as that takes)
TIMED_QUERIES = 2560
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


@dataclass(frozen=True)
class Shape:
    """A dataset: what each pod stored (its blocks from the root, one event per chain) and the
    whole chains to query."""

    name: str
    description: str
    #: (request keys from the root, pod), one per event
    holdings: list[tuple[list[int], int]]
    chains: list[list[int]]

    @property
    def entries(self) -> int:
        """Distinct (block, pod) entries once everything is loaded."""
        return len({(key, pod) for keys, pod in self.holdings for key in keys})


def chains_shape(chains: int, seed: int = 22) -> Shape:
    """``chains`` random 512-block chains, each held whole by :data:`HOLDERS` of 8 pods."""
    rng = random.Random(seed)
    holdings, queries = [], []
    for _ in range(chains):
        keys = [rng.getrandbits(64) for _ in range(CHAIN_BLOCKS)]
        queries.append(keys)
        holdings += [(keys, pod) for pod in sorted(rng.sample(range(PODS), HOLDERS))]
    text = f"{chains} chains x {CHAIN_BLOCKS} blocks, each whole on {HOLDERS} of {PODS} pods"
    return Shape("chains", text, holdings, queries)


def families_shape(families: int, seed: int = 23) -> Shape:
    """``families`` families of a 384-block prefix and 8 tails of 128 blocks; each chain on
    1-4 of 8 pods, the first holding it whole, the others a random prefix of 64-384 blocks."""
    rng = random.Random(seed)
    holdings, queries = [], []
    for _ in range(families):
        prefix = [rng.getrandbits(64) for _ in range(PREFIX_BLOCKS)]
        for _ in range(TAILS):
            keys = prefix + [rng.getrandbits(64) for _ in range(TAIL_BLOCKS)]
            queries.append(keys)
            first, *others = rng.sample(range(PODS), rng.randint(*FAMILY_HOLDERS))
            holdings.append((keys, first))
            holdings += [(keys[: rng.randint(*PARTIAL_BLOCKS)], pod) for pod in others]
    text = (
        f"{families} families x ({PREFIX_BLOCKS}-block prefix + {TAILS} tails x {TAIL_BLOCKS}), "
        f"each chain on {FAMILY_HOLDERS[0]}-{FAMILY_HOLDERS[1]} of {PODS} pods (the first whole, "
        f"the others {PARTIAL_BLOCKS[0]}-{PARTIAL_BLOCKS[1]} blocks of it)"
    )
    return Shape("families", text, holdings, queries)


SHAPES: dict[str, Callable[[int], Shape]] = {"chains": chains_shape, "families": families_shape}


def rss_bytes() -> int:
    """The resident set of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_kvredis(index: Any, shape: Shape) -> None:
    """Each event as an ``add``: the engine keys and request keys computed as the events come
    (fresh ints, as from a hasher: what the index keeps of them is its own)."""
    entries = [PodEntry(f"pod-{p}", "gpu") for p in range(PODS)]
    for keys, pod in shape.holdings:
        index.add([engine_key(k) for k in keys], [k ^ 0 for k in keys], [entries[pod]])


def dynamo_events(shape: Shape) -> list[tuple[int, bytes]]:
    """One ``stored`` event per (pod, chain): the pod's blocks from the root."""
    out = []
    for n, (keys, pod) in enumerate(shape.holdings):
        blocks = [{"block_hash": engine_key(k), "tokens_hash": k} for k in keys]
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


def _rss_child(side: str, shape_name: str, size: int) -> float:
    """In a fresh process: build the dataset, then the resident-set growth per entry while
    ``side`` loads it."""
    shape = SHAPES[shape_name](size)
    built: object
    if side == "dynamo":
        from dynamo._core import RadixTree  # type: ignore[import-not-found, unused-ignore]

        events = dynamo_events(shape)
        gc.collect()
        before = rss_bytes()
        built = RadixTree()
        for worker, event in events:
            built.apply_event(worker, event)  # type: ignore[attr-defined]
        built.find_matches(shape.chains[0])  # type: ignore[attr-defined]  # (applied on its thread)
    else:
        gc.collect()
        before = rss_bytes()
        built = MEMORY_INDEXES[side]()
        load_kvredis(built, shape)
    gc.collect()
    return (rss_bytes() - before) / shape.entries


def rss_per_entry(side: str, shape: Shape, size: int) -> float:
    """:func:`_rss_child` in a spawned process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return float(pool.apply(_rss_child, (side, shape.name, size)))


def traced_per_entry(side: str, shape: Shape) -> float:
    """What tracemalloc counts for an index loaded with ``shape``, per entry."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = MEMORY_INDEXES[side]()
    load_kvredis(index, shape)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    return used / shape.entries


def main() -> None:
    parser = bench_parser(__doc__, "8 chains and 2 families, few queries; a few seconds")
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--chains", type=int, help="chains shape: chains (default 128)")
    parser.add_argument("--families", type=int, help="families shape: families (default 150)")
    parser.add_argument("--redis-url", help="benchmark this Redis instead of starting one")
    args = parser.parse_args()
    sizes = {
        "chains": args.chains or (8 if args.quick else 128),
        "families": args.families or (2 if args.quick else 150),
    }
    names = list(SHAPES) if args.shape == "both" else [args.shape]
    timed_queries = 64 if args.quick else TIMED_QUERIES

    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        RadixTree = None
        print(INSTALL_HINT)

    results: dict[str, Any] = {}
    with redis_server(args.redis_url) as url:
        for name in names:
            shape = SHAPES[name](sizes[name])
            results[name] = run_shape(shape, sizes[name], RadixTree, url, timed_queries)
    if args.json:
        write_json(args.json, {"dynamo": RadixTree is not None, "shapes": results})


def run_shape(
    shape: Shape, size: int, radix_tree: Any, url: str, timed_queries: int
) -> dict[str, Any]:
    """Load ``shape`` into every side, then time the queries and measure the memory."""
    entries = shape.entries
    print(f"== {shape.name}: {shape.description}: {entries:,} (block, pod) entries")
    sides: dict[str, Query] = {}
    memory: dict[str, dict[str, float]] = {}
    if radix_tree is not None:
        memory["dynamo RadixTree"] = {"rss_bytes_per_entry": rss_per_entry("dynamo", shape, size)}
        tree = radix_tree()
        for worker, event in dynamo_events(shape):
            tree.apply_event(worker, event)
        sides["dynamo find_matches"] = dynamo_query(tree)
    indexes: dict[str, Any] = {}
    for name, make in MEMORY_INDEXES.items():
        memory[name] = {
            "rss_bytes_per_entry": rss_per_entry(name, shape, size),
            "traced_bytes_per_entry": traced_per_entry(name, shape),
        }
        index = indexes[name] = make()
        load_kvredis(index, shape)
        sides[f"{name}.score"] = lambda keys, index=index: index.score(keys, WEIGHTS)
    scorer = LongestPrefixScorer(WEIGHTS)
    embedded = indexes["InMemoryIndex"]
    sides["InMemoryIndex lookup + LongestPrefixScorer"] = lambda keys: scorer.score(
        keys, embedded.lookup(keys)
    )

    rng = random.Random(7)
    whole = shape.chains
    half = [[*keys[:256], *(rng.getrandbits(64) for _ in range(256))] for keys in whole]
    repeat = max(1, -(-timed_queries // len(whole)))
    redis = new_redis_index(RedisIndexConfig(address=url, namespace=f"bench-dynamo-{shape.name}"))
    try:
        load_kvredis(redis, shape)
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
    return {"size": size, "entries": entries, "queries": rows, "memory": memory}


def run_queries(
    sides: dict[str, Query], query_sets: dict[str, list[list[int]]], repeat: int
) -> list[dict[str, Any]]:
    """Check every side gives the same scores on every query, then time the sides in
    interleaved rounds (each round runs every query once on every side, the sides in turn), so
    a change of load on a shared machine falls on all of them alike."""
    rows = []
    for label, queries in query_sets.items():
        reference = next(iter(sides))
        for keys in queries:
            want = sides[reference](keys)
            for name, query in sides.items():
                got = query(keys)
                assert got == want, f"{name} scored {got}, {reference} {want}"
        print(f"-- {label} ({len(queries[0])} keys; every side gave the same scores)")
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeat):
            for name, query in sides.items():
                samples[name] += timed(query, queries, 1)
        base = None
        for name, times in samples.items():
            p50 = statistics.median(times) * 1e6
            p99 = percentile(times, 0.99) * 1e6
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

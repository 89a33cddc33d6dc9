"""kvredis migrate: how long converting a namespace of layout kvredis-kvblock/1 takes, how long
one call blocks the server, and what lookups cost before and after.

It fills a namespace with the previous release's scripts (``tests/redis/layout_v1/dc8cf00``:
speculative entries with a ttl in the request buckets, their deadlines in a sorted set), with
chains of confirmed entries from several pods and a speculative entry with a live ttl on every
key of a share of the chains, then runs :func:`kvredis.migrate_namespace` (default page size) and
prints:

- the migration: pairs converted, wall time, pages, pairs per second, the mean server time of a
  ``migrate`` call (``INFO commandstats``), and the longest page as the client saw it (between
  two progress callbacks: round trip included);
- lookups of the same chains, as Redis CPU per call (EVALSHA usec / calls; the best of three
  alternating rounds): the /1 script on a /1 namespace (a copy that stays unmigrated), this
  release's script on the migrated namespace (per-key records), and this release's script on a
  namespace this release wrote from the same adds (chain runs, expiring buckets).
"""

from __future__ import annotations

import importlib
import itertools
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from kvredis import PodEntry, RedisIndex, RedisIndexConfig, drop_namespace, migrate_namespace

from _bench import bench_parser, redis_server, write_json

PODS = [PodEntry(f"pod-{i}", "gpu") for i in range(4)]
SPEC = PodEntry("pod-s", "gpu", speculative=True)
ROUNDS = 3


def evalsha_usec(raw: redis.Redis, fn: Callable[[], object], calls: int) -> float:
    """Redis CPU (µs) per EVALSHA while running ``fn`` ``calls`` times."""
    raw.config_resetstat()
    for _ in range(calls):
        fn()
    stats = raw.info("commandstats")["cmdstat_evalsha"]
    return float(stats["usec"]) / max(1, int(stats["calls"]))


def main() -> None:
    parser = bench_parser(__doc__, "1,000 chains instead of 10,000")
    parser.add_argument("--redis", metavar="URL", help="an existing server (default: start one)")
    args = parser.parse_args()
    chains_n = 1_000 if args.quick else 10_000
    rng = random.Random(1)
    chains = [[rng.getrandbits(64) for _ in range(16)] for _ in range(chains_n)]
    with redis_server(args.redis) as url:
        raw = redis.Redis.from_url(url)
        ns_kept, ns_old, ns_new = (f"bench-{uuid.uuid4().hex[:8]}" for _ in range(3))
        # the previous release's client of the test suite (importable once _bench set the path)
        client = importlib.import_module("tests.redis.layout_v1").V1Namespace
        kept, v1 = client(raw, ns_kept), client(raw, ns_old)  # the same adds; one stays /1
        fresh = RedisIndex(RedisIndexConfig(address=url, namespace=ns_new))
        for n, chain in enumerate(chains):
            engine = [k ^ 0x5A5A for k in chain]
            pods = [PODS[n % 4], PODS[(n + 1) % 4]]
            for old in (kept, v1):
                old.add(engine, chain, pods)
            fresh.add(engine, chain, pods)
            if n % 4 == 0:
                for old in (kept, v1):
                    old.add(None, chain, [SPEC], ttl_ms=3_600_000)
                fresh.add(None, chain, [SPEC], ttl=3600)
        pairs = int(raw.zcard(v1.sx))

        stamps: list[float] = []
        raw.config_resetstat()
        started = time.perf_counter()
        report = migrate_namespace(
            RedisIndexConfig(address=url, namespace=ns_old),
            lambda _d, _t: stamps.append(time.perf_counter()),
        )
        wall = time.perf_counter() - started
        stats = raw.info("commandstats").get("cmdstat_evalsha", {"usec": 0, "calls": 1})
        pages = max(0, len(stamps) - 1)
        longest = max((b - a for a, b in itertools.pairwise(stamps)), default=0.0)
        migrated = RedisIndex(RedisIndexConfig(address=url, namespace=ns_old))
        sample = chains[: min(len(chains), 2_000)]
        variants: dict[str, Callable[[list[int]], object]] = {
            "before": kept.lookup,
            "after": migrated.lookup,
            "runs": fresh.lookup,
        }
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(ROUNDS):  # alternating, the best round of each (a shared machine)
            for name, lookup in variants.items():
                it = iter(sample)
                usec = evalsha_usec(raw, lambda f=lookup, i=it: f(next(i)), len(sample))
                best[name] = min(best[name], usec)
        before, after, runs = best["before"], best["after"], best["runs"]
        result: dict[str, Any] = {
            "chains": chains_n,
            "keys_per_chain": 16,
            "speculative_pairs": pairs,
            "migrated_pairs": report.pairs,
            "wall_s": round(wall, 3),
            "pages": pages,
            "pairs_per_s": round(report.pairs / wall) if wall else None,
            "server_usec_per_call": round(float(stats["usec"]) / max(1, int(stats["calls"])), 1),
            "longest_page_ms_client": round(longest * 1000, 2),
            "lookup_usec_v1_before": round(before, 1),
            "lookup_usec_after_migration": round(after, 1),
            "lookup_usec_written_by_this_release": round(runs, 1),
        }
        print(
            f"{chains_n:,} chains x 16 keys, {pairs:,} speculative pairs: migrated in "
            f"{wall:.2f} s ({pages} pages, {result['pairs_per_s']:,} pairs/s, "
            f"{result['server_usec_per_call']} us of server time per call, longest page "
            f"{result['longest_page_ms_client']} ms as the client saw it)"
        )
        print(
            f"lookup of a 16-key chain, Redis CPU per call: /1 before {before:.1f} us, migrated "
            f"{after:.1f} us ({after / before:.2f}x), written by this release (runs) "
            f"{runs:.1f} us ({runs / before:.2f}x)"
        )
        if args.json:
            write_json(args.json, result)
        for index in (migrated, fresh):
            index.drop_namespace()
            index.close()
        drop_namespace(RedisIndexConfig(address=url, namespace=ns_kept))
        raw.close()


if __name__ == "__main__":
    main()

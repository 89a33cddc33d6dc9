"""Bytes per (block, pod) entry in Redis: RedisIndex against the Go llm-d layout, same workload.

Each layout gets a fresh redis-server. The workload is ``--blocks`` request keys (default 100k)
held by ``--pods`` pods (default 4), loaded as 64-block events (engine keys mapped 1:1 to request
keys, so the engine->request mapping is included). The figure is the growth of ``used_memory``
(INFO memory) over the empty server, minus the growth of the script cache, divided by
blocks x pods. A per-key-type breakdown samples MEMORY USAGE and OBJECT ENCODING.

``--bucket-bits 16,12,auto`` measures kvredis at each bucket count (``auto``: what
:func:`kvredis.redis.layout.bucket_bits_for` gives for the blocks).

Run:  .venv/bin/python scripts/bench_redis_memory.py [--quick] [--bucket-bits 16,auto]
"""

from __future__ import annotations

import random
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import redis

from kvredis.batch import AddOp
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.redis.layout import DEFAULT_BUCKET_BITS, bucket_bits_for
from kvredis.types import PodEntry

from _bench import RedisServer, bench_parser, write_json
from reference_layout import ReferenceLayout

EVENT_BLOCKS = 64
NAMESPACE = "kvblock"
SAMPLES_PER_GROUP = 300
TARGET = 1 / 3


@dataclass
class KeyGroup:
    """Keys of one type and name pattern, with sampled sizes and encodings."""

    type: str
    pattern: str
    count: int
    sampled: int
    avg_bytes: float
    est_total_bytes: float
    encodings: dict[str, int]


@dataclass
class Layout:
    """Memory of one layout after loading the workload."""

    name: str
    entries: int
    used_memory_delta: int
    scripts_delta: int
    keys: int
    load_seconds: float
    groups: list[KeyGroup] = field(default_factory=list)

    @property
    def bytes_per_entry(self) -> float:
        return (self.used_memory_delta - self.scripts_delta) / self.entries


@dataclass(frozen=True)
class Workload:
    """The request keys, engine keys and pods every layout stores."""

    request_keys: list[int]
    engine_keys: list[list[int]]
    pods: list[PodEntry]

    def events(self) -> list[AddOp]:
        """One AddOp per (pod, 64-block chunk), pods interleaved as a fleet would report."""
        ops = []
        for start in range(0, len(self.request_keys), EVENT_BLOCKS):
            req = tuple(self.request_keys[start : start + EVENT_BLOCKS])
            for p, pod in enumerate(self.pods):
                eng = tuple(self.engine_keys[p][start : start + EVENT_BLOCKS])
                ops.append(AddOp(eng, req, (pod,)))
        return ops


def make_workload(blocks: int, pods: int, distinct_engine_keys: bool, seed: int) -> Workload:
    rng = random.Random(seed)
    request_keys = [rng.getrandbits(64) for _ in range(blocks)]
    shared = [rng.getrandbits(64) for _ in range(blocks)]
    engine_keys = [
        [rng.getrandbits(64) for _ in range(blocks)] if distinct_engine_keys else shared
        for _ in range(pods)
    ]
    entries = [PodEntry(f"10.0.{i // 250}.{i % 250 + 1}:8000", "gpu") for i in range(pods)]
    return Workload(request_keys, engine_keys, entries)


def memory(client: redis.Redis) -> tuple[int, int]:
    info = client.info("memory")
    return int(info["used_memory"]), int(info.get("used_memory_scripts", 0))


_BINARY = re.compile(rb"[^\x20-\x7e]")
#: Groups with at most this many keys are listed key by key.
SMALL_GROUP = 8


def printable(name: bytes) -> str:
    """A key name with non-printable bytes shown as ``?``."""
    return _BINARY.sub(b"?", name).decode("ascii")


def pattern_of(name: bytes, namespace: str = NAMESPACE) -> str:
    """The group of a key: ``<ns>:<kind>:*`` or ``<ns>:<name>`` inside the kvredis namespace,
    the name up to its first ``:`` then ``*`` outside it, ``#`` for a bare number."""
    prefix = namespace.encode() + b":"
    if name.startswith(prefix):
        kind, sep, _rest = name[len(prefix) :].partition(b":")
        return printable(prefix + kind) + (":*" if sep else "")
    head, sep, _rest = name.partition(b":")
    if sep:
        return printable(head) + ":*"
    return "#" if name.isdigit() else printable(name)


def breakdown(client: redis.Redis, seed: int) -> tuple[int, list[KeyGroup]]:
    """Every key grouped by (type, pattern), with MEMORY USAGE / OBJECT ENCODING samples."""
    names = list(client.scan_iter(count=5000))
    groups: dict[tuple[str, str], list[bytes]] = {}
    for start in range(0, len(names), 5000):
        chunk = names[start : start + 5000]
        pipe = client.pipeline(transaction=False)
        for name in chunk:
            pipe.type(name)
        for name, kind in zip(chunk, pipe.execute(), strict=True):
            groups.setdefault((kind.decode(), pattern_of(name)), []).append(name)
    for (kind, pattern), members in list(groups.items()):
        if 1 < len(members) <= SMALL_GROUP:
            del groups[(kind, pattern)]
            for name in members:
                groups[(kind, printable(name))] = [name]
    rng = random.Random(seed)
    out: list[KeyGroup] = []
    for (kind, pattern), members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        sample = rng.sample(members, min(SAMPLES_PER_GROUP, len(members)))
        pipe = client.pipeline(transaction=False)
        for name in sample:
            pipe.memory_usage(name, samples=0)
            pipe.object("ENCODING", name)
        replies = pipe.execute()
        sizes = [int(s) for s in replies[0::2] if s is not None]
        encodings = Counter(
            e.decode() if isinstance(e, bytes) else str(e) for e in replies[1::2]
        )
        avg = statistics.fmean(sizes) if sizes else 0.0
        out.append(
            KeyGroup(kind, pattern, len(members), len(sample), avg, avg * len(members),
                     dict(encodings))
        )
    return len(names), out


def measure(
    name: str,
    load: Callable[[str], None],
    workload: Workload,
    with_breakdown: bool,
    seed: int,
) -> Layout:
    """Load ``workload`` with ``load(url)`` into a fresh server and measure the growth."""
    srv = RedisServer()
    srv.start()
    client = redis.Redis(host="127.0.0.1", port=srv.port)
    try:
        before, scripts_before = memory(client)
        start = time.perf_counter()
        load(srv.url)
        seconds = time.perf_counter() - start
        after, scripts_after = memory(client)
        layout = Layout(
            name=name,
            entries=len(workload.request_keys) * len(workload.pods),
            used_memory_delta=after - before,
            scripts_delta=scripts_after - scripts_before,
            keys=int(client.dbsize()) + _other_db_keys(client),
            load_seconds=seconds,
        )
        if with_breakdown:
            layout.keys, layout.groups = _breakdown_all_dbs(client, srv.port, seed)
        return layout
    finally:
        client.close()
        srv.close()


def _other_db_keys(client: redis.Redis) -> int:
    info = client.info("keyspace")
    return sum(int(v["keys"]) for k, v in info.items() if k != "db0")


def _breakdown_all_dbs(
    client: redis.Redis, port: int, seed: int
) -> tuple[int, list[KeyGroup]]:
    total = 0
    groups: list[KeyGroup] = []
    for db_name in client.info("keyspace"):
        db = int(str(db_name)[2:])
        conn = redis.Redis(host="127.0.0.1", port=port, db=db)
        try:
            n, g = breakdown(conn, seed)
        finally:
            conn.close()
        total += n
        groups.extend(g)
    return total, groups


def load_kvredis(
    workload: Workload, ops_per_call: int, bucket_bits: int = DEFAULT_BUCKET_BITS
) -> Callable[[str], None]:
    def load(url: str) -> None:
        config = RedisIndexConfig(address=url, namespace=NAMESPACE, bucket_bits=bucket_bits)
        index = RedisIndex(config)
        try:
            ops = workload.events()
            for start in range(0, len(ops), ops_per_call):
                index.apply_batch(ops[start : start + ops_per_call])
            probe = workload.request_keys[:EVENT_BLOCKS]
            found = index.lookup(probe)
            assert len(found) == len(probe) and all(
                len(v) == len(workload.pods) for v in found.values()
            ), "kvredis did not store the workload"
        finally:
            index.close()

    return load


def load_reference(workload: Workload) -> Callable[[str], None]:
    def load(url: str) -> None:
        client = redis.Redis.from_url(url, db=1)
        try:
            ref = ReferenceLayout(client)
            for op in workload.events():
                ref.add(op.engine_keys, op.request_keys, op.entries)
            probe = workload.request_keys[:EVENT_BLOCKS]
            found = ref.lookup(probe)
            assert len(found) == len(probe), "the reference did not store the workload"
        finally:
            client.close()

    return load


def print_layout(layout: Layout) -> None:
    print(
        f"{layout.name}: {layout.bytes_per_entry:,.1f} bytes/entry "
        f"(used_memory +{layout.used_memory_delta:,} B, of which script cache "
        f"+{layout.scripts_delta:,} B; {layout.keys:,} keys; loaded in {layout.load_seconds:.1f} s)"
    )
    if not layout.groups:
        return
    print(f"  {'type':<6} {'key pattern':<34} {'keys':>9} {'avg B/key':>10} "
          f"{'est. total':>12} {'B/entry':>8}  encoding (sample)")
    for g in layout.groups:
        enc = ", ".join(f"{k} {v}" for k, v in sorted(g.encodings.items(), key=lambda e: -e[1]))
        print(
            f"  {g.type:<6} {g.pattern[:34]:<34} {g.count:>9,} {g.avg_bytes:>10,.1f} "
            f"{g.est_total_bytes:>12,.0f} {g.est_total_bytes / layout.entries:>8.1f}  {enc}"
        )
    sampled = sum(g.est_total_bytes for g in layout.groups)
    rest = layout.used_memory_delta - layout.scripts_delta - sampled
    print(
        f"  {'':<6} {'(keyspace tables, allocator slack)':<34} {'':>9} {'':>10} "
        f"{rest:>12,.0f} {rest / layout.entries:>8.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "10k blocks (seconds)")
    parser.add_argument("--blocks", type=int, default=None, help="request keys (default 100k)")
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument(
        "--distinct-engine-keys",
        action="store_true",
        help="every pod reports its own engine keys (default: pods share engine hashes)",
    )
    parser.add_argument("--ops-per-call", type=int, default=16, help="AddOps per apply_batch")
    parser.add_argument(
        "--bucket-bits",
        default=str(DEFAULT_BUCKET_BITS),
        help="kvredis bucket bits, comma-separated to compare (auto: bucket_bits_for the "
        "blocks); the verdict is the first's",
    )
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    blocks = args.blocks or (10_000 if args.quick else 100_000)
    workload = make_workload(blocks, args.pods, args.distinct_engine_keys, args.seed)
    print(
        f"{blocks:,} blocks x {args.pods} pods = {blocks * args.pods:,} entries, "
        f"{'distinct' if args.distinct_engine_keys else 'shared'} engine keys, "
        f"{EVENT_BLOCKS}-block events"
    )
    breakdown_on = not args.no_breakdown
    sides = [
        bucket_bits_for(blocks) if b.strip() == "auto" else int(b)
        for b in args.bucket_bits.split(",")
    ]
    kvs = [
        measure(
            "kvredis" if b == DEFAULT_BUCKET_BITS else f"kvredis, {b} bucket bits "
            f"({blocks / 2**b:,.0f} keys a bucket)",
            load_kvredis(workload, args.ops_per_call, b),
            workload,
            breakdown_on,
            args.seed,
        )
        for b in sides
    ]
    ref = measure("reference (Go layout)", load_reference(workload), workload, breakdown_on,
                  args.seed)
    for kv in kvs:
        print_layout(kv)
    print_layout(ref)
    kv = kvs[0]
    ratio = kv.bytes_per_entry / ref.bytes_per_entry
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"kvredis / reference = {ratio:.3f} (target <= {TARGET:.3f}): {verdict}")
    if args.json:
        write_json(
            args.json,
            {
                "blocks": blocks,
                "pods": args.pods,
                "layouts": [
                    {**asdict(x), "bytes_per_entry": x.bytes_per_entry} for x in (*kvs, ref)
                ],
                "bucket_bits": sides,
                "ratio": ratio,
                "verdict": verdict,
            },
        )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

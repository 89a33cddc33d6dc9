"""Redis CPU per operation: RedisIndex against the Go llm-d layout, side by side on one server.

What decides how many routers one Redis serves is the server's CPU per routed request, not the
client's latency. This benchmark starts its own redis-server (or uses ``--url``), pins it to one
core with ``taskset`` when it can (clients run on the others), and measures every row two ways:

- **CPU**: the growth of ``used_cpu_user + used_cpu_sys`` (``INFO cpu``, the server's own
  rusage) over the calls, minus what the idle server burns in the same time, per call. This is
  everything the server does for the call: reading and parsing the request, running the
  script or the commands, writing the reply;
- **cmd**: the ``usec`` of ``INFO commandstats`` per call (the commands' or the script's own
  time, without the networking).

kvredis runs in database 0 under its own namespace, the reference layout
(``scripts/reference_layout.py``: one HASH per request key, read by one HKEYS pipeline per
lookup) in database 1. Both hold the same entries; answers are compared before anything is
measured. The reference's score is its lookup plus a client-side scorer, so its server CPU is
that of its lookup.

Datasets (seeded, the same in every run):

- the hot chain: one 512-block chain held by 4 pods (2 on gpu, 2 on cpu);
- 20k chains: 1,000 families of a 384-block shared prefix + 20 tails of 128 blocks, 8 pods,
  each chain on 1-3 pods (a family's prefix on the union of its chains' pods): 2.9M request
  keys; a row scores whole random chains;
- random keys: unrelated 512-block chains on 4 pods (1-4 holders each), 1M and 4M blocks;
- pods: one 512-block chain held by 1, 8 and 64 pods;
- writes (kvredis only; compare across commits): add of a 64-block event of fresh keys, add of
  a 64-block event of a new pod onto an existing chain, evict by engine key, evict in the middle
  of a held chain, apply_batch of 16 single-key ops.

With ``--base REV`` the rows run in two child processes at the same time, one on the kvredis of
git revision ``REV`` and one on this checkout, each with its own server (both pinned to the same
core), ``--rounds`` times; the table shows the median of each side and after/before. That is
how costs are compared across a change on a shared machine, where one run alone moves by tens
of percent. Both children run this checkout's script and bench helpers (``_bench.py``,
``_chains.py``, ``reference_layout.py``: the same datasets and loaders on both sides); only the
``kvredis`` package (and its ``lua/``) of ``REV`` is unpacked (``git archive``) and put first on
the base child's ``PYTHONPATH``. Each child reports the ``kvredis`` it imported and the layout
version its namespace was created with, and the parent checks that the base side measured the
unpacked tree.

Run:  .venv/bin/python scripts/bench_server_cpu.py [--quick] [--json PATH] [--rows a,b]
          [--base REV [--rounds N]]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

import kvredis
from kvredis.batch import AddOp, Watermark
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType

from _bench import REPO, RedisServer, bench_parser, write_json
from _chains import (
    HOT_CHAIN,
    TWENTY_K_CHAINS,
    WEIGHTS,
    ChainSpec,
    Dataset,
    build,
    engine_key,
    load_kvredis,
    load_reference,
    pod_entries,
    random_keys,
)
from reference_layout import ReferenceLayout

REFERENCE_DB = 1
EVENT_BLOCKS = 64


@dataclass
class Row:
    """One measured operation: server µs per call on both sides."""

    dataset: str
    op: str
    kvredis_cpu_us: float
    kvredis_cmd_us: float
    reference_cpu_us: float | None = None
    reference_cmd_us: float | None = None
    calls: int = 0

    @property
    def ratio(self) -> float | None:
        """How many times less server CPU kvredis takes than the reference."""
        if self.reference_cpu_us is None or self.kvredis_cpu_us <= 0:
            return None
        return self.reference_cpu_us / self.kvredis_cpu_us


@dataclass
class Measured:
    """One run of the rows, and which kvredis made it: the package folder this process imported
    and the layout version the namespaces were created with (``layout`` of ``<ns>:meta``)."""

    kvredis: str
    layouts: list[str]
    pinned: bool
    rows: list[Row]

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["rows"] = [asdict(r) | {"ratio": r.ratio} for r in self.rows]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measured:
        rows = [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in data["rows"]]
        return cls(data["kvredis"], data["layouts"], data["pinned"], rows)


class Server:
    """The measured server: INFO cpu and commandstats around a run of calls."""

    def __init__(self, url: str, pid: int | None) -> None:
        self.raw = redis.Redis.from_url(url)
        self.pid = pid
        self.idle_per_s = 0.0

    def cpu(self) -> float:
        info = self.raw.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def calibrate(self, seconds: float = 1.0) -> None:
        """What the idle server burns per second (its cron, our INFO calls)."""
        before = self.cpu()
        start = time.perf_counter()
        time.sleep(seconds)
        self.idle_per_s = max(0.0, (self.cpu() - before) / (time.perf_counter() - start))

    def measure(self, call: Callable[[int], object], calls: int) -> tuple[float, float]:
        """(CPU µs, commandstats µs) per call of ``call(i)`` for i in range(calls)."""
        call(0)
        self.raw.config_resetstat()
        before = self.cpu()
        start = time.perf_counter()
        for i in range(calls):
            call(i)
        elapsed = time.perf_counter() - start
        used = self.cpu() - before - self.idle_per_s * elapsed
        stats = self.raw.info("commandstats")
        usec = sum(
            v["usec"]
            for k, v in stats.items()
            if not k.startswith(("cmdstat_info", "cmdstat_config"))
        )
        return used * 1e6 / calls, usec / calls

    def close(self) -> None:
        self.raw.close()


def pin(pid: int, core: int = 0) -> bool:
    """Pin a process to one core with taskset; False when that is not possible."""
    if shutil.which("taskset") is None:
        return False
    done = subprocess.run(
        ["taskset", "-a", "-p", "-c", str(core), str(pid)], capture_output=True, check=False
    )
    return done.returncode == 0


def keys(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


class Sides:
    """The two layouts on one server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.namespace = f"cpu-{uuid.uuid4().hex[:8]}"
        self.config = RedisIndexConfig(address=f"{url}/0", namespace=self.namespace)
        self.kv = RedisIndex(self.config)
        self.ref_client = redis.Redis.from_url(url, db=REFERENCE_DB)
        self.ref = ReferenceLayout(self.ref_client)
        self.scorer = LongestPrefixScorer(WEIGHTS)

    def load(self, data: Dataset) -> None:
        """Both layouts hold ``data``: kvredis written event by event, as engines report it
        (``apply_batch`` of one op per event), the reference pipelined."""
        load_kvredis(self.config, data, per_event=True)
        where = urlsplit(self.url)
        load_reference(where.hostname or "127.0.0.1", where.port or 6379, REFERENCE_DB, data)

    def layout(self) -> str:
        """The layout version of this side's kvredis namespace, as stored in ``<ns>:meta``."""
        version = redis.Redis.from_url(self.url).hget(f"{self.namespace}:meta", "layout")
        return version.decode() if isinstance(version, bytes) else "?"

    def ref_score(self, chain: Sequence[int]) -> dict[str, float]:
        return self.scorer.score(chain, self.ref.lookup(chain))

    def agree(self, chain: Sequence[int]) -> None:
        got, want = self.kv.lookup(chain), self.ref.lookup(chain)
        assert {k: set(v) for k, v in got.items()} == {k: set(v) for k, v in want.items()}
        assert self.kv.score(chain, WEIGHTS) == self.ref_score(chain)

    def close(self) -> None:
        self.kv.close()
        self.ref_client.close()


def read_rows(
    server: Server, sides: Sides, dataset: str, chains: list[list[int]], calls: int, ops: str
) -> Iterator[Row]:
    for chain in chains[:3]:
        sides.agree(chain)
    n = len(chains)
    if "lookup" in ops:
        kv = server.measure(lambda i: sides.kv.lookup(chains[i % n]), calls)
        ref = server.measure(lambda i: sides.ref.lookup(chains[i % n]), calls)
        yield Row(dataset, "lookup", *kv, *ref, calls)
    if "score" in ops:
        kv = server.measure(lambda i: sides.kv.score(chains[i % n], WEIGHTS), calls)
        ref = server.measure(lambda i: sides.ref_score(chains[i % n]), calls)
        yield Row(dataset, "score", *kv, *ref, calls)


def run(
    url: str,
    quick: bool,
    wanted: set[str],
    server: Server,
    seed: int,
    scale: int | None = None,
    layouts: set[str] | None = None,
) -> list[Row]:
    """The ``wanted`` rows (all when empty); adds the layout version of every kvredis namespace
    it loaded to ``layouts``."""
    rows: list[Row] = []
    calls = 100 if quick else 400
    scale = scale or (20 if quick else 1)
    seen = layouts if layouts is not None else set()

    def section(name: str) -> bool:
        return not wanted or name in wanted

    def fresh() -> Sides:
        server.raw.flushall(asynchronous=True)
        return Sides(url)

    def dataset(spec: ChainSpec, ops: str, picked: bool) -> None:
        """Load ``spec``'s dataset into both layouts and measure ``ops`` on its chains (random
        picks of them with ``picked``)."""
        data = build(replace(spec, seed=seed))
        sides = fresh()
        sides.load(data)
        seen.add(sides.layout())
        chains = (
            data.random_chains(random.Random(seed), calls)
            if picked
            else [data.chain(c) for c in range(data.chains)]
        )
        rows.extend(read_rows(server, sides, spec.name, chains, calls, ops))
        sides.close()

    if section("hot"):
        dataset(replace(HOT_CHAIN, name="hot chain, 4 pods"), "lookup score", False)
    if section("20k"):
        name = f"20k chains/{scale}, 8 pods"
        dataset(replace(TWENTY_K_CHAINS.scaled(1 / scale), name=name), "score", True)
    if section("random"):
        for blocks in (50_000, 200_000) if quick else (1_000_000, 4_000_000):
            dataset(random_keys(blocks, 4, (1, 4)), "score", True)
    if section("pods"):
        for npods in (1, 8, 64):
            spec = random_keys(512, npods)
            dataset(replace(spec, name=f"512 blocks, {npods} pods"), "score", False)
    if section("writes"):
        sides = fresh()
        rows += write_rows(server, sides, calls, seed)
        seen.add(sides.layout())
        sides.close()
    if section("walk"):
        server.raw.flushall(asynchronous=True)
        rows += walk_rows(server, 50_000 if quick else 1_000_000, calls, seed)
    return rows


#: Lua walks over 512 keys of buckets named by the low bits of the key (the directions of the
#: layout choice): ARGV[1] bucket prefix, ARGV[2] bucket bits, ARGV[3] the chain (hash blob).
_WALK_PER_KEY = """
local prefix, mask, chain, n = ARGV[1], 2 ^ tonumber(ARGV[2]), ARGV[3], 0
for i = 1, #chain, 8 do
  local h = string.sub(chain, i, i + 7)
  local b = struct.unpack('>I4', h, 5) % mask
  if not redis.call('HGET', prefix .. b, h) then break end
  n = n + 1
end
return n
"""
_WALK_GROUPED = """
local prefix, mask, chain, n = ARGV[1], 2 ^ tonumber(ARGV[2]), ARGV[3], 0
local groups, order = {}, {}
for i = 1, #chain, 8 do
  local h = string.sub(chain, i, i + 7)
  local b = struct.unpack('>I4', h, 5) % mask
  local g = groups[b]
  if not g then g = {}; groups[b] = g; order[#order + 1] = b end
  g[#g + 1] = h
end
for _, b in ipairs(order) do
  local got = redis.call('HMGET', prefix .. b, unpack(groups[b]))
  for _, v in ipairs(got) do if v then n = n + 1 end end
end
return n
"""
_WALK_RUN = """
local run, chain = redis.call('GET', KEYS[1]), ARGV[1]
return run == string.sub(chain, 1, #run) and #run / 8 or 0
"""


def walk_rows(server: Server, blocks: int, calls: int, seed: int) -> list[Row]:
    """The floor of each read design on ``blocks`` stored keys: one HGET per key (buckets of 16
    and of 8 bits), one HMGET per bucket the chain touches, and one GET of a 512-key run."""
    rng = random.Random(seed)
    raw = server.raw
    stored = keys(rng, blocks)
    chain = stored[:512]
    blob = b"".join(k.to_bytes(8, "big") for k in chain)
    for bits in (16, 8):
        pipe = raw.pipeline(transaction=False)
        for k in stored:
            pipe.hset(f"w{bits}:{k % (1 << bits)}", k.to_bytes(8, "big"), b"\0\0\0\1")
            if len(pipe) >= 10_000:
                pipe.execute()
        pipe.execute()
    raw.set("run", blob)
    per_key, grouped, run = (raw.script_load(s) for s in (_WALK_PER_KEY, _WALK_GROUPED, _WALK_RUN))
    name = f"bare walks, {blocks:,} keys"
    rows = []
    for bits in (16, 8):
        for label, sha in (("one HGET per key", per_key), ("one HMGET per bucket", grouped)):
            assert int(raw.evalsha(sha, 0, f"w{bits}:", bits, blob)) == 512
            args = (sha, 0, f"w{bits}:", bits, blob)
            cpu = server.measure(lambda _i, a=args: raw.evalsha(*a), calls)  # type: ignore[misc]
            rows.append(Row(name, f"512 keys, {label}, {bits}-bit buckets", *cpu))
    assert int(raw.evalsha(run, 1, "run", blob)) == 512
    cpu = server.measure(lambda _i: raw.evalsha(run, 1, "run", blob), calls)
    rows.append(Row(name, "512 keys as one run: GET + compare", *cpu))
    raw.flushall(asynchronous=True)
    return rows


def write_rows(server: Server, sides: Sides, calls: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    kv = sides.kv
    pods = pod_entries(8)
    name = "writes"
    rows: list[Row] = []
    # fresh keys: every call stores a new 64-block event of one pod
    events = [keys(rng, EVENT_BLOCKS) for _ in range(calls + 1)]
    adder = pods[0]
    rows.append(
        Row(
            name,
            "add 64-block event, fresh keys",
            *server.measure(
                lambda i: kv.add([engine_key(k) for k in events[i]], events[i], [adder]), calls + 1
            ),
        )
    )
    # a new pod onto chains other pods hold already (the entry sets change)
    held = [keys(rng, 512) for _ in range(calls + 1)]
    for chain in held:
        kv.add([engine_key(k) for k in chain], chain, [pods[1]])
    rows.append(
        Row(
            name,
            "add 64-block event onto a held chain",
            *server.measure(
                lambda i: kv.add(
                    [engine_key(k) for k in held[i][64:128]], held[i][64:128], [pods[2]]
                ),
                calls + 1,
            ),
        )
    )
    # evict by engine key: the last block of each fresh event (a BlockRemoved of the tail)
    rows.append(
        Row(
            name,
            "evict by engine key (tail block)",
            *server.measure(
                lambda i: kv.evict(engine_key(events[i][-1]), KeyType.ENGINE, [adder]), calls + 1
            ),
        )
    )
    rows.append(
        Row(
            name,
            "evict by engine key (middle of a chain)",
            *server.measure(
                lambda i: kv.evict(engine_key(held[i][300]), KeyType.ENGINE, [pods[1]]), calls + 1
            ),
        )
    )
    seq = iter(range(1, 10**9))
    batches = [
        [AddOp(None, (rng.getrandbits(64),), (pods[3],)) for _ in range(16)]
        for _ in range(calls + 1)
    ]
    rows.append(
        Row(
            name,
            "apply_batch of 16 ops",
            *server.measure(
                lambda i: kv.apply_batch(batches[i], "s", Watermark(1, next(seq))), calls + 1
            ),
        )
    )
    return rows


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"


def print_table(rows: list[Row]) -> None:
    print(
        f"{'dataset':<30} {'op':<40} {'kvredis cpu/cmd us':>20} {'reference cpu/cmd us':>22}"
        f" {'ratio':>7}"
    )
    for r in rows:
        ref = f"{fmt(r.reference_cpu_us)} / {fmt(r.reference_cmd_us)}" if r.reference_cpu_us else ""
        ratio = f"{r.ratio:.2f}x" if r.ratio else ""
        kv = f"{fmt(r.kvredis_cpu_us)} / {fmt(r.kvredis_cmd_us)}"
        print(f"{r.dataset:<30} {r.op:<40} {kv:>20} {ref:>22} {ratio:>7}")


def measure_here(
    quick: bool, rows: str, seed: int, url: str | None, scale: int | None = None
) -> Measured:
    """Run the rows on the kvredis this process imports."""
    wanted = {w for w in rows.split(",") if w}
    own = None if url else RedisServer()
    if own is not None:
        own.start()
    address = url or (own.url if own else "")
    layouts: set[str] = set()
    try:
        pid = own.proc.pid if own is not None and own.proc is not None else None
        pinned = pid is not None and pin(pid)
        server = Server(address, pid)
        server.calibrate()
        out = run(address, quick, wanted, server, seed, scale, layouts)
        server.close()
    finally:
        if own is not None:
            own.close()
    return Measured(str(Path(kvredis.__file__).parent), sorted(layouts), pinned, out)


def _children(script: Path, trees: Sequence[Path | None], args: list[str]) -> list[Measured]:
    """Run this checkout's ``script`` once per tree at the same time (each with its own server,
    so both see the same machine): with a tree, on that tree's ``kvredis`` (first on
    ``PYTHONPATH``, ahead of the editable install and of this checkout)."""
    procs = []
    for tree in trees:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if tree is not None:
            # this checkout follows, so that tests.servers (RedisServer) is still found
            env["PYTHONPATH"] = os.pathsep.join((str(tree), str(REPO)))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args, "--json", "-"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    out = []
    for tree, proc in zip(trees, procs, strict=True):
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"the run on {tree or REPO} failed:\n{stderr[-2000:]}")
        out.append(Measured.from_json(json.loads(stdout[stdout.index("{") :])))
    return out


def unpack_kvredis(base: str, into: Path) -> Path:
    """The ``kvredis`` package and ``lua/`` of git revision ``base`` unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", base, "kvredis", "lua"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def compare(base: str, rounds: int, args: list[str]) -> tuple[list[Measured], list[dict[str, Any]]]:
    """Median server CPU per row of revision ``base`` and of this checkout, run side by side
    ``rounds`` times; (the last run of each side, the table)."""
    sides: dict[str, list[Measured]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="kvredis-base-") as tmp:
        tree = unpack_kvredis(base, Path(tmp))
        for _ in range(rounds):
            before, after = _children(Path(__file__), (tree, None), args)
            if not Path(before.kvredis).is_relative_to(tree):
                raise SystemExit(f"the base side measured {before.kvredis}, not {tree}/kvredis")
            sides["before"].append(before)
            sides["after"].append(after)
    out = []
    for i, row in enumerate(sides["after"][0].rows):
        before_us = statistics.median(m.rows[i].kvredis_cpu_us for m in sides["before"])
        after_us = statistics.median(m.rows[i].kvredis_cpu_us for m in sides["after"])
        ref = [r for m in sides["after"] if (r := m.rows[i].reference_cpu_us)]
        out.append(
            {
                "dataset": row.dataset,
                "op": row.op,
                "before_cpu_us": before_us,
                "after_cpu_us": after_us,
                "after_vs_before": after_us / before_us if before_us else None,
                "reference_cpu_us": statistics.median(ref) if ref else None,
            }
        )
    return [sides["before"][-1], sides["after"][-1]], out


def provenance(label: str, measured: Measured) -> str:
    layouts = ", ".join(measured.layouts) or "no namespace"
    return f"{label}: kvredis from {measured.kvredis} (layout {layouts})"


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "scaled-down datasets and fewer calls")
    parser.add_argument("--url", help="use this server instead of starting one")
    parser.add_argument(
        "--rows", default="", help="comma-separated: hot,20k,random,pods,writes,walk"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--scale", type=int, help="1/N of the 20k-chain families (default 1, 20 with --quick)"
    )
    parser.add_argument("--base", help="git revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side with --base")
    args = parser.parse_args(argv)
    if args.base:
        child = ["--rows", args.rows, "--seed", str(args.seed)] + (
            ["--quick"] if args.quick else []
        )
        child += ["--scale", str(args.scale)] if args.scale else []
        (before, after), table = compare(args.base, args.rounds, child)
        print(provenance(f"before ({args.base})", before))
        print(provenance("after (this checkout)", after))
        print(
            f"{'dataset':<30} {'op':<40} {'before':>8} {'after':>8} {'after/before':>12}"
            f" {'reference':>9}"
        )
        for t in table:
            ratio = t["after_vs_before"]
            print(
                f"{t['dataset']:<30} {t['op']:<40} {fmt(t['before_cpu_us']):>8}"
                f" {fmt(t['after_cpu_us']):>8} {ratio:>11.2f}x {fmt(t['reference_cpu_us']):>9}"
            )
        if args.json:
            sides = {"before": before.as_json(), "after": after.as_json()}
            write_json(args.json, {"base": args.base, "sides": sides, "rows": table})
        return 0
    measured = measure_here(args.quick, args.rows, args.seed, args.url, args.scale)
    if args.json == "-":
        write_json("-", measured.as_json())
        return 0
    print(f"server pinned to core 0: {measured.pinned}")
    print(provenance("this run", measured))
    print_table(measured.rows)
    if args.json:
        write_json(args.json, measured.as_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())

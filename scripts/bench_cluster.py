"""Cluster capacity on realistic engine streams: one server against clusters of 1, 3 and 6
primaries, with and without replicas, side by side.

The fleet is ``scripts/bench_realistic.py``'s (imported: ``Fleet``), with more pods: ``--pods``
pods (48), ``--conversations`` conversations of ``--turns`` turns over 16 shared system prompts,
LRU eviction at 3,000 blocks per pod, every engine message one batch through
:class:`~kvredis.ingest.EventIngester` (vLLM: prefill chunks of up to 128 blocks, then one
one-block ``BlockStored`` per 16 generated tokens; SGLang page size 1: radix nodes, one engine
hash per token). Setups (``--setups``; each started from binaries by this script, servers
pinned to one core and this process to the other where ``taskset`` allows):

- ``single``: one server, :class:`~kvredis.redis.RedisIndex`;
- ``1p``, ``3p``, ``6p``: clusters of 1, 3 and 6 primaries without replicas;
- ``3p+1r``, ``3p+2r``: 3 primaries with 1 and 2 replicas each, reads spread over each slot's
  primary and replicas (``read_from_replicas="spread"``).

A cluster namespace has ``--shards-per-primary`` shards per primary (1: a score costs one call
per shard it involves, so more shards per node cost more per score). Per shape, in one run:

1. **ingest**: the whole stream into every setup (the page journal off on all: its appends and
   compactions are the same per pod on one server and on a cluster, where a pod's journal lives
   in the pod's shard; ``bench_realistic.py`` measures them), the setups taking it in turns chunk
   by chunk
   (so a noisy spell of the machine hits them alike); each node's ``INFO cpu`` growth (user +
   sys, less its idle rate) per stored block, and this process's CPU per block;
2. **score**: every conversation's whole chain scored (the router's keys), ``--rounds`` rounds
   each scoring it on every setup in turn; each node's CPU per score, and this process's; the
   scores are checked equal to the single server's;
3. **scores, shard by shard** (clusters without replicas): every chain scored against each
   shard's pods only, the shards one after another (:func:`score_isolated`), so that a node
   serves its calls alone, as on a core of its own: in a whole score the nodes sharing this
   machine's one server core take each score in turns, which makes each call dearer than on a
   core of its own, while one server is measured alone;
4. **memory**: the primaries' ``used_memory`` growth per stored (key, entry) pair.

Then a fleet sizing from the measured costs (:func:`fleet_sizing`, its assumptions printed).
Capacity is what the busiest node allows: one server's CPU per operation on its one core over
the busiest node's CPU per operation (a write goes to a primary; a read to one node of each slot
it involves). On this machine every server and this process share 2 cores, so throughput is
not measured directly: the CPU per operation is, and capacity follows from it with each node on
a core of its own.

Run:  .venv/bin/python scripts/bench_cluster.py [--quick] [--shape vllm,sglang] [--server valkey]
          [--setups single,1p,3p,6p,3p+1r,3p+2r] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from bench_realistic import BLOCK, MODEL, TP, WEIGHTS, Fleet, SglangFleet, VllmFleet
from bench_server_cpu import pin

from kvredis.ingest import EventIngester, IngesterConfig
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.cluster.shards import pod_shard

from _bench import LocalCluster, RedisServer, bench_parser, write_json

#: Every setup: (primaries, replicas per primary); 0 primaries: one server.
SETUPS: dict[str, tuple[int, int]] = {
    "single": (0, 0),
    "1p": (1, 0),
    "3p": (3, 0),
    "6p": (6, 0),
    "3p+1r": (3, 1),
    "3p+2r": (3, 2),
}
#: Engine messages fed to one setup before the next takes its turn.
CHUNK = 500

Index = RedisIndex | RedisClusterIndex


@dataclass
class Node:
    """One server process of a setup."""

    port: int
    primary: bool
    client: redis.Redis = field(repr=False, default=None)  # type: ignore[assignment]
    idle_per_s: float = 0.0

    def cpu(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def memory(self) -> int:
        """``used_memory`` less the clients' buffers (a connection keeps the query buffer its
        largest recent command needed until the node finds it idle: no part of the data)."""
        info = self.client.info("memory")
        return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


class Setup:
    """One measured deployment: its servers, its index config, what it burnt so far."""

    def __init__(self, name: str, url: str, nodes: list[Node], config: RedisIndexConfig) -> None:
        self.name = name
        self.url = url
        self.nodes = nodes
        self.config = config
        self.index: Index | None = None
        #: per phase: CPU seconds per node, operations, client CPU seconds
        self.cpu: dict[str, list[float]] = {}
        self.ops: dict[str, int] = {}
        self.client: dict[str, float] = {}
        self.samples: dict[str, list[list[float]]] = {}
        self.client_samples: dict[str, list[float]] = {}

    @property
    def cluster(self) -> bool:
        return self.config.cluster

    def open(self) -> Index:
        self.index = RedisClusterIndex(self.config) if self.cluster else RedisIndex(self.config)
        return self.index

    def calibrate(self, seconds: float) -> None:
        before = [n.cpu() for n in self.nodes]
        start = time.perf_counter()
        time.sleep(seconds)
        elapsed = time.perf_counter() - start
        for node, b in zip(self.nodes, before, strict=True):
            node.idle_per_s = max(0.0, (node.cpu() - b) / elapsed)

    def measure(
        self, phase: str, ops: int, run: Callable[[], object], sample: bool = False
    ) -> None:
        """Run ``run`` (``ops`` operations); add each node's CPU and the client's to ``phase``."""
        before = [n.cpu() for n in self.nodes]
        cpu0, t0 = time.process_time(), time.perf_counter()
        run()
        client, elapsed = time.process_time() - cpu0, time.perf_counter() - t0
        burnt = [
            max(0.0, n.cpu() - b - n.idle_per_s * elapsed)
            for n, b in zip(self.nodes, before, strict=True)
        ]
        total = self.cpu.setdefault(phase, [0.0] * len(self.nodes))
        self.cpu[phase] = [a + b for a, b in zip(total, burnt, strict=True)]
        self.ops[phase] = self.ops.get(phase, 0) + ops
        self.client[phase] = self.client.get(phase, 0.0) + client
        if sample:
            self.samples.setdefault(phase, []).append([b * 1e6 / ops for b in burnt])
            self.client_samples.setdefault(phase, []).append(client * 1e6 / ops)

    def per_op(self, phase: str) -> list[float]:
        """Median over the samples (or the total) of each node's CPU µs per operation."""
        if phase in self.samples:
            rows = self.samples[phase]
            return [statistics.median(r[i] for r in rows) for i in range(len(self.nodes))]
        return [c * 1e6 / self.ops[phase] for c in self.cpu[phase]]

    def client_per_op(self, phase: str) -> float:
        if phase in self.client_samples:
            return statistics.median(self.client_samples[phase])
        return self.client[phase] * 1e6 / self.ops[phase]


def _cluster_nodes(cluster: LocalCluster) -> list[Node]:
    roles = cluster.topology()
    return [
        Node(port, role == "master", redis.Redis(port=port, socket_timeout=30))
        for port, (role, _, _) in sorted(roles.items())
    ]


def start_setups(
    stack: ExitStack, names: Sequence[str], kind: str, per_primary: int
) -> list[Setup]:
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    setups: list[Setup] = []
    for name in names:
        primaries, replicas = SETUPS[name]
        if primaries == 0:
            server = RedisServer(kind)
            server.start()
            stack.callback(server.close)
            node = Node(server.port, True, redis.Redis(port=server.port, socket_timeout=30))
            config = RedisIndexConfig(address=server.url, namespace=f"{ns}-{name}")
            setups.append(Setup(name, server.url, [node], config))
            pids = [server.proc.pid] if server.proc is not None else []
        else:
            cluster = LocalCluster(kind, primaries=primaries, replicas=replicas)
            stack.callback(cluster.close)
            cluster.start()
            config = RedisIndexConfig(
                address=cluster.url,
                namespace=f"{ns}-{name.replace('+', '')}",
                cluster_shards=per_primary * primaries,
                read_from_replicas="spread" if replicas else False,
            )
            setups.append(Setup(name, cluster.url, _cluster_nodes(cluster), config))
            pids = [n.pid for n in cluster.nodes if n.pid]
        for pid in pids:
            pin(pid, 0)
    return setups


# -- the phases ---------------------------------------------------------------------------------


def ingest(setups: Sequence[Setup], fleet: Fleet) -> int:
    """Every message into every setup, the setups in turns, chunk by chunk; blocks stored."""
    # no page journal on any setup: the same work per engine message everywhere (a cluster keeps
    # a pod's journal in the pod's shard), measured by bench_realistic.py
    config = IngesterConfig(page_journal=False)
    ingesters = {s.name: EventIngester(s.open(), TP, config=config) for s in setups}
    seqs: dict[str, dict[int, int]] = {s.name: {} for s in setups}
    messages = fleet.messages
    for start in range(0, len(messages), CHUNK):
        chunk = messages[start : start + CHUNK]
        blocks = sum(m.blocks for m in chunk)
        for setup in setups:
            ing, seq = ingesters[setup.name], seqs[setup.name]

            def feed(
                chunk: Sequence[Any] = chunk, ing: EventIngester = ing, seq: dict[int, int] = seq
            ) -> None:
                for m in chunk:
                    n = seq.get(m.pod, 0)
                    ing.process(f"kv@pod-{m.pod}@{MODEL}", n, m.payload, endpoint=f"pod-{m.pod}")
                    seq[m.pod] = n + 1

            setup.measure("ingest", blocks, feed)
    return sum(m.blocks for m in messages)


def score(setups: Sequence[Setup], chains: list[list[int]], rounds: int) -> int:
    """Every chain scored on every setup, in ``rounds`` rounds taking the setups in turn; the
    scores checked equal to the first setup's."""
    want = [setups[0].index.score(c, WEIGHTS) for c in chains]  # type: ignore[union-attr]
    for setup in setups[1:]:
        got = [setup.index.score(c, WEIGHTS) for c in chains]  # type: ignore[union-attr]
        assert got == want, f"{setup.name}: scores differ from {setups[0].name}'s"
    for r in range(rounds):
        order = list(setups[r % len(setups) :]) + list(setups[: r % len(setups)])
        for setup in order:
            index = setup.index
            assert index is not None

            def run(index: Index = index) -> None:
                for chain in chains:
                    index.score(chain, WEIGHTS)

            setup.measure("score", len(chains), run, sample=True)
    return len(want)


def score_isolated(
    setups: Sequence[Setup], chains: list[list[int]], rounds: int, pods: int
) -> None:
    """Each shard of a cluster without replicas scored on its own: every chain scored against
    the shard's pods only (``pod_identifier_set``: one call, on that shard's node), the shards
    one after another, ``rounds`` rounds. A node then serves a run of calls alone, as a node on
    a core of its own does; in a whole-cluster score the nodes of one core take each score in
    turns, which costs each call more (each process finds the core's caches holding another's
    data), while one server is measured alone. The filter makes a shard's call do a little more
    than an unfiltered one (its pods' ids read), so these costs are on the high side."""
    ids = [f"pod-{p}" for p in range(pods)]
    for setup in setups:
        replicas = SETUPS[setup.name][1]
        index = setup.index
        if not setup.cluster or replicas or not isinstance(index, RedisClusterIndex):
            continue
        groups: dict[int, list[str]] = {}
        for pod in ids:
            groups.setdefault(pod_shard(pod, index.shards), []).append(pod)
        for _ in range(rounds):
            for shard, group in sorted(groups.items()):

                def run(index: RedisClusterIndex = index, group: list[str] = group) -> None:
                    for chain in chains:
                        index.score(chain, WEIGHTS, group)

                setup.measure(f"isolated:{shard}", len(chains), run, sample=True)


def isolated_costs(setup: Setup) -> list[float]:
    """Per shard measured by :func:`score_isolated`: its node's CPU per score (µs)."""
    return [
        max(setup.per_op(phase)) for phase in sorted(setup.samples) if phase.startswith("isolated:")
    ]


# -- output -------------------------------------------------------------------------------------


@dataclass
class Row:
    setup: str
    primaries: int
    replicas: int
    shards: int
    #: per stored block: Redis CPU µs over the primaries, over every node, the busiest primary's
    ingest_cpu_primaries: float
    ingest_cpu_all: float
    ingest_cpu_busiest: float
    ingest_capacity: float
    ingest_client_us: float
    ingest_client_ratio: float
    #: per score: Redis CPU µs over every node, the busiest node's
    score_cpu_all: float
    score_cpu_busiest: float
    score_capacity: float
    score_client_us: float
    score_client_ratio: float
    #: primaries' used_memory growth per stored pair (bytes), and against one server
    bytes_per_pair: float
    memory_ratio: float
    ingest_cpu_per_node: list[float] = field(default_factory=list)
    score_cpu_per_node: list[float] = field(default_factory=list)
    #: shards scored one at a time (:func:`score_isolated`; clusters without replicas): each
    #: shard's node's CPU per score, their sum, and one server's CPU over the busiest's
    score_isolated_per_shard: list[float] = field(default_factory=list)
    score_isolated_all: float = 0.0
    score_isolated_capacity: float = 0.0


@dataclass
class ShapeResult:
    shape: str
    messages: int
    blocks: int
    pairs: int
    conversations: int
    pods: int
    rows: list[Row]


def summarize(setups: Sequence[Setup], memory: dict[str, int], pairs: int) -> list[Row]:
    base = setups[0]
    base_ingest = base.per_op("ingest")[0]
    base_score = base.per_op("score")[0]
    base_client_ingest = base.client_per_op("ingest")
    base_client_score = base.client_per_op("score")
    rows = []
    for setup in setups:
        primaries, replicas = SETUPS[setup.name]
        ingest_nodes = setup.per_op("ingest")
        score_nodes = setup.per_op("score")
        on_primaries = [c for c, n in zip(ingest_nodes, setup.nodes, strict=True) if n.primary]
        shards = setup.config.cluster_shards if setup.cluster else 1
        rows.append(
            Row(
                setup.name, primaries, replicas, shards,
                sum(on_primaries), sum(ingest_nodes), max(on_primaries),
                base_ingest / max(on_primaries),
                setup.client_per_op("ingest"), setup.client_per_op("ingest") / base_client_ingest,
                sum(score_nodes), max(score_nodes), base_score / max(score_nodes),
                setup.client_per_op("score"), setup.client_per_op("score") / base_client_score,
                memory[setup.name] / max(pairs, 1), memory[setup.name] / max(memory[base.name], 1),
                [round(c, 1) for c in ingest_nodes], [round(c, 1) for c in score_nodes],
            )
        )  # fmt: skip
        isolated = isolated_costs(setup)
        if isolated:
            row = rows[-1]
            row.score_isolated_per_shard = [round(c, 1) for c in isolated]
            row.score_isolated_all = sum(isolated)
            row.score_isolated_capacity = base_score / max(isolated)
    return rows


def print_result(result: ShapeResult) -> None:
    print(
        f"\n== {result.shape}: {result.pods} pods, {result.conversations} conversations, "
        f"{result.messages:,} engine batches, {result.blocks:,} blocks stored, "
        f"{result.pairs:,} pairs held at the end"
    )
    header = (
        f"{'setup':<8} {'shards':>6} | {'ingest µs/block: prim':>21} {'all':>6} {'busiest':>7} "
        f"{'capacity':>8} {'client':>7} | {'score µs: all':>13} {'busiest':>7} {'capacity':>8} "
        f"{'client':>7} | {'B/pair':>6} {'mem':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in result.rows:
        ingest = (
            f"{r.ingest_cpu_primaries:>21.1f} {r.ingest_cpu_all:>6.1f} "
            f"{r.ingest_cpu_busiest:>7.1f} {r.ingest_capacity:>7.2f}x "
            f"{r.ingest_client_ratio:>6.2f}x"
        )
        score = (
            f"{r.score_cpu_all:>13.1f} {r.score_cpu_busiest:>7.1f} {r.score_capacity:>7.2f}x "
            f"{r.score_client_ratio:>6.2f}x"
        )
        memory = f"{r.bytes_per_pair:>6.0f} {r.memory_ratio:>4.2f}x"
        print(f"{r.setup:<8} {r.shards:>6} | {ingest} | {score} | {memory}")
    print(
        "capacity: one server's CPU per operation over the busiest node's; client: this process's "
        "CPU per operation against the single server's; mem: used_memory growth against it"
    )
    for r in result.rows:
        nodes = f"ingest per node {r.ingest_cpu_per_node}  score per node {r.score_cpu_per_node}"
        print(f"  {r.setup:<8} {nodes}")
    isolated = [r for r in result.rows if r.score_isolated_per_shard]
    if isolated:
        base = result.rows[0].score_cpu_all
        print(
            "scores, each shard's node measured alone (as on a core of its own): its CPU per "
            "score; capacity with 0, 1 and 2 replicas per primary (reads spread evenly)"
        )
        for r in isolated:
            c = r.score_isolated_capacity
            print(
                f"  {r.setup:<8} per shard {r.score_isolated_per_shard}  all "
                f"{r.score_isolated_all:.1f} µs ({r.score_isolated_all / base:.2f}x)  capacity "
                f"{c:.2f}x / {2 * c:.2f}x / {3 * c:.2f}x"
            )


@dataclass
class SizingRow:
    pods: int
    blocks_per_s: float
    scores_per_s: float
    shards_per_score: float
    primaries: int
    replicas: int
    nodes: int
    redis_cores: float


def fleet_sizing(result: ShapeResult, args: Any) -> list[SizingRow]:
    """Primaries and replicas for fleets of 100, 1,000 and 10,000 pods, from the measured costs:
    Redis CPU per stored block over the primaries (3p), a replica's CPU per block (3p+1r), and a
    shard's CPU per score (3p, one shard per node: a score costs one such call per shard it
    involves). Every pod stores ``--pod-blocks-per-s`` blocks a second; every pod routes
    ``--requests-per-pod`` requests a second, each scored against its model's pool of ``--pool``
    pods (the router's candidates: the shards of those pods only); no node busier than
    ``--utilisation``. Pods land on shards by hash: the busiest primary is taken at the mean
    plus two standard deviations."""
    rows = {r.setup: r for r in result.rows}
    if "3p" not in rows:
        return []
    base = rows["3p"]
    per_block = base.ingest_cpu_primaries
    replica_block = 0.0
    if "3p+1r" in rows:
        replica_block = (
            max(0.0, rows["3p+1r"].ingest_cpu_all - rows["3p+1r"].ingest_cpu_primaries) / 3
        )
    per_shard_score = base.score_cpu_all / base.shards
    budget = args.utilisation * 1e6
    out = []
    for pods in (100, 1_000, 10_000):
        blocks = pods * args.pod_blocks_per_s
        scores = pods * args.requests_per_pod
        primaries = 1
        while True:
            spread = 1 + 2 * ((primaries - 1) / pods) ** 0.5 if primaries > 1 else 1.0
            if blocks * per_block * spread / primaries <= budget * 0.5 or primaries >= pods:
                break
            primaries += 1
        shards = primaries
        pool = min(args.pool, pods)
        touched = shards * (1 - (1 - 1 / shards) ** pool)
        reads = scores * touched * per_shard_score / primaries  # per primary's group
        ingest = blocks * per_block * spread / primaries
        replicas = 0
        while max(ingest + reads / (replicas + 1), blocks * replica_block / primaries
                   + reads / (replicas + 1)) > budget:  # fmt: skip
            replicas += 1
        nodes = primaries * (1 + replicas)
        cores = (
            blocks * (per_block + replicas * replica_block) + scores * touched * per_shard_score
        ) / 1e6
        out.append(SizingRow(pods, blocks, scores, touched, primaries, replicas, nodes, cores))
    return out


def print_sizing(rows: list[SizingRow], args: Any) -> None:
    if not rows:
        return
    print(
        f"\nFleet sizing ({args.pod_blocks_per_s:g} blocks stored per pod per second, "
        f"{args.requests_per_pod:g} routed requests per pod per second scored against a pool of "
        f"{args.pool} pods, nodes at most {args.utilisation:.0%} busy, one shard per primary):"
    )
    print(f"{'pods':>7} {'blocks/s':>10} {'scores/s':>9} {'shards/score':>12} {'primaries':>9} "
          f"{'replicas/primary':>16} {'nodes':>6} {'Redis cores':>11}")  # fmt: skip
    for r in rows:
        print(f"{r.pods:>7,} {r.blocks_per_s:>10,.0f} {r.scores_per_s:>9,.0f} "
              f"{r.shards_per_score:>12.1f} {r.primaries:>9} {r.replicas:>16} {r.nodes:>6} "
              f"{r.redis_cores:>11.1f}")  # fmt: skip


def run_shape(args: Any, shape: str, kind: str) -> ShapeResult:
    quick = args.quick
    fleet: Fleet
    if shape == "vllm":  # pods of 3,000 blocks (SGLang's radix caches count tokens)
        fleet = VllmFleet(args.conversations, args.turns, 3000, args.seed, pods=args.pods)
    else:
        fleet = SglangFleet(args.conversations, args.turns, 3000 * BLOCK, args.seed, args.pods)
    fleet.run()
    with ExitStack() as stack:
        setups = start_setups(stack, args.setups.split(","), kind, args.shards_per_primary)
        for setup in setups:
            setup.calibrate(0.3 if quick else 1.0)
        used = {s.name: sum(n.memory() for n in s.nodes if n.primary) for s in setups}
        blocks = ingest(setups, fleet)
        memory = {
            s.name: sum(n.memory() for n in s.nodes if n.primary) - used[s.name] for s in setups
        }
        base = setups[0].index
        assert isinstance(base, RedisIndex)
        pairs = sum(len(entries) for c in fleet.convs for entries in base.lookup(c.keys).values())
        chains = [c.keys for c in fleet.convs]
        score(setups, chains, args.rounds)
        score_isolated(setups, chains, args.rounds, args.pods)
        rows = summarize(setups, memory, pairs)
        for setup in setups:
            if setup.index is not None:
                setup.index.close()
    return ShapeResult(shape, len(fleet.messages), blocks, pairs, len(chains), args.pods, rows)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "a smaller fleet and fewer rounds (a few minutes)")
    parser.add_argument("--shape", default="vllm,sglang", help="vllm, sglang or both")
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument("--setups", default=",".join(SETUPS), help="setups, the first the base")
    parser.add_argument("--pods", type=int, default=48)
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--shards-per-primary", type=int, default=1)
    parser.add_argument(
        "--pod-blocks-per-s",
        type=float,
        default=300.0,
        help="blocks a pod stores per second, for the fleet sizing",
    )
    parser.add_argument(
        "--requests-per-pod",
        type=float,
        default=2.0,
        help="routed requests per pod per second, for the fleet sizing",
    )
    parser.add_argument(
        "--pool",
        type=int,
        default=16,
        help="pods a request is scored against (the router's candidates)",
    )
    parser.add_argument(
        "--utilisation",
        type=float,
        default=0.7,
        help="the most a node may be busy, for the fleet sizing",
    )
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    defaults = {"conversations": (40, 200), "turns": (3, 7), "rounds": (3, 7)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}; known: {', '.join(SETUPS)}")
    if pin(os.getpid(), 1):
        print("servers pinned to core 0, this process to core 1")
    results = []
    for shape in args.shape.split(","):
        result = run_shape(args, shape, args.server)
        print_result(result)
        sizing = fleet_sizing(result, args)
        print_sizing(sizing, args)
        results.append((result, sizing))
    if args.json:
        shapes = [{**asdict(r), "sizing": [asdict(x) for x in z]} for r, z in results]
        write_json(args.json, {"server": args.server, "shapes": shapes})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cluster: the index on a local Redis Cluster against RedisIndex on one server, side by side.

Starts its own servers from binaries (``tests/servers.py``): one server for the single-node
baseline (``RedisIndex``), and a 1-primary and a 3-primary cluster (``LocalCluster``, no
replicas) for ``RedisClusterIndex``. Loads the 20k-chain dataset (``scripts/_chains.py``,
scaled; request keys only) into every namespace through ``apply_batch``, then measures, in one
run:

1. **Round trips** per call (``index.round_trips``: a wave counts one per node it involves) of
   lookup, score, add, evict by engine key and ``apply_batch`` for chains of 16, 64 and 512
   blocks on the 3-primary cluster (``cluster_shards`` 3, 6 (the default) and 16) and the
   single server, with the nodes each call involves and the waves it sends. The target: one
   round trip per involved node and wave, and lookup and score in one wave.
2. **Per call**: Redis CPU (``INFO cpu`` deltas, user + sys, summed over the setup's nodes,
   minus their idle rate), client CPU and client latency per call of each operation, the single
   server against the 3-primary cluster with 3, 6 and 16 shards; the setups alternate within
   each round, so they see the same machine state.
3. **Mixed router workload**: K = 1, 2, 4 client processes scoring random 64-512-block prefixes
   of the dataset's chains back to back, and one ingestion process sending event batches back
   to back, as the ingester does (``apply_batch`` with a stream and a watermark: two 16-block
   adds of fresh keys with their engine keys, and the evicts by engine key of the blocks the
   batch :data:`LAG` batches earlier added), on the single server, the 1-primary and the
   3-primary cluster (the default 6 shards). Reported: scores/s, batches/s, p50/p99 of both,
   Redis CPU (summed over the primaries, minus idle) in cores and per operation (score or
   batch).

Nothing is pinned: on a 2-core machine every server, client and the ingester share both cores,
so a cluster's throughput here is bounded by the machine, not by its primaries. The honest
figure is the Redis CPU per operation: with each primary on its own core, throughput scales as
``primaries x single-core rate / (cluster CPU per op / single CPU per op)``, which the mixed
table prints as "real hw" (and, more cautiously, with the busiest primary's share in place of
``1 / primaries``).

Run:  .venv/bin/python scripts/bench_cluster.py [--quick] [--json PATH] [--server redis|valkey]
          [--only trips,calls,mixed]
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import random
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from threading import Barrier
from typing import Any

import redis

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark
from kvredis.redis import RedisIndexConfig, new_redis_index
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.cluster.ops import op_cluster_lookup, op_cluster_score
from kvredis.redis.cluster.routing import Wave, WaveOp
from kvredis.redis.cluster.shards import DEFAULT_SHARDS
from kvredis.redis.cluster.writes import op_cluster_add, op_cluster_apply_batch, op_cluster_evict
from kvredis.redis.index import RedisIndex
from kvredis.types import KeyType, PodEntry

from _bench import LocalCluster, RedisServer, bench_parser, percentile, write_json
from _chains import TWENTY_K_CHAINS, WEIGHTS, Dataset, build, engine_key, load_kvredis

Index = RedisIndex | RedisClusterIndex
#: Blocks of one add event of an ingestion batch, and adds per batch.
EVENT_BLOCKS = 16
ADDS_PER_BATCH = 2
#: A batch evicts (by engine key) what the batch this many batches earlier added.
LAG = 4
#: Score chains are random prefixes of the dataset's chains, this many blocks long.
SCORE_BLOCKS = (64, 512)
#: Chains each score client cycles through (built before timing).
CHAINS_PER_CLIENT = 256
#: Chain lengths of the round-trip table.
TRIP_BLOCKS = (16, 64, 512)
#: Unmeasured calls of each operation before the round-trip counts (they load the scripts).
TRIP_WARMUP = 3


# -- servers and what they burn ------------------------------------------------------------------


@dataclass
class Setup:
    """One measured deployment: its config and the server ports whose CPU counts."""

    name: str
    config: RedisIndexConfig
    ports: list[int]

    @property
    def primaries(self) -> int:
        return len(self.ports)

    @property
    def cluster(self) -> bool:
        return self.config.cluster

    def index(self) -> Index:
        return new_redis_index(self.config)


class Meter:
    """``INFO cpu`` of a setup's nodes: CPU seconds used so far, per node."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.clients = [redis.Redis(port=p, socket_timeout=10) for p in ports]
        self.idle_per_s: list[float] = [0.0] * len(ports)

    def cpu(self) -> list[float]:
        out = []
        for client in self.clients:
            info = client.info("cpu")
            out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
        return out

    def calibrate(self, seconds: float) -> None:
        """What each idle node burns per second (its cron, cluster bus, these INFO calls)."""
        before, start = self.cpu(), time.perf_counter()
        time.sleep(seconds)
        elapsed = time.perf_counter() - start
        self.idle_per_s = [
            max(0.0, (b - a) / elapsed) for a, b in zip(before, self.cpu(), strict=True)
        ]

    def busy(self, before: list[float], after: list[float], elapsed: float) -> list[float]:
        """CPU seconds each node spent on the work between ``before`` and ``after``."""
        return [
            max(0.0, b - a - idle * elapsed)
            for a, b, idle in zip(before, after, self.idle_per_s, strict=True)
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()


def start_single(stack: ExitStack, kind: str) -> RedisServer:
    server = RedisServer(kind)
    server.start()
    stack.callback(server.close)
    return server


def start_cluster(stack: ExitStack, kind: str, primaries: int) -> LocalCluster:
    cluster = LocalCluster(kind, primaries=primaries, replicas=0)
    stack.callback(cluster.close)
    cluster.start()
    return cluster


# -- workloads --------------------------------------------------------------------------------


class IngestStream:
    """Event batches of fresh keys: batch ``i`` adds :data:`ADDS_PER_BATCH` events of
    ``blocks`` fresh request keys (with their engine keys, one pod each) and evicts by engine
    key every block that batch ``i - LAG`` added; fenced by ``stream`` and an increasing
    watermark, as the ingester sends them."""

    def __init__(
        self, seed: int, pods: Sequence[PodEntry], stream: str, blocks: int = EVENT_BLOCKS
    ) -> None:
        self.rng = random.Random(seed)
        self.pods = list(pods)
        self.stream = stream
        self.blocks = blocks
        self.seq = 0
        self.history: deque[list[AddOp]] = deque()

    def event(self) -> AddOp:
        keys = tuple(self.rng.getrandbits(64) for _ in range(self.blocks))
        pod = self.rng.choice(self.pods)
        return AddOp(tuple(engine_key(k) for k in keys), keys, (pod,))

    def next(self) -> tuple[list[IndexOp], Watermark]:
        adds = [self.event() for _ in range(ADDS_PER_BATCH)]
        evicts: list[IndexOp] = []
        if len(self.history) >= LAG:
            for op in self.history.popleft():
                assert op.engine_keys is not None
                evicts += [EvictOp(e, KeyType.ENGINE, op.entries) for e in op.engine_keys]
        self.history.append(adds)
        self.seq += 1
        return [*adds, *evicts], Watermark(1, self.seq)

    def warm(self, index: Index) -> None:
        """Send the first :data:`LAG` batches (which evict nothing yet)."""
        while len(self.history) < LAG:
            ops, mark = self.next()
            index.apply_batch(ops, self.stream, mark)


def score_chains(data: Dataset, rng: random.Random, n: int) -> list[list[int]]:
    """``n`` random prefixes of 64-512 blocks of random chains of the dataset."""
    lo, hi = SCORE_BLOCKS
    return [c[: rng.randint(lo, hi)] for c in data.random_chains(rng, n)]


# -- 1. round trips ------------------------------------------------------------------------------


@dataclass
class Trips:
    """What one call sent: round trips, distinct nodes involved, waves."""

    trips: float
    nodes: float
    waves: float


@dataclass
class TripRow:
    setup: str
    op: str
    blocks: int
    trips: float
    nodes: float
    waves: float


def _counting(op: WaveOp[Any], tally: list[Wave]) -> WaveOp[Any]:
    """``op``, recording every wave it sends."""
    reply: Any = None
    while True:
        try:
            request = op.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Wave):
            tally.append(request)
        reply = yield request


Case = tuple[str, Callable[[Any], WaveOp[Any]], Callable[[], object]]


def trips_of(index: Index, case: Case) -> Trips:
    """Round trips, nodes and waves of one call: the case's wave operation on a cluster index
    (driven through a wave counter), its plain call on a single server."""
    _, wave_op, plain = case
    before = index.round_trips
    if isinstance(index, RedisClusterIndex):
        tally: list[Wave] = []
        index.executor.run(_counting(wave_op(index.core), tally))
        nodes = {b.node for w in tally for b in w.batches}
        return Trips(index.round_trips - before, len(nodes), len(tally))
    plain()
    trips = index.round_trips - before
    return Trips(trips, 1, trips)


def _trip_cases(
    index: Index, chain: list[int], event: AddOp, stream: str, batch: tuple[list[IndexOp], Any]
) -> list[Case]:
    """One call of each operation: (name, wave operation on a cluster core, plain call)."""
    eng, req, ents = event.engine_keys, event.request_keys, event.entries
    key = (eng or (0,))[-1]
    ops, mark = batch
    blocks = len(req)
    return [
        ("lookup", lambda c: op_cluster_lookup(c, chain, None), lambda: index.lookup(chain)),
        (
            "score",
            lambda c: op_cluster_score(c, chain, WEIGHTS, None),
            lambda: index.score(chain, WEIGHTS),
        ),
        (
            f"add {blocks}-block event",
            lambda c: op_cluster_add(c, eng, req, ents),
            lambda: index.add(eng, req, ents),
        ),
        (
            "evict by engine key",
            lambda c: op_cluster_evict(c, key, KeyType.ENGINE, ents),
            lambda: index.evict(key, KeyType.ENGINE, ents),
        ),
        (
            f"apply_batch ({ADDS_PER_BATCH}x{blocks} adds + evicts), fenced",
            lambda c: op_cluster_apply_batch(c, ops, stream, mark),
            lambda: index.apply_batch(ops, stream, mark),
        ),
    ]


def measure_trips(setups: Sequence[Setup], data: Dataset, seed: int, repeats: int) -> list[TripRow]:
    rows: list[TripRow] = []
    for setup in setups:
        with setup.index() as index:
            rng = random.Random(seed)
            for blocks in TRIP_BLOCKS:
                chains = [c[:blocks] for c in data.random_chains(rng, TRIP_WARMUP + repeats)]
                name = f"trips-{uuid.uuid4().hex[:6]}"
                stream = IngestStream(seed * 1000 + blocks, data.pods, name, blocks)  # fresh keys
                stream.warm(index)
                samples: dict[str, list[Trips]] = {}
                for i, chain in enumerate(chains):
                    cases = _trip_cases(index, chain, stream.event(), stream.stream, stream.next())
                    for case in cases:
                        trips = trips_of(index, case)
                        if i >= TRIP_WARMUP:  # scripts loaded on every node (NOSCRIPT) before
                            samples.setdefault(case[0], []).append(trips)
                for op, ts in samples.items():
                    rows.append(
                        TripRow(
                            setup.name,
                            op,
                            blocks,
                            statistics.fmean(t.trips for t in ts),
                            statistics.fmean(t.nodes for t in ts),
                            statistics.fmean(t.waves for t in ts),
                        )
                    )
    return rows


# -- 2. per call --------------------------------------------------------------------------------


@dataclass
class CallRow:
    """One operation on one setup: per call."""

    setup: str
    #: the primaries holding the namespace's shards (0: a single server)
    primaries: int
    op: str
    calls: int
    redis_cpu_us: float
    client_cpu_us: float
    p50_us: float
    p99_us: float


@dataclass
class _Acc:
    cpu: float = 0.0
    client: float = 0.0
    calls: int = 0
    latencies: list[float] = field(default_factory=list)


def timed(meter: Meter, calls: Sequence[Callable[[], object]], acc: _Acc) -> None:
    """Run ``calls`` one after the other; add their Redis CPU, client CPU and latencies."""
    before, cpu0, t0 = meter.cpu(), time.process_time(), time.perf_counter()
    clock = time.perf_counter_ns
    for call in calls:
        t = clock()
        call()
        acc.latencies.append((clock() - t) / 1000.0)
    elapsed, client = time.perf_counter() - t0, time.process_time() - cpu0
    acc.cpu += sum(meter.busy(before, meter.cpu(), elapsed))
    acc.client += client
    acc.calls += len(calls)


def _round_calls(
    index: Index, data: Dataset, seed: int, calls: int, stream: IngestStream
) -> Iterator[tuple[str, list[Callable[[], object]]]]:
    """The rows of one round on one index, in order (the evicts undo the adds before them)."""
    rng = random.Random(seed)
    firsts = [c[:1] for c in data.random_chains(rng, calls)]
    yield "lookup 1 (one script call)", [partial(index.lookup, c) for c in firsts]
    for blocks in SCORE_BLOCKS:
        chains = [c[:blocks] for c in data.random_chains(rng, calls)]
        yield f"lookup {blocks}", [partial(index.lookup, c) for c in chains]
        yield f"score {blocks}", [partial(index.score, c, WEIGHTS) for c in chains]
    fresh = IngestStream(rng.getrandbits(64), data.pods, "", 64)
    big = [fresh.event() for _ in range(calls)]
    yield (
        "add 64-block event",
        [partial(index.add, e.engine_keys, e.request_keys, e.entries) for e in big],
    )
    yield (
        "evict by engine key",
        [partial(index.evict, (e.engine_keys or (0,))[-1], KeyType.ENGINE, e.entries) for e in big],
    )
    name = f"apply_batch ({ADDS_PER_BATCH}x{EVENT_BLOCKS} adds + evicts)"
    batches = [stream.next() for _ in range(calls)]
    yield (
        f"{name}, fenced",
        [partial(index.apply_batch, ops, stream.stream, mark) for ops, mark in batches],
    )
    plain = [stream.next()[0] for _ in range(calls)]
    yield f"{name}, unfenced", [partial(index.apply_batch, ops) for ops in plain]


def primaries_used(index: Index) -> int:
    """The primaries holding a cluster namespace's shards (0 for a single server)."""
    if not isinstance(index, RedisClusterIndex):
        return 0
    slot_map = index.executor.slot_map
    return len({slot_map.primary(slot) for slot in index.core.slots})


def measure_calls(
    setups: Sequence[Setup], data: Dataset, seed: int, calls: int, rounds: int, idle_s: float
) -> list[CallRow]:
    meters = {s.name: Meter(s.ports) for s in setups}
    for meter in meters.values():
        meter.calibrate(idle_s)
    accs: dict[tuple[str, str], _Acc] = {}
    order: list[str] = []
    with ExitStack() as stack:
        indexes: dict[str, Index] = {}
        streams: dict[str, IngestStream] = {}
        used: dict[str, int] = {}
        for s in setups:
            indexes[s.name] = s.index()
            stack.callback(indexes[s.name].close)
            used[s.name] = primaries_used(indexes[s.name])
            streams[s.name] = IngestStream(seed, data.pods, f"calls-{uuid.uuid4().hex[:6]}")
            streams[s.name].warm(indexes[s.name])
        for r in range(rounds):
            # every setup's rows of this round, then run row by row, the setups alternating
            rows = {
                s.name: list(_round_calls(indexes[s.name], data, seed + r, calls, streams[s.name]))
                for s in setups
            }
            names = [s.name for s in setups]
            names = names[r % len(names) :] + names[: r % len(names)]
            for i, (op, _) in enumerate(rows[names[0]]):
                if op not in order:
                    order.append(op)
                for name in names:
                    warm = rows[name][i][1]
                    timed(meters[name], warm, accs.setdefault((name, op), _Acc()))
    for meter in meters.values():
        meter.close()
    out = []
    for op in order:
        for s in setups:
            acc = accs[(s.name, op)]
            out.append(CallRow(
                s.name, used[s.name], op, acc.calls,
                acc.cpu * 1e6 / acc.calls, acc.client * 1e6 / acc.calls,
                statistics.median(acc.latencies), percentile(acc.latencies, 0.99),
            ))  # fmt: skip
    return out


# -- 3. mixed workload ---------------------------------------------------------------------------


@dataclass
class MixedRun:
    setup: str
    primaries: int
    clients: int
    seconds: float
    scores: int
    batches: int
    scores_per_s: float
    batches_per_s: float
    score_p50_us: float
    score_p99_us: float
    batch_p50_us: float
    batch_p99_us: float
    redis_cpu_cores: float
    redis_cpu_us_per_op: float
    busiest_node_share: float
    client_cpu_us_per_score: float
    client_cpu_us_per_batch: float


def _scorer(
    config: RedisIndexConfig,
    chains: list[list[int]],
    seconds: float,
    start: Barrier,
    out: multiprocessing.connection.Connection,
) -> None:
    latencies: list[float] = []
    with new_redis_index(config) as index:
        for chain in chains[:8]:
            index.score(chain, WEIGHTS)  # warm up: connections, scripts, slot map
        start.wait()
        cpu0 = time.process_time()
        clock = time.perf_counter_ns
        stop_at = clock() + int(seconds * 1e9)
        i = 0
        while clock() < stop_at:
            t = clock()
            index.score(chains[i % len(chains)], WEIGHTS)
            latencies.append((clock() - t) / 1000.0)
            i += 1
        cpu = time.process_time() - cpu0
    out.send((latencies, cpu))
    out.close()


def _ingester(
    config: RedisIndexConfig,
    pods: Sequence[PodEntry],
    seed: int,
    seconds: float,
    start: Barrier,
    out: multiprocessing.connection.Connection,
) -> None:
    latencies: list[float] = []
    stream = IngestStream(seed, pods, f"ingest-{uuid.uuid4().hex[:8]}")
    with new_redis_index(config) as index:
        stream.warm(index)
        start.wait()
        cpu0 = time.process_time()
        clock = time.perf_counter_ns
        stop_at = clock() + int(seconds * 1e9)
        while clock() < stop_at:
            ops, mark = stream.next()
            t = clock()
            index.apply_batch(ops, stream.stream, mark)
            latencies.append((clock() - t) / 1000.0)
        cpu = time.process_time() - cpu0
    out.send((latencies, cpu))
    out.close()


@dataclass
class _Window:
    scores: list[float]
    batches: list[float]
    seconds: float
    busy: list[float]
    score_cpu: float
    batch_cpu: float


def mixed_window(
    setup: Setup, meter: Meter, data: Dataset, clients: int, seconds: float, seed: int
) -> _Window:
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(clients + 2)
    jobs: list[tuple[Any, multiprocessing.connection.Connection]] = []
    for c in range(clients + 1):
        recv, send = ctx.Pipe(duplex=False)
        if c < clients:
            chains = score_chains(data, random.Random(seed * 1000 + c), CHAINS_PER_CLIENT)
            args: tuple[Any, ...] = (setup.config, chains, seconds, start, send)
            proc = ctx.Process(target=_scorer, args=args)
        else:
            args = (setup.config, data.pods, seed, seconds, start, send)
            proc = ctx.Process(target=_ingester, args=args)
        proc.start()
        send.close()
        jobs.append((proc, recv))
    start.wait(timeout=120)
    before, t0 = meter.cpu(), time.perf_counter()
    time.sleep(seconds)
    after, elapsed = meter.cpu(), time.perf_counter() - t0
    results = []
    for proc, recv in jobs:
        results.append(recv.recv())
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a {setup.name} worker exited with {proc.exitcode}")
    scores = [x for lat, _ in results[:-1] for x in lat]
    score_cpu = sum(cpu for _, cpu in results[:-1])
    batches, batch_cpu = results[-1]
    busy = meter.busy(before, after, elapsed)
    return _Window(scores, batches, elapsed, busy, score_cpu, batch_cpu)


def summarize(setup: Setup, clients: int, windows: list[_Window]) -> MixedRun:
    seconds = sum(w.seconds for w in windows)
    scores = [x for w in windows for x in w.scores]
    batches = [x for w in windows for x in w.batches]
    per_node = [sum(col) for col in zip(*(w.busy for w in windows), strict=True)]
    busy = sum(per_node)
    ops = len(scores) + len(batches)

    def q(xs: list[float], p: float) -> float:
        return percentile(xs, p) if xs else 0.0

    return MixedRun(
        setup.name, setup.primaries if setup.cluster else 0, clients, round(seconds, 3),
        len(scores), len(batches),
        len(scores) / seconds, len(batches) / seconds,
        q(scores, 0.5), q(scores, 0.99), q(batches, 0.5), q(batches, 0.99),
        busy / seconds, busy * 1e6 / ops if ops else 0.0,
        max(per_node) / busy if busy > 0 else 0.0,
        1e6 * sum(w.score_cpu for w in windows) / max(1, len(scores)),
        1e6 * sum(w.batch_cpu for w in windows) / max(1, len(batches)),
    )  # fmt: skip


def measure_mixed(
    setups: Sequence[Setup],
    data: Dataset,
    counts: Sequence[int],
    seconds: float,
    rounds: int,
    seed: int,
    idle_s: float,
) -> list[MixedRun]:
    meters = {s.name: Meter(s.ports) for s in setups}
    for meter in meters.values():
        meter.calibrate(idle_s)
    runs: list[MixedRun] = []
    for clients in counts:
        windows: dict[str, list[_Window]] = {s.name: [] for s in setups}
        for r in range(rounds):
            for s in setups:
                windows[s.name].append(
                    mixed_window(s, meters[s.name], data, clients, seconds / rounds, seed + r)
                )
        runs += [summarize(s, clients, windows[s.name]) for s in setups]
    for meter in meters.values():
        meter.close()
    return runs


# -- output ---------------------------------------------------------------------------------------


@dataclass
class Result:
    server: str
    dataset: dict[str, object]
    load_seconds: dict[str, float]
    trips: list[TripRow]
    calls: list[CallRow]
    mixed: list[MixedRun]
    notes: list[str]


NOTES = [
    "All servers, clients and the ingester share the machine's cores (nothing pinned): on 2 "
    "cores a 3-primary cluster cannot run 3 primaries in parallel, and every wave's per-node "
    "pipelines and per-shard script calls cost CPU that the single server does not spend, so "
    "throughput here is bounded by the machine, not by the primaries.",
    "The honest figure is the Redis CPU per operation summed over the nodes: a cluster spends "
    "that much more server CPU per routed request than one server does.",
    "Real hardware (each primary on its own core, clients elsewhere): throughput ~ primaries x "
    "single-core rate / (cluster CPU per op / single CPU per op), the 'real hw' column; with the "
    "busiest primary's share of the CPU in place of 1 / primaries it is the 'busiest' figure.",
]


def print_result(result: Result) -> None:
    ds = result.dataset
    print(
        f"{ds['name']} (scale {ds['scale']:g}): {ds['chains']:,} chains of {ds['chain_blocks']} "
        f"blocks, {ds['pods']} pods, {ds['distinct_keys']:,} keys; server {result.server}; "
        "load " + ", ".join(f"{k} {v:.1f} s" for k, v in result.load_seconds.items())
    )
    print_trips(result.trips)
    print_calls(result.calls)
    print_mixed(result.mixed)
    print()
    for note in result.notes:
        print("- " + note)


def print_trips(trips: list[TripRow]) -> None:
    if trips:
        print("\nRound trips per call (nodes involved, waves sent)")
        setups = list(dict.fromkeys(r.setup for r in trips))
        header = f"{'operation':<46} {'blocks':>6} " + " ".join(f"{s:>18}" for s in setups)
        print(header)
        print("-" * len(header))
        cells = {(r.setup, r.op, r.blocks): r for r in trips}
        for op, blocks in dict.fromkeys((r.op, r.blocks) for r in trips):
            line = f"{op:<46} {blocks:>6} "
            for s in setups:
                r = cells[(s, op, blocks)]
                line += f" {r.trips:>5.1f} ({r.nodes:.1f}, {r.waves:.1f})".rjust(19)
            print(line)


def print_calls(calls: list[CallRow]) -> None:
    if calls:
        print("\nPer call: Redis CPU µs (summed over nodes, minus idle) / client CPU µs / p50 µs")
        setups = list(dict.fromkeys(r.setup for r in calls))
        base = setups[0]
        header = f"{'operation':<46} " + " ".join(f"{s:>24}" for s in setups)
        print(header)
        print("-" * len(header))
        cells2 = {(r.setup, r.op): r for r in calls}
        for op in dict.fromkeys(r.op for r in calls):
            line = f"{op:<46} "
            ref = cells2[(base, op)]
            for s in setups:
                r = cells2[(s, op)]
                ratio = (
                    ""
                    if s == base or ref.redis_cpu_us <= 0
                    else (f" {r.redis_cpu_us / ref.redis_cpu_us:.1f}x")
                )
                cell = f"{r.redis_cpu_us:,.0f}{ratio} / {r.client_cpu_us:,.0f} / {r.p50_us:,.0f}"
                line += f" {cell:>24}"
            print(line)
        print("(ratio: Redis CPU per call against the first column)")
        print(
            "Predicted throughput on real hardware (each primary on its own core), against the "
            "single server: primaries x single CPU/call / cluster CPU/call (the primaries holding "
            "the namespace's shards)"
        )
        for s in setups[1:]:
            parts = []
            for op in dict.fromkeys(r.op for r in calls):
                cluster, ref = cells2[(s, op)], cells2[(base, op)]
                if op.startswith(("score", "apply_batch")) and cluster.redis_cpu_us > 0:
                    primaries = 3  # the per-call setups are 3-primary clusters
                    parts.append(
                        f"{op}: {primaries * ref.redis_cpu_us / cluster.redis_cpu_us:.2f}x"
                    )
            held = cells2[(s, next(iter(dict.fromkeys(r.op for r in calls))))].primaries
            print(f"  {s} ({held} primaries hold its shards): " + "; ".join(parts))


def print_mixed(mixed: list[MixedRun]) -> None:
    if mixed:
        print("\nMixed router workload: K score clients + 1 ingester, back to back")
        header = (
            f"{'setup':<14} {'K':>2} {'scores/s':>9} {'p50/p99 ms':>12} {'batches/s':>9} "
            f"{'p50/p99 ms':>12} {'Redis CPU':>9} {'µs/op':>7} {'busiest':>7} {'real hw':>9} "
            f"{'client µs/score':>15}"
        )
        print(header)
        print("-" * len(header))
        single = {r.clients: r for r in mixed if r.primaries == 0}
        for r in mixed:
            hw = ""
            base_run = single.get(r.clients)
            if r.primaries and base_run and r.redis_cpu_us_per_op > 0:
                ratio = base_run.redis_cpu_us_per_op / r.redis_cpu_us_per_op
                even = r.primaries * ratio
                worst = ratio / r.busiest_node_share if r.busiest_node_share else even
                hw = f"{even:.1f}/{worst:.1f}x"
            print(
                f"{r.setup:<14} {r.clients:>2} {r.scores_per_s:>9,.0f} "
                f"{r.score_p50_us / 1000:>5.1f}/{r.score_p99_us / 1000:<6.1f} "
                f"{r.batches_per_s:>9,.0f} {r.batch_p50_us / 1000:>5.1f}/"
                f"{r.batch_p99_us / 1000:<6.1f} {r.redis_cpu_cores:>8.2f}c "
                f"{r.redis_cpu_us_per_op:>7,.0f} {100 * r.busiest_node_share:>6.0f}% {hw:>9} "
                f"{r.client_cpu_us_per_score:>15,.0f}"
            )
        print(
            "Redis CPU: cores busy, summed over the primaries, minus idle; µs/op: per score or "
            "batch; busiest: the busiest primary's share; real hw: throughput predicted against "
            "the single server with each primary on its own core (even spread / busiest primary); "
            "client µs/score: the score clients' own CPU per score"
        )


# -- main --------------------------------------------------------------------------------------


def run(args: Any) -> Result:
    data = build(TWENTY_K_CHAINS.scaled(args.scale))
    sections = set(args.only.split(","))
    shard_counts = [int(s) for s in args.shards.split(",")]
    counts = [int(c) for c in args.clients.split(",")]
    loads: dict[str, float] = {}
    with ExitStack() as stack:
        single = start_single(stack, args.server)
        three = start_cluster(stack, args.server, 3)
        one = start_cluster(stack, args.server, 1) if "mixed" in sections else None
        ns = f"bench-{uuid.uuid4().hex[:8]}"

        def setup(name: str, address: str, ports: list[int], shards: int = DEFAULT_SHARDS) -> Setup:
            cfg = RedisIndexConfig(
                address=address, namespace=f"{ns}-{name.replace(' ', '')}", cluster_shards=shards
            )
            loads[name] = load_kvredis(cfg, data, with_engine_keys=False).seconds
            return Setup(name, cfg, ports)

        three_ports = three.ports[:3]
        base = setup("single", single.url, [single.port])
        by_shards = {n: setup(f"3p/{n} shards", three.url, three_ports, n) for n in shard_counts}
        setups_calls = [base, *by_shards.values()]
        trips: list[TripRow] = []
        calls: list[CallRow] = []
        mixed: list[MixedRun] = []
        if "trips" in sections:
            trips = measure_trips(setups_calls, data, args.seed, args.trip_repeats)
        if "calls" in sections:
            calls = measure_calls(setups_calls, data, args.seed, args.calls, args.rounds, args.idle)
        if one is not None:
            mixed_setups = [
                base,
                setup(f"1p/{DEFAULT_SHARDS} shards", one.url, one.ports[:1]),
                by_shards.get(DEFAULT_SHARDS)
                or setup(f"3p/{DEFAULT_SHARDS} shards", three.url, three_ports),
            ]
            mixed = measure_mixed(
                mixed_setups, data, counts, args.seconds, args.rounds, args.seed, args.idle
            )
    dataset: dict[str, object] = {
        "name": data.spec.name,
        "scale": args.scale,
        "chains": data.chains,
        "chain_blocks": data.spec.chain_blocks,
        "pods": data.spec.pods,
        "distinct_keys": data.distinct_keys(),
    }
    return Result(args.server, dataset, loads, trips, calls, mixed, NOTES)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "1/200 of the dataset, short runs (under a minute)")
    parser.add_argument("--server", choices=["redis", "valkey"], default="redis")
    parser.add_argument("--scale", type=float, default=None, help="fraction of the 20k chains")
    parser.add_argument("--seconds", type=float, default=None, help="timed seconds per setup and K")
    parser.add_argument("--clients", default="1,2,4", help="score client processes, e.g. 1,2,4")
    parser.add_argument("--calls", type=int, default=None, help="calls per row, setup and round")
    parser.add_argument("--rounds", type=int, default=None, help="alternations of the setups")
    parser.add_argument("--shards", default="3,6,16", help="cluster_shards of the per-call rows")
    parser.add_argument("--only", default="trips,calls,mixed", help="sections to run")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    defaults = {"scale": (0.005, 0.05), "seconds": (1.0, 9.0), "calls": (20, 150), "rounds": (1, 3)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.trip_repeats = 2 if args.quick else 5
    args.idle = 0.3 if args.quick else 1.0
    result = run(args)
    if args.json:
        write_json(args.json, asdict(result))
    print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

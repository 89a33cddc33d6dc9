"""Event-ingestion throughput into Redis: batched EventIngester vs one Index call per event.

Starts its own redis-server on a free port (or uses ``--url``). A simulated fleet of engines
produces realistic batches, one per scheduler step and pod: BlockStored events of 1-64 blocks
(prefills) and of single blocks (decodes continuing a running request), and BlockRemoved events
of single hashes once a pod's cache is full. The same msgpack payloads are then applied

* by ``EventIngester`` (one ``apply_batch`` per batch, parents from its local cache), in one
  thread and with 4 worker threads (pods in parallel), and
* the way the llm-d event pool does it: per event, ``get_request_key`` for the parent, then
  ``add``; ``evict`` per removed hash; each a separate Index call,

each into its own namespace of the same server. The runs alternate for ``--rounds`` rounds so
they share the machine's state; medians are reported. Round trips are counted on the client
(every request written to a Redis connection; a pipeline counts once), the server's execution
time comes from ``INFO commandstats``, and the resulting index states are compared.

Run:  .venv/bin/python scripts/bench_ingest.py [--quick] [--url URL]
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis

from kvredis.errors import EngineKeyNotFoundError
from kvredis.hashing import ChunkedTokenDatabase
from kvredis.ingest import EndpointConfig, EventIngester, IngesterConfig
from kvredis.ingest.events import BlockRemoved, BlockStored, decode_batch, encode_batch
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.types import KeyType, PodEntry

from _bench import bench_parser, redis_server, write_json

BLOCK = 16
MODEL = "bench-model"
TARGET_RATIO = 3.0


@dataclass
class Message:
    topic: bytes
    seq: int
    payload: bytes
    pod: str


@dataclass
class Workload:
    messages: list[Message]
    stored_blocks: int
    removed_blocks: int
    events: int


def make_workload(pods: int, steps: int, capacity: int, seed: int = 7) -> Workload:
    """Engine batches, one per scheduler step and pod, interleaved across pods by step."""
    rng = random.Random(seed)
    per_pod: list[list[Message]] = []
    stored_total = removed_total = events_total = 0
    for p in range(pods):
        pod = f"pod-{p}"
        topic = f"kv@{pod}@{MODEL}".encode()
        running: list[tuple[int, int]] = []  # (last engine hash, next token offset) per request
        cache: deque[int] = deque()
        messages = []
        for seq in range(steps):
            events: list[Any] = []
            for _ in range(rng.randint(1, 6)):
                if not running or rng.random() < 0.3:
                    blocks = rng.randint(1, 64)  # a prefill
                    parent = None
                    base = rng.randrange(1 << 30)
                    if len(running) > 24:
                        running.pop(0)
                else:
                    blocks = 1  # a decode step that filled one more block
                    i = rng.randrange(len(running))
                    parent, base = running.pop(i)
                hashes = tuple(rng.getrandbits(64) for _ in range(blocks))
                tokens = tuple(range(base, base + blocks * BLOCK))
                events.append(BlockStored(hashes, parent, tokens, BLOCK, medium="GPU"))
                running.append((hashes[-1], base + blocks * BLOCK))
                cache.extend(hashes)
                stored_total += blocks
            tails = {h for h, _ in running}  # blocks running requests still reference
            while len(cache) > capacity:
                victim = cache.popleft()
                if victim in tails:
                    cache.append(victim)
                    continue
                events.append(BlockRemoved((victim,), medium="GPU"))
                removed_total += 1
            events_total += len(events)
            messages.append(Message(topic, seq, encode_batch(events, ts=time.time()), pod))
        per_pod.append(messages)
    interleaved = [m for step in zip(*per_pod, strict=True) for m in step]
    return Workload(interleaved, stored_total, removed_total, events_total)


class RoundTrips:
    """Counts requests written to any redis-py connection (one per command or pipeline)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = redis.connection.AbstractConnection.send_packed_command

    def __enter__(self) -> RoundTrips:
        original = self._original

        def counting(conn: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            original(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        redis.connection.AbstractConnection.send_packed_command = self._original  # type: ignore[method-assign]


def server_usec(client: redis.Redis) -> int:
    """Microseconds the server spent executing commands (scripts included), INFO excluded."""
    stats: dict[str, Any] = client.info("commandstats")
    return sum(int(v["usec"]) for k, v in stats.items() if k != "cmdstat_info")


@dataclass
class Sample:
    seconds: float
    round_trips: int
    server_seconds: float


@dataclass
class Result:
    name: str
    seconds: float
    blocks_per_s: float
    ratio: float
    round_trips_per_batch: float
    server_seconds: float


def run_ingester(
    index: RedisIndex, work: Workload, tp: ChunkedTokenDatabase, workers: int
) -> float:
    pods = sorted({m.pod for m in work.messages})
    endpoints = [EndpointConfig(f"engine-{p}", pod_id=p, model_name=MODEL) for p in pods]
    ing = EventIngester(index, tp, endpoints, IngesterConfig(workers=workers))
    by_pod = {e.pod_id: e for e in endpoints}
    start = time.perf_counter()
    if workers == 1:
        for m in work.messages:
            ing.process(m.topic, m.seq, m.payload, by_pod[m.pod])
    else:
        ing.start()
        for m in work.messages:
            ing.submit(m.topic, m.seq, m.payload, by_pod[m.pod])
        ing.wait_idle(600)
    seconds = time.perf_counter() - start
    ing.stop()
    c = ing.counters.snapshot()
    assert c["batches_applied"] == len(work.messages), c
    assert c["parent_misses"] == 0 and c["rejected"] == 0, c
    return seconds


def run_per_event(index: RedisIndex, work: Workload, tp: ChunkedTokenDatabase) -> float:
    """The llm-d pool way: every event is its own sequence of Index calls."""
    start = time.perf_counter()
    for m in work.messages:
        entry = [PodEntry(m.pod, "gpu")]
        for ev in decode_batch(m.payload).events:
            if isinstance(ev, BlockStored):
                parent = 0
                if ev.parent_block_hash:
                    try:
                        parent = index.get_request_key(ev.parent_block_hash)
                    except EngineKeyNotFoundError:
                        continue
                keys = tp.tokens_to_kv_block_keys(parent, ev.token_ids, MODEL)
                index.add(ev.block_hashes, keys, entry)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    index.evict(h, KeyType.ENGINE, entry)
    return time.perf_counter() - start


def sample_state(index: RedisIndex, keys: list[int]) -> list[list[PodEntry]]:
    return [sorted(index.lookup([k]).get(k, []), key=str) for k in keys]


def probe_keys(index: RedisIndex, work: Workload) -> list[int]:
    """Request keys of the last block of a sample of stored events, as the index maps them."""
    rng = random.Random(1)
    keys: list[int] = []
    for m in rng.sample(work.messages, min(200, len(work.messages))):
        for ev in decode_batch(m.payload).events:
            if isinstance(ev, BlockStored):
                with contextlib.suppress(EngineKeyNotFoundError):
                    keys.append(index.get_request_key(ev.block_hashes[-1]))
    return keys


def sample_run(
    client: redis.Redis, url: str, fn: Callable[[RedisIndex], float]
) -> tuple[Sample, RedisIndex]:
    """One run into a fresh namespace; the client is connected before counting starts."""
    index = RedisIndex(RedisIndexConfig(address=url, namespace=f"bench-{uuid.uuid4().hex[:8]}"))
    index.get_watermark("warm-up")
    before = server_usec(client)
    with RoundTrips() as trips:
        seconds = fn(index)
    return Sample(seconds, trips.count, (server_usec(client) - before) / 1e6), index


def compare(url: str, work: Workload, pods: int, rounds: int, json_path: str | None) -> int:
    """Run the three ways of ingesting ``work`` into the Redis at ``url`` and report them."""
    tp = ChunkedTokenDatabase()
    client = redis.Redis.from_url(url)
    runners: dict[str, Callable[[RedisIndex], float]] = {
        "per-event Index calls (llm-d pool)": lambda index: run_per_event(index, work, tp),
        "EventIngester, 1 thread": lambda index: run_ingester(index, work, tp, workers=1),
        "EventIngester, 4 workers": lambda index: run_ingester(index, work, tp, workers=4),
    }
    samples: dict[str, list[Sample]] = {name: [] for name in runners}
    try:
        print(
            f"workload: {len(work.messages)} batches from {pods} pods, {work.events} events, "
            f"{work.stored_blocks} stored blocks, {work.removed_blocks} removed blocks; "
            f"{rounds} alternating rounds"
        )
        probe: list[int] = []
        reference: list[list[PodEntry]] = []
        for r in range(rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                sample, index = sample_run(client, url, runners[name])
                samples[name].append(sample)
                if not probe:
                    probe = probe_keys(index, work)
                    reference = sample_state(index, probe)
                    mismatch = False
                else:
                    mismatch = sample_state(index, probe) != reference
                index.drop_namespace()  # leave nothing behind on a --url server
                index.close()
                if mismatch:
                    print(f"STATE MISMATCH: {name} differs from the first run")
                    return 1
        batches = len(work.messages)
        results = []
        base_seconds = statistics.median(x.seconds for x in samples[next(iter(runners))])
        for name, runs in samples.items():
            seconds = statistics.median(x.seconds for x in runs)
            results.append(
                Result(
                    name=name,
                    seconds=seconds,
                    blocks_per_s=work.stored_blocks / seconds,
                    ratio=base_seconds / seconds,
                    round_trips_per_batch=statistics.median(x.round_trips for x in runs) / batches,
                    server_seconds=statistics.median(x.server_seconds for x in runs),
                )
            )
        print(
            f"{'run':36} {'seconds':>8} {'blocks/s':>10} {'ratio':>6} {'trips/batch':>12} "
            f"{'server s':>9}"
        )
        for res in results:
            print(
                f"{res.name:36} {res.seconds:8.2f} {res.blocks_per_s:10.0f} {res.ratio:5.1f}x "
                f"{res.round_trips_per_batch:12.3f} {res.server_seconds:9.2f}"
            )
        batched, base = results[1], results[0]
        verdict = "ok" if batched.ratio >= TARGET_RATIO else "BELOW TARGET"
        print(
            f"batched / per-event (1 thread): {batched.ratio:.1f}x (target >= "
            f"{TARGET_RATIO:.0f}x: {verdict}); {batched.round_trips_per_batch:.3f} round trips "
            f"per batch, one more per stream at start (per-event: "
            f"{base.round_trips_per_batch:.1f}); index states agree on "
            f"{len(probe)} probed keys"
        )
        if json_path:
            write_json(json_path, [asdict(r) for r in results])
        return 0
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "a small workload (seconds)")
    parser.add_argument("--url", help="use this Redis instead of starting one")
    parser.add_argument("--pods", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="scheduler steps per pod")
    parser.add_argument("--rounds", type=int, default=None, help="alternating repetitions")
    args = parser.parse_args(argv)
    pods = args.pods or (2 if args.quick else 4)
    steps = args.steps or (60 if args.quick else 400)
    rounds = args.rounds or (2 if args.quick else 3)
    work = make_workload(pods, steps, capacity=600 if args.quick else 3000)
    with redis_server(args.url) as url:
        return compare(url, work, pods, rounds, args.json)


if __name__ == "__main__":
    sys.exit(main())

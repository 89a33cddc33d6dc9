"""A shard's slot resharded (as ``redis-cli --cluster reshard`` does it) while a mixed workload
runs, for the resharding tests and ``scripts/bench_cluster_reshard.py``.

:func:`reshard` moves one slot from a primary to another: ``CLUSTER SETSLOT`` IMPORTING on the
target and MIGRATING on the source (in either order), the slot's keys a few at a time with
``CLUSTER GETKEYSINSLOT`` + ``MIGRATE``, then ``SETSLOT NODE`` on every primary. :class:`Workload`
adds, evicts (by request and by engine key), batches, looks up and scores on one client, feeds
the same writes to an :class:`~kvredis.InMemoryIndex` and checks every answer against it; it
counts failed calls and wrong answers and times the longest call.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from kvredis import AddOp, EvictOp, InMemoryIndex, KeyType, PodEntry, Watermark
from kvredis.scoring import LongestPrefixScorer
from tests.servers import LocalCluster

PODS = tuple(PodEntry(f"pod-{i}", tier) for i in range(3) for tier in ("gpu", "cpu"))


def writer_pods(index: Any) -> tuple[PodEntry, ...]:
    """Pods of a writes-only workload sharing ``index`` with a mixed one: for each of
    :data:`PODS`, another pod on the same shard (the two clients write the same shards), so that
    the writer's evicts do not break the stamps of the pods the mixed workload reads (a lookup
    of several steps then keeps such a pod's entries only where its first step read them, which
    a model that does not see the writer cannot tell from a wrong answer)."""
    core = index.core
    names: dict[str, str] = {}
    for pod in dict.fromkeys(e.pod_identifier for e in PODS):
        shard = core.pod_shard(pod)
        names[pod] = next(
            name
            for name in (f"pod-w{n}" for n in range(10_000))
            if core.pod_shard(name) == shard and name not in names.values()
        )
    return tuple(PodEntry(names[e.pod_identifier], e.device_tier) for e in PODS)


def on(port: int, *args: Any) -> Any:
    """One command on one node (bytes replies: keys are binary)."""
    client = redis.Redis(port=port, socket_timeout=10)
    try:
        return client.execute_command(*args)
    finally:
        client.close()


def primaries(cluster: LocalCluster) -> list[int]:
    """The ports of the cluster's primaries."""
    return sorted(p for p, (role, _, _) in cluster.topology().items() if role == "master")


def reshard(
    cluster: LocalCluster,
    slot: int,
    source: int,
    target: int,
    importing_first: bool = True,
    per_migrate: int = 5,
    pause: float = 0.01,
) -> int:
    """Move ``slot`` from primary ``source`` to primary ``target``: :func:`begin_migration`,
    :func:`move_keys`, :func:`hand_over`. Returns the number of keys moved."""
    begin_migration(cluster, slot, source, target, importing_first, pause)
    moved = move_keys(slot, source, target, per_migrate, pause)
    hand_over(cluster, slot, source, target)
    return moved


def begin_migration(
    cluster: LocalCluster,
    slot: int,
    source: int,
    target: int,
    importing_first: bool = True,
    pause: float = 0.0,
) -> None:
    """SETSLOT IMPORTING on the target and MIGRATING on the source (``importing_first``: in
    this order, as redis-cli does; else the other way round), ``pause`` after each."""
    ids = {p: on(p, "CLUSTER", "MYID") for p in cluster.live_ports()}
    importing = (target, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
    migrating = (source, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
    for port, *args in (importing, migrating) if importing_first else (migrating, importing):
        on(port, *args)
        time.sleep(pause)  # the index runs with one side set only


def move_keys(slot: int, source: int, target: int, per_migrate: int = 5, pause: float = 0.0) -> int:
    """The slot's keys from source to target, ``per_migrate`` at a time (GETKEYSINSLOT +
    MIGRATE) with a ``pause`` in between; the number of keys moved."""
    moved = 0
    while True:
        keys = on(source, "CLUSTER", "GETKEYSINSLOT", slot, per_migrate)
        if not keys:
            return moved
        on(source, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
        time.sleep(pause)  # the index runs in between: some of the shard's keys moved, some not


def hand_over(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    """SETSLOT NODE target on the target, the source, then the other primaries."""
    target_id = on(target, "CLUSTER", "MYID")
    others = [p for p in primaries(cluster) if p not in (source, target)]
    for port in (target, source, *others):
        on(port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)


def owner(cluster: LocalCluster, slot: int) -> int:
    """The port of the primary serving ``slot`` (in the first primary's view)."""
    for port, (role, _, slots) in cluster.topology().items():
        if role != "master":
            continue
        for part in slots.split():
            first, _, last = part.partition("-")
            if int(first) <= slot <= int(last or first):
                return port
    raise LookupError(f"no primary serves slot {slot}")


@dataclass
class Outcome:
    """What a workload saw: calls made, calls that raised, answers unlike the model's, the
    longest call of each kind (seconds)."""

    calls: int = 0
    failed: int = 0
    mismatches: int = 0
    longest: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        slowest = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in sorted(self.longest.items()))
        return (
            f"{self.calls} calls, {self.failed} failed, {self.mismatches} mismatches; "
            f"longest: {slowest}"
        )


class Workload:
    """Adds, evicts, batches, lookups and scores on ``index``, each write also applied to an
    InMemoryIndex and each read compared with it (entries per key as sets: their order is no
    part of the contract). ``keys``: the request keys it uses (chains are runs of them);
    ``reads=False``: writes only (as an event ingester), checked by :meth:`check_all`.
    Workloads sharing an index need their own keys and ``stream``."""

    def __init__(
        self,
        index: Any,
        keys: Sequence[int],
        seed: int = 7,
        stream: str = "reshard",
        reads: bool = True,
        pods: Sequence[PodEntry] = PODS,
    ) -> None:
        self.index = index
        self.model = InMemoryIndex()
        self.keys = list(keys)
        self.rng = random.Random(seed)
        self.scorer = LongestPrefixScorer()
        self.outcome = Outcome()
        self.stream = stream
        self.reads = reads
        self.pods = tuple(pods)
        self.seq = 0
        #: engine keys added: (first engine key, its chain, the entry its add stored)
        self.engines: list[tuple[int, tuple[int, ...], PodEntry]] = []
        self.next_engine = (1 << 40) + (self.keys[0] << 20)

    def _call(self, kind: str, call: Callable[[Any], Any]) -> Any:
        began = time.monotonic()
        self.outcome.calls += 1
        try:
            return call(self.index)
        except Exception as exc:
            self.outcome.failed += 1
            self.outcome.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            return None
        finally:
            spent = time.monotonic() - began
            self.outcome.longest[kind] = max(self.outcome.longest.get(kind, 0.0), spent)

    def _write(self, kind: str, call: Callable[[Any], Any]) -> None:
        """A write on the index; the model takes it too (also when the index's call raised:
        a failed call may have applied, and sending it again is what a caller would do)."""
        self._call(kind, call)
        call(self.model)

    def _chain(self, length: int) -> list[int]:
        start = self.rng.randrange(len(self.keys))
        return [self.keys[(start + i) % len(self.keys)] for i in range(length)]

    def _check_lookup(self, chain: list[int], pods: list[str] | None = None) -> None:
        got = self._call("lookup", lambda ix: ix.lookup(chain, pods))
        want = self.model.lookup(chain, pods)
        if got is not None and _sets(got) != _sets(want):
            self.outcome.mismatches += 1
            self.outcome.errors.append(f"lookup {chain}: {got} != {want}")

    def _check_score(self, chain: list[int]) -> None:
        got = self._call("score", lambda ix: ix.score(chain))
        want = self.scorer.score(chain, self.model.lookup(chain))
        if got is not None and got != want:
            self.outcome.mismatches += 1
            self.outcome.errors.append(f"score {chain}: {got} != {want}")

    def step(self) -> None:
        """One round of every kind of call."""
        rng = self.rng
        chain = self._chain(rng.randrange(4, 12))
        entry = rng.choice(self.pods)
        engines = tuple(range(self.next_engine, self.next_engine + len(chain)))
        self.next_engine += len(chain)
        self.engines.append((engines[0], tuple(chain), entry))
        self._write("add", lambda ix: ix.add(list(engines), chain, [entry]))
        if self.reads:
            self._check_lookup(chain)
            self._check_score(chain)
        self.seq += 1
        seq = self.seq
        batch = [
            AddOp(None, tuple(self._chain(3)), (rng.choice(self.pods),)),
            EvictOp(rng.choice(self.keys), KeyType.REQUEST, (rng.choice(self.pods),)),
            AddOp(None, tuple(self._chain(2)), (rng.choice(self.pods),)),
        ]
        self._write("apply_batch", lambda ix: ix.apply_batch(batch, self.stream, Watermark(1, seq)))
        victim = rng.choice(self.keys)
        gone = rng.choice(self.pods)
        self._write("evict", lambda ix: ix.evict(victim, KeyType.REQUEST, [gone]))
        if len(self.engines) > 4 and rng.random() < 0.5:
            # an engine evicts what it stored: the entry of the add that mapped the engine key
            engine, _, stored = self.engines.pop(rng.randrange(len(self.engines)))
            self._write("evict", lambda ix: ix.evict(engine, KeyType.ENGINE, [stored]))
        if self.reads:
            self._check_lookup(self._chain(rng.randrange(1, 8)), [entry.pod_identifier])

    def check_all(self) -> None:
        """Compare every key on its own with the model (each a one-key lookup)."""
        for key in self.keys:
            self._check_lookup([key])


def _sets(found: dict[int, list[PodEntry]]) -> dict[int, frozenset[PodEntry]]:
    return {key: frozenset(entries) for key, entries in found.items()}


def run_during(
    workloads: Sequence[Workload], mover: Callable[[], object], least_steps: int = 3
) -> list[int]:
    """Run each workload in a thread of its own, step after step, while ``mover`` runs (and for
    at least ``least_steps`` steps each); the steps each ran."""
    moving = threading.Event()
    moving.set()
    steps = [0] * len(workloads)
    failures: list[BaseException] = []

    def loop(at: int) -> None:
        try:
            while moving.is_set() or steps[at] < least_steps:
                workloads[at].step()
                steps[at] += 1
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(workloads))]
    for thread in threads:
        thread.start()
    try:
        mover()
    finally:
        moving.clear()
        for thread in threads:
            thread.join(60)
    if failures:
        raise failures[0]
    return steps

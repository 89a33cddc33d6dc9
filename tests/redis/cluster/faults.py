"""A primary killed in the middle of a mixed workload, for the cluster fault test and
``scripts/bench_cluster_failover.py``.

Writer threads add chains of 64-512 blocks by engine key, evict the tails of their earlier
chains by engine key, and send event batches with watermarks; a reader thread looks chains up
and scores them. Each writer owns its pod and its keys and works in order, so what it was told
(every acknowledged write, and when its call started) says exactly what the index must hold at
the end. A primary is killed in the middle; the workload keeps going through the failover and
while the killed node comes back as a replica. Then every acknowledged write is checked against
the index: an add is lost when a block it stored (and nobody evicted) is missing, an evict when
the block it removed still holds the pod.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvredis import (
    AddOp,
    BackendUnavailableError,
    EvictOp,
    KeyType,
    PodEntry,
    RedisIndexConfig,
    Watermark,
)
from kvredis.redis.cluster.index import RedisClusterIndex
from tests.servers import LocalCluster


@dataclass
class Chain:
    """One chain a writer added: its keys, its pod, and how many tail blocks it evicted."""

    engine_keys: list[int]
    request_keys: list[int]
    pod: PodEntry
    started: float  # when the call that added it started (monotonic)
    evicts: list[tuple[int, float]] = field(default_factory=list)  # (block, call started)
    #: an evict of it failed (not acknowledged, maybe applied): it cannot be checked
    uncertain: bool = False


@dataclass
class Outcome:
    """What one fault run saw."""

    acknowledged: int = 0  # writes the index acknowledged (adds of chains, evicts of blocks)
    acknowledged_after: int = 0  # of those, started once the failover was over
    lost: int = 0  # acknowledged writes whose effect the index does not hold at the end
    lost_after: int = 0  # of those, started once the failover was over
    retried: int = 0  # BackendUnavailableError the workload caught and retried itself
    errors: list[str] = field(default_factory=list)  # anything else that escaped a call
    longest: float = 0.0  # the longest call, in seconds
    failover: float = 0.0  # seconds from the kill until a replica served the slots
    #: per lost write: (what, when its call started, in seconds relative to the kill)
    lost_writes: list[tuple[str, float]] = field(default_factory=list)
    calls: int = 0
    victim_pods: list[str] = field(default_factory=list)  # the pods the killed primary held
    at_risk: int = 0  # acknowledged writes of those pods (the others' shards never failed over)

    def line(self) -> str:
        return (
            f"lost {self.lost}/{self.acknowledged} acknowledged writes "
            f"({self.lost_after}/{self.acknowledged_after} started after the failover; "
            f"{self.at_risk} of pods on the killed primary: {', '.join(self.victim_pods)}); "
            f"{self.retried} retried by the workload, {len(self.errors)} errors; "
            f"longest call {self.longest:.2f} s, failover {self.failover:.1f} s, "
            f"{self.calls} calls"
        )


class _Workload:
    def __init__(self, index: RedisClusterIndex, seed: int, retry: bool) -> None:
        self.index = index
        self.retry = retry
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcome = Outcome()
        self.chains: list[Chain] = []
        self.rng = random.Random(seed)

    def call(self, fn: Callable[[], object]) -> bool:
        """Run one index call, retrying it on BackendUnavailableError when the workload
        retries (the same call again is safe: set operations and fenced batches); whether it
        was acknowledged."""
        while True:
            began = time.monotonic()
            try:
                fn()
            except BackendUnavailableError as exc:
                with self.lock:
                    self.outcome.retried += 1
                    if not self.retry:
                        self.outcome.errors.append(repr(exc))
                if self.retry and not self.stop.is_set():
                    continue
                return False
            except Exception as exc:
                with self.lock:
                    self.outcome.errors.append(repr(exc))
                return False
            finally:
                with self.lock:
                    self.outcome.longest = max(self.outcome.longest, time.monotonic() - began)
                    self.outcome.calls += 1
            return True

    def new_chain(self, rng: random.Random, pod: PodEntry, low: int, high: int) -> Chain:
        n = rng.randint(low, high)
        keys = [rng.getrandbits(63) | 1 for _ in range(2 * n)]
        return Chain(keys[:n], keys[n:], pod, time.monotonic())

    def tail(self, rng: random.Random, mine: list[Chain]) -> tuple[Chain, list[int]] | None:
        """A chain of ``mine`` and the next 1-8 blocks of its tail to evict."""
        if not mine:
            return None
        chain = rng.choice(mine)
        left = len(chain.request_keys) - len(chain.evicts)
        count = min(rng.randint(1, 8), left - 1)
        if count <= 0:
            return None
        return chain, [left - 1 - i for i in range(count)]

    def adder(self, number: int) -> None:
        rng = random.Random(self.rng.getrandbits(64))
        pod = PodEntry(f"pod-{number}", "gpu")
        mine: list[Chain] = []
        index = self.index
        while not self.stop.is_set():
            chain = self.new_chain(rng, pod, 64, 512)
            if not self.call(lambda c=chain: index.add(c.engine_keys, c.request_keys, [pod])):
                continue
            mine.append(chain)
            self.record(chain)
            picked = self.tail(rng, mine)
            if picked is None:
                continue
            target, blocks = picked
            for block in blocks:
                began = time.monotonic()
                key = target.engine_keys[block]
                if not self.call(lambda k=key: index.evict(k, KeyType.ENGINE, [pod])):
                    target.uncertain = True
                    break
                target.evicts.append((block, began))

    def batcher(self, number: int) -> None:
        rng = random.Random(self.rng.getrandbits(64))
        pod = PodEntry(f"pod-b{number}", "cpu")
        stream = f"stream-{number}"
        mine: list[Chain] = []
        seq = 0
        while not self.stop.is_set():
            chain = self.new_chain(rng, pod, 64, 128)
            ops: list[Any] = [AddOp(chain.engine_keys, chain.request_keys, (pod,))]
            picked = self.tail(rng, mine)
            if picked is not None:
                target, blocks = picked
                ops += [EvictOp(target.engine_keys[b], KeyType.ENGINE, (pod,)) for b in blocks]
            seq += 1
            mark = Watermark(1, seq)
            if not self.call(lambda o=ops, m=mark: self.index.apply_batch(o, stream, m)):
                if picked is not None:
                    picked[0].uncertain = True
                continue
            mine.append(chain)
            self.record(chain)
            if picked is not None:
                target.evicts += [(b, chain.started) for b in blocks]

    def reader(self) -> None:
        rng = random.Random(self.rng.getrandbits(64))
        while not self.stop.is_set():
            with self.lock:
                chain = rng.choice(self.chains) if self.chains else None
            if chain is None:
                time.sleep(0.01)
                continue
            keys = chain.request_keys
            self.call(lambda k=keys: self.index.lookup(k))
            self.call(lambda k=keys: self.index.score(k))

    def record(self, chain: Chain) -> None:
        with self.lock:
            self.chains.append(chain)


def _check(
    index: RedisClusterIndex, chains: list[Chain], kill: float, after: float, outcome: Outcome
) -> None:
    """Count the acknowledged writes and those whose effect the index lost."""
    for chain in chains:
        if chain.uncertain:
            continue
        late = chain.started >= after
        evicted = {block for block, _ in chain.evicts}
        kept = len(chain.request_keys) - len(evicted)
        found = index.lookup(chain.request_keys)
        held = sum(1 for key in chain.request_keys[:kept] if chain.pod in found.get(key, []))
        risky = chain.pod.pod_identifier in outcome.victim_pods
        outcome.acknowledged += 1
        outcome.acknowledged_after += late
        outcome.at_risk += risky
        if held < kept:
            outcome.lost += 1
            outcome.lost_after += late
            outcome.lost_writes.append(("add", chain.started - kill))
        for block, started in chain.evicts:
            late_evict = late and started >= after  # the chain too was added after it
            outcome.acknowledged += 1
            outcome.acknowledged_after += late_evict
            outcome.at_risk += risky
            key = chain.request_keys[block]
            if chain.pod in index.lookup([key]).get(key, []):
                outcome.lost += 1
                outcome.lost_after += late_evict
                outcome.lost_writes.append(("evict", started - kill))


def _primary_of(
    cluster: LocalCluster, index: RedisClusterIndex, pods: list[str]
) -> tuple[int, list[str]]:
    """The primary serving the shards of the most of the workload's ``pods`` (each pod's
    writes go to its shard's primary: a primary holding none of them would lose nothing), and
    the pods it serves."""
    core = index.core
    slot_map = core.cluster.slot_map
    assert slot_map is not None  # the workload's first calls fetched it
    held: dict[int, list[str]] = {}
    for pod in pods:
        held.setdefault(slot_map.primary(core.slots[core.pod_shard(pod)]).port, []).append(pod)
    view = cluster.topology()
    masters = {port for port, (role, _, _) in view.items() if role == "master"}
    victim = max(sorted(held), key=lambda port: (port in masters, len(held[port])))
    return victim, held[victim]


def _on(cluster: LocalCluster, port: int, *args: Any) -> Any:
    client = cluster.client(port)
    try:
        return client.execute_command(*args)
    finally:
        client.close()


def _cut_replication(cluster: LocalCluster, port: int) -> list[int]:
    """Cut the replication link of primary ``port`` and keep it down (its replicas now send a
    password it refuses); the replicas."""
    replicas = [p for p, (_, master, _) in cluster.topology().items() if master == port]
    for replica in replicas:
        _on(cluster, replica, "CONFIG", "SET", "masterauth", "kvredis-fault-cut")
    _on(cluster, port, "CLIENT", "KILL", "TYPE", "replica")
    return replicas


def fault_run(
    cluster: LocalCluster,
    *,
    before: float = 1.0,
    after: float = 1.0,
    retries: int = 12,
    retry_backoff: float = 0.05,
    wait_replicas: int = 0,
    workload_retries: bool = True,
    adders: int = 2,
    batchers: int = 1,
    seed: int = 0,
    lag: float = 0.0,
) -> Outcome:
    """Run the workload on ``cluster``, kill a primary after ``before`` seconds, bring it back
    once a replica took over, keep going ``after`` seconds more; check every acknowledged
    write. The killed node is revived even when the run fails.

    ``lag``: cut the primary's replication link that many seconds before the kill (its replica
    reconnects within a second): the writes the primary acknowledges meanwhile are what a
    replica lagging behind a crashing primary (a slow network, a stalled replica) loses. A
    plain kill on loopback loses next to nothing: a primary sends the replication stream out
    with its replies."""
    config = RedisIndexConfig(
        address=cluster.url,
        namespace=f"kvt-fault-{uuid.uuid4().hex[:10]}",
        retries=retries,
        retry_backoff=retry_backoff,
        socket_timeout=2.0,
        connect_timeout=1.0,
        cluster_wait_replicas=wait_replicas,
    )
    killed: int | None = None
    with RedisClusterIndex(config) as index:
        work = _Workload(index, seed, workload_retries)
        threads = [threading.Thread(target=work.adder, args=(i,)) for i in range(adders)]
        threads += [threading.Thread(target=work.batcher, args=(i,)) for i in range(batchers)]
        threads.append(threading.Thread(target=work.reader))
        for thread in threads:
            thread.start()
        try:
            time.sleep(before)
            pods = [f"pod-{i}" for i in range(adders)] + [f"pod-b{i}" for i in range(batchers)]
            victim, work.outcome.victim_pods = _primary_of(cluster, index, pods)
            cut = _cut_replication(cluster, victim) if lag else []
            time.sleep(lag)
            began = time.monotonic()
            killed, _ = cluster.kill_primary(victim)
            ended = time.monotonic()
            work.outcome.failover = ended - began
            for replica in cut:
                _on(cluster, replica, "CONFIG", "SET", "masterauth", "")
            cluster.revive(killed)
            killed = None
            time.sleep(after)
        finally:
            work.stop.set()
            for thread in threads:
                thread.join(60)
            if killed is not None:
                cluster.revive(killed)
        outcome = work.outcome
        with work.lock:
            chains = list(work.chains)
        _check(index, chains, began, ended, outcome)
        index.drop_namespace()
    return outcome

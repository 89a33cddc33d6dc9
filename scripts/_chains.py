"""Chain datasets the server-side benchmarks share, and their loaders.

A dataset is a set of *families*: each family is a shared prefix of ``prefix_blocks`` request
keys followed by ``tails_per_family`` tails of ``tail_blocks`` keys; every (prefix + tail) is
one *chain*, the request keys of a whole prompt. A family without tails is one chain, the
prefix alone. Every chain is held by a seeded choice of ``holders`` of the dataset's pods; a
family's prefix is held by the union of its chains' holders, as when the same system prompt is
cached on every pod that served one of its conversations.

The sets the server-side benchmarks use:

- :data:`TWENTY_K_CHAINS`: 1,000 families x 384-block prefix + 20 x 128-block tails = 20,000
  chains of 512 blocks, 8 pods, each chain on 1-3 pods; 2,944,000 distinct request keys.
- :data:`HOT_CHAIN`: one 512-block chain held by 4 pods (2 on gpu, 2 on cpu).
- :func:`random_keys`: ``blocks`` random keys as unrelated 512-block chains over ``pods`` pods.

``spec.scaled(f)`` keeps the shape and scales the number of families (``--quick`` runs use
1/20). Everything is derived from ``spec.seed``: the same spec gives the same keys, holders and
events in every process, so a worker process rebuilds the dataset instead of receiving it.

Engine keys are a fixed bijection of the request keys (:func:`engine_key`), so every request key
has its own engine key, mapped 1:1 as vLLM's block hashes are.

The state to load is given two ways: :meth:`Dataset.runs`, each run of keys with all the pods
holding it, and :meth:`Dataset.events`, the writes as engines report them, one event per (pod,
chain) the pod holds (the whole chain for the first chain of a family on that pod, the tail for
the next ones). Both end in the same (request key, pod) entries. The loaders:

- :func:`load_kvredis`: through the public API, ``AddOp`` batches in ``apply_batch`` (one op
  per run, or with ``per_event`` one per event; a single server or a cluster), spread over
  worker processes.
- :func:`load_reference`: the Go layout of ``reference_layout.py``, pipelined over raw sockets:
  one HSET per request key with a field per holding pod, one ZADD per engine key.

Both take ``with_engine_keys=False`` to leave out the engine-to-request mappings, which no lookup
or score reads and which take about half the load time.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from kvredis.batch import AddOp
from kvredis.redis import RedisIndexConfig, new_redis_index
from kvredis.types import PodEntry

from reference_layout import ENGINE_PREFIX, RespConnection, encode_field

__all__ = [
    "HOT_CHAIN",
    "TWENTY_K_CHAINS",
    "WEIGHTS",
    "ChainSpec",
    "Dataset",
    "Event",
    "LoadStats",
    "build",
    "engine_key",
    "load_kvredis",
    "load_reference",
    "pod_entries",
    "random_keys",
    "reference_commands",
]

#: Medium weights the benchmarks score with (pods are on gpu or cpu).
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}

_MASK = (1 << 64) - 1
_ENGINE_MUL = 0x9E3779B97F4A7C15  # odd: multiplication mod 2**64 is a bijection
_ENGINE_ADD = 0x632BE59BD9B4E019


@dataclass(frozen=True, slots=True)
class ChainSpec:
    """The shape of a chain dataset (see the module docstring)."""

    name: str
    families: int
    prefix_blocks: int
    tails_per_family: int
    tail_blocks: int
    pods: int
    #: each chain is held by between holders[0] and holders[1] pods (inclusive), chosen at random
    holders: tuple[int, int]
    seed: int = 1

    def __post_init__(self) -> None:
        lo, hi = self.holders
        if self.families < 1 or self.prefix_blocks < 1 or self.pods < 1:
            raise ValueError(f"{self.name}: families, prefix_blocks and pods must be >= 1")
        if self.tails_per_family < 0 or (self.tails_per_family and self.tail_blocks < 1):
            raise ValueError(f"{self.name}: tails need tail_blocks >= 1")
        if not 1 <= lo <= hi <= self.pods:
            raise ValueError(f"{self.name}: holders must satisfy 1 <= lo <= hi <= pods")

    @property
    def chain_blocks(self) -> int:
        """Request keys per chain."""
        return self.prefix_blocks + (self.tail_blocks if self.tails_per_family else 0)

    @property
    def chains(self) -> int:
        """Number of chains."""
        return self.families * max(1, self.tails_per_family)

    @property
    def distinct_keys(self) -> int:
        """Number of distinct request keys."""
        return self.families * (self.prefix_blocks + self.tails_per_family * self.tail_blocks)

    def scaled(self, factor: float) -> ChainSpec:
        """The same shape with ``factor`` times the families (at least one)."""
        return replace(self, families=max(1, round(self.families * factor)))


TWENTY_K_CHAINS = ChainSpec("20k chains", 1000, 384, 20, 128, pods=8, holders=(1, 3))
HOT_CHAIN = ChainSpec("hot chain", 1, 512, 0, 0, pods=4, holders=(4, 4))


def random_keys(
    blocks: int, pods: int, holders: tuple[int, int] | None = None, chain_blocks: int = 512,
    seed: int = 1,
) -> ChainSpec:
    """``blocks`` random request keys as unrelated chains of ``chain_blocks`` keys over ``pods``
    pods, each chain held by ``holders`` pods (default: all of them)."""
    lo_hi = holders if holders is not None else (pods, pods)
    return ChainSpec(
        f"random {blocks:,} blocks, {pods} pods",
        max(1, blocks // chain_blocks), chain_blocks, 0, 0, pods, lo_hi, seed,
    )


def pod_entries(pods: int) -> tuple[PodEntry, ...]:
    """The pods of a dataset: ``pod-0 .. pod-{n-1}``, the first half on gpu, the rest on cpu."""
    gpus = (pods + 1) // 2
    return tuple(PodEntry(f"pod-{i}", "gpu" if i < gpus else "cpu") for i in range(pods))


def engine_key(request_key: int) -> int:
    """The engine key of a request key (a fixed bijection of 64-bit integers)."""
    return (request_key * _ENGINE_MUL + _ENGINE_ADD) & _MASK


@dataclass(frozen=True, slots=True)
class Event:
    """One write as an engine reports it: ``pod`` (an index into ``Dataset.pods``) stored these
    request keys (and their engine keys, :func:`engine_key`)."""

    pod: int
    request_keys: list[int]

    @property
    def engine_keys(self) -> list[int]:
        return [engine_key(k) for k in self.request_keys]


class Dataset:
    """A built :class:`ChainSpec`: its keys, who holds which chain, and its events.

    Chain ``c`` belongs to family ``c // tails`` (``tails = max(1, tails_per_family)``) and has
    tail ``c % tails``.
    """

    def __init__(self, spec: ChainSpec) -> None:
        self.spec = spec
        self.pods = pod_entries(spec.pods)
        rng = random.Random(spec.seed)
        tails = spec.tails_per_family
        per_family = spec.prefix_blocks + tails * spec.tail_blocks
        keys = array("Q")
        keys.frombytes(rng.randbytes(8 * spec.families * per_family))
        self._keys = keys
        self._per_family = per_family
        self.holders: list[tuple[int, ...]] = []
        lo, hi = spec.holders
        for _ in range(spec.chains):
            self.holders.append(tuple(sorted(rng.sample(range(spec.pods), rng.randint(lo, hi)))))

    @property
    def chains(self) -> int:
        """Number of chains."""
        return self.spec.chains

    def _family_of(self, chain: int) -> tuple[int, int]:
        tails = max(1, self.spec.tails_per_family)
        return divmod(chain, tails)

    def prefix(self, family: int) -> list[int]:
        """The shared prefix of a family."""
        start = family * self._per_family
        return self._keys[start : start + self.spec.prefix_blocks].tolist()

    def tail(self, family: int, tail: int) -> list[int]:
        """Tail ``tail`` of a family (empty for a family without tails)."""
        if not self.spec.tails_per_family:
            return []
        start = family * self._per_family + self.spec.prefix_blocks + tail * self.spec.tail_blocks
        return self._keys[start : start + self.spec.tail_blocks].tolist()

    def chain(self, chain: int) -> list[int]:
        """The request keys of a whole chain, in order."""
        family, tail = self._family_of(chain)
        return self.prefix(family) + self.tail(family, tail)

    def family_holders(self, family: int) -> tuple[int, ...]:
        """The pods holding a family's prefix: the union of its chains' holders."""
        tails = max(1, self.spec.tails_per_family)
        union: set[int] = set()
        for c in range(family * tails, (family + 1) * tails):
            union.update(self.holders[c])
        return tuple(sorted(union))

    def random_chains(self, rng: random.Random, n: int) -> list[list[int]]:
        """``n`` whole chains picked uniformly at random (with repetition)."""
        return [self.chain(rng.randrange(self.chains)) for _ in range(n)]

    def distinct_keys(self) -> int:
        """Number of distinct request keys."""
        return len(self._keys)

    def entries(self) -> int:
        """Number of (request key, pod) entries of the loaded state."""
        spec = self.spec
        total = 0
        tails = max(1, spec.tails_per_family)
        for family in range(spec.families):
            total += spec.prefix_blocks * len(self.family_holders(family))
            if spec.tails_per_family:
                for c in range(family * tails, (family + 1) * tails):
                    total += spec.tail_blocks * len(self.holders[c])
        return total

    def runs(self, part: int = 0, parts: int = 1) -> Iterator[tuple[list[int], tuple[int, ...]]]:
        """The loaded state as (request keys, holding pods) runs: each family's prefix with the
        union of its chains' holders, then each tail with its chain's holders. ``part``/``parts``
        select every ``parts``-th family (for worker processes)."""
        tails = max(1, self.spec.tails_per_family)
        for family in range(part, self.spec.families, parts):
            yield self.prefix(family), self.family_holders(family)
            if self.spec.tails_per_family:
                for t in range(tails):
                    yield self.tail(family, t), self.holders[family * tails + t]

    def events(self, part: int = 0, parts: int = 1) -> Iterator[Event]:
        """The writes of every pod, as an engine emits them: for each (pod, family) the first
        chain the pod holds comes as one event of the whole chain, each further chain as an
        event of its tail. ``part``/``parts`` select every ``parts``-th family."""
        tails = max(1, self.spec.tails_per_family)
        for family in range(part, self.spec.families, parts):
            prefix = self.prefix(family)
            for pod in range(self.spec.pods):
                first = True
                for t in range(tails):
                    if pod not in self.holders[family * tails + t]:
                        continue
                    tail = self.tail(family, t)
                    yield Event(pod, prefix + tail if first else tail)
                    first = False


def build(spec: ChainSpec) -> Dataset:
    """The dataset of ``spec``."""
    return Dataset(spec)


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a loader wrote and how long it took."""

    keys: int
    entries: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _KvOptions:
    batch_entries: int
    per_event: bool
    with_engine_keys: bool


def _kvredis_ops(
    data: Dataset, part: int, parts: int, per_event: bool, with_engine_keys: bool
) -> Iterator[AddOp]:
    if per_event:
        for event in data.events(part, parts):
            engine = tuple(event.engine_keys) if with_engine_keys else None
            yield AddOp(engine, tuple(event.request_keys), (data.pods[event.pod],))
        return
    for keys, holders in data.runs(part, parts):
        engine = tuple(engine_key(k) for k in keys) if with_engine_keys else None
        yield AddOp(engine, tuple(keys), tuple(data.pods[h] for h in holders))


def _load_kvredis_part(
    spec: ChainSpec, config: RedisIndexConfig, part: int, parts: int, options: _KvOptions
) -> int:
    data = Dataset(spec)
    written = 0
    with new_redis_index(config) as index:
        ops: list[AddOp] = []
        size = 0
        for op in _kvredis_ops(data, part, parts, options.per_event, options.with_engine_keys):
            ops.append(op)
            size += len(op.request_keys) * len(op.entries)
            if size >= options.batch_entries:
                index.apply_batch(ops)
                written += size
                ops, size = [], 0
        if ops:
            index.apply_batch(ops)
            written += size
    return written


def _in_parts(processes: int, work: Callable[..., int], *args: object) -> int:
    """``work(*args, part, parts)`` summed over ``processes`` forked workers (or run here)."""
    if processes <= 1:
        return work(*args, 0, 1)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(processes) as pool:
        return sum(pool.starmap(work, [(*args, p, processes) for p in range(processes)]))


def _kvredis_worker(
    spec: ChainSpec, config: RedisIndexConfig, options: _KvOptions, part: int, parts: int
) -> int:
    return _load_kvredis_part(spec, config, part, parts, options)


def load_kvredis(
    config: RedisIndexConfig,
    data: Dataset,
    *,
    processes: int = 2,
    batch_entries: int = 4096,
    per_event: bool = False,
    with_engine_keys: bool = True,
) -> LoadStats:
    """Write ``data`` into the kvredis index of ``config`` (a single server or a cluster)
    through ``apply_batch``
    (about ``batch_entries`` (request key, entry) pairs per batch), families spread over
    ``processes`` forked worker processes, each rebuilding the dataset from its spec.

    By default each op is one of :meth:`Dataset.runs`: a run of keys with all the pods holding
    it, the state an ingester reaches. ``per_event`` replays :meth:`Dataset.events` instead, one
    op per pod as the engines report it: the same final state at about four times the server
    CPU (too slow for the full 20k-chain set within a minute). ``with_engine_keys`` also maps
    every request key's engine key (:func:`engine_key`), as events do.
    """
    start = time.perf_counter()
    options = _KvOptions(batch_entries, per_event, with_engine_keys)
    written = _in_parts(processes, _kvredis_worker, data.spec, config, options)
    return LoadStats(data.distinct_keys(), written, time.perf_counter() - start)


def reference_commands(
    data: Dataset, with_engine_keys: bool = True, part: int = 0, parts: int = 1
) -> Iterator[bytes]:
    """The commands that write ``data`` (every ``parts``-th family from ``part``) in the
    reference layout, RESP-encoded: per request key one HSET with a field per holding pod, and
    one ZADD mapping its engine key."""
    fields = [encode_field(p).encode() for p in data.pods]
    pairs = [b"$%d\r\n%b\r\n$0\r\n\r\n" % (len(f), f) for f in fields]  # field, ""
    suffixes: dict[tuple[int, ...], tuple[bytes, bytes]] = {}
    for keys, holders in data.runs(part, parts):
        if holders not in suffixes:
            body = b"".join(pairs[h] for h in holders)
            suffixes[holders] = (b"*%d\r\n$4\r\nHSET\r\n" % (2 + 2 * len(holders)), body)
        head, body = suffixes[holders]
        for k in keys:
            name = b"%d" % k
            yield b"%b$%d\r\n%b\r\n%b" % (head, len(name), name, body)
            if with_engine_keys:
                zset = b"%b%d" % (ENGINE_PREFIX.encode(), engine_key(k))
                yield b"*4\r\n$4\r\nZADD\r\n$%d\r\n%b\r\n$1\r\n0\r\n$%d\r\n%b\r\n" % (
                    len(zset), zset, len(name), name,
                )


def _reference_worker(
    spec: ChainSpec, host: str, port: int, db: int, with_engine_keys: bool, pipeline: int,
    part: int, parts: int,
) -> int:
    data = Dataset(spec)
    conn = RespConnection(host, port, db)
    sent = 0
    try:
        batch: list[bytes] = []
        for command in reference_commands(data, with_engine_keys, part, parts):
            batch.append(command)
            if len(batch) >= pipeline:
                conn.pipeline(batch)
                sent += len(batch)
                batch = []
        if batch:
            conn.pipeline(batch)
            sent += len(batch)
    finally:
        conn.close()
    return sent


def load_reference(
    host: str,
    port: int,
    db: int,
    data: Dataset,
    *,
    processes: int = 2,
    with_engine_keys: bool = True,
    pipeline: int = 10_000,
) -> LoadStats:
    """Write ``data`` in the reference layout into database ``db`` (which should be empty),
    ``pipeline`` commands per round trip over raw sockets, families spread over ``processes``
    forked workers. The state is what the reference's ``add`` leaves after every event."""
    start = time.perf_counter()
    _in_parts(processes, _reference_worker, data.spec, host, port, db, with_engine_keys, pipeline)
    return LoadStats(data.distinct_keys(), data.entries(), time.perf_counter() - start)

"""The routing demo: a simulated fleet of pods serving a synthetic chat workload.

Several shared system prompts and many multi-turn conversations produce requests whose token
prefixes overlap. Each pod keeps an LRU prefix cache of KV blocks on a GPU tier that spills to a
CPU tier, and reports what it stores and evicts to the shared index (engine keys mapped to
request keys, as an engine's KV events would). Each router sends every request to one pod; the
pod's own cache decides how many prompt tokens it can skip. The index-aware router asks the
:class:`~kvredis.indexer.Indexer` for per-pod prefix scores, the baseline picks a pod at random.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvredis.batch import AddOp, EvictOp, IndexOp
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.index import BatchIndex, Closeable, Index, apply_op
from kvredis.indexer import Indexer
from kvredis.types import KeyType, PodEntry

GPU = "gpu"
CPU = "cpu"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Shape of the synthetic workload and fleet."""

    pods: int = 8
    system_prompts: int = 16
    system_prompt_tokens: int = 1024
    conversations: int = 200
    turns: int = 6
    user_tokens: int = 96
    reply_tokens: int = 160
    gpu_blocks_per_pod: int = 400
    cpu_blocks_per_pod: int = 400
    block_size: int = 16
    model: str = "demo/llama-3-8b"
    seed: int = 7


@dataclass(frozen=True, slots=True)
class Request:
    """One chat turn: the full prompt and the reply the pod generates."""

    conversation: int
    prompt: tuple[int, ...]
    reply: tuple[int, ...]


def generate_requests(cfg: WorkloadConfig) -> list[Request]:
    """Interleaved multi-turn conversations over a few shared system prompts (deterministic)."""
    rng = random.Random(cfg.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, 128_000) for _ in range(n))

    systems = [tokens(cfg.system_prompt_tokens) for _ in range(cfg.system_prompts)]
    histories: list[tuple[int, ...]] = [
        systems[rng.randrange(cfg.system_prompts)] for _ in range(cfg.conversations)
    ]
    pending = [cfg.turns] * cfg.conversations
    requests: list[Request] = []
    live = list(range(cfg.conversations))
    while live:
        conv = rng.choice(live)
        prompt = histories[conv] + tokens(rng.randint(cfg.user_tokens // 2, cfg.user_tokens))
        reply = tokens(rng.randint(cfg.reply_tokens // 2, cfg.reply_tokens))
        requests.append(Request(conv, prompt, reply))
        histories[conv] = prompt + reply
        pending[conv] -= 1
        if pending[conv] == 0:
            live.remove(conv)
    return requests


@dataclass
class SimulatedPod:
    """A pod's prefix cache: GPU LRU spilling into a CPU LRU, reporting changes to the index."""

    name: str
    index: Index
    gpu_capacity: int
    cpu_capacity: int
    gpu: OrderedDict[int, int] = field(default_factory=OrderedDict)
    cpu: OrderedDict[int, int] = field(default_factory=OrderedDict)

    def cached_prefix_blocks(self, request_keys: list[int]) -> int:
        """How many leading blocks this pod holds on any tier (what the engine can skip)."""
        n = 0
        for key in request_keys:
            if key not in self.gpu and key not in self.cpu:
                break
            n += 1
        return n

    def store(self, request_keys: list[int]) -> None:
        """Serve a sequence: every block ends up on the GPU tier, most recently used.

        What changed is reported the way an engine does, as one event batch per step: a single
        ``apply_batch`` call on a :class:`~kvredis.index.BatchIndex` (one op at a time otherwise).
        """
        gpu, cpu = PodEntry(self.name, GPU), PodEntry(self.name, CPU)
        ops: list[IndexOp] = []
        new_engine: list[int] = []
        new_request: list[int] = []
        for key in request_keys:
            if key in self.gpu:
                self.gpu.move_to_end(key)
                continue
            engine_key = self.cpu.pop(key, None)
            if engine_key is not None:
                ops.append(EvictOp(engine_key, KeyType.ENGINE, (cpu,)))
            else:
                engine_key = _engine_key(self.name, key)
            self.gpu[key] = engine_key
            new_engine.append(engine_key)
            new_request.append(key)
        if new_request:
            ops.append(AddOp(tuple(new_engine), tuple(new_request), (gpu,)))
        while len(self.gpu) > self.gpu_capacity:
            key, engine_key = self.gpu.popitem(last=False)
            ops.append(EvictOp(engine_key, KeyType.ENGINE, (gpu,)))
            self.cpu[key] = engine_key
            ops.append(AddOp((engine_key,), (key,), (cpu,)))
        while len(self.cpu) > self.cpu_capacity:
            _key, engine_key = self.cpu.popitem(last=False)
            ops.append(EvictOp(engine_key, KeyType.ENGINE, (cpu,)))
        if not ops:
            return
        if isinstance(self.index, BatchIndex):
            self.index.apply_batch(ops)
            return
        for op in ops:
            apply_op(self.index, op)


def _engine_key(pod: str, request_key: int) -> int:
    """A stand-in for the engine's own block hash (differs from the request key, like vLLM's)."""
    h = (request_key ^ 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    return (h ^ (h >> 31) ^ sum(pod.encode())) & 0xFFFFFFFFFFFFFFFF or 1


@dataclass(frozen=True, slots=True)
class RouterResult:
    """What one router achieved over the whole workload."""

    router: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    max_pod_share: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


Router = Callable[[Indexer, list[str], tuple[int, ...], dict[str, int], random.Random], str]


def route_random(
    indexer: Indexer,
    pods: list[str],
    prompt: tuple[int, ...],
    load: dict[str, int],
    rng: random.Random,
) -> str:
    """The baseline: any pod, uniformly."""
    return rng.choice(pods)


def route_by_prefix(
    indexer: Indexer,
    pods: list[str],
    prompt: tuple[int, ...],
    load: dict[str, int],
    rng: random.Random,
    model: str,
) -> str:
    """Highest prefix score wins; ties (and cold prompts) go to the least-loaded pod."""
    scores = indexer.score_tokens(list(prompt), model)
    best = max(scores.values(), default=0.0)
    candidates = [p for p in pods if scores.get(p, 0.0) == best] if best > 0 else pods
    least = min(load[p] for p in candidates)
    return rng.choice([p for p in candidates if load[p] == least])


def simulate(
    cfg: WorkloadConfig,
    requests: list[Request],
    index: Index,
    router_name: str,
    router: Router,
    on_request: Callable[[], None] | None = None,
) -> RouterResult:
    """Replay the workload on a fresh fleet backed by ``index`` with the given router."""
    processor = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=cfg.block_size))
    indexer = Indexer(index, processor)
    pods = [f"pod-{i}" for i in range(cfg.pods)]
    fleet = {
        p: SimulatedPod(p, index, cfg.gpu_blocks_per_pod, cfg.cpu_blocks_per_pod) for p in pods
    }
    load = dict.fromkeys(pods, 0)
    rng = random.Random(cfg.seed + 1)
    prompt_tokens = hit_tokens = 0
    for req in requests:
        pod = router(indexer, pods, req.prompt, load, rng)
        load[pod] += 1
        keys = indexer.compute_block_keys(list(req.prompt), cfg.model)
        hit_tokens += fleet[pod].cached_prefix_blocks(keys) * cfg.block_size
        prompt_tokens += len(req.prompt)
        full = indexer.compute_block_keys(list(req.prompt + req.reply), cfg.model)
        fleet[pod].store(full)
        if on_request is not None:
            on_request()
    for pod in pods:
        index.clear(pod)
    return RouterResult(
        router_name, len(requests), prompt_tokens, hit_tokens, max(load.values()) / len(requests)
    )


def routers(cfg: WorkloadConfig) -> list[tuple[str, Router]]:
    """The routers the demo compares, baseline first."""

    def by_prefix(
        indexer: Indexer,
        pods: list[str],
        prompt: tuple[int, ...],
        load: dict[str, int],
        rng: random.Random,
    ) -> str:
        return route_by_prefix(indexer, pods, prompt, load, rng, cfg.model)

    return [("random", route_random), ("kvredis", by_prefix)]


def run_demo(cfg: WorkloadConfig, make_index: Callable[[str], Index]) -> list[RouterResult]:
    """Run every router over the same workload, each on a fresh index from ``make_index``."""
    requests = generate_requests(cfg)
    results = []
    for name, router in routers(cfg):
        index = make_index(name)
        try:
            results.append(simulate(cfg, requests, index, name, router))
        finally:
            if isinstance(index, Closeable):
                index.close()
    return results

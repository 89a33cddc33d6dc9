"""The embedded indexes with runs (keys one add stores together) against a plain model: random
chains added whole, in pieces, pod by pod and with engine keys, evicted mid-run, re-added,
cleared, expiring, bounded by key counts and by bytes. After every operation the index must hold
exactly the model's entries (in the order they were added), drop keys in exactly the model's
least-recently-used order, map engine keys as the model does, and keep its internals consistent
(``tests/memory_state.py``)."""

from __future__ import annotations

import random
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import pytest

from kvredis.batch import AddOp
from kvredis.checks import MAX_REQUEST_KEYS_PER_ENGINE_KEY, infer_mappings
from kvredis.errors import EngineKeyNotFoundError
from kvredis.memory import (
    CostAwareMemoryIndex,
    CostAwareMemoryIndexConfig,
    InMemoryIndex,
    InMemoryIndexConfig,
)
from kvredis.memory import index as memory_index
from kvredis.memory import recency as memory_recency
from kvredis.memory.runs import RUN_MAX, RUN_MIN, span, span_at
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType, PodEntry
from tests import memory_state

WEIGHTS = [None, {"gpu": 1.0, "cpu": 0.25}]


class Model:
    """The contract of an embedded index, written as plainly as possible."""

    def __init__(self, size: int | None, cap: int | None) -> None:
        self.size, self.cap = size, cap
        # request key -> entry -> deadline (None: does not expire), both in LRU order
        self.keys: OrderedDict[int, OrderedDict[PodEntry, float | None]] = OrderedDict()
        self.engine: OrderedDict[int, list[int]] = OrderedDict()

    def expire(self, now: float) -> None:
        for key in list(self.keys):
            held = self.keys[key]
            for entry in [e for e, d in held.items() if d is not None and d <= now]:
                del held[entry]
            if not held:
                del self.keys[key]

    def add(
        self, eng: list[int] | None, req: list[int], ents: list[PodEntry], ttl: float | None,
        now: float,
    ) -> None:  # fmt: skip
        unique = list(dict.fromkeys(ents))
        if self.cap is not None:
            unique = unique[-self.cap :]
        confirmed = {e.pod_identifier for e in unique if not e.speculative}
        for key in req:
            held = self.keys.get(key)
            if held is None:
                held = self.keys[key] = OrderedDict()
            self.keys.move_to_end(key)
            for entry in [e for e, d in held.items() if d is not None]:
                if entry.pod_identifier in confirmed:
                    del held[entry]
            for entry in unique:
                held.pop(entry, None)
                held[entry] = None if ttl is None else now + ttl
            while self.cap is not None and len(held) > self.cap:
                held.popitem(last=False)
        if eng:
            pairs = zip(eng, req, strict=True) if len(eng) == len(req) else infer_mappings(eng, req)
            for engine_key, request_key in pairs:
                refs = self.engine.get(engine_key)
                if refs is None:
                    self.engine[engine_key] = [request_key]
                    continue
                self.engine.move_to_end(engine_key)
                if refs[-1] != request_key:
                    if request_key in refs:
                        refs.remove(request_key)
                    elif len(refs) >= MAX_REQUEST_KEYS_PER_ENGINE_KEY:
                        refs.pop(0)
                    refs.append(request_key)
        self.shrink()

    def shrink(self) -> None:
        if self.size is not None:
            while len(self.keys) > self.size:
                self.keys.popitem(last=False)
            while len(self.engine) > self.size:
                self.engine.popitem(last=False)

    def remove(self, key: int, ents: list[PodEntry]) -> None:
        held = self.keys.get(key)
        if held is not None:
            for entry in ents:
                held.pop(entry, None)
            if not held:
                del self.keys[key]

    def evict(self, key: int, key_type: KeyType, ents: list[PodEntry]) -> None:
        if key_type is KeyType.REQUEST:
            self.remove(key, ents)
            return
        refs = self.engine.get(key)
        if refs is None:
            return
        for request_key in refs:
            self.remove(request_key, ents)
        if not any(r in self.keys for r in refs):
            del self.engine[key]

    def clear(self, pod: str, tiers: set[str] | None = None, rank: int | None = None) -> int:
        removed = 0
        for key in list(self.keys):
            held = self.keys[key]
            for entry in list(held):
                if (
                    entry.pod_identifier == pod
                    and (tiers is None or entry.device_tier in tiers)
                    and (rank is None or entry.dp_rank == rank)
                ):
                    del held[entry]
                    removed += 1
            if not held:
                del self.keys[key]
        for engine_key in [
            e for e, refs in self.engine.items() if not any(r in self.keys for r in refs)
        ]:
            del self.engine[engine_key]
        return removed

    def walk(self, keys: list[int], pods: set[str] | None) -> dict[int, list[PodEntry]]:
        out = {}
        for key in keys:
            held = [e for e in self.keys.get(key, ()) if pods is None or e.pod_identifier in pods]
            if not held:
                break
            out[key] = held
        return out

    def use(self, keys: list[int]) -> None:
        for key in keys:
            self.keys.move_to_end(key)


def raced(keys: list[int], found: dict[int, list[PodEntry]]) -> int:
    """How many keys a score walks: while some (pod, rank) holds every key so far."""
    racers: set[tuple[str, int]] | None = None
    walked = 0
    for key in keys:
        here = {(e.pod_identifier, e.dp_rank) for e in found.get(key, ())}
        racers = here if racers is None else racers & here
        if not racers:
            break
        walked += 1
    return walked


def compare(index: Any, model: Model, *, order: bool) -> None:
    memory_state.check(index)
    held = memory_state.held_keys(index)
    want = {k: tuple(v) for k, v in model.keys.items()}
    assert held == want
    assert memory_state.engine_map(index) == {k: tuple(v) for k, v in model.engine.items()}
    if order:
        assert memory_state.key_order(index) == list(model.keys)
        assert memory_state.engine_order(index) == list(model.engine)


def sync_dropped(index: Any, model: Model) -> None:
    """A byte-bounded index drops least recently used keys until it fits: whatever it dropped
    must be the oldest keys of the model's order (request keys and engine keys apart)."""
    held = memory_state.held_keys(index)
    dropped = [k for k in model.keys if k not in held]
    assert dropped == list(model.keys)[: len(dropped)], "dropped keys that were not the oldest"
    for key in dropped:
        del model.keys[key]
    engine = memory_state.engine_map(index)
    gone = [k for k in model.engine if k not in engine]
    assert gone == list(model.engine)[: len(gone)], "dropped engine keys that were not the oldest"
    for key in gone:
        del model.engine[key]


def run_workload(
    seed: int, make: Any, model: Model, *, bytes_bound: bool, monkeypatch: Any
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(memory_index, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    rng = random.Random(seed)
    index = make()
    chains = [[rng.getrandbits(64) for _ in range(48)] for _ in range(3)]
    chains.append([rng.randrange(4) + 10 * c for c in range(12)])  # small keys, non-chaining
    engine_of = {k: k ^ 0x5DEECE66D for chain in chains for k in chain}
    pods = ["pod-0", "pod-1", "pod-2"]

    def entry(speculative: bool = False) -> PodEntry:
        return PodEntry(
            rng.choice(pods), rng.choice(["gpu", "cpu"]), speculative=speculative,
            dp_rank=rng.choice([0, 0, 1]),
        )  # fmt: skip

    made_runs = 0
    for step in range(250):
        where = f"seed {seed}, step {step}"
        chain = rng.choice(chains)
        start = 0 if rng.random() < 0.6 else rng.randrange(len(chain))
        keys = chain[start : rng.randint(start + 1, len(chain))]
        if start and rng.random() < 0.2:
            keys = keys[: rng.randint(1, 3)]  # a decode step's block or two
        if rng.random() < 0.15:
            keys = rng.sample(chain, min(len(chain), rng.randint(1, 12)))  # out of order
        elif rng.random() < 0.1:
            keys = keys + keys[: rng.randint(1, 3)]  # repeated keys
        action = rng.random()
        model.expire(clock[0])
        if action < 0.45:
            ttl = None
            if rng.random() < 0.15:
                entries, ttl = [entry(True)], rng.choice([0.5, 3.0])
            else:
                entries = [entry() for _ in range(rng.choice([1, 1, 2]))]
            shape = rng.random()
            if shape < 0.5:
                eng = [engine_of[k] for k in keys]
            elif shape < 0.6:
                eng = [engine_of[k] for k in keys[: max(1, len(keys) // 3)]]  # many to one
            elif shape < 0.65:
                eng = [rng.choice(list(engine_of.values()))]
            else:
                eng = None
            if ttl is None and rng.random() < 0.3:  # as an ingester writes: tuples, in a batch
                parent = None
                if rng.random() < 0.6 and start and keys == chain[start : start + len(keys)]:
                    parent = chain[start - 1]  # an append to the chain (a block or a few)
                op = AddOp(None if eng is None else tuple(eng), tuple(keys), tuple(entries), parent)
                assert index.apply_batch([op])
            else:
                index.add(eng, keys, entries, ttl=ttl)
            model.add(eng, keys, entries, ttl, clock[0])
        elif action < 0.52:  # the next blocks of a chain, naming their parent
            held = [n for n, k in enumerate(chain) if k in model.keys]
            nxt = next((n for n in range(len(chain)) if chain[n] not in model.keys), None)
            if nxt and held:
                keys = chain[nxt : nxt + rng.randint(1, 3)]
                eng = [engine_of[k] for k in keys] if rng.random() < 0.7 else None
                entries = [entry()]
                op = AddOp(None if eng is None else tuple(eng), tuple(keys), tuple(entries))
                op = AddOp(op.engine_keys, op.request_keys, op.entries, chain[nxt - 1])
                assert index.apply_batch([op])
                model.add(eng, keys, entries, None, clock[0])
                if bytes_bound:
                    sync_dropped(index, model)
                query = chain[: nxt + len(keys) + 1]
                want = LongestPrefixScorer().score_by_rank(query, model.walk(query, None))
                assert index.score_by_rank(query) == want, where
                model.use(query[: raced(query, model.walk(query, None))])
        elif action < 0.62:
            key = rng.choice(keys)
            held = list(model.keys.get(key, ())) or [entry()]
            evicted = rng.sample(held, rng.randint(1, min(2, len(held))))
            if rng.random() < 0.5:
                index.evict(key, KeyType.REQUEST, evicted)
                model.evict(key, KeyType.REQUEST, evicted)
            else:
                index.evict(engine_of[key], KeyType.ENGINE, evicted)
                model.evict(engine_of[key], KeyType.ENGINE, evicted)
        elif action < 0.66:
            pod = rng.choice(pods)
            if rng.random() < 0.5:
                assert index.clear_with_progress(pod) == model.clear(pod), where
            else:
                tiers, rank = rng.choice([None, {"cpu"}]), rng.choice([None, 1])
                removed = index.clear_entries(pod, device_tiers=tiers, dp_rank=rank)
                assert removed == model.clear(pod, tiers, rank), where
        elif action < 0.8:
            query = rng.choice(chains)[: rng.randint(1, 48)]
            pod_set = rng.choice([None, None, set(rng.sample(pods, 2))])
            found = model.walk(query, pod_set)
            got = index.lookup(query, pod_set)
            assert {k: list(v) for k, v in got.items()} == found, where
            model.use(list(found))
        elif action < 0.92:
            query = rng.choice(chains)[: rng.randint(1, 48)]
            pod_set = rng.choice([None, None, set(rng.sample(pods, 2))])
            found = model.walk(query, pod_set)
            weights = rng.choice(WEIGHTS)
            want = LongestPrefixScorer(weights).score_by_rank(query, found)
            assert index.score_by_rank(query, weights, pod_set) == want, where
            model.use(query[: raced(query, found)])
        elif action < 0.96:
            engine_key = engine_of[rng.choice(keys)]
            refs = model.engine.get(engine_key)
            if refs is None:
                with pytest.raises(EngineKeyNotFoundError):
                    index.get_request_key(engine_key)
            else:
                assert index.get_request_key(engine_key) == refs[-1], where
                model.engine.move_to_end(engine_key)
        else:
            clock[0] += rng.choice([0.4, 1.0, 4.0])
            model.expire(clock[0])
            assert len(index) == len(model.keys), where
        if bytes_bound:
            sync_dropped(index, model)
            assert index.cost() <= index.max_cost(), where
        try:
            compare(index, model, order=not bytes_bound)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        made_runs += bool(index._runs)
    assert made_runs > 10, "the workload hardly made runs"


@pytest.mark.parametrize("seed", range(24))
def test_key_count_bounds_drop_in_exact_lru_order(seed: int, monkeypatch: Any) -> None:
    if seed % 2:  # the heap of uses rebuilt often, not just past 1024 stale events
        monkeypatch.setattr(memory_recency, "_SLACK", 4)
    rng = random.Random(seed * 7919)
    size = rng.choice([None, 40, 90, 150])
    cap = rng.choice([None, 2, 3, 10])
    config = InMemoryIndexConfig(
        size=size or 10**9, pod_cache_size=cap or 1000
    )  # fmt: skip
    model = Model(size, cap)
    run_workload(
        seed, lambda: InMemoryIndex(config), model, bytes_bound=False, monkeypatch=monkeypatch
    )


@pytest.mark.parametrize("seed", range(12))
def test_byte_bound_drops_the_oldest_keys(seed: int, monkeypatch: Any) -> None:
    budget = random.Random(seed).choice([6_000, 15_000, 40_000, 10**9])
    model = Model(None, None)
    config = CostAwareMemoryIndexConfig(budget)
    run_workload(
        seed, lambda: CostAwareMemoryIndex(config), model, bytes_bound=True, monkeypatch=monkeypatch
    )


def test_a_chain_stored_at_once_is_one_run_and_scores_in_one_piece() -> None:
    index = InMemoryIndex()
    keys = list(range(1000, 1000 + 64))
    index.add([k + 1 for k in keys], keys, [PodEntry("pod-a", "gpu")])
    index.add(None, keys[:40], [PodEntry("pod-b", "gpu")])
    assert len(index._runs) == 1 and not index._keys
    run = next(iter(index._runs))
    assert [len(list(v)) for v in run.sets.values] == [2, 1]
    assert index.score(keys) == {"pod-a": 64.0, "pod-b": 40.0}
    assert len(list(index._pieces(keys, None, 0.0))) == 2
    memory_state.check(index)


def test_fewer_new_keys_than_a_run_stay_inline() -> None:
    index = InMemoryIndex()
    index.add(None, list(range(RUN_MIN - 1)), [PodEntry("pod-a", "gpu")])
    assert not index._runs and len(index._keys) == RUN_MIN - 1
    index.add(None, list(range(100, 100 + RUN_MIN)), [PodEntry("pod-a", "gpu")])
    assert len(index._runs) == 1
    memory_state.check(index)


def test_span_is_the_length_of_the_common_stretch() -> None:
    """``span`` and ``span_at`` against a key-by-key count, on chained keys (that never meet
    again once they part) and on keys that do (small values, repeated)."""
    rng = random.Random(5)
    for _ in range(30_000):
        n = rng.randint(1, 40)
        run = [rng.getrandbits(rng.choice([2, 8, 64])) for _ in range(n)]
        pos, i = rng.randrange(n), rng.randint(0, 5)
        chain = [rng.getrandbits(8) for _ in range(i)] + run[pos : pos + rng.randint(1, n - pos)]
        for _ in range(rng.randint(0, 3)):
            k = rng.randrange(i, len(chain))
            if k > i:
                chain[k] = rng.getrandbits(rng.choice([1, 8]))
        chain += [rng.getrandbits(2) for _ in range(rng.randint(0, 5))]
        ends = sorted({*rng.sample(range(1, n + 1), rng.randint(1, n)), n})
        want = 0
        while i + want < len(chain) and pos + want < n and chain[i + want] == run[pos + want]:
            want += 1
        assert span(chain, i, run, pos) == want
        assert span_at(chain, i, run, pos, ends) == want


def test_appends_naming_their_parent_grow_the_run() -> None:
    """An engine storing a chain block by block (the ingester names each add's parent): the
    chain stays one run, and a score reads it in one piece."""
    index = InMemoryIndex()
    chain = list(range(5000, 5000 + 40))
    a = PodEntry("pod-a", "gpu")
    index.add([k + 1 for k in chain[:16]], chain[:16], [a])  # the prompt
    for n in range(16, 40):  # one block per decode step
        assert index.apply_batch([AddOp((chain[n] + 1,), (chain[n],), (a,), chain[n - 1])])
        assert index.score(chain) == {"pod-a": n + 1.0}  # (what a score read is kept fresh)
    assert len(index._runs) == 1 and not index._keys
    assert index.score(chain) == {"pod-a": 40.0}
    assert index.get_request_key(chain[30] + 1) == chain[30]
    assert len(list(index._pieces(chain, None, 0.0))) == 1
    index.apply_batch([AddOp(None, (77,), (a,), 12345)])  # a parent no run ends: inline
    assert len(index._keys) == 1
    memory_state.check(index)


def test_an_add_longer_than_a_run_makes_several() -> None:
    """Runs stay at most RUN_MAX keys long, so finding a key in one stays cheap."""
    index = CostAwareMemoryIndex()
    keys = list(range(10_000, 10_000 + 2 * RUN_MAX + 100))
    index.add([k + 7 for k in keys], keys, [PodEntry("pod-a", "gpu")])
    assert sorted(len(run.keys) for run in index._runs) == [100, RUN_MAX, RUN_MAX]
    assert index.score(keys) == {"pod-a": float(len(keys))}
    assert index.get_request_key(keys[-1] + 7) == keys[-1]
    assert memory_state.key_order(index) == keys
    memory_state.check(index)

"""A batch's write programs (``kvredis.redis.program``): consecutive evicts sharing their
entries go in together (:meth:`Programs.evicts`) and make exactly the programs the same evicts
made one by one (:meth:`Programs.evict`) do, over any budget."""

from __future__ import annotations

import random

from kvredis.batch import AddOp, EvictOp, IndexOp
from kvredis.redis import ops
from kvredis.redis.layout import Layout
from kvredis.redis.program import Program, Programs
from kvredis.types import KeyType, PodEntry

LAYOUT = Layout("prog-test", 16, b"")
A, B, S = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu"), PodEntry("pod-a", speculative=True)


def one_by_one(plan: list[IndexOp], budget: int) -> list[Program]:
    """The programs of ``plan`` with every evict added on its own (what a batch's evicts made
    before they went in together)."""
    programs = Programs(LAYOUT, budget)
    for op in plan:
        if isinstance(op, EvictOp):
            programs.evict(op.key, op.key_type, op.entries)
        else:
            ents = list(dict.fromkeys(op.entries))
            pieces = ops.add_pieces(op.engine_keys, op.request_keys, ents, programs.budget)
            parents = ops.piece_parents(pieces, op.parent)
            for (keys, pairs), parent in zip(pieces, parents, strict=True):
                programs.add(keys, pairs, ents, parent)
    return programs.items


def shape(programs: list[Program]) -> list[tuple[object, ...]]:
    return [(p.ops, p.units, p.count, p.cost, p.entries) for p in programs]


def random_plan(rng: random.Random) -> list[IndexOp]:
    shared = [(A,), (A, B), (B, A, B), (S,)]
    plan: list[IndexOp] = []
    for _ in range(rng.randrange(1, 40)):
        if rng.random() < 0.15:
            keys = tuple(rng.randrange(1, 2**64) for _ in range(rng.randrange(1, 30)))
            plan.append(AddOp(keys if rng.random() < 0.5 else None, keys, rng.choice(shared)))
            continue
        entries = rng.choice(shared)
        kind = rng.choice([KeyType.ENGINE, KeyType.REQUEST])
        for _ in range(rng.randrange(1, 60)):
            if rng.random() < 0.1:  # an equal tuple that is another object: a run of its own
                entries = (*entries,)
            plan.append(EvictOp(rng.randrange(0, 2**64), kind, entries))
    return plan


def test_evicts_in_runs_make_the_programs_evicts_one_by_one_make() -> None:
    rng = random.Random(7)
    runs = 0
    for _ in range(300):
        plan = random_plan(rng)
        budget = rng.choice([1, 2, 3, 5, 8, 40, 1024])
        together = ops.batch_programs(LAYOUT, plan, budget)
        assert shape(together) == shape(one_by_one(plan, budget))
        runs += len(together)
    assert runs > 300  # small budgets split most plans into several programs


def test_an_evict_over_the_budget_alone_still_gets_a_program() -> None:
    plan: list[IndexOp] = [EvictOp(k, KeyType.ENGINE, (A, B)) for k in range(1, 6)]
    together = ops.batch_programs(LAYOUT, plan, 2)  # each evict costs 4 units
    assert [p.count for p in together] == [1] * 5
    assert shape(together) == shape(one_by_one(plan, 2))

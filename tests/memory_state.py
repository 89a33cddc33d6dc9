"""Reading an embedded index's internals for tests: what it holds, in which order it would drop
keys, and the invariants tying its tables, runs, entry records and byte estimate together.

Only tests use this; it reads private attributes of :mod:`kvredis.memory` on purpose.
"""

from __future__ import annotations

from typing import Any

from kvredis.memory import (
    KEY_COST,
    RUN_COST,
    RUN_KEY_COST,
    RUN_MAPPING_COST,
    RUN_POSITION_COST,
)
from kvredis.memory.engine import refs
from kvredis.types import PodEntry


def ranges(run_ranges: Any) -> list[tuple[int, int, Any]]:
    """A run's ranges as (start, end, value)."""
    out, start = [], 0
    for end, value in zip(run_ranges.ends, run_ranges.values, strict=True):
        out.append((start, end, value))
        start = end
    return out


def held_keys(index: Any) -> dict[int, tuple[PodEntry, ...]]:
    """Every request key the index holds, with its entries (oldest added first), without
    counting anything as used."""
    out: dict[int, tuple[PodEntry, ...]] = dict(index._keys)
    for run in index._runs:
        for start, end, entries in ranges(run.sets):
            if entries:
                for key in run.keys[start:end]:
                    assert key not in out, f"key {key} held twice"
                    out[key] = entries
    return out


def key_order(index: Any) -> list[int]:
    """The request keys, least recently used first (the order the bounds drop them in)."""
    stamped = [(index._key_ticks[key], n, key) for n, key in enumerate(index._keys)]
    for run in index._runs:
        live = {k for s, e, entries in ranges(run.sets) if entries for k in range(s, e)}
        for start, end, tick in ranges(run.recency):
            for pos in range(start, end):
                if pos in live:
                    assert tick, f"live position {pos} of {run} was never used"
                    stamped.append((tick, pos, run.keys[pos]))
    return [key for _, _, key in sorted(stamped)]


def engine_map(index: Any) -> dict[int, tuple[int, ...]]:
    """Every engine key with its request keys (oldest first)."""
    out = {key: refs(index._engine.get(key)) for key in index._engine.keys()}  # noqa: SIM118
    for run in index._runs:
        if run.engine is not None:
            for pos, engine_key in enumerate(run.engine):
                if engine_key is not None:
                    assert engine_key not in out, f"engine key {engine_key} held twice"
                    out[engine_key] = (run.keys[pos],)
    return out


def engine_order(index: Any) -> list[int]:
    """The engine keys, least recently used first."""
    ticks = index._engine.ticks
    stamped = [(ticks[key], n, key) for n, key in enumerate(index._engine.keys())]
    for run in index._runs:
        if run.engine is None:
            continue
        for start, end, tick in ranges(run.engine_recency):
            for pos in range(start, end):
                engine_key = run.engine[pos]
                if engine_key is not None:
                    assert tick, f"engine key at {pos} of {run} was never used"
                    stamped.append((tick, pos, engine_key))
    return [key for _, _, key in sorted(stamped)]


def check(index: Any) -> None:
    """Assert every invariant of the index's internals."""
    inline, resident, runs = index._keys, index._resident, index._runs
    assert set(index._key_ticks) == set(inline)
    ticks = [index._key_ticks[k] for k in inline]
    assert ticks == sorted(ticks), "inline keys out of tick order"
    assert not set(inline) & set(resident), "a key both inline and in a run"
    holders: dict[int, set[int]] = {}  # id of the entry -> keys holding it
    run_counts: dict[int, dict[Any, int]] = {}
    for key, stored in inline.items():
        assert stored and len({id(e) for e in stored}) == len(stored)
        for entry in stored:
            assert index._by_id[id(entry)].entry is entry
            holders.setdefault(id(entry), set()).add(key)
    cost = len(inline) * KEY_COST + sum(
        index._by_id[id(e)].cost for stored in inline.values() for e in stored
    )
    live_total = 0
    for run in runs:
        n = len(run.keys)
        assert len(set(run.keys)) == n, "a key twice in a run"
        for run_ranges in (run.sets, run.recency, run.engine_recency):
            if run_ranges is None:
                continue
            assert run_ranges.ends[-1] == n and len(run_ranges.ends) == len(run_ranges.values)
            assert all(a < b for a, b in zip(run_ranges.ends, run_ranges.ends[1:], strict=False))
        counts: dict[Any, int] = {}
        live = 0
        for start, end, entries in ranges(run.sets):
            assert len({id(e) for e in entries}) == len(entries)
            for pos in range(start, end):
                key = run.keys[pos]
                if entries:
                    assert resident.get(key) is run, f"live key {key} not mapped to its run"
                else:
                    assert resident.get(key) is not run, f"hole {key} still mapped to its run"
            if entries:
                live += end - start
            for entry in entries:
                held = index._by_id[id(entry)]
                assert held.entry is entry
                counts[held] = counts.get(held, 0) + end - start
                holders.setdefault(id(entry), set()).update(run.keys[start:end])
        assert counts == run.holders, "a run's counts of its entries are off"
        assert live == run.live
        live_total += live
        run_counts[id(run)] = counts
        mapped = 0
        if run.engine is not None:
            assert len(run.engine) == n
            for engine_key in run.engine:
                if engine_key is not None:
                    assert index._engine_resident.get(engine_key) is run
                    mapped += 1
            cost += n * 8
        assert mapped == run.mapped
        assert run.live or run.mapped, "a dead run kept"
        cost += RUN_COST + n * RUN_POSITION_COST + live * RUN_KEY_COST
        cost += mapped * RUN_MAPPING_COST + sum(held.cost for held in counts)
    assert live_total == len(resident), "keys mapped to runs that do not hold them"
    for engine_key, run in index._engine_resident.items():
        assert run in runs and run.engine is not None and engine_key in run.engine
        assert index._engine.get(engine_key) is None, "an engine key in a run and the table"
    assert len(index._held) == len(holders), "records of entries no key holds"
    for held in index._held.values():
        keys = holders[id(held.entry)]
        assert held.count == len(keys), f"{held.entry} counts {held.count}, held by {len(keys)}"
        assert {k for k in keys if k in inline} <= set(held.log)
        assert held.runs == {run for run in runs if held in run_counts[id(run)]}
        assert index._pods[held.entry.pod_identifier] >= {held}
    assert sum(len(v) for v in index._pods.values()) == len(index._held)
    assert index._cost == cost, f"byte estimate {index._cost}, recounted {cost}"

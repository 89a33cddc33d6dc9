"""Smoke test: scripts/bench_realistic.py runs end to end (``--quick``) on both engine shapes,
its scores agree with what the simulated pods hold (the script asserts it), keys appended one
event at a time end up in chain runs, and it reports every side it measures (client CPU through
process, process_many and kvredis ingest over ZMQ; Redis CPU against the Go layout as its code
writes and written well; memory per pair) and the fleet-sizing table."""

from __future__ import annotations

import importlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_realistic.py"


@pytest.mark.redis
def test_quick_run_reports_both_shapes(tmp_path: Path) -> None:
    out = tmp_path / "realistic.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--zmq-runs", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = {r["shape"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"vllm", "sglang"}
    for r in results.values():  # kvredis ingest over ZMQ twice, a fresh process each: the median
        runs = r["zmq_runs_us"]
        assert len(runs) == 2 and min(runs) > 0
        assert r["client_us_per_block"]["kvredis ingest (ZMQ)"] == pytest.approx(sum(runs) / 2)
    assert "kvredis ingest (ZMQ) runs, median above: " in proc.stdout
    for r in results.values():
        assert r["scores_checked"] > 0 and r["blocks_stored"] > 0
        assert r["share_in_runs"] > 0.95  # one-block events joined the runs they continue
        assert set(r["score_us"]) == {"kvredis", "go layout", "64-key fill", "floor", "bare call"}
        assert set(r["ingest_us_per_block"]) == {"kvredis", "go layout"}
        assert set(r["redis_us_per_block"]) == {
            "kvredis, backlog 1",
            "kvredis, backlog 16",
            "go layout",
            "go layout written well",
        }
        assert set(r["client_us_per_block"]) == {
            "process",
            "process_many(16)",
            "kvredis ingest (ZMQ)",
        }
        assert all(v > 0 for v in r["client_us_per_block"].values())
        # the ingester's cost per message, per stored block and per removed key, fitted
        assert set(r["client_cost_us"]) == {"process", "process_many(16)"}
        for costs in r["client_cost_us"].values():
            assert set(costs) == {"message", "event", "block", "removed key"}
            assert min(costs.values()) >= 0 and max(costs.values()) > 0
        assert r["parent_misses"] == 0 and r["pairs"] > 0
        assert set(r["memory"]) == {
            "event-filled",
            "of which page journal",
            "page journal compacted",
            "64-key fill",
            "64-key fill with engine mappings",
        }
        # the adds naming each block's engine mapping hold what the event-filled index holds
        memory = r["memory"]
        event_filled = memory["event-filled"] - memory["of which page journal"]
        assert memory["64-key fill with engine mappings"] > memory["64-key fill"]
        assert r["ratios"]["memory without the journal vs 64-key fill with engine mappings"] == (
            pytest.approx(event_filled / memory["64-key fill with engine mappings"])
        )
        assert r["bucket_bits"] == 16
    # SGLang's radix nodes start and end inside blocks: many pages per block, branches, evictions
    sglang = results["sglang"]
    assert sglang["pages_stored"] > 8 * sglang["blocks_stored"]
    assert sglang["evicted_per_stored"] > 0
    assert "| sglang, redis | 1,000 |" in proc.stdout


def test_zmq_runs_must_be_at_least_one() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--zmq-runs", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--zmq-runs must be at least 1" in proc.stderr


@pytest.mark.redis
def test_quick_run_on_valkey(tmp_path: Path) -> None:
    # with buckets sized for the fleet (--bucket-bits auto): fewer than the default 16, printed
    out = tmp_path / "realistic.json"
    args = ["--quick", "--shape=vllm", "--server=valkey", "--bucket-bits=auto", "--json", out]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["shape"] == "vllm" and result["server"] == "valkey"
    assert result["scores_checked"] > 0
    assert result["bucket_bits"] < 16
    printed = re.search(r"bucket bits\s+(\d+)", proc.stdout)
    assert printed is not None and int(printed.group(1)) == result["bucket_bits"]


@pytest.mark.redis
def test_quick_run_compares_another_revisions_scripts(tmp_path: Path) -> None:
    """``--before REF``: the scripts of a git revision against this checkout's, in one server
    (here the checkout's own last commit, so both speak the same protocol)."""
    if not (SCRIPT.parents[1] / ".git").exists():
        pytest.skip("not a git checkout")
    out = tmp_path / "realistic.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--shape=vllm", "--before=HEAD", "--json", out],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(out.read_text())
    rows = result["before"]
    assert set(rows) == {
        "conversation score",
        "3-part chain score",
        "3-part chain, 2 ranks",
        "ingest per block, 1 per call",
        "ingest per block, 16 per call",
        "score, each side's fill",
    }
    assert all(set(sides) == {"HEAD", "now"} and min(sides.values()) > 0 for sides in rows.values())


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/bench_realistic.py as a module (its helpers import from scripts/)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("bench_realistic")


def test_least_squares_recovers_the_costs(bench: ModuleType) -> None:
    rng = random.Random(3)
    costs = [91.5, 3.25, 11.0]
    rows = [[rng.randint(1, 16), rng.randint(0, 900), rng.randint(0, 400)] for _ in range(60)]
    ys = [sum(c * x for c, x in zip(costs, row, strict=True)) for row in rows]
    assert bench.least_squares(rows, ys) == pytest.approx(costs, rel=1e-6)
    # a column that never varies from zero gets no cost
    flat = [[row[0], row[1], 0] for row in rows]
    fitted = bench.least_squares(flat, [91.5 * a + 3.25 * b for a, b, _ in flat])
    assert fitted == pytest.approx([91.5, 3.25, 0.0], rel=1e-6, abs=1e-9)


def test_costs_are_never_negative(bench: ModuleType) -> None:
    # calls whose cost falls with their blocks: the unconstrained fit gives a negative cost,
    # the cost model the best fit without one
    rows = [[1, b, 0] for b in range(1, 30)]
    ys = [100.0 - 2.0 * b for b in range(1, 30)]
    assert bench.least_squares(rows, ys)[1] == pytest.approx(-2.0)
    fitted = bench.nonnegative_least_squares(rows, ys)
    assert min(fitted) >= 0
    assert fitted[1] == 0 and fitted[0] == pytest.approx(sum(ys) / len(ys))


def test_cost_model_splits_calls_by_message(bench: ModuleType) -> None:
    rng = random.Random(5)
    messages = [
        bench.Message(
            0, b"", [], [1] * rng.randint(0, 6), rng.randint(1, 40), events=rng.randint(1, 9)
        )
        for _ in range(101)
    ]
    backlog = 4
    each = []
    for i in range(0, len(messages), backlog):
        part = messages[i : i + backlog]
        us = sum(20.0 + 60.0 * m.events + 3.0 * m.blocks + 12.0 * len(m.removed) for m in part)
        each.append(us / 1e6)
    fitted = bench.cost_model(messages, backlog, each)
    want = {"message": 20.0, "event": 60.0, "block": 3.0, "removed key": 12.0}
    assert fitted == pytest.approx(want, rel=1e-6)


def test_a_pod_never_evicts_blocks_in_use(bench: ModuleType) -> None:
    pod = bench.Pod(capacity=4)
    blocks = [(k,) for k in range(1, 5)]
    for b in blocks:
        pod.lru[b[-1]] = b
    pod.pin(blocks[:2])  # the two least recently used are a running request's
    assert pod.evict(2) == [3, 4]
    assert list(pod.lru) == [1, 2]
    pod.pin(blocks[:2], -1)  # the request ended
    assert pod.pinned == {}
    assert pod.evict(3) == [1]
    # all in use: nothing to evict, and evict returns
    pod.pin(blocks[1:2])
    assert pod.evict(4) == []
    with pytest.raises(AssertionError):
        pod.pin(blocks[:1], -1)  # never pinned


def test_evicting_around_blocks_in_use_keeps_the_free_order(bench: ModuleType) -> None:
    pod = bench.Pod(capacity=5)
    for k in range(1, 6):
        pod.lru[k] = (k,)
    pod.pin([(1,), (2,)])
    assert pod.evict(1) == [3]  # room for one more beside the 4 left
    assert pod.evict(2) == [4]
    # blocks in use stay where they were: freed, they are the least recently used again
    assert list(pod.lru) == [1, 2, 5]
    pod.pin([(1,), (2,)], -1)
    assert pod.evict(4) == [1, 2]


def test_step_batches_hold_each_store_in_order(bench: ModuleType) -> None:
    """A vllm-steps batch holds the stores of one engine step, in order: replayed store by store
    they leave exactly what each pod holds; stores of several requests share a batch."""
    fleet = bench.VllmStepFleet(64, 2, 500, seed=11, concurrency=8)
    fleet.run()
    assert any(len(m.steps()) > 1 for m in fleet.messages)
    held: dict[int, set[int]] = {p: set() for p in range(fleet.npods)}
    for m in fleet.messages:
        assert m.blocks == sum(len(req) for _, adds in m.steps() for _, req in adds)
        assert m.removed == [k for removed, _ in m.steps() for k in removed]
        assert m.events >= len(m.steps())  # a store publishes an event at least
        for removed, adds in m.steps():
            held[m.pod].difference_update(removed)
            for engine_keys, _ in adds:
                held[m.pod].update(engine_keys)
    assert held == {p: set(pod.lru) for p, pod in enumerate(fleet.pods)}
    assert sum(len(m.removed) for m in fleet.messages) > 0  # the caches filled and evicted


def _quick_run(tmp_path: Path, shapes: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """``--quick --no-zmq`` of ``shapes``: what it printed, and its results by shape."""
    out = tmp_path / "realistic.json"
    args = ["--quick", f"--shape={shapes}", "--no-zmq", "--json", out]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, {r["shape"]: r for r in json.loads(out.read_text())}


@pytest.mark.redis
def test_quick_run_of_engine_step_batches(tmp_path: Path) -> None:
    stdout, results = _quick_run(tmp_path, "vllm-steps,vllm-stores")
    steps, stores = results["vllm-steps"], results["vllm-stores"]
    for r in (steps, stores):
        assert r["scores_checked"] > 0 and r["parent_misses"] == 0
    # the same stream: the same events and blocks, fewer batches when a step holds several
    assert (steps["events"], steps["blocks_stored"]) == (stores["events"], stores["blocks_stored"])
    assert steps["messages"] < stores["messages"] <= stores["events"]
    assert "| vllm-steps, redis | 1,000 |" in stdout


@pytest.mark.redis
def test_quick_run_of_long_answers(tmp_path: Path) -> None:
    stdout, results = _quick_run(tmp_path, "vllm-long")
    result = results["vllm-long"]
    assert result["scores_checked"] > 0 and result["parent_misses"] == 0
    assert result["events"] > 0.6 * result["blocks_stored"]  # mostly one-block stores
    assert "| vllm-long, redis | 1,000 |" in stdout


def test_long_answers_are_appended_a_block_at_a_time(bench: ModuleType) -> None:
    """vllm-long: vllm-steps' fleet with answers of 64-640 blocks, a one-block event each."""
    steps = bench.VllmStepFleet(16, 2, 3000, seed=4, concurrency=2)
    long = bench.VllmLongFleet(16, 2, 3000, seed=4, concurrency=2)
    for fleet in (steps, long):
        fleet.run()
    assert long.shape == "vllm-long" and long.out_blocks == (64, 640)
    stored = sum(m.blocks for m in long.messages)
    # at least 64 generated blocks per turn, each its own event: most of what is stored
    assert sum(m.events for m in long.messages) >= 64 * 16 * 2
    assert sum(m.events for m in long.messages) > 0.6 * stored
    assert stored > 4 * sum(m.blocks for m in steps.messages)
    # a pod's running requests share its engine steps
    assert any(m.events > 1 for m in long.messages)


def test_per_store_batches_publish_the_same_stream(bench: ModuleType) -> None:
    """vllm-stores publishes vllm-steps' stream event for event, a batch per store."""
    fleets = []
    for per_store in (False, True):
        fleet = bench.VllmStepFleet(48, 2, 400, seed=2, concurrency=6, per_store=per_store)
        fleet.run()
        fleets.append(fleet)
    steps, stores = fleets
    assert (steps.shape, stores.shape) == ("vllm-steps", "vllm-stores")
    assert all(len(m.steps()) == 1 for m in stores.messages)
    assert len(stores.messages) > len(steps.messages)

    def per_pod(fleet: object) -> dict[int, list[object]]:
        out: dict[int, list[object]] = {}
        for m in fleet.messages:  # type: ignore[attr-defined]
            out.setdefault(m.pod, []).extend(m.steps())
        return out

    def events(fleet: object) -> dict[int, list[object]]:
        out: dict[int, list[object]] = {}
        for m in fleet.messages:  # type: ignore[attr-defined]
            out.setdefault(m.pod, []).extend(msgpack.unpackb(m.payload)[1])
        return out

    assert per_pod(steps) == per_pod(stores)
    assert events(steps) == events(stores)
    assert [set(pod.lru) for pod in steps.pods] == [set(pod.lru) for pod in stores.pods]

"""Smoke test: scripts/bench_cluster.py runs end to end (a tiny ``--quick``) and reports every
section for every setup: round trips within one per involved node and wave, per-call costs,
and the mixed workload on the single server, the 1-primary and the 3-primary cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_cluster.py"


@pytest.mark.redis
@pytest.mark.cluster
def test_quick_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    args = [
        "--quick", "--scale", "0.002", "--seconds", "0.3", "--clients", "1",
        "--calls", "3", "--shards", "6", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "Round trips per call" in proc.stdout and "real hw" in proc.stdout
    result = json.loads(out.read_text())
    trips = result["trips"]
    assert {t["setup"] for t in trips} == {"single", "3p/6 shards"}
    for row in trips:
        assert 0 < row["nodes"] <= 3
        # one round trip per involved node and wave, never more
        assert row["trips"] <= row["nodes"] * row["waves"] + 1e-9
        if row["op"] in ("lookup", "score"):
            assert row["waves"] == 1 and row["trips"] == row["nodes"]
    calls = {(c["setup"], c["op"]) for c in result["calls"]}
    assert ("3p/6 shards", "score 512") in calls and ("single", "score 512") in calls
    for row in result["calls"]:
        assert row["calls"] == 3 and row["p99_us"] >= row["p50_us"] > 0
        assert row["redis_cpu_us"] >= 0
    mixed = {(m["setup"], m["clients"]): m for m in result["mixed"]}
    assert set(mixed) == {("single", 1), ("1p/6 shards", 1), ("3p/6 shards", 1)}
    for run in mixed.values():
        assert run["scores"] > 0 and run["batches"] > 0
        assert run["score_p99_us"] >= run["score_p50_us"] > 0

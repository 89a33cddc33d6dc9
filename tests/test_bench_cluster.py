"""Smoke test: scripts/bench_cluster.py runs end to end on a tiny realistic fleet and reports
every setup asked for, with scores checked equal to the single server's (the script asserts
it) and capacities computed from each node's CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_cluster.py"


@pytest.mark.redis
@pytest.mark.cluster
def test_a_tiny_run_reports_every_setup(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    args = [
        "--quick", "--shape", "vllm", "--setups", "single,1p,3p+1r", "--pods", "6",
        "--conversations", "6", "--turns", "2", "--rounds", "1", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "capacity" in proc.stdout
    (shape,) = json.loads(out.read_text())["shapes"]
    assert shape["shape"] == "vllm" and shape["blocks"] > 0 and shape["pairs"] > 0
    rows = {r["setup"]: r for r in shape["rows"]}
    assert set(rows) == {"single", "1p", "3p+1r"}
    assert rows["single"]["ingest_capacity"] == rows["single"]["score_capacity"] == 1.0
    replicated = rows["3p+1r"]
    assert replicated["primaries"] == 3 and replicated["replicas"] == 1
    assert len(replicated["score_cpu_per_node"]) == 6  # every node's CPU, replicas too
    # a cluster without replicas is also scored shard by shard, each node measured alone
    assert len(rows["1p"]["score_isolated_per_shard"]) == rows["1p"]["shards"] == 1
    assert rows["1p"]["score_isolated_capacity"] > 0
    assert rows["3p+1r"]["score_isolated_per_shard"] == []
    assert rows["single"]["score_isolated_per_shard"] == []
    for row in rows.values():
        assert row["ingest_cpu_busiest"] > 0 and row["score_cpu_busiest"] > 0
        assert row["score_cpu_all"] >= row["score_cpu_busiest"]

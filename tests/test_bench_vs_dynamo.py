"""Smoke test: scripts/bench_vs_dynamo.py runs end to end without Dynamo installed (a tiny
``--quick``): it says how to install Dynamo's radix tree, skips its rows, checks that the
embedded and Redis scores agree on every query of both shapes (the script asserts it) and reports
them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_vs_dynamo.py"
SIDES = {
    "InMemoryIndex.score",
    "CostAwareMemoryIndex.score",
    "InMemoryIndex lookup + LongestPrefixScorer",
    "RedisIndex.score (wall)",
}


@pytest.mark.redis
def test_quick_run_without_dynamo_reports_every_other_side(tmp_path: Path) -> None:
    out = tmp_path / "dynamo.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--chains", "2", "--families", "1",
         "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    if result["dynamo"]:
        pytest.fail("Dynamo is installed in the test venv: it must not be a dependency")
    assert "pip install" in proc.stdout and "ai-dynamo-runtime" in proc.stdout
    assert set(result["shapes"]) == {"chains", "families"}
    chains, families = result["shapes"]["chains"], result["shapes"]["families"]
    assert chains["entries"] == 2 * 512 * 4
    # 8 chains of 384 + 128 blocks: every block at least once, the prefix on 1-8 pods
    assert 384 + 8 * 128 <= families["entries"] <= 8 * 384 + 8 * 128
    for shape in (chains, families):
        rows = [r for r in shape["queries"] if r["query"] not in ("PING", "beyond PING")]
        (ping,) = [r["p50_us"] for r in shape["queries"] if r["query"] == "PING"]
        (beyond,) = [r["p50_us"] for r in shape["queries"] if r["query"] == "beyond PING"]
        (wall,) = [
            r["p50_us"]
            for r in rows
            if r["side"] == "RedisIndex.score (wall)" and r["query"] == "whole chain"
        ]
        assert {(r["query"], r["side"]) for r in rows} == {
            (q, s) for q in ("whole chain", "leaves at block 256") for s in SIDES
        }
        assert all(r["p99_us"] >= r["p50_us"] > 0 for r in rows)
        assert beyond == pytest.approx(wall - ping)
        assert set(shape["memory"]) == {"InMemoryIndex", "CostAwareMemoryIndex"}
        assert all(m["traced_bytes_per_entry"] > 0 for m in shape["memory"].values())

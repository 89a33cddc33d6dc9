"""Smoke test: scripts/bench_realistic.py runs end to end (``--quick``) on both engine shapes,
its scores agree with what the simulated pods hold (the script asserts it), and keys appended
one event at a time end up in chain runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_realistic.py"


@pytest.mark.redis
def test_quick_run_reports_both_shapes(tmp_path: Path) -> None:
    out = tmp_path / "realistic.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = {r["shape"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"vllm", "sglang"}
    for r in results.values():
        assert r["scores_checked"] > 0 and r["blocks_stored"] > 0
        assert r["share_in_runs"] > 0.95  # one-block events joined the runs they continue
        assert set(r["score_us"]) == {"kvredis", "go layout", "64-key fill", "floor", "bare call"}
        assert set(r["ingest_us_per_block"]) == {"kvredis", "go layout"}


@pytest.mark.redis
def test_quick_run_on_valkey(tmp_path: Path) -> None:
    out = tmp_path / "realistic.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--shape=vllm", "--server=valkey", "--json", out],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["shape"] == "vllm" and result["server"] == "valkey"
    assert result["scores_checked"] > 0


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
        "ingest per block",
    }
    assert all(set(sides) == {"HEAD", "now"} and min(sides.values()) > 0 for sides in rows.values())

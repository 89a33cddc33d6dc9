"""Smoke test: scripts/bench_realistic.py runs end to end (``--quick``) on both engine shapes,
its scores agree with what the simulated pods hold (the script asserts it), keys appended one
event at a time end up in chain runs, and it reports every side it measures (client CPU through
process, process_many and kvredis ingest over ZMQ; Redis CPU against the Go layout as its code
writes and written well; memory per pair) and the fleet-sizing table."""

from __future__ import annotations

import json
import re
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
        "ingest per block",
    }
    assert all(set(sides) == {"HEAD", "now"} and min(sides.values()) > 0 for sides in rows.values())

"""Smoke test: scripts/bench_appends.py runs end to end (``--quick``) and reports the runs a
chain of one-key appends ends in, as the run append limit makes them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvredis.redis.layout import RUN_APPEND_MAX

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_appends.py"


@pytest.mark.redis
def test_quick_run_reports_append_costs_and_runs(tmp_path: Path) -> None:
    out = tmp_path / "appends.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--rounds", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["length"] == 512 and len(result["us_per_append"]) == 512 // 64
    assert min(result["us_per_append"]) > 0 and result["score_us"] > 0
    assert result["growth"] == pytest.approx(result["last_quarter_us"] / result["first_quarter_us"])
    # the first key stands alone; the appended keys fill runs of RUN_APPEND_MAX + 1 keys (a run
    # is extended while it holds at most RUN_APPEND_MAX)
    assert result["runs_per_chain"] == math.ceil(512 / (RUN_APPEND_MAX + 1))
    assert "last quarter / first quarter" in proc.stdout


def test_a_length_shorter_than_a_segment_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--length", "10", "--segment", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--length" in proc.stderr

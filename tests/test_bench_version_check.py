"""Smoke test: scripts/bench_version_check.py times the library's per-call protocol version
check (the library with it against the same library without it: it asserts both answer alike)
and reports every row and the check alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_version_check.py"


@pytest.mark.redis
def test_quick_run_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert {"ping", "score, 16 blocks", "apply_batch, 64 evicts"} <= set(result["rows"])
    for row in result["rows"].values():
        assert row["with_check_function_us"] > 0 and row["without_function_us"] > 0
    assert set(result["alone"]) == {
        "the check alone, 10 arguments",
        "the check alone, 10000 arguments",
    }

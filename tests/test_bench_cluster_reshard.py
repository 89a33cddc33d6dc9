"""Smoke test: scripts/bench_cluster_reshard.py runs end to end (``--quick``: one move there and
back) and reports every phase, with no failed call and no wrong answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_cluster_reshard.py"


@pytest.mark.redis
@pytest.mark.cluster
def test_quick_run_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "reshard.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--keys", "200", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert "slot moves" in proc.stdout
    result = json.loads(out.read_text())
    assert result["moves"] == 1
    for phase in ("mixed", "writes-only", "writes_only_after_move"):
        assert result[phase]["calls"] > 0
        assert result[phase]["failed"] == 0, proc.stdout
    assert result["mixed"]["mismatches"] == 0 == result["writes-only"]["mismatches"]

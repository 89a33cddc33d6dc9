"""Smoke test: scripts/bench_saturation.py runs end to end (a tiny ``--quick``) and reports every
run of both sides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import server_binary

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_saturation.py"


@pytest.mark.redis
@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_quick_run_reports_both_sides(kind: str, tmp_path: Path) -> None:
    if server_binary(kind) is None:
        pytest.fail(f"no {kind} server installed (scripts/install-servers, dev extras)")
    out = tmp_path / "saturation.json"
    args = ["--quick", "--scale", "0.002", "--seconds", "0.2", "--clients", "1,2"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--server", kind, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ops/core-s" in proc.stdout and "client CPU" in proc.stdout
    result = json.loads(out.read_text())
    assert result["server"] == kind
    assert result["dataset"]["chains"] == 40 and result["dataset"]["chain_blocks"] == 512
    runs = {(r["side"], r["clients"]): r for r in result["runs"]}
    assert set(runs) == {(s, k) for s in ("kvredis", "reference") for k in (1, 2)}
    for run in runs.values():
        assert run["ops"] > 0 and run["p99_us"] >= run["p50_us"] > 0
        assert run["server_cpu_pct"] >= 0
        assert run["client_cpu_pct"] > 0 and run["client_cpu_us_per_op"] > 0

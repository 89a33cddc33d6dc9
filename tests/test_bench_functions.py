"""Smoke test: scripts/bench_functions.py calls the index's operations through an EVALSHA client
and a function-library client of one namespace, on one server and on a cluster, checks that both
give the same results (the script asserts it), and reports both costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import local_server_kinds

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_functions.py"
ROWS = {
    "lookup, miss at the first key",
    "lookup, 16 blocks",
    "lookup, 512 blocks",
    "score, 16 blocks",
    "score, 512 blocks",
    "add, 16 keys",
    "apply_batch, 16 adds",
}


@pytest.mark.redis
@pytest.mark.parametrize("kind", local_server_kinds())
@pytest.mark.parametrize("cluster", [0, pytest.param(3, marks=pytest.mark.cluster)])
def test_quick_run_reports_both_ways(tmp_path: Path, kind: str, cluster: int) -> None:
    out = tmp_path / "functions.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--server", kind, "--json", str(out),
         "--cluster", str(cluster)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == ROWS
    for row in rows.values():
        assert row["evalsha_cpu_us"] > 0 and row["fcall_cpu_us"] > 0
        assert row["evalsha_wall_us"] > 0 and row["fcall_wall_us"] > 0
        assert 1 <= row["nodes"] <= max(1, cluster)

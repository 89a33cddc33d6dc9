"""Smoke test: scripts/bench_client_cpu.py measures the client CPU and instructions per index
call on kvredis's connection pools and on redis-py's own, side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_client_cpu.py"


@pytest.mark.redis
@pytest.mark.timeout(1200)  # 16 processes under valgrind
def test_quick_run_compares_both_pools_on_every_call(tmp_path: Path) -> None:
    out = tmp_path / "client.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--instructions", "--json", str(out)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["op"] for row in rows] == ["score", "lookup", "add", "score (asyncio)"]
    for row in rows:
        cpu, counted = row["cpu_us"], row["instructions"]
        assert set(cpu) == set(counted) == {"kvredis", "redis-py"}
        # a call costs the client tens of microseconds to milliseconds, and tens of thousands
        # to millions of instructions, whichever the pool
        assert all(1 < us < 50_000 for us in cpu.values()), cpu
        assert all(10_000 < n < 20_000_000 for n in counted.values()), counted
        assert row["ratio"] == pytest.approx(cpu["kvredis"] / cpu["redis-py"])
        assert row["instructions_ratio"] == pytest.approx(counted["kvredis"] / counted["redis-py"])
        assert row["op"] in proc.stdout
    assert "kvredis's pools / redis-py's" in proc.stdout

"""Smoke test: scripts/bench_lua_floor.py times hash commands run from a script and reports the
floor of a stored block's life in commands alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_lua_floor.py"


@pytest.mark.redis
def test_quick_run_reports_each_command_and_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--buckets", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    commands = result["command_us"]
    assert set(commands) == {"HGET miss", "HGET hit", "HSET new + HDEL"}
    assert all(us > 0 for us in commands.values())
    hget = (commands["HGET miss"] + commands["HGET hit"]) / 2
    assert result["block_life_floor_us"] == pytest.approx(
        4 * hget + 2 * commands["HSET new + HDEL"]
    )
    assert "a stored block's life" in proc.stdout

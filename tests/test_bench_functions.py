"""Smoke test: scripts/bench_functions.py builds a Redis Function library out of each of
kvredis's read scripts and its ping, gets the same reply from ``FCALL`` as from ``EVALSHA`` on
every row (the script asserts it), and reports both costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import local_server_kinds

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_functions.py"


@pytest.mark.redis
@pytest.mark.parametrize("kind", local_server_kinds())
def test_quick_run_gets_the_same_replies_both_ways(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "functions.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--server", kind, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {
        "ping (floor of a call)",
        "lookup, miss at the first key",
        "lookup, 16 blocks",
        "lookup, 512 blocks",
        "score, 512 blocks",
    }
    for row in rows.values():
        assert row["evalsha_us"] > 0 and row["fcall_us"] > 0

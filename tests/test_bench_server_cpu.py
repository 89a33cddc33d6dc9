"""Smoke test: scripts/bench_server_cpu.py ``--base`` measures the base revision's kvredis (its
tree unpacked from git) with this checkout's script and dataset helpers, and this checkout's
kvredis on the other side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_server_cpu.py"


def _git_head() -> str | None:
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.redis
def test_base_side_runs_on_the_base_tree(tmp_path: Path) -> None:
    head = _git_head()
    if head is None:
        pytest.skip("not a git checkout: --base unpacks a revision with git archive")
    out = tmp_path / "cpu.json"
    args = ["--base", head, "--quick", "--rows", "hot", "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    before, after = result["sides"]["before"], result["sides"]["after"]
    assert Path(after["kvredis"]) == REPO / "kvredis"
    assert not Path(before["kvredis"]).is_relative_to(REPO)
    assert Path(before["kvredis"]).name == "kvredis"
    assert before["layouts"] == after["layouts"] != []
    assert [(r["dataset"], r["op"]) for r in result["rows"]] == [
        ("hot chain, 4 pods", "lookup"),
        ("hot chain, 4 pods", "score"),
    ]
    for row in result["rows"]:
        assert row["before_cpu_us"] > 0 and row["after_cpu_us"] > 0
        assert row["reference_cpu_us"] > 0

"""Smoke test: scripts/bench_ingest_instructions.py counts the instructions an ingester runs per
stored block (valgrind's callgrind) on a small realistic fleet."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_ingest_instructions.py"


@pytest.mark.redis
def test_quick_run_counts_instructions_per_block_and_event(tmp_path: Path) -> None:
    out = tmp_path / "ir.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--shape", "vllm", "--json", str(out)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(out.read_text())["results"]
    assert row["shape"] == "vllm"
    assert row["blocks"] > row["events"] > 0 and row["messages"] > 0
    # ingesting costs instructions beyond loading the fleet: tens to hundreds of thousands a
    # block (an interpreter's work per decoded, planned and encoded block)
    assert 10_000 < row["per_block"] < 5_000_000
    assert row["per_block"] == pytest.approx(row["instructions"] / row["blocks"])
    assert row["per_event"] == pytest.approx(row["instructions"] / row["events"])
    assert "instructions per stored block" in proc.stdout
    assert json.loads(out.read_text())["backlog"] == 16


@pytest.mark.redis
def test_backlog_one_counts_process_with_a_call_per_message(tmp_path: Path) -> None:
    """``--backlog 1`` runs ``process``: a call per message costs more per block than 16
    messages per call (the round trip and the call's own work, per message)."""
    runs = {}
    for backlog in (1, 16):
        out = tmp_path / f"ir{backlog}.json"
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--quick", "--shape", "vllm", "--backlog", str(backlog),
             "--json", str(out)],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        payload = json.loads(out.read_text())
        assert payload["backlog"] == backlog
        [runs[backlog]] = payload["results"]
    assert runs[1]["blocks"] == runs[16]["blocks"]
    assert runs[1]["per_block"] > runs[16]["per_block"]


def test_backlog_must_be_at_least_one() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backlog", "0"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "--backlog must be at least 1" in proc.stderr

"""``kvredis cluster-up`` / ``cluster-down`` and ``python -m kvredis.testing.cluster``: a local
cluster that outlives the command, usable by the index, and gone after ``down``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvredis import PodEntry, RedisIndexConfig, new_redis_index
from kvredis.testing.servers import server_binary

pytestmark = [pytest.mark.redis, pytest.mark.cluster]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("kind", "launcher"),
    [
        ("redis", "cli"),
        ("valkey", "module"),
    ],
)
def test_a_cluster_started_by_one_command_serves_the_index_until_cluster_down(
    kind: str, launcher: str, tmp_path: Path
) -> None:
    if server_binary(kind) is None:
        pytest.skip(f"no {kind} binary")
    state = tmp_path / "cluster.json"
    if launcher == "cli":
        up = [sys.executable, "-m", "kvredis", "cluster-up", "--kind", kind, "--state", str(state)]
        down = [sys.executable, "-m", "kvredis", "cluster-down", "--state", str(state)]
    else:
        module = [sys.executable, "-m", "kvredis.testing.cluster"]
        up = [*module, "up", "--kind", kind, "--state", str(state)]
        down = [*module, "down", "--state", str(state)]
    started = _run(*up)
    assert started.returncode == 0, started.stderr
    url = started.stdout.strip()
    assert url.startswith("redis+cluster://127.0.0.1:")
    recorded = json.loads(state.read_text())
    try:
        assert len(recorded["pids"]) == 6 and all(_alive(p) for p in recorded["pids"])
        again = _run(*up)
        assert again.returncode == 1 and "already running" in again.stderr
        index = new_redis_index(RedisIndexConfig(address=url, namespace="up"))
        try:
            index.add(None, [1, 2, 3], [PodEntry("pod-a", "gpu")])
            assert index.score([1, 2, 3]) == {"pod-a": 3.0}
        finally:
            index.close()
    finally:
        stopped = _run(*down)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped 6 nodes" in stopped.stdout
    assert not any(_alive(p) for p in recorded["pids"])
    assert not state.exists()
    assert not any(Path(d).exists() for d in recorded["dirs"])
    gone = _run(*down)
    assert gone.returncode == 1 and "cluster-up" in gone.stderr

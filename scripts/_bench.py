"""What the benchmarks share: a Redis server to run against, percentiles and the common options.

Benchmarks are run as files, from any directory: ``.venv/bin/python scripts/bench_X.py``.
Python then puts this folder first on ``sys.path``, so a benchmark imports this module (and
``reference_layout``) by its bare name, and ``kvredis`` comes from the editable install. The
redis-server fixture of the test suite (``tests/servers.py``) is not installed; importing this
module puts the repository root on ``sys.path`` so that it serves the benchmarks as well. This is
the one place that touches ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The repository checkout the benchmark runs from.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))  # after this folder, before site-packages

from tests.servers import LocalCluster, RedisServer  # noqa: E402

__all__ = [
    "REPO",
    "LocalCluster",
    "RedisServer",
    "bench_parser",
    "callgrind_instructions",
    "percentile",
    "redis_server",
    "write_json",
]


@contextmanager
def redis_server(url: str | None = None) -> Iterator[str]:
    """The URL of the Redis to benchmark: ``url`` itself, or a fresh ``redis-server`` on a free
    loopback port, stopped (and its files removed) on exit."""
    if url is not None:
        yield url
        return
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.close()


def percentile(samples: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``samples`` by the nearest-rank method."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def bench_parser(doc: str | None, quick: str, *, with_json: bool = True) -> argparse.ArgumentParser:
    """The argument parser of a benchmark, described by the first line of its docstring ``doc``,
    with ``--quick`` (a run of seconds; ``quick`` says what it runs) and, if ``with_json``,
    ``--json PATH`` (for :func:`write_json`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick)
    if with_json:
        parser.add_argument(
            "--json", metavar="PATH", help='also write the results as JSON ("-": to stdout)'
        )
    return parser


def write_json(target: str, payload: object) -> None:
    """Write ``payload`` as indented JSON to the file ``target``, or print it when it is ``-``."""
    text = json.dumps(payload, indent=2)
    if target == "-":
        print(text)
    else:
        Path(target).write_text(text + "\n")


def callgrind_instructions(args: list[str]) -> int:
    """The instructions (callgrind's ``Ir``) a Python child running ``args`` (this interpreter's
    arguments: a script and its own) executes under ``valgrind --tool=callgrind``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--cache-sim=no",
                "--branch-sim=no",
                f"--callgrind-out-file={tmp}/callgrind.out",
                sys.executable,
                *args,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(found.group(1))

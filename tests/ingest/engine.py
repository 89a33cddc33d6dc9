"""The engine stand-in the ingestion tests use: :class:`kvredis.testing.engine.FakeEngine`
(shipped for users' suites too), and helpers that watch the ingester's threads."""

from __future__ import annotations

import threading
import time

from kvredis.testing.engine import END, FakeEngine, wait_until

__all__ = ["END", "FakeEngine", "assert_no_leaked_ingesters", "ingester_threads", "wait_until"]


def ingester_threads() -> set[threading.Thread]:
    """The live worker and subscriber threads of every EventIngester in this process."""
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith(("kvredis-ingest-", "kvredis-sub-")) and t.is_alive()
    }


def assert_no_leaked_ingesters(before: set[threading.Thread], timeout: float = 10.0) -> None:
    """Fail if ingester threads started since ``before`` are still running (a missing stop())."""
    deadline = time.monotonic() + timeout
    while True:
        leaked = ingester_threads() - before
        if not leaked:
            return
        if time.monotonic() > deadline:
            names = ", ".join(sorted(t.name for t in leaked))
            raise AssertionError(f"ingester threads still running after the test: {names}")
        time.sleep(0.01)

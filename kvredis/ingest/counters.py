"""What an ingester reports: named counters, and warnings logged at a bounded rate.

Counter names are the members of :class:`Counter`, so a misspelt counter is a type error (and an
``AttributeError``), never a new counter. :meth:`IngestCounters.snapshot` flattens them into the
``{name: value}`` dict metrics exporters read, with one ``rejected.<reason>`` entry per
:class:`~kvredis.ingest.events.RejectReason`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Mapping

from kvredis.ingest.events import RejectReason

__all__ = ["COUNTER_NAMES", "Counter", "IngestCounters", "RateLimitedLog"]


class Counter(enum.Enum):
    """Everything an ingester counts; the value is the name :meth:`IngestCounters.snapshot` uses."""

    MESSAGES = "messages"
    """Messages seen (fed, received or rejected by a transport)."""
    BATCHES = "batches"
    BATCHES_APPLIED = "batches_applied"
    BATCHES_DUPLICATE = "batches_duplicate"
    BATCHES_FAILED = "batches_failed"
    BATCHES_ABANDONED = "batches_abandoned"
    BATCHES_REJECTED = "batches_rejected"
    BATCHES_SUPERSEDED = "batches_superseded"
    """Batches of an engine incarnation a restart already superseded: dropped, never applied."""
    EVENTS = "events"
    EVENTS_APPLIED = "events_applied"
    BLOCKS_STORED = "blocks_stored"
    BLOCKS_REMOVED = "blocks_removed"
    REQUEST_KEYS_STORED = "request_keys_stored"
    TIER_UPDATES = "tier_updates"
    TIER_UPDATE_MISSES = "tier_update_misses"
    PARENT_MISSES = "parent_misses"
    INDEX_CALLS = "index_calls"
    INDEX_LOOKUPS = "index_lookups"
    GAPS = "gaps"
    REPLAYS = "replays"
    REPLAYED_BATCHES = "replayed_batches"
    REPLAY_FAILURES = "replay_failures"
    NAMESPACE_RESETS = "namespace_resets"
    """The stored watermark went back while this ingester had progress: the index lost its data
    (a Redis restart without persistence, a failover to an empty replica, a FLUSHALL)."""
    RESTARTS = "restarts"
    ENGINES_REPLACED = "engines_replaced"
    """An endpoint began publishing another engine's ``kv@<pod>@<model>`` topic: the previous
    engine is gone, and its pod was cleared (on its own stream; the new engine's is its own)."""
    EPOCHS_ADOPTED = "epochs_adopted"
    CLEARS = "clears"
    CLEARS_ALL_BLOCKS_CLEARED = "clears_all_blocks_cleared"
    CLEARS_RESTART = "clears_restart"
    CLEARS_GAP = "clears_gap"
    CLEARS_REPLACED = "clears_replaced"
    PEER_WAITS = "peer_waits"
    TAKEOVERS = "takeovers"
    LOST_OWNERSHIP = "lost_ownership"
    BACKEND_RETRIES = "backend_retries"
    REJECTED = "rejected"
    """Rejections of every reason (``rejected.<reason>`` counts each)."""
    RECEIVED = "received"
    """Messages a transport queued to the workers."""
    CONNECTS = "connects"
    DISCONNECTS = "disconnects"
    TRANSPORT_ERRORS = "transport_errors"

    # members are singletons: hash by identity, in C (Enum's own hash is Python code, and
    # counters are bumped several times per batch)
    __hash__ = object.__hash__


COUNTER_NAMES: tuple[str, ...] = tuple(counter.value for counter in Counter)
"""The names of every :class:`Counter`, in declaration order."""


def _rejected_name(reason: RejectReason) -> str:
    return f"rejected.{reason.value}"


class IngestCounters:
    """Thread-safe counters of everything the ingester counts.

    :meth:`snapshot` returns a flat ``dict``: the names in :data:`COUNTER_NAMES` plus
    ``rejected.<reason>`` for every :class:`~kvredis.ingest.events.RejectReason`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[Counter, int] = dict.fromkeys(Counter, 0)
        self._rejected: dict[RejectReason, int] = dict.fromkeys(RejectReason, 0)

    def inc(self, counter: Counter, amount: int = 1) -> None:
        """Add ``amount`` to ``counter``."""
        with self._lock:
            self._values[counter] += amount

    def add_all(self, amounts: Mapping[Counter, int]) -> None:
        """Add several counters at once."""
        with self._lock:
            for counter, amount in amounts.items():
                self._values[counter] += amount

    def reject(self, reason: RejectReason, amount: int = 1) -> None:
        """Count a rejection (``rejected`` and ``rejected.<reason>``)."""
        with self._lock:
            self._values[Counter.REJECTED] += amount
            self._rejected[reason] += amount

    def get(self, name: Counter | str) -> int:
        """The current value of one counter, by member or by its :meth:`snapshot` name.

        An unknown name raises ``KeyError``.
        """
        if isinstance(name, Counter):
            with self._lock:
                return self._values[name]
        return self.snapshot()[name]

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter, by name."""
        with self._lock:
            out = {counter.value: value for counter, value in self._values.items()}
            for reason, value in self._rejected.items():
                out[_rejected_name(reason)] = value
        return out


class RateLimitedLog:
    """Logs a warning of one kind at most once per ``interval`` seconds, counting the rest."""

    def __init__(self, log: logging.Logger, interval: float) -> None:
        self._log = log
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` unless a ``kind`` warning was logged within the interval."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(kind, (float("-inf"), 0))
            if now - last < self._interval:
                self._last[kind] = (last, suppressed + 1)
                return
            self._last[kind] = (now, 0)
        if suppressed:
            message += f" (+{suppressed} similar suppressed)"
        self._log.warning(message, *args)

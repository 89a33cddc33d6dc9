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


class _Cells:
    """One thread's counts."""

    __slots__ = ("rejected", "values")

    def __init__(self) -> None:
        self.values: dict[Counter, int] = dict.fromkeys(Counter, 0)
        self.rejected: dict[RejectReason, int] = dict.fromkeys(RejectReason, 0)

    def add(self, other: _Cells) -> None:
        for counter, value in other.values.items():
            self.values[counter] += value
        for reason, value in other.rejected.items():
            self.rejected[reason] += value


class IngestCounters:
    """Thread-safe counters of everything the ingester counts.

    :meth:`snapshot` returns a flat ``dict``: the names in :data:`COUNTER_NAMES` plus
    ``rejected.<reason>`` for every :class:`~kvredis.ingest.events.RejectReason`.

    Each thread counts into cells of its own, so counting takes no lock (workers and
    subscribers count several times per message, and a shared lock made them wait on each
    other); reading sums every thread's cells. A read sees every count made before it began;
    counts made while it runs may show in some counters and not yet in others, as separate
    reads would show them (``rejected`` is always the sum of its reasons: it is added up from
    them when read).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards the list of cells (not the counts: only their thread writes them)."""
        self._local = threading.local()
        self._cells: list[tuple[threading.Thread, _Cells]] = []
        self._ended = _Cells()
        """The counts of threads that ended."""

    def _own(self) -> _Cells:
        """The calling thread's cells, made on its first count. The cells of threads that
        ended are folded together then (a thread ``threading`` did not start is never seen to
        end: its cells stay apart)."""
        try:
            cells: _Cells = self._local.cells
        except AttributeError:
            cells = _Cells()
            with self._lock:
                live = []
                for thread, other in self._cells:
                    if thread.is_alive():
                        live.append((thread, other))
                    else:  # it counts no more: fold its counts in
                        self._ended.add(other)
                live.append((threading.current_thread(), cells))
                self._cells = live
            self._local.cells = cells
        return cells

    def _total(self) -> _Cells:
        total = _Cells()
        with self._lock:
            total.add(self._ended)
            for _, cells in self._cells:
                total.add(cells)
        total.values[Counter.REJECTED] += sum(total.rejected.values())
        return total

    def inc(self, counter: Counter, amount: int = 1) -> None:
        """Add ``amount`` to ``counter``."""
        self._own().values[counter] += amount

    def add_all(self, amounts: Mapping[Counter, int]) -> None:
        """Add several counters at once."""
        values = self._own().values
        for counter, amount in amounts.items():
            values[counter] += amount

    def reject(self, reason: RejectReason, amount: int = 1) -> None:
        """Count a rejection (``rejected`` and ``rejected.<reason>``)."""
        self._own().rejected[reason] += amount  # ``rejected`` is their sum (see _total)

    def get(self, name: Counter | str) -> int:
        """The current value of one counter, by member or by its :meth:`snapshot` name.

        An unknown name raises ``KeyError``.
        """
        if isinstance(name, Counter) and name is not Counter.REJECTED:
            with self._lock:
                return self._ended.values[name] + sum(c.values[name] for _, c in self._cells)
        return self.snapshot()[name.value if isinstance(name, Counter) else name]

    def snapshot(self) -> dict[str, int]:
        """Every counter, by name."""
        total = self._total()
        out = {counter.value: value for counter, value in total.values.items()}
        for reason, value in total.rejected.items():
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

"""A worker's queue: the messages received for one ingest worker, in arrival order.

It is bounded twice, as backpressure on the receivers: in messages waiting (``max_items``) and in
payload bytes queued or still held by the worker (``max_bytes``; a message larger than that
waits for an empty queue). Receivers put bursts and the worker takes everything waiting (up to
its call size) under one lock, so a message costs no lock of its own on either side.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["WorkQueue"]

T = TypeVar("T")

_CLOSED_POLL_S = 0.1
"""How often a receiver blocked on a full queue looks whether the ingester is closing."""


class WorkQueue(Generic[T]):
    """Messages for one worker, bounded in count and in bytes (see the module docstring)."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max(1, max_items)
        self.max_bytes = max_bytes
        self.used = 0
        """Payload bytes queued or held by the worker (released by :meth:`release`)."""
        self._items: deque[tuple[T, int]] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._finished = False

    def put(
        self,
        items: Sequence[T],
        sizes: Sequence[int],
        deadline: float | None,
        closed: threading.Event,
    ) -> int:
        """Queue ``items`` (payload bytes ``sizes``) in order, waiting while the queue is full.

        Returns how many were queued: all of them, or the leading ones queued before ``closed``
        was set, ``deadline`` (``time.monotonic()``) passed or :meth:`finish` was called.
        """
        done = 0
        with self._lock:
            for item, size in zip(items, sizes, strict=True):
                while len(self._items) >= self.max_items or (
                    self.used and self.used + size > self.max_bytes
                ):
                    if closed.is_set() or self._finished:
                        return done
                    wait = _CLOSED_POLL_S
                    if deadline is not None:
                        wait = min(wait, deadline - time.monotonic())
                        if wait <= 0:
                            return done
                    self._not_full.wait(wait)
                if closed.is_set() or self._finished:
                    return done
                self._items.append((item, size))
                self.used += size
                done += 1
                if len(self._items) == 1:  # the worker waits only on an empty queue
                    self._not_empty.notify()
        return done

    def take(self, limit: int) -> list[tuple[T, int]] | None:
        """Every waiting item with its size, at most ``limit``, waiting for the first one;
        ``None`` once :meth:`finish` was called and nothing is left. Their bytes stay counted
        until :meth:`release`."""
        with self._lock:
            while not self._items:
                if self._finished:
                    return None
                self._not_empty.wait()
            items = self._items
            out = [items.popleft() for _ in range(min(limit, len(items)))]
            self._not_full.notify_all()
            return out

    def release(self, size: int) -> None:
        """The worker is done with items of ``size`` payload bytes in all."""
        with self._lock:
            self.used -= size
            self._not_full.notify_all()

    def drain(self) -> list[tuple[T, int]]:
        """Remove every waiting item (with its size) and release its bytes."""
        with self._lock:
            out = list(self._items)
            self._items.clear()
            self.used -= sum(size for _, size in out)
            self._not_full.notify_all()
            return out

    def finish(self) -> None:
        """Nothing more will be put (a :meth:`put` from now on queues nothing): :meth:`take`
        returns what is left, then ``None``."""
        with self._lock:
            self._finished = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

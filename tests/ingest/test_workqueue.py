"""A worker's queue: order, both bounds, bursts larger than the queue, closing and finishing."""

from __future__ import annotations

import threading
import time

from kvredis.ingest.workqueue import WorkQueue
from kvredis.testing import wait_until

OPEN = threading.Event()


def items(taken: list[tuple[int, int]] | None) -> list[int]:
    assert taken is not None
    return [item for item, _ in taken]


def test_items_come_out_in_order_at_most_limit_at_a_time() -> None:
    q: WorkQueue[int] = WorkQueue(10, 1000)
    assert q.put([1, 2, 3, 4, 5], [1] * 5, None, OPEN) == 5
    assert items(q.take(3)) == [1, 2, 3]
    assert items(q.take(10)) == [4, 5]
    assert q.used == 5  # held by the worker until released
    q.release(5)
    assert q.used == 0


def test_a_burst_larger_than_the_queue_flows_through_to_the_worker() -> None:
    q: WorkQueue[int] = WorkQueue(2, 1000)
    seen: list[int] = []

    def worker() -> None:
        while (taken := q.take(1)) is not None:
            seen.extend(items(taken))
            q.release(sum(size for _, size in taken))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    put = threading.Thread(target=lambda: q.put(list(range(50)), [1] * 50, None, OPEN), daemon=True)
    put.start()
    put.join(10)
    assert not put.is_alive(), "the burst stalled: the worker was not woken"
    q.finish()
    thread.join(10)
    assert seen == list(range(50))


def test_the_byte_bound_holds_until_the_worker_releases() -> None:
    q: WorkQueue[str] = WorkQueue(10, 10)
    assert q.put(["a"], [6], None, OPEN) == 1
    assert q.put(["b"], [6], time.monotonic() + 0.05, OPEN) == 0  # 12 > 10: waits, times out
    assert items(q.take(5)) == ["a"]
    assert q.put(["b"], [6], time.monotonic() + 0.05, OPEN) == 0  # "a" is still held
    q.release(6)
    assert q.put(["b", "c"], [6, 4], None, OPEN) == 2


def test_a_message_larger_than_the_bound_waits_for_an_empty_queue() -> None:
    q: WorkQueue[str] = WorkQueue(10, 10)
    assert q.put(["small"], [1], None, OPEN) == 1
    assert q.put(["big"], [25], time.monotonic() + 0.05, OPEN) == 0
    q.take(5)
    q.release(1)
    assert q.put(["big"], [25], None, OPEN) == 1


def test_the_count_bound_waits_for_a_take() -> None:
    q: WorkQueue[int] = WorkQueue(2, 1000)
    assert q.put([1, 2, 3], [1, 1, 1], time.monotonic() + 0.05, OPEN) == 2
    assert items(q.take(1)) == [1]
    assert q.put([3], [1], None, OPEN) == 1
    assert items(q.take(5)) == [2, 3]


def test_closing_returns_how_many_were_queued() -> None:
    q: WorkQueue[int] = WorkQueue(1, 1000)
    closed = threading.Event()
    result: list[int] = []
    put = threading.Thread(
        target=lambda: result.append(q.put([1, 2, 3], [1] * 3, None, closed)), daemon=True
    )
    put.start()
    wait_until(lambda: q.used == 1)  # the first is queued; the second waits for room
    closed.set()
    put.join(5)
    assert result == [1]
    assert q.put([4], [1], None, closed) == 0


def test_finish_lets_the_worker_take_what_is_left_then_end() -> None:
    q: WorkQueue[int] = WorkQueue(10, 1000)
    q.put([1, 2], [1, 1], None, OPEN)
    q.finish()
    assert items(q.take(10)) == [1, 2]
    assert q.take(10) is None
    assert q.put([3], [1], None, OPEN) == 0  # finished: nothing more is queued
    waiting: WorkQueue[int] = WorkQueue(10, 1000)
    result: list[object] = []
    take = threading.Thread(target=lambda: result.append(waiting.take(10)), daemon=True)
    take.start()
    time.sleep(0.05)
    waiting.finish()
    take.join(5)
    assert result == [None]


def test_drain_removes_the_waiting_items_and_their_bytes() -> None:
    q: WorkQueue[int] = WorkQueue(10, 1000)
    q.put([1, 2, 3], [5, 6, 7], None, OPEN)
    assert items(q.take(1)) == [1]
    assert q.drain() == [(2, 6), (3, 7)]
    assert q.used == 5  # the taken one is still held
    q.finish()
    assert q.take(10) is None

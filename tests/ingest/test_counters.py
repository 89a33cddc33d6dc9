"""Counter names are a closed set; the snapshot keeps its flat shape."""

from __future__ import annotations

import threading

import pytest

from kvredis.ingest.counters import COUNTER_NAMES, Counter, IngestCounters
from kvredis.ingest.events import RejectReason

#: The flat names metrics exporters read (they must not change).
NAMES = [
    "messages",
    "batches",
    "batches_applied",
    "batches_duplicate",
    "batches_failed",
    "batches_abandoned",
    "batches_rejected",
    "batches_superseded",
    "events",
    "events_applied",
    "blocks_stored",
    "blocks_removed",
    "request_keys_stored",
    "tier_updates",
    "tier_update_misses",
    "parent_misses",
    "index_calls",
    "index_lookups",
    "gaps",
    "replays",
    "replayed_batches",
    "replay_failures",
    "namespace_resets",
    "restarts",
    "engines_replaced",
    "epochs_adopted",
    "clears",
    "clears_all_blocks_cleared",
    "clears_restart",
    "clears_gap",
    "clears_replaced",
    "peer_waits",
    "takeovers",
    "lost_ownership",
    "backend_retries",
    "rejected",
    "received",
    "connects",
    "disconnects",
    "transport_errors",
]


def test_snapshot_is_the_flat_dict_of_every_name() -> None:
    counters = IngestCounters()
    counters.inc(Counter.CLEARS)
    counters.add_all({Counter.CLEARS: 2, Counter.GAPS: 1})
    counters.reject(RejectReason.NO_POD, 2)
    snapshot = counters.snapshot()
    assert list(COUNTER_NAMES) == NAMES
    assert list(snapshot) == NAMES + [f"rejected.{r.value}" for r in RejectReason]
    assert (snapshot["clears"], snapshot["gaps"]) == (3, 1)
    assert (snapshot["rejected"], snapshot["rejected.no_pod"]) == (2, 2)
    assert counters.get("rejected.no_pod") == counters.get(Counter.REJECTED) == 2


def test_a_misspelt_counter_is_an_error_not_a_new_counter() -> None:
    counters = IngestCounters()
    with pytest.raises(AttributeError):
        counters.inc(Counter.CLEAR)  # type: ignore[attr-defined]
    with pytest.raises(KeyError):
        counters.inc("clears")  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        counters.get("clear")
    assert set(counters.snapshot()) == set(NAMES) | {f"rejected.{r.value}" for r in RejectReason}


def test_counts_from_many_threads_add_up_exactly() -> None:
    counters = IngestCounters()
    start = threading.Barrier(8)

    def count() -> None:
        start.wait()
        for _ in range(5000):
            counters.inc(Counter.MESSAGES)
            counters.add_all({Counter.EVENTS: 2, Counter.BATCHES: 1})
            counters.reject(RejectReason.NO_POD)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    c = counters.snapshot()
    assert (c["messages"], c["events"], c["batches"]) == (40_000, 80_000, 40_000)
    assert c["rejected"] == c["rejected.no_pod"] == counters.get(Counter.REJECTED) == 40_000


def test_the_counts_of_threads_that_ended_stay_and_their_cells_go() -> None:
    counters = IngestCounters()
    for _ in range(50):
        thread = threading.Thread(target=counters.inc, args=(Counter.GAPS, 3))
        thread.start()
        thread.join()
    counters.inc(Counter.GAPS)
    assert counters.get(Counter.GAPS) == 151
    assert counters.snapshot()["gaps"] == 151
    assert len(counters._cells) <= 2  # the cells of ended threads were folded together


def test_reads_while_threads_come_and_go_see_every_count_once() -> None:
    counters = IngestCounters()
    stop = threading.Event()
    seen: list[tuple[int, int, int]] = []

    def read() -> None:
        while not stop.is_set():
            c = counters.snapshot()
            seen.append((c["gaps"], c["rejected"], c["rejected.no_pod"] + c["rejected.bad_event"]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for _ in range(200):  # short-lived threads: their cells are folded in while reads run
        thread = threading.Thread(
            target=lambda: [
                counters.inc(Counter.GAPS),
                counters.reject(RejectReason.NO_POD),
                counters.reject(RejectReason.BAD_EVENT, 2),
            ]
        )
        thread.start()
        thread.join()
    stop.set()
    reader.join(10)
    assert counters.get(Counter.GAPS) == 200 and counters.get(Counter.REJECTED) == 600
    assert all(rejected == reasons for _, rejected, reasons in seen)  # within each read
    gaps = [g for g, _, _ in seen]
    assert gaps == sorted(gaps) and max(gaps, default=0) <= 200  # never a count twice

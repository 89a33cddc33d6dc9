"""The ingest protocol stepped action by action on a fake clock: every verdict, no threads.

Replicas share one real InMemoryIndex through the real IndexBackend; the tests decide when each
replica acts, when time passes and when shutdown begins (see tests/ingest/harness.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest

from kvredis.batch import Watermark
from kvredis.errors import BackendUnavailableError
from kvredis.index import ClearProgress
from kvredis.ingest.config import IngesterConfig
from kvredis.ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvredis.ingest.sequencer import (
    Action,
    ApplyOps,
    ApplyStep,
    BatchGroup,
    BatchOutcome,
    ClearPod,
    Failed,
    FetchReplay,
    LookupRequestKey,
    OpenReplay,
    ReadWatermark,
    SleepUntil,
    drive,
)
from kvredis.ingest.stream import CLEAR_PHASE, PHASE_DONE, stream_position
from kvredis.memory import InMemoryIndex
from tests.ingest.harness import (
    CONFIG,
    POD,
    STREAM,
    TOPIC,
    FakeClock,
    FakeReplay,
    Replica,
    Stepper,
    batch,
    block_tokens,
    held,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def index() -> InMemoryIndex:
    return InMemoryIndex()


def mark(epoch: int, seq: int, phase: int = PHASE_DONE) -> Watermark:
    return Watermark(epoch, stream_position(seq, phase))


def waited(clock: FakeClock) -> float:
    """Seconds the fake clock moved since the test began."""
    return clock.now - 1000.0


def steps_of(replica: Replica) -> list[Watermark]:
    """The watermarks of every step the replica attempted, in order."""
    return [a.watermark for a in replica.trace if isinstance(a, ApplyStep)]


def clear_batch(n: int) -> bytes:
    """A multi-step batch: AllBlocksCleared (claim, clear) then block ``n`` (last step)."""
    return batch(n, AllBlocksCleared())


def is_clear(action: Action) -> bool:
    return isinstance(action, ClearPod)


def is_sleep(action: Action) -> bool:
    return isinstance(action, SleepUntil)


def on_nth(kind: type, n: int, then: Any) -> Any:
    """A hook that calls ``then()`` before the ``n``-th action of type ``kind`` (1-based)."""
    seen = [0]

    def hook(action: Action) -> None:
        if isinstance(action, kind):
            seen[0] += 1
            if seen[0] == n:
                then()

    return hook


# -- the common path ------------------------------------------------------------------------


def test_in_order_batches_take_one_fenced_step_each(index: InMemoryIndex, clock: FakeClock) -> None:
    r = Replica(index, clock)
    assert [r.process(s, batch(s)) for s in range(3)] == [BatchOutcome.APPLIED] * 3
    assert [type(a) for a in r.trace] == [ReadWatermark, ApplyStep, ApplyStep, ApplyStep]
    assert steps_of(r) == [mark(0, s) for s in range(3)]
    assert index.get_watermark(STREAM) == mark(0, 2)
    assert held(index, range(3)) == {0, 1, 2}
    assert clock.now == 1000.0  # nothing waited


def test_without_watermarks_ops_apply_unfenced(index: InMemoryIndex, clock: FakeClock) -> None:
    r = Replica(index, clock, IngesterConfig(use_watermarks=False))
    r.feed(range(2))
    assert [type(a) for a in r.trace] == [ApplyOps, ApplyOps]
    assert index.get_watermark(STREAM) is None
    # seq going back is a restart at once: no watermark to consult, nothing to wait for
    assert r.process(0, batch(9)) is BatchOutcome.APPLIED
    assert [type(a) for a in r.trace[2:]] == [ClearPod, ApplyOps]
    assert held(index, [0, 1, 9]) == {9}


def test_parent_evicted_earlier_in_the_batch_flushes_then_looks_up(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    r = Replica(index, clock)
    r.process(0, batch(0))
    payload = encode_batch([BlockRemoved((1,)), BlockStored((2,), 1, block_tokens(1), 16)])
    assert r.process(1, payload) is BatchOutcome.APPLIED
    # the eviction is applied as a claiming step before the parent is read back
    assert [type(a) for a in r.trace[2:]] == [ApplyStep, LookupRequestKey, ApplyStep]
    assert steps_of(r)[1:] == [mark(0, 1, 1), mark(0, 1)]
    assert r.count("parent_misses") == 1


# -- duplicates -----------------------------------------------------------------------------


def test_fresh_subscriber_within_the_restart_window_skips_what_a_peer_applied(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(6))
    assert b.process(3, batch(3)) is BatchOutcome.DUPLICATE  # 5 - 3 <= restart_window
    assert b.trace == [ReadWatermark(STREAM), OpenReplay(b.stream.endpoint)]
    assert [b.process(s, batch(s)) for s in (4, 5, 6)] == [
        BatchOutcome.DUPLICATE,
        BatchOutcome.DUPLICATE,
        BatchOutcome.APPLIED,
    ]
    assert b.count("clears") == 0 and clock.now == 1000.0


def test_refused_claim_on_a_batch_a_peer_applied_meanwhile_is_a_duplicate(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    slow = b.begin(0, batch(0))
    slow.step()  # b read the (empty) watermark: batch 0 looks new
    assert isinstance(slow.pending, ApplyStep)
    assert a.process(0, batch(0)) is BatchOutcome.APPLIED
    assert slow.finish() is BatchOutcome.DUPLICATE
    assert [type(x) for x in b.trace] == [ReadWatermark, ApplyStep, ReadWatermark]
    assert (b.count("batches_duplicate"), b.count("batches_applied")) == (1, 0)


# -- gaps -----------------------------------------------------------------------------------


def test_gap_filled_by_replay(index: InMemoryIndex, clock: FakeClock) -> None:
    replay = FakeReplay({s: batch(s) for s in range(4)})  # it buffers what it sent, 3 too
    r = Replica(index, clock, replay=replay)
    r.process(0, batch(0))
    assert r.process(3, batch(3)) is BatchOutcome.APPLIED
    assert replay.requests == [1]
    assert steps_of(r) == [mark(0, s) for s in range(4)]
    assert held(index, range(4)) == {0, 1, 2, 3}
    assert (r.count("gaps"), r.count("replayed_batches"), r.count("clears")) == (1, 2, 0)


def test_gap_beyond_the_replay_buffer_clears_then_applies_the_tail(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    replay = FakeReplay({s: batch(s) for s in (3, 4, 5)})  # 1 and 2 fell out of the buffer
    r = Replica(index, clock, replay=replay)
    r.process(0, batch(0))
    assert r.process(5, batch(5)) is BatchOutcome.APPLIED
    start = r.trace.index(FetchReplay(r.stream.endpoint, 1))
    kinds = [type(a) for a in r.trace[start:]]
    # peers get peer_grace_s to cover the gap; then the batch claims itself at a clear phase
    # (no peer can apply a batch of the gap after the clear), clears, and applies the replayed
    # tail and itself as its last step
    assert kinds[1] is ReadWatermark and SleepUntil in kinds
    assert kinds[-3:] == [ApplyStep, ClearPod, ApplyStep]
    assert steps_of(r)[1:] == [mark(0, 5, CLEAR_PHASE), mark(0, 5)]
    assert held(index, range(6)) == {3, 4, 5}
    assert (r.count("replay_failures"), r.count("clears_gap")) == (1, 1)
    assert waited(clock) == pytest.approx(CONFIG.peer_grace_s, abs=CONFIG.poll_interval_s)


def test_replay_of_a_restarted_publisher_is_not_used(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """The engine restarted unseen: its buffer holds the new incarnation's batches 1..3."""
    replay = FakeReplay({s: batch(50 + s) for s in range(4)})
    r = Replica(index, clock, replay=replay)
    r.process(0, batch(0))
    assert r.process(3, batch(3)) is BatchOutcome.APPLIED
    assert (r.count("replay_failures"), r.count("replayed_batches")) == (1, 0)
    assert held(index, [0, 3, 51, 52]) == {3}


def test_unreachable_replay_is_a_failure_and_the_gap_clears(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    replay = FakeReplay()
    replay.reachable = False
    r = Replica(index, clock, replay=replay)
    r.process(0, batch(0))
    assert r.process(2, batch(2)) is BatchOutcome.APPLIED
    assert replay.requests == [1]
    assert (r.count("replays"), r.count("replay_failures"), r.count("clears_gap")) == (1, 1, 1)
    assert held(index, range(3)) == {2}


def test_gap_before_anything_of_the_epoch_was_applied_clears_without_waiting(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """A peer may have applied the first batches of the gap: the rest would be refused to it."""
    r = Replica(index, clock)
    assert r.process(7, batch(7)) is BatchOutcome.APPLIED
    assert [type(a) for a in r.trace] == [ReadWatermark, OpenReplay, ApplyStep, ClearPod, ApplyStep]
    assert (r.count("gaps"), r.count("clears_gap")) == (1, 1)
    assert clock.now == 1000.0


def test_without_watermarks_a_gap_before_anything_was_applied_does_not_clear(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    r = Replica(index, clock, IngesterConfig(use_watermarks=False))
    assert r.process(7, batch(7)) is BatchOutcome.APPLIED
    assert [type(a) for a in r.trace] == [OpenReplay, ApplyOps]
    assert (r.count("gaps"), r.count("clears")) == (1, 0)


def test_gap_covered_by_a_peer_within_the_grace_does_not_clear(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(1))
    b.feed(range(1))
    b.hooks.append(on_nth(SleepUntil, 2, lambda: a.feed(range(1, 4))))
    assert b.process(4, batch(4)) is BatchOutcome.APPLIED
    assert b.count("clears") == 0
    assert held(index, range(5)) == {0, 1, 2, 3, 4}
    assert clock.now < 1000.0 + CONFIG.peer_grace_s


# -- restarts and epochs --------------------------------------------------------------------


def test_seq_going_back_is_a_restart(index: InMemoryIndex, clock: FakeClock) -> None:
    r = Replica(index, clock)
    r.feed(range(3))
    mark_before = len(r.trace)
    assert r.process(0, batch(9)) is BatchOutcome.APPLIED
    restart = r.trace[mark_before:]
    assert [type(a) for a in restart] == [ApplyStep, ClearPod, ApplyStep, ApplyStep]
    assert isinstance(restart[1], ClearPod) and restart[1].pod == POD
    assert steps_of(r)[3:] == [mark(1, -1, 1), mark(1, -1), mark(1, 0)]
    assert held(index, [0, 1, 2, 9]) == {9}
    assert (r.count("restarts"), r.count("clears_restart"), r.count("gaps")) == (1, 1, 0)


def both_fed(index: InMemoryIndex, clock: FakeClock, n: int = 3) -> tuple[Replica, Replica]:
    """Two replicas that both handled batches ``0..n-1``."""
    a, b = Replica(index, clock), Replica(index, clock)
    for r in (a, b):
        r.feed(range(n))
    return a, b


def test_two_replicas_that_see_one_restart_clear_once(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = both_fed(index, clock)
    a.process(0, batch(9))
    assert b.process(0, batch(9)) is BatchOutcome.DUPLICATE
    assert (a.count("clears") + b.count("clears"), b.count("restarts")) == (1, 1)
    assert b.stream.epoch == 1
    assert b.process(1, batch(10)) is BatchOutcome.APPLIED
    assert index.get_watermark(STREAM) == mark(1, 1)


def test_fresh_subscriber_far_below_with_a_quiet_stream_is_a_restart(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(20))
    assert b.process(2, batch(50)) is BatchOutcome.APPLIED
    # the grace expired: nobody moved
    assert waited(clock) == pytest.approx(CONFIG.peer_grace_s, abs=CONFIG.poll_interval_s)
    assert (b.count("restarts"), b.count("clears_restart")) == (1, 1)
    assert index.get_watermark(STREAM) == mark(1, 2)
    assert held(index, [*range(20), 50]) == {50}


def test_fresh_subscriber_far_below_sees_the_stream_move_so_a_peer_is_ahead(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(20))
    b.hooks.append(on_nth(SleepUntil, 2, lambda: a.feed([20])))
    assert b.process(2, batch(2)) is BatchOutcome.DUPLICATE
    assert clock.now < 1000.0 + CONFIG.peer_grace_s
    assert (b.count("restarts"), b.count("clears")) == (0, 0)
    assert b.stream.known == (20, PHASE_DONE)


def test_fresh_subscriber_adopts_the_epoch_a_peer_started(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(20))
    # the engine restarted; a saw it first and starts epoch 1 while b waits
    b.hooks.append(on_nth(SleepUntil, 1, lambda: a.process(0, batch(60))))
    assert b.process(0, batch(60)) is BatchOutcome.DUPLICATE
    assert (b.count("epochs_adopted"), b.count("restarts"), b.count("clears")) == (1, 0, 0)
    assert (b.stream.epoch, b.stream.known) == (1, (0, PHASE_DONE))
    assert a.count("clears_restart") == 1
    assert b.process(1, batch(61)) is BatchOutcome.APPLIED
    assert index.get_watermark(STREAM) == mark(1, 1)


@pytest.mark.parametrize(
    ("buffered", "restarted"),
    [(range(15, 25), False), (range(1), True)],
    ids=["peer-ahead", "restart"],
)
def test_fresh_subscriber_probes_replay_instead_of_waiting(
    index: InMemoryIndex, clock: FakeClock, buffered: range, restarted: bool
) -> None:
    a = Replica(index, clock)
    a.feed(range(20))
    replay = FakeReplay({s: batch(70 + s) for s in buffered})
    b = Replica(index, clock, replay=replay)
    outcome = b.process(0, batch(70))
    assert replay.requests == [19]  # does the publisher still buffer the stored position?
    assert not any(is_sleep(x) for x in b.trace) and clock.now == 1000.0
    if restarted:
        assert outcome is BatchOutcome.APPLIED
        assert (b.count("restarts"), b.count("clears_restart")) == (1, 1)
        assert held(index, [*range(20), 70]) == {70}
    else:
        assert outcome is BatchOutcome.DUPLICATE
        assert (b.count("restarts"), b.count("clears")) == (0, 0)


# -- claims, waits, takeovers ---------------------------------------------------------------


def owner_stalled_mid_batch(
    index: InMemoryIndex, clock: FakeClock
) -> tuple[Replica, Replica, Stepper]:
    """Replicas ``a`` and ``b`` at batch 0; ``a`` claimed multi-step batch 1 and stopped right
    before its clear. Returns ``a``, ``b`` and ``a``'s paused routine."""
    a, b = Replica(index, clock), Replica(index, clock)
    for r in (a, b):
        r.feed(range(1))
    stalled = a.begin(1, clear_batch(1))
    stalled.run_until(is_clear)
    assert index.get_watermark(STREAM) == mark(0, 1, 1)
    return a, b, stalled


def test_waiting_for_a_peer_mid_batch_ends_when_it_finishes(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    _, b, owner = owner_stalled_mid_batch(index, clock)
    b.hooks.append(on_nth(SleepUntil, 3, lambda: owner.finish()))
    assert b.process(1, clear_batch(1)) is BatchOutcome.DUPLICATE
    assert owner.outcome is BatchOutcome.APPLIED
    assert (b.count("peer_waits"), b.count("takeovers"), b.count("clears")) == (1, 0, 0)
    assert index.get_watermark(STREAM) == mark(0, 1)


def test_a_stalled_peer_batch_is_taken_over_after_the_timeout(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    _, b, _ = owner_stalled_mid_batch(index, clock)  # the owner dies there
    assert b.process(1, clear_batch(1)) is BatchOutcome.APPLIED
    assert waited(clock) == pytest.approx(CONFIG.takeover_timeout_s, abs=CONFIG.poll_interval_s)
    assert (b.count("peer_waits"), b.count("takeovers"), b.count("clears")) == (1, 1, 1)
    # the takeover continues the claim at its next phase
    assert mark(0, 1, 2) in steps_of(b)
    assert index.get_watermark(STREAM) == mark(0, 1)
    assert held(index, [0, 1]) == {1}


def test_an_owner_whose_later_step_is_refused_lost_the_batch(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b, owner = owner_stalled_mid_batch(index, clock)
    assert b.process(1, clear_batch(1)) is BatchOutcome.APPLIED  # took it over and finished
    assert owner.finish() is BatchOutcome.DUPLICATE
    assert (a.count("lost_ownership"), a.count("batches_duplicate")) == (1, 1)
    assert a.count("batches_applied") == 1  # only batch 0
    assert index.get_watermark(STREAM) == mark(0, 1)


class SlowClearIndex(InMemoryIndex):
    """A clear that takes ``pages`` pages of ``seconds`` each (on the fake clock)."""

    def __init__(self, clock: FakeClock, pages: int, seconds: float) -> None:
        super().__init__()
        self.clock, self.pages, self.seconds = clock, pages, seconds
        self.seen: list[Watermark | None] = []

    def clear_with_progress(
        self, pod_identifier: str, progress: ClearProgress | None = None
    ) -> int:
        return self._slow(super().clear_with_progress(pod_identifier), progress)

    def clear_entries(
        self,
        pod_identifier: str,
        *,
        device_tiers: Collection[str] | None = None,
        dp_rank: int | None = None,
        progress: ClearProgress | None = None,
    ) -> int:
        removed = super().clear_entries(pod_identifier, device_tiers=device_tiers, dp_rank=dp_rank)
        return self._slow(removed, progress)

    def _slow(self, removed: int, progress: ClearProgress | None) -> int:
        for page in range(self.pages):
            self.clock.advance(self.seconds)
            if progress is not None:
                progress(page + 1, removed)
            self.seen.append(self.get_watermark(STREAM))
        return removed


def test_a_long_clear_heartbeats_its_claim(clock: FakeClock) -> None:
    index = SlowClearIndex(clock, pages=3, seconds=1.5)
    r = Replica(index, clock)
    r.process(0, batch(0))
    assert r.process(1, clear_batch(1)) is BatchOutcome.APPLIED
    assert index.seen == [mark(0, 1, 2), mark(0, 1, 3), mark(0, 1, 4)]
    assert index.get_watermark(STREAM) == mark(0, 1)


# -- shutdown and backend trouble -----------------------------------------------------------


def test_shutdown_while_waiting_for_a_peer_abandons(index: InMemoryIndex, clock: FakeClock) -> None:
    _, b, _ = owner_stalled_mid_batch(index, clock)

    def stop() -> None:
        b.stop.flag = True

    b.hooks.append(on_nth(SleepUntil, 2, stop))
    assert b.process(1, clear_batch(1)) is BatchOutcome.ABANDONED
    assert (b.count("batches_abandoned"), b.count("takeovers"), b.count("clears")) == (1, 0, 0)


def test_shutdown_during_the_restart_or_peer_decision_abandons(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(20))

    def stop() -> None:
        b.stop.flag = True

    b.hooks.append(on_nth(SleepUntil, 1, stop))
    assert b.process(2, batch(50)) is BatchOutcome.ABANDONED
    assert (b.count("restarts"), b.count("clears")) == (0, 0)
    assert held(index, range(20)) == set(range(20))


class FlakyIndex(InMemoryIndex):
    """``apply_batch`` is unavailable ``failures`` times (failing before, or after, applying)."""

    def __init__(self, failures: int, lose_reply: bool = False) -> None:
        super().__init__()
        self.failures, self.lose_reply = failures, lose_reply
        self.failed = 0
        self.on_failure: Callable[[], None] = lambda: None

    def apply_batch(self, ops: Any, stream: Any = None, watermark: Any = None) -> bool:
        if self.failed < self.failures:
            self.failed += 1
            if self.lose_reply:
                super().apply_batch(ops, stream, watermark)
            self.on_failure()
            raise BackendUnavailableError("connection reset")
        return super().apply_batch(ops, stream, watermark)


def test_backend_unavailable_is_retried_with_backoff(clock: FakeClock) -> None:
    index = FlakyIndex(failures=3)
    r = Replica(index, clock)
    assert r.process(0, batch(0)) is BatchOutcome.APPLIED
    assert r.count("backend_retries") == 3
    assert r.count("index_calls") == 1 + 4  # the watermark read, then four attempts
    assert clock.now == pytest.approx(1000.0 + 0.05 + 0.1 + 0.2)
    assert held(index, [0]) == {0}


def test_a_step_whose_reply_was_lost_is_recognized_as_applied(clock: FakeClock) -> None:
    index = FlakyIndex(failures=1, lose_reply=True)
    r = Replica(index, clock)
    assert r.process(0, batch(0)) is BatchOutcome.APPLIED
    assert [type(a) for a in r.trace] == [ReadWatermark, ApplyStep, ReadWatermark]
    assert (r.count("batches_applied"), r.count("batches_duplicate")) == (1, 0)


def test_shutdown_during_a_backend_outage_abandons(clock: FakeClock) -> None:
    index = FlakyIndex(failures=1_000)
    r = Replica(index, clock)

    def stop_on_third_failure() -> None:
        r.stop.flag = index.failed >= 3

    index.on_failure = stop_on_third_failure
    assert r.process(0, batch(0)) is BatchOutcome.ABANDONED
    assert (r.count("backend_retries"), r.count("batches_abandoned")) == (3, 1)
    assert clock.now == pytest.approx(1000.0 + 0.05 + 0.1)  # no wait once shutdown began
    assert index.get_watermark(STREAM) is None


def stalled_opening(
    index: InMemoryIndex, clock: FakeClock, fed: int
) -> tuple[Replica, Replica, Stepper]:
    """Replica a handled batches ``0..fed-1``, saw the engine restart and stalls in epoch 1's
    opening clear (the stepper of its message); replica b is fresh."""
    a, b = Replica(index, clock), Replica(index, clock)
    a.feed(range(fed))
    stalled = a.begin(0, batch(60))
    stalled.run_until(is_clear)
    assert index.get_watermark(STREAM) == mark(1, -1, 1)
    return a, b, stalled


def test_adopting_an_epoch_waits_for_its_opening_clear_then_takes_it_over(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """Issue 13: the epoch a peer opened is followed only once its opening clear is done."""
    a, b, stalled = stalled_opening(index, clock, 20)
    assert b.process(0, batch(60)) is BatchOutcome.APPLIED
    # b waited for the clear, took it over after takeover_timeout_s, then applied batch 0
    assert waited(clock) >= CONFIG.takeover_timeout_s
    assert [type(x) for x in b.trace].count(ClearPod) == 1
    assert b.trace.index(next(x for x in b.trace if is_clear(x))) < len(b.trace) - 1
    assert held(index, [*range(20), 60]) == {60}
    assert stalled.finish() is BatchOutcome.DUPLICATE
    assert (a.count("clears") + b.count("clears"), b.count("takeovers")) == (1, 1)
    assert held(index, range(20)) == set()


def test_a_lagging_replica_drops_two_incarnations_of_backlog(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """Two restarts in a row while b lags: b follows them one regression at a time."""
    a, b = both_fed(index, clock)
    a.feed(range(3, 6))
    a.process(0, batch(30))  # restart 1: epoch 1
    a.process(1, batch(31))
    a.process(0, batch(40))  # restart 2: epoch 2
    assert [b.process(s, batch(s)) for s in range(3, 6)] == [BatchOutcome.SUPERSEDED] * 3
    # b's connection shows restart 1: epoch 1 is not the newest, so its batches are dropped too
    assert [b.process(s, batch(30 + s)) for s in range(2)] == [BatchOutcome.SUPERSEDED] * 2
    # restart 2: b follows epoch 2
    assert b.process(0, batch(40)) is BatchOutcome.DUPLICATE
    assert b.process(1, batch(41)) is BatchOutcome.APPLIED
    assert held(index, [*range(6), 30, 31, 40, 41]) == {40, 41}
    assert index.get_watermark(STREAM) == mark(2, 1)
    assert (a.count("clears") + b.count("clears"), b.count("batches_superseded")) == (2, 5)


def test_a_subscriber_refused_by_a_newer_epoch_drops_then_follows_it_without_clearing(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """Nothing stored at subscription; a peer then opened epoch 1 and applied its batch 0.

    The subscriber's first seq 0 may be the incarnation before epoch 1 (superseded: dropped);
    the next seq 0 is the restart epoch 1 stands for, whose batch 0 the peer applied.
    """
    r = Replica(index, clock)
    drive(r.sequencer.on_subscribe(r.stream), r.perform)
    assert index.apply_batch([], STREAM, mark(1, 0))
    assert r.process(0, batch(2)) is BatchOutcome.SUPERSEDED
    assert r.process(0, batch(3)) is BatchOutcome.DUPLICATE
    assert (r.count("clears"), r.count("clears_restart"), r.count("epochs_adopted")) == (0, 0, 1)
    assert (r.stream.epoch, index.get_watermark(STREAM)) == (1, mark(1, 0))
    assert held(index, [2, 3]) == set()


def test_a_gap_batch_that_takes_over_a_stalled_opening_counts_the_restart_clear(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """b starts while a stalls and missed batch 0 of the new incarnation (a gap, no replay):
    its gap batch takes the opening over, and its clear, the epoch's opening clear, is counted
    once, as a restart clear."""
    a, b, stalled = stalled_opening(index, clock, 3)
    assert b.process(1, batch(61)) is BatchOutcome.APPLIED
    counted = [b.count(name) for name in ("takeovers", "clears", "clears_restart", "clears_gap")]
    assert (counted, waited(clock) >= CONFIG.takeover_timeout_s) == ([1, 1, 1, 0], True)
    assert held(index, [*range(3), 60, 61]) == {61}
    assert index.get_watermark(STREAM) == mark(1, 1)
    assert stalled.finish() is BatchOutcome.DUPLICATE
    assert (a.count("clears"), a.count("lost_ownership")) == (0, 1)


def test_a_subscriber_that_read_an_epoch_opening_takes_seq_0_for_a_new_restart(
    index: InMemoryIndex, clock: FakeClock
) -> None:
    """b subscribes while a opens epoch 1: the batch that made a open it was published before,
    so a seq 0 b receives comes from a later incarnation. b finishes epoch 1's opening (a
    stalled) and opens epoch 2 for it: one epoch and one counted clear per restart."""
    a, b, stalled = stalled_opening(index, clock, 3)
    drive(b.sequencer.on_subscribe(b.stream), b.perform)
    assert b.process(0, batch(70)) is BatchOutcome.APPLIED
    assert index.get_watermark(STREAM) == mark(2, 0)
    assert (b.count("takeovers"), b.count("clears_restart"), b.count("restarts")) == (1, 2, 1)
    assert held(index, [*range(3), 60, 70]) == {70}
    assert stalled.finish() is BatchOutcome.SUPERSEDED
    assert a.count("clears") == 0


# -- batches applied together (BatchGroup) ----------------------------------------------------


def _group(replica: Replica, calls: list[int], fail: bool = False, limit: int = 64) -> BatchGroup:
    def apply_steps(steps: Sequence[Any]) -> Any:
        calls.append(len(steps))
        if fail:
            raise Failed("the index went away")
        return replica.backend.apply_steps(steps)

    return BatchGroup(replica.sequencer, replica.perform, apply_steps, limit)


def test_a_group_of_fast_batches_is_one_index_call_with_the_outcomes_of_one_by_one() -> None:
    index, clock = InMemoryIndex(), FakeClock()
    one, many = Replica(InMemoryIndex(), clock), Replica(index, clock)
    one.feed(range(3))
    many.feed(range(3))  # the stream is synced: the next batches take the fast path
    calls: list[int] = []
    group = _group(many, calls)
    for n in range(3, 13):
        group.handle(n, many.stream, TOPIC, n, batch(n))
    group.flush()
    one.feed(range(3, 13))
    assert calls == [10]
    assert [group.outcomes[n] for n in range(3, 13)] == [BatchOutcome.APPLIED] * 10
    assert held(index, range(13)) == held(one.index, range(13)) == set(range(13))
    assert index.get_watermark(STREAM) == one.index.get_watermark(STREAM)
    for name in ("batches", "batches_applied", "events", "blocks_stored", "messages"):
        assert many.count(name) == one.count(name), name


def test_batches_a_peer_applied_first_are_duplicates_and_the_rest_apply() -> None:
    index, clock = InMemoryIndex(), FakeClock()
    peer, mine = Replica(index, clock), Replica(index, clock)
    for replica in (peer, mine):
        replica.feed(range(2))
    peer.feed(range(2, 5))  # the peer is ahead by three batches
    calls: list[int] = []
    group = _group(mine, calls)
    for n in range(2, 8):
        group.handle(n, mine.stream, TOPIC, n, batch(n))
    group.flush()
    assert calls == [6]  # one call: its first three were skipped, so were the rest
    assert [group.outcomes[n] for n in range(2, 8)] == [BatchOutcome.DUPLICATE] * 3 + [
        BatchOutcome.APPLIED
    ] * 3
    assert held(index, range(8)) == set(range(8))
    # the first two were duplicates too (the peer applied them before this replica saw them)
    assert mine.count("batches_duplicate") == 5 and mine.count("batches_applied") == 3


def test_a_failed_group_is_handled_again_message_by_message() -> None:
    index, clock = InMemoryIndex(), FakeClock()
    replica = Replica(index, clock)
    replica.feed(range(2))
    calls: list[int] = []
    group = _group(replica, calls, fail=True)
    for n in range(2, 6):
        group.handle(n, replica.stream, TOPIC, n, batch(n))
    group.flush()
    assert calls == [4]
    assert [group.outcomes[n] for n in range(2, 6)] == [BatchOutcome.APPLIED] * 4
    assert held(index, range(6)) == set(range(6))
    assert replica.count("batches") == 6 and replica.count("messages") == 6


def test_a_message_that_needs_more_applies_the_group_first() -> None:
    """A gap (a lost batch with no replay) is handled alone, after the batches before it."""
    index, clock = InMemoryIndex(), FakeClock()
    replica = Replica(index, clock)
    replica.feed(range(2))
    calls: list[int] = []
    group = _group(replica, calls)
    for n in (2, 3, 5, 6):  # 4 is lost
        group.handle(n, replica.stream, TOPIC, n, batch(n))
    group.flush()
    assert calls == [2, 1]  # 2 and 3 together, 5 alone (the gap clear), 6 after it
    assert held(index, range(7)) == {5, 6}
    assert replica.count("gaps") == 1

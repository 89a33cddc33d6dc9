"""The ingest protocol as a sans-IO state machine: order, gaps, restarts, epochs, claims, takeovers.

``docs/ingest-protocol.md`` describes the protocol and its limits; this module is its only
implementation. :meth:`Sequencer.on_message` handles one engine message of one stream. It is a
generator: it yields the actions of :mod:`kvredis.ingest.actions` and receives their results,
and returns the :class:`~kvredis.ingest.actions.BatchOutcome`. It makes every decision itself
and performs none of the I/O: no threads, no sleeps, no index or socket calls. Time comes from
the injected ``clock``, shutdown from the injected ``stopping`` flag;
:func:`~kvredis.ingest.actions.drive` runs the generator against a port
(:class:`~kvredis.ingest.backend.IndexBackend`, or a scripted one in tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvredis.batch import IndexOp, Watermark
from kvredis.ingest.actions import (
    Abandoned,
    Action,
    AppendJournal,
    ApplyOps,
    ApplyStep,
    BatchOutcome,
    ClearPod,
    Conflict,
    Failed,
    FetchReplay,
    FreshVerdict,
    Interrupt,
    LookupRequestKey,
    LostOwnership,
    NotOwner,
    OpenReplay,
    ReadJournal,
    ReadWatermark,
    SleepUntil,
    StepResult,
    Steps,
    drive,
)
from kvredis.ingest.config import IngesterConfig
from kvredis.ingest.counters import Counter, IngestCounters
from kvredis.ingest.events import DecodedBatch, Rejection, RejectReason, decode_batch
from kvredis.ingest.planner import (
    Barrier,
    BatchPlan,
    Lookup,
    Planner,
    PlanSteps,
    Recall,
    Reset,
)
from kvredis.ingest.stream import (
    CLEAR_PHASE,
    MAX_ENGINE_SEQ,
    PHASE_DONE,
    PHASE_LAST_STEP,
    StreamState,
    split_position,
    stream_position,
)
from kvredis.ingest.transport import ReplayedMessage

__all__ = [
    "Abandoned",
    "Action",
    "ApplyOps",
    "ApplyStep",
    "BatchGroup",
    "BatchOutcome",
    "BatchRun",
    "ClearPod",
    "Conflict",
    "Failed",
    "FastBatch",
    "FetchReplay",
    "FreshVerdict",
    "Interrupt",
    "LookupRequestKey",
    "LostOwnership",
    "OpenReplay",
    "ReadWatermark",
    "Sequencer",
    "SleepUntil",
    "StepResult",
    "Steps",
    "drive",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# ------------------------------------------------------------------------------------------
# One execution of one batch (possibly several steps)
# ------------------------------------------------------------------------------------------


@dataclass
class _Message:
    topic: bytes
    seq: int
    payload: bytes
    counted: bool = False
    _decoded: DecodedBatch | None = field(default=None, repr=False)
    decode: Callable[[object], DecodedBatch] = field(default=decode_batch, repr=False)
    """The stream's wire format (:meth:`~kvredis.ingest.stream.StreamState.decode`)."""

    @property
    def decoded(self) -> DecodedBatch:
        """The payload, decoded once: a batch re-sequenced, retried or seen again as a duplicate
        is not decoded again."""
        if self._decoded is None:
            self._decoded = self.decode(self.payload)
        return self._decoded


def _stream_scope(st: StreamState, msg: _Message) -> Reset | None:
    """What a clear of ``st``'s pods (a restart, a lost batch) covers: the entries of the one
    data-parallel rank every batch of the stream carried (``msg``'s included; each rank of a
    vLLM pod publishes on its own endpoint, and the other ranks' copies are not in doubt), or
    every entry when the stream carried several ranks."""
    ranks = st.ranks | {msg.decoded.data_parallel_rank or 0}
    if len(ranks) != 1:
        return None
    return Reset(ranks.pop(), None)


class BatchRun:
    """One attempt at applying one batch: its steps, phases and claim (see the protocol doc)."""

    def __init__(
        self,
        seqr: Sequencer,
        st: StreamState,
        epoch: int,
        seq: int,
        claim_seq: int,
        first_phase: int,
        pod: str | None,
    ) -> None:
        self._seqr = seqr
        self.st = st
        self.pod = pod
        self.plan = BatchPlan(seqr.planner.caches.get(pod) if pod is not None else None)
        self.epoch = epoch
        self.seq = seq
        self.claim_seq = claim_seq
        self.phase = first_phase
        self.last_phase = PHASE_LAST_STEP if first_phase >= CLEAR_PHASE else CLEAR_PHASE - 1
        self.steps = 0
        self._last_beat = seqr.clock()

    def _step(self, ops: list[IndexOp], position: int) -> Steps[None]:
        seqr = self._seqr
        if not seqr.fenced:
            if ops:
                yield ApplyOps(ops)
            return
        wm = Watermark(self.epoch, position)
        name = self.st.name
        result: StepResult = yield ApplyStep(ops, name, wm)
        applied = result.applied
        if not applied and result.attempts > 1:
            # an attempt whose reply was lost may have applied: then the stored mark is ours
            stored = yield ReadWatermark(name)
            applied = stored == wm
        if not applied:
            raise NotOwner if self.steps == 0 else LostOwnership
        self.steps += 1
        self.st.known = split_position(position)

    def flush(self) -> Steps[None]:
        """Apply the pending ops as an intermediate step (the first one claims the batch)."""
        if self.phase > self.last_phase:
            raise Failed("too many steps in one batch")
        yield from self._step(self.plan.take(), stream_position(self.claim_seq, self.phase))
        self.phase += 1
        self._last_beat = self._seqr.clock()

    def finish(self) -> Steps[None]:
        """Apply the remaining ops as the batch's last step (phase done)."""
        yield from self._step(self.plan.take(), stream_position(self.seq))

    def heartbeat(self) -> Steps[None]:
        """Advance the claim during a long clear so peers see progress (or learn we lost it)."""
        seqr = self._seqr
        if not seqr.fenced:
            return
        now = seqr.clock()
        if now - self._last_beat < seqr.config.heartbeat_interval_s:
            return
        if self.phase > self.last_phase - 1:
            return
        self._last_beat = now
        yield from self._step([], stream_position(self.claim_seq, self.phase))
        self.phase += 1

    def clear(self, pods: Iterable[str], cause: Counter, scope: Reset | None = None) -> Steps[None]:
        """Clear pods as a step of this batch (after applying what precedes it); with ``scope``
        only the entries of its rank on its tiers."""
        yield from self.flush()
        if cause is Counter.CLEARS_GAP and self.claim_seq < 0:
            # the batch took over a stalled epoch opening: its clear is the opening clear
            cause = Counter.CLEARS_RESTART
        seqr = self._seqr
        caches = seqr.planner.caches
        for pod in sorted(set(pods)):
            if scope is None:
                yield ClearPod(pod, self.heartbeat)
            else:
                yield ClearPod(pod, self.heartbeat, scope.device_tiers, scope.dp_rank)
            caches.drop(pod, tails=scope is None)
            self.plan.count(Counter.CLEARS)
            self.plan.count(cause)
        self.plan.after_clear(
            caches.get(self.pod) if self.pod is not None else None, tails=scope is None
        )
        self._last_beat = seqr.clock()

    def recall(self, pod: str) -> Steps[None]:
        """Replay ``pod``'s page journal into its cache (a journal that cannot be read now is
        not read: the batch plans with what this ingester knows)."""
        try:
            entries: list[bytes] = yield ReadJournal(pod)
        except Failed as exc:
            logger.warning("pod %s: cannot read its page journal: %s", pod, exc)
            entries = []
        restored = self.plan.recall(entries)
        if restored:
            logger.info("pod %s: %d page records recalled from its journal", pod, restored)

    def run_plan(self, planning: PlanSteps) -> Steps[None]:
        """Drive the planner, answering its lookups and applying its barriers."""
        answer: int | None = None
        while True:
            try:
                need = planning.send(answer)
            except StopIteration:
                return
            answer = None
            if isinstance(need, Lookup):
                answer = yield LookupRequestKey(need.engine_key)
            elif need is Barrier.FLUSH:
                yield from self.flush()
            elif isinstance(need, Recall):
                yield from self.recall(need.pod)
            else:
                assert self.pod is not None and isinstance(need, Reset)
                yield from self.clear([self.pod], Counter.CLEARS_ALL_BLOCKS_CLEARED, need)


@dataclass(slots=True)
class FastBatch:
    """A batch planned on the fast path (:meth:`Sequencer.plan_fast`): its one fenced step, to be
    applied together with other streams' and its own stream's later batches."""

    st: StreamState
    msg: _Message
    plan: BatchPlan
    step: ApplyStep
    restore: Callable[[], None]
    """Puts the pod's cache back as it was before this batch taught it."""
    pod: str


PlanFn = Callable[[BatchRun], Steps[None]]
"""What a batch applies: drives a :class:`BatchRun` through its steps (planning, clears)."""

MAX_CLAIM_ATTEMPTS = 8
"""Attempts at one batch (each refused claim a peer's takeover finished, or a reset stored
watermark retried) before it is dropped as failed."""


@dataclass(frozen=True, slots=True)
class BatchJob:
    """One batch for :meth:`Sequencer._run_batch`: what it applies, where its claim starts, and
    how its outcome counts."""

    msg: _Message
    """The engine message the batch comes from (what a newer epoch supersedes)."""
    epoch: int
    seq: int
    """The batch's own position (``-1``: the opening of ``epoch``)."""
    plan: PlanFn
    claim_seq: int
    """Where the claim starts (a takeover moves it to the stalled peer's position)."""
    first_phase: int = 1
    """The first step's phase (:data:`CLEAR_PHASE` for a batch that opens with a gap clear)."""
    pod: str | None = None
    """The pod whose cache the plan uses (``None``: the batch names no pod)."""
    count_batch: bool = True
    """Whether the outcome counts as a batch (an epoch's opening does not)."""
    unusable: bool = False
    """Nothing could be decoded: the batch still advances the watermark (peers see the stream
    move on) but counts as rejected, not applied."""
    supersede: bool = True
    """Whether a newer stored epoch supersedes ``msg`` (else it just ends the batch)."""
    depth: int = 0
    """Re-sequencing depth of ``msg`` (bounded by :meth:`Sequencer._sequence_synced`)."""

    @property
    def plans_clears(self) -> bool:
        """Whether the plan itself clears (an epoch opening, a gap clear): a takeover of its
        claim then redoes nothing but the plan."""
        return self.first_phase >= CLEAR_PHASE or self.seq < 0


@dataclass(slots=True)
class _Claim:
    """Where the next attempt at a batch claims the stream, and what it must redo first."""

    seq: int
    phase: int
    redo_clear: bool = False
    """A stalled peer's claim, taken over, stood for a clear of the stream's pods: redo it."""


# ------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------


class Sequencer:
    """The protocol for every stream of one ingester.

    What it knows of each stream lives in that stream's
    :class:`~kvredis.ingest.stream.StreamState`; the caller handles one stream's messages one at
    a time, in order (different streams may be handled concurrently).
    """

    def __init__(
        self,
        config: IngesterConfig,
        planner: Planner,
        counters: IngestCounters,
        *,
        fenced: bool,
        clock: Callable[[], float],
        stopping: Callable[[], bool],
        reject: Callable[[Rejection, str], None],
    ) -> None:
        self.config = config
        self.planner = planner
        self.counters = counters
        self.fenced = fenced
        """Whether batches are fenced by stored watermarks (a BatchIndex with watermarks on)."""
        self.journaled = planner.caches.journaled
        """Whether applied batches' page records go to the pods' page journals."""
        self.clock = clock
        self.stopping = stopping
        self._reject = reject

    # -- entry point -----------------------------------------------------------------------

    def on_message(
        self,
        st: StreamState,
        topic: object,
        seq: int,
        payload: object,
        decoded: DecodedBatch | None = None,
    ) -> Steps[BatchOutcome]:
        """Handle one engine message of ``st``'s publisher. Never raises on bad input.

        ``decoded`` is the payload already decoded by the stream's wire format (``st.decode``);
        without it the payload is decoded when first needed.
        """
        self.counters.inc(Counter.MESSAGES)
        where = st.endpoint.endpoint
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_ENGINE_SEQ:
            self._reject(Rejection(RejectReason.SEQ_OUT_OF_RANGE, f"seq {seq!r}"), where)
            return BatchOutcome.REJECTED
        if not isinstance(topic, (bytes, bytearray, memoryview)):
            return self._bad_message(f"topic is a {type(topic).__name__}", where)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            return self._bad_message(f"payload is a {type(payload).__name__}", where)
        topic_b = bytes(topic)
        if topic_b:
            st.last_topic = topic_b
        msg = _Message(topic_b, seq, bytes(payload), _decoded=decoded, decode=st.decode)
        try:
            return (yield from self._sequence(st, msg, allow_restart=True))
        finally:
            st.subscribed_before = False

    # -- the fast path ----------------------------------------------------------------------

    def plan_fast(
        self,
        st: StreamState,
        topic: object,
        seq: int,
        payload: object,
        decoded: DecodedBatch | None = None,
    ) -> FastBatch | None:
        """What :meth:`on_message` would do for the common message, without any I/O: a batch of
        the current epoch, next in order, whose plan needs no lookup, flush, clear or read of
        the pod's page journal, and whose only action is its one fenced step (see
        ``docs/ingest-protocol.md``, "Batches applied together").

        Returns ``None``, having changed nothing, for any other message: the caller applies the
        fast batches it holds, then gives this message to :meth:`on_message`. Otherwise the
        message is counted and the stream advanced as if the step were applied (the pod's cache
        learns the batch's mappings): the caller then applies the step and calls
        :meth:`finish_fast` if it applied, else :meth:`undo_fast` on it and on every later fast
        batch of the stream (latest first), then :meth:`resequence` on each in order.
        """
        if not self.fenced or isinstance(seq, bool) or not isinstance(seq, int):
            return None
        if not isinstance(topic, (bytes, bytearray, memoryview)) or not isinstance(
            payload, (bytes, bytearray, memoryview)
        ):
            return None
        last = st.last_seq
        known = st.known
        if (
            not st.synced
            or st.superseded
            or last is None
            or seq != last + 1
            or seq > MAX_ENGINE_SEQ
            or self.clock() >= st.next_reset_check
            or (known is not None and (known[1] != PHASE_DONE or known[0] >= seq))
        ):
            return None
        topic_b = bytes(topic)
        pod, model = st.identity(topic_b)
        if pod is None:
            return None
        msg = _Message(topic_b, seq, bytes(payload), _decoded=decoded, decode=st.decode)
        decoded = msg.decoded
        if not decoded.events and decoded.rejects:
            return None
        plan = BatchPlan(self.planner.caches.get(pod))
        planning = self.planner.plan(plan, decoded, pod, model)
        try:
            planning.send(None)
        except StopIteration:
            pass
        else:
            planning.close()
            return None
        self.counters.add_all(
            {Counter.MESSAGES: 1, Counter.BATCHES: 1, Counter.EVENTS: decoded.total_events}
        )
        if topic_b:
            st.last_topic = topic_b
        st.subscribed_before = False
        msg.counted = True
        for rejection in decoded.rejects:
            self._reject(rejection, st.endpoint.endpoint)
        st.last_seq = seq
        st.pods.add(pod)
        st.ranks.add(decoded.data_parallel_rank or 0)
        ops = plan.take()
        restore = plan.commit_cache_undoably()
        step = ApplyStep(ops, st.name, Watermark(st.epoch, stream_position(seq)))
        return FastBatch(st, msg, plan, step, restore, pod)

    def finish_fast(self, fast: FastBatch) -> BatchOutcome:
        """A fast batch's step applied: count it as :meth:`on_message` would have."""
        fast.st.known = (fast.msg.seq, PHASE_DONE)
        for rejection in fast.plan.rejects:
            self._reject(rejection, fast.st.endpoint.endpoint)
        stats = fast.plan.stats
        stats[Counter.BATCHES_APPLIED] = stats.get(Counter.BATCHES_APPLIED, 0) + 1
        self.counters.add_all(stats)
        return BatchOutcome.APPLIED

    def undo_fast(self, fast: FastBatch) -> None:
        """A fast batch's step did not apply (or is not known to have): put the pod's cache and
        the stream back as they were before it."""
        fast.restore()
        fast.st.last_seq = fast.msg.seq - 1

    def resequence(self, fast: FastBatch) -> Steps[BatchOutcome]:
        """Handle an undone fast batch's message the way :meth:`on_message` does (it is counted
        already): a duplicate, a stream moved on, a superseded incarnation, or apply it."""
        try:
            return (yield from self._sequence(fast.st, fast.msg, allow_restart=True))
        finally:
            fast.st.subscribed_before = False

    def _bad_message(self, detail: str, where: str) -> BatchOutcome:
        self._reject(Rejection(RejectReason.BAD_MESSAGE, detail), where)
        return BatchOutcome.REJECTED

    def on_subscribe(self, st: StreamState) -> Steps[None]:
        """A new subscription to ``st``'s publisher begins: read the stored watermark first.

        Called before the subscription receives anything, it ties the stream to the epoch
        stored at that moment: every message received afterwards comes from that epoch's engine
        incarnation or a later one. (Without it, the watermark is read with the first message.)
        A backend that cannot answer leaves the read to the first message.
        """
        st.last_seq = None
        st.superseded = False
        st.synced = False
        try:
            yield from self._sync(st, once=True)
            st.subscribed_before = True
        except (Abandoned, Failed) as exc:
            logger.warning("stream %s: cannot read the stored watermark yet: %s", st.name, exc)

    def on_replaced(self, st: StreamState) -> Steps[BatchOutcome]:
        """``st``'s endpoint now publishes another engine's topic: ``st``'s engine is gone.

        Its pods are cleared once, as a new epoch of its stream (claimed like a restart's opening
        clear, so HA replicas that all see the change clear once, and a replica still holding
        the old engine's batches drops them as superseded); the new engine's stream is its own
        and is never cleared for it. Only the entries of the stream's data-parallel rank go when
        every batch of the stream carried one.
        """
        self.counters.inc(Counter.ENGINES_REPLACED)
        topic = st.last_topic
        pods = st.pods_for(topic or None)
        logger.warning(
            "stream %s: its endpoint publishes another engine now: clearing %s",
            st.name,
            ", ".join(sorted(pods)) or "nothing",
        )
        try:
            if not st.synced:
                yield from self._sync(st)
        except Failed as exc:
            logger.error("stream %s: cannot read the stored watermark: %s", st.name, exc)
            self.counters.inc(Counter.BATCHES_FAILED)
            return BatchOutcome.FAILED
        except Abandoned:
            self.counters.inc(Counter.BATCHES_ABANDONED)
            return BatchOutcome.ABANDONED
        for pod in pods:
            self.planner.catalog.forget_pod(pod)
            self.planner.caches.drop(pod)
        # the clear covers the stream's one rank (if it had one), not the marker's
        rank = next(iter(st.ranks)) if len(st.ranks) == 1 else None
        marker = _Message(topic, -1, b"", _decoded=DecodedBatch(0.0, (), rank), decode=st.decode)
        st.superseded = False
        st.subscribed_before = False
        new_epoch = st.epoch + 1
        try:
            if (
                self.fenced
                and st.known is not None
                and st.known[0] == -1
                and st.known[1] != PHASE_DONE
            ):
                opened = yield from self._open_epoch(st, st.epoch, marker, supersede=False)
                if opened in (BatchOutcome.ABANDONED, BatchOutcome.FAILED):
                    return opened
            outcome = yield from self._open_epoch(
                st, new_epoch, marker, supersede=False, cause=Counter.CLEARS_REPLACED
            )
        except Abandoned:
            self.counters.inc(Counter.BATCHES_ABANDONED)
            return BatchOutcome.ABANDONED
        if outcome is BatchOutcome.DUPLICATE:
            self.counters.inc(Counter.EPOCHS_ADOPTED)
        if outcome in (BatchOutcome.APPLIED, BatchOutcome.DUPLICATE) and st.epoch < new_epoch:
            st.epoch = new_epoch
            if outcome is BatchOutcome.APPLIED:
                st.known = (-1, PHASE_DONE)
        st.last_seq = None
        return outcome

    # -- sequencing ------------------------------------------------------------------------

    def _sync(self, st: StreamState, once: bool = False) -> Steps[None]:
        """Adopt the stored epoch and position (once per stream and ingester run)."""
        if self.fenced:
            stored: Watermark | None = yield ReadWatermark(st.name, once)
            if stored is not None:
                st.epoch = stored.epoch
                st.known = split_position(stored.seq)
        st.next_reset_check = self.clock() + self.config.reset_check_interval_s
        st.synced = True

    def _sequence(
        self, st: StreamState, msg: _Message, allow_restart: bool, depth: int = 0
    ) -> Steps[BatchOutcome]:
        try:
            try:
                if not st.synced:
                    yield from self._sync(st)
            except Failed as exc:
                logger.error("stream %s: cannot read the stored watermark: %s", st.name, exc)
                self.counters.inc(Counter.BATCHES_FAILED)
                return BatchOutcome.FAILED
            return (yield from self._sequence_synced(st, msg, allow_restart, depth))
        except Abandoned:
            self.counters.inc(Counter.BATCHES_ABANDONED)
            return BatchOutcome.ABANDONED

    def _reset_check(self, st: StreamState) -> Steps[bool]:
        """Read the stored watermark back now and then: did it go back (the index lost its data)?"""
        now = self.clock()
        if not self.fenced or st.known is None or now < st.next_reset_check:
            return False
        st.next_reset_check = now + self.config.reset_check_interval_s
        try:
            stored: Watermark | None = yield ReadWatermark(st.name, once=True)
        except (Abandoned, Failed):
            return False  # the next batch's step will wait out the outage
        mine = (st.epoch, stream_position(*st.known))
        if stored is not None and (stored.epoch, stored.seq) >= mine:
            return False
        self.counters.inc(Counter.NAMESPACE_RESETS)
        logger.error(
            "stream %s: the index lost its data (stored watermark %s, this ingester had reached "
            "epoch %d batch %d): a Redis restart without persistence, a failover to an empty "
            "replica or a flush; recovering what the engine's replay buffer still holds",
            st.name,
            stored,
            st.epoch,
            st.known[0],
        )
        for pod in st.pods:
            self.planner.caches.drop(pod)
            self.planner.catalog.forget_pod(pod)
        if stored is not None:
            st.epoch = stored.epoch
        st.known = None if stored is None else split_position(stored.seq)
        st.last_seq = None
        return True

    def _sequence_synced(
        self, st: StreamState, msg: _Message, allow_restart: bool, depth: int
    ) -> Steps[BatchOutcome]:
        if allow_restart and (yield from self._reset_check(st)):
            # everything from the start of the engine's replay buffer is missing: a gap
            allow_restart = False
        if depth > 4:
            logger.error(
                "stream %s: giving up on batch %d after repeated conflicts", st.name, msg.seq
            )
            self.counters.inc(Counter.BATCHES_FAILED)
            st.last_seq = msg.seq
            return BatchOutcome.FAILED
        seq = msg.seq
        if st.superseded:
            assert st.last_seq is not None
            if seq <= st.last_seq and allow_restart:
                return (yield from self._restart(st, msg, depth))
            return self._count_superseded(st, msg)
        if st.last_seq is None:
            if st.known is None:
                expected = 0
            elif st.subscribed_before and allow_restart:
                # read before subscribing: the batch stored (or claimed) was published before,
                # and so was the batch that made a replica open the epoch (its seq 0 at least)
                kseq = st.known[0]
                expected = max(kseq + 1, 1 if st.epoch > 0 else 0)
            else:
                kseq, kphase = st.known
                expected = kseq + 1 if kphase == PHASE_DONE else max(kseq, 0)
            if seq < expected:
                verdict = FreshVerdict.PEER_AHEAD
                if allow_restart:
                    verdict = yield from self._fresh_verdict(st, msg)
                if verdict is FreshVerdict.RESTART:
                    return (yield from self._restart(st, msg, depth))
                if verdict is FreshVerdict.ADOPTED:
                    if st.known is not None and st.known[0] == -1 and st.known[1] != PHASE_DONE:
                        # the peer's opening clear is still running: wait for it or take it over
                        opened = yield from self._open_epoch(st, st.epoch, msg)
                        if opened not in (BatchOutcome.DUPLICATE, BatchOutcome.APPLIED):
                            return opened
                    return (yield from self._sequence(st, msg, False, depth + 1))
                st.last_seq = seq
                return self._count_duplicate(msg, st)
            if seq > expected:
                return (yield from self._gap(st, expected, msg, depth))
            return (yield from self._apply(st, msg, depth))
        if seq == st.last_seq + 1:
            return (yield from self._apply(st, msg, depth))
        if seq > st.last_seq + 1:
            return (yield from self._gap(st, st.last_seq + 1, msg, depth))
        if allow_restart:
            return (yield from self._restart(st, msg, depth))
        st.last_seq = seq
        return self._count_duplicate(msg, st)

    def _supersede(self, st: StreamState, stored: Watermark, msg: _Message) -> BatchOutcome:
        """A peer started a newer epoch than the one ``msg``'s incarnation belongs to."""
        logger.warning(
            "stream %s: a peer started epoch %d after an engine restart this replica has not "
            "seen yet; dropping batches of the earlier incarnation from %d until seq goes back",
            st.name,
            stored.epoch,
            msg.seq,
        )
        for pod in st.pods_for(msg.topic):
            self.planner.caches.drop(pod)
            self.planner.catalog.forget_pod(pod)
        st.superseded = True
        st.known = None
        return self._count_superseded(st, msg)

    def _count_superseded(self, st: StreamState, msg: _Message) -> BatchOutcome:
        st.last_seq = msg.seq
        if not msg.counted:
            msg.counted = True
            self.counters.inc(Counter.BATCHES)
        self.counters.inc(Counter.BATCHES_SUPERSEDED)
        return BatchOutcome.SUPERSEDED

    def _count_duplicate(self, msg: _Message, st: StreamState) -> BatchOutcome:
        if not msg.counted:
            msg.counted = True
            self.counters.inc(Counter.BATCHES)
        self.counters.inc(Counter.BATCHES_DUPLICATE)
        pod, _ = st.identity(msg.topic)
        if pod is not None:
            decoded = msg.decoded
            st.ranks.add(decoded.data_parallel_rank or 0)
            self.planner.caches.forget_batch(pod, decoded)
        return BatchOutcome.DUPLICATE

    def _fresh_verdict(self, st: StreamState, msg: _Message) -> Steps[FreshVerdict]:
        """A fresh subscription got ``seq`` below the stored position: restart or a peer ahead?

        The replay endpoint settles it: a publisher with nothing at or after the stored
        position has restarted. Without replay, a ``seq`` within ``restart_window`` batches of
        the stored position is a peer slightly ahead; further below, the stored watermark must
        move within ``peer_grace_s`` (a live peer) or it is a restart.
        """
        assert st.known is not None
        stored_seq = st.known[0]
        if st.subscribed_before:
            # the position was read before subscribing: anything received below it was
            # published after it, so by a new incarnation
            return FreshVerdict.RESTART
        has_replay = yield from self._has_replay(st)
        if has_replay and stored_seq >= 0:
            found = yield from self._fetch(st, stored_seq)
            if found is not None:
                restarted = not any(m.seq >= stored_seq for m in found)
                return FreshVerdict.RESTART if restarted else FreshVerdict.PEER_AHEAD
        if not self.fenced:
            return FreshVerdict.RESTART
        if stored_seq - msg.seq <= self.config.restart_window:
            return FreshVerdict.PEER_AHEAD
        before = (st.epoch, st.known)
        deadline = self.clock() + self.config.peer_grace_s
        while self.clock() < deadline and not self.stopping():
            yield SleepUntil(self.clock() + self.config.poll_interval_s)
            stored = yield from self._read_quiet(st.name)
            if stored is None or (stored.epoch, split_position(stored.seq)) == before:
                continue
            if stored.epoch != st.epoch:
                self._adopt_epoch(st, stored, msg)
                return FreshVerdict.ADOPTED
            st.known = split_position(stored.seq)
            return FreshVerdict.PEER_AHEAD
        if self.stopping():
            raise Abandoned  # undecided: clearing on a guess would hurt every replica
        return FreshVerdict.RESTART

    def _adopt_epoch(self, st: StreamState, stored: Watermark, msg: _Message) -> None:
        """Follow the epoch a peer started (it detected a restart and cleared the pod)."""
        self.counters.inc(Counter.EPOCHS_ADOPTED)
        logger.info("stream %s: following epoch %d started by a peer", st.name, stored.epoch)
        for pod in st.pods_for(msg.topic):
            self.planner.caches.drop(pod)
            self.planner.catalog.forget_pod(pod)
        st.epoch = stored.epoch
        st.known = split_position(stored.seq)
        st.last_seq = None

    def _restart(self, st: StreamState, msg: _Message, depth: int) -> Steps[BatchOutcome]:
        self.counters.inc(Counter.RESTARTS)
        pods = st.pods_for(msg.topic)
        logger.warning(
            "stream %s: seq went back to %d (last %s): engine restart, clearing %s",
            st.name,
            msg.seq,
            st.last_seq if st.last_seq is not None else st.known,
            ", ".join(sorted(pods)) or "nothing",
        )
        new_epoch = st.epoch + 1
        st.superseded = False
        for pod in pods:
            self.planner.catalog.forget_pod(pod)
            self.planner.caches.drop(pod)
        if self.fenced and st.known is not None and st.known[0] == -1 and st.known[1] != PHASE_DONE:
            # the epoch followed is still opening (a peer's clear in progress): finish that
            # first, waiting for it or taking it over, so each restart has its epoch and clear
            opened = yield from self._open_epoch(st, st.epoch, msg, supersede=False)
            if opened in (BatchOutcome.ABANDONED, BatchOutcome.FAILED):
                st.last_seq = msg.seq
                return opened
        outcome = yield from self._open_epoch(st, new_epoch, msg)
        if outcome in (BatchOutcome.ABANDONED, BatchOutcome.FAILED, BatchOutcome.SUPERSEDED):
            st.last_seq = msg.seq
            return outcome
        if outcome is BatchOutcome.DUPLICATE:
            self.counters.inc(Counter.EPOCHS_ADOPTED)
        if st.epoch < new_epoch:
            st.epoch = new_epoch
            if outcome is BatchOutcome.APPLIED:
                st.known = (-1, PHASE_DONE)
        st.last_seq = None
        return (yield from self._sequence(st, msg, False, depth + 1))

    def _open_epoch(
        self,
        st: StreamState,
        epoch: int,
        msg: _Message,
        supersede: bool = True,
        cause: Counter = Counter.CLEARS_RESTART,
    ) -> Steps[BatchOutcome]:
        """Open ``epoch`` with a clear of every pod of the stream, or see that a peer did.

        The claim is the epoch's first position, ``(seq -1, phase 1)``: APPLIED when this
        replica cleared, DUPLICATE once a peer's opening clear is done (a clear in progress is
        waited for, a stalled one taken over), SUPERSEDED when a peer is already in a later
        epoch (``msg`` is then dropped and the stream follows ``epoch``'s incarnation, unless
        not ``supersede``: ``msg`` belongs to the later epoch).
        """
        pods = st.pods_for(msg.topic)
        scope = _stream_scope(st, msg)

        def plan(run: BatchRun) -> Steps[None]:
            if pods:
                yield from run.clear(pods, cause, scope)
            else:
                yield from run.flush()

        job = BatchJob(msg, epoch, -1, plan, claim_seq=-1, count_batch=False, supersede=supersede)
        return (yield from self._run_batch(st, job))

    def _gap(
        self, st: StreamState, first_missing: int, msg: _Message, depth: int
    ) -> Steps[BatchOutcome]:
        self.counters.inc(Counter.GAPS)
        logger.info("stream %s: gap, batches %d..%d missing", st.name, first_missing, msg.seq - 1)
        replayed: list[_Message] = []
        has_replay = yield from self._has_replay(st)
        if has_replay:
            found = yield from self._fetch(st, first_missing)
            if found is not None and not any(
                item.seq == msg.seq and item.payload == msg.payload for item in found
            ):
                # the publisher does not hold the batch in hand: it restarted since (its buffer
                # is another incarnation's), or the batch fell out of its buffer
                logger.warning(
                    "stream %s: replay does not hold batch %d as received; not using it",
                    st.name,
                    msg.seq,
                )
                found = None
            if found is not None:
                by_seq: dict[int, _Message] = {}
                for item in found:
                    # later batches are on their way live; applying them now would make them
                    # look like a publisher restart when they arrive
                    if first_missing <= item.seq < msg.seq:
                        by_seq.setdefault(
                            item.seq,
                            _Message(
                                item.topic or st.last_topic,
                                item.seq,
                                item.payload,
                                decode=st.decode,
                            ),
                        )
                expect = first_missing
                while expect in by_seq:
                    replayed.append(by_seq[expect])
                    expect += 1
                if replayed and replayed[-1].seq >= msg.seq - 1:
                    self.counters.inc(Counter.REPLAYED_BATCHES, len(replayed))
                    for replayed_msg in replayed:
                        if st.last_seq is not None and replayed_msg.seq <= st.last_seq:
                            continue
                        yield from self._apply(st, replayed_msg, depth)
                    if st.last_seq is not None and msg.seq <= st.last_seq:
                        return self._count_duplicate(msg, st)
                    return (yield from self._apply(st, msg, depth))
                tail = [by_seq[s] for s in sorted(by_seq) if s < msg.seq and s > first_missing]
                replayed = _contiguous_tail(tail, msg.seq)
            self.counters.inc(Counter.REPLAY_FAILURES)
        if not self.fenced and not st.dirty():
            st.last_seq = msg.seq - 1
            return (yield from self._apply(st, msg, depth))
        if self.fenced and st.dirty():
            covered = yield from self._peers_covered(st, msg.seq - 1)
            if covered:
                st.last_seq = msg.seq - 1
                return (yield from self._apply(st, msg, depth))
        # With watermarks the clear is needed even when nothing of the epoch was applied as far
        # as this replica knows: a peer may have applied the gap's first batches meanwhile, and
        # the rest of the gap would then be refused to it.
        logger.log(
            logging.WARNING if st.dirty() else logging.INFO,
            "stream %s: batches %d..%d are lost, clearing the pod",
            st.name,
            first_missing,
            msg.seq - 1,
        )
        # one batch: claimed at the batch itself, so that no peer applies a batch of the gap
        # after the clear; the replayed tail is applied after the clear, in the same batch
        return (yield from self._apply(st, msg, depth, pre_clear=True, tail=replayed))

    def _peers_covered(self, st: StreamState, last_missing: int) -> Steps[bool]:
        """Wait up to ``peer_grace_s`` for peers to apply the missing batches."""
        deadline = self.clock() + self.config.peer_grace_s
        while True:
            stored = yield from self._read_quiet(st.name)
            if stored is not None and stored.epoch == st.epoch:
                st.known = split_position(stored.seq)
                if stored.seq >= stream_position(last_missing):
                    return True
            if self.stopping():
                raise Abandoned  # undecided: clearing on a guess would hurt every replica
            if self.clock() >= deadline:
                return False
            yield SleepUntil(self.clock() + self.config.poll_interval_s)

    def _read_quiet(self, stream: str) -> Steps[Watermark | None]:
        """The stored watermark, or ``None`` when the backend cannot tell right now."""
        try:
            stored: Watermark | None = yield ReadWatermark(stream)
        except (Abandoned, Failed):
            return None
        return stored

    # -- replay ----------------------------------------------------------------------------

    def _has_replay(self, st: StreamState) -> Steps[bool]:
        if st.has_replay is None:
            st.has_replay = bool((yield OpenReplay(st.endpoint)))
        return st.has_replay

    def _fetch(self, st: StreamState, start: int) -> Steps[list[ReplayedMessage] | None]:
        self.counters.inc(Counter.REPLAYS)
        found: list[ReplayedMessage] | None = yield FetchReplay(st.endpoint, max(start, 0))
        return found

    # -- applying one batch ----------------------------------------------------------------

    def _apply(
        self,
        st: StreamState,
        msg: _Message,
        depth: int,
        pre_clear: bool = False,
        tail: Sequence[_Message] = (),
    ) -> Steps[BatchOutcome]:
        """Decode, plan and apply one batch of the current epoch; updates ``last_seq``.

        ``pre_clear``: the batch opens with a clear of the stream's pods (a gap nobody could
        fill), then applies the replayed batches of ``tail`` (those right before it), then its own.
        """
        st.last_seq = msg.seq
        first = not msg.counted
        msg.counted = True
        if first:
            self.counters.inc(Counter.BATCHES)
        if self.fenced and not pre_clear and st.known_at_least(msg.seq):
            return self._count_duplicate(msg, st)
        where = st.endpoint.endpoint
        pod, model = st.identity(msg.topic)
        decoded = msg.decoded
        if first:
            self.counters.inc(Counter.EVENTS, decoded.total_events)
            for rejection in decoded.rejects:
                self._reject(rejection, where)
            if pod is None:
                detail = f"topic {msg.topic[:80]!r} names no pod"
                self._reject(Rejection(RejectReason.NO_POD, detail), where)
        unusable = pod is None or (not decoded.events and bool(decoded.rejects))
        if pod is None:
            decoded = DecodedBatch(ts=decoded.ts, events=())
        else:
            st.pods.add(pod)
            st.ranks.add(decoded.data_parallel_rank or 0)
        clear_pods = st.pods_for(msg.topic) if pre_clear else set()
        clear_scope = _stream_scope(st, msg) if pre_clear else None
        planner = self.planner
        before: list[tuple[DecodedBatch, str, str | None]] = []
        for earlier in tail:
            self.counters.inc(Counter.BATCHES)
            tail_pod, tail_model = st.identity(earlier.topic)
            tail_decoded = earlier.decoded
            self.counters.inc(Counter.EVENTS, tail_decoded.total_events)
            for rejection in tail_decoded.rejects:
                self._reject(rejection, where)
            if tail_pod is not None:
                before.append((tail_decoded, tail_pod, tail_model))

        def plan(run: BatchRun) -> Steps[None]:
            if pre_clear:
                yield from run.clear(clear_pods, Counter.CLEARS_GAP, clear_scope)
            for tail_decoded, tail_pod, tail_model in before:
                yield from run.run_plan(planner.plan(run.plan, tail_decoded, tail_pod, tail_model))
            if pod is not None:
                yield from run.run_plan(planner.plan(run.plan, decoded, pod, model))

        job = BatchJob(
            msg,
            st.epoch,
            msg.seq,
            plan,
            claim_seq=msg.seq,
            first_phase=CLEAR_PHASE if pre_clear else 1,
            pod=pod,
            unusable=unusable,
            depth=depth,
        )
        outcome = yield from self._run_batch(st, job)
        if tail and outcome is BatchOutcome.APPLIED:
            self.counters.inc(Counter.BATCHES_APPLIED, len(tail))
        return outcome

    def _run_batch(self, st: StreamState, job: BatchJob) -> Steps[BatchOutcome]:
        """Run ``job`` until applied, found duplicate, superseded or given up (each refused claim
        is read back from the stored watermark: :meth:`_refused`)."""
        claim = _Claim(job.claim_seq, job.first_phase)
        # a peer's claim seen in progress is never stepped over: wait for it or take it over
        known = st.known
        peer_claim = (
            self.fenced
            and job.epoch == st.epoch
            and known is not None
            and known[1] != PHASE_DONE
            and stream_position(*known) < stream_position(job.seq)
        )
        for _attempt in range(MAX_CLAIM_ATTEMPTS):
            run = BatchRun(self, st, job.epoch, job.seq, claim.seq, claim.phase, job.pod)
            try:
                try:
                    if peer_claim:
                        peer_claim = False
                        raise NotOwner
                    yield from self._attempt(run, st, job, claim)
                except (NotOwner, LostOwnership) as refused:
                    outcome = yield from self._refused(run, st, job, claim, refused)
                    if outcome is None:
                        continue
                    return outcome
            except Abandoned:
                run.plan.discard_cache()
                self.counters.inc(Counter.BATCHES_ABANDONED)
                return BatchOutcome.ABANDONED
            except Failed as exc:
                run.plan.discard_cache()
                logger.error("stream %s: batch %d failed: %s", st.name, job.seq, exc)
                self.counters.inc(Counter.BATCHES_FAILED)
                return BatchOutcome.FAILED
            outcome = self._applied(run, st, job)
            yield from self.journal([(job.pod, run.plan)])
            return outcome
        logger.error("stream %s: batch %d kept conflicting, dropped", st.name, job.seq)
        self.counters.inc(Counter.BATCHES_FAILED)
        return BatchOutcome.FAILED

    def _attempt(self, run: BatchRun, st: StreamState, job: BatchJob, claim: _Claim) -> Steps[None]:
        """One attempt: the clear a taken-over claim stood for, the plan, the last step."""
        if claim.redo_clear:
            cause = Counter.CLEARS_RESTART if claim.seq < 0 else Counter.CLEARS_GAP
            yield from run.clear(st.pods_for(job.msg.topic), cause, _stream_scope(st, job.msg))
        yield from job.plan(run)
        yield from run.finish()

    def _refused(
        self,
        run: BatchRun,
        st: StreamState,
        job: BatchJob,
        claim: _Claim,
        refused: NotOwner | LostOwnership,
    ) -> Steps[BatchOutcome | None]:
        """A claim of ``job`` was refused: its outcome as the stored watermark tells it, or
        ``None`` to try again (``claim`` moved on for a takeover). Raises :class:`Abandoned`
        or :class:`Failed` when the watermark cannot be read."""
        if isinstance(refused, LostOwnership):
            # a peer took the batch over: wait until it is done (or take it back)
            self.counters.inc(Counter.LOST_OWNERSHIP)
            logger.warning("stream %s: a peer took batch %d over", st.name, job.seq)
        verdict, stored = yield from self._conflict(st, job.epoch, job.seq)
        if verdict is Conflict.ABANDONED:
            raise Abandoned
        if verdict is Conflict.DUPLICATE:
            run.plan.commit_cache()
            if job.count_batch:
                self.counters.inc(Counter.BATCHES_DUPLICATE)
            return BatchOutcome.DUPLICATE
        if verdict is Conflict.TAKEOVER:
            assert stored is not None
            self._take_over(st, job, claim, stored)
            return None
        run.plan.discard_cache()
        if verdict is Conflict.RETRY:
            return None
        assert stored is not None
        if stored.epoch > job.epoch:
            if not job.supersede:
                return BatchOutcome.SUPERSEDED
            # a peer saw an engine restart this replica has not seen yet: the message belongs
            # to an earlier incarnation, and the restart's clear superseded it
            st.epoch = job.epoch
            return self._supersede(st, stored, job.msg)
        # the stream moved past our claim: sequence the message again
        st.known = split_position(stored.seq)
        st.last_seq = None
        return (yield from self._sequence(st, job.msg, False, job.depth + 1))

    def _take_over(self, st: StreamState, job: BatchJob, claim: _Claim, stored: Watermark) -> None:
        """Move ``claim`` past a stalled peer's claim ``stored`` (the next attempt finishes it)."""
        self.counters.inc(Counter.TAKEOVERS)
        sseq, sphase = split_position(stored.seq)
        logger.warning(
            "stream %s: peer stalled at batch %d phase %d, taking over", st.name, sseq, sphase
        )
        claim.seq, claim.phase = sseq, sphase + 1
        if job.plans_clears and job.seq >= 0:
            claim.phase = max(claim.phase, CLEAR_PHASE)
        # the claim stood for a clear (below the batch, or at a clear phase): redo it
        claim.redo_clear = not job.plans_clears and (sseq < job.seq or sphase >= CLEAR_PHASE)

    def journal(self, applied: Iterable[tuple[str | None, BatchPlan]]) -> Steps[None]:
        """Append the page journal entries of batches that took effect (their pods' records:
        a failure loses records, which are parent misses later, never wrong keys)."""
        if not self.journaled:
            return
        entries = tuple(
            (pod, entry)
            for pod, plan in applied
            if pod is not None and (entry := plan.journal_entry()) is not None
        )
        if not entries:
            return
        try:
            yield AppendJournal(entries)
        except Interrupt as exc:
            logger.warning("cannot append to the page journals: %s", exc)

    def _applied(self, run: BatchRun, st: StreamState, job: BatchJob) -> BatchOutcome:
        """The batch's last step applied: its cache, rejects and counters take effect."""
        counters = self.counters
        run.plan.commit_cache()
        for rejection in run.plan.rejects:
            self._reject(rejection, st.endpoint.endpoint)
        counters.add_all(run.plan.stats)
        if not self.fenced:
            st.known = (job.seq, PHASE_DONE)
        if job.unusable:
            counters.inc(Counter.BATCHES_REJECTED)
            return BatchOutcome.REJECTED
        if job.count_batch:
            counters.inc(Counter.BATCHES_APPLIED)
        return BatchOutcome.APPLIED

    def _conflict(
        self, st: StreamState, epoch: int, seq: int
    ) -> Steps[tuple[Conflict, Watermark | None]]:
        """Why a claim was refused: duplicate, a peer mid-batch (wait/takeover), or moved on."""
        target = stream_position(seq)
        last: Watermark | None = None
        since = self.clock()
        waited = False
        while True:
            stored: Watermark | None = yield ReadWatermark(st.name)
            if stored is None or stored.epoch < epoch:
                return Conflict.RETRY, stored
            if stored.epoch > epoch:
                return Conflict.MOVED, stored
            if stored.seq >= target:
                st.known = split_position(stored.seq)
                return Conflict.DUPLICATE, stored
            sphase = split_position(stored.seq)[1]
            if sphase == PHASE_DONE:
                return Conflict.MOVED, stored
            if stored != last:
                last, since = stored, self.clock()
            elif self.clock() - since >= self.config.takeover_timeout_s:
                return Conflict.TAKEOVER, stored
            if self.stopping():
                return Conflict.ABANDONED, stored
            if not waited:
                waited = True
                self.counters.inc(Counter.PEER_WAITS)
            yield SleepUntil(self.clock() + self.config.poll_interval_s)


class BatchGroup:
    """Messages handled in order, the fast batches among them applied together
    (``docs/ingest-protocol.md``, "Batches applied together").

    :meth:`handle` takes one message at a time: a batch :meth:`Sequencer.plan_fast` takes joins
    the group; any other message first has the group applied (:meth:`flush`), then runs through
    :meth:`Sequencer.on_message` alone, so the index sees every message's effect in order.
    ``perform`` performs the machine's actions, ``apply_steps`` applies fenced steps together
    (what each did; raising :class:`Abandoned` or :class:`Failed` as ``perform`` may).
    The caller holds whatever orders each stream (its lock) until :meth:`flush` returns.
    """

    def __init__(
        self,
        sequencer: Sequencer,
        perform: Callable[[Action], Any],
        apply_steps: Callable[[Sequence[ApplyStep]], list[StepResult]],
        limit: int,
    ) -> None:
        self.sequencer = sequencer
        self.perform = perform
        self.apply_steps = apply_steps
        self.limit = limit
        self.outcomes: dict[int, BatchOutcome] = {}
        """Each message's outcome, by the number :meth:`handle` was given (set once known)."""
        self._group: list[tuple[int, FastBatch]] = []

    def handle(
        self,
        number: int,
        st: StreamState,
        topic: object,
        seq: int,
        payload: object,
        decoded: DecodedBatch | None = None,
    ) -> None:
        """Handle message ``number`` of stream ``st`` (its outcome lands in :attr:`outcomes`,
        at once or by a later :meth:`flush`)."""
        seqr = self.sequencer
        fast = seqr.plan_fast(st, topic, seq, payload, decoded) if self.limit > 1 else None
        if fast is None:
            self.flush()
            steps = seqr.on_message(st, topic, seq, payload, decoded)
            self.outcomes[number] = drive(steps, self.perform)
            return
        self._group.append((number, fast))
        if len(self._group) >= self.limit:
            self.flush()

    def flush(self) -> None:
        """Apply the group; a stream whose batch did not apply (or may not have) gets that
        batch and its later ones undone and handled again by the full machine.

        Every batch to handle again is undone first (latest first, over all streams), then the
        applied batches are journaled, then the undone ones handled again: a pod's journal keeps
        its batches' order and never holds a batch that did not apply.
        """
        group, self._group = self._group, []
        if not group:
            return
        seqr, outcomes = self.sequencer, self.outcomes
        try:
            results: list[StepResult] | None = self.apply_steps([f.step for _, f in group])
        except (Abandoned, Failed) as exc:
            logger.warning("applying %d batches together failed: %s", len(group), exc)
            results = None
        verdicts = self._verdicts(group, results)
        redo: dict[int, list[tuple[int, FastBatch]]] = {}
        applied: list[FastBatch] = []
        for j, (number, fast) in enumerate(group):
            key = id(fast.st)
            if key not in redo and verdicts[j]:
                outcomes[number] = seqr.finish_fast(fast)
                applied.append(fast)
            else:
                redo.setdefault(key, []).append((number, fast))
        undone = {id(fast) for again in redo.values() for _, fast in again}
        for _, fast in reversed(group):
            if id(fast) in undone:
                seqr.undo_fast(fast)
        if applied:
            drive(seqr.journal([(f.pod, f.plan) for f in applied]), self.perform)
        for again in redo.values():
            for number, fast in again:
                outcomes[number] = drive(seqr.resequence(fast), self.perform)

    def _verdicts(
        self, group: Sequence[tuple[int, FastBatch]], results: Sequence[StepResult] | None
    ) -> list[bool]:
        """Whether each batch of the group applied. A call that took more than one attempt may
        have applied batches in an attempt whose reply was lost, which the next attempt then
        refused: such a batch applied when its stream's stored mark has reached its own in its
        epoch (read once per stream; a mark that cannot be read leaves the batch to the full
        machine)."""
        if results is None:
            return [False] * len(group)
        verdicts = [r.applied for r in results]
        if all(r.applied or r.attempts <= 1 for r in results):
            return verdicts
        stored: dict[str, Watermark | None] = {}
        for j, (_, fast) in enumerate(group):
            if verdicts[j] or results[j].attempts <= 1:
                continue
            name = fast.step.stream
            if name not in stored:
                try:
                    stored[name] = self.perform(ReadWatermark(name, once=True))
                except (Abandoned, Failed) as exc:
                    logger.warning("stream %s: cannot read the stored watermark: %s", name, exc)
                    stored[name] = None
            mark = stored[name]
            wm = fast.step.watermark
            verdicts[j] = mark is not None and mark.epoch == wm.epoch and mark >= wm
        return verdicts


def _contiguous_tail(found: list[_Message], upto: int) -> list[_Message]:
    """The replayed batches ending right before ``upto`` without a hole."""
    tail: list[_Message] = []
    expect = upto - 1
    for m in sorted(found, key=lambda m: -m.seq):
        if m.seq != expect:
            break
        tail.append(m)
        expect -= 1
    tail.reverse()
    return tail

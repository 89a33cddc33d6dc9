"""Model check of the HA ingest protocol: 2-3 sans-IO replicas through generated interleavings.

Hypothesis drives an engine (publishing, restarting, with a replay buffer of a few batches that
may be out of reach) and 2-3 replicas stepped one action at a time on a fake clock, with pauses
(a replica not stepped), kills between any two actions, late joiners and messages lost on one
replica's connection. After every step the index is checked against a single-replica model of
what the pod holds (``docs/ingest-protocol.md``, "Limits", states what this proves):

- no stale entry, ever: nothing of an earlier engine incarnation once a batch of a later one was
  applied, and nothing the engine removed once a batch at or after the removal was applied;
- each restart opens at most one epoch, and each epoch's opening clear is counted once, by the
  replica that finished it;
- once the replicas are quiet, the pod holds exactly what the engine holds, unless a documented
  limit applied: a batch no replica received that replay could not return, a gap clear, or a
  takeover of a replica that died (or stalled) mid-batch.

The documented limits about restarts a replica cannot see are modelled rather than checked: an
incarnation is "blind" (old entries may stay next to new ones until a replica sees the restart)
when no replica can see its restart, or when a replica's subscription takes it for the
incarnation the stored epoch was opened for (:meth:`Protocol._anchor`); such a replica counts
epochs differently from a peer that counted the restarts it missed, so every incarnation it
receives while it runs is blind too. ``KVREDIS_MODEL_EXAMPLES`` and
``KVREDIS_MODEL_STEPS`` raise the example count (200) and steps per example (40) for long runs,
which explore anew (a fresh seed, or ``--hypothesis-seed``); give them ``--timeout=0`` (the
suite's per-test limit is 300 s).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as strat
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvredis.batch import AddOp, IndexOp, Watermark
from kvredis.ingest.events import BlockRemoved, BlockStored, encode_batch
from kvredis.ingest.sequencer import BatchGroup, BatchOutcome, drive
from kvredis.ingest.stream import PHASE_DONE, split_position
from kvredis.ingest.transport import ReplayedMessage
from kvredis.memory import InMemoryIndex
from tests.ingest.harness import CONFIG, STREAM, TOPIC, FakeClock, Replica, Stepper, block_key
from tests.ingest.harness import block_tokens as tokens

MAX_ACTIONS = 3000
"""A bound on the actions one message may take (waits for a stalled peer end in a takeover)."""


@cache
def key_of(block: int) -> int:
    return block_key(block)


@dataclass(frozen=True)
class Published:
    """One engine batch: it stores ``block`` and maybe removes ``removes`` (same incarnation)."""

    incarnation: int
    seq: int
    block: int
    removes: int | None
    payload: bytes


class RecordingIndex(InMemoryIndex):
    """The real in-memory index, remembering every request key an applied batch added."""

    def __init__(self) -> None:
        super().__init__()
        self.added: set[int] = set()

    def apply_batch(
        self,
        ops: Any,
        stream: str | None = None,
        watermark: Watermark | None = None,
    ) -> bool:
        applied = super().apply_batch(ops, stream, watermark)
        if applied:
            op: IndexOp
            for op in ops:
                if isinstance(op, AddOp):
                    self.added.update(op.request_keys)
        return applied


class Engine:
    """An engine process after process: sequence numbers, a replay buffer of ``buffer`` batches."""

    def __init__(self, buffer: int) -> None:
        self.incarnation = 0
        self.next_seq = 0
        self.buffer = buffer
        self.reachable = True
        self.log: list[Published] = []
        self.alive: list[int] = []
        """Blocks the current incarnation holds."""

    def publish(self, remove: bool) -> Published:
        removes = self.alive.pop(0) if remove and self.alive else None
        block = len(self.log)
        events: list[Any] = [] if removes is None else [BlockRemoved((removes + 1,))]
        events.append(BlockStored((block + 1,), None, tokens(block), 16))
        msg = Published(self.incarnation, self.next_seq, block, removes, encode_batch(events))
        self.log.append(msg)
        self.alive.append(block)
        self.next_seq += 1
        return msg

    def restart(self) -> None:
        self.incarnation += 1
        self.next_seq = 0
        self.alive = []

    def fetch(self, start_seq: int) -> list[ReplayedMessage] | None:
        if not self.reachable:
            return None
        current = [m for m in self.log if m.incarnation == self.incarnation]
        kept = current[len(current) - self.buffer :] if self.buffer else []
        return [ReplayedMessage(TOPIC, m.seq, m.payload) for m in kept if m.seq >= start_seq]

    def close(self) -> None:
        pass


@dataclass
class Node:
    """One replica slot: the running replica (None: dead) and its subscription's queue."""

    replica: Replica | None = None
    queue: deque[Published] = field(default_factory=deque)
    stepper: Stepper | None = None
    current: Published | None = None
    received: int | None = None
    """The incarnation of the last message delivered to it."""
    witness: bool = False
    """It received the engine's previous incarnation and has yet to handle the current one: its
    connection will show the restart as seq going back."""
    anchor: Anchor | None = None
    """What its subscription read (None: it has received a message since)."""
    misnumbered: bool = False
    """It anchored in the wrong epoch while a peer counts the restarts it missed: every
    incarnation it receives is blind (see :meth:`Protocol._anchor`)."""


@dataclass(frozen=True)
class Anchor:
    """The stored watermark a replica read when it subscribed, as the model sees it."""

    epoch: int
    """The stored epoch."""
    expected: int
    """The lowest ``seq`` published after the subscription; below it is a restart."""


#: Counters whose movement means a documented limit applied (entries may be missing).
LIMIT_COUNTERS = ("clears_gap", "takeovers", "lost_ownership", "replay_failures")


class Protocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.index = RecordingIndex()
        self.engine = Engine(buffer=4)
        self.with_replay = True
        self.slots: list[Node] = []
        self.retired: list[Replica] = []
        self.restarts = 0
        self.epoch_of: dict[int, int] = {0: 0}
        """Per epoch, the visible restarts before the incarnation whose message opened it."""
        self.visible = {0: 0}
        """Per incarnation, the restarts before it a connection can see (one that published
        nothing and the restart after it look like one restart)."""
        self.blind: set[int] = set()
        """Incarnations no replica can tell from the one before: no live replica received the
        previous one (or all that did died first), or one subscribed after the restart once the
        new incarnation had passed the stored position."""
        self.clean = True
        """No replica died holding messages of the current incarnation."""
        self.limits_at_restart = (0,) * len(LIMIT_COUNTERS)
        self.gaps_at_restart = 0
        self.handled: set[tuple[int, int]] = set()
        """(incarnation, seq) of every batch some replica applied or found applied."""

    # -- setup -----------------------------------------------------------------------------

    @initialize(
        replicas=strat.integers(2, 3),
        buffer=strat.integers(0, 6),
        with_replay=strat.booleans(),
    )
    def setup(self, replicas: int, buffer: int, with_replay: bool) -> None:
        self.engine.buffer = buffer
        self.with_replay = with_replay
        for _ in range(replicas):
            self.slots.append(Node())
            self._join(self.slots[-1])

    def _join(self, node: Node) -> None:
        replay = self.engine if self.with_replay else None
        node.replica = Replica(self.index, self.clock, CONFIG, replay=replay)  # type: ignore[arg-type]
        node.queue.clear()
        node.witness, node.received, node.misnumbered = False, None, False
        stored = self.index.get_watermark(STREAM)
        epoch, kseq = 0, -1
        if stored is not None:
            epoch, kseq = stored.epoch, split_position(stored.seq)[0]
        # read before subscribing: the batch stored, and the one that opened the epoch (its seq 0
        # at least), were published before
        node.anchor = Anchor(epoch, max(kseq + 1, 1 if epoch else 0))
        node.stepper, node.current = None, None
        replica = node.replica
        drive(replica.sequencer.on_subscribe(replica.stream), replica.perform)

    def _live(self) -> list[Node]:
        return [n for n in self.slots if n.replica is not None]

    # -- the engine ------------------------------------------------------------------------

    @rule(remove=strat.booleans())
    def publish(self, remove: bool) -> None:
        msg = self.engine.publish(remove)
        for node in self._live():
            node.queue.append(msg)
            node.received = msg.incarnation
            if node.misnumbered:
                self.blind.add(msg.incarnation)

    def _anchor(self, node: Node, msg: Published) -> None:
        """The first message ``node``'s subscription handles: does it number epochs as its peers?

        A replica counts restarts from the epoch it read when it subscribed. It is right if its
        first message comes from the incarnation whose message opened that epoch (``seq`` not
        below the position read) or from the next one (``seq`` below it: it sees that restart).
        Otherwise nothing it receives tells it: it takes the message's incarnation for the
        epoch's, whose entries are still held (blind). If a peer opened an epoch since it
        subscribed, or a peer received earlier messages (it counts the restarts this replica
        missed), that peer's epochs stand for restarts this replica did not see, and it takes the
        next restart it sees for the epoch already open: the numberings differ until it stops,
        so every incarnation it receives is blind.
        """
        anchor = node.anchor
        assert anchor is not None
        node.anchor = None
        opened = self._epoch() != anchor.epoch
        peers_counting = opened or any(
            peer is not node and peer.received is not None for peer in self._live()
        )
        seen_restart = msg.seq < anchor.expected
        # restarts between the stored epoch's incarnation and this message's
        missed = self.visible[msg.incarnation] - self.epoch_of[anchor.epoch]
        if missed != (1 if seen_restart else 0):
            self.blind.add(msg.incarnation)
            node.misnumbered = peers_counting
            if peers_counting:  # and so is every incarnation it received since
                self.blind.update(range(msg.incarnation, self.engine.incarnation + 1))

    @rule()
    def restart_engine(self) -> None:
        outgoing = self.engine.incarnation
        published = any(m.incarnation == outgoing for m in self.engine.log)
        self.engine.restart()
        self.restarts += published
        if published:  # else this restart and the one before look like one on every connection
            for node in self._live():
                node.witness = node.received == outgoing
        self.visible[self.engine.incarnation] = self.restarts
        unseen = bool(self.engine.log) and not any(node.witness for node in self._live())
        if unseen or (not published and outgoing in self.blind):
            self.blind.add(self.engine.incarnation)
        self.clean = True
        self.limits_at_restart = self._limits()
        self.gaps_at_restart = self._count("gaps")

    @rule(reachable=strat.booleans())
    def replay_reachable(self, reachable: bool) -> None:
        self.engine.reachable = reachable

    @rule(seconds=strat.sampled_from([0.05, 0.3, 1.0, 5.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # -- replicas --------------------------------------------------------------------------

    @rule(which=strat.integers(0, 2), actions=strat.integers(1, 6))
    def step(self, which: int, actions: int) -> None:
        node = self.slots[which % len(self.slots)]
        for _ in range(actions):
            if not self._step(node):
                return

    @rule(which=strat.integers(0, 2))
    def finish_message(self, which: int) -> None:
        node = self.slots[which % len(self.slots)]
        if node.stepper is None:
            self._step(node)
        for _ in range(MAX_ACTIONS):
            if node.stepper is None:
                return
            self._step(node)
        raise AssertionError("a message took more than MAX_ACTIONS actions")

    @rule(which=strat.integers(0, 2), most=strat.integers(2, 6))
    def drain(self, which: int, most: int) -> None:
        """The replica takes up to ``most`` queued messages at once and applies them as a
        worker does (``BatchGroup``): the fast batches among them in one ``apply_batches``, the
        others one by one, in order."""
        node = self.slots[which % len(self.slots)]
        replica = node.replica
        if replica is None or node.stepper is not None or not node.queue:
            return
        group = BatchGroup(
            replica.sequencer, replica.perform, replica.backend.apply_steps, limit=most
        )
        taken: list[Published] = []
        while node.queue and len(taken) < most:
            msg = node.queue.popleft()
            if node.anchor is not None:
                self._anchor(node, msg)
            before = self._epoch()
            group.handle(len(taken), replica.stream, TOPIC, msg.seq, msg.payload)
            for opened in range(before + 1, self._epoch() + 1):
                self.epoch_of[opened] = self.visible[msg.incarnation]
            taken.append(msg)
        group.flush()
        for number, msg in enumerate(taken):
            node.current = msg
            self._done(node, group.outcomes.get(number))

    def _step(self, node: Node) -> bool:
        """One action of ``node`` (starting its next message if idle); False if it has none."""
        replica = node.replica
        if replica is None:
            return False
        if node.stepper is None:
            if not node.queue:
                return False
            node.current = node.queue.popleft()
            if node.anchor is not None:
                self._anchor(node, node.current)
            node.stepper = replica.begin(node.current.seq, node.current.payload)
        else:
            msg, before = node.current, self._epoch()
            node.stepper.step()
            assert msg is not None
            for opened in range(before + 1, self._epoch() + 1):
                # the epoch stands for the incarnation of the message whose handling opened it
                self.epoch_of[opened] = self.visible[msg.incarnation]
        if node.stepper.pending is None:
            self._done(node, node.stepper.outcome)
        return True

    def _epoch(self) -> int:
        stored = self.index.get_watermark(STREAM)
        return 0 if stored is None else stored.epoch

    def _done(self, node: Node, outcome: BatchOutcome | None) -> None:
        msg = node.current
        assert msg is not None
        node.stepper, node.current = None, None
        if msg.incarnation == self.engine.incarnation:
            node.witness = False
        if outcome in (BatchOutcome.APPLIED, BatchOutcome.DUPLICATE):
            self.handled.add((msg.incarnation, msg.seq))

    @rule(which=strat.integers(0, 2))
    def kill(self, which: int) -> None:
        node = self.slots[which % len(self.slots)]
        if node.replica is None:
            return
        self.retired.append(node.replica)
        if node.queue or node.current is not None:
            self.clean = False
        node.replica, node.stepper, node.current = None, None, None
        node.queue.clear()
        if node.witness and not any(n.witness for n in self._live()):
            self.blind.add(self.engine.incarnation)
        node.witness, node.received = False, None

    @precondition(lambda self: any(n.replica is None for n in self.slots))
    @rule(which=strat.integers(0, 2))
    def join(self, which: int) -> None:
        dead = [n for n in self.slots if n.replica is None]
        self._join(dead[which % len(dead)])

    @rule(which=strat.integers(0, 2), position=strat.integers(0, 50))
    def lose_message(self, which: int, position: int) -> None:
        """A message lost on one replica's connection (never the first of an incarnation)."""
        node = self.slots[which % len(self.slots)]
        candidates = [i for i, m in enumerate(node.queue) if m.seq > 0]
        if candidates:
            del node.queue[candidates[position % len(candidates)]]

    # -- checks ----------------------------------------------------------------------------

    def _replicas(self) -> list[Replica]:
        return self.retired + [n.replica for n in self.slots if n.replica is not None]

    def _count(self, name: str) -> int:
        return sum(r.count(name) for r in self._replicas())

    def _limits(self) -> tuple[int, ...]:
        return tuple(self._count(name) for name in LIMIT_COUNTERS)

    @rule()
    def settle(self) -> None:
        """Every live replica handles everything it received; then the pod must be exact."""
        for _ in range(MAX_ACTIONS * 10):
            busy = [n for n in self._live() if n.queue or n.stepper is not None]
            if not busy:
                break
            for node in busy:  # one action each in turn: a replica's waits let its peers move
                self._step(node)
        else:
            raise AssertionError("the replicas never became quiet")
        current = [m for m in self.engine.log if m.incarnation == self.engine.incarnation]
        exact = (
            current
            and self.engine.incarnation not in self.blind
            and self._live()
            and self.clean
            and self._limits() == self.limits_at_restart
            # a gap is covered only by replay
            and (self.with_replay or self._count("gaps") == self.gaps_at_restart)
            and all((m.incarnation, m.seq) in self.handled for m in current)
        )
        if not exact:
            return
        held = {m.block for m in self.engine.log if self.index.lookup([key_of(m.block)])}
        assert held == set(self.engine.alive), (
            f"quiet, nothing lost, no limit applied: held {sorted(held)}, "
            f"engine holds {sorted(self.engine.alive)}"
        )

    @invariant()
    def no_stale_entry(self) -> None:
        log = self.engine.log
        applied = [m for m in log if key_of(m.block) in self.index.added]
        if not applied:
            return
        newest = max(m.incarnation for m in applied)
        if newest in self.blind:
            return
        removed_at = {m.removes: m for m in log if m.removes is not None}
        for m in log:
            if not self.index.lookup([key_of(m.block)]):
                continue
            assert m.incarnation == newest, (
                f"stale: block {m.block} of incarnation {m.incarnation} held after a batch of "
                f"incarnation {newest} was applied"
            )
            gone = removed_at.get(m.block)
            if gone is not None:
                later = [a for a in applied if a.incarnation == gone.incarnation]
                assert not any(a.seq >= gone.seq for a in later), (
                    f"stale: block {m.block} removed by batch {gone.seq} held after batch "
                    f"{max(a.seq for a in later)} was applied"
                )

    @invariant()
    def one_epoch_and_one_clear_per_restart(self) -> None:
        stored = self.index.get_watermark(STREAM)
        epoch = 0 if stored is None else stored.epoch
        assert epoch <= self.restarts, f"epoch {epoch} after {self.restarts} restarts"
        opened = epoch
        if stored is not None and split_position(stored.seq) < (-1, PHASE_DONE):
            opened -= 1  # the opening clear is in progress
        assert self._count("clears_restart") == opened


Protocol.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVREDIS_MODEL_EXAMPLES", "200")),
    stateful_step_count=int(os.environ.get("KVREDIS_MODEL_STEPS", "40")),
    deadline=None,
    # the suite's run is the same on every machine; long runs (the variables set) explore anew
    derandomize="KVREDIS_MODEL_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestProtocol = Protocol.TestCase


# -- counterexamples found by long runs, pinned as explicit step sequences --------------------

Step = tuple[str, dict[str, Any]]


def run_steps(setup: dict[str, Any], steps: list[Step]) -> Protocol:
    """Drive the model through ``steps`` as hypothesis would, checking invariants after each."""
    machine = Protocol()
    checks = (machine.no_stale_entry, machine.one_epoch_and_one_clear_per_restart)
    machine.setup(**setup)
    for check in checks:
        check()
    for name, args in steps:
        getattr(machine, name)(**args)
        for check in checks:
            check()
    machine.teardown()
    return machine


NO_REPLAY = {"replicas": 2, "buffer": 0, "with_replay": False}
PUBLISH: Step = ("publish", {"remove": False})
RESTART: Step = ("restart_engine", {})
SETTLE: Step = ("settle", {})


def kill(which: int) -> Step:
    return ("kill", {"which": which})


def join(which: int) -> Step:
    return ("join", {"which": which})


def test_a_gap_batch_taking_over_a_stalled_epoch_opening_counts_one_restart_clear() -> None:
    """Replica 0 dies holding the claim of epoch 1's opening; the joiner replacing it missed
    batch 0, so its gap batch takes the opening over: its clear is the restart clear."""
    machine = run_steps(
        NO_REPLAY,
        [
            PUBLISH,
            RESTART,
            SETTLE,
            PUBLISH,
            ("step", {"actions": 2, "which": 0}),
            kill(0),
            join(0),
            PUBLISH,
            SETTLE,
        ],
    )
    assert machine._count("clears_restart") == 1
    assert machine._count("clears_gap") == 0


def test_a_subscriber_that_received_nothing_before_a_restart_cannot_see_it() -> None:
    """Replica 0 subscribes with nothing stored and receives nothing of incarnation 0; replica 1
    applies its batch 0. Incarnation 1's batch 0 then looks to replica 0 like the batch replica 1
    applied (a duplicate) and its batch 1 like the next one: incarnation 1 is blind until
    replica 1 sees seq go back, and replica 0 numbers epochs one low from then on."""
    machine = run_steps(
        NO_REPLAY,
        [
            kill(0),
            PUBLISH,
            join(0),
            RESTART,
            ("finish_message", {"which": 1}),
            PUBLISH,
            PUBLISH,
            ("step", {"actions": 5, "which": 0}),
            SETTLE,
        ],
    )
    assert machine.blind == {1}
    assert machine.slots[0].misnumbered


def test_a_subscriber_anchored_in_an_unseen_restart_stays_one_epoch_low() -> None:
    """Replica 0 subscribes while replica 1 lags behind a restart (nothing stored yet, the new
    incarnation past it). Replica 1 then opens epoch 1 for that restart and dies; replica 0
    drops its first batch as superseded and takes the next restart it sees for epoch 1: the
    batch a peer applied there is a duplicate to it, and the new block is never stored."""
    machine = run_steps(
        NO_REPLAY,
        [
            kill(0),
            PUBLISH,
            RESTART,
            PUBLISH,
            join(0),
            RESTART,
            SETTLE,
            kill(1),
            PUBLISH,
            RESTART,
            PUBLISH,
            SETTLE,
        ],
    )
    assert machine.blind == {2, 3}
    replica = machine.slots[0].replica
    assert replica is not None
    assert (replica.count("batches_superseded"), replica.count("clears")) == (1, 0)


def test_a_subscriber_anchored_in_an_epoch_a_lagging_peer_opened_after_the_next_restart() -> None:
    """Replica 1 opens epoch 1 for incarnation 1 only after the engine restarted again, and
    dies; its replacement reads epoch 1 at batch 0 and receives incarnation 2's batch 1, which
    looks exactly like incarnation 1's: it is applied in epoch 1 next to block 1 (blind) until
    replica 0 sees seq go back."""
    machine = run_steps(
        NO_REPLAY,
        [
            PUBLISH,
            SETTLE,
            RESTART,
            PUBLISH,
            RESTART,
            PUBLISH,
            ("finish_message", {"which": 1}),
            kill(1),
            join(1),
            PUBLISH,
            ("step", {"actions": 6, "which": 1}),
            SETTLE,
        ],
    )
    assert machine.blind == {2}
    assert machine.slots[1].misnumbered


def test_a_subscriber_opening_one_epoch_for_two_restarts_a_lagging_peer_counts() -> None:
    """Replica 1 lags two restarts behind when replica 0's replacement subscribes at epoch 0,
    batch 1, and receives incarnation 2's batch 1: it sees seq go back and opens epoch 1 for
    both restarts. Replica 1, seeing the first of them, takes epoch 1 for incarnation 1 and
    applies its batch 2 there, next to incarnation 2's block, until it sees the second."""
    machine = run_steps(
        NO_REPLAY,
        [
            PUBLISH,
            PUBLISH,
            ("finish_message", {"which": 0}),
            ("finish_message", {"which": 0}),
            RESTART,
            PUBLISH,
            PUBLISH,
            PUBLISH,
            RESTART,
            PUBLISH,
            kill(0),
            join(0),
            PUBLISH,
            ("finish_message", {"which": 0}),
            *[("finish_message", {"which": 1})] * 5,
            SETTLE,
        ],
    )
    assert machine.blind == {2}
    assert machine.slots[0].misnumbered


def step(which: int, actions: int) -> Step:
    return ("step", {"which": which, "actions": actions})


def finish(which: int) -> Step:
    return ("finish_message", {"which": which})


#: Replica 1 claims epoch 1's opening for incarnation 1 and stalls; replica 0 subscribes, loses
#: incarnation 1's only message it would receive, and gets incarnation 2's seq 0 first.
SUBSCRIBED_DURING_AN_OPENING: list[Step] = [
    PUBLISH,
    RESTART,
    finish(1),
    kill(0),
    PUBLISH,
    step(1, 2),
    join(0),
    PUBLISH,
    ("lose_message", {"position": 0, "which": 0}),
    RESTART,
    PUBLISH,
    finish(0),
]


def test_a_subscriber_that_read_an_epoch_opening_sees_seq_0_as_a_restart() -> None:
    """The batch that made replica 1 open epoch 1 was published before replica 0 subscribed, so
    the seq 0 replica 0 receives is a new incarnation's: it finishes the opening and opens epoch
    2 (before, it took it for epoch 1's batch 0, and replica 1 then applied incarnation 1's batch
    1 next to it)."""
    machine = run_steps(NO_REPLAY, [*SUBSCRIBED_DURING_AN_OPENING, step(1, 5), SETTLE])
    assert machine._epoch() == 2
    assert machine.blind == set()


def test_a_subscriber_that_read_an_epoch_opening_leaves_the_pod_exact() -> None:
    """The same start, run on to two more restarts and a kill: the pod ends exact."""
    machine = run_steps(
        NO_REPLAY,
        [
            *SUBSCRIBED_DURING_AN_OPENING,
            step(1, 4),
            RESTART,
            ("time_passes", {"seconds": 5.0}),
            SETTLE,
            finish(0),
            finish(2),
            SETTLE,
            kill(1),
            step(2, 5),
            SETTLE,
            ("replay_reachable", {"reachable": True}),
            finish(1),
            ("publish", {"remove": True}),
            SETTLE,
        ],
    )
    assert machine.blind == set()

"""Replicas of the ingest sequencer on a fake clock, for stepping the HA protocol without threads.

Each :class:`Replica` is one ingester's :class:`~kvredis.ingest.sequencer.Sequencer` performing its
actions through the real :class:`~kvredis.ingest.backend.IndexBackend` on a shared index (the real
``InMemoryIndex`` by default). Time is a :class:`FakeClock` that only moves when a replica sleeps
(or a test advances it); shutdown is a flag. A :class:`Stepper` runs one message one action at a
time, so a test decides exactly how replicas interleave: a replica paused between two actions is
a replica that stalled, or died.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvredis.groups import GroupCatalog
from kvredis.hashing import ChunkedTokenDatabase
from kvredis.index import BatchIndex, Index
from kvredis.ingest.backend import IndexBackend
from kvredis.ingest.config import EndpointConfig, IngesterConfig
from kvredis.ingest.counters import IngestCounters, RateLimitedLog
from kvredis.ingest.events import BlockStored, Event, Rejection, encode_batch
from kvredis.ingest.planner import Planner, PodCaches
from kvredis.ingest.sequencer import Action, BatchOutcome, Interrupt, Sequencer, Steps, drive
from kvredis.ingest.stream import StreamState
from kvredis.ingest.transport import ReplayedMessage

TP = ChunkedTokenDatabase()
POD, MODEL = "pod-a", "model-a"
TOPIC = f"kv@{POD}@{MODEL}".encode()
ENDPOINT = EndpointConfig("engine-1")
STREAM = ENDPOINT.stream_name
CONFIG = IngesterConfig(
    peer_grace_s=0.5, takeover_timeout_s=10.0, heartbeat_interval_s=1.0, poll_interval_s=0.1,
    restart_window=4, backend_retry_max_s=1.0,
)


def block_tokens(n: int) -> tuple[int, ...]:
    """The tokens of block ``n`` (one full block, its own chain)."""
    return tuple(range(16 * n, 16 * n + 16))


def block_key(n: int) -> int:
    """The request key block ``n`` is stored under."""
    return TP.tokens_to_kv_block_keys(0, block_tokens(n), MODEL)[0]


def batch(n: int, *before: Event) -> bytes:
    """A batch storing block ``n`` (engine key ``n + 1``), after ``before``."""
    return encode_batch([*before, BlockStored((n + 1,), None, block_tokens(n), 16)])


def held(index: Index, blocks: Sequence[int]) -> set[int]:
    """Which of ``blocks`` the index holds an entry for."""
    return {n for n in blocks if index.lookup([block_key(n)])}


class FakeClock:
    """Monotonic seconds that move only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeStop:
    """A shutdown flag whose waits advance the fake clock instead of sleeping."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        if not self.flag and timeout:
            self.clock.advance(timeout)
        return self.flag


class FakeReplay:
    """An engine's replay buffer: what it holds, whether it answers, what it was asked."""

    def __init__(self, payloads: dict[int, bytes] | None = None) -> None:
        self.buffer: dict[int, bytes] = dict(payloads or {})
        self.reachable = True
        self.requests: list[int] = []

    def fetch(self, start_seq: int) -> list[ReplayedMessage] | None:
        self.requests.append(start_seq)
        if not self.reachable:
            return None
        found = sorted(self.buffer.items())
        return [ReplayedMessage(TOPIC, s, p) for s, p in found if s >= start_seq]

    def close(self) -> None:
        pass


Hook = Callable[[Action], None]


class Replica:
    """One ingester's sequencer and stream state, performing actions on a shared index."""

    def __init__(
        self,
        index: Any,
        clock: FakeClock,
        config: IngesterConfig = CONFIG,
        replay: FakeReplay | None = None,
    ) -> None:
        self.index = index
        self.clock = clock
        self.counters = IngestCounters()
        self.stop = FakeStop(clock)
        self.rejects: list[Rejection] = []
        self.planner = Planner(TP, GroupCatalog(), PodCaches(1024))
        self.sequencer = Sequencer(
            config,
            self.planner,
            self.counters,
            fenced=isinstance(index, BatchIndex) and config.use_watermarks,
            clock=clock,
            stopping=self.stop.is_set,
            reject=lambda rejection, _where: self.rejects.append(rejection),
        )
        self.backend = IndexBackend(
            index,
            self.counters,
            stop=self.stop,
            clock=clock,
            replay_factory=lambda _endpoint: replay,
            retry_max_s=config.backend_retry_max_s,
            warn=RateLimitedLog(logging.getLogger(__name__), 60.0),
        )
        self.stream = StreamState(ENDPOINT)
        self.trace: list[Action] = []
        """Every action performed (heartbeats inside a clear are performed by the backend)."""
        self.hooks: list[Hook] = []
        """Called with each action before it is performed (to interleave peers, stop, ...)."""

    def perform(self, action: Action) -> Any:
        self.trace.append(action)
        for hook in list(self.hooks):
            hook(action)
        return self.backend.perform(action)

    def steps(self, seq: int, payload: bytes, topic: bytes = TOPIC) -> Steps[BatchOutcome]:
        return self.sequencer.on_message(self.stream, topic, seq, payload)

    def process(self, seq: int, payload: bytes, topic: bytes = TOPIC) -> BatchOutcome:
        """Handle one message to its end."""
        return drive(self.steps(seq, payload, topic), self.perform)

    def feed(self, seqs: Sequence[int], payload: Callable[[int], bytes] = batch) -> None:
        """Handle messages ``seqs`` (payload of each: ``payload(seq)``)."""
        for seq in seqs:
            self.process(seq, payload(seq))

    def begin(self, seq: int, payload: bytes, topic: bytes = TOPIC) -> Stepper:
        """Start handling one message, to be stepped action by action."""
        return Stepper(self, self.steps(seq, payload, topic))

    def count(self, name: str) -> int:
        return self.counters.get(name)


class Stepper:
    """One message's routine, advanced one action at a time."""

    def __init__(self, replica: Replica, steps: Steps[BatchOutcome]) -> None:
        self.replica = replica
        self._steps = steps
        self.pending: Action | None = None
        """The action the routine waits to have performed (None: it returned)."""
        self.outcome: BatchOutcome | None = None
        self._resume(None, None)

    def _resume(self, reply: Any, error: Interrupt | None) -> None:
        try:
            if error is None:
                self.pending = self._steps.send(reply)
            else:
                self.pending = self._steps.throw(error)
        except StopIteration as done:
            self.pending, self.outcome = None, done.value

    def step(self) -> Action:
        """Perform the pending action and move to the next one."""
        action = self.pending
        assert action is not None, "the routine already returned"
        try:
            reply, error = self.replica.perform(action), None
        except Interrupt as exc:
            reply, error = None, exc
        self._resume(reply, error)
        return action

    def run_until(self, predicate: Callable[[Action], bool]) -> Action:
        """Step until the pending action satisfies ``predicate`` (it is not performed)."""
        while self.pending is not None and not predicate(self.pending):
            self.step()
        assert self.pending is not None, "the routine returned first"
        return self.pending

    def finish(self) -> BatchOutcome:
        """Step to the end; the outcome."""
        while self.pending is not None:
            self.step()
        assert self.outcome is not None
        return self.outcome

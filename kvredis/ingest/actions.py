"""The vocabulary of the ingest state machine: the actions it yields, their results, the
interrupts a port raises into it, its verdicts and outcomes, and :func:`drive`, which runs a
machine routine against a port.

Actions and what the port sends back:

==========================  ===============================================================
:class:`ReadWatermark`      the stream's stored :class:`~kvredis.batch.Watermark` or ``None``
:class:`ApplyStep`          a fenced step: :class:`StepResult` (applied? after how many tries)
:class:`ApplyOps`           unfenced operations (no watermarks): ``None``
:class:`LookupRequestKey`   the index's request key for an engine key, or ``None``
:class:`ClearPod`           ``None``; the port runs ``heartbeat()`` steps while a clear is long
:class:`OpenReplay`         whether the publisher has a replay endpoint
:class:`FetchReplay`        the buffered batches from a ``seq`` on, or ``None`` if unreachable
:class:`SleepUntil`         ``None`` once ``clock() >= deadline`` or shutdown began
:class:`ReadJournal`        a pod's page journal entries (``[]`` without a journal)
:class:`AppendJournal`      ``None`` (entries of applied batches appended to page journals)
==========================  ===============================================================

A port reports trouble by raising, into the machine, :class:`Abandoned` (shutdown while it
waited for an unavailable backend) or :class:`Failed` (an error a retry will not fix); a refused
heartbeat inside a :class:`ClearPod` raises :class:`LostOwnership` out of the clear.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvredis.batch import IndexOp, Watermark
from kvredis.fastinit import slot_init
from kvredis.ingest.config import EndpointConfig

__all__ = [
    "Abandoned",
    "Action",
    "AppendJournal",
    "ApplyOps",
    "ApplyStep",
    "BatchOutcome",
    "ClearPod",
    "Conflict",
    "Failed",
    "FetchReplay",
    "FreshVerdict",
    "Interrupt",
    "LookupRequestKey",
    "LostOwnership",
    "OpenReplay",
    "ReadJournal",
    "ReadWatermark",
    "SleepUntil",
    "StepResult",
    "Steps",
    "drive",
]

T = TypeVar("T")

# ------------------------------------------------------------------------------------------
# Vocabulary: actions, results, interrupts, verdicts, outcomes
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadWatermark:
    """Read the stored watermark of ``stream`` (``once``: no retrying an unavailable backend,
    which then raises :class:`Failed`)."""

    stream: str
    once: bool = False


@slot_init
@dataclass(frozen=True, slots=True)
class ApplyStep:
    """Apply ``ops`` iff ``watermark`` is above the stream's stored one, storing it atomically."""

    ops: Sequence[IndexOp]
    stream: str
    watermark: Watermark


@slot_init
@dataclass(frozen=True, slots=True)
class StepResult:
    """What an :class:`ApplyStep` did: ``applied``, after ``attempts`` tries (lost replies)."""

    applied: bool
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class ApplyOps:
    """Apply ``ops`` with no fencing (a single ingester, or an index without watermarks)."""

    ops: Sequence[IndexOp]


@dataclass(frozen=True, slots=True)
class LookupRequestKey:
    """Ask the index for the request key ``engine_key`` maps to."""

    engine_key: int


@dataclass(frozen=True, slots=True)
class ClearPod:
    """Clear every entry of ``pod`` (only those on ``device_tiers`` and of rank ``dp_rank`` when
    set: an engine's prefix-cache reset).

    While the clear runs, the port drives ``heartbeat()`` (with :func:`drive`) after every page
    of progress; its steps keep the claim alive, and a refused one raises :class:`LostOwnership`,
    which must abort the clear and reach the machine.
    """

    pod: str
    heartbeat: Callable[[], Steps[None]]
    device_tiers: frozenset[str] | None = None
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class OpenReplay:
    """Does ``endpoint`` have a replay client? (The port opens it on first use.)"""

    endpoint: EndpointConfig


@dataclass(frozen=True, slots=True)
class FetchReplay:
    """Every batch the publisher buffers with ``seq >= start_seq``, or ``None`` if unreachable."""

    endpoint: EndpointConfig
    start_seq: int


@dataclass(frozen=True, slots=True)
class ReadJournal:
    """Read ``pod``'s page journal (:mod:`kvredis.ingest.journal`)."""

    pod: str


@dataclass(frozen=True, slots=True)
class AppendJournal:
    """Append ``(pod, entry)`` pairs to the pods' page journals (batches that took effect)."""

    entries: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class SleepUntil:
    """Wait until the clock reads ``deadline`` (sooner once shutdown began)."""

    deadline: float


Action = (
    ReadWatermark
    | ApplyStep
    | ApplyOps
    | LookupRequestKey
    | ClearPod
    | OpenReplay
    | FetchReplay
    | SleepUntil
    | ReadJournal
    | AppendJournal
)
Steps = Generator[Action, Any, T]
"""A machine routine: yields actions, is sent their results, returns a ``T``."""


class Interrupt(Exception):
    """Raised into the machine at the action that could not complete."""


class Abandoned(Interrupt):
    """Shutdown began while the port waited (for an unavailable backend)."""


class Failed(Interrupt):
    """The batch cannot be applied: the index raised something a retry will not fix, or the
    batch needs more steps than a watermark phase can number."""


class LostOwnership(Interrupt):
    """A later step or heartbeat of a multi-step batch was refused: a peer took it over."""


class NotOwner(Interrupt):
    """The first step of a batch was refused by the stored watermark."""


class FreshVerdict(enum.Enum):
    """A fresh subscriber got ``seq`` below the stored position: what that means."""

    PEER_AHEAD = "peer_ahead"
    """A peer already applied it: skip it as a duplicate."""
    RESTART = "restart"
    """The engine restarted: start a new epoch."""
    ADOPTED = "adopted"
    """A peer started a new epoch meanwhile: this replica follows it and sequences again."""


class Conflict(enum.Enum):
    """Why the first step of a batch was refused, read from the stored watermark."""

    DUPLICATE = "duplicate"
    """The stream is done at or past this batch."""
    RETRY = "retry"
    """No watermark, or an older epoch, is stored (it was reset): try again."""
    MOVED = "moved"
    """A newer epoch (the message's incarnation was superseded by a restart a peer saw), or a
    finished batch past the claim (sequence the message again)."""
    TAKEOVER = "takeover"
    """A peer's multi-step batch stalled for ``takeover_timeout_s``: finish it."""
    ABANDONED = "abandoned"
    """Shutdown while waiting for a peer."""


class BatchOutcome(enum.Enum):
    """What happened to one engine message."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """Already applied (by a peer replica, by a replay, or before a restart of this ingester)."""
    FAILED = "failed"
    """The index raised an unexpected error; the batch was dropped (logged, counted)."""
    ABANDONED = "abandoned"
    """Shutdown interrupted a wait for the backend or a peer; the batch was not applied."""
    REJECTED = "rejected"
    """Nothing usable in the message (bad seq or payload, no pod); counted and logged."""
    SUPERSEDED = "superseded"
    """From an engine incarnation a peer already saw restart: dropped, never applied."""


def drive(steps: Steps[T], perform: Callable[[Action], Any]) -> T:
    """Run a machine routine to its end, performing each action with ``perform``.

    An :class:`Interrupt` raised by ``perform`` is raised into the routine at that action.
    """
    reply: Any = None
    error: Interrupt | None = None
    while True:
        try:
            action = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        try:
            reply, error = perform(action), None
        except Interrupt as exc:
            reply, error = None, exc

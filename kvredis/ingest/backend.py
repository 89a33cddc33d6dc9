"""The port the sequencer's actions run against: an index, the publishers' replay endpoints, time.

:class:`IndexBackend` performs each :data:`~kvredis.ingest.sequencer.Action` of the sequencer.
Index calls are retried with exponential backoff (up to ``backend_retry_max_s``) while the index
raises :class:`~kvredis.errors.BackendUnavailableError`, so a batch waits out an outage instead
of being dropped; once shutdown begins a waiting call gives up with
:class:`~kvredis.ingest.sequencer.Abandoned`. Any other error becomes
:class:`~kvredis.ingest.sequencer.Failed`. Every index call is counted (``index_calls``), every
retry too (``backend_retries``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvredis.batch import Batch, IndexOp
from kvredis.errors import BackendUnavailableError, EngineKeyNotFoundError
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import (
    BatchIndex,
    Index,
    MultiBatchIndex,
    ProgressClearIndex,
    SchemeIndex,
    SelectiveClearIndex,
    apply_batches_in_turn,
    apply_op,
)
from kvredis.ingest.actions import (
    Abandoned,
    Action,
    AppendJournal,
    ApplyOps,
    ApplyStep,
    ClearPod,
    Failed,
    FetchReplay,
    Interrupt,
    LookupRequestKey,
    OpenReplay,
    ReadJournal,
    ReadWatermark,
    SleepUntil,
    StepResult,
    drive,
)
from kvredis.ingest.config import EndpointConfig
from kvredis.ingest.counters import Counter, IngestCounters, RateLimitedLog
from kvredis.ingest.journal import COMPACT_GROWTH, COMPACT_MIN_BYTES, PageJournal
from kvredis.ingest.transport import ReplayClient, ReplayedMessage, ReplayFactory

__all__ = ["IndexBackend", "StopSignal"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FIRST_RETRY_DELAY_S = 0.05


class StopSignal(Protocol):
    """Shutdown as the port sees it (a :class:`threading.Event` is one)."""

    def is_set(self) -> bool:
        """Whether shutdown began."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, less once shutdown begins; whether it began."""
        ...


_APPLIED, _NOT_APPLIED = StepResult(True), StepResult(False)
"""The results of a step applied, or not, in one attempt (a step per batch: made once)."""


class IndexBackend:
    """Performs the sequencer's actions against ``index``, replay clients and real waiting."""

    def __init__(
        self,
        index: Index,
        counters: IngestCounters,
        *,
        stop: StopSignal,
        clock: Callable[[], float],
        replay_factory: ReplayFactory,
        retry_max_s: float,
        warn: RateLimitedLog,
        scheme: BlockKeyScheme | None = None,
        journal: PageJournal | None = None,
        snapshot: Callable[[str], bytes] | None = None,
    ) -> None:
        self.index = index
        #: a block key scheme still to record in the namespace before the first write (the
        #: backend was down when the ingester was built)
        self._scheme = scheme
        self.journal = journal
        """Where the pods' page journals are kept (``None``: nowhere)."""
        self._journal_lock = threading.Lock()
        self._appended: dict[str, int] = {}
        """Bytes this process appended to each pod's journal since it last compacted it."""
        self._compacted: dict[str, int] = {}
        """The size of each pod's journal as this process last compacted it."""
        self._snapshot = snapshot
        """What this process knows of a pod's pages, as a journal entry (for compaction)."""
        self._entries: dict[str, int] = {}
        """How many entries each pod's journal has if only this process wrote to it since it
        read or compacted it (a compaction then takes :attr:`_snapshot`, not a replay)."""
        self._batch = index if isinstance(index, BatchIndex) else None
        # (checked once: a runtime-checkable protocol's isinstance walks its members each time)
        self._multi = index if isinstance(index, MultiBatchIndex) else None
        self._counters = counters
        self._stop = stop
        self._clock = clock
        self._replay_factory = replay_factory
        self._replays: dict[str, ReplayClient | None] = {}
        self._retry_max_s = retry_max_s
        self._warn = warn

    def perform(self, action: Action) -> Any:
        """Perform one action and return its result (see :mod:`kvredis.ingest.sequencer`)."""
        if isinstance(action, ApplyStep):
            return self._apply_step(action)
        if isinstance(action, ReadWatermark):
            batch = self._batch_index()
            if action.once:
                try:
                    return batch.get_watermark(action.stream)
                except Exception as exc:
                    raise Failed(f"{type(exc).__name__}: {exc}") from exc
            return self._call(lambda: batch.get_watermark(action.stream))
        if isinstance(action, LookupRequestKey):
            return self._lookup(action.engine_key)
        if isinstance(action, ApplyOps):
            self._apply_ops(action.ops)
            return None
        if isinstance(action, ClearPod):
            self._clear(action)
            return None
        if isinstance(action, SleepUntil):
            self._stop.wait(max(0.0, action.deadline - self._clock()))
            return None
        if isinstance(action, OpenReplay):
            return self._replay(action.endpoint) is not None
        if isinstance(action, ReadJournal):
            return self._read_journal(action.pod)
        if isinstance(action, AppendJournal):
            self._append_journal(action.entries)
            return None
        return self._fetch(action)

    # -- index calls -----------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        delay = _FIRST_RETRY_DELAY_S
        while True:
            self._counters.inc(Counter.INDEX_CALLS)
            try:
                return fn()
            except BackendUnavailableError as exc:
                self._counters.inc(Counter.BACKEND_RETRIES)
                self._warn.warning("backend", "index backend unavailable, retrying: %s", exc)
                if self._stop.is_set():
                    raise Abandoned from exc
                self._stop.wait(delay)
                delay = min(delay * 2, self._retry_max_s)
            except Interrupt:
                raise
            except Exception as exc:
                raise Failed(f"{type(exc).__name__}: {exc}") from exc

    def _batch_index(self) -> BatchIndex:
        if self._batch is None:
            raise Failed(f"{type(self.index).__name__} has no watermarks (not a BatchIndex)")
        return self._batch

    def _record_scheme(self) -> None:
        """Record (and check) the pending block key scheme before the first write; a namespace
        recording another fails every write with :class:`~kvredis.errors.BlockKeySchemeError`."""
        scheme, index = self._scheme, self.index
        if scheme is not None and isinstance(index, SchemeIndex):
            self._call(lambda: index.check_block_key_scheme(scheme, record=True))
            self._scheme = None

    def _apply_step(self, action: ApplyStep) -> StepResult:
        self._record_scheme()
        batch = self._batch_index()
        attempts = 0

        def call() -> bool:
            nonlocal attempts
            attempts += 1
            return bool(batch.apply_batch(action.ops, action.stream, action.watermark))

        applied = self._call(call)
        return StepResult(applied, attempts)

    def apply_steps(self, steps: Sequence[ApplyStep]) -> list[StepResult]:
        """Apply fenced steps of one or more streams together (one index call where the index
        is a :class:`~kvredis.index.MultiBatchIndex`): what each did, with the attempts the
        call took (an attempt whose reply was lost may have applied steps the next one refuses).
        Retried like any index call; raises :class:`Abandoned` or :class:`Failed` as
        :meth:`perform` does."""
        batch, multi = self._batch_index(), self._multi
        self._record_scheme()
        batches = [Batch(s.ops, s.stream, s.watermark) for s in steps]
        attempts = 0

        def call() -> list[bool]:
            nonlocal attempts
            attempts += 1
            if multi is not None:
                return list(multi.apply_batches(batches))
            return apply_batches_in_turn(batch, batches)

        results = self._call(call)
        if attempts == 1:
            return [_APPLIED if applied else _NOT_APPLIED for applied in results]
        return [StepResult(bool(applied), attempts) for applied in results]

    def _apply_ops(self, ops: Sequence[IndexOp]) -> None:
        self._record_scheme()
        batch = self._batch
        if batch is not None:
            self._call(lambda: batch.apply_batch(ops))
            return
        for op in ops:
            self._call(functools.partial(apply_op, self.index, op))

    def _lookup(self, engine_key: int) -> int | None:
        index = self.index

        def call() -> int | None:
            try:
                return int(index.get_request_key(engine_key))
            except EngineKeyNotFoundError:
                return None

        return self._call(call)

    def _clear(self, action: ClearPod) -> None:
        index = self.index

        def progress(_done: int, _removed: int) -> None:
            drive(action.heartbeat(), self.perform)

        selective = action.device_tiers is not None or action.dp_rank is not None
        if selective and isinstance(index, SelectiveClearIndex):
            self._call(
                lambda: index.clear_entries(
                    action.pod,
                    device_tiers=action.device_tiers,
                    dp_rank=action.dp_rank,
                    progress=progress,
                )
            )
        elif isinstance(index, ProgressClearIndex):
            self._call(lambda: index.clear_with_progress(action.pod, progress))
        else:
            self._call(lambda: index.clear(action.pod))
        journal = self.journal
        if journal is not None and not selective:
            self._journal_call(lambda: journal.delete(action.pod))
            with self._journal_lock:
                self._entries[action.pod] = 0

    # -- page journals -----------------------------------------------------------------------

    def _journal_call(self, fn: Callable[[], T]) -> T:
        """A journal operation: an error becomes :class:`Failed` (the journal is kept beside
        the index, by another client: the index calls' retries do not cover it)."""
        self._counters.inc(Counter.INDEX_CALLS)
        try:
            return fn()
        except Exception as exc:
            raise Failed(f"{type(exc).__name__}: {exc}") from exc

    def _read_journal(self, pod: str) -> list[bytes]:
        journal = self.journal
        if journal is None:
            return []
        entries = self._journal_call(lambda: journal.read(pod))
        with self._journal_lock:
            self._entries[pod] = len(entries)
        return entries

    def _append_journal(self, entries: Sequence[tuple[str, bytes]]) -> None:
        """Append, then compact the pods whose journal this process doubled since it last did."""
        journal = self.journal
        if journal is None or not entries:
            return
        self._journal_call(lambda: journal.append(entries))
        due: list[str] = []
        with self._journal_lock:
            for pod, entry in entries:
                if pod in self._entries:
                    self._entries[pod] += 1
                appended = self._appended[pod] = self._appended.get(pod, 0) + len(entry)
                if appended >= max(COMPACT_MIN_BYTES, COMPACT_GROWTH * self._compacted.get(pod, 0)):
                    self._appended[pod] = 0
                    due.append(pod)
        for pod in due:
            with self._journal_lock:
                mine = self._entries.get(pod)
            take = self._snapshot
            snapshot = None if take is None else functools.partial(take, pod)
            size = self._journal_call(functools.partial(journal.compact, pod, mine, snapshot))
            with self._journal_lock:
                if size is not None:
                    self._compacted[pod] = size
                    self._entries[pod] = 1
                else:
                    self._entries.pop(pod, None)  # a peer wrote to it: replay it next time

    # -- replay ----------------------------------------------------------------------------

    def _replay(self, endpoint: EndpointConfig) -> ReplayClient | None:
        key = endpoint.endpoint
        if key not in self._replays:
            self._replays[key] = self._replay_factory(endpoint)
        return self._replays[key]

    def _fetch(self, action: FetchReplay) -> list[ReplayedMessage] | None:
        stream, start = action.endpoint.stream_name, action.start_seq
        client = self._replay(action.endpoint)
        found: list[ReplayedMessage] | None = None
        if client is not None:
            try:
                found = client.fetch(start)
            except Exception as exc:
                logger.warning("stream %s: replay from %d failed: %s", stream, start, exc)
        if found is None:
            logger.warning("stream %s: replay from %d got no answer", stream, start)
        return found

    def close_replays(self) -> None:
        """Close every replay client (they are opened again on next use)."""
        replays, self._replays = self._replays, {}
        for client in replays.values():
            if client is not None:
                client.close()

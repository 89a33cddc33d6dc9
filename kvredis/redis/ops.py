"""The index operations as sans-IO generators, and the combinators that run them.

Every index operation (``op_*``) is a generator that yields requests
(:mod:`kvredis.redis.requests`), receives each reply, and returns the operation's result. The
combinators add what every operation needs, once, for every executor:

- :func:`op_send` sends one request: a :class:`ScriptCall` as ``EVALSHA``, loading the script
  and sending it again when the server answers ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a restart or
  a failover; in a pipeline only the calls that got ``NOSCRIPT`` are sent again); transient
  failures (connection lost, timeout, ``BUSY``/``LOADING``/``MASTERDOWN``/``READONLY``/
  ``TRYAGAIN`` replies) are retried ``retries`` times after a :class:`Sleep` with exponential
  backoff, then raise :class:`~kvredis.errors.BackendUnavailableError` naming the server; a
  refused authentication raises it at once; any other error reply becomes its
  :mod:`kvredis.errors` exception (:func:`kvredis.errors.translate`).
- :func:`op_drive` runs an operation, sending each of its requests with :func:`op_send`.
- :func:`op_run` loads the namespace when needed, runs an operation, and when the namespace
  turns out to be stale (recreated since it was loaded) reloads it and runs the operation once
  more.

An executor (:mod:`kvredis.redis.executor`) only sends what the outermost generator yields and
resumes it with the reply or a :class:`~kvredis.redis.requests.Failure`. Every index call is
idempotent (adds and evicts have set semantics, watermarked batches apply at most once), which
is what makes retrying a request safe.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark, check_batch, check_stream
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    check_add,
    check_entries,
    check_hash,
    check_key_type,
    check_pod_identifier,
    infer_mappings,
    pod_filter,
)
from kvredis.errors import (
    BackendUnavailableError,
    EngineKeyNotFoundError,
    InvalidInputError,
    NamespaceLayoutError,
    StaleNamespaceError,
    translate,
)
from kvredis.index import ClearProgress
from kvredis.redis.codec import bytes_text, encode_entry, hash_field, pack_hashes, text_bytes
from kvredis.redis.layout import LAYOUT_VERSION, Layout, meta_key
from kvredis.redis.requests import (
    Arg,
    AuthenticationFailed,
    Command,
    ConnectionLost,
    ErrorReply,
    Failure,
    Op,
    Pipeline,
    Request,
    ScriptCall,
    Sleep,
)
from kvredis.redis.scripts import ScriptRegistry
from kvredis.redis.state import CoreState
from kvredis.scoring import DEFAULT_MEDIUM_WEIGHTS, UNKNOWN_TIER_WEIGHT, LongestPrefixScorer
from kvredis.types import KeyType, PodEntry

T = TypeVar("T")

#: Argument types of the index operations (those of the Index protocol).
Keys = Sequence[int]
Pods = Collection[str] | None
Entries = Sequence[PodEntry]
Weights = Mapping[str, float] | None

#: Fields the clear loop aims to examine per script call (sizes the SCAN pages).
DEFAULT_CLEAR_FIELDS_PER_CALL = 512
#: Error replies of a server that is up but cannot serve right now (retried like timeouts).
TRANSIENT_REPLIES = frozenset({"BUSY", "LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN"})
#: How many times one call is sent in all when the server keeps answering NOSCRIPT (a flush
#: racing the reload).
NOSCRIPT_ATTEMPTS = 3


# -- combinators -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a failing request is retried, and the server named when giving up."""

    retries: int
    backoff: float
    #: e.g. ``"redis at 127.0.0.1:6379"`` (password masked)
    server: str

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1``: exponential, at most one second."""
        return float(min(1.0, self.backoff * (2**attempt)))

    def unavailable(self, failure: Failure) -> BackendUnavailableError:
        """The error a request raises when it gives up."""
        what = (
            "authentication failed at"
            if isinstance(failure, AuthenticationFailed)
            else "cannot reach"
        )
        return BackendUnavailableError(f"{what} {self.server}: {failure.message}")


@dataclass(frozen=True, slots=True)
class Session:
    """What one index client carries through its operations (shared by its threads/tasks)."""

    state: CoreState
    registry: ScriptRegistry
    policy: RetryPolicy


def _load_scripts(registry: ScriptRegistry, names: Collection[str]) -> Op[None]:
    for name in sorted(names):
        registry.check_loaded(name, (yield registry.load(name)))


def _script_call(registry: ScriptRegistry, call: ScriptCall) -> Op[Any]:
    for attempt in range(1, NOSCRIPT_ATTEMPTS + 1):
        try:
            return (yield registry.evalsha(call))
        except ErrorReply as failure:
            if failure.code != "NOSCRIPT" or attempt == NOSCRIPT_ATTEMPTS:
                raise
        yield from _load_scripts(registry, (call.script,))
    raise AssertionError("unreachable")  # pragma: no cover


def _noscript(reply: Any) -> bool:
    return isinstance(reply, ErrorReply) and reply.code == "NOSCRIPT"


def _pipeline(registry: ScriptRegistry, items: Sequence[ScriptCall | Command]) -> Op[list[Any]]:
    def wire(positions: Sequence[int]) -> Pipeline:
        return Pipeline(
            tuple(
                registry.evalsha(item) if isinstance(item, ScriptCall) else item
                for item in (items[i] for i in positions)
            )
        )

    replies = list((yield wire(range(len(items)))))
    for _ in range(NOSCRIPT_ATTEMPTS - 1):
        missing = [i for i, reply in enumerate(replies) if _noscript(reply)]
        if not missing:
            break
        calls = (items[i] for i in missing)
        yield from _load_scripts(registry, {c.script for c in calls if isinstance(c, ScriptCall)})
        for i, reply in zip(missing, (yield wire(missing)), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Failure):
            raise reply
    return replies


def op_send(session: Session, request: Request) -> Op[Any]:
    """Send one request: scripts by EVALSHA with reload on NOSCRIPT, retries, error translation.

    A pipeline's reply is the list of its replies; a failed command in it fails the whole
    request (every request is idempotent, so it may be sent again).
    """
    policy, registry = session.policy, session.registry
    attempt = 0
    while True:
        try:
            if isinstance(request, ScriptCall):
                return (yield from _script_call(registry, request))
            if isinstance(request, Pipeline):
                return (yield from _pipeline(registry, request.items))
            return (yield request)
        except AuthenticationFailed as failure:
            raise policy.unavailable(failure) from failure
        except (ConnectionLost, ErrorReply) as failure:
            if isinstance(failure, ErrorReply) and failure.code not in TRANSIENT_REPLIES:
                raise translate(failure.message) from failure
            if attempt >= policy.retries:
                raise policy.unavailable(failure) from failure
        yield Sleep(policy.delay(attempt))
        attempt += 1


def op_drive(session: Session, op: Op[T]) -> Op[T]:
    """Run ``op``, sending each of its requests with :func:`op_send`."""
    try:
        request = next(op)
        while True:
            reply = yield from op_send(session, request)
            request = op.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        op.close()


def op_run(session: Session, factory: Callable[[], Op[T]]) -> Op[T]:
    """Run the operation ``factory()`` makes; on a stale namespace reload it and run once more.

    Loads the namespace first if this client has not loaded it yet.
    """
    if not session.state.loaded:
        yield from op_drive(session, op_load_namespace(session.state, ping=False))
    try:
        return (yield from op_drive(session, factory()))
    except StaleNamespaceError:
        yield from op_drive(session, op_load_namespace(session.state, ping=False))
        return (yield from op_drive(session, factory()))


def op_connect(session: Session) -> Op[Layout]:
    """Ping the server and load the namespace (what constructing a client does)."""
    return (yield from op_drive(session, op_load_namespace(session.state, ping=True)))


# -- operations --------------------------------------------------------------------------------


def op_load_namespace(state: CoreState, ping: bool = True) -> Op[Layout]:
    """Ping the server, then create or read the namespace's meta record and adopt it."""
    if ping:
        yield Command(("PING",))
    reply = yield ScriptCall(
        "namespace",
        (meta_key(state.namespace),),
        (LAYOUT_VERSION, state.bucket_bits, secrets.token_hex(8)),
    )
    return state.adopt(reply)


def _pod_args(pods: frozenset[str] | None) -> list[Arg]:
    if pods is None:
        return [0]
    # Only str ids can name a pod; a filter of nothing else matches nothing (the empty id,
    # which no entry can have).
    names = [text_bytes(p) for p in pods if isinstance(p, str)] or [b""]
    return [len(names), *names]


def op_lookup(
    state: CoreState, request_keys: Keys, pod_identifier_set: Pods
) -> Op[dict[int, list[PodEntry]]]:
    """``Index.lookup``: one ``lookup`` script call."""
    keys, chain = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    if not keys:
        return {}
    layout, cache = state.snapshot()
    reply = yield ScriptCall(
        "lookup",
        (layout.meta, layout.pi, layout.pp),
        (layout.gen, layout.rprefix, layout.bucket_bits, cache.floor, *_pod_args(pods), chain),
    )
    cache.learn(reply[1], int(reply[0]))
    entries = cache.entries
    return {key: entries(ids) for key, ids in zip(keys, reply[2:], strict=False)}


def score_weights(medium_weights: Weights) -> Mapping[str, float]:
    """Validated tier weights (``None`` gives the scorer's defaults)."""
    if medium_weights is None:
        return DEFAULT_MEDIUM_WEIGHTS
    return LongestPrefixScorer(medium_weights).medium_weights


def op_score(
    state: CoreState, request_keys: Keys, medium_weights: Weights, pod_identifier_set: Pods
) -> Op[dict[str, float]]:
    """Server-side LongestPrefixScorer over the chain: one ``score`` script call."""
    keys, chain = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    weights = score_weights(medium_weights)
    if not keys:
        return {}
    layout = state.layout
    weight_args: list[Arg] = [len(weights)]
    for tier, weight in weights.items():
        weight_args += (text_bytes(tier), repr(float(weight)))
    reply = yield ScriptCall(
        "score",
        (layout.meta, layout.pi, layout.pp),
        (
            layout.gen,
            layout.rprefix,
            layout.bucket_bits,
            *_pod_args(pods),
            *weight_args,
            repr(float(UNKNOWN_TIER_WEIGHT)),
            chain,
        ),
    )
    return {bytes_text(reply[i]): float(reply[i + 1]) for i in range(0, len(reply), 2)}


class _Program:
    """Builds the op program of add / evict / apply_batch (see ``lua/apply_batch.lua``)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.entries: list[bytes] = []
        self._entry_index: dict[PodEntry, int] = {}
        self.ops: list[Arg] = []
        self.count = 0

    def entry(self, entry: PodEntry) -> int:
        index = self._entry_index.get(entry)
        if index is None:
            self.entries.append(encode_entry(entry))
            index = self._entry_index[entry] = len(self.entries)
        return index

    def add(self, engine_keys: Keys | None, request_keys: Keys, entries: Entries) -> None:
        pairs = infer_mappings(engine_keys, request_keys) if engine_keys else []
        ents = list(dict.fromkeys(entries))
        self.ops += ("A", len(ents), *(self.entry(e) for e in ents))
        self.ops.append(struct.pack(f">{len(request_keys)}Q", *request_keys))
        self.ops.append(struct.pack(f">{2 * len(pairs)}Q", *(k for pair in pairs for k in pair)))
        self.count += 1

    def evict(self, key: int, key_type: KeyType, entries: Entries) -> None:
        ents = list(dict.fromkeys(entries))
        tag = "R" if key_type is KeyType.REQUEST else "E"
        self.ops += (tag, hash_field(key), len(ents), *(self.entry(e) for e in ents))
        self.count += 1

    def bucket_args(self) -> list[Arg]:
        layout = self.layout
        return [layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits]

    def entry_args(self) -> list[Arg]:
        return [len(self.entries), *self.entries]


def op_add(
    state: CoreState, engine_keys: Keys | None, request_keys: Keys, entries: Entries
) -> Op[None]:
    """``Index.add``: one ``add`` script call."""
    eng, req, ents = check_add(engine_keys, request_keys, entries)
    layout = state.layout
    program = _Program(layout)
    program.add(eng, req, ents)
    yield ScriptCall(
        "add",
        (layout.meta, layout.pe, layout.pi, layout.pp),
        [
            *program.bucket_args(),
            MAX_REQUEST_KEYS_PER_ENGINE_KEY,
            *program.entry_args(),
            *program.ops,
        ],
    )


def op_evict(state: CoreState, key: int, key_type: KeyType, entries: Entries) -> Op[None]:
    """``Index.evict``: one ``evict`` script call."""
    k = check_hash(key, "evict key")
    kt = check_key_type(key_type)
    ents = check_entries(entries)
    layout = state.layout
    program = _Program(layout)
    program.evict(k, kt, ents)
    yield ScriptCall(
        "evict",
        (layout.meta, layout.pe),
        [*program.bucket_args(), *program.entry_args(), *program.ops],
    )


def op_get_request_key(state: CoreState, engine_key: int) -> Op[int]:
    """``Index.get_request_key``: one ``request_key`` script call."""
    k = check_hash(engine_key, "engine key")
    layout = state.layout
    reply = yield ScriptCall(
        "request_key",
        (layout.meta,),
        (layout.gen, layout.eprefix, layout.bucket_bits, hash_field(k)),
    )
    if reply is None:
        raise EngineKeyNotFoundError(k)
    return int.from_bytes(reply, "big")


def op_apply_batch(
    state: CoreState, ops: Sequence[IndexOp], stream: str | None, watermark: Watermark | None
) -> Op[bool]:
    """``BatchIndex.apply_batch``: one ``apply_batch`` script call for the whole batch."""
    plan = check_batch(ops, stream, watermark)
    if not plan and stream is None:
        return True
    layout = state.layout
    program = _Program(layout)
    for op in plan:
        if isinstance(op, AddOp):
            program.add(op.engine_keys, op.request_keys, op.entries)
        elif isinstance(op, EvictOp):
            program.evict(op.key, op.key_type, op.entries)
    fence: list[Arg] = [b"", 0, 0]
    if stream is not None and watermark is not None:
        fence = [text_bytes(stream), str(watermark.epoch), str(watermark.seq)]
    reply = yield ScriptCall(
        "apply_batch",
        (layout.meta, layout.pe, layout.pi, layout.pp, layout.wm),
        [
            *program.bucket_args(),
            MAX_REQUEST_KEYS_PER_ENGINE_KEY,
            *fence,
            *program.entry_args(),
            program.count,
            *program.ops,
        ],
    )
    return bool(int(reply))


def op_get_watermark(state: CoreState, stream: str) -> Op[Watermark | None]:
    """``BatchIndex.get_watermark``: one HGET."""
    name = check_stream(stream)
    reply = yield Command(("HGET", state.layout.wm, text_bytes(name)))
    if reply is None:
        return None
    epoch, sep, seq = bytes(reply).partition(b":")
    try:
        if not sep:
            raise ValueError("no separator")
        return Watermark(int(epoch), int(seq))
    except (ValueError, InvalidInputError) as exc:
        raise NamespaceLayoutError(f"malformed watermark {reply!r} for stream {name!r}") from exc


def op_reset_watermark(state: CoreState, stream: str, watermark: Watermark | None) -> Op[None]:
    """``BatchIndex.reset_watermark``: one HSET or HDEL."""
    name = check_stream(stream)
    if watermark is not None and not isinstance(watermark, Watermark):
        raise InvalidInputError(f"watermark must be a Watermark or None, got {watermark!r}")
    layout = state.layout
    if watermark is None:
        yield Command(("HDEL", layout.wm, text_bytes(name)))
    else:
        value = f"{watermark.epoch}:{watermark.seq}"
        yield Command(("HSET", layout.wm, text_bytes(name), value))


def _scan_reply(reply: Any) -> tuple[int, list[bytes]]:
    cursor, keys = reply
    return int(cursor), list(keys)


def _paged(
    pattern: bytes,
    fields_per_call: int,
    call: Callable[[list[bytes]], ScriptCall],
    on_page: Callable[[int, int], None],
) -> Op[None]:
    """SCAN ``pattern`` and run ``call(keys)`` on pages of keys sized to ``fields_per_call``.

    The page size adapts to the work the script reports per key (second element of its reply),
    and a page never exceeds it even when SCAN returns more keys (they wait for the next call).
    When the buffered keys run out, the script call travels in one pipeline with the next SCAN,
    so a page costs one round trip. ``on_page(keys in page, first element of the reply)`` is
    called after each page.
    """
    size = 8

    def scan(cursor: int) -> Command:
        return Command(("SCAN", cursor, "MATCH", pattern, "COUNT", size))

    cursor, buffered = _scan_reply((yield scan(0)))
    while buffered or cursor:
        if not buffered:
            cursor, buffered = _scan_reply((yield scan(cursor)))
            continue
        page, buffered = buffered[:size], buffered[size:]
        if cursor and not buffered:
            replies = yield Pipeline((call(page), scan(cursor)))
            result = replies[0]
            cursor, buffered = _scan_reply(replies[1])
        else:
            result = yield call(page)
        n, work = int(result[0]), int(result[1])
        on_page(len(page), n)
        size = max(1, min(1024, int(fields_per_call / max(1.0, work / len(page)))))


def op_clear(
    state: CoreState,
    pod_identifier: str,
    progress: ClearProgress | None = None,
    fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL,
) -> Op[int]:
    """``Index.clear``: remove every entry of the pod, page by page; returns entries removed.

    Two passes over the namespace with SCAN MATCH (never the whole keyspace): the request
    buckets (``clear`` script: remove the pod's entry ids, delete emptied request keys), then the
    engine buckets (``clear_mappings`` script: drop mappings none of whose request keys holds an
    entry). ``progress(done, removed)`` is called after every page with the bucket keys processed
    so far (both passes; SCAN may report a key twice) and the (request key, entry) pairs removed
    so far. A pod the namespace never saw costs one HGET.
    """
    pod = check_pod_identifier(pod_identifier)
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
    layout = state.layout
    ids = yield Command(("HGET", layout.pp, text_bytes(pod)))
    if not ids:
        return 0
    done = removed = 0

    def on_request_page(keys: int, n: int) -> None:
        nonlocal done, removed
        done += keys
        removed += n
        if progress is not None:
            progress(done, removed)

    def on_engine_page(keys: int, _dropped: int) -> None:
        nonlocal done
        done += keys
        if progress is not None:
            progress(done, removed)

    yield from _paged(
        layout.request_pattern(),
        fields_per_call,
        lambda keys: ScriptCall("clear", (layout.meta, *keys), (layout.gen, ids)),
        on_request_page,
    )
    yield from _paged(
        layout.engine_pattern(),
        fields_per_call,
        lambda keys: ScriptCall(
            "clear_mappings", (layout.meta, *keys), (layout.gen, layout.rprefix, layout.bucket_bits)
        ),
        on_engine_page,
    )
    return removed


def op_drop_namespace(state: CoreState, keys_per_call: int = 1000) -> Op[int]:
    """Delete every key of the namespace (SCAN MATCH on its prefix, UNLINK page by page).

    Returns the number of keys deleted. Other namespaces and foreign keys are never touched.
    Clients of the dropped namespace notice on their next call (the meta record is gone) and
    start over with an empty namespace.
    """
    layout = state.layout
    pattern, meta = layout.namespace_pattern(), layout.meta
    deleted = 0
    cursor: int | None = None
    while cursor != 0:
        scan = ("SCAN", cursor or 0, "MATCH", pattern, "COUNT", keys_per_call)
        cursor, keys = _scan_reply((yield Command(scan)))
        keys = [k for k in keys if k != meta]
        if keys:
            deleted += int((yield Command(("UNLINK", *keys))))
    # The meta record goes last, so a concurrent client cannot re-adopt half a namespace.
    deleted += int((yield Command(("UNLINK", meta))))
    return deleted

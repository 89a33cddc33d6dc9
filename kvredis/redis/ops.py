"""The index operations as sans-IO generators.

Every index operation (``op_*``) is a generator that yields requests
(:mod:`kvredis.redis.requests`), receives each reply, and returns the operation's result. The
session that sends them, with its retries, backoff and script or function reloads, is
:mod:`kvredis.redis.session` (:func:`~kvredis.redis.session.op_send`,
:func:`~kvredis.redis.session.op_drive`); the write programs the ``add``, ``evict`` and
``apply_batch`` scripts run are built by :mod:`kvredis.redis.program`. Here:
:func:`op_run` loads the namespace when needed, runs an operation, and when the namespace turns
out to be stale (recreated since it was loaded) reloads it and runs the operation once more;
:func:`op_connect` checks the server when a client connects.

An executor (:mod:`kvredis.redis.executor`) only sends what the outermost generator yields and
resumes it with the reply or a :class:`~kvredis.redis.requests.Failure`. Every index call is
idempotent (adds and evicts have set semantics, watermarked batches apply at most once and carry
a token, so a resent call that had been applied is recognised and reported applied), which is
what makes retrying a request safe; no call does more than
:data:`~kvredis.redis.program.CALL_BUDGET` units of work.
"""

from __future__ import annotations

import logging
import math
import secrets
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvredis.batch import (
    AddOp,
    Batch,
    EvictOp,
    IndexOp,
    Watermark,
    check_batch,
    check_batches,
    check_stream,
)
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    EntrySelection,
    check_add,
    check_entries,
    check_hash,
    check_key_type,
    check_pod_identifier,
    check_ttl,
    pod_filter,
)
from kvredis.errors import (
    BackendError,
    BackendUnavailableError,
    CallBudgetError,
    EngineKeyNotFoundError,
    InvalidInputError,
    NamespaceLayoutError,
    StaleNamespaceError,
)
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import ClearProgress
from kvredis.redis.codec import (
    HASH_WIDTH,
    ID_WIDTH,
    bytes_text,
    decode_entry,
    encode_entry,
    hash_field,
    pack_hashes,
    text_bytes,
)
from kvredis.redis.config import DEFAULT_CLEAR_FIELDS_PER_CALL
from kvredis.redis.functions import API_VERSION, namespace_call
from kvredis.redis.layout import EXPIRY_FIELD, EXPIRY_KEY, Layout
from kvredis.redis.program import (
    CALL_BUDGET,
    Program,
    Programs,
    add_pieces,
    blob_ops,
    engine_evict_units,
    piece_parents,
    program_of,
)
from kvredis.redis.requests import (
    Arg,
    Command,
    Op,
    Pipeline,
    ScriptCall,
    Sleep,
)
from kvredis.redis.session import (
    Session,
    check_eviction_policy,
    check_not_cluster,
    op_drive,
    op_send,
)
from kvredis.redis.stamps import StampBook
from kvredis.redis.state import (
    CoreState,
    EntryCache,
    namespace_missing_error,
    refused_by_acl,
)
from kvredis.scoring import (
    DEFAULT_MEDIUM_WEIGHTS,
    UNKNOWN_TIER_WEIGHT,
    LongestPrefixScorer,
    best_ranks,
)
from kvredis.types import Entries, Keys, KeyType, PodEntry, Pods

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: Argument types of the index operations (those of the Index protocol).
Weights = Mapping[str, float] | None

#: Request keys one ``lookup`` call walks at most (a read costs a fraction of a write); a longer
#: chain is walked in parts, each sent only while the chain keeps hitting.
LOOKUP_KEYS_PER_CALL = 4096
#: Request keys one ``score`` call walks at most; a longer chain is scored in parts, each sent
#: only while a pod holds every key so far.
SCORE_KEYS_PER_CALL = 4096
#: Entry ids one ``reclaim`` call deletes at most.
RECLAIM_IDS_PER_CALL = 1024


def op_run(session: Session, factory: Callable[[], Op[T]]) -> Op[T]:
    """Run the operation ``factory()`` makes; on a stale namespace reload it and run once more.

    Loads the namespace first if this client has not loaded it yet.
    """
    if not session.state.loaded:
        yield from op_drive(session, op_load_namespace(session.state, False, session.registry.api))
    try:
        return (yield from op_drive(session, factory()))
    except StaleNamespaceError:
        yield from op_drive(session, op_load_namespace(session.state, False, session.registry.api))
        return (yield from op_drive(session, factory()))


def op_connect(session: Session, strict: bool = False) -> Op[Layout]:
    """Ping the server, check that it is no cluster node (:func:`check_not_cluster`), read its
    version (:func:`op_expiry_mode`), load the namespace and check the server's eviction policy
    (what constructing a client does): see :func:`check_eviction_policy`."""
    yield from op_send(session, Command(("PING",)))
    try:
        cluster_info = yield from op_send(session, Command(("INFO", "cluster")))
    except BackendUnavailableError:
        raise
    except BackendError as exc:  # INFO not permitted (ACL, renamed command)
        logger.debug("cannot read INFO cluster from %s: %s", session.policy.server, exc)
    else:
        check_not_cluster(cluster_info, session.policy.server)
    session.state.expiry_mode = yield from op_expiry_mode(session)
    registry, state = session.registry, session.state
    yield from op_drive(session, registry.op_choose(session.policy.server, state))
    layout = yield from op_drive(session, op_load_namespace(state, False, registry.api))
    try:
        info = yield from op_send(session, Command(("INFO", "memory")))
    except BackendError as exc:  # INFO not permitted (ACL, renamed command): nothing to check
        logger.debug("cannot read INFO memory from %s: %s", session.policy.server, exc)
        return layout
    check_eviction_policy(info, session.policy.server, strict)
    return layout


# -- operations --------------------------------------------------------------------------------


#: The prefix of the generation of a namespace being dropped (see ``lua/drop.lua``).
TOMBSTONE = b"dropping:"
#: How many times loading a namespace finishes a drop it finds before giving up.
LOAD_ATTEMPTS = 4


def op_load_namespace(
    state: CoreState, ping: bool = True, api: int | None = API_VERSION
) -> Op[Layout]:
    """Ping the server, then read the namespace's meta record (creating it if missing) and
    adopt it.

    The record is read with a plain HMGET first, so a client starts on a read-only replica and
    under ``maxmemory`` with ``noeviction`` when the namespace exists; only a missing record
    costs the (writing) ``namespace`` script. A drop in progress is finished first. A new
    namespace records how its expiring entries expire (``state.expiry_mode``, found by
    :func:`op_expiry_mode` when the client connects), and ``api``, the protocol version of the
    client's function library (see :func:`kvredis.redis.functions.namespace_call`).
    """
    if ping:
        yield Command(("PING",))
    keys = Layout(state.namespace, state.bucket_bits, b"")
    for _ in range(LOAD_ATTEMPTS):
        fields = yield _read_meta(keys)
        if not all(fields[:3]) and state.wait_for_namespace > 0:
            fields = yield from _op_wait_for_namespace(state, keys)
        if all(fields[:3]):
            state.check_scheme(_scheme_field(fields))
            reply = list(fields[:3])
        else:
            scheme = None if state.scheme is None else state.scheme.text
            try:
                reply = yield namespace_call(state, API_VERSION if api is None else api, scheme)
            except BackendError as exc:
                if not refused_by_acl(str(exc)):
                    raise
                fields = yield _read_meta(keys)
                if not all(fields[:3]):  # still none, and this client may not make it
                    raise namespace_missing_error(state, str(exc)) from None
                state.check_scheme(_scheme_field(fields))
                reply = list(fields[:3])
        gen = reply[2] if isinstance(reply, (list, tuple)) and len(reply) == 3 else None
        if not (isinstance(gen, bytes) and gen.startswith(TOMBSTONE)):
            return state.adopt(reply)
        yield from _finish_drop(keys, gen)
    raise StaleNamespaceError(f"namespace {state.namespace!r} keeps being dropped; try again")


#: The first and the longest pause between two reads of a namespace a client waits for.
#: The first and the longest pause between reads of a namespace a client waits for.
WAIT_FIRST_S = 0.05
WAIT_LONGEST_S = 1.0


def _read_meta(keys: Layout) -> Command:
    """The read of a namespace's meta record: ``layout``, ``bucket_bits``, ``gen`` (all set
    once it exists) and ``scheme`` (its block key scheme, when one was recorded)."""
    return Command(("HMGET", keys.meta, "layout", "bucket_bits", "gen", "scheme"))


def _scheme_field(fields: Sequence[Any]) -> Any:
    """The ``scheme`` of a :func:`_read_meta` reply (None when it holds none)."""
    return fields[3] if len(fields) > 3 else None


def _op_wait_for_namespace(state: CoreState, keys: Layout) -> Op[Any]:
    """Read the meta record (:func:`_read_meta`) until it exists, for at most
    ``state.wait_for_namespace`` seconds (slept between reads, doubling up to
    :data:`WAIT_LONGEST_S`); never creates it. Raises
    :class:`~kvredis.errors.NamespaceMissingError` when it did not appear in time."""
    waited, pause = 0.0, WAIT_FIRST_S
    logger.info(
        "namespace %r does not exist yet%s: waiting up to %g s for its creator (an ingester, "
        "kvredis restore)",
        state.namespace,
        f" at {state.address}" if state.address else "",
        state.wait_for_namespace,
    )
    while True:
        step = min(pause, state.wait_for_namespace - waited)
        if step <= 0:
            raise namespace_missing_error(state, None)
        yield Sleep(step)
        waited += step
        pause = min(WAIT_LONGEST_S, pause * 2)
        fields = yield _read_meta(keys)
        if all(fields[:3]):
            return fields


def op_expiry_mode(session: Session) -> Op[str]:
    """How this server can expire speculative entries by itself: ``"field"`` with hash field
    expiry (``HPEXPIREAT``: Redis 7.4+, Valkey 9+), else ``"key"``, from the versions in
    ``INFO server``. A server that does not answer it (ACL, renamed command) counts as
    ``"key"``, which works everywhere."""
    try:
        info = yield from op_send(session, Command(("INFO", "server")))
    except BackendUnavailableError:
        raise
    except BackendError as exc:
        logger.debug("cannot read INFO server from %s: %s", session.policy.server, exc)
        return EXPIRY_KEY
    return expiry_mode_of(info)


#: The first versions with hash field expiry (HPEXPIREAT), by ``INFO server`` field.
FIELD_EXPIRY_SINCE = {"valkey_version": (9, 0), "redis_version": (7, 4)}


def expiry_mode_of(info: Any) -> str:
    """``"field"`` when ``INFO server`` (a mapping, or its text) names a server with hash field
    expiry, else ``"key"``. Valkey also reports a ``redis_version`` (7.2.4), so its own version
    decides."""
    fields: dict[str, str] = {}
    if isinstance(info, Mapping):
        fields = {str(k): str(v) for k, v in info.items()}
    elif isinstance(info, (bytes, str)):
        text = info.decode("utf-8", "replace") if isinstance(info, bytes) else info
        for line in text.splitlines():
            name, _, value = line.partition(":")
            fields[name.strip()] = value.strip()
    for name, since in FIELD_EXPIRY_SINCE.items():
        if name in fields:
            parts = fields[name].split(".")[:2]
            try:
                version = tuple(int(p) for p in parts)
            except ValueError:
                return EXPIRY_KEY
            return EXPIRY_FIELD if version >= since else EXPIRY_KEY
    return EXPIRY_KEY


def pod_args(pods: frozenset[str] | None) -> list[Arg]:
    if pods is None:
        return [0]
    # Only str ids can name a pod; a filter of nothing else matches nothing (the empty id,
    # which no entry can have).
    names = [text_bytes(p) for p in pods if isinstance(p, str)] or [b""]
    return [len(names), *names]


def op_lookup(
    state: CoreState, request_keys: Keys, pod_identifier_set: Pods, book: StampBook | None = None
) -> Op[dict[int, list[PodEntry]]]:
    """``Index.lookup``: one ``lookup`` script call (one per :data:`LOOKUP_KEYS_PER_CALL` keys
    of a longer chain, and one more where a walk stops at its work limit, each sent only while
    the chain keeps hitting); a read, which a replica may answer. The parts of a chain carry
    stamps (:mod:`kvredis.redis.stamps`; ``book``, when given, carries them from and to the
    caller's earlier and later reads of the namespace, and every part then asks for the stamps
    of the pods it reads): a pod that lost an entry since an earlier part read it keeps only
    what the parts before read."""
    keys, chain = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    if not keys:
        return {}
    layout, cache = state.snapshot()
    # a caller's book reads on after this lookup (a cluster's other shards): every part stamps
    always = book is not None
    if book is None:
        book = StampBook()
    book.bind(layout.gen)
    filter_args = pod_args(pods)
    found: dict[int, list[PodEntry]] = {}
    step, start = LOOKUP_KEYS_PER_CALL, 0
    while start < len(keys):
        whole = start == 0 and len(keys) <= step
        piece = chain if whole else chain[start * HASH_WIDTH : (start + step) * HASH_WIDTH]
        more = 1 if always or start + len(piece) // HASH_WIDTH < len(keys) else 0
        reply = yield ScriptCall(
            "lookup",
            (layout.meta, layout.pi, layout.pp, layout.sx),
            (
                layout.gen,
                layout.rprefix,
                layout.bucket_bits,
                cache.floor,
                *filter_args,
                piece,
                more,
                *book.args(),
            ),
            read=True,
        )
        at = read_lookup_reply(cache, reply, keys, start, found, book=book)
        if walk_cut(reply) and at > start:  # stopped at the walk's work limit: walk on
            start = at
        elif at - start < len(piece) // HASH_WIDTH:
            break
        else:
            start += step
    return found


def walk_cut(reply: Sequence[Any]) -> bool:
    """Whether a ``lookup`` reply says the walk stopped at its work limit (an element after its
    pairs) rather than at a miss or the chain's end."""
    return len(reply) % 2 == 0


def read_lookup_reply(
    cache: EntryCache,
    reply: Sequence[Any],
    keys: Sequence[int],
    start: int,
    found: dict[int, Any],
    shared: bool = False,
    book: StampBook | None = None,
) -> int:
    """Take in a ``lookup`` reply for the chain ``keys`` walked from ``start``: learn the
    definitions it carries, record each hit key's entries in ``found`` (a list of its own per
    key, or with ``shared`` one tuple shared by the keys holding the same entries); the position
    after the last hit. A key whose ids all lack a definition holds no entry: the chain ends
    before it (never a hit with an empty entry list). With ``book``, the reply's stamps go into
    it first, and the entries of the pods it dropped are left out (a key left without entries
    ends the chain there)."""
    cache.learn(reply[1], int(reply[0]))
    entries = cache.holders
    dropped: set[str] = set()
    if book is not None:
        book.take(reply[2])
        dropped = book.dropped
    kept: dict[Any, tuple[PodEntry, ...]] = {}
    at = start
    for i in range(3, len(reply) - 1, 2):  # a last element after the pairs: the walk was cut
        n, held = int(reply[i]), entries(reply[i + 1])
        if dropped and held:
            ids = reply[i + 1]
            held = kept.get(ids)  # type: ignore[assignment]
            if held is None:
                held = kept[ids] = tuple(e for e in entries(ids) if e.pod_identifier not in dropped)
        if not held:
            break
        if shared:
            found.update(dict.fromkeys(keys[at : at + n], held))
        else:
            for key in keys[at : at + n]:
                found[key] = list(held)
        at += n
    return at


def score_weights(medium_weights: Weights) -> Mapping[str, float]:
    """Validated tier weights (``None`` gives the scorer's defaults)."""
    if medium_weights is None:
        return DEFAULT_MEDIUM_WEIGHTS
    return LongestPrefixScorer(medium_weights).medium_weights


def op_score(
    state: CoreState, request_keys: Keys, medium_weights: Weights, pod_identifier_set: Pods
) -> Op[dict[str, float]]:
    """Server-side LongestPrefixScorer over the chain: each pod's best data-parallel rank's
    score (:func:`op_score_by_rank`)."""
    return best_ranks(
        (yield from op_score_by_rank(state, request_keys, medium_weights, pod_identifier_set))
    )


def op_score_by_rank(
    state: CoreState, request_keys: Keys, medium_weights: Weights, pod_identifier_set: Pods
) -> Op[dict[str, dict[int, float]]]:
    """Server-side LongestPrefixScorer over the chain, per pod and data-parallel rank: one
    ``score`` script call per :data:`SCORE_KEYS_PER_CALL` keys of the chain (and one more
    where a walk stops at its work limit), each sent only while a (pod, rank) holds every key
    so far; a later call goes on from the scores the earlier ones reached, so the floats are
    the scorer's whatever the parts, and carries their stamps (:mod:`kvredis.redis.stamps`):
    one whose pod lost an entry since an earlier part read it keeps the score it had. A read,
    which a replica may answer."""
    keys, chain = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    weights = score_weights(medium_weights)
    if not keys:
        return {}
    layout = state.layout
    fixed: list[Arg] = [layout.gen, layout.rprefix, layout.bucket_bits, *pod_args(pods)]
    fixed.append(len(weights))
    for tier, weight in weights.items():
        fixed += (text_bytes(tier), repr(float(weight)))
    fixed.append(repr(float(UNKNOWN_TIER_WEIGHT)))
    scores: dict[tuple[bytes, int], float] = {}
    carried: list[Arg] = [0]  # the (pod, rank)s still in the race, their scores and stamps
    start = 0
    while start < len(keys):
        piece = chain[start * HASH_WIDTH : (start + SCORE_KEYS_PER_CALL) * HASH_WIDTH]
        more = 1 if start + len(piece) // HASH_WIDTH < len(keys) else 0
        reply = yield ScriptCall(
            "score",
            (layout.meta, layout.pi, layout.pp, layout.sx),
            (*fixed, piece, more, *carried),
            read=True,
        )
        walked, cut, live = read_score_reply(reply, scores)
        if not live or (walked < len(piece) // HASH_WIDTH and not cut) or walked == 0:
            break  # none left, or a key none holds
        start += walked
        carried = [len(live)]
        for slot, stamp in live:
            carried += (slot[0], slot[1], repr(scores[slot]), stamp)
    out: dict[str, dict[int, float]] = {}
    for (pod, rank), score in scores.items():
        out.setdefault(bytes_text(pod), {})[rank] = score
    return out


def read_score_reply(
    reply: Sequence[Any], scores: dict[tuple[bytes, int], float]
) -> tuple[int, bool, list[tuple[tuple[bytes, int], bytes]]]:
    """Take in a ``score`` reply: each (pod, rank)'s score into ``scores`` (keeping its place
    of first appearance); how many keys the call walked, whether its walk stopped at the work
    limit, and the (pod, rank)s still holding every key walked, in order, with their stamps."""
    live: list[tuple[tuple[bytes, int], bytes]] = []
    for i in range(2, len(reply) - 4, 5):
        slot = (bytes(reply[i]), int(reply[i + 1]))
        scores[slot] = float(reply[i + 2])
        if int(reply[i + 3]):
            live.append((slot, bytes(reply[i + 4])))
    return int(reply[0]), bool(int(reply[1])), live


def op_add(
    state: CoreState,
    engine_keys: Keys | None,
    request_keys: Keys,
    entries: Entries,
    ttl: float | None = None,
) -> Op[None]:
    """``Index.add``: one ``add`` script call (one per
    :data:`~kvredis.redis.program.CALL_BUDGET` of work)."""
    eng, req, ents = check_add(engine_keys, request_keys, entries)
    seconds = check_ttl(ttl, ents)
    ttl_ms = 0 if seconds is None else max(1, math.ceil(seconds * 1000))
    yield from op_add_pieces(state, add_pieces(eng, req, ents), list(dict.fromkeys(ents)), ttl_ms)


def op_add_pieces(
    state: CoreState,
    pieces: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]],
    unique: Entries,
    ttl_ms: int,
) -> Op[None]:
    """One ``add`` script call per piece (see :func:`add_pieces`) of checked input (more when
    the server refuses a piece as over budget: :func:`op_parts`)."""
    layout = state.layout
    parents = piece_parents(pieces, None)
    programs = [
        program_of(layout, [("A", keys, pairs, unique, parent)])
        for (keys, pairs), parent in zip(pieces, parents, strict=True)
    ]
    yield from op_parts(programs, lambda program, part, parts: add_call(program, ttl_ms))


def op_parts(
    programs: Sequence[Program],
    call: Callable[[Program, int, int], ScriptCall],
    first: int = 1,
    after: int = 0,
    fenced: bool = False,
) -> Op[tuple[bool, int]]:
    """Send ``programs`` in order as parts ``first, first + 1, ...`` of a batch of
    ``after`` parts more than these, each as ``call(program, part, parts)``.

    A program the server refuses as over budget (:class:`~kvredis.errors.CallBudgetError`:
    its keys reach too many fragmented chain runs; it wrote nothing) is sent as its
    :meth:`Program.pieces` of the size the server found to fit instead (an evict by engine key
    as evicts by request key of the request keys its mapping lists, read first, then the evict
    by engine key that drops the mapping), and the parts after it are numbered anew (a fenced
    batch keeps its token: the server counts the parts done, not how many there are). With
    ``fenced``, stops at the first part the server skipped (reply 0). Returns whether every
    part applied, and how many parts were added by splitting.
    """
    queue = list(programs)
    queue.reverse()
    part, added = first, 0
    while queue:
        program = queue.pop()
        try:
            reply = yield call(program, part, part + len(queue) + after)
        except CallBudgetError as exc:
            units = program.units
            if exc.ops == 0 and units and units[0][0] == "E":
                # its request keys reach too many runs: evict them by request key, in pieces
                # of the size that fits, then the evict by engine key of the rest
                key = units[0][1]
                layout = program.layout
                mapping = yield Command(("HGET", layout.engine_bucket(key), hash_field(key)))
                expanded = [*engine_evict_units(units[0], mapping), *units[1:]]
                program = program_of(layout, expanded)
                pieces = program.pieces(max(1, exc.keys)) or [program]  # nothing mapped now
            else:
                pieces = program.pieces(exc.ops, exc.keys)
            if not pieces:
                raise
            queue += reversed(pieces)
            added += len(pieces) - 1
            continue
        if fenced and not int(reply):
            return False, added
        part += 1
    return True, added


def add_call(program: Program, ttl_ms: int) -> ScriptCall:
    """The ``add`` call of a program of one add op (``lua/add.lua``)."""
    layout = program.layout
    return ScriptCall(
        "add",
        (layout.meta, layout.pe, layout.pi, layout.pp, layout.sx),
        [
            *program.bucket_args(),
            MAX_REQUEST_KEYS_PER_ENGINE_KEY,
            ttl_ms,
            *program.entry_args(),
            *program.ops,
        ],
    )


def op_evict(state: CoreState, key: int, key_type: KeyType, entries: Entries) -> Op[None]:
    """``Index.evict``: one ``evict`` script call (more when an evict by engine key reaches
    too many fragmented runs: :func:`op_parts`)."""
    k = check_hash(key, "evict key")
    kt = check_key_type(key_type)
    ents = check_entries(entries)
    program = Program(state.layout)
    program.evict(k, kt, ents)
    yield from op_parts([program], evict_call)


def evict_call(program: Program, part: int = 1, parts: int = 1) -> ScriptCall:
    """The ``evict`` call of a program of evict ops (``lua/evict.lua``): one, or the evicts by
    request key a refused evict by engine key became."""
    layout = program.layout
    return ScriptCall(
        "evict",
        (layout.meta, layout.pe, layout.sx),
        [*program.bucket_args(), *program.entry_args(), program.count, *program.ops],
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


def batch_programs(
    layout: Layout, plan: Sequence[IndexOp], budget: int | None = None
) -> list[Program]:
    """The programs of a checked batch, each within ``budget`` units (at least one program)."""
    programs = Programs(layout, budget)
    # consecutive evicts of one entries tuple and kind (an ingester's removal event shares one)
    # go in together
    run: list[int] = []
    run_entries: tuple[PodEntry, ...] = ()
    run_type = KeyType.ENGINE
    for op in plan:
        if isinstance(op, EvictOp):
            if run and (op.entries is not run_entries or op.key_type is not run_type):
                programs.evicts(run, run_type, run_entries)
                run = []
            run_entries, run_type = op.entries, op.key_type
            run.append(op.key)
            continue
        if run:
            programs.evicts(run, run_type, run_entries)
            run = []
        if isinstance(op, AddOp):
            ents = list(dict.fromkeys(op.entries))
            pieces = add_pieces(op.engine_keys, op.request_keys, ents, programs.budget)
            for (keys, pairs), parent in zip(pieces, piece_parents(pieces, op.parent), strict=True):
                programs.add(keys, pairs, ents, parent)
    if run:
        programs.evicts(run, run_type, run_entries)
    return programs.items


def op_apply_batch(
    state: CoreState, ops: Sequence[IndexOp], stream: str | None, watermark: Watermark | None
) -> Op[bool]:
    """``BatchIndex.apply_batch``: one ``apply_batch`` script call for the whole batch.

    A batch beyond one call's work budget goes in parts (``lua/apply_batch.lua``): each part is
    its own atomic call, and the watermark advances with the last one (a part the server
    refuses as over budget is split: :func:`op_parts`). A random token names this call, so a
    part sent again after its reply was lost is recognised by the server (reported as
    applied, never applied twice).
    """
    plan = check_batch(ops, stream, watermark)
    if not plan and stream is None:
        return True
    return (yield from _apply_alone(batch_programs(state.layout, plan), stream, watermark))


def op_apply_batches(state: CoreState, batches: Sequence[Batch]) -> Op[list[bool]]:
    """``MultiBatchIndex.apply_batches``: the batches in ``apply_batches`` script calls of as
    many whole batches as fit one call's work budget (``lua/apply_batches.lua``), each batch
    with its own fence and token.

    A batch too large for one call goes alone as :func:`op_apply_batch` does (in parts); so do
    the batches of a call the server refuses as over budget (it wrote nothing). Once a fenced
    batch of a stream is not applied, the stream's later batches are not sent (``False``).
    """
    checked = check_batches(batches)
    out = [False] * len(checked)
    stopped: set[str] = set()
    group = _BatchGroup(state.layout)
    for i, (plan, stream, watermark) in enumerate(checked):
        if stream is not None and stream in stopped:
            continue
        if not plan and stream is None:
            out[i] = True
            continue
        added = group.add(i, plan, stream, watermark)
        if added is _FULL:
            yield from group.send(out, stopped)
            group = _BatchGroup(state.layout)
            added = group.add(i, plan, stream, watermark)
        if added is _ALONE:
            # over a call's budget by itself: the group so far first, to keep the order
            yield from group.send(out, stopped)
            group = _BatchGroup(state.layout)
            out[i] = yield from _apply_alone(batch_programs(state.layout, plan), stream, watermark)
            if not out[i] and stream is not None:
                stopped.add(stream)
    yield from group.send(out, stopped)
    return out


def _apply_alone(
    programs: list[Program], stream: str | None, watermark: Watermark | None
) -> Op[bool]:
    """One batch's programs as the parts of one ``apply_batch`` (:func:`op_apply_batch`)."""
    fence = batch_fence(stream, watermark)
    token = secrets.token_hex(8)
    applied, _ = yield from op_parts(
        programs,
        lambda program, part, parts: batch_call(program, fence, token, part, parts),
        fenced=True,
    )
    return applied


_BATCH_HEAD = struct.Struct(">HB")
#: What :meth:`_BatchGroup.add` did with a batch: added it, found the group too full for it, or
#: found it over a call's budget by itself.
_ADDED = object()
_FULL = object()
_ALONE = object()
_U16 = struct.Struct(">H")


class _BatchGroup:
    """Whole batches gathered into one ``apply_batches`` call (``lua/apply_batches.lua``):
    the entries and streams they name, each listed once, and each batch's fence and ops."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.cost = 0
        self.entries: list[bytes] = []
        self._entry_index: dict[PodEntry, int] = {}
        self._order: list[PodEntry] = []
        self.streams: dict[str, int] = {}
        self.members: list[tuple[int, list[IndexOp], str | None, Watermark | None]] = []
        self.blob: list[bytes] = []
        # each batch's token: the call's random one and the batch's number in it (unique per
        # batch, and one random draw per call instead of per batch)
        self._token = secrets.token_hex(6)

    def _entry(self, entry: PodEntry) -> int:
        index = self._entry_index.get(entry)
        if index is None:
            self.entries.append(encode_entry(entry))
            self._order.append(entry)
            index = self._entry_index[entry] = len(self.entries)
        return index

    def add(
        self, index: int, plan: list[IndexOp], stream: str | None, watermark: Watermark | None
    ) -> object:
        """Add a batch (:data:`_ADDED`), unless it would take the call over its work budget:
        :data:`_FULL` (send the group, then add it to the next) or, for a batch over budget
        by itself, :data:`_ALONE` (it goes on its own, in parts)."""
        known = len(self.entries)
        blob, count, cost = blob_ops(plan, self._entry)
        if (self.members and self.cost + cost > CALL_BUDGET) or cost > CALL_BUDGET:
            for entry in self._order[known:]:
                del self._entry_index[entry]
            del self.entries[known:], self._order[known:]
            return _ALONE if cost > CALL_BUDGET else _FULL
        self.cost += cost
        self.members.append((index, plan, stream, watermark))
        if count > 0xFFFF:
            raise InvalidInputError(f"a batch of {count} ops is too many for one call")
        if stream is None or watermark is None:
            self.blob.append(_BATCH_HEAD.pack(0, 0))
        else:
            number = self.streams.setdefault(stream, len(self.streams) + 1)
            token = f"{self._token}{len(self.members):04x}"
            mark = f"{watermark.epoch}:{watermark.seq}:{token}".encode()
            self.blob += (_BATCH_HEAD.pack(number, len(mark)), mark)
        self.blob += (_U16.pack(count), blob)
        return _ADDED

    def call(self) -> ScriptCall:
        layout = self.layout
        return ScriptCall(
            "apply_batches",
            (layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.sx),
            [
                layout.gen,
                layout.rprefix,
                layout.eprefix,
                layout.bucket_bits,
                MAX_REQUEST_KEYS_PER_ENGINE_KEY,
                len(self.entries),
                *self.entries,
                len(self.streams),
                *(text_bytes(name) for name in self.streams),
                b"".join(self.blob),
            ],
        )

    def send(self, out: list[bool], stopped: set[str]) -> Op[None]:
        """Send the group (nothing when empty); record each batch's outcome in ``out``."""
        if not self.members:
            return
        try:
            replies = yield self.call()
        except CallBudgetError:
            # the ops reach too many fragmented runs together: each batch on its own (in
            # parts where needed); the refused call wrote nothing
            for index, plan, stream, watermark in self.members:
                if stream is not None and stream in stopped:
                    continue
                applied = yield from _apply_alone(
                    batch_programs(self.layout, plan), stream, watermark
                )
                out[index] = applied
                if not applied and stream is not None:
                    stopped.add(stream)
            return
        for (index, _, stream, _), reply in zip(self.members, replies, strict=True):
            out[index] = bool(int(reply))
            if not out[index] and stream is not None:
                stopped.add(stream)


def batch_fence(stream: str | None, watermark: Watermark | None) -> list[Arg]:
    """The stream, epoch and seq arguments of an ``apply_batch`` call (empty: unfenced)."""
    if stream is not None and watermark is not None:
        return [text_bytes(stream), str(watermark.epoch), str(watermark.seq)]
    return [b"", 0, 0]


def batch_call(
    program: Program, fence: Sequence[Arg], token: str, part: int = 1, parts: int = 1
) -> ScriptCall:
    """The ``apply_batch`` call of part ``part`` of ``parts`` (see ``lua/apply_batch.lua``)."""
    layout = program.layout
    return ScriptCall(
        "apply_batch",
        (layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.wp, layout.sx),
        [
            *program.bucket_args(),
            MAX_REQUEST_KEYS_PER_ENGINE_KEY,
            *fence,
            token,
            part,
            parts,
            *program.entry_args(),
            program.count,
            *program.ops,
        ],
    )


def op_block_key_scheme(
    state: CoreState, scheme: BlockKeyScheme, record: bool = False
) -> Op[BlockKeyScheme | None]:
    """Check ``scheme`` (the client's block key scheme) against the one the namespace records,
    and from now on at every load of the namespace; with ``record``, record it first when the
    namespace records none (the first writer's stays). The scheme recorded (None: none);
    :class:`~kvredis.errors.BlockKeySchemeError` when it is another."""
    if not isinstance(scheme, BlockKeyScheme):
        raise InvalidInputError(f"scheme must be a BlockKeyScheme, got {scheme!r}")
    state.scheme = scheme
    meta = state.layout.meta
    recorded = yield Command(("HGET", meta, "scheme"))
    if not recorded and record:
        yield namespace_call(state, API_VERSION, scheme.text)
        recorded = yield Command(("HGET", meta, "scheme"))
    return state.check_scheme(recorded)


def op_get_watermark(state: CoreState, stream: str) -> Op[Watermark | None]:
    """``BatchIndex.get_watermark``: one HGET."""
    name = check_stream(stream)
    reply = yield Command(("HGET", state.layout.wm, text_bytes(name)))
    if reply is None:
        return None
    try:
        return decode_watermark(bytes(reply))
    except NamespaceLayoutError as exc:
        raise NamespaceLayoutError(f"{exc} for stream {name!r}") from None


def decode_watermark(stored: bytes) -> Watermark:
    """A watermark as stored in ``<ns>:wm``: ``"epoch:seq"`` or ``"epoch:seq:token"``.

    The token names the call that applied it; raises :class:`NamespaceLayoutError` on
    anything else.
    """
    epoch, sep, rest = stored.partition(b":")
    seq = rest.split(b":", 1)[0]
    try:
        if not sep:
            raise ValueError("no separator")
        return Watermark(int(epoch), int(seq))
    except (ValueError, InvalidInputError) as exc:
        raise NamespaceLayoutError(f"malformed watermark {stored!r}") from exc


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
    mappings: bool = True,
    selection: EntrySelection | None = None,
) -> Op[int]:
    """``Index.clear`` on one namespace: :func:`op_clear_passes`, then :func:`op_reclaim` of the
    ids it retired; returns the (request key, entry) pairs removed."""
    removed, ids = yield from op_clear_passes(
        state, pod_identifier, progress, fields_per_call, mappings, selection
    )
    yield from op_reclaim(state, pod_identifier, ids)
    return removed


def op_clear_passes(
    state: CoreState,
    pod_identifier: str,
    progress: ClearProgress | None = None,
    fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL,
    mappings: bool = True,
    selection: EntrySelection | None = None,
) -> Op[tuple[int, bytes]]:
    """Remove every entry of the pod, page by page; returns the (request key, entry) pairs
    removed and the entry ids retired (for :func:`op_reclaim`, once nothing holds them).

    Four passes over the namespace with SCAN MATCH (never the whole keyspace): the runs
    (``clear_runs`` script: remove the pod's entry ids from their ranges, drop the refs of
    positions left empty, delete emptied runs), the request buckets (``clear`` script: remove the
    pod's entry ids from keys stored inline, delete emptied request keys), the expiring buckets
    (the same script: the pod's expiring entries and their deadlines), then the engine buckets
    (``clear_mappings`` script: drop mappings none of whose request keys holds an entry, live
    expiring entries included).
    ``progress(done, removed)`` is called after every page with the keys processed so far (all
    passes; SCAN may report a key twice) and the (request key, entry) pairs removed
    so far. First the pod's entry ids are retired (``retire`` script: adds racing the clear
    store the pod's entries under new ids, untouched by this clear; ids an interrupted clear
    left retired are taken up again). A pod the namespace never saw costs one call.
    ``mappings=False`` skips the engine bucket pass (the cluster index, whose mappings and
    request keys live in different shards, runs its own, and reclaims after it: a clear cut
    short before then leaves the ids retired, so running it again runs the mapping pass again).
    With ``selection`` (``clear_entries``) only the pod's entries it matches are removed: their
    ids are picked from the pod's definitions (current and retired ids, one HMGET) before the
    passes, and only those are retired (and reclaimed).
    """
    pod = check_pod_identifier(pod_identifier)
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
    layout = state.layout
    # The pod's ids are retired first (atomically): adds racing the clear intern the pod's
    # entries under new ids, which this clear neither removes nor reclaims.
    keys = (layout.meta, layout.pe, layout.pi, layout.pp, layout.pr)
    if selection is None:
        ids = yield ScriptCall("retire", keys, (layout.gen, text_bytes(pod)))
    else:
        current = yield Command(("HGET", layout.pp, text_bytes(pod)))
        retired = yield Command(("HGET", layout.pr, text_bytes(pod)))
        listed = bytes(current or b"") + bytes(retired or b"")
        chosen = (yield from _selected_ids(layout, listed, selection)) if listed else b""
        if not chosen:
            return 0, b""
        ids = yield ScriptCall("retire", keys, (layout.gen, text_bytes(pod), chosen))
    if not ids:
        return 0, b""
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
        layout.run_pattern(),
        fields_per_call,
        lambda keys: ScriptCall(
            "clear_runs",
            (layout.meta, *keys),
            (layout.gen, ids, layout.rprefix, layout.bucket_bits),
        ),
        on_request_page,
    )
    yield from _paged(
        layout.request_pattern(),
        fields_per_call,
        lambda keys: ScriptCall("clear", (layout.meta, *keys), (layout.gen, ids)),
        on_request_page,
    )
    yield from _paged(
        layout.expiring_pattern(),
        fields_per_call,
        lambda keys: ScriptCall("clear", (layout.meta, *keys), (layout.gen, ids, "s")),
        on_request_page,
    )
    if mappings:
        yield from _paged(
            layout.engine_pattern(),
            fields_per_call,
            lambda keys: ScriptCall(
                "clear_mappings",
                (layout.meta, layout.sx, *keys),
                (layout.gen, layout.rprefix, layout.bucket_bits),
            ),
            on_engine_page,
        )
    return removed, bytes(ids)


def op_reclaim(state: CoreState, pod_identifier: str, ids: bytes) -> Op[None]:
    """Delete the definitions of the pod's entry ids a clear retired, once no bucket, run or
    expiring bucket holds them (``reclaim`` script; ids are never reused)."""
    layout = state.layout
    pod = text_bytes(pod_identifier)
    for start in range(0, len(ids), RECLAIM_IDS_PER_CALL * ID_WIDTH):
        yield ScriptCall(
            "reclaim",
            (layout.meta, layout.pe, layout.pi, layout.pr),
            (layout.gen, pod, ids[start : start + RECLAIM_IDS_PER_CALL * ID_WIDTH]),
        )


def _selected_ids(layout: Layout, ids: bytes, selection: EntrySelection) -> Op[bytes]:
    """The ids of the id list ``ids`` whose definitions ``selection`` matches (an id without a
    definition is left out: no bucket can hold it for a lookup to return)."""
    listed = [ids[i : i + ID_WIDTH] for i in range(0, len(ids), ID_WIDTH)]
    defs = yield Command(("HMGET", layout.pi, *listed))
    return b"".join(
        entry_id
        for entry_id, enc in zip(listed, defs, strict=True)
        if enc and selection.matches(decode_entry(bytes(enc)))
    )


def _finish_drop(layout: Layout, tombstone: bytes, keys_per_call: int = 1000) -> Op[int]:
    """Delete the keys of a namespace whose meta record holds ``tombstone``, then the record.

    Only keys :meth:`Layout.owns` are deleted (never those of a namespace with a longer name),
    and only while the tombstone is in place (each page is a ``drop`` script call).
    """
    deleted = 0
    cursor: int | None = None
    while cursor != 0:
        scan = ("SCAN", cursor or 0, "MATCH", layout.namespace_pattern(), "COUNT", keys_per_call)
        cursor, found = _scan_reply((yield Command(scan)))
        page = [k for k in found if k != layout.meta and layout.owns(k)]
        if page:
            n = int((yield ScriptCall("drop", (layout.meta, *page), ("page", tombstone))))
            if n < 0:
                return deleted
            deleted += n
    deleted += int((yield ScriptCall("drop", (layout.meta,), ("end", tombstone))))
    return deleted


def op_drop_namespace(state: CoreState, keys_per_call: int = 1000) -> Op[int]:
    """Delete every key of the namespace; returns the number of keys deleted.

    First the meta record's generation becomes a tombstone (``lua/drop.lua``), atomically: from
    then on no client writes to the namespace (their calls fail the generation check), so the
    SCAN that follows deletes every key the namespace had and no writer can re-create an entry
    id whose definition is gone. The meta record goes last. Keys of other namespaces (also those
    whose names extend this one's) and foreign keys are never touched. A client that finds the
    tombstone (its dropper died, or is still at work) finishes the drop before it creates the
    next incarnation; clients of the dropped namespace start over with an empty one.
    """
    keys = Layout(state.namespace, state.bucket_bits, b"")
    tombstone = yield ScriptCall("drop", (keys.meta,), ("begin", secrets.token_hex(8)))
    return (yield from _finish_drop(keys, bytes(tombstone), keys_per_call))

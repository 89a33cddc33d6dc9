"""The sans-IO core of the Redis/Valkey index: key layout, encodings, script arguments, replies.

Nothing here touches a socket. Every index operation is a generator that yields requests
(:class:`~kvredis.scripts.ScriptCall`, :class:`Command` or :class:`Pipeline`), receives each
reply, and returns the operation's result; the sync and asyncio executors in
:mod:`kvredis.redis_index` only send what it yields. So the index logic exists once, for both,
and an executor with another transport (a cluster one: see the README, "Key layout") can drive
the same operations.

Key layout of a namespace ``<ns>`` (all keys start with ``<ns>:``)::

    <ns>:meta      HASH  layout, bucket_bits, gen (random token of this incarnation), next_id
    <ns>:pe        HASH  encoded entry -> 4-byte entry id
    <ns>:pi        HASH  4-byte entry id -> encoded entry
    <ns>:pp        HASH  pod id -> the pod's entry ids (4 bytes each)
    <ns>:wm        HASH  stream -> "epoch:seq" (apply_batch watermarks)
    <ns>:r:<bucket> HASH 8-byte request key -> entry ids (4 bytes each), oldest added first
    <ns>:e:<bucket> HASH 8-byte engine key -> request keys (8 bytes each), most recent last

``<bucket>`` is the bucket of the hash (:func:`bucket_of`: its low ``bits`` bits) as
``ceil(bits / 8)`` big-endian bytes. See ``lua/_kvblock.lua`` for the same definitions on the
server side.
"""

from __future__ import annotations

import logging
import secrets
import struct
import threading
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvredis.batch import AddOp, EvictOp, IndexOp, Watermark, check_batch, check_stream
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    check_add,
    check_entries,
    check_hash,
    check_hashes,
    check_key_type,
    check_pod_identifier,
    infer_mappings,
    pod_filter,
)
from kvredis.errors import (
    BackendError,
    EngineKeyNotFoundError,
    InvalidInputError,
    NamespaceLayoutError,
    StaleNamespaceError,
)
from kvredis.scoring import DEFAULT_MEDIUM_WEIGHTS, UNKNOWN_TIER_WEIGHT, LongestPrefixScorer
from kvredis.scripts import Arg, PipelineItem, ScriptCall
from kvredis.types import KeyType, PodEntry

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Layout version stored in ``<ns>:meta``; a client refuses a namespace of another version.
LAYOUT_VERSION = "kvredis-kvblock/1"
#: Bucket bits of a new namespace unless configured: 65,536 request buckets (and as many engine
#: buckets), which keeps buckets small (listpack-encoded) up to tens of millions of keys.
DEFAULT_BUCKET_BITS = 16
MIN_BUCKET_BITS = 1
MAX_BUCKET_BITS = 24
#: Fields the clear loop aims to examine per script call (sizes the SCAN pages).
DEFAULT_CLEAR_FIELDS_PER_CALL = 512

ID_WIDTH = 4
HASH_WIDTH = 8
_U32 = struct.Struct(">I")
_ENTRY_TAIL = struct.Struct(">BI")
_SPECULATIVE, _HAS_GROUP = 1, 2
_GLOB_SPECIAL = frozenset(b"*?[]\\")


# -- encodings ---------------------------------------------------------------------------------


def text_bytes(text: str) -> bytes:
    """The UTF-8 bytes of any ``str`` (lone surrogates kept, so every str round-trips)."""
    return text.encode("utf-8", "surrogatepass")


def bytes_text(data: bytes) -> str:
    """Inverse of :func:`text_bytes`."""
    return data.decode("utf-8", "surrogatepass")


def hash_field(value: int) -> bytes:
    """The 8-byte big-endian form of a 64-bit hash (field names in the bucket hashes)."""
    return value.to_bytes(HASH_WIDTH, "big")


def bucket_of(value: int, bits: int) -> int:
    """The bucket of a 64-bit hash: its low ``bits`` bits.

    Uniform for the hashes engines and kvredis produce, and still spread for small sequential
    numbers. The bucket key name carries it as ``ceil(bits / 8)`` big-endian bytes, which the
    Lua scripts cut from the 8-byte hash without arithmetic.
    """
    return value & ((1 << bits) - 1)


def pack_hashes(values: Sequence[int], what: str = "block hash") -> tuple[list[int], bytes]:
    """Validate 64-bit hashes and pack them as one blob of 8-byte big-endian values.

    Returns the hashes as a list of ints and the blob. Fast for plain ``int`` inputs; anything
    else goes through :func:`kvredis.index.check_hashes` (same errors as every backend).
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        keys = check_hashes(values, what)
    elif all(type(v) is int for v in values):
        keys = values if isinstance(values, list) else list(values)
    else:
        keys = check_hashes(values, what)
    try:
        return keys, struct.pack(f">{len(keys)}Q", *keys)
    except struct.error:
        check_hashes(keys, what)
        raise


def encode_entry(entry: PodEntry) -> bytes:
    """Unambiguous binary encoding of all five fields of a pod entry.

    ``u32 len | pod id | u32 len | tier | u8 flags (1 speculative, 2 has_group) | u32 group``,
    integers big-endian, strings UTF-8.
    """
    pod = text_bytes(entry.pod_identifier)
    tier = text_bytes(entry.device_tier)
    flags = (_SPECULATIVE if entry.speculative else 0) | (_HAS_GROUP if entry.has_group else 0)
    return b"".join(
        (
            _U32.pack(len(pod)),
            pod,
            _U32.pack(len(tier)),
            tier,
            _ENTRY_TAIL.pack(flags, entry.group_idx),
        )
    )


def decode_entry(data: bytes) -> PodEntry:
    """Inverse of :func:`encode_entry`; a malformed encoding raises NamespaceLayoutError."""
    try:
        (n,) = _U32.unpack_from(data, 0)
        pod = data[4 : 4 + n]
        (m,) = _U32.unpack_from(data, 4 + n)
        tier = data[8 + n : 8 + n + m]
        flags, group = _ENTRY_TAIL.unpack_from(data, 8 + n + m)
        if len(data) != 8 + n + m + _ENTRY_TAIL.size or len(pod) != n or len(tier) != m:
            raise ValueError("length mismatch")
        return PodEntry(
            bytes_text(pod),
            bytes_text(tier),
            bool(flags & _SPECULATIVE),
            bool(flags & _HAS_GROUP),
            group,
        )
    except (struct.error, ValueError) as exc:
        raise NamespaceLayoutError(f"malformed pod entry encoding {data!r}: {exc}") from exc


def escape_glob(data: bytes) -> bytes:
    """``data`` with the glob characters of SCAN MATCH escaped (``* ? [ ] \\``)."""
    return bytes(b for c in data for b in ((92, c) if c in _GLOB_SPECIAL else (c,)))


# -- layout ------------------------------------------------------------------------------------


class Layout:
    """Key names of one incarnation of a namespace (fixed bucket bits and generation)."""

    __slots__ = (
        "bucket_bits",
        "eprefix",
        "gen",
        "mask",
        "meta",
        "namespace",
        "pe",
        "pi",
        "pp",
        "rprefix",
        "suffix_bytes",
        "wm",
    )

    def __init__(self, namespace: str, bucket_bits: int, gen: bytes) -> None:
        self.namespace = namespace
        self.bucket_bits = bucket_bits
        self.gen = gen
        self.mask = (1 << bucket_bits) - 1
        self.suffix_bytes = (bucket_bits + 7) // 8
        ns = text_bytes(namespace)
        self.meta = meta_key(namespace)
        self.pe = ns + b":pe"
        self.pi = ns + b":pi"
        self.pp = ns + b":pp"
        self.wm = ns + b":wm"
        self.rprefix = ns + b":r:"
        self.eprefix = ns + b":e:"

    def request_bucket(self, value: int) -> bytes:
        """The request bucket key holding request key ``value``."""
        return self.rprefix + (value & self.mask).to_bytes(self.suffix_bytes, "big")

    def engine_bucket(self, value: int) -> bytes:
        """The engine bucket key holding engine key ``value``."""
        return self.eprefix + (value & self.mask).to_bytes(self.suffix_bytes, "big")

    def request_pattern(self) -> bytes:
        """SCAN MATCH pattern of the request buckets (and nothing else)."""
        return escape_glob(self.rprefix) + b"?" * self.suffix_bytes

    def engine_pattern(self) -> bytes:
        """SCAN MATCH pattern of the engine buckets (and nothing else)."""
        return escape_glob(self.eprefix) + b"?" * self.suffix_bytes

    def namespace_pattern(self) -> bytes:
        """SCAN MATCH pattern of every key of the namespace."""
        return escape_glob(text_bytes(self.namespace) + b":") + b"*"


def meta_key(namespace: str) -> bytes:
    """The key of a namespace's meta record."""
    return text_bytes(namespace) + b":meta"


def check_namespace(namespace: object) -> str:
    """Validate a namespace name: a non-empty str that cannot nest inside another namespace.

    Bucket keys are ``<ns>:r:<bucket>`` and ``<ns>:e:<bucket>``, so a namespace containing
    ``:r:`` or ``:e:``, or ending in ``:r`` or ``:e``, would share key names with a shorter one;
    such names are refused. Any other text (including ``:``) is fine.
    """
    if not isinstance(namespace, str) or not namespace:
        raise InvalidInputError(f"namespace must be a non-empty str, got {namespace!r}")
    if any(part in namespace for part in (":r:", ":e:")) or namespace.endswith((":r", ":e")):
        raise InvalidInputError(
            f"namespace {namespace!r} may not contain ':r:' or ':e:' or end in ':r' or ':e' "
            "(its keys would collide with those of a shorter namespace)"
        )
    return namespace


def check_bucket_bits(bits: object) -> int:
    """Validate a bucket bit count."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise InvalidInputError(f"bucket bits must be an int, got {bits!r}")
    if not MIN_BUCKET_BITS <= bits <= MAX_BUCKET_BITS:
        raise InvalidInputError(
            f"bucket bits must be in [{MIN_BUCKET_BITS}, {MAX_BUCKET_BITS}], got {bits}"
        )
    return bits


# -- client-side entry dictionary --------------------------------------------------------------


class EntryCache:
    """Thread-safe id -> PodEntry dictionary of one client, filled from lookup replies.

    Entry ids are allocated in increasing order and never reused within a namespace generation,
    so cached definitions stay valid as long as the generation (a new generation gets a new
    cache).
    ``floor`` is the highest id up to which every definition is known; lookups send it, and the
    server returns the definitions of the next ids (a bounded number per call) and of any hit id
    above them, so a client soon knows the whole dictionary and replies carry no definitions.
    """

    _MAX_LISTS = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._defs: dict[bytes, PodEntry] = {}
        self._lists: dict[bytes, tuple[PodEntry, ...]] = {}
        self.floor = 0

    def learn(self, flat: Sequence[bytes], floor: int) -> None:
        """Record definitions given as a flat ``id, encoded entry, ...`` sequence.

        ``floor`` is the id up to which the server has now sent every definition that exists.
        """
        decoded = {}
        for i in range(0, len(flat), 2):
            decoded[bytes(flat[i])] = decode_entry(bytes(flat[i + 1]))
        with self._lock:
            self._defs.update(decoded)
            self.floor = max(self.floor, floor)

    def entries(self, ids: bytes) -> list[PodEntry]:
        """The entries of an id list (raises StaleNamespaceError on an unknown id)."""
        known = self._lists.get(ids)
        if known is None:
            defs = self._defs
            try:
                known = tuple(defs[ids[i : i + ID_WIDTH]] for i in range(0, len(ids), ID_WIDTH))
            except KeyError:
                raise StaleNamespaceError("entry id unknown to this client") from None
            with self._lock:
                if len(self._lists) >= self._MAX_LISTS:
                    self._lists = {}
                self._lists[ids] = known
        return list(known)


# -- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """A plain Redis command, as its arguments."""

    args: tuple[Arg, ...]


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Several requests sent in one round trip (no MULTI); the reply is the list of replies."""

    items: tuple[PipelineItem, ...]


Request = ScriptCall | Command | Pipeline
#: An index operation: yields requests, receives their replies, returns the result.
Op = Generator[Request, Any, T]


class CoreState:
    """What one client knows about its namespace: the current layout and its entry cache.

    Both are replaced together when the namespace generation changes; an operation takes one
    :meth:`snapshot` and uses that pair to the end, so a reply is always decoded with the
    dictionary of the generation it was produced under.
    """

    def __init__(self, namespace: str, bucket_bits: int = DEFAULT_BUCKET_BITS) -> None:
        self.namespace = check_namespace(namespace)
        self.bucket_bits = check_bucket_bits(bucket_bits)
        self._current: tuple[Layout, EntryCache] | None = None
        self._lock = threading.Lock()

    def snapshot(self) -> tuple[Layout, EntryCache]:
        """The loaded layout and the entry cache of its generation."""
        current = self._current
        if current is None:
            raise BackendError("namespace not loaded yet")
        return current

    @property
    def layout(self) -> Layout:
        """The loaded layout (after :func:`op_load_namespace`)."""
        return self.snapshot()[0]

    @property
    def cache(self) -> EntryCache:
        """The entry cache of the loaded generation."""
        return self.snapshot()[1]

    @property
    def loaded(self) -> bool:
        """Whether a layout was loaded."""
        return self._current is not None

    def adopt(self, reply: Sequence[Any]) -> Layout:
        """Take over the namespace record returned by the ``namespace`` script."""
        if not isinstance(reply, (list, tuple)) or len(reply) != 3 or not all(reply):
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} has an incomplete meta record {reply!r}; "
                "delete its keys or use another namespace"
            )
        version, bits_raw, gen = (bytes(v) for v in reply)
        if version.decode("utf-8", "replace") != LAYOUT_VERSION:
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} holds layout {version!r}, this client writes "
                f"{LAYOUT_VERSION!r}; use another namespace"
            )
        try:
            bits = check_bucket_bits(int(bits_raw))
        except (ValueError, InvalidInputError) as exc:
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} has invalid bucket bits {bits_raw!r}"
            ) from exc
        if bits != self.bucket_bits:
            logger.info(
                "namespace %r was created with %d bucket bits; using them (configured %d)",
                self.namespace,
                bits,
                self.bucket_bits,
            )
        with self._lock:
            current = self._current
            if current is None or current[0].gen != gen or current[0].bucket_bits != bits:
                current = self._current = (Layout(self.namespace, bits, gen), EntryCache())
            return current[0]


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
    state: CoreState, request_keys: Sequence[int], pod_identifier_set: Collection[str] | None
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


def score_weights(medium_weights: Mapping[str, float] | None) -> Mapping[str, float]:
    """Validated tier weights (``None`` gives the scorer's defaults)."""
    if medium_weights is None:
        return DEFAULT_MEDIUM_WEIGHTS
    return LongestPrefixScorer(medium_weights).medium_weights


def op_score(
    state: CoreState,
    request_keys: Sequence[int],
    medium_weights: Mapping[str, float] | None,
    pod_identifier_set: Collection[str] | None,
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

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
    ) -> None:
        pairs = infer_mappings(engine_keys, request_keys) if engine_keys else []
        ents = list(dict.fromkeys(entries))
        self.ops += ("A", len(ents), *(self.entry(e) for e in ents))
        self.ops.append(struct.pack(f">{len(request_keys)}Q", *request_keys))
        self.ops.append(struct.pack(f">{2 * len(pairs)}Q", *(k for pair in pairs for k in pair)))
        self.count += 1

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        ents = list(dict.fromkeys(entries))
        tag = "R" if key_type is KeyType.REQUEST else "E"
        self.ops += (tag, hash_field(key), len(ents), *(self.entry(e) for e in ents))
        self.count += 1

    def common_args(self) -> list[Arg]:
        layout = self.layout
        return [
            layout.gen,
            layout.rprefix,
            layout.eprefix,
            layout.bucket_bits,
            MAX_REQUEST_KEYS_PER_ENGINE_KEY,
        ]

    def entry_args(self) -> list[Arg]:
        return [len(self.entries), *self.entries]


def op_add(
    state: CoreState,
    engine_keys: Sequence[int] | None,
    request_keys: Sequence[int],
    entries: Sequence[PodEntry],
) -> Op[None]:
    """``Index.add``: one ``add`` script call."""
    eng, req, ents = check_add(engine_keys, request_keys, entries)
    layout = state.layout
    program = _Program(layout)
    program.add(eng, req, ents)
    yield ScriptCall(
        "add",
        (layout.meta, layout.pe, layout.pi, layout.pp),
        [*program.common_args(), *program.entry_args(), *program.ops],
    )


def op_evict(
    state: CoreState, key: int, key_type: KeyType, entries: Sequence[PodEntry]
) -> Op[None]:
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
        [*program.common_args(), *program.entry_args(), *program.ops],
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
        [*program.common_args(), *fence, *program.entry_args(), program.count, *program.ops],
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


#: ``progress(done, removed)`` of :func:`op_clear`.
ClearProgress = Callable[[int, int], None]


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
            replies = yield Pipeline((call(page), scan(cursor).args))
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

"""KV-cache events as vLLM and SGLang publish them: wire decoding (and encoding) into typed values.

(TensorRT-LLM's JSON events decode into the same values in :mod:`kvredis.ingest.trtllm`.)

An engine publishes one msgpack *batch* per scheduler step, a positional array (vLLM's
``EventBatch`` omits a nil rank, SGLang always sends three elements)::

    [ts: float, events: array, data_parallel_rank: int | nil]      (the third element is optional)

or, as some vLLM versions declare it, a map with the same field names (``{"ts": ..., "events":
[...], "data_parallel_rank": ...}``; SGLang's name ``attn_dp_rank`` is accepted too).

Each event is either a map with the tag under ``"type"`` (vLLM 0.24 and later, every SGLang) or a
positional array whose first element is the tag (vLLM 0.23 and earlier)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?,
     lora_name?, extra_keys?, group_idx?, kv_cache_spec_kind?, kv_cache_spec_sliding_window?,
     locality?, ownership?]
    ["BlockRemoved", block_hashes, medium?, group_idx?, locality?, ownership?]
    ["AllBlocksCleared"]

Map events may omit keys equal to their default and may carry keys this module does not know
(``session_id``, ``lookahead_token_ids``, ...): they are ignored, as are extra trailing array
fields. SGLang's ``BlockStored`` map also carries ``cache_salt`` (vLLM reports its salt inside
``extra_keys``). Block hashes arrive as unsigned 64-bit ints, as signed 64-bit ints (SGLang; read
as their two's complement) or as raw bytes (the last 8 bytes, big-endian, shorter ones
left-padded with zeros); :func:`wire_hash` normalizes all three.

SGLang with EAGLE speculative decoding publishes *bigram* pages: ``token_ids`` holds one
``[token, next_token]`` pair per position (``block_size`` counts pairs). The page caches the KV of
the first elements; the second ones only repeat the next position's token (the last one is the
token after the page, which EAGLE's draft model needed). A bigram page decodes to its first
elements, so it hashes exactly like the same page published as plain tokens; pairs that do not
chain (``pair[i][1] != pair[i + 1][0]``) are rejected.

:func:`decode_batch` never raises on bad input. Every event is decoded on its own: a malformed one
becomes a :class:`Rejection` with a :class:`RejectReason` and the well-formed events of the same
batch are still returned. Only a payload that is not a batch at all is rejected as a whole.

Which engine published a batch shows in telltale fields (:attr:`DecodedBatch.engine`): SGLang's
``cache_salt``/``metadata`` fields, ``attn_dp_rank``, its ``CPU_PINNED``/``DISK``/``EXTERNAL``
mediums and signed (negative) hashes; vLLM's ``extra_keys``, ``group_idx``, ``event_version``,
``locality``/``ownership`` fields, ``data_parallel_rank`` and its ``CPU``/``STORAGE`` mediums.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from kvredis.errors import InvalidInputError
from kvredis.fastinit import slot_init
from kvredis.features import (
    CacheSaltKey,
    LoRAKey,
    MultiModalKey,
    PromptEmbedsKey,
    TypedExtraKey,
    UnplacedExtraKeyError,
    split_extra_keys,
)
from kvredis.tiers import DEFAULT_TIERS

__all__ = [
    "EVENT_VERSION",
    "MAX_PAYLOAD_BYTES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Engine",
    "Event",
    "RejectReason",
    "Rejection",
    "WireError",
    "decode_batch",
    "decode_batch_object",
    "encode_batch",
    "event_to_wire",
    "parse_topic",
    "wire_hash",
]

MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
"""Payloads larger than this are rejected unread (a batch of a scheduler step is far smaller)."""

EVENT_VERSION = 1
"""The newest vLLM ``event_version`` this module decodes (typed extra keys)."""

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_I64_LIMIT = 1 << 63
_U32 = 1 << 32
_GROUP_LIMIT = 1 << 31
_INT_TYPE = {int}


class Engine(enum.Enum):
    """The engine a stream's events come from: what a prefix-cache reset drops depends on it, and
    how its cache evicts decides how the ingester maps pages finer than index blocks
    (:func:`kvredis.ingest.chains.page_mapping`)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    """TensorRT-LLM (``trtllm-serve``'s ``/kv_cache_events``, :mod:`kvredis.ingest.trtllm`)."""


class RejectReason(enum.Enum):
    """Why a payload, an event or a message was not applied. The value is the counter name."""

    MALFORMED_PAYLOAD = "malformed_payload"
    """Not a msgpack object (truncated, trailing bytes, nesting too deep, bad extension)."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    BAD_BATCH = "bad_batch"
    """The payload is msgpack but not ``[ts, events, dp_rank?]`` with an events array."""
    BAD_TIMESTAMP = "bad_timestamp"
    """The batch ``ts`` is not a number (the events still apply)."""
    BAD_DP_RANK = "bad_dp_rank"
    """The batch ``data_parallel_rank`` is not an int or nil (the events still apply)."""
    BAD_EVENT = "bad_event"
    """An event is neither a map nor a non-empty array."""
    MISSING_TAG = "missing_tag"
    UNKNOWN_TAG = "unknown_tag"
    MISSING_FIELD = "missing_field"
    BAD_FIELD_TYPE = "bad_field_type"
    BAD_FIELD_VALUE = "bad_field_value"
    """Right type, impossible value (negative block size, group index out of range, bad UTF-8)."""
    BAD_HASH = "bad_hash"
    """A block hash that is not an int or non-empty bytes."""
    HASH_OUT_OF_RANGE = "hash_out_of_range"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    BAD_EXTRA_KEYS = "bad_extra_keys"
    UNPLACED_EXTRA_KEY = "unplaced_extra_key"
    """An extra key kvredis cannot place in the block keys (vLLM's ``legacy`` or an unknown typed
    key, a LoRA or salt out of place, an SGLang metadata key other than ``cache_salt``, a
    TensorRT-LLM ``token_extra_id`` or LoRA id): the event is refused, never hashed without it."""
    BAD_MESSAGE = "bad_message"
    """A transport message without the ``[topic, seq, payload]`` frames or with a bad seq frame."""
    SEQ_OUT_OF_RANGE = "seq_out_of_range"
    NO_POD = "no_pod"
    """Neither the endpoint configuration nor the topic names the pod."""
    NO_MODEL = "no_model"
    """A BlockStored event needs a model name for hashing and none is known."""
    HASHING_FAILED = "hashing_failed"
    """The token processor refused the event's tokens, model or features."""


@slot_init
@dataclass(frozen=True, slots=True)
class Rejection:
    """One rejected payload, event or message: the reason, a short detail, the event position."""

    reason: RejectReason
    detail: str
    position: int | None = None

    def __post_init__(self) -> None:
        if not self.detail.strip():  # a log line must say why, even for a silent exception
            object.__setattr__(self, "detail", f"{self.reason.value} (no further detail)")


@slot_init
@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine cached full blocks (or, without tokens, moved known blocks to another tier)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """Per-engine-block extra keys: raw items, or the typed keys of :mod:`kvredis.features`
    (see :func:`kvredis.features.split_extra_keys`)."""
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    """vLLM: ``"LOCAL"`` or ``"REMOTE"`` relative to the publishing pod; ``None``: unspecified."""
    ownership: str | None = None
    """vLLM: the secondary offloading tier that reported the block, if any."""
    cache_salt: str | None = None
    """SGLang: the salt of the request that stored the blocks (vLLM: in ``extra_keys``)."""
    moved_from: str | None = None
    """A tier move (no tokens): the medium the blocks left (TensorRT-LLM's ``updated`` cache
    level); their entries of that medium go from the keys the new medium's entries go to.
    Never on the wire of vLLM or SGLang."""

    @property
    def tier(self) -> str:
        """The device tier under :data:`kvredis.tiers.DEFAULT_TIERS`."""
        return DEFAULT_TIERS.tier(self.medium, self.locality, self.ownership)


@slot_init
@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine dropped these blocks from one tier (and group)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    @property
    def tier(self) -> str:
        """The device tier under :data:`kvredis.tiers.DEFAULT_TIERS`."""
        return DEFAULT_TIERS.tier(self.medium, self.locality, self.ownership)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped every cached block."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@slot_init
@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """A decoded engine batch: its well-formed events in order, and what was rejected."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    rejects: tuple[Rejection, ...] = ()
    total_events: int = 0
    """Number of events the payload carried, well-formed or not."""
    engine: Engine | None = None
    """The engine that published the batch: what its shape shows (see the module docstring),
    or, once the batch is handed to the sequencer, its stream's configured or learned engine
    (``None``: not known)."""


class WireError(InvalidInputError):
    """A wire value that cannot be decoded; ``reason`` says which :class:`RejectReason`."""

    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def wire_hash(value: object, what: str = "block hash") -> int:
    """Normalize a wire block hash (uint64, int64 or bytes) to an unsigned 64-bit int.

    Raises :class:`WireError` (an ``InvalidInputError``) for other types, empty bytes and ints
    outside ``[-2**63, 2**64)``.
    """
    if type(value) is int:
        if 0 <= value < _U64:
            return value
        if _I64_MIN <= value < 0:
            return value + _U64
        raise WireError(RejectReason.HASH_OUT_OF_RANGE, f"{what} {value} is outside 64 bits")
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise WireError(RejectReason.BAD_HASH, f"{what} is empty bytes")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise WireError(RejectReason.BAD_HASH, f"{what} must be an int or bytes, got {_tname(value)}")


def _tname(value: object) -> str:
    return type(value).__name__


def _hashes(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"{what} must be an array, got {_tname(value)}"
        )
    if not value:
        return ()
    if _only_ints(value):
        hashes = _int_hashes(value)
        if hashes is not None:
            return hashes
    return tuple(wire_hash(v, "block hash") for v in value)


def _int_hashes(values: list[int] | tuple[int, ...]) -> tuple[int, ...] | None:
    """Non-empty ``values``, all exactly ``int``, as unsigned hashes when all of them are uint64
    or all are int64, at C speed; ``None`` otherwise (mixed or out of range: hash by hash)."""
    if min(values) >= 0 and max(values) < _U64:
        return tuple(values)
    try:  # SGLang's signed hashes: their two's complement, read back as unsigned, in C
        signed = array("q", values)
    except OverflowError:  # (array checks that every one is within int64)
        return None
    return tuple(array("Q", signed.tobytes()).tolist())


def _only_ints(values: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every element is exactly an ``int`` (``bool`` excluded), at C speed."""
    return set(map(type, values)) == _INT_TYPE


def _opt_hash(value: object, what: str) -> int | None:
    return None if value is None else wire_hash(value, what)


def _tokens(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"token_ids must be an array, got {_tname(value)}"
        )
    if not value:
        return ()
    if not _only_ints(value) and isinstance(value[0], (list, tuple)):
        return _bigram_tokens(value)
    _check_token_ids(value)
    return tuple(value)


def _check_token_ids(value: list[Any] | tuple[Any, ...]) -> None:
    """Raise unless ``value`` (non-empty) holds only uint32 ints."""
    if not _only_ints(value):
        bad_item = next(t for t in value if type(t) is not int)
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"token ids must be ints, got {_tname(bad_item)}"
        )
    if min(value) < 0 or max(value) >= _U32:
        bad = next(t for t in value if not 0 <= t < _U32)
        raise WireError(RejectReason.TOKEN_OUT_OF_RANGE, f"token id {bad} is outside uint32")


def _bigram_tokens(pairs: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
    """An EAGLE bigram page ``[[t0, t1], [t1, t2], ...]`` as its first elements ``(t0, ...)``."""
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise WireError(
                RejectReason.BAD_FIELD_TYPE,
                f"bigram token_ids must hold [token, next] pairs, got {_tname(pair)}",
            )
    firsts = [pair[0] for pair in pairs]
    seconds = [pair[1] for pair in pairs]
    _check_token_ids(firsts + seconds)
    if firsts[1:] != seconds[:-1]:
        raise WireError(
            RejectReason.BAD_FIELD_VALUE,
            "bigram token pairs do not chain (pair[i][1] != pair[i+1][0])",
        )
    return tuple(firsts)


def _opt_int(
    value: object, what: str, low: int | None = None, high: int | None = None
) -> int | None:
    if value is None:
        return None
    if type(value) is not int:
        raise WireError(RejectReason.BAD_FIELD_TYPE, f"{what} must be an int, got {_tname(value)}")
    if (low is not None and value < low) or (high is not None and value >= high):
        raise WireError(RejectReason.BAD_FIELD_VALUE, f"{what} {value} is out of range")
    return value


def _opt_str(value: object, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"{what} must be a string, got {_tname(value)}"
        )
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise WireError(RejectReason.BAD_FIELD_VALUE, f"{what} is not valid UTF-8") from None
    return value


def _extra_keys(value: object, lora_name: str | None, chain_start: bool) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise WireError(
            RejectReason.BAD_EXTRA_KEYS, f"extra_keys must be an array, got {_tname(value)}"
        )
    typed = False
    for block in value:
        if block is None:
            continue
        if not isinstance(block, (list, tuple)):
            raise WireError(
                RejectReason.BAD_EXTRA_KEYS,
                f"extra_keys entries must be arrays or nil, got {_tname(block)}",
            )
        if not typed:
            typed = any(isinstance(item, Mapping) for item in block)
    if not typed:
        return tuple(value)
    blocks = tuple(
        None if block is None else tuple(_typed_key(item) for item in block) for block in value
    )
    try:  # placed now, so that a key out of place refuses the event here, with its reason
        split_extra_keys(blocks, lora_name=lora_name, chain_start=chain_start)
    except UnplacedExtraKeyError as exc:
        raise WireError(RejectReason.UNPLACED_EXTRA_KEY, str(exc)) from None
    return blocks


def _typed_key(item: object) -> TypedExtraKey | object:
    """A typed extra key map (vLLM ``event_version`` 1) as its :mod:`kvredis.features` type;
    other items are left as they are (mixed with typed ones, they refuse the event)."""
    if not isinstance(item, Mapping):
        return item
    tag = item.get("type")
    if not isinstance(tag, str):
        raise WireError(RejectReason.BAD_EXTRA_KEYS, "typed extra key without a 'type' tag")
    if tag == "mm":
        modality, digest, offset = item.get("modality"), item.get("hash"), item.get("block_offset")
        if not isinstance(modality, str) or not isinstance(digest, str) or type(offset) is not int:
            raise WireError(
                RejectReason.BAD_EXTRA_KEYS,
                "an 'mm' extra key needs modality (string), hash (string), block_offset (int)",
            )
        return MultiModalKey(modality, _utf8(digest, "mm hash"), offset)
    if tag == "lora":
        name = item.get("name")
        if not isinstance(name, str):
            raise WireError(RejectReason.BAD_EXTRA_KEYS, "a 'lora' extra key needs a name string")
        return LoRAKey(name)
    if tag == "cache_salt":
        salt = item.get("salt")
        if not isinstance(salt, str):
            raise WireError(
                RejectReason.BAD_EXTRA_KEYS, "a 'cache_salt' extra key needs a salt string"
            )
        return CacheSaltKey(_utf8(salt, "cache salt"))
    if tag == "prompt_embeds":
        digest = item.get("hash")
        if not isinstance(digest, (bytes, bytearray)) or not digest:
            raise WireError(
                RejectReason.BAD_EXTRA_KEYS, "a 'prompt_embeds' extra key needs a hash (bytes)"
            )
        return PromptEmbedsKey(bytes(digest))
    if tag == "legacy":
        raise WireError(
            RejectReason.UNPLACED_EXTRA_KEY,
            f"a 'legacy' extra key ({item.get('value')!r:.60}): the engine could not classify "
            "it, and kvredis does not guess where it goes in the block keys",
        )
    raise WireError(
        RejectReason.UNPLACED_EXTRA_KEY,
        f"unknown extra key type {tag[:40]!r}: kvredis cannot place it in the block keys",
    )


def _utf8(value: str, what: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise WireError(RejectReason.BAD_EXTRA_KEYS, f"{what} is not valid UTF-8") from None
    return value


def _event_version(value: object) -> None:
    if value is None:
        return
    if type(value) is not int:
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"event_version must be an int, got {_tname(value)}"
        )
    if value > EVENT_VERSION:
        raise WireError(
            RejectReason.BAD_FIELD_VALUE,
            f"event_version {value} is newer than this kvredis decodes ({EVENT_VERSION}); "
            "upgrade kvredis",
        )


def _metadata_salt(meta: object) -> str | None:
    """The ``cache_salt`` of SGLang's ``BlockStoredWithMetadata`` metadata map."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise WireError(RejectReason.BAD_FIELD_TYPE, f"metadata must be a map, got {_tname(meta)}")
    for key in meta:
        if key != "cache_salt":
            raise WireError(
                RejectReason.UNPLACED_EXTRA_KEY,
                f"BlockStored metadata key {str(key)[:40]!r} is not one kvredis can place in "
                "the block keys (only cache_salt)",
            )
    return _opt_str(meta.get("cache_salt"), "metadata.cache_salt")


def _block_stored(f: Mapping[str, Any]) -> BlockStored:
    if "block_hashes" not in f:
        raise WireError(RejectReason.MISSING_FIELD, "BlockStored without block_hashes")
    _event_version(f.get("event_version"))
    block_size = _opt_int(f.get("block_size"), "block_size", 0, _U32)
    parent = _opt_hash(f.get("parent_block_hash"), "parent_block_hash")
    lora_name = _opt_str(f.get("lora_name"), "lora_name")
    salt = _opt_str(f.get("cache_salt"), "cache_salt")
    meta_salt = _metadata_salt(f.get("metadata"))
    if meta_salt is not None:
        if salt is not None and salt != meta_salt:
            raise WireError(
                RejectReason.BAD_FIELD_VALUE, "cache_salt and metadata.cache_salt disagree"
            )
        salt = meta_salt
    return BlockStored(
        block_hashes=_hashes(f["block_hashes"], "block_hashes"),
        parent_block_hash=parent,
        token_ids=_tokens(f.get("token_ids")),
        block_size=block_size or 0,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=lora_name,
        extra_keys=_extra_keys(f.get("extra_keys"), lora_name, not parent),
        group_idx=_opt_int(f.get("group_idx"), "group_idx", 0, _GROUP_LIMIT),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(
            f.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window", 0
        ),
        locality=_opt_str(f.get("locality"), "locality"),
        ownership=_opt_str(f.get("ownership"), "ownership"),
        cache_salt=salt,
    )


def _block_removed(f: Mapping[str, Any]) -> BlockRemoved:
    if "block_hashes" not in f:
        raise WireError(RejectReason.MISSING_FIELD, "BlockRemoved without block_hashes")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], "block_hashes"),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx", 0, _GROUP_LIMIT),
        locality=_opt_str(f.get("locality"), "locality"),
        ownership=_opt_str(f.get("ownership"), "ownership"),
    )


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
)
"""BlockStored fields in vLLM's declaration order (the positional order of array events)."""
_STORED_FIELDS_V1 = (*_STORED_FIELDS[:7], "event_version", *_STORED_FIELDS[7:])
"""The same in vLLM's ``event_version`` 1 order: ``event_version`` comes before ``extra_keys``."""
_SGLANG_STORED_FIELDS = _STORED_FIELDS[:6]
"""SGLang's array ``BlockStored`` (``metadata`` follows them in ``BlockStoredWithMetadata``)."""
_STORED_REQUIRED = 7
"""vLLM's BlockStored fields without a default: always encoded, even as nil."""
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_REMOVED_REQUIRED = 2
_ARRAY_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1}
"""Leading fields an array event always carries (the fields of vLLM 0.23's first version)."""
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": _STORED_FIELDS,
    "BlockRemoved": _REMOVED_FIELDS,
    "AllBlocksCleared": (),
}


_PLAIN_STORED_KEYS = frozenset(("type", *_STORED_FIELDS[:_STORED_REQUIRED]))
"""The keys of the usual ``BlockStored`` map of vLLM and SGLang (the others at their defaults)."""
_PLAIN_REMOVED_KEYS = frozenset(("type", *_REMOVED_FIELDS[:_REMOVED_REQUIRED]))


def _plain_event(raw: dict[Any, Any]) -> Event | None:
    """The fast path of :func:`_event`, for the map events engines send all the time.

    A ``BlockStored`` or ``BlockRemoved`` map with no keys but those of
    :data:`_PLAIN_STORED_KEYS` / :data:`_PLAIN_REMOVED_KEYS` and only plain values decodes here,
    its checks inlined. Plain: the arrays are exact lists of exact ints in range (no bools, no
    bytes hashes, no bigram pairs), the scalars exact ints in range, ASCII strs or nil. Anything
    else returns ``None`` and the general code decodes it: this never raises, so every rejection
    (reason, detail) comes from the general code. What this decodes, the general code decodes to
    the same event (``tests/ingest/test_events.py`` checks the two paths against each other).
    """
    tag = raw.get("type")
    if type(tag) is not str:  # (exactly str: a subclass or another type may compare as it likes)
        return None
    if tag == "BlockStored":
        keys = _PLAIN_STORED_KEYS
    elif tag == "BlockRemoved":
        keys = _PLAIN_REMOVED_KEYS
    else:
        return None
    try:
        if not raw.keys() <= keys:  # a field the general code reads, or one it ignores
            return None
    except Exception:  # a key whose __hash__ raises: the general code never hashes it
        return None
    hashes = raw.get("block_hashes")  # (missing: None)
    if type(hashes) is not list:
        return None
    block_hashes: tuple[int, ...] | None
    if len(hashes) == 1:  # the usual event: one block (as _hashes and wire_hash decode it)
        value = hashes[0]
        if type(value) is not int:
            return None
        try:
            block_hashes = (wire_hash(value),)
        except WireError:
            return None
    elif not hashes:
        block_hashes = ()
    elif _only_ints(hashes):
        block_hashes = _int_hashes(hashes)
        if block_hashes is None:
            return None
    else:
        return None
    medium = raw.get("medium")
    if medium is not None and (type(medium) is not str or not medium.isascii()):
        return None  # (non-ASCII: the general code checks that it encodes as UTF-8)
    if keys is _PLAIN_REMOVED_KEYS:
        return BlockRemoved(block_hashes, medium)

    parent = raw.get("parent_block_hash")
    if parent is not None:
        if type(parent) is not int:
            return None
        try:
            parent = wire_hash(parent)
        except WireError:
            return None
    tokens = raw.get("token_ids")
    token_ids: tuple[int, ...] = ()
    if tokens is not None:
        if type(tokens) is not list:
            return None
        if tokens:  # (bigram pages, with lists in it, are not plain)
            if not (_only_ints(tokens) and min(tokens) >= 0 and max(tokens) < _U32):
                return None
            token_ids = tuple(tokens)
    block_size = raw.get("block_size")
    if block_size is None:
        block_size = 0
    elif type(block_size) is not int or not 0 <= block_size < _U32:
        return None
    lora_id = raw.get("lora_id")
    if lora_id is not None and type(lora_id) is not int:
        return None
    lora_name = raw.get("lora_name")
    if lora_name is not None and (type(lora_name) is not str or not lora_name.isascii()):
        return None
    return BlockStored(block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name)


def _event(raw: object) -> Event:
    if type(raw) is dict:  # what msgpack decodes a map to: most likely plain
        event = _plain_event(raw)
        if event is not None:
            return event
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        if tag is None:
            raise WireError(RejectReason.MISSING_TAG, "map event without a 'type' key")
        fields: Mapping[str, Any] = raw
    elif isinstance(raw, (list, tuple)):
        if not raw:
            raise WireError(RejectReason.BAD_EVENT, "empty event array")
        tag = raw[0]
        body = raw[1:]
        if tag == "BlockStored" and len(body) > 6 and isinstance(body[6], Mapping):
            # SGLang's BlockStoredWithMetadata: its seven fields, then the metadata map
            fields = dict(zip(_SGLANG_STORED_FIELDS, body, strict=False))
            fields["metadata"] = body[6]
        elif tag == "BlockStored" and len(body) > 7 and type(body[7]) is int:
            fields = dict(zip(_STORED_FIELDS_V1, body, strict=False))
        else:
            names = _FIELDS.get(tag) if isinstance(tag, str) else None
            fields = dict(zip(names, body, strict=False)) if names is not None else {}
    else:
        raise WireError(
            RejectReason.BAD_EVENT, f"event must be a map or an array, got {_tname(raw)}"
        )
    if not isinstance(tag, str):
        raise WireError(RejectReason.MISSING_TAG, f"event tag must be a string, got {_tname(tag)}")
    if tag == "BlockStored":
        return _block_stored(fields)
    if tag == "BlockRemoved":
        return _block_removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireError(RejectReason.UNKNOWN_TAG, f"unknown event tag {tag[:64]!r}")


_SGLANG_KEYS = frozenset({"cache_salt", "metadata"})
_VLLM_KEYS = frozenset(
    {
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "event_version",
        "lookahead_token_ids",
    }
)
_TELLTALE_KEYS = _SGLANG_KEYS | _VLLM_KEYS
_MEDIUM_ENGINES = {
    **dict.fromkeys(("CPU_PINNED", "DISK", "EXTERNAL"), Engine.SGLANG),
    **dict.fromkeys(("CPU", "STORAGE"), Engine.VLLM),
}


def _engine_hint(obj: object, raw_events: list[Any] | tuple[Any, ...]) -> Engine | None:
    """The engine a batch's telltale fields name, if any (see the module docstring)."""
    # (``type(x) is list`` / ``is dict`` first: the usual answers, without the Mapping ABC's
    # slower isinstance check)
    try:
        if type(obj) is not list and isinstance(obj, Mapping):
            if "attn_dp_rank" in obj:
                return Engine.SGLANG
            if "data_parallel_rank" in obj:
                return Engine.VLLM
        for raw in raw_events:
            medium: object = None
            hashes: object = None
            if type(raw) is dict or (type(raw) is not list and isinstance(raw, Mapping)):
                keys = raw.keys()
                if not _TELLTALE_KEYS.isdisjoint(keys):  # (one test for the usual event)
                    return Engine.SGLANG if not _SGLANG_KEYS.isdisjoint(keys) else Engine.VLLM
                medium, hashes = raw.get("medium"), raw.get("block_hashes")
            elif isinstance(raw, (list, tuple)) and len(raw) > 1:
                if raw[0] == "BlockStored":
                    if len(raw) > 7:  # SGLang's metadata map, or vLLM's lora_name and on
                        return Engine.SGLANG if isinstance(raw[7], Mapping) else Engine.VLLM
                    medium = raw[6] if len(raw) > 6 else None
                elif raw[0] == "BlockRemoved":
                    medium = raw[2] if len(raw) > 2 else None
                hashes = raw[1]
            if isinstance(medium, str):
                engine = _MEDIUM_ENGINES.get(medium)
                if engine is not None:
                    return engine
            if isinstance(hashes, list) and hashes:  # int64 hashes: vLLM's are unsigned (or bytes)
                if len(hashes) == 1:  # the usual event; as below, without building a set
                    if type(hashes[0]) is int and hashes[0] < 0:
                        return Engine.SGLANG
                elif _only_ints(hashes) and min(hashes) < 0:
                    return Engine.SGLANG
    except Exception:  # a hostile object names no engine
        return None
    return None


def _reject_batch(reason: RejectReason, detail: str) -> DecodedBatch:
    return DecodedBatch(ts=0.0, events=(), rejects=(Rejection(reason, detail),))


_RANK_NAMES = ("data_parallel_rank", "attn_dp_rank")


def _batch_fields(obj: object) -> tuple[object, object, object] | None:
    """``(ts, events, rank)`` of a batch array or map, or ``None`` when it is neither."""
    if isinstance(obj, (list, tuple)):
        if len(obj) < 2:
            return None
        return obj[0], obj[1], obj[2] if len(obj) > 2 else None
    if isinstance(obj, Mapping):
        if "events" not in obj:
            return None
        rank = next((obj[name] for name in _RANK_NAMES if obj.get(name) is not None), None)
        return obj.get("ts"), obj["events"], rank
    return None


def decode_batch_object(obj: object, *, hint: bool = True) -> DecodedBatch:
    """Decode an already-unpacked batch object (``[ts, events, dp_rank?]`` or the same as a map).

    Never raises. With ``hint``, :attr:`DecodedBatch.engine` is the engine the batch's shape
    names (a stream that knows its engine skips looking).
    """
    fields = _batch_fields(obj)
    if fields is None:
        return _reject_batch(
            RejectReason.BAD_BATCH, "batch must be an array [ts, events, ...] or a map with events"
        )
    raw_ts, raw_events, raw_rank = fields
    if not isinstance(raw_events, (list, tuple)):
        return _reject_batch(
            RejectReason.BAD_BATCH, f"batch events must be an array, got {_tname(raw_events)}"
        )
    rejects: list[Rejection] = []
    if isinstance(raw_ts, (int, float)) and not isinstance(raw_ts, bool):
        ts = float(raw_ts)
    else:
        ts = 0.0
        rejects.append(Rejection(RejectReason.BAD_TIMESTAMP, f"ts is a {_tname(raw_ts)}"))
    dp_rank: int | None = None
    if raw_rank is not None:
        if type(raw_rank) is int:
            dp_rank = raw_rank
        else:
            rejects.append(Rejection(RejectReason.BAD_DP_RANK, f"dp rank is a {_tname(raw_rank)}"))
    events: list[Event] = []
    for position, raw in enumerate(raw_events):
        try:
            events.append(_event(raw))
        except WireError as rej:
            rejects.append(Rejection(rej.reason, rej.detail, position))
        except Exception as exc:  # a hostile object must never escape as an exception
            rejects.append(Rejection(RejectReason.BAD_EVENT, f"undecodable event: {exc!r}"[:200]))
    return DecodedBatch(
        ts=ts,
        events=tuple(events),
        data_parallel_rank=dp_rank,
        rejects=tuple(rejects),
        total_events=len(raw_events),
        engine=_engine_hint(obj, raw_events) if hint else None,
    )


def decode_batch(payload: object, *, hint: bool = True) -> DecodedBatch:
    """Decode one msgpack batch payload. Never raises; see the module docstring.

    Anything but ``bytes``, ``bytearray`` or ``memoryview`` (``None`` included) is a rejected
    payload (:attr:`RejectReason.MALFORMED_PAYLOAD`). ``hint``: see :func:`decode_batch_object`.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return _reject_batch(
            RejectReason.MALFORMED_PAYLOAD, f"payload is a {_tname(payload)}, not bytes"
        )
    if len(payload) > MAX_PAYLOAD_BYTES:
        return _reject_batch(
            RejectReason.PAYLOAD_TOO_LARGE, f"{len(payload)} bytes > {MAX_PAYLOAD_BYTES}"
        )
    try:
        obj = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
        )
    except Exception as exc:
        return _reject_batch(RejectReason.MALFORMED_PAYLOAD, _undecodable(exc, bytes(payload)))
    return decode_batch_object(obj, hint=hint)


def _undecodable(exc: Exception, payload: bytes) -> str:
    """Why msgpack could not decode ``payload``: its error, never an empty reason (msgpack's
    ``FormatError`` for a reserved type byte such as ``0xc1`` has no message), and the first
    bytes of the payload."""
    reason = str(exc).strip() or (
        "not msgpack (a reserved type byte)"
        if type(exc).__name__ == "FormatError"
        else "msgpack could not decode it"
    )
    if not payload:
        return f"{type(exc).__name__}: {reason} (an empty payload)"
    head = payload[:16].hex(" ") + (" ..." if len(payload) > 16 else "")
    return f"{type(exc).__name__}: {reason} (payload of {len(payload)} bytes: {head})"[:200]


def parse_topic(topic: str) -> tuple[str | None, str | None]:
    """``kv@<pod-id>@<model-name>`` → ``(pod, model)``; anything else → ``(None, None)``.

    The model name may itself contain ``@``. Empty parts come back as ``None``.
    """
    parts = topic.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv":
        return None, None
    return parts[1] or None, parts[2] or None


# ------------------------------------------------------------------------------------------
# Encoding: the engine side of the wire, for test publishers, benchmarks and relays.
# ------------------------------------------------------------------------------------------

WireFormat = Literal["map", "array"]


def event_to_wire(event: Event, fmt: WireFormat = "map") -> list[Any] | dict[str, Any]:
    """The msgpack-ready form of ``event``, as vLLM would publish it in the given format.

    Map events are vLLM 0.34's msgspec encoding: the tag first, then the fields in declaration
    order, those without a default always present (``nil`` when unset) and those with one
    omitted at their default (``omit_defaults``); SGLang's ``cache_salt`` comes last when set.
    Array events carry every field up to the last non-default one (they cannot carry
    ``cache_salt``). Typed extra keys are written as vLLM's ``event_version`` 1 tagged maps (an
    array event then carries ``event_version`` before ``extra_keys``).
    """
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if fmt == "map" else ["AllBlocksCleared"]
    names: tuple[str, ...]
    typed = False
    if isinstance(event, BlockStored):
        names = _STORED_FIELDS
        tag = "BlockStored"
        required = _STORED_REQUIRED
        typed = event.extra_keys is not None and any(
            isinstance(item, _TYPED_KEYS) for block in event.extra_keys if block for item in block
        )
        if typed and fmt == "array":
            names = _STORED_FIELDS_V1
    else:
        names = _REMOVED_FIELDS
        tag = "BlockRemoved"
        required = _REMOVED_REQUIRED
    values: list[Any] = []
    for name in names:
        if name == "event_version":
            values.append(EVENT_VERSION)
            continue
        value = getattr(event, name)
        if name == "extra_keys" and typed:
            value = [
                None if block is None else [_typed_to_wire(item) for item in block]
                for block in value
            ]
        values.append(list(value) if isinstance(value, tuple) else value)
    if fmt == "map":
        out: dict[str, Any] = {"type": tag}
        for i, (name, value) in enumerate(zip(names, values, strict=True)):
            if i < required or value is not None:
                out[name] = value
        if isinstance(event, BlockStored) and event.cache_salt is not None:
            out["cache_salt"] = event.cache_salt
        return out
    last = max([_ARRAY_REQUIRED[tag] - 1] + [i for i, v in enumerate(values) if v is not None])
    return [tag, *values[: last + 1]]


_TYPED_KEYS = (MultiModalKey, LoRAKey, CacheSaltKey, PromptEmbedsKey)


def _typed_to_wire(item: object) -> object:
    """A typed extra key as vLLM's tagged map (other items unchanged)."""
    if isinstance(item, MultiModalKey):
        return {
            "type": "mm",
            "modality": item.modality,
            "hash": item.hash,
            "block_offset": item.block_offset,
        }
    if isinstance(item, LoRAKey):
        return {"type": "lora", "name": item.name}
    if isinstance(item, CacheSaltKey):
        return {"type": "cache_salt", "salt": item.salt}
    if isinstance(item, PromptEmbedsKey):
        return {"type": "prompt_embeds", "hash": item.hash}
    return list(item) if isinstance(item, tuple) else item


def encode_batch(
    events: Sequence[Event | Mapping[str, Any] | Sequence[Any]],
    ts: float = 0.0,
    data_parallel_rank: int | None = None,
    fmt: WireFormat = "map",
) -> bytes:
    """A msgpack batch payload. Typed events are converted; raw maps/arrays pass through."""
    wire: list[Any] = []
    for event in events:
        if isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            wire.append(event_to_wire(event, fmt))
        else:
            wire.append(event)
    batch: list[Any] = [ts, wire]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return msgpack.packb(batch, use_bin_type=True)  # type: ignore[no-any-return]

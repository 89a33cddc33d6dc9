"""TensorRT-LLM's KV cache events, decoded into the events of :mod:`kvredis.ingest.events`.

TensorRT-LLM (1.2) hands its events out rather than publishing them: ``LLM.get_kv_cache_events()``
in Python, and ``trtllm-serve``'s ``POST /kv_cache_events``, which answers with a JSON array of
every event buffered since the previous call (waiting a moment for one when there is none) and
forgets them. The buffer (``kv_cache_config.event_buffer_max_size`` events) drops the oldest when
full. Each event, as ``KVCacheEventSerializer`` writes it::

    {"event_id": N, "window_size": W, "attention_dp_rank": R?, "data": DATA}

    DATA = {"type": "created", "num_blocks_per_cache_level": [primary, secondary]}
         | {"type": "stored", "parent_hash": H | null, "blocks": [
               {"type": "stored_block", "block_hash": H,
                "tokens": [{"type": "unique_token", "token_id": T, "token_extra_id": E}, ...],
                "cache_level": L, "priority": P,
                "mm_keys": [{"type": "mm_key", "hash": HEX, "start_offset": O, "uuid"?: U}]?,
                "cache_salt": S?, "lora_id": ID?}, ...]}
         | {"type": "removed", "block_hashes": [H, ...]}
         | {"type": "updated", "block_hash": H,
            "cache_level": {"type": "event_diff", "new_value": L, "old_value": L} | null,
            "priority": {"type": "event_diff", "new_value": P, "old_value": P} | null}

Facts this module relies on:

* ``event_id`` counts every event of one KV-cache manager from 0, so it is the sequence: a jump
  is a gap (the buffer dropped events, or another caller took them), a step back a new manager
  (the engine restarted). With attention data parallelism rank 0 gathers every rank's events
  and each rank counts its own (``attention_dp_rank`` names it): one sequence per rank.
* Hashes are the block manager's ``size_t`` (an unsigned 64-bit JSON integer; a later manager
  sends 32-byte hex digests, read by their last 8 bytes like msgpack ``bin`` hashes). A stored
  event's blocks chain: the first block's parent is ``parent_hash`` (``null``: the chain starts
  at the root), each next block's parent is the block before.
* ``cache_level`` 0 is the primary pool (GPU memory), 1 the secondary one (host memory, the
  offload target): the mediums ``GPU`` and ``CPU`` here, so the tiers ``gpu`` and ``cpu``. A
  block lives in one level at a time: ``updated`` with a ``cache_level`` diff moves it (offload
  or onboard), ``removed`` names no level (both tiers' entries go).
* Each attention window size has its own block manager (variable sliding-window attention), and
  the same tokens get the same hashes in each: ``window_size`` becomes the KV-cache group
  (``group_idx``), so one window's removal never takes another window's entry.
* A block holds ``tokens_per_block`` tokens (the events do not say how many:
  :class:`TrtllmDecoder` learns it as the largest block seen); a run of them on one level is one
  ``BlockStored`` (``block_size`` ``tokens_per_block``). The last block of a sequence may hold
  fewer, a *partial* block: it is the engines' own partial page, a ``BlockStored`` of its own
  chained to the block before, so the index blocks its tokens complete are credited and the
  chain ends inside an index block there. Nothing hangs from a partial block: a later request
  extending the sequence copies it into a full sibling with another hash (partial reuse), which
  holds the same index blocks. An index block leaves the index when any engine block holding its
  tokens is removed, so the partial block's removal would take away blocks its sibling still
  holds (and the router would lose the rest of the chain): :class:`TrtllmDecoder` remembers the
  partial blocks a full sibling has covered since, and their removals (and tier moves) are not
  applied.
* ``mm_keys`` name the multimodal items a block holds tokens of: ``uuid`` when the request gave
  one (a V1 manager sends it as ``hash``), else the item's content digest. They become the
  block's features (``MMHash(identifier)``), as vLLM's multimodal extra keys do.
* ``created`` is a new KV-cache manager, with empty pools: an ``AllBlocksCleared``.
* A ``token_extra_id`` (prompt-table vocabulary) or a ``lora_id`` changes the engine's hash in a
  way the tokens alone do not show (the adapter's name is not in the event): such an event is
  refused (``unplaced_extra_key``), never hashed as plain text. ``priority`` is not indexed.

:func:`split_events` cuts a ``/kv_cache_events`` answer into one message per event;
:func:`decode_event` decodes one (never raises, as :func:`~kvredis.ingest.events.decode_batch`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvredis.features import MultiModalKey
from kvredis.ingest.events import (
    MAX_PAYLOAD_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    Engine,
    Event,
    Rejection,
    RejectReason,
    WireError,
    wire_hash,
)

__all__ = [
    "CACHE_LEVEL_MEDIUMS",
    "PolledEvent",
    "TrtllmDecoder",
    "decode_event",
    "decode_event_object",
    "events_payload",
    "split_events",
]

CACHE_LEVEL_MEDIUMS: tuple[str, ...] = ("GPU", "CPU")
"""The medium of each TensorRT-LLM cache level: 0 primary (GPU), 1 secondary (host memory)."""

_U32 = 1 << 32
_GROUP_LIMIT = 1 << 31


@dataclass(frozen=True, slots=True)
class PolledEvent:
    """One event of a ``/kv_cache_events`` answer: its id (the sequence), its attention-DP rank
    (0 without attention data parallelism) and its JSON, the message payload."""

    event_id: int
    rank: int
    payload: bytes


def split_events(body: bytes) -> tuple[list[PolledEvent], list[str]]:
    """The events of one ``/kv_cache_events`` answer, in order, and what was wrong with it.

    An answer that is not a JSON array is one problem and no events; an element without an
    integer ``event_id`` (or with a non-integer ``attention_dp_rank``) is skipped with a problem:
    its rank's sequence then shows a gap.
    """
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return [], [f"the answer is not JSON ({exc})"[:200]]
    if not isinstance(obj, list):
        return [], [f"the answer is a JSON {type(obj).__name__}, not an array of events"]
    out: list[PolledEvent] = []
    problems: list[str] = []
    for position, item in enumerate(obj):
        if not isinstance(item, dict):
            problems.append(f"event {position} is a JSON {type(item).__name__}, not an object")
            continue
        event_id = item.get("event_id")
        rank = item.get("attention_dp_rank")
        if type(event_id) is not int or event_id < 0:
            problems.append(f"event {position} has no event_id ({event_id!r:.40})")
            continue
        if rank is not None and (type(rank) is not int or rank < 0):
            problems.append(f"event {event_id} has attention_dp_rank {rank!r:.40}")
            continue
        payload = json.dumps(item, separators=(",", ":")).encode("utf-8")
        out.append(PolledEvent(event_id, rank or 0, payload))
    return out, problems


_SHADOW_LIMIT = 65_536
"""Partial blocks (and covered ones) a decoder remembers, least recently stored dropped."""


class _State:
    """What decoding one server's events remembers: its block size, and its partial blocks
    (by KV-cache group and parent), each marked once a full sibling covers its tokens."""

    def __init__(self, tokens_per_block: int = 0) -> None:
        self.tokens_per_block = tokens_per_block
        self._partials: OrderedDict[tuple[int | None, int], tuple[int | None, tuple[int, ...]]]
        self._partials = OrderedDict()
        self._children: dict[tuple[int | None, int | None], set[int]] = {}
        self._covered: OrderedDict[tuple[int | None, int], None] = OrderedDict()

    def reset(self) -> None:
        """A new KV-cache manager: nothing of the old one's blocks is held."""
        self._partials.clear()
        self._children.clear()
        self._covered.clear()

    def partial(
        self, group: int | None, parent: int | None, block: int, tokens: tuple[int, ...]
    ) -> None:
        self._partials[(group, block)] = (parent, tokens)
        self._children.setdefault((group, parent), set()).add(block)
        while len(self._partials) > _SHADOW_LIMIT:
            (g, old), (p, _) = self._partials.popitem(last=False)
            self._forget_child(g, p, old)

    def full(self, group: int | None, parent: int | None, tokens: tuple[int, ...]) -> None:
        """A full block under ``parent``: it covers the partial siblings its tokens extend."""
        siblings = self._children.get((group, parent))
        if not siblings:
            return
        for block in list(siblings):
            _, held = self._partials[(group, block)]
            if tokens[: len(held)] == held:
                del self._partials[(group, block)]
                self._forget_child(group, parent, block)
                self._covered[(group, block)] = None
                while len(self._covered) > _SHADOW_LIMIT:
                    self._covered.popitem(last=False)

    def covered(self, group: int | None, block: int, *, gone: bool = False) -> bool:
        """Whether partial ``block`` is covered by a full sibling (``gone``: it was removed)."""
        key = (group, block)
        if gone:
            entry = self._partials.pop(key, None)
            if entry is not None:
                self._forget_child(group, entry[0], block)
            if key in self._covered:
                del self._covered[key]
                return True
            return False
        return key in self._covered

    def _forget_child(self, group: int | None, parent: int | None, block: int) -> None:
        siblings = self._children.get((group, parent))
        if siblings is not None:
            siblings.discard(block)
            if not siblings:
                del self._children[(group, parent)]


class TrtllmDecoder:
    """The wire format of one trtllm-serve: :func:`decode_event`, learning the engine's
    ``tokens_per_block`` from the blocks it sees (the largest; a partial block is smaller) and
    which partial blocks a full sibling covers (their removals are not applied)."""

    def __init__(self) -> None:
        self._state = _State()

    @property
    def tokens_per_block(self) -> int:
        """The largest block seen (0: none yet)."""
        return self._state.tokens_per_block

    def __call__(self, payload: object, *, hint: bool = True) -> DecodedBatch:
        return _decode(payload, self._state)


def decode_event(payload: object, tokens_per_block: int = 0) -> DecodedBatch:
    """Decode one TensorRT-LLM event's JSON (a :class:`PolledEvent` payload). Never raises.

    The batch holds the kvredis events the TensorRT-LLM event stands for (see the module
    docstring), ``data_parallel_rank`` its ``attention_dp_rank`` and ``engine``
    :attr:`~kvredis.ingest.events.Engine.TRTLLM`. ``tokens_per_block``: the engine's block size
    if known (blocks smaller than it, and than the event's largest, are partial).
    """
    return _decode(payload, _State(tokens_per_block))


def _decode(payload: object, state: _State) -> DecodedBatch:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return _reject(RejectReason.MALFORMED_PAYLOAD, f"payload is a {_tname(payload)}, not bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        return _reject(
            RejectReason.PAYLOAD_TOO_LARGE, f"{len(payload)} bytes > {MAX_PAYLOAD_BYTES}"
        )
    try:
        obj = json.loads(bytes(payload))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return _reject(RejectReason.MALFORMED_PAYLOAD, f"not JSON: {exc}"[:200])
    return _decode_object(obj, state)


def decode_event_object(obj: object, tokens_per_block: int = 0) -> DecodedBatch:
    """Decode one already-parsed TensorRT-LLM event (a JSON object). Never raises."""
    return _decode_object(obj, _State(tokens_per_block))


def _decode_object(obj: object, state: _State) -> DecodedBatch:
    if not isinstance(obj, Mapping):
        return _reject(
            RejectReason.BAD_BATCH, f"a TensorRT-LLM event is a JSON object, got {_tname(obj)}"
        )
    rejects: list[Rejection] = []
    rank = obj.get("attention_dp_rank")
    if rank is not None and (type(rank) is not int or rank < 0):
        rejects.append(Rejection(RejectReason.BAD_DP_RANK, f"attention_dp_rank {rank!r:.40}"))
        rank = None
    events: tuple[Event, ...] = ()
    try:
        events = _events(obj, state)
    except WireError as rej:
        rejects.append(Rejection(rej.reason, rej.detail, 0))
    except Exception as exc:  # a hostile object must never escape as an exception
        rejects.append(Rejection(RejectReason.BAD_EVENT, f"undecodable event: {exc!r}"[:200], 0))
    return DecodedBatch(
        ts=0.0,
        events=events,
        data_parallel_rank=rank,
        rejects=tuple(rejects),
        total_events=1,
        engine=Engine.TRTLLM,
    )


def _reject(reason: RejectReason, detail: str) -> DecodedBatch:
    return DecodedBatch(
        ts=0.0, events=(), rejects=(Rejection(reason, detail),), engine=Engine.TRTLLM
    )


def _tname(value: object) -> str:
    return type(value).__name__


def _events(obj: Mapping[str, Any], state: _State) -> tuple[Event, ...]:
    data = obj.get("data")
    if not isinstance(data, Mapping):
        raise WireError(RejectReason.BAD_EVENT, f"event data must be an object, got {_tname(data)}")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise WireError(RejectReason.MISSING_TAG, "event data without a 'type'")
    window = obj.get("window_size")
    if window is not None and (type(window) is not int or not 0 <= window < _GROUP_LIMIT):
        raise WireError(RejectReason.BAD_FIELD_VALUE, f"window_size {window!r:.40}")
    if kind == "stored":
        return _stored(data, window, state)
    if kind == "removed":
        hashes = _hash_list(data.get("block_hashes"), "block_hashes")
        # a covered partial block's index blocks are its full sibling's too: they stay
        kept = tuple(h for h in hashes if not state.covered(window, h, gone=True))
        if not kept:
            return ()
        return tuple(BlockRemoved(kept, medium=m, group_idx=window) for m in CACHE_LEVEL_MEDIUMS)
    if kind == "updated":
        return _updated(data, window, state)
    if kind == "created":
        state.reset()
        return (AllBlocksCleared(),)
    raise WireError(RejectReason.UNKNOWN_TAG, f"unknown event type {kind[:64]!r}")


def _hash(value: object, what: str) -> int:
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise WireError(RejectReason.BAD_HASH, f"{what} {value[:40]!r} is not hex") from None
        return wire_hash(raw, what)
    return wire_hash(value, what)


def _hash_list(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"{what} must be an array, got {_tname(value)}"
        )
    return tuple(_hash(h, "block hash") for h in value)


def _medium(level: object) -> str:
    if type(level) is not int or not 0 <= level < len(CACHE_LEVEL_MEDIUMS):
        raise WireError(RejectReason.BAD_FIELD_VALUE, f"cache_level {level!r:.40} is not 0 or 1")
    return CACHE_LEVEL_MEDIUMS[level]


def _tokens(value: object, block: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(
            RejectReason.BAD_FIELD_TYPE,
            f"block {block} tokens must be an array, got {_tname(value)}",
        )
    out: list[int] = []
    for token in value:
        if isinstance(token, Mapping):
            extra = token.get("token_extra_id")
            if extra is not None and extra != 0:
                raise WireError(
                    RejectReason.UNPLACED_EXTRA_KEY,
                    f"block {block} holds a token with token_extra_id {extra!r:.40} (a prompt-"
                    "table vocabulary): its key depends on more than the token ids",
                )
            token = token.get("token_id")
        if type(token) is not int:
            raise WireError(
                RejectReason.BAD_FIELD_TYPE, f"token ids must be ints, got {_tname(token)}"
            )
        if not 0 <= token < _U32:
            raise WireError(RejectReason.TOKEN_OUT_OF_RANGE, f"token id {token} is outside uint32")
        out.append(token)
    if not out:
        raise WireError(RejectReason.BAD_FIELD_VALUE, f"block {block} holds no tokens")
    return tuple(out)


def _mm_keys(value: object, block: int) -> tuple[MultiModalKey, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise WireError(RejectReason.BAD_EXTRA_KEYS, f"block {block} mm_keys must be an array")
    keys: list[MultiModalKey] = []
    for item in value:
        if not isinstance(item, Mapping):
            raise WireError(RejectReason.BAD_EXTRA_KEYS, f"block {block} mm_keys hold objects")
        uuid, digest, offset = item.get("uuid"), item.get("hash"), item.get("start_offset", 0)
        identifier = uuid if isinstance(uuid, str) and uuid else digest
        if not isinstance(identifier, str) or not identifier or type(offset) is not int:
            raise WireError(
                RejectReason.BAD_EXTRA_KEYS,
                f"block {block} mm_key needs a hash (string) and a start_offset (int)",
            )
        keys.append(MultiModalKey("", identifier, offset))
    return tuple(keys)


@dataclass
class _Block:
    hash: int
    tokens: tuple[int, ...]
    medium: str
    mm: tuple[MultiModalKey, ...] | None


def _stored(data: Mapping[str, Any], window: int | None, state: _State) -> tuple[Event, ...]:
    parent_raw = data.get("parent_hash")
    parent = None if parent_raw is None else _hash(parent_raw, "parent_hash")
    raw_blocks = data.get("blocks")
    if not isinstance(raw_blocks, list):
        raise WireError(
            RejectReason.BAD_FIELD_TYPE, f"blocks must be an array, got {_tname(raw_blocks)}"
        )
    blocks: list[_Block] = []
    salt: str | None = None
    for i, block in enumerate(raw_blocks):
        if not isinstance(block, Mapping):
            raise WireError(RejectReason.BAD_FIELD_TYPE, f"block {i} is a {_tname(block)}")
        if "block_hash" not in block:
            raise WireError(RejectReason.MISSING_FIELD, f"block {i} has no block_hash")
        block_hash = _hash(block["block_hash"], "block_hash")
        tokens = _tokens(block.get("tokens"), i)
        medium = _medium(block.get("cache_level", 0))
        lora = block.get("lora_id")
        if lora is not None:
            raise WireError(
                RejectReason.UNPLACED_EXTRA_KEY,
                f"block {i} belongs to LoRA task {lora!r:.40}: the event does not name the "
                "adapter its keys are hashed under",
            )
        block_salt = block.get("cache_salt")
        if block_salt is not None:
            if not isinstance(block_salt, str):
                raise WireError(
                    RejectReason.BAD_FIELD_TYPE, f"block {i} cache_salt is not a string"
                )
            if salt is not None and block_salt != salt:
                raise WireError(
                    RejectReason.BAD_FIELD_VALUE, "blocks of one event disagree on the salt"
                )
            salt = block_salt
        blocks.append(_Block(block_hash, tokens, medium, _mm_keys(block.get("mm_keys"), i) or None))
    size = max([state.tokens_per_block, *(len(b.tokens) for b in blocks)])
    state.tokens_per_block = size
    # runs of full blocks on one level; a partial block (fewer tokens) is a run of its own,
    # with the engine's block size (its tokens end the chain inside an index block)
    runs: list[list[_Block]] = []
    before = parent
    for block in blocks:
        if len(block.tokens) == size:
            state.full(window, before, block.tokens)
        else:
            state.partial(window, before, block.hash, block.tokens)
        run = runs[-1] if runs else None
        if (
            run is None
            or len(block.tokens) != size
            or len(run[-1].tokens) != size
            or run[-1].medium != block.medium
        ):
            runs.append([block])
        else:
            run.append(block)
        before = block.hash
    out: list[Event] = []
    before = parent
    for run in runs:
        mm = [b.mm for b in run]
        out.append(
            BlockStored(
                block_hashes=tuple(b.hash for b in run),
                parent_block_hash=before,
                token_ids=tuple(t for b in run for t in b.tokens),
                block_size=size,
                medium=run[0].medium,
                extra_keys=tuple(mm) if any(mm) else None,
                group_idx=window,
                kv_cache_spec_sliding_window=window,
                # a salt isolates a chain at its root; a continued chain carries it already
                cache_salt=salt if before is None else None,
            )
        )
        before = run[-1].hash
    return tuple(out)


def _diff(value: object, what: str) -> tuple[object, object] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise WireError(RejectReason.BAD_FIELD_TYPE, f"{what} must be an event_diff object")
    return value.get("old_value"), value.get("new_value")


def _updated(data: Mapping[str, Any], window: int | None, state: _State) -> tuple[Event, ...]:
    if "block_hash" not in data:
        raise WireError(RejectReason.MISSING_FIELD, "updated event without block_hash")
    block_hash = _hash(data["block_hash"], "block_hash")
    if state.covered(window, block_hash):
        return ()  # a covered partial block: its index blocks are its full sibling's
    _diff(data.get("priority"), "priority")  # checked, not indexed
    levels = _diff(data.get("cache_level"), "cache_level")
    if levels is None:
        return ()
    old, new = _medium(levels[0]), _medium(levels[1])
    if old == new:
        return ()
    # a move: the new level's entry on the keys the block maps to, the old level's off them
    return (
        BlockStored(
            block_hashes=(block_hash,),
            medium=new,
            group_idx=window,
            kv_cache_spec_sliding_window=window,
            moved_from=old,
        ),
    )


def events_payload(events: Sequence[Mapping[str, Any]]) -> bytes:
    """A ``/kv_cache_events`` answer holding ``events`` (for fakes and relays)."""
    return json.dumps(list(events), separators=(",", ":")).encode("utf-8")

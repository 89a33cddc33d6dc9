"""KV-event payloads byte for byte as vLLM 0.34 and SGLang 0.5.23 publish them (and vLLM's
``event_version`` 1 shapes from its main branch, SGLang's older array form).

Both engines encode with msgspec: an event is a tagged struct (a map whose first key is
``"type"``, then the fields in declaration order), ``omit_defaults`` drops fields that have a
default and hold it, fields without a default are always written (``nil`` when unset); a batch
is an ``array_like`` struct, which msgspec writes in full (``[ts, events, rank]``, the rank
``nil`` when unset, for both engines). A struct with more than 15 fields (vLLM's
``BlockStored``) gets a map16 header even when fewer keys remain. Tuples (extra keys, bigram
pairs) travel as arrays, digests as msgpack ``bin``. These helpers build the same maps and
arrays (shapes and field names copied from the engines' struct declarations) and pack them the
same way; kvredis's own tests pin the bytes against msgspec's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

Hash = int | bytes


class Map16(dict[str, Any]):
    """A map msgspec writes with a map16 header (its struct declares more than 15 fields)."""


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (``bin`` for bytes), with :class:`Map16` headers kept."""
    if isinstance(obj, Map16):
        out = bytearray(b"\xde" + len(obj).to_bytes(2, "big"))
        for key, value in obj.items():
            out += pack(key) + pack(value)
        return bytes(out)
    if isinstance(obj, (list, tuple)) and any(_has_map16(v) for v in obj):
        n = len(obj)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        return head + b"".join(pack(v) for v in obj)
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _has_map16(obj: Any) -> bool:
    if isinstance(obj, Map16):
        return True
    return isinstance(obj, (list, tuple)) and any(_has_map16(v) for v in obj)


def _fields(
    required: Sequence[tuple[str, Any]], optional: Sequence[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    return [*required, *[(k, v) for k, v in optional if v is not None]]


def vllm_stored(
    block_hashes: Sequence[Hash],
    parent_block_hash: Hash | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
    group_idx: int | None = None,
    kv_cache_spec_kind: str | None = None,
    kv_cache_spec_sliding_window: int | None = None,
    locality: str | None = None,
    ownership: str | None = None,
    session_id: str | None = None,
    lookahead_token_ids: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """vLLM 0.34 ``BlockStored`` (``vllm/distributed/kv_events.py``)."""
    fields = _fields(
        [
            ("type", "BlockStored"),
            ("block_hashes", list(block_hashes)),
            ("parent_block_hash", parent_block_hash),
            ("token_ids", list(token_ids)),
            ("block_size", block_size),
            ("lora_id", lora_id),
            ("medium", medium),
            ("lora_name", lora_name),
        ],
        [
            (
                "extra_keys",
                None
                if extra_keys is None
                else [None if b is None else [_item(i) for i in b] for b in extra_keys],
            ),
            ("group_idx", group_idx),
            ("kv_cache_spec_kind", kv_cache_spec_kind),
            ("kv_cache_spec_sliding_window", kv_cache_spec_sliding_window),
            ("locality", locality),
            ("ownership", ownership),
            ("session_id", session_id),
            (
                "lookahead_token_ids",
                None if lookahead_token_ids is None else [list(t) for t in lookahead_token_ids],
            ),
        ],
    )
    return Map16(fields)


def vllm_offload_placeholder(
    offload_key: Hash, group_idx: int, *, medium: str = "CPU"
) -> dict[str, Any]:
    """The ``BlockStored`` vLLM 0.34's offloading connector publishes for a stored chunk when
    self-describing events are off (``OffloadingEventsTracker._placeholder_stored``): only the
    chunk's offload key (the hash of its last block), no parent, no tokens, ``block_size`` 0."""
    return vllm_stored([offload_key], None, [], 0, medium=medium, group_idx=group_idx)


def _item(item: Any) -> Any:
    return list(item) if isinstance(item, tuple) else item


def vllm_removed(
    block_hashes: Sequence[Hash],
    *,
    medium: str | None = "GPU",
    group_idx: int | None = None,
    locality: str | None = None,
    ownership: str | None = None,
) -> dict[str, Any]:
    """vLLM 0.34 ``BlockRemoved``."""
    return dict(
        _fields(
            [("type", "BlockRemoved"), ("block_hashes", list(block_hashes)), ("medium", medium)],
            [("group_idx", group_idx), ("locality", locality), ("ownership", ownership)],
        )
    )


def all_cleared() -> dict[str, Any]:
    """``AllBlocksCleared`` (both engines)."""
    return {"type": "AllBlocksCleared"}


def vllm_batch(
    events: Sequence[Any], ts: float = 1.0, data_parallel_rank: int | None = None
) -> bytes:
    """vLLM 0.34 ``KVEventBatch``: ``[ts, events, data_parallel_rank]``."""
    return pack([ts, list(events), data_parallel_rank])


def vllm_map_batch(
    events: Sequence[Any], ts: float = 1.0, data_parallel_rank: int | None = None
) -> bytes:
    """The batch as a map with the same field names (``EventBatch`` without ``array_like``)."""
    batch: dict[str, Any] = {"ts": ts, "events": list(events)}
    if data_parallel_rank is not None:
        batch["data_parallel_rank"] = data_parallel_rank
    return pack(batch)


def signed(value: int) -> int:
    """A 64-bit hash the way SGLang publishes it (int64, two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def sglang_stored(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int] | Sequence[tuple[int, int]],
    block_size: int,
    *,
    medium: str | None = "GPU",
    cache_salt: str | None = None,
    session_id: str | None = None,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """SGLang 0.5.23 ``BlockStored`` (``sglang/srt/disaggregation/kv_events.py``)."""
    return dict(
        _fields(
            [
                ("type", "BlockStored"),
                ("block_hashes", [signed(h) for h in block_hashes]),
                (
                    "parent_block_hash",
                    None if parent_block_hash is None else signed(parent_block_hash),
                ),
                ("token_ids", [_item(t) for t in token_ids]),
                ("block_size", block_size),
                ("lora_id", None),
            ],
            [
                ("medium", medium),
                ("cache_salt", cache_salt),
                ("session_id", session_id),
                ("lora_name", lora_name),
            ],
        )
    )


def sglang_removed(block_hashes: Sequence[int], *, medium: str | None = "GPU") -> dict[str, Any]:
    """SGLang 0.5.23 ``BlockRemoved``."""
    return dict(
        _fields(
            [("type", "BlockRemoved"), ("block_hashes", [signed(h) for h in block_hashes])],
            [("medium", medium)],
        )
    )


def sglang_batch(events: Sequence[Any], ts: float = 1.0, attn_dp_rank: int | None = None) -> bytes:
    """SGLang 0.5.23 ``KVEventBatch``: always ``[ts, events, attn_dp_rank]``."""
    return pack([ts, list(events), attn_dp_rank])


def sglang_pages(
    tokens: Sequence[int],
    page_size: int,
    first_hash: int,
    parent: int | None = None,
    *,
    bigram_next: int | None = None,
    **kwargs: Any,
) -> tuple[list[dict[str, Any]], int]:
    """The events SGLang's recorder emits for one radix node: one ``BlockStored`` per page,
    coalesced while the pages chain and share a size (so a short last page is its own event).

    Page ``i`` gets engine hash ``first_hash + i``. With ``bigram_next`` (EAGLE), pages carry
    ``[token, next]`` pairs, the last pair ending with ``bigram_next``. Returns the events and
    the last page's hash.
    """
    events: list[dict[str, Any]] = []
    raw = [*tokens, bigram_next] if bigram_next is not None else list(tokens)
    h = first_hash
    for start in range(0, len(tokens), page_size):
        end = min(start + page_size, len(tokens))
        page: list[Any]
        if bigram_next is not None:
            page = [(raw[j], raw[j + 1]) for j in range(start, end)]
        else:
            page = list(tokens[start:end])
        tail = events[-1] if events else None
        if tail is not None and tail["block_size"] == len(page):  # the pages chain
            tail["block_hashes"].append(signed(h))
            tail["token_ids"].extend(_item(t) for t in page)
        else:
            events.append(sglang_stored([h], parent, page, len(page), **kwargs))
        parent = h
        h += 1
    return events, h - 1


# -- vLLM's next shapes (main branch: event_version 1, typed extra keys) --------------------------


def vllm_mm(modality: str, mm_hash: str, block_offset: int) -> dict[str, Any]:
    """vLLM's typed extra key ``MultiModalKey`` (tag ``mm``)."""
    return {"type": "mm", "modality": modality, "hash": mm_hash, "block_offset": block_offset}


def vllm_lora(name: str) -> dict[str, Any]:
    """vLLM's typed extra key ``LoRAKey``."""
    return {"type": "lora", "name": name}


def vllm_salt(salt: str) -> dict[str, Any]:
    """vLLM's typed extra key ``CacheSaltKey`` (first block of a request only)."""
    return {"type": "cache_salt", "salt": salt}


def vllm_embeds(digest: bytes) -> dict[str, Any]:
    """vLLM's typed extra key ``PromptEmbedsKey``."""
    return {"type": "prompt_embeds", "hash": digest}


def vllm_legacy(value: Any) -> dict[str, Any]:
    """vLLM's ``LegacyExtraKey``: an internal extra key it could not classify."""
    return {"type": "legacy", "value": value}


def vllm_stored_v1(
    block_hashes: Sequence[Hash],
    parent_block_hash: Hash | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: int | None = None,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    event_version: int = 1,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
    group_idx: int | None = None,
    kv_cache_spec_kind: str | None = None,
    kv_cache_spec_sliding_window: int | None = None,
    locality: str | None = None,
    ownership: str | None = None,
    fmt: str = "map",
) -> dict[str, Any] | list[Any]:
    """vLLM main's ``BlockStored`` (``event_version`` 1, typed ``extra_keys``): as a tagged map
    (``event_version`` omitted at its default, 1) or in the positional array form (an
    ``array_like`` struct: every field, in order), where ``event_version`` comes before
    ``extra_keys``."""
    extra = None if extra_keys is None else [None if b is None else list(b) for b in extra_keys]
    names_values: list[tuple[str, Any]] = [
        ("block_hashes", list(block_hashes)),
        ("parent_block_hash", parent_block_hash),
        ("token_ids", list(token_ids)),
        ("block_size", block_size),
        ("lora_id", lora_id),
        ("medium", medium),
        ("lora_name", lora_name),
        ("event_version", event_version),
        ("extra_keys", extra),
        ("group_idx", group_idx),
        ("kv_cache_spec_kind", kv_cache_spec_kind),
        ("kv_cache_spec_sliding_window", kv_cache_spec_sliding_window),
        ("locality", locality),
        ("ownership", ownership),
    ]
    if fmt == "array":
        return ["BlockStored", *[v for _, v in names_values]]
    out: dict[str, Any] = {"type": "BlockStored"}
    for i, (name, value) in enumerate(names_values):
        if name == "event_version":
            if value != 1:
                out[name] = value
        elif i < 7 or value is not None:
            out[name] = value
    return out


def sglang_array_stored(
    block_hashes: Sequence[int],
    parent_block_hash: int | None,
    token_ids: Sequence[int],
    block_size: int,
    *,
    medium: str | None = "GPU",
    cache_salt: str | None = None,
) -> list[Any]:
    """SGLang's array-form ``BlockStored`` (``array_like`` events, before tagged maps), and with
    a salt its ``BlockStoredWithMetadata``: the seven base fields, then ``{"cache_salt": s}``."""
    out: list[Any] = [
        "BlockStored",
        [signed(h) for h in block_hashes],
        None if parent_block_hash is None else signed(parent_block_hash),
        list(token_ids),
        block_size,
        None,
        medium,
    ]
    if cache_salt is not None:
        out.append({"cache_salt": cache_salt})
    return out

"""Multimodal block features: which image/audio items taint which KV blocks.

A block that holds (part of) a multimodal item's placeholder tokens must hash differently from a
text block with the same token ids, because the engine's cached KV for it depends on the item's
content. These helpers produce the per-block identifier lists that
:meth:`kvredis.hashing.ChunkedTokenDatabase.tokens_to_kv_block_keys` mixes into the block keys:

* :func:`compute_block_extra_features` derives them on the router side from the tokenizer's
  multimodal hashes and placeholder ranges;
* :func:`split_extra_keys` decodes an engine's ``BlockStored`` ``extra_keys`` item by item (LoRA
  name, multimodal items, cache salt, prompt-embedding digests), untyped (vLLM 0.34) or typed
  (:class:`MultiModalKey`, :class:`LoRAKey`, :class:`CacheSaltKey`, :class:`PromptEmbedsKey`:
  vLLM's ``event_version`` 1 schema); :func:`parse_raw_extra_keys` is the older reading that
  takes every string for a multimodal identifier;
* :func:`realign_extra_features` maps per-engine-block features onto kvredis's block size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvredis.errors import InvalidInputError
from kvredis.fastinit import slot_init

__all__ = [
    "PROMPT_EMBEDS_PREFIX",
    "BlockExtraFeatures",
    "CacheSaltKey",
    "ExtraKeys",
    "LoRAKey",
    "MMHash",
    "MultiModalKey",
    "PlaceholderRange",
    "PromptEmbedsKey",
    "TypedExtraKey",
    "UnplacedExtraKeyError",
    "compute_block_extra_features",
    "parse_raw_extra_keys",
    "realign_extra_features",
    "split_extra_keys",
]

#: Prefix of the identifier a prompt-embedding digest becomes (followed by the digest in hex).
PROMPT_EMBEDS_PREFIX = "prompt_embeds:"


@dataclass(frozen=True, slots=True)
class MMHash:
    """The identifier (content hash) of one multimodal item overlapping a block."""

    hash: str

    def __post_init__(self) -> None:
        if not isinstance(self.hash, str):
            raise InvalidInputError(f"MMHash.hash must be a str, got {type(self.hash).__name__}")
        try:
            self.hash.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(f"MMHash.hash is not encodable as UTF-8: {exc}") from None


@dataclass(frozen=True, slots=True)
class BlockExtraFeatures:
    """Per-block extra data that taints the block hash: the overlapping items, in start order.

    Instances compare by value. They hold a list, so they are not hashable. A block with an empty
    ``mm_hashes`` list hashes exactly like a text block (``None``).
    """

    mm_hashes: list[MMHash]

    def __post_init__(self) -> None:
        if not isinstance(self.mm_hashes, list):
            raise InvalidInputError(
                f"BlockExtraFeatures.mm_hashes must be a list, got {type(self.mm_hashes).__name__}"
            )
        for item in self.mm_hashes:
            if not isinstance(item, MMHash):
                raise InvalidInputError(
                    "BlockExtraFeatures.mm_hashes must hold MMHash values, "
                    f"got {type(item).__name__}"
                )


def _check_nonneg_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"PlaceholderRange.{name} must be an int, got {value!r}")
    if value < 0:
        raise InvalidInputError(f"PlaceholderRange.{name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """The placeholder tokens of one multimodal item: ``[offset, offset + length)``, absolute."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        _check_nonneg_int("offset", self.offset)
        _check_nonneg_int("length", self.length)


def compute_block_extra_features(
    mm_hashes: Mapping[str, Sequence[str]],
    mm_placeholders: Mapping[str, Sequence[PlaceholderRange]],
    block_size: int,
    num_tokens: int,
) -> list[BlockExtraFeatures | None] | None:
    """Per full block, the identifiers of the multimodal items whose placeholders overlap it.

    Each modality's hashes are paired with its placeholder ranges by position (pairs beyond the
    shorter of the two lists are dropped; a modality without ranges contributes nothing). All
    pairs are sorted by start offset (stably, so equal starts keep modality then list order).
    Block ``i`` covers tokens ``[i * block_size, (i + 1) * block_size)`` and there are
    ``num_tokens // block_size`` of them; a block gets the identifiers of every item whose range
    ``[offset, offset + length)`` intersects it, in start order, or ``None`` when there is none.
    As in the Go ``ComputeBlockExtraFeatures``, an item overlaps a block when it ends after the
    block's start and starts before its end, so a zero-length range strictly inside a block
    (``block_start < offset < block_end``) is kept for that block, and one starting on a block
    boundary belongs to no block.

    Returns ``None`` when there are no hashes (or no pairs), ``block_size <= 0`` or
    ``num_tokens <= 0``.
    """
    for name, value in (("block_size", block_size), ("num_tokens", num_tokens)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"{name} must be an int, got {value!r}")
    for name, mapping in (("mm_hashes", mm_hashes), ("mm_placeholders", mm_placeholders)):
        if mapping is not None and not isinstance(mapping, Mapping):
            raise InvalidInputError(
                f"{name} must be a dict keyed by modality, got {type(mapping).__name__}"
            )
    if not mm_hashes or not mm_placeholders or block_size <= 0 or num_tokens <= 0:
        return None
    items: list[tuple[int, int, str]] = []
    for modality, hashes in mm_hashes.items():
        if isinstance(hashes, (str, bytes)):
            raise InvalidInputError(
                f"mm_hashes[{modality!r}] must be a list of identifiers, "
                f"got {type(hashes).__name__}"
            )
        ranges = mm_placeholders.get(modality)
        if not ranges:
            continue
        for identifier, rng in zip(hashes, ranges, strict=False):
            if not isinstance(identifier, str):
                raise InvalidInputError(
                    f"mm_hashes[{modality!r}] must hold str identifiers, "
                    f"got {type(identifier).__name__}"
                )
            if not isinstance(rng, PlaceholderRange):
                raise InvalidInputError(
                    f"mm_placeholders[{modality!r}] must hold PlaceholderRange values, "
                    f"got {type(rng).__name__}"
                )
            items.append((rng.offset, rng.offset + rng.length, identifier))
    if not items:
        return None
    items.sort(key=lambda item: item[0])

    num_blocks = num_tokens // block_size
    result: list[BlockExtraFeatures | None] = [None] * num_blocks
    first = 0  # items before `first` end at or before the current block: never needed again
    for block_idx in range(num_blocks):
        block_start = block_idx * block_size
        block_end = block_start + block_size
        hits: list[MMHash] = []
        for idx in range(first, len(items)):
            start, end, identifier = items[idx]
            if start >= block_end:
                break
            if end > block_start:
                hits.append(MMHash(identifier))
            elif idx == first:
                first += 1
        if hits:
            result[block_idx] = BlockExtraFeatures(hits)
    return result


def parse_raw_extra_keys(
    raw: Sequence[Sequence[Any] | None] | None,
) -> list[BlockExtraFeatures | None] | None:
    """Turn a ``BlockStored`` event's ``extra_keys`` into per-block features.

    Each block's elements are bare string identifiers (current vLLM) or legacy
    ``[identifier, offset]`` pairs (a list or tuple whose first element is a string; the offset is
    ignored). Other elements (LoRA names, cache salts, numbers) are skipped. A ``None`` block, or
    one without identifiers, becomes ``None``. ``raw=None`` returns ``None``.
    """
    if raw is None:
        return None
    if isinstance(raw, (str, bytes, bytearray)) or not isinstance(raw, Sequence):
        raise InvalidInputError(
            f"extra_keys must be a list of per-block lists, got {type(raw).__name__}"
        )
    result: list[BlockExtraFeatures | None] = []
    for block_idx, block in enumerate(raw):
        if block is None:
            result.append(None)
            continue
        if isinstance(block, (str, bytes, bytearray)) or not isinstance(block, Sequence):
            raise InvalidInputError(
                f"extra_keys[{block_idx}] must be a list or None, got {type(block).__name__}"
            )
        hashes: list[MMHash] = []
        for element in block:
            if isinstance(element, str):
                hashes.append(MMHash(element))
            elif isinstance(element, (list, tuple)) and element and isinstance(element[0], str):
                hashes.append(MMHash(element[0]))
        result.append(BlockExtraFeatures(hashes) if hashes else None)
    return result


@slot_init
@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What a ``BlockStored`` event's ``extra_keys`` say, decoded (see :func:`split_extra_keys`)."""

    features: list[BlockExtraFeatures | None] | None
    """Per engine block, the identifiers that taint its hash; ``None`` when no block has one."""
    cache_salt: str | None = None
    """The salt of the request that stored the chain (first block of a chain only)."""


NO_EXTRA_KEYS = ExtraKeys(None)
"""What an event without ``extra_keys`` says: no features, no salt (one object, immutable)."""


class UnplacedExtraKeyError(InvalidInputError):
    """An extra key kvredis cannot place in the block keys (a LoRA that is not the event's, a
    salt off the first block of a chain, a key vLLM itself could not classify): the event is
    refused rather than hashed as if the key were not there."""


@dataclass(frozen=True, slots=True)
class MultiModalKey:
    """Typed extra key ``mm``: a multimodal item the block holds tokens of.

    ``hash`` is the item's hash as the engine's renderer computed it (vLLM: ``mm_hashes``, the
    identifier without a LoRA prefix); ``block_offset`` is where the item's tokens start relative
    to the block (negative when the item began in an earlier block). The block's features hold
    ``MMHash(hash)``, as an untyped ``[identifier, offset]`` pair's identifier.
    """

    modality: str
    hash: str
    block_offset: int


@dataclass(frozen=True, slots=True)
class LoRAKey:
    """Typed extra key ``lora``: the adapter the block was computed with (the event's
    ``lora_name``, under which it is hashed as the model; not a feature)."""

    name: str


@dataclass(frozen=True, slots=True)
class CacheSaltKey:
    """Typed extra key ``cache_salt``: the request's salt (first block of a request only)."""

    salt: str


@dataclass(frozen=True, slots=True)
class PromptEmbedsKey:
    """Typed extra key ``prompt_embeds``: the digest of the prompt embeddings the block covers
    (a feature ``PROMPT_EMBEDS_PREFIX + hash.hex()``, as an untyped ``bytes`` item)."""

    hash: bytes


TypedExtraKey = MultiModalKey | LoRAKey | CacheSaltKey | PromptEmbedsKey
"""The typed extra keys kvredis places (vLLM's ``legacy`` wrapper and unknown tags it refuses)."""
_TYPED = (MultiModalKey, LoRAKey, CacheSaltKey, PromptEmbedsKey)


def _split_typed(
    blocks: list[Sequence[Any]], lora_name: str | None, chain_start: bool
) -> ExtraKeys:
    """:func:`split_extra_keys` for typed keys: each is placed by its type, never by position;
    a key that cannot be placed raises :class:`UnplacedExtraKeyError`."""
    salt: str | None = None
    result: list[BlockExtraFeatures | None] = []
    for block_idx, items in enumerate(blocks):
        hashes: list[MMHash] = []
        for item in items:
            if isinstance(item, MultiModalKey):
                hashes.append(MMHash(item.hash))
            elif isinstance(item, PromptEmbedsKey):
                hashes.append(MMHash(PROMPT_EMBEDS_PREFIX + bytes(item.hash).hex()))
            elif isinstance(item, LoRAKey):
                if item.name != lora_name:
                    raise UnplacedExtraKeyError(
                        f"extra_keys[{block_idx}] names LoRA {item.name!r} but the event's "
                        f"lora_name is {lora_name!r}: its blocks cannot be hashed under either"
                    )
            elif isinstance(item, CacheSaltKey):
                if not chain_start or block_idx != 0 or salt is not None:
                    raise UnplacedExtraKeyError(
                        f"extra_keys[{block_idx}] carries a cache salt off the first block of a "
                        "chain: a salt isolates a chain from its root, nowhere else"
                    )
                salt = item.salt
            else:
                raise UnplacedExtraKeyError(
                    f"extra_keys[{block_idx}] mixes typed and untyped items "
                    f"({type(item).__name__}): the untyped ones cannot be placed"
                )
        result.append(BlockExtraFeatures(hashes) if hashes else None)
    if all(f is None for f in result):
        return ExtraKeys(None, salt)
    return ExtraKeys(result, salt)


def _block_items(block_idx: int, block: object) -> Sequence[Any]:
    if block is None:
        return ()
    if isinstance(block, (str, bytes, bytearray)) or not isinstance(block, Sequence):
        raise InvalidInputError(
            f"extra_keys[{block_idx}] must be a list or None, got {type(block).__name__}"
        )
    return block


def split_extra_keys(
    raw: Sequence[Sequence[Any] | None] | None,
    *,
    lora_name: str | None = None,
    chain_start: bool = False,
) -> ExtraKeys:
    """Decode a ``BlockStored`` event's ``extra_keys``, each item by its shape.

    vLLM 0.34 publishes per engine block a list holding, in this order: the LoRA name (a bare
    string, when the event has a ``lora_name``), the multimodal items overlapping the block as
    ``[identifier, offset]`` pairs, the request's cache salt (a bare string, first block of a
    request only) and prompt-embedding digests (``bytes``). Items are read as:

    * a bare string equal to ``lora_name`` at the head of a block: the LoRA, *not* a feature
      (the event is hashed under the adapter's name as the model, which already separates it);
    * a list or tuple whose first element is a string (``[identifier, offset]``, or the legacy
      tuples older engines and the upstream parser accept): a multimodal identifier;
    * ``bytes``: a prompt-embedding digest, kept as the identifier
      ``PROMPT_EMBEDS_PREFIX + digest.hex()``: blocks fed from embeddings hash apart from text
      blocks with the same placeholder token ids (a wrong hit there would serve another
      prompt's KV), and a router that knows the digests can pass the same identifiers;
    * the cache salt: with ``chain_start`` (the event starts a chain: no parent), the last bare
      string of the first block, unless later blocks hold bare strings too (then the event uses
      the legacy bare-identifier shape, where an image runs on into the next block); it goes to
      :attr:`ExtraKeys.cache_salt`, not into the features;
    * any other bare string: a multimodal identifier (older vLLM published bare identifiers);
    * anything else (numbers, ``None``): ignored.

    One case stays ambiguous: an old-style bare identifier that appears only in the first block
    of a chain's first event reads as a salt. Both isolate the prefix; only the key differs.

    Typed keys (vLLM's ``event_version`` 1 schema, decoded by
    :func:`kvredis.ingest.events.decode_batch`) need no guessing: :class:`MultiModalKey` and
    :class:`PromptEmbedsKey` are features of their block, :class:`LoRAKey` must name the event's
    ``lora_name``, :class:`CacheSaltKey` may only be on the first block of a chain start; a typed
    key anywhere else, or untyped items mixed with typed ones, raise
    :class:`UnplacedExtraKeyError`.
    """
    if raw is None:
        return NO_EXTRA_KEYS
    if isinstance(raw, (str, bytes, bytearray)) or not isinstance(raw, Sequence):
        raise InvalidInputError(
            f"extra_keys must be a list of per-block lists, got {type(raw).__name__}"
        )
    blocks = [_block_items(i, block) for i, block in enumerate(raw)]
    if any(isinstance(item, _TYPED) for items in blocks for item in items):
        return _split_typed(blocks, lora_name, chain_start)

    def is_lora(i: int, item: object) -> bool:
        return i == 0 and bool(lora_name) and item == lora_name

    bare = [
        [i for i, item in enumerate(items) if isinstance(item, str) and not is_lora(i, item)]
        for items in blocks
    ]
    salt_at: tuple[int, int] | None = None
    if chain_start and bare and bare[0] and not any(bare[1:]):
        salt_at = (0, bare[0][-1])
    salt: str | None = None
    result: list[BlockExtraFeatures | None] = []
    for block_idx, items in enumerate(blocks):
        hashes: list[MMHash] = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                if is_lora(i, item):
                    continue
                if salt_at == (block_idx, i):
                    salt = item
                    continue
                hashes.append(MMHash(item))
            elif isinstance(item, (bytes, bytearray)):
                hashes.append(MMHash(PROMPT_EMBEDS_PREFIX + bytes(item).hex()))
            elif isinstance(item, (list, tuple)) and item and isinstance(item[0], str):
                hashes.append(MMHash(item[0]))
        result.append(BlockExtraFeatures(hashes) if hashes else None)
    if all(f is None for f in result):
        return ExtraKeys(None, salt or None)
    return ExtraKeys(result, salt or None)


def realign_extra_features(
    features: Sequence[BlockExtraFeatures | None] | None, blocks: int
) -> list[BlockExtraFeatures | None] | None:
    """Realign per-engine-block features to ``blocks`` of our blocks.

    Fewer engine blocks than ours (1:many) replicates each engine block's features to its
    sub-blocks. More (many:1) concatenates the identifiers of the engine blocks inside each of
    ours, in order, counting an item that continues from one engine block into the next once
    (the longest run ending the previous block's list that also starts the next one's), so an
    image spanning engine blocks appears once, as the router-side features list it, while two
    copies of one image inside a block stay two. Returns ``None`` when no block carries an
    identifier.
    """
    if not features or blocks <= 0:
        return None
    n_engine = len(features)
    out: list[BlockExtraFeatures | None]
    if n_engine == blocks:
        out = list(features)
    elif n_engine < blocks:
        out = [features[i * n_engine // blocks] for i in range(blocks)]
    else:
        merged: list[list[MMHash]] = [[] for _ in range(blocks)]
        prev_target, prev_ids = -1, cast("list[MMHash]", [])
        for i, feat in enumerate(features):
            target = i * blocks // n_engine
            ids = feat.mm_hashes if feat is not None else []
            skip = _continued(prev_ids, ids) if target == prev_target else 0
            merged[target].extend(ids[skip:])
            prev_target, prev_ids = target, ids
        out = [BlockExtraFeatures(m) if m else None for m in merged]
    if all(f is None or not f.mm_hashes for f in out):
        return None
    return out


def _continued(acc: Sequence[MMHash], ids: Sequence[MMHash]) -> int:
    """Length of the longest suffix of ``acc`` that is a prefix of ``ids``."""
    for size in range(min(len(acc), len(ids)), 0, -1):
        if list(acc[-size:]) == list(ids[:size]):
            return size
    return 0

"""Value types of the kvblock model: block hashes, key types, pod entries, KV-cache group metadata.

Values only: frozen, hashable, validated on construction. Stateful holders live elsewhere
(:class:`~kvredis.groups.GroupCatalog`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvredis.errors import InvalidInputError

MAX_BLOCK_HASH = (1 << 64) - 1
#: The largest data-parallel rank (``PodEntry.dp_rank``) an entry holds.
MAX_DP_RANK = (1 << 31) - 1


class BlockHash(int):
    """A 64-bit block hash: an ``int`` in ``[0, 2**64)``; its ``str`` is the unsigned decimal."""

    __slots__ = ()

    def __new__(cls, value: int) -> BlockHash:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"block hash must be an int, got {type(value).__name__}")
        if not 0 <= value <= MAX_BLOCK_HASH:
            raise InvalidInputError(f"block hash must be in [0, 2**64), got {value}")
        return super().__new__(cls, value)

    def __repr__(self) -> str:
        return f"BlockHash({int(self)})"

    def __str__(self) -> str:
        return int.__repr__(self)


EMPTY_BLOCK_HASH = BlockHash(0)


class KeyType(enum.Enum):
    """Which key space a key passed to ``Index.evict`` belongs to."""

    ENGINE = "engine"
    REQUEST = "request"


@dataclass(frozen=True, slots=True)
class PodEntry:
    """One holder of a block: a pod, on a device tier, optionally speculative, optionally grouped,
    held by one data-parallel rank of the pod.

    Equality and hashing cover all six fields. ``group_idx`` is meaningful only with
    ``has_group=True`` (hybrid-memory-allocator KV-cache groups). ``dp_rank`` is the
    data-parallel rank holding the copy (0: rank 0, or a pod without data parallelism): the
    ranks of a pod hold their copies on their own, so each rank's copy is an entry of its own,
    while filters and ``clear`` work on ``pod_identifier`` and so cover every rank; a score takes
    each rank on its own (a pod scores its best rank's).
    """

    pod_identifier: str
    device_tier: str = ""
    speculative: bool = False
    has_group: bool = False
    group_idx: int = 0
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.pod_identifier, str):
            raise InvalidInputError(
                f"pod_identifier must be a str, got {type(self.pod_identifier).__name__}"
            )
        if not isinstance(self.device_tier, str):
            raise InvalidInputError(
                f"device_tier must be a str, got {type(self.device_tier).__name__}"
            )
        if not isinstance(self.speculative, bool) or not isinstance(self.has_group, bool):
            raise InvalidInputError("speculative and has_group must be bools")
        if isinstance(self.group_idx, bool) or not isinstance(self.group_idx, int):
            raise InvalidInputError(f"group_idx must be an int, got {self.group_idx!r}")
        if not 0 <= self.group_idx < (1 << 31):
            raise InvalidInputError(f"group_idx must be in [0, 2**31), got {self.group_idx}")
        if isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int):
            raise InvalidInputError(f"dp_rank must be an int, got {self.dp_rank!r}")
        if not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise InvalidInputError(f"dp_rank must be in [0, 2**31), got {self.dp_rank}")

    def __str__(self) -> str:
        text = f"{self.pod_identifier}@{self.device_tier}"
        if self.speculative:
            text += "[speculative]"
        if self.has_group:
            text += f"[group={self.group_idx}]"
        if self.dp_rank:
            text += f"[dp={self.dp_rank}]"
        return text


@dataclass(frozen=True, slots=True)
class GroupMetadata:
    """What a pod reported about one of its KV-cache groups (kind, block size, sliding window)."""

    kind: str
    block_size: int
    sliding_window_size: int | None = None


#: Request keys (or engine keys) in chain order, as the index methods take them.
Keys = Sequence[int]
#: A pod filter: the pod identifiers a lookup considers, ``None`` for every pod.
Pods = Collection[str] | None
#: Pod entries, as adds and evicts take them.
Entries = Sequence[PodEntry]
#: What a lookup returns: request key -> the entries holding it, in chain order.
Lookup = dict[int, list[PodEntry]]

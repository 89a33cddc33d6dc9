"""The input checks every index backend applies, so all of them refuse the same inputs alike.

Also the engine-to-request key pairing rule (:func:`infer_mappings`) and the per-engine-key cap,
which are part of the contract every backend keeps.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvredis.errors import InvalidInputError
from kvredis.types import MAX_BLOCK_HASH, KeyType, PodEntry

#: Most request keys remembered per engine key (every backend); older mappings are dropped.
MAX_REQUEST_KEYS_PER_ENGINE_KEY = 1024


def check_hash(value: object, what: str = "block hash") -> int:
    """Return ``value`` as an int if it is a valid 64-bit unsigned hash, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_BLOCK_HASH:
        raise InvalidInputError(f"{what} must be in [0, 2**64), got {value}")
    return int(value)


_INT_ONLY = frozenset((int,))


def plain_hashes(values: list[int] | tuple[int, ...]) -> bool:
    """Whether every element of a list or tuple is a plain ``int`` (no ``bool``) in the 64-bit
    hash range, checked at C speed."""
    return _INT_ONLY.issuperset(map(type, values)) and (
        not values or (min(values) >= 0 and max(values) <= MAX_BLOCK_HASH)
    )


def check_hashes(values: Sequence[int], what: str = "block hash") -> list[int]:
    """Validate a sequence of 64-bit hashes (see :func:`check_hash`)."""
    if isinstance(values, (list, tuple)) and plain_hashes(values):
        return list(values)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidInputError(
            f"{what} list must be a sequence of ints, got {type(values).__name__}"
        )
    return [check_hash(v, what) for v in values]


def check_entries(entries: Sequence[PodEntry], *, for_add: bool = False) -> list[PodEntry]:
    """Validate a non-empty sequence of pod entries.

    With ``for_add`` the pod identifier must be non-empty (an entry that cannot be named cannot
    be filtered, scored or cleared later), and so must the device tier unless the entry is
    speculative: the llm-d scorer adds ``PodEntry(pod, speculative=True)`` with no tier for a
    request it just routed, and later evicts it by request key.
    """
    if isinstance(entries, PodEntry):
        raise InvalidInputError("entries must be a sequence of PodEntry, got a single PodEntry")
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise InvalidInputError(
            f"entries must be a sequence of PodEntry, got {type(entries).__name__}"
        )
    out = list(entries)
    if not out:
        raise InvalidInputError("no pod entries given: pass at least one PodEntry")
    for entry in out:
        if not isinstance(entry, PodEntry):
            raise InvalidInputError(f"entries must be PodEntry values, got {type(entry).__name__}")
        if for_add and not entry.pod_identifier:
            raise InvalidInputError(
                f"pod entry {entry!r} has an empty pod identifier; it must be a non-empty string"
            )
        if for_add and not entry.device_tier and not entry.speculative:
            raise InvalidInputError(
                f"pod entry {entry!r} has an empty device tier; only speculative entries may "
                "have none"
            )
    return out


def check_add(
    engine_keys: Sequence[int] | None, request_keys: Sequence[int], entries: Sequence[PodEntry]
) -> tuple[list[int] | None, list[int], list[PodEntry]]:
    """Validate the arguments of ``Index.add`` and return them as lists."""
    req = check_hashes(request_keys, "request key")
    if not req:
        raise InvalidInputError("no request keys given: add needs at least one request key")
    eng = None if engine_keys is None else check_hashes(engine_keys, "engine key")
    return eng, req, check_entries(entries, for_add=True)


#: Longest TTL of a speculative entry, in seconds (30 days).
MAX_TTL = 30 * 24 * 3600.0


def check_ttl(ttl: object, entries: Sequence[PodEntry]) -> float | None:
    """Validate the ``ttl`` of ``Index.add``: ``None``, or seconds (finite, > 0, at most
    :data:`MAX_TTL`) for entries that are all speculative (confirmed entries never expire)."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise InvalidInputError(f"ttl must be a number of seconds or None, got {ttl!r}")
    value = float(ttl)
    if not math.isfinite(value) or value <= 0 or value > MAX_TTL:
        raise InvalidInputError(f"ttl must be finite, > 0 and at most {MAX_TTL:g} s, got {ttl!r}")
    for entry in entries:
        if not entry.speculative:
            raise InvalidInputError(
                f"ttl given for the confirmed entry {entry!r}: only speculative entries expire"
            )
    return value


def check_key_type(key_type: object) -> KeyType:
    """Validate an evict key type."""
    if not isinstance(key_type, KeyType):
        raise InvalidInputError(
            f"key_type must be KeyType.ENGINE or KeyType.REQUEST, got {key_type!r}"
        )
    return key_type


def check_pod_identifier(pod_identifier: object) -> str:
    """Validate the pod identifier of ``Index.clear``: a non-empty str."""
    if not isinstance(pod_identifier, str) or not pod_identifier:
        raise InvalidInputError(f"pod_identifier must be a non-empty str, got {pod_identifier!r}")
    return pod_identifier


@dataclass(frozen=True, slots=True)
class EntrySelection:
    """Which of a pod's entries a selective clear removes (``None``: any value)."""

    device_tiers: frozenset[str] | None = None
    dp_rank: int | None = None

    def matches(self, entry: PodEntry) -> bool:
        """Whether ``entry`` (of the pod being cleared) is selected."""
        if self.device_tiers is not None and entry.device_tier not in self.device_tiers:
            return False
        return self.dp_rank is None or entry.dp_rank == self.dp_rank


def check_selection(device_tiers: object, dp_rank: object) -> EntrySelection:
    """Validate the filters of ``clear_entries``: a collection of tier strs (or ``None``) and
    a rank in ``[0, 2**31)`` (or ``None``)."""
    tiers: frozenset[str] | None = None
    if device_tiers is not None:
        if isinstance(device_tiers, (str, bytes)) or not isinstance(device_tiers, Iterable):
            raise InvalidInputError(
                "device_tiers must be a collection of tier names (or None), got "
                f"{type(device_tiers).__name__}"
            )
        tiers = frozenset(device_tiers)
        if not all(isinstance(t, str) for t in tiers):
            raise InvalidInputError(f"device_tiers must hold strs, got {sorted(map(repr, tiers))}")
    if dp_rank is not None and (
        isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < 1 << 31
    ):
        raise InvalidInputError(f"dp_rank must be an int in [0, 2**31) or None, got {dp_rank!r}")
    return EntrySelection(tiers, dp_rank)


def pod_filter(pod_identifier_set: Collection[str] | None) -> frozenset[str] | None:
    """Normalize a lookup filter: ``None`` or empty means every pod."""
    if not pod_identifier_set:
        return None
    if isinstance(pod_identifier_set, str):
        raise InvalidInputError("pod_identifier_set must be a collection of pod ids, not a str")
    if not isinstance(pod_identifier_set, Iterable):
        raise InvalidInputError(
            "pod_identifier_set must be a collection of pod ids, got "
            f"{type(pod_identifier_set).__name__}"
        )
    return frozenset(pod_identifier_set)


def infer_mappings(
    engine_keys: Sequence[int], request_keys: Sequence[int]
) -> list[tuple[int, int]]:
    """Engine-to-request key pairs inferred from the length ratio (1:1, many:1 and 1:many).

    With ``n = max(len(e), len(r))``, position ``i`` in ``range(n)`` maps
    ``e[i * len(e) // n]`` to ``r[i * len(r) // n]``. Either list empty gives no pairs.
    """
    ne, nr = len(engine_keys), len(request_keys)
    if ne == 0 or nr == 0:
        return []
    n = max(ne, nr)
    return [(engine_keys[i * ne // n], request_keys[i * nr // n]) for i in range(n)]

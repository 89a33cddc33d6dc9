"""The bounds of the embedded indexes: their configs (key counts, a byte budget) and the byte-cost
model :class:`~kvredis.memory.CostAwareMemoryIndex` keeps its budget with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvredis.errors import ConfigError
from kvredis.jsonconfig import parse_size, take_fields
from kvredis.types import PodEntry

__all__ = [
    "ENTRY_COST",
    "KEY_COST",
    "MAPPING_COST",
    "MAPPING_REF_COST",
    "RUN_COST",
    "RUN_KEY_COST",
    "RUN_MAPPING_COST",
    "RUN_POSITION_COST",
    "CostAwareMemoryIndexConfig",
    "InMemoryIndexConfig",
    "estimated_entry_cost",
]

# Byte-cost estimate of the cost-aware index: what the structures below take on 64-bit CPython
# 3.11, measured with tracemalloc, counting the ints of the keys (the index keeps them). Dict
# tables grow in powers of two, so the true figure swings with the number of keys: for chains
# stored as runs, 10k-200k keys and 1-8 pods, the estimate is within -11%/+15% of what is
# allocated (scripts/bench_memory.py reports it, tests/test_memory.py checks it).
#: A request key kept inline: its int and its slots in the LRU dict and the last-use dict.
KEY_COST = 152
#: One entry under one request key (its 8 bytes in the entry's key log, and its slot in the
#: key's tuple where that tuple is not shared along a chain), plus the length of its two strings
#: (see estimated_entry_cost).
ENTRY_COST = 16
#: An engine key in the engine table: its int and its slots in the LRU dict and the last-use
#: dict.
MAPPING_COST = 136
#: One request key remembered by an engine key.
MAPPING_REF_COST = 24
#: A run (:mod:`kvredis.memory.runs`): the object, its lists, ranges and counts, whatever its
#: length.
RUN_COST = 800
#: A position of a run, for the run's whole life: its slot in the key list and the key's int.
RUN_POSITION_COST = 44
#: A run position that holds entries: its key's slot in the table of keys in runs.
RUN_KEY_COST = 40
#: An engine key kept in a run: its int and its table slot (its list slot, 8 bytes a position,
#: is charged with the run's first engine key).
RUN_MAPPING_COST = 76


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class InMemoryIndexConfig:
    """Bounds of :class:`~kvredis.memory.InMemoryIndex`: request keys kept, entries kept per key."""

    size: int = 100_000_000
    pod_cache_size: int = 10

    def __post_init__(self) -> None:
        _positive_int("size", self.size)
        _positive_int("pod_cache_size", self.pod_cache_size)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> InMemoryIndexConfig:
        """Build from the upstream JSON shape (``size``, ``podCacheSize``)."""
        fields = {"size": "size", "podCacheSize": "pod_cache_size"}
        return cls(**take_fields("inMemoryConfig", mapping, fields))


@dataclass(frozen=True, slots=True)
class CostAwareMemoryIndexConfig:
    """Budget of :class:`~kvredis.memory.CostAwareMemoryIndex`: a human size (``"2GiB"``) or
    bytes."""

    size: int | str = "2GiB"

    def __post_init__(self) -> None:
        parse_size(self.size)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> CostAwareMemoryIndexConfig:
        """Build from the upstream JSON shape (``size``)."""
        return cls(**take_fields("costAwareMemoryConfig", mapping, {"size": "size"}))

    def max_cost(self) -> int:
        """The budget in bytes."""
        return parse_size(self.size)


def estimated_entry_cost(entry: PodEntry) -> int:
    """Estimated bytes of one entry stored under one request key (strings counted in full)."""
    return ENTRY_COST + len(entry.pod_identifier) + len(entry.device_tier)

"""The engine-key table of the embedded indexes: engine key -> the request keys it maps to.

Engines name blocks by their own hashes (engine keys); an add records which request keys each
engine key stands for, an evict by engine key and ``get_request_key`` read it back. The table
keeps, per engine key, its most recent request keys (at most
:data:`~kvredis.checks.MAX_REQUEST_KEYS_PER_ENGINE_KEY`, oldest first; one is stored as a bare
int, several as a tuple), in least-recently-used order, with the last-use tick of every key
where the index weighs engine keys against request keys, and its share of the byte estimate
(:data:`~kvredis.memory.bounds.MAPPING_COST` per engine key,
:data:`~kvredis.memory.bounds.MAPPING_REF_COST` per request key remembered).

Not thread-safe on its own: the index calls it with its lock held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvredis.checks import MAX_REQUEST_KEYS_PER_ENGINE_KEY, infer_mappings
from kvredis.memory.bounds import MAPPING_COST, MAPPING_REF_COST

__all__ = ["EngineTable", "refs"]

#: What the table holds per engine key: one request key, or several (oldest first).
Refs = int | tuple[int, ...]


def refs(value: Refs) -> tuple[int, ...]:
    """The request keys of a stored value, oldest first."""
    return (value,) if type(value) is int else value  # type: ignore[return-value]


class EngineTable:
    """Engine key -> request key(s), in least-recently-used order (see the module docstring).

    ``cost`` is the estimated bytes of the table; ``ticks`` (engine key -> last-use tick)
    exists only when built with ``track_ticks``.
    """

    __slots__ = ("_map", "cost", "ticks")

    def __init__(self, *, track_ticks: bool = False) -> None:
        self._map: OrderedDict[int, Refs] = OrderedDict()
        self.ticks: dict[int, int] | None = {} if track_ticks else None
        self.cost = 0

    def __len__(self) -> int:
        return len(self._map)

    def get(self, engine_key: int) -> Refs | None:
        """What the table holds for ``engine_key``, without counting it as used."""
        return self._map.get(engine_key)

    def disjoint(self, engine_keys: Iterable[int]) -> bool:
        """Whether the table holds none of ``engine_keys``."""
        return self._map.keys().isdisjoint(engine_keys)

    def keys(self) -> list[int]:
        """A snapshot of the engine keys, least recently used first."""
        return list(self._map)

    def oldest(self) -> int | None:
        """The least recently used engine key, if any."""
        return next(iter(self._map), None)

    def resolve(self, engine_key: int, tick: int) -> Refs | None:
        """What the table holds for ``engine_key``, counting it as used at ``tick``."""
        value = self._map.get(engine_key)
        if value is not None:
            self._map.move_to_end(engine_key)
            if self.ticks is not None:
                self.ticks[engine_key] = tick
        return value

    def map_all(self, eng: Sequence[int], req: Sequence[int], tick: int) -> None:
        """Record the engine->request mappings of an add (pairwise when the lengths match,
        else as :func:`~kvredis.checks.infer_mappings` pairs them), all used at ``tick``."""
        table = self._map
        if len(eng) == len(req) and table.keys().isdisjoint(eng):  # new engine keys
            before = len(table)
            table.update(zip(eng, req, strict=True))  # one C-level update
            if len(table) - before == len(eng):
                self.cost += (MAPPING_COST + MAPPING_REF_COST) * len(eng)
                if self.ticks is not None:
                    self.ticks.update(dict.fromkeys(eng, tick))
                return
            for engine_key in eng:  # an engine key repeated: undo, then pair by pair
                table.pop(engine_key, None)
        pairs = zip(eng, req, strict=True) if len(eng) == len(req) else infer_mappings(eng, req)
        self.map_pairs(pairs, tick)

    def map_pairs(self, pairs: Iterable[tuple[int, int]], tick: int) -> None:
        """Record (engine key, request key) pairs, in order, all used at ``tick``."""
        table = self._map
        get, touch = table.get, table.move_to_end
        ticks = self.ticks
        for engine_key, request_key in pairs:
            value = get(engine_key)
            if value is None:
                table[engine_key] = request_key
                self.cost += MAPPING_COST + MAPPING_REF_COST
            else:
                touch(engine_key)
                if value != request_key:
                    self._remap(engine_key, value, request_key)
            if ticks is not None:
                ticks[engine_key] = tick

    def put(self, engine_key: int, value: Refs, tick: int) -> None:
        """Hold ``value`` for an engine key the table does not hold, used at ``tick``."""
        self._map[engine_key] = value
        self.cost += MAPPING_COST + MAPPING_REF_COST * len(refs(value))
        if self.ticks is not None:
            self.ticks[engine_key] = tick

    def _remap(self, engine_key: int, value: Refs, request_key: int) -> None:
        """Make ``request_key`` the most recent of an engine key's request keys."""
        held = refs(value)
        if held[-1] == request_key:
            return
        if request_key in held:
            held = tuple([r for r in held if r != request_key])
        else:
            self.cost += MAPPING_REF_COST
            if len(held) >= MAX_REQUEST_KEYS_PER_ENGINE_KEY:
                held = held[1:]
                self.cost -= MAPPING_REF_COST
        self._map[engine_key] = (*held, request_key)

    def drop(self, engine_key: int) -> None:
        """Forget an engine key (it must be in the table)."""
        value = self._map.pop(engine_key)
        self.cost -= MAPPING_COST + MAPPING_REF_COST * len(refs(value))
        if self.ticks is not None:
            del self.ticks[engine_key]

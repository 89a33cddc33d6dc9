"""Write programs: the ops of adds, evicts and batches encoded for the ``add``, ``evict`` and
``apply_batch`` scripts (``lua/includes/program.lua``), their cost in units of work, and the
split of a write into calls that stay within :data:`CALL_BUDGET`."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvredis.batch import AddOp, IndexOp
from kvredis.checks import (
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    infer_mappings,
)
from kvredis.redis.codec import (
    HASH_WIDTH,
    blob_hashes,
    encode_entry,
    hash_blob,
    hash_field,
)
from kvredis.redis.layout import Layout
from kvredis.redis.requests import (
    Arg,
)
from kvredis.types import Entries, Keys, KeyType, PodEntry

#: The work one script call may do, in units of about one request key written (10-25 µs on a
#: small machine, so a call stays within about 25 ms; ``scripts/bench_hardening.py`` measures
#: the longest call): adds and batches larger than this are sent in parts, so no call blocks
#: the server for long whatever the input size.
CALL_BUDGET = 1024
#: Units of one engine -> request key mapping (as a request key: a long mapping list, whose
#: rewrite costs more, is counted by the server, which refuses a call over its work limit
#: before any write: ``lua/includes/writes.lua``).
PAIR_COST = 1
#: Units of an evict by engine key (its usual one request key; an engine key mapped to many
#: more is counted by the server, as for :data:`PAIR_COST`).
ENGINE_EVICT_COST = 2


def compress_pairs(pairs: Sequence[tuple[int, int]], cap: int) -> list[tuple[int, int]]:
    """The mappings that decide the outcome of recording ``pairs`` in order.

    An engine key keeps its ``cap`` most recently mapped distinct request keys, so of many pairs
    of one engine key only the last ``cap`` distinct request keys (by last occurrence) matter;
    recording just those, in the same order, leaves the same mapping.
    """
    seen: set[tuple[int, int]] = set()
    counts: dict[int, int] = {}
    kept: list[tuple[int, int]] = []
    for pair in reversed(pairs):
        engine = pair[0]
        if pair in seen or counts.get(engine, 0) >= cap:
            continue
        seen.add(pair)
        counts[engine] = counts.get(engine, 0) + 1
        kept.append(pair)
    kept.reverse()
    return kept


class Program:
    """Builds the op program of add / evict / apply_batch (see ``lua/apply_batch.lua``)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.entries: list[bytes] = []
        self._entry_index: dict[PodEntry, int] = {}
        self.ops: list[Arg] = []
        self.count = 0
        self.cost = 0
        #: the ops as given, to rebuild the program in pieces (:meth:`pieces`)
        self.units: list[Unit] = []

    def entry(self, entry: PodEntry) -> int:
        index = self._entry_index.get(entry)
        if index is None:
            self.entries.append(encode_entry(entry))
            index = self._entry_index[entry] = len(self.entries)
        return index

    def add(
        self,
        request_keys: Keys,
        pairs: Sequence[tuple[int, int]],
        entries: Entries,
        parent: int | None = None,
    ) -> None:
        """An add op; ``parent`` (the request key before the first one in its chain, when
        known) lets the keys join the chain run it ends (a ``"P"`` op; past ``RUN_APPEND_MAX``
        keys only as many as :data:`~kvredis.redis.layout.RUN_APPEND_SHARE` allows, see
        ``docs/design/chain-runs.md``)."""
        if parent is not None and request_keys:
            self.ops += ("P", hash_field(parent))
        else:
            self.ops.append("A")
        self.ops += (len(entries), *(self.entry(e) for e in entries))
        self.ops.append(hash_blob(request_keys))
        self.ops.append(hash_blob([k for pair in pairs for k in pair]))
        self.count += 1
        self.cost += add_cost(len(request_keys), len(pairs), len(entries))
        self.units.append(("A", request_keys, pairs, entries, parent))

    def evict(self, key: int, key_type: KeyType, entries: Entries, first: int = 0) -> None:
        """An evict op; by engine key, of its request keys after the first ``first`` (see
        ``lua/includes/program.lua``)."""
        self.evicts((key,), key_type, list(dict.fromkeys(entries)), first)

    def evicts(
        self, keys: Sequence[int], key_type: KeyType, ents: Sequence[PodEntry], first: int = 0
    ) -> None:
        """:meth:`evict` of each of ``keys`` in turn, all of the same entries (``ents``, without
        duplicates) and kind: their entry indexes worked out once."""
        indexes = (len(ents), *(self.entry(e) for e in ents))
        ops, units = self.ops, self.units
        if key_type is KeyType.REQUEST:
            for key in keys:
                ops += ("R", key.to_bytes(HASH_WIDTH, "big"), *indexes)
                units.append(("R", key, ents))
        else:
            for key in keys:
                ops += ("E", key.to_bytes(HASH_WIDTH, "big"), first, *indexes)
                units.append(("E", key, ents, first))
        self.count += len(keys)
        self.cost += evict_cost(len(ents), key_type) * len(keys)

    def extend(self, units: Sequence[Unit]) -> None:
        """Append the ops ``units`` (another program's :attr:`units`), in order."""
        _fill(self, units)

    def bucket_args(self) -> list[Arg]:
        layout = self.layout
        return [layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits]

    def entry_args(self) -> list[Arg]:
        return [len(self.entries), *self.entries]

    def pieces(self, ops: int = 0, keys: int = 0) -> list[Program]:
        """The program as smaller ones that, applied in order, do the same: of ``ops`` ops
        each; else (``ops`` 0) its first op's request keys in pieces of ``keys`` (its mappings
        with the last), then the other ops; else cut in two. Empty for one op that cannot be
        split (an evict; :func:`~kvredis.redis.ops.op_parts` turns a refused evict by engine
        key into evicts by request key)."""
        units, layout = self.units, self.layout
        if 0 < ops < len(units):
            return [program_of(layout, units[i : i + ops]) for i in range(0, len(units), ops)]
        head = _unit_pieces(units[0], keys) if units else []
        if head:
            rest = [program_of(layout, units[1:])] if len(units) > 1 else []
            return [program_of(layout, [unit]) for unit in head] + rest
        if len(units) < 2:
            return []
        cut = len(units) // 2
        return [program_of(layout, units[:cut]), program_of(layout, units[cut:])]


#: One op of a :class:`Program`: ``("A", request keys, engine/request key pairs, entries[,
#: parent key])``,
#: ``("R", key, entries)`` or ``("E", key, entries[, first])`` for an evict by request or engine
#: key.
Unit = tuple[Any, ...]


def _unit_pieces(unit: Unit, keys: int) -> list[Unit]:
    """An add op as adds of ``keys`` request keys each (in two when ``keys`` is 0), in order,
    its mappings with the last; empty for any other op."""
    if unit[0] != "A" or len(unit[1]) < 2:
        return []
    request_keys, pairs, entries = unit[1:4]
    parent = unit[4] if len(unit) > 4 else None
    step = keys if 0 < keys < len(request_keys) else (len(request_keys) + 1) // 2
    cuts = range(0, len(request_keys), step)
    out: list[Unit] = [
        ("A", request_keys[i : i + step], [], entries, request_keys[i - 1] if i else parent)
        for i in cuts
    ]
    out[-1] = (*out[-1][:2], pairs, *out[-1][3:])
    return out


def engine_evict_units(unit: Unit, mapping: bytes | None) -> list[Unit]:
    """An evict by engine key (``("E", key, entries, first)``) whose engine key maps to
    ``mapping`` (as read) as evicts by request key of its request keys after the first
    ``first``, then the evict by engine key of what follows them (keys mapped since), which
    drops the mapping once none of its request keys holds an entry."""
    _, key, entries, first = unit
    request_keys = blob_hashes(mapping)
    out: list[Unit] = [("R", k, entries) for k in request_keys[first:]]
    return [*out, ("E", key, entries, max(first, len(request_keys)))]


def program_of(layout: Layout, units: Sequence[Unit]) -> Program:
    """A program of ``units`` (:attr:`Program.units`), in order."""
    return _fill(Program(layout), units)


def programs_of(layout: Layout, units: Sequence[Unit], budget: int | None = None) -> list[Program]:
    """``units`` as programs of at most ``budget`` units of work each, in order (at least one
    program; see :class:`Programs`)."""
    return _fill(Programs(layout, budget), units).items


_Filled = TypeVar("_Filled", "Program", "Programs")


def _fill(target: _Filled, units: Sequence[Unit]) -> _Filled:
    for unit in units:
        if unit[0] == "A":
            target.add(unit[1], unit[2], unit[3], unit[4] if len(unit) > 4 else None)
        elif unit[0] == "R":
            target.evict(unit[1], KeyType.REQUEST, unit[2])
        else:
            target.evict(unit[1], KeyType.ENGINE, *unit[2:])
    return target


def add_cost(keys: int, pairs: int, entries: int) -> int:
    """Units of work of an add op (see :data:`CALL_BUDGET`)."""
    return 1 + entries + keys + PAIR_COST * pairs


def evict_cost(entries: int, key_type: KeyType) -> int:
    """Units of work of an evict op (by engine key it rewrites every key it maps to)."""
    return entries + (ENGINE_EVICT_COST if key_type is KeyType.ENGINE else 1)


class Programs:
    """Ops filled into programs of at most ``budget`` units each, in order (at least one
    program, an op larger than the budget alone in its own)."""

    def __init__(self, layout: Layout, budget: int | None = None) -> None:
        self.layout = layout
        self.budget = CALL_BUDGET if budget is None else budget
        self.items = [Program(layout)]

    def _room(self, cost: int) -> Program:
        last = self.items[-1]
        if last.count and last.cost + cost > self.budget:
            last = Program(self.layout)
            self.items.append(last)
        return last

    def add(
        self,
        request_keys: Keys,
        pairs: Sequence[tuple[int, int]],
        entries: Entries,
        parent: int | None = None,
    ) -> None:
        """Add an add op (entries already without duplicates; see :meth:`Program.add`)."""
        cost = add_cost(len(request_keys), len(pairs), len(entries))
        self._room(cost).add(request_keys, pairs, entries, parent)

    def evict(self, key: int, key_type: KeyType, entries: Entries, first: int = 0) -> None:
        """Add an evict op (see :meth:`Program.evict`)."""
        ents = list(dict.fromkeys(entries))
        self._room(evict_cost(len(ents), key_type)).evict(key, key_type, ents, first)

    def evicts(self, keys: Sequence[int], key_type: KeyType, entries: Entries) -> None:
        """:meth:`evict` of each of ``keys`` in turn (all of the same entries and kind), the
        programs filled as many keys at a time as their budget takes."""
        ents = list(dict.fromkeys(entries))
        unit = evict_cost(len(ents), key_type)
        at = 0
        while at < len(keys):
            last = self._room(unit)
            room = (self.budget - last.cost) // unit if last.count else self.budget // unit
            take = keys[at : at + max(1, room)]
            last.evicts(take, key_type, ents)
            at += len(take)


def add_pieces(
    engine_keys: Keys | None, request_keys: Keys, entries: Entries, budget: int | None = None
) -> list[tuple[Sequence[int], Sequence[tuple[int, int]]]]:
    """An add split into pieces of at most ``budget`` units: (request keys, mappings) each.

    The request keys come first, in chain order (a reader sees a growing prefix of the chain),
    then the mappings (compressed: :func:`compress_pairs`).
    """
    pairs = infer_mappings(engine_keys, request_keys) if engine_keys else []
    pairs = compress_pairs(pairs, MAX_REQUEST_KEYS_PER_ENGINE_KEY)
    return split_add(request_keys, pairs, len(entries), budget)


def split_add(
    request_keys: Keys, pairs: Sequence[tuple[int, int]], entries: int, budget: int | None = None
) -> list[tuple[Sequence[int], Sequence[tuple[int, int]]]]:
    """:func:`add_pieces` for explicit (engine, request) key pairs and ``entries`` entries."""
    room = max(1, (CALL_BUDGET if budget is None else budget) - 1 - entries)
    if len(request_keys) + PAIR_COST * len(pairs) <= room:
        return [(request_keys, pairs)]
    pieces: list[tuple[Sequence[int], Sequence[tuple[int, int]]]] = [
        (request_keys[i : i + room], []) for i in range(0, len(request_keys), room)
    ]
    step = max(1, room // PAIR_COST)
    pieces += [([], pairs[i : i + step]) for i in range(0, len(pairs), step)]
    return pieces


def piece_parents(
    pieces: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]], parent: int | None
) -> list[int | None]:
    """The parent key of each piece of an add (:func:`add_pieces`) whose first piece follows
    ``parent``: the key before the piece's first request key in the chain."""
    out: list[int | None] = []
    for keys, _ in pieces:
        out.append(parent if keys else None)
        if keys:
            parent = keys[-1]
    return out


_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


def blob_ops(plan: Sequence[IndexOp], entry: Callable[[PodEntry], int]) -> tuple[bytes, int, int]:
    """The ops of one checked batch in the binary form of ``apply_batches``
    (``lua/includes/program.lua``, ``read_blob_batches``), how many ops that is, and their
    units of work.

    ``entry`` gives an entry's 1-based index among the call's entries. Consecutive evicts of
    the same kind and entries become one op of several keys (evicted in turn, as separate ops
    would be); an add's mappings are those :func:`add_pieces` sends.
    """
    out: list[bytes] = []
    cost = count = 0
    u16, u32 = _U16.pack, _U32.pack
    tag = b""
    heads: tuple[bytes, ...] = ()
    keys: list[int] = []
    last_entries: object = None
    last_type: object = None
    kind, these, unit = b"", heads, 0

    def flush() -> None:
        nonlocal count
        if keys:
            out.append(tag + b"".join(heads) + u32(len(keys)) + hash_blob(keys))
            keys.clear()
            count += 1

    add_entries: object = None
    add_head, add_count = b"", 0
    for op in plan:
        if isinstance(op, AddOp):
            flush()
            if op.entries is not add_entries:  # (an ingester's adds of one pod share theirs)
                add_entries = op.entries
                ents = list(dict.fromkeys(op.entries))
                add_count = len(ents)
                add_head = u16(add_count) + b"".join(u16(entry(e)) for e in ents)
            req = op.request_keys
            eng = op.engine_keys
            if eng and len(eng) == len(req) and len(set(eng)) == len(eng):
                # one engine key per request key, none repeated: the pairs as they come
                npairs = len(req)
                flat = [0] * (2 * npairs)
                flat[0::2] = eng
                flat[1::2] = req
            else:
                pairs = infer_mappings(eng, req) if eng else []
                pairs = compress_pairs(pairs, MAX_REQUEST_KEYS_PER_ENGINE_KEY)
                npairs = len(pairs)
                flat = [k for pair in pairs for k in pair]
            if op.parent is not None and req:
                out.append(b"P" + add_head + hash_field(op.parent))
            else:
                out.append(b"A" + add_head)
            out.append(u32(len(req)) + hash_blob(req))
            out.append(u32(npairs) + hash_blob(flat))
            cost += add_cost(len(req), npairs, add_count)
            count += 1
            continue
        if op.entries is not last_entries or op.key_type is not last_type:
            # (an ingester's evicts of one event share one entries tuple: worked out once)
            last_entries, last_type = op.entries, op.key_type
            ents = list(dict.fromkeys(op.entries))
            kind = b"R" if op.key_type is KeyType.REQUEST else b"E"
            these = (u16(len(ents)), *(u16(entry(e)) for e in ents))
            unit = evict_cost(len(ents), op.key_type)
        if not keys or kind != tag or these != heads:
            flush()
            tag, heads = kind, these
        keys.append(op.key)
        cost += unit
    flush()
    return b"".join(out), count, cost

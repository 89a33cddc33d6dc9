"""Request keys an embedded index keeps one by one (*inline*): key -> the tuple of its entries,
oldest added first, in least-recently-used order with its last-use tick. Keys holding one entry
share its 1-tuple, and consecutive keys an add or a removal leaves with the same entries share
one tuple. Entries that expire are only ever held inline (:mod:`kvredis.memory.expiry`).

A layer of the index class (see :mod:`kvredis.memory.tables`); its methods run with the index's
lock held.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvredis.memory.bounds import KEY_COST
from kvredis.memory.tables import Held, Tables, holds
from kvredis.types import PodEntry

__all__ = ["EXPIRED_PER_CALL", "LOG_SLACK", "InlineKeys"]

#: Most expired speculative entries reclaimed per call (the rest on later calls; reads filter
#: out whatever is left past its deadline).
EXPIRED_PER_CALL = 256

#: A log of request keys is compacted once it is longer than twice its live keys plus this.
LOG_SLACK = 64


class InlineKeys(Tables):
    """Adding to, removing from and dropping inline request keys."""

    def _add_inline(
        self, req: Sequence[int], ents: Sequence[PodEntry], deadline: float | None
    ) -> None:
        """Add to keys that are all inline or new (and stay inline)."""
        if len(ents) == 1 and deadline is None and not self._expiry:
            self._add_one(req, self._intern(ents[0]))
        else:
            self._add_many(req, ents, deadline)
        self._tick += 1
        self._key_ticks.update(dict.fromkeys(req, self._tick))

    def _add_one(self, req: Sequence[int], held: Held) -> None:
        """Add one entry to inline or new keys (no expiry involved): the common event."""
        table = self._keys
        entry, alone = held.entry, held.alone
        keys_before = len(table)
        added: Sequence[int] = ()
        fresh = None
        if table.keys().isdisjoint(req):  # all new keys: one C-level update of each dict
            fresh = dict.fromkeys(req, alone)
            if len(fresh) == len(req):
                table.update(fresh)
                added = req
            else:  # a key repeated: its place in the LRU order is its last occurrence
                fresh = None
        if fresh is None:
            get, touch, cap = table.get, table.move_to_end, self._entries_per_key
            # Keys that held the same tuple hold the same tuple after the add too: a chain
            # added pod by pod keeps one tuple for the whole run of keys its pods share.
            grown_from: tuple[PodEntry, ...] | None = None
            grown: tuple[PodEntry, ...] = alone
            refreshed_from: tuple[PodEntry, ...] | None = None
            refreshed: tuple[PodEntry, ...] = alone
            added = []
            for key in req:
                stored = get(key)
                if stored is None:
                    table[key] = alone
                    added.append(key)
                    continue
                if stored[-1] is not entry:
                    if stored is grown_from:  # as the key before: share its tuple
                        stored = grown
                        added.append(key)
                    elif stored is refreshed_from:
                        stored = refreshed
                    elif holds(stored, entry):  # re-added: it becomes the most recent
                        refreshed_from = stored
                        stored = refreshed = (*[e for e in stored if e is not entry], entry)
                    else:
                        added.append(key)
                        grown_from = stored
                        stored += alone
                        if cap is not None and len(stored) > cap:
                            stored = self._trim(key, stored, cap)
                            grown_from = None
                        grown = stored
                    table[key] = stored
                touch(key)
        self._cost += (len(table) - keys_before) * KEY_COST
        if added:
            self._log_keys(held, added)

    def _log_keys(self, held: Held, keys: Sequence[int]) -> None:
        """Record that inline ``keys`` (not holding the entry before) now hold it; compact the
        log once it is over twice its keys (amortized O(1) per key logged)."""
        held.count += len(keys)
        self._cost += len(keys) * held.cost
        log = held.log
        log.extend(keys)
        if len(log) > 2 * held.count + LOG_SLACK:
            get, entry = self._keys.get, held.entry
            held.log = array("Q", [k for k in dict.fromkeys(log) if holds(get(k), entry)])

    def _add_many(
        self, req: Sequence[int], ents: Sequence[PodEntry], deadline: float | None
    ) -> None:
        """Add several entries, or entries that expire, or while some entries expire, to
        inline or new keys."""
        cap = self._entries_per_key
        helds = self._records(ents)
        added = tuple(h.entry for h in helds)
        added_ids = set(map(id, added))
        by_id = self._by_id
        # A confirmed entry of a pod replaces that pod's expiring speculative entries under
        # the key (speculative entries added without a ttl stay until evicted).
        expiry = self._expiry
        confirmed = {e.pod_identifier for e in added if not e.speculative} if expiry else ()
        table = self._keys
        new_keys: list[list[int]] = [[] for _ in helds]  # logged once the keys hold them
        for key in req:
            stored = table.get(key)
            if stored is None:
                stored = ()
                self._cost += KEY_COST
            else:
                table.move_to_end(key)
            # Re-adding an entry refreshes it: it moves to the most recently added end.
            kept = [e for e in stored if id(e) not in added_ids]
            if confirmed and kept:
                replaced = {
                    id(e): e
                    for e in kept
                    if e.pod_identifier in confirmed and (key, by_id[id(e)]) in expiry
                }
                if replaced:
                    for entry in replaced.values():
                        self._forget(key, entry)
                    kept = [e for e in kept if id(e) not in replaced]
            for held, logged in zip(helds, new_keys, strict=True):
                if not holds(stored, held.entry):
                    logged.append(key)
            merged = (*kept, *added)
            if cap is not None and len(merged) > cap:
                merged = self._trim(key, merged, cap)
            table[key] = merged
            if deadline is not None:
                for held in helds:
                    expiry.set(key, held, deadline)
            elif expiry:
                for held in helds:
                    expiry.discard(key, held)
        for held, logged in zip(helds, new_keys, strict=True):
            if logged:
                self._log_keys(held, logged)

    def _trim(self, key: int, stored: tuple[PodEntry, ...], cap: int) -> tuple[PodEntry, ...]:
        """Keep the ``cap`` most recently added entries of an inline key."""
        for entry in stored[:-cap]:
            self._forget(key, entry)
        return stored[-cap:]

    def _drop_pair(self, key: int, held: Held) -> int:
        """Remove one entry from one inline key (and the key once empty); 1 if it was there,
        else 0."""
        table = self._keys
        stored = table.get(key)
        if not holds(stored, held.entry):
            return 0
        assert stored is not None
        held.count -= 1
        self._cost -= held.cost
        if len(stored) == 1:  # it held only this entry
            del table[key]
            del self._key_ticks[key]
            self._cost -= KEY_COST
        else:
            shrunk = self._shrunk
            if shrunk[0] is stored and shrunk[1] is held:  # as the key before: share
                table[key] = shrunk[2]
            else:
                entry = held.entry
                left = (
                    stored[:-1]
                    if stored[-1] is entry
                    else tuple([e for e in stored if e is not entry])
                )
                table[key] = left
                self._shrunk = (stored, held, left)
        if self._expiry:
            self._expiry.discard(key, held)
        if not held.count:
            self._release(held)
        return 1

    def _forget(self, key: int, entry: PodEntry) -> None:
        """Account for a stored entry no longer under an inline key (the caller updates the
        key)."""
        held = self._by_id[id(entry)]
        held.count -= 1
        self._cost -= held.cost
        if self._expiry:
            self._expiry.discard(key, held)
        if not held.count:
            self._release(held)

    def _expire(self, now: float) -> None:
        """Reclaim up to :data:`EXPIRED_PER_CALL` entries whose deadline is past."""
        for key, held in self._expiry.due(now, EXPIRED_PER_CALL):
            self._drop_pair(key, held)

    def _drop_key(self, key: int) -> None:
        """Drop an inline key with all its entries."""
        stored = self._keys.pop(key)
        del self._key_ticks[key]
        self._cost -= KEY_COST
        for entry in stored:
            self._forget(key, entry)

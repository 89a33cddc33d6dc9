"""Engine keys of an embedded index: in the engine table (:mod:`kvredis.memory.engine`), or kept
beside their request keys in a run when an add paired them 1:1 with the run's new keys (one list
slot and one table slot each, instead of an ordered-dict node). Recording an add's mappings in
the order of its keys, resolving, dropping, and dropping the least recently used.

A layer of the index class (see :mod:`kvredis.memory.tables`); its methods run with the index's
lock held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvredis.checks import infer_mappings
from kvredis.memory.bounds import RUN_MAPPING_COST
from kvredis.memory.in_runs import RunKeys
from kvredis.memory.runs import Ranges, Run, span

__all__ = ["EngineKeys"]


class EngineKeys(RunKeys):
    """The index's engine keys, in the engine table and in runs."""

    def _map(
        self,
        eng: Sequence[int],
        req: Sequence[int],
        run: Run | None,
        positions: Mapping[int, int],
    ) -> None:
        """Record the engine->request mappings of an add, used in their order. A new engine
        key paired with a key of the add's new run is kept in the run, at the key's position;
        the others go to (or stay in) the engine table, or stay in the run they are in."""
        engine_resident, table = self._engine_resident, self._engine
        if run is None and not engine_resident:
            self._tick += 1
            table.map_all(eng, req, self._tick)
            return
        aligned = len(eng) == len(req)
        if aligned and (type(eng) is not list or type(req) is not list):
            eng, req = list(eng), list(req)  # (compared with the runs' key lists)
        pairs: Iterable[tuple[int, int]]
        pairs = enumerate(eng) if aligned else infer_mappings(eng, req)
        skip = 0  # pairs already handled as part of a stretch of a run
        inline: list[tuple[int, int]] = []  # pairs for the table, used next
        # engine keys of one run at positions [a, b), used next
        used: Run | None = None
        a = b = 0

        def flush() -> None:
            nonlocal used
            if inline:
                self._tick += 1
                table.map_pairs(inline, self._tick)
                inline.clear()
            if used is not None:
                self._use_engine(used, a, b)
                used = None

        for first, second in pairs:
            if aligned:  # (index, engine key)
                if skip:
                    skip -= 1
                    continue
                engine_key, request_key = second, req[first]
            else:
                engine_key, request_key = first, second
            home = engine_resident.get(engine_key)
            if home is not None:
                pos = home.engine_position(engine_key, b if home is used else -1)
                if home.keys[pos] == request_key:
                    if home is not used or pos != b:
                        flush()
                        used, a = home, pos
                    b = pos + 1
                    if aligned:  # the pairs that follow along the run, at once
                        assert home.engine is not None
                        more = min(
                            span(eng, first, home.engine, pos), span(req, first, home.keys, pos)
                        )
                        skip = more - 1
                        b = pos + more
                    continue
                flush()  # a second request key: the mapping moves to the table
                old = home.keys[pos]
                self._drop_engine(home, pos)
                self._tick += 1
                table.put(engine_key, old, self._tick)
                table.map_pairs(((engine_key, request_key),), self._tick)
                continue
            pos = positions.get(request_key, -1)
            if pos >= 0 and run is not None and (run.engine is None or run.engine[pos] is None):
                if inline:
                    flush()
                if table.get(engine_key) is None:
                    self._place_engine(run, pos, engine_key)
                    if run is not used or pos != b:
                        flush()
                        used, a = run, pos
                    b = pos + 1
                    continue
            if used is not None:
                flush()
            inline.append((engine_key, request_key))
        flush()

    def _place_engine(self, run: Run, pos: int, engine_key: int) -> None:
        """Keep a new engine key at ``pos`` of ``run`` (the caller marks it used)."""
        n = len(run.keys)
        if run.engine is None:
            run.engine = [None] * n
            run.engine_recency = Ranges(n, 0)
            self._cost += n * 8
        run.engine[pos] = engine_key
        run.mapped += 1
        self._engine_resident[engine_key] = run
        self._cost += RUN_MAPPING_COST

    def _drop_engine(self, run: Run, pos: int) -> None:
        """Forget the engine key at ``pos`` of ``run``."""
        assert run.engine is not None
        engine_key = run.engine[pos]
        assert engine_key is not None
        del self._engine_resident[engine_key]
        run.engine[pos] = None
        run.mapped -= 1
        self._cost -= RUN_MAPPING_COST
        if not run.alive:
            self._bury(run)

    def _drop_unheld_engine_keys(self, run: Run) -> int:
        """Drop the engine keys of ``run`` whose request key no key holds; returns how many
        engine keys it examined."""
        engine = run.engine
        if engine is None or not run.mapped:
            return 0
        examined = run.mapped
        inline, resident = self._keys, self._resident
        for pos, engine_key in enumerate(engine):
            if engine_key is not None:
                key = run.keys[pos]
                if key not in resident and key not in inline:
                    self._drop_engine(run, pos)
                    if run.engine is None or not run.alive:
                        break
        return examined

    def _use_engine(self, run: Run, a: int, b: int) -> None:
        """Count the engine keys at ``[a, b)`` of ``run`` as used."""
        assert run.engine_recency is not None
        self._tick += 1
        run.engine_recency.assign(a, b, self._tick)
        self._engine_order.used(run, self._tick)

    def _drop_used_engine(self, run: Run, tick: int, limit: int) -> int:
        """Drop up to ``limit`` engine keys of ``run`` last used at ``tick``; returns how
        many there were."""
        recency, engine = run.engine_recency, run.engine
        assert recency is not None and engine is not None
        dropped = 0
        while dropped < limit:
            try:
                j = recency.values.index(tick)
            except ValueError:
                self._engine_order.done(run, tick)
                break
            a = recency.start(j)
            b = min(recency.ends[j], a + limit - dropped)
            recency.assign(a, b, 0)
            for pos in range(a, b):
                if engine[pos] is not None:
                    self._drop_engine(run, pos)
                    dropped += 1
            if not run.alive:
                break
        return dropped

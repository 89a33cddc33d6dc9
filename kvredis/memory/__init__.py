"""Embedded indexes: the whole KV-block index in this process's memory.

Two backends share one implementation and differ only in how they bound their memory:

* :class:`InMemoryIndex` keeps at most ``size`` request keys and at most ``size`` engine keys
  (least recently used dropped first) and at most ``pod_cache_size`` entries per request key
  (least recently added dropped first).
* :class:`CostAwareMemoryIndex` keeps an estimate of the bytes it holds (see
  :func:`estimated_entry_cost` and the ``*_COST`` constants) under a budget such as ``"2GiB"``,
  dropping the least recently used request keys and engine keys, whichever is older, until it
  fits.

"Used" means added to, looked up with a hit, or walked by a score while some pod is still in
the race (request keys), or resolved by ``get_request_key`` (engine keys). Both backends
implement :class:`~kvredis.index.Index`, :class:`~kvredis.index.BatchIndex`,
:class:`~kvredis.index.ScoringIndex` and :class:`~kvredis.index.RankScoringIndex` (``score``
and ``score_by_rank`` walk the chain once, racing each data-parallel rank of a pod on its own,
and stop when no (pod, rank) is left); one lock guards all state, so every method is atomic.

How the keys are kept:

* An add that brings :data:`~kvredis.memory.runs.RUN_MIN` or more new request keys (without a
  ttl) stores them as a *run* (:mod:`kvredis.memory.runs`): the keys in chain order, their
  entries as ranges of positions, their recency as ranges of ticks, and, when the add paired
  them 1:1 with new engine keys, those engine keys. An add that names its parent
  (``AddOp.parent`` in :meth:`InMemoryIndex.apply_batch`, as the ingester writes an engine's
  chain block by block) appends its new keys to the run its parent ends. A walk reads a run
  with one table lookup and one list comparison, and takes its entries range by range; using a
  span of a run is one range assignment. So a score of a chain stored by a few events costs a
  few lookups, not one per block, and a key in a run costs a table slot and two list slots, not
  an ordered-dict node.
* Other request keys are kept one by one (*inline*): key -> the tuple of its entries, oldest
  added first, in least-recently-used order, with its last-use tick (keys holding one entry
  share its 1-tuple, and consecutive keys an add or a removal leaves with the same entries share
  one tuple). Entries that expire are kept inline only: an add with a ttl moves its keys out of
  their runs.
* Engine keys not in a run are in an :class:`~kvredis.memory.engine.EngineTable`; the deadlines
  of expiring entries in an :class:`~kvredis.memory.expiry.ExpiryTable`; the order of run
  positions by last use in :class:`~kvredis.memory.recency.RunOrder` heaps, built on the
  first eviction. Per distinct entry a record counts the keys holding it and knows its runs and
  (a log of) its inline keys, so ``clear(pod)`` never compares PodEntry values key by key.

The modules, each importing (at its top) only those listed before it. The first six are data
structures and pure functions; from ``tables`` on, each is a layer of the index class over the
one before it, its methods run with the index's lock held:

============  ===================================================================================
bounds        the configs (key counts, a byte budget) and the byte-cost model of the budget
runs          ``Run``: the keys one add stored, in chain order, held range by range
race          the score's race over a walk: racers (pod, rank), best weights, the scorer's sums
recency       least-recently-used order over run positions (``RunOrder`` heaps of uses)
expiry        ``ExpiryTable``: when each expiring entry dies
engine        ``EngineTable``: engine key -> the request keys it maps to
tables        the tables of an index and its records of entries: the state the layers share
inline        request keys kept one by one
in_runs       request keys kept in runs: making, appending, holing, dropping positions
engine_keys   engine keys, in the engine table or beside their run's keys
walks         lookups and scores: a chain read up to the first miss, run span by run span
index         :class:`InMemoryIndex` and :class:`CostAwareMemoryIndex`: checks, the lock, adds,
              evicts, clears, the bounds
============  ===================================================================================

``scripts/bench_vs_dynamo.py`` measures ``score`` and the memory per entry against Dynamo's
in-process radix tree, ``scripts/bench_memory.py`` against a plain dict of sets.
"""

from __future__ import annotations

from kvredis.memory.bounds import (
    ENTRY_COST,
    KEY_COST,
    MAPPING_COST,
    MAPPING_REF_COST,
    RUN_COST,
    RUN_KEY_COST,
    RUN_MAPPING_COST,
    RUN_POSITION_COST,
    CostAwareMemoryIndexConfig,
    InMemoryIndexConfig,
    estimated_entry_cost,
)
from kvredis.memory.index import (
    CLEAR_MAPPINGS_PER_PAGE,
    EXPIRED_PER_CALL,
    LOG_SLACK,
    MAX_REQUEST_KEYS_PER_ENGINE_KEY,
    CostAwareMemoryIndex,
    InMemoryIndex,
)

__all__ = [
    "CLEAR_MAPPINGS_PER_PAGE",
    "ENTRY_COST",
    "EXPIRED_PER_CALL",
    "KEY_COST",
    "LOG_SLACK",
    "MAPPING_COST",
    "MAPPING_REF_COST",
    "MAX_REQUEST_KEYS_PER_ENGINE_KEY",
    "RUN_COST",
    "RUN_KEY_COST",
    "RUN_MAPPING_COST",
    "RUN_POSITION_COST",
    "CostAwareMemoryIndex",
    "CostAwareMemoryIndexConfig",
    "InMemoryIndex",
    "InMemoryIndexConfig",
    "estimated_entry_cost",
]

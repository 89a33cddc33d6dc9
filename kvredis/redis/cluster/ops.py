"""The index operations on a cluster, as sans-IO wave operations (see :mod:`.routing`).

A cluster namespace is a set of shards (:mod:`.shards`), each a complete single-server
namespace living in one slot. An operation splits its keys by shard and groups the shards by
node: lookups and writes send one script call per node (``lua/lookup_shards.lua``,
``lua/apply_shards.lua``: the single-server Lua code run per shard), all nodes in one
:class:`~kvredis.redis.cluster.routing.Wave`, so a wave costs one round trip and one script
call per involved node (:func:`op_shard_lookups`, :func:`op_node_writes`). Where the cached slot
map is out of date, or a shard stale, those shards take the per-shard path: the single-server
operation (:mod:`kvredis.redis.ops`, unchanged, with its NOSCRIPT reload, retries and stale
reload) on each shard, run in lockstep by :func:`~kvredis.redis.cluster.core.op_parallel`. The
other operations (clear, drop, watermarks, request keys) always take it.

- lookup: every shard walks its part of the chain (in chain order) and stops at its first
  miss; the merge walks the whole chain and stops at the first key no shard reported. Exact,
  because a shard reports every hit before its own first miss. A long chain goes in waves:
  one node's call walks at most ``LOOKUP_KEYS_PER_CALL`` keys, and a shard's next part is sent
  only while its keys hit and come before the first miss found so far.
- score: the lookup, then :class:`~kvredis.scoring.LongestPrefixScorer` on the client (the same
  floats as the server-side scorer), per data-parallel rank too.
- a lookup read in more than one step (waves, or the per-shard path after a wave) carries each
  shard's stamps (:mod:`kvredis.redis.stamps`) and checks them all once more after its last
  read: a pod that lost an entry on any shard meanwhile keeps only what the first wave read.
- add: request keys go to their shards, each engine -> request mapping to the engine key's
  shard (so the most recent mapping of an engine key is decided in one place).
- evict by engine key: read the mapping (engine key's shard), evict from each request key
  (request keys' shards) and probe whether each still holds an entry, then drop the mapping
  with a compare-and-delete (``unmap``) if none does. Three waves instead of one atomic step.
- apply_batch: the batch is cut into steps (runs of adds and request-key evicts; runs of
  engine-key evicts). With a watermark, every shard gets the first step as part 1 of a
  fenced batch (the fence of ``lua/apply_batch.lua``, in ``lua/includes/fence.lua``): a shard
  whose watermark is at or past the batch skips it, and later steps run only on the shards
  that took it. A batch with more than one
  step ends with an empty last part that advances each shard's watermark, so a batch cut short
  (a crash) is taken again in full by the next sender (its operations are set operations).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kvredis.checks import (
    EntrySelection,
    check_hash,
    check_pod_identifier,
    pod_filter,
)
from kvredis.errors import (
    BackendUnavailableError,
    InvalidInputError,
)
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import ClearProgress
from kvredis.redis.cluster.core import (
    MAPPING_PAGE,
    ClusterCore,
    group_by_node,
    on_every_shard,
    on_shards,
    slot_command,
)
from kvredis.redis.cluster.routing import (
    SlotCommand,
    WaveOp,
    op_refresh,
    op_wave,
)
from kvredis.redis.cluster.shards import (
    descriptor_key,
    shard_slot,
    shards_of,
)
from kvredis.redis.cluster.writes import op_node_writes, unmap_mappings
from kvredis.redis.codec import HASH_WIDTH, blob_hashes, hash_blob, pack_hashes
from kvredis.redis.config import DEFAULT_CLEAR_FIELDS_PER_CALL
from kvredis.redis.ops import (
    LOOKUP_KEYS_PER_CALL,
    batch_fence,
    op_block_key_scheme,
    op_clear_passes,
    op_drop_namespace,
    op_get_request_key,
    op_lookup,
    op_reclaim,
    pod_args,
    read_lookup_reply,
    score_weights,
    walk_cut,
)
from kvredis.redis.requests import (
    Command,
    Op,
    Pipeline,
    ScriptCall,
)
from kvredis.redis.stamps import StampBook
from kvredis.redis.state import CoreState, EntryCache
from kvredis.scoring import LongestPrefixScorer, best_ranks
from kvredis.types import Keys, PodEntry

T = TypeVar("T")


# -- reads -------------------------------------------------------------------------------------


def op_cluster_lookup(
    core: ClusterCore,
    request_keys: Keys,
    pod_identifier_set: Any,
    shared: bool = False,
    stamped: bool = False,
) -> WaveOp[dict[int, Any]]:
    """``Index.lookup`` over the shards: waves of one ``lookup_shards`` call per involved node
    (:func:`op_shard_lookups`), each call walking at most :data:`LOOKUP_KEYS_PER_CALL` keys
    (its shards share them); a shard's next part is sent only while its keys hit and come
    before the first miss found so far. ``shared``: keys holding the same entries share one
    tuple (for the scorer) instead of a list each.

    A lookup read in more than one step (several waves, or a shard walked again by the
    per-shard path after its wave) carries each shard's stamps (:mod:`kvredis.redis.stamps`)
    from its first wave on, and checks every shard's stamps once more after its last read, in
    one more wave (:func:`op_check_stamps`): a pod whose stamp broke on any shard keeps only the
    entries the first wave read, so the merge never credits a pod with entries it did not hold
    at one instant. Whether it takes several waves is known from the chain (a shard with more
    keys than one wave walks); a lookup of one wave asks for no stamps (``stamped`` asks
    anyway), and one whose wave sent a shard to the per-shard path starts over stamped. (The
    calls of one wave run on their nodes at the same time: one wave reads the shards as one
    step.)"""
    keys, _ = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    if not keys:
        return {}
    shards = shards_of(keys, core.count)
    groups: dict[int, list[int]] = {}
    places: dict[int, list[int]] = {}  # shard -> the chain position of each of its keys
    for place, (key, shard) in enumerate(zip(keys, shards, strict=True)):
        groups.setdefault(shard, []).append(key)
        places.setdefault(shard, []).append(place)
    walked = dict.fromkeys(groups, 0)
    horizon = len(keys)  # the chain position of the first miss found so far
    hits: dict[int, Any] = {}
    books = {shard: StampBook() for shard in groups}
    first: set[int] = set()  # the keys the first wave's calls read
    steps = 0
    while True:
        going = [s for s in groups if walked[s] < len(groups[s]) and places[s][walked[s]] < horizon]
        if not going:
            break
        per = yield from _keys_per_shard(core, going)
        if not steps:
            stamped = stamped or any(len(groups[s]) > per for s in going)
        parts = {s: groups[s][walked[s] : walked[s] + per] for s in going}
        found, again = yield from op_shard_lookups(
            core, parts, pods, shared, books if stamped else None
        )
        if again and not stamped:  # a step more than planned: read again, with stamps
            return (yield from op_cluster_lookup(core, keys, pods, shared, stamped=True))
        steps += 1 + bool(again)
        for shard, part in parts.items():
            got = found.get(shard, {})  # a key is found only by its own shard
            hits.update(got)
            if steps - bool(again) == 1 and shard not in again:
                first.update(got)
            n = next((i for i, key in enumerate(part) if key not in got), len(part))
            if n < len(part):  # the shard's first miss: the chain ends there at the latest
                horizon = min(horizon, places[shard][walked[shard] + n])
                walked[shard] = len(groups[shard])
            else:
                walked[shard] += n
    if steps > 1:
        yield from op_check_stamps(core, books, pods)
    dropped: set[str] = set().union(*(book.dropped for book in books.values()))
    kept: dict[int, Any] = {}  # id(entries) -> those of pods not dropped
    merged: dict[int, Any] = {}
    for key in keys:
        entries = hits.get(key)
        if entries is None:
            break
        if dropped and key not in first:
            held = kept.get(id(entries))
            if held is None:
                held = [e for e in entries if e.pod_identifier not in dropped]
                kept[id(entries)] = held = tuple(held) if shared else held
            if not held:
                break
            entries = held if shared else list(held)
        merged[key] = entries
    return merged


def _keys_per_shard(core: ClusterCore, shards: Sequence[int]) -> WaveOp[int]:
    """How many keys each of ``shards`` may walk in the next wave, so that the shards one node
    holds walk at most :data:`LOOKUP_KEYS_PER_CALL` keys together (at least one each)."""
    slot_map = core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))
    per_node: dict[Any, int] = {}
    for shard in shards:
        try:
            node: Any = slot_map.primary(core.slots[shard])
        except BackendUnavailableError:  # no owner known yet: the per-shard path finds it
            node = None
        per_node[node] = per_node.get(node, 0) + 1
    return max(1, LOOKUP_KEYS_PER_CALL // max(per_node.values()))


def op_shard_lookups(
    core: ClusterCore,
    groups: Mapping[int, list[int]],
    pods: frozenset[str] | None,
    shared: bool = False,
    books: Mapping[int, StampBook] | None = None,
) -> WaveOp[tuple[dict[int, dict[int, Any]], list[int]]]:
    """Each shard's part of a chain walked, as ``{shard: {key: entries}}`` (hits up to the
    shard's first miss), and the shards the per-shard path walked after the wave.

    The shards a node holds are walked by one ``lookup_shards`` call, so a wave costs one script
    call per node, not per shard. The slot map the calls are grouped by may be out of date
    (a slot moved, a failover): a call that meets a redirection or a failure, and a shard
    whose generation changed, are walked again by the per-shard path
    (:func:`~kvredis.redis.cluster.core.op_parallel`, which follows redirections, reloads
    scripts and namespaces and retries). With ``books``, each part carries its shard's stamps
    from them (and updates them), and asks for the stamps of the pods it reads."""
    read = core.read_from_replicas
    pick = core.pick()
    slot_map = core.cluster.slot_map or (yield from op_refresh(core.cluster, core.policy.server))
    by_node, unmapped = group_by_node(
        core, groups, lambda slot: slot_map.reader(slot, pick) if read else slot_map.primary(slot)
    )
    stamped = books is not None
    if books is None:
        books = {shard: StampBook() for shard in groups}
    filter_args = pod_args(pods)
    commands: list[SlotCommand] = []
    plan: list[list[tuple[int, EntryCache]]] = []
    for shards in by_node.values():
        call_keys: list[Any] = []
        call_args: list[Any] = [*filter_args]
        caches = []
        for shard in shards:
            layout, cache = core.state(shard).snapshot()
            books[shard].bind(layout.gen)
            names = (layout.meta, layout.pi, layout.pp, layout.sx)
            call_keys = call_keys or list(names)
            call_args += (*names, layout.gen, layout.rprefix, layout.bucket_bits, cache.floor)
            part = groups[shard]  # checked by the caller
            call_args += (hash_blob(part), 1 if stamped and part else 0, *books[shard].args())
            caches.append((shard, cache))
        call = core.registry.call_command(ScriptCall("lookup_shards", call_keys, call_args))
        commands.append(SlotCommand(core.slots[shards[0]], call.args))
        plan.append(caches)
    try:
        replies = yield from op_wave(core.cluster, commands, core.fast_policy, read=read, pick=pick)
    except BackendUnavailableError:  # a redirection or a node in trouble: the careful path
        replies = [None] * len(commands)
    results: dict[int, dict[int, Any]] = {}
    again: list[int] = list(unmapped)
    reload: list[int] = []
    for caches, reply in zip(plan, replies, strict=True):
        if not isinstance(reply, list):
            if core.registry.missing(reply):
                reload.append(caches[0][0])
            again += (shard for shard, _ in caches)
            continue
        for (shard, cache), part in zip(caches, reply, strict=True):
            if not isinstance(part, list) or walk_cut(part):
                # "STALE": the shard is reloaded on the way; a walk stopped at its work
                # limit: the per-shard lookup walks on in parts
                again.append(shard)
                continue
            found: dict[int, Any] = {}
            read_lookup_reply(cache, part, groups[shard], 0, found, shared, books[shard])
            results[shard] = found
    if reload and not core.registry.active:  # the library: each shard's call settles it
        load = core.registry.load_command("lookup_shards", read)
        commands = [SlotCommand(core.slots[shard], load.args) for shard in reload]
        yield from op_wave(core.cluster, commands, core.wave_policy, read=load.read, pick=pick)
    if again:
        factories = {
            shard: _lookup_factory(groups[shard], pods, books[shard] if stamped else None)
            for shard in again
        }
        results.update((yield from on_shards(core, factories, read=True)))
    return results, again


def _lookup_factory(
    keys: list[int], pods: frozenset[str] | None, book: StampBook | None
) -> Callable[[CoreState], Op[dict[int, list[PodEntry]]]]:
    return lambda state: op_lookup(state, keys, pods, book)


def op_check_stamps(
    core: ClusterCore, books: Mapping[int, StampBook], pods: frozenset[str] | None
) -> WaveOp[None]:
    """Check the stamps of every shard's book once more (after a read's last wave): one
    ``lookup_shards`` call per node with empty chains; a book whose shard cannot be checked
    now (a slot moving, a node in trouble, a recreated shard) drops all its pods."""
    groups: dict[int, list[int]] = {shard: [] for shard, book in books.items() if book.stamps}
    if not groups:
        return
    checking = {shard: books[shard] for shard in groups}
    try:
        _, again = yield from op_shard_lookups(core, groups, pods, False, checking)
    except BackendUnavailableError:
        again = list(groups)
    for shard in again:
        books[shard].drop_all()


def op_cluster_score(
    core: ClusterCore, request_keys: Keys, medium_weights: Any, pod_identifier_set: Any
) -> WaveOp[dict[str, float]]:
    """Per-pod longest-prefix scores: the cluster lookup, scored on the client (each pod's
    best data-parallel rank's)."""
    by_rank = yield from op_cluster_score_by_rank(
        core, request_keys, medium_weights, pod_identifier_set
    )
    return best_ranks(by_rank)


def op_cluster_score_by_rank(
    core: ClusterCore, request_keys: Keys, medium_weights: Any, pod_identifier_set: Any
) -> WaveOp[dict[str, dict[int, float]]]:
    """Per-pod, per-data-parallel-rank longest-prefix scores: the cluster lookup, scored on the
    client (the same floats as the server-side scorer)."""
    scorer = LongestPrefixScorer(score_weights(medium_weights))
    keys, _ = pack_hashes(request_keys, "request key")
    found = yield from op_cluster_lookup(core, keys, pod_identifier_set, shared=True)
    return scorer.score_by_rank(keys, found)


def op_cluster_get_request_key(core: ClusterCore, engine_key: int) -> WaveOp[int]:
    """``Index.get_request_key``: one call on the engine key's shard."""
    key = check_hash(engine_key, "engine key")
    shard = core.shard(key)
    found = yield from on_shards(core, {shard: lambda s: op_get_request_key(s, key)})
    return found[shard]


# -- clear and drop ----------------------------------------------------------------------------


def op_cluster_clear(
    core: ClusterCore,
    pod_identifier: str,
    progress: ClearProgress | None = None,
    fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL,
    selection: EntrySelection | None = None,
) -> WaveOp[int]:
    """``Index.clear`` on every shard in parallel (each pages its own keys on its node), then
    one pass over the engine mappings: a mapping none of whose request keys holds an entry any
    more is dropped. The pairs removed. With ``selection`` (``clear_entries``) each shard
    removes only the pod's entries it matches."""
    done: dict[int, tuple[int, int]] = {}

    def reporter(shard: int) -> ClearProgress:
        def report(keys: int, removed: int) -> None:
            done[shard] = (keys, removed)
            if progress is not None:
                progress(sum(d[0] for d in done.values()), sum(d[1] for d in done.values()))

        return report

    check_pod_identifier(pod_identifier)
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
    factories = {
        shard: _clear_factory(pod_identifier, reporter(shard), fields_per_call, selection)
        for shard in range(core.count)
    }
    cleared = yield from on_shards(core, factories)
    retired = {shard: ids for shard, (_n, ids) in cleared.items() if ids}
    if retired:  # the mapping pass, then the reclaim: a clear cut short before it runs it again
        yield from op_clear_mappings(core)
        yield from on_shards(
            core, {shard: _reclaim_factory(pod_identifier, ids) for shard, ids in retired.items()}
        )
    return sum(n for n, _ids in cleared.values())


def _clear_factory(
    pod: str, report: ClearProgress, per_call: int, selection: EntrySelection | None
) -> Callable[[CoreState], Op[tuple[int, bytes]]]:
    return lambda state: op_clear_passes(
        state, pod, report, per_call, mappings=False, selection=selection
    )


def _reclaim_factory(pod: str, ids: bytes) -> Callable[[CoreState], Op[None]]:
    return lambda state: op_reclaim(state, pod, ids)


def op_clear_mappings(core: ClusterCore) -> WaveOp[int]:
    """Drop every engine mapping none of whose request keys holds an entry; the number
    dropped. Each shard pages its engine buckets; a page's request keys are probed on their
    shards in one wave, and the mappings left without holders are dropped (compare-and-delete)."""
    dropped = 0
    for shard in range(core.count):
        cursor: int | None = None
        while cursor != 0:
            page = yield from on_shards(core, {shard: _mapping_page(cursor or 0)})
            cursor, mappings = page[shard]
            if not mappings:
                continue
            wanted = {k for mapping in mappings.values() for k in blob_hashes(mapping)}
            held = yield from _probe(core, wanted)
            drops = [
                (e, m) for e, m in mappings.items() if not any(k in held for k in blob_hashes(m))
            ]
            if drops:
                dropped += yield from unmap_mappings(core, {shard: drops})
    return dropped


def _mapping_page(cursor: int) -> Callable[[CoreState], Op[tuple[int, dict[int, bytes]]]]:
    def op(state: CoreState) -> Op[tuple[int, dict[int, bytes]]]:
        layout = state.layout
        next_cursor, keys = yield Command(
            ("SCAN", cursor, "MATCH", layout.engine_pattern(), "COUNT", MAPPING_PAGE)
        )
        mappings: dict[int, bytes] = {}
        if keys:
            replies = yield Pipeline(tuple(Command(("HGETALL", k)) for k in keys))
            for reply in replies:
                for field, value in _hash_items(reply):
                    if len(field) == HASH_WIDTH and value and len(value) % HASH_WIDTH == 0:
                        mappings[int.from_bytes(field, "big")] = value
        return int(next_cursor), mappings

    return op


def _hash_items(reply: Any) -> list[tuple[bytes, bytes]]:
    """The (field, value) pairs of an HGETALL reply (a flat list, or a map in RESP3)."""
    if isinstance(reply, dict):
        return [(bytes(k), bytes(v)) for k, v in reply.items()]
    if isinstance(reply, (list, tuple)):
        return [(bytes(reply[i]), bytes(reply[i + 1])) for i in range(0, len(reply) - 1, 2)]
    return []


def _probe(core: ClusterCore, keys: Iterable[int]) -> WaveOp[set[int]]:
    """Which of the request keys hold an entry (stored inline or in a run)."""
    _, held = yield from op_node_writes(
        core, {}, batch_fence(None, None), secrets.token_hex(8), probes=core.by_shard(keys)
    )
    return held


def op_cluster_drop(core: ClusterCore) -> WaveOp[int]:
    """Drop every shard (each scans its own node), then the descriptor; keys deleted."""
    deleted = yield from on_every_shard(core, op_drop_namespace)
    desc = descriptor_key(core.namespace)
    removed = yield from slot_command(core, shard_slot(desc.decode()), "DEL", desc)
    return sum(deleted.values()) + int(removed)


def op_cluster_block_key_scheme(
    core: ClusterCore, scheme: BlockKeyScheme, record: bool = False
) -> WaveOp[BlockKeyScheme | None]:
    """:func:`~kvredis.redis.ops.op_block_key_scheme` on every shard (each shard's namespace
    records the scheme); the scheme recorded (None: none yet on some shard)."""
    found = yield from on_every_shard(core, lambda s: op_block_key_scheme(s, scheme, record))
    schemes = list(found.values())
    return schemes[0] if schemes and all(s is not None for s in schemes) else None

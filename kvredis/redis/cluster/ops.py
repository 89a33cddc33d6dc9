"""The index's reads, clear and drop on a cluster, as sans-IO wave operations (see
:mod:`.routing`); the writes are :mod:`.writes`.

A cluster namespace is a set of shards (:mod:`.shards`), each a complete single-server
namespace living in one slot; in the pod layout every pod lives in one shard. A read involves
the shards of the pods it asks about (every shard without a pod filter); the shards one node
holds are read by one script call on that node (:mod:`.calls`), every node's call in one wave.

- score: the single-server ``score`` on each shard (itself on a node holding one shard of the
  score, through ``score_shards`` on a node holding several): each shard scores its
  own pods (per data-parallel rank) over the whole chain (a pod's prefix is in its shard), so
  the replies merge by union into exactly the floats one server gives
  (:class:`~kvredis.scoring.LongestPrefixScorer`'s). One round trip per involved node; a chain
  longer than one call's keys goes in parts, each shard going on from where its pods got and
  carrying their stamps (:mod:`kvredis.redis.stamps`), so the parts never credit a pod with
  more than it held at once.
- lookup: a key's entries are spread over the shards of the pods holding it, and the chain
  ends at the first key no shard holds. Each shard walks to its first miss (``lookup_union``);
  the farthest of them is where the chain may end, so the shards that stopped before it walk
  again, passing over their misses up to it, and stop at their first miss at or after it;
  until every shard stops at the same key. One wave when the shards stop together (the pods
  holding a chain hold a prefix of it), a second for the others; a lookup of more than one step
  carries each shard's stamps and checks them once more after its last step (a pod that lost an
  entry meanwhile keeps only what the first wave read).
- get_request_key: every shard's mapping of the engine key (each shard keeps the mappings its
  pods' adds made): the first shard's that has one.
- clear: on the pod's shard only, the single-server clear (mappings included).

While a namespace of the key layout is being converted (:mod:`.migrate`) a pod's entries may be
in several shards: a score is then the client's :class:`~kvredis.scoring.LongestPrefixScorer`
over the lookup, which merges every shard's entries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvredis.checks import (
    EntrySelection,
    check_hash,
    check_pod_identifier,
    pod_filter,
)
from kvredis.errors import (
    BackendUnavailableError,
    EngineKeyNotFoundError,
    InvalidInputError,
    StaleNamespaceError,
    translate,
)
from kvredis.hashing.config import BlockKeyScheme
from kvredis.index import ClearProgress
from kvredis.redis.cluster.calls import NodeCall, group_shards, op_node_calls, op_slot_map
from kvredis.redis.cluster.core import (
    ClusterCore,
    on_every_shard,
    on_shards,
    slot_command,
)
from kvredis.redis.cluster.routing import NON_LOCAL_KEY, WaveOp
from kvredis.redis.cluster.shards import descriptor_key, shard_slot
from kvredis.redis.cluster.topology import ClusterNode
from kvredis.redis.codec import HASH_WIDTH, bytes_text, hash_field, pack_hashes, text_bytes
from kvredis.redis.config import DEFAULT_CLEAR_FIELDS_PER_CALL
from kvredis.redis.ops import (
    LOOKUP_KEYS_PER_CALL,
    SCORE_KEYS_PER_CALL,
    op_block_key_scheme,
    op_clear,
    op_drop_namespace,
    op_score_by_rank,
    pod_args,
    read_score_reply,
    score_weights,
)
from kvredis.redis.requests import Arg, Command, Op, ScriptCall
from kvredis.redis.stamps import StampBook
from kvredis.redis.state import CoreState, EntryCache
from kvredis.scoring import UNKNOWN_TIER_WEIGHT, LongestPrefixScorer, best_ranks
from kvredis.types import Keys, PodEntry

T = TypeVar("T")


# -- lookup ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ShardWalk:
    """How far one shard's walk of a chain got (positions 0-based).

    ``start``: where its next walk begins; ``miss``: the first key it does not hold at or after
    the position it was last asked to pass over misses up to (None: not known yet, or its walk
    was cut at the work limit); ``end``: it walked to the chain's end."""

    start: int = 0
    miss: int | None = None
    end: bool = False


@dataclass(slots=True)
class UnionLookup:
    """The merge of the shards' walks of one chain: every shard's hits by position.

    With ``books`` (a read in more than one step), each shard's walks carry its stamps
    (:mod:`kvredis.redis.stamps`), and a pod whose stamp broke keeps only the entries the first
    step read."""

    keys: Sequence[int]
    walks: dict[int, ShardWalk]
    #: position -> the entries shards reported there, in shard order, with the step that read
    #: them (0: the first wave)
    hits: dict[int, list[tuple[int, tuple[PodEntry, ...]]]] = field(default_factory=dict)
    #: shard -> its stamps (None: a read of one step, no stamps)
    books: dict[int, StampBook] | None = None
    #: the steps taken so far (a wave, or the per-shard path after one)
    step: int = 0

    @property
    def frontier(self) -> int:
        """The farthest stop known: every key before it is held by some shard."""
        stops = [len(self.keys) if w.end else w.miss for w in self.walks.values()]
        return max((s for s in stops if s is not None), default=0)

    def due(self) -> dict[int, tuple[int, int]]:
        """The shards to walk (again), with the position to start from and the position up to
        which they pass over their misses."""
        upto = self.frontier
        out: dict[int, tuple[int, int]] = {}
        for shard, walk in self.walks.items():
            if walk.end:
                continue
            if walk.miss is None:
                out[shard] = (walk.start, max(upto, walk.start))
            elif walk.miss < upto:
                out[shard] = (walk.miss + 1, upto)
        return out

    def take(self, shard: int, cache: EntryCache, reply: Sequence[Any]) -> None:
        """Take in one shard's ``lookup_union`` reply."""
        cache.learn(reply[1], int(reply[0]))
        if self.books is not None:
            self.books[shard].take(reply[4])
        holders = cache.holders
        step = self.step
        for i in range(5, len(reply) - 1, 2):
            at = int(reply[i]) - 1
            pairs = reply[i + 1]
            for j in range(0, len(pairs) - 1, 2):
                n, held = int(pairs[j]), holders(pairs[j + 1])
                if held:
                    for p in range(at, at + n):
                        self.hits.setdefault(p, []).append((step, held))
                at += n
        how, where = int(reply[2]), int(reply[3]) - 1
        walk = self.walks[shard]
        walk.start, walk.miss, walk.end = where, None, False
        if how == 0:
            walk.miss = where
        elif how == 2:
            walk.end = True

    def result(self) -> dict[int, list[PodEntry]]:
        """Entries per key, in chain order, up to the first key no shard holds (the entries of
        a pod whose stamp broke counting only where the first step read them)."""
        dropped: set[str] = set()
        if self.books is not None:
            dropped = set().union(*(book.dropped for book in self.books.values()))
        out: dict[int, list[PodEntry]] = {}
        for position, key in enumerate(self.keys[: self.frontier]):
            found = self.hits.get(position)
            if not found:
                break
            lists = [held for _, held in found]
            if dropped:
                lists = [
                    held if step == 0 else tuple(e for e in held if e.pod_identifier not in dropped)
                    for step, held in found
                ]
                lists = [held for held in lists if held]
                if not lists:
                    break
            if len(lists) == 1:
                out[key] = list(lists[0])
            else:
                out[key] = list(dict.fromkeys(e for held in lists for e in held))
        return out


def _union_shard_args(
    state: CoreState, start: int, upto: int, book: StampBook | None
) -> tuple[list[Arg], EntryCache]:
    layout, cache = state.snapshot()
    args: list[Arg] = [
        *(layout.meta, layout.pi, layout.pp, layout.sx),
        *(layout.gen, layout.rprefix, layout.bucket_bits, cache.floor, start + 1, upto + 1),
    ]
    if book is None:
        args += (0, 0)
    else:
        book.bind(layout.gen)
        args += (1, *book.args())
    return args, cache


def _union_walk_factory(
    chain: bytes, filter_args: list[Arg], start: int, upto: int, book: StampBook | None
) -> Callable[[CoreState], Op[tuple[EntryCache, list[Any]]]]:
    """One shard's walk by the per-shard path (``lookup_union`` of one shard)."""

    def factory(state: CoreState) -> Op[tuple[EntryCache, list[Any]]]:
        args, cache = _union_shard_args(state, start, upto, book)
        layout = state.layout
        keys = (layout.meta, layout.pi, layout.pp, layout.sx)
        (reply,) = yield ScriptCall("lookup_union", keys, [*filter_args, chain, *args], read=True)
        if not isinstance(reply, list):
            raise StaleNamespaceError("the shard's generation changed")
        return cache, reply

    return factory


def op_cluster_lookup(
    core: ClusterCore, request_keys: Keys, pod_identifier_set: Any, stamped: bool | None = None
) -> WaveOp[dict[int, list[PodEntry]]]:
    """``Index.lookup`` over the shards (see the module docstring).

    A lookup read in more than one step carries each shard's stamps from its first wave on
    and checks them once more after its last (:func:`op_check_union_stamps`): a pod whose
    stamp broke keeps only the entries the first wave read. Stamps are asked for from the start
    where more than one step is likely (several shards, or a chain longer than one call
    walks; ``stamped`` decides otherwise); a lookup without them that takes a second step
    starts over with them."""
    keys, chain = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    if not keys:
        return {}
    shards = core.pods_shards(pods)
    if not shards:
        return {}
    if stamped is None:
        stamped = len(shards) > 1 or len(keys) > LOOKUP_KEYS_PER_CALL
    books = {shard: StampBook() for shard in shards} if stamped else None
    merge = UnionLookup(keys, {shard: ShardWalk() for shard in shards}, books=books)
    filter_args = pod_args(pods)
    pick = core.pick()
    while True:
        due = merge.due()
        if not due:
            break
        if merge.step and books is None:  # a step more than planned: read again, stamped
            return (yield from op_cluster_lookup(core, keys, pods, stamped=True))
        slot_map = yield from op_slot_map(core)
        by_node, again = group_shards(core, due, core.reader(slot_map, pick))
        calls: list[NodeCall] = []
        caches: list[list[EntryCache]] = []
        for node, node_shards in by_node.items():
            first = core.state(node_shards[0]).layout
            args: list[Arg] = [*filter_args, chain]
            node_caches = []
            for shard in node_shards:
                book = None if books is None else books[shard]
                shard_args, cache = _union_shard_args(core.state(shard), *due[shard], book)
                args += shard_args
                node_caches.append(cache)
            names = (first.meta, first.pi, first.pp, first.sx)
            walk = ScriptCall("lookup_union", names, args, read=True)
            slot = core.slots[node_shards[0]]
            calls.append(NodeCall(slot, walk, tuple(node_shards), node=node))
            caches.append(node_caches)
        replies = yield from op_node_calls(core, calls, read=True, pick=pick)
        for node_call, node_caches, reply in zip(calls, caches, replies, strict=True):
            if reply is None:
                again += node_call.items
                continue
            for shard, cache, part in zip(node_call.items, node_caches, reply, strict=True):
                if isinstance(part, list):
                    merge.take(shard, cache, part)
                else:
                    again.append(shard)  # "STALE": the per-shard path reloads the shard
        merge.step += 1
        if again:
            if books is None:  # a step more than planned: read again, stamped
                return (yield from op_cluster_lookup(core, keys, pods, stamped=True))
            factories = {
                s: _union_walk_factory(chain, filter_args, *due[s], books[s]) for s in again
            }
            found = yield from on_shards(core, factories, read=True)
            for shard, (cache, reply) in found.items():
                merge.take(shard, cache, reply)
            merge.step += 1
    if books is not None and merge.step > 1:
        yield from op_check_union_stamps(core, books, filter_args, pick)
    return merge.result()


def op_check_union_stamps(
    core: ClusterCore, books: Mapping[int, StampBook], filter_args: list[Arg], pick: int = 0
) -> WaveOp[None]:
    """Check the stamps of every shard's book once more (after a read's last step): one
    ``lookup_union`` call of an empty chain per node, its shards carrying their stamps; a book
    whose shard cannot be checked now (a slot moving, a node in trouble, a recreated shard)
    drops all its pods."""
    checking = [shard for shard, book in books.items() if book.stamps]
    if not checking:
        return
    slot_map = yield from op_slot_map(core)
    by_node, again = group_shards(core, checking, core.reader(slot_map, pick))
    calls: list[NodeCall] = []
    for node, node_shards in by_node.items():
        first = core.state(node_shards[0]).layout
        args: list[Arg] = [*filter_args, b""]
        for shard in node_shards:
            args += _union_shard_args(core.state(shard), 0, 0, books[shard])[0]
        names = (first.meta, first.pi, first.pp, first.sx)
        check = ScriptCall("lookup_union", names, args, read=True)
        calls.append(NodeCall(core.slots[node_shards[0]], check, tuple(node_shards), node=node))
    replies = yield from op_node_calls(core, calls, read=True, pick=pick)
    for node_call, reply in zip(calls, replies, strict=True):
        if reply is None:
            again += node_call.items
            continue
        for shard, part in zip(node_call.items, reply, strict=True):
            if isinstance(part, list):
                books[shard].take(part[4])
            else:
                again.append(shard)
    if not again:
        return
    factories = {s: _union_walk_factory(b"", filter_args, 0, 0, books[s]) for s in again}
    try:
        found = yield from on_shards(core, factories, read=True)
    except (BackendUnavailableError, StaleNamespaceError):
        found = {}
    for shard in again:
        if shard in found:
            books[shard].take(found[shard][1][4])
        else:
            books[shard].drop_all()


# -- score -------------------------------------------------------------------------------------


#: A (pod id, data-parallel rank) of a score.
Slot = tuple[bytes, int]


@dataclass(slots=True)
class ShardScore:
    """One shard's scores over a chain walked in parts: its (pod, rank)s' scores so far, where
    its next part starts, and the (pod, rank)s still holding every key walked, with their
    scores and stamps (score.lua's carried arguments)."""

    scores: dict[Slot, float] = field(default_factory=dict)
    start: int = 0
    carried: list[Arg] = field(default_factory=lambda: [0])
    done: bool = False


def _score_shard_args(core: ClusterCore, shard: int, state: ShardScore, more: int) -> list[Arg]:
    """One shard's arguments in ``score_shards``: their count, the shard's keys and namespace
    (:meth:`~.core.ClusterCore.shard_args`), whether keys follow this part, the (pod, rank)s
    carried over."""
    fixed = core.shard_args(shard)
    carried = state.carried
    return [len(fixed) + 1 + len(carried), *fixed, more, *carried]


@dataclass(frozen=True, slots=True)
class ScoreCall:
    """The first call of a score on one node (``score_shards``, or the single-server ``score``
    on a node holding one of its shards), all but its weights and keys:
    the node, its shards and their arguments (kept while the slot map and the shards' layouts
    are the same: :meth:`~.core.ClusterCore.read_plan`)."""

    node: ClusterNode
    slot: int
    shards: tuple[int, ...]
    names: tuple[Any, ...]
    head: tuple[Any, ...]
    #: one shard on the node: the single-server ``score`` itself (``head`` its namespace
    #: arguments), without the wrapper's argument copies and checks
    single: bool = False

    def call(self, tail: tuple[Any, ...]) -> NodeCall:
        """The node call scoring a whole chain, ``tail`` the pod filter, weights and keys."""
        if self.single:  # the whole chain: no keys follow, none carried
            script = ScriptCall("score", self.names, (*self.head, *tail, 0, 0), read=True)
        else:
            script = ScriptCall("score_shards", self.names, (*self.head, *tail), read=True)
        return NodeCall(self.slot, script, self.shards, single=self.single, node=self.node)


def _score_calls(core: ClusterCore, by_node: Mapping[ClusterNode, list[int]]) -> list[ScoreCall]:
    out = []
    for node, group in by_node.items():
        names = core.shard_args(group[0])[:4]
        if len(group) == 1:
            head = tuple(core.shard_args(group[0])[4:])
            out.append(ScoreCall(node, core.slots[group[0]], tuple(group), names, head, True))
            continue
        args: list[Arg] = [len(group)]
        for shard in group:
            fixed = core.shard_args(shard)
            args += (len(fixed) + 2, *fixed, 0, 0)  # the whole chain: no keys follow, none carried
        out.append(ScoreCall(node, core.slots[group[0]], tuple(group), names, tuple(args)))
    return out


def _score_factory(
    keys: list[int], weights: Any, pods: frozenset[str] | None
) -> Callable[[CoreState], Op[dict[str, dict[int, float]]]]:
    """One shard's whole score by the per-shard path (the single-server ``score``)."""
    return lambda state: op_score_by_rank(state, keys, weights, pods)


def op_cluster_score(
    core: ClusterCore, request_keys: Keys, medium_weights: Any, pod_identifier_set: Any
) -> WaveOp[dict[str, float]]:
    """Per-pod longest-prefix scores (see the module docstring): each pod's best data-parallel
    rank's (:func:`op_cluster_score_by_rank`); the same floats as
    :class:`~kvredis.scoring.LongestPrefixScorer`."""
    by_rank = yield from op_cluster_score_by_rank(
        core, request_keys, medium_weights, pod_identifier_set
    )
    return best_ranks(by_rank)


def op_cluster_score_by_rank(
    core: ClusterCore, request_keys: Keys, medium_weights: Any, pod_identifier_set: Any
) -> WaveOp[dict[str, dict[int, float]]]:
    """Per-pod, per-data-parallel-rank longest-prefix scores (see the module docstring): the
    same floats as :meth:`~kvredis.scoring.LongestPrefixScorer.score_by_rank`. A chain read in
    parts carries each shard's stamps from part to part (score.lua): a (pod, rank) whose pod
    lost an entry since an earlier part read it keeps the score it had."""
    keys, chain = pack_hashes(request_keys, "request key")
    pods = pod_filter(pod_identifier_set)
    weights = score_weights(medium_weights)
    if not keys:
        return {}
    if not core.by_pod:  # a pod's entries may be in several shards: merge, then score
        found = yield from op_cluster_lookup(core, keys, pods)
        return LongestPrefixScorer(weights).score_by_rank(keys, found)
    shards = core.pods_shards(pods)
    if not shards:
        return {}
    common: list[Arg] = [*pod_args(pods), len(weights)]
    for tier, weight in weights.items():
        common += (text_bytes(tier), repr(float(weight)))
    common.append(repr(float(UNKNOWN_TIER_WEIGHT)))
    pick = core.pick()
    if len(keys) <= SCORE_KEYS_PER_CALL:  # the usual score: one wave, each shard's whole walk
        slot_map = yield from op_slot_map(core)
        plan = core.read_plan(slot_map, shards, pick, _score_calls)
        if plan is not None:
            tail = (*common, chain)
            first_calls = [c.call(tail) for c in plan]
            answered = yield from op_node_calls(core, first_calls, read=True, pick=pick)
            whole = _whole_scores(answered, len(keys))
            if whole is not None:
                return whole
    states = {shard: ShardScore() for shard in shards}
    careful: dict[int, dict[str, dict[int, float]]] = {}
    pending = list(shards)
    while pending:
        slot_map = yield from op_slot_map(core)
        by_node, again = group_shards(core, pending, core.reader(slot_map, pick))
        calls: list[NodeCall] = []
        for node, node_shards in by_node.items():
            for start in dict.fromkeys(states[s].start for s in node_shards):
                group = [s for s in node_shards if states[s].start == start]
                piece = chain[start * HASH_WIDTH : (start + SCORE_KEYS_PER_CALL) * HASH_WIDTH]
                more = 1 if start + len(piece) // HASH_WIDTH < len(keys) else 0
                args: list[Arg] = [len(group)]
                for shard in group:
                    args += _score_shard_args(core, shard, states[shard], more)
                args += common
                args.append(piece)
                names = core.shard_args(group[0])[:4]
                score = ScriptCall("score_shards", names, args, read=True)
                calls.append(NodeCall(core.slots[group[0]], score, tuple(group), node=node))
        replies = yield from op_node_calls(core, calls, read=True, pick=pick)
        pending = []
        for node_call, reply in zip(calls, replies, strict=True):
            if reply is None:
                again += node_call.items
                continue
            for shard, part in zip(node_call.items, reply, strict=True):
                if not isinstance(part, list):
                    if not _shard_again(part):
                        raise translate(_error_text(part))
                    again.append(shard)
                    continue
                state = states[shard]
                walked, cut, live = read_score_reply(part, state.scores)
                piece_keys = min(SCORE_KEYS_PER_CALL, len(keys) - state.start)
                state.start += walked
                if live and walked and (cut or walked == piece_keys) and state.start < len(keys):
                    state.carried = [len(live)]
                    for slot, stamp in live:
                        state.carried += (slot[0], slot[1], repr(state.scores[slot]), stamp)
                    pending.append(shard)
        if again:  # the shard scored again, whole, by the per-shard path
            factories = {s: _score_factory(keys, weights, pods) for s in again}
            careful.update((yield from on_shards(core, factories, read=True)))
            for shard in again:
                states[shard].done = True
    out: dict[str, dict[int, float]] = {}
    for shard, state in states.items():
        if state.done:
            scored = careful[shard]
        else:
            scored = {}
            for (pod, rank), value in state.scores.items():
                scored.setdefault(bytes_text(pod), {})[rank] = value
        for pod_id, ranks in scored.items():
            known = out.setdefault(pod_id, {})
            for rank, value in ranks.items():
                if rank not in known or value > known[rank]:
                    known[rank] = value
    return out


def _error_text(error: Any) -> str:
    """The text of a shard's error in a node's reply: a string element of ``score_shards``'s
    reply (bytes), or the message of a single-server call's error reply (str)."""
    return error if isinstance(error, str) else bytes(error).decode("utf-8", "replace")


def _shard_again(error: Any) -> bool:
    """Whether the error that stopped one shard's score in ``score_shards`` is one the
    per-shard path gets past: a stale shard (it reloads), a key of a slot this node does not
    serve now (it follows the slot)."""
    message = _error_text(error)
    return message.startswith(("KVREDIS_STALE", "TRYAGAIN", "MOVED", "ASK")) or (
        NON_LOCAL_KEY in message
    )


def _whole_scores(
    replies: Sequence[list[Any] | None], length: int
) -> dict[str, dict[int, float]] | None:
    """The scores of a one-wave score, merged (a (pod, rank) in several shards: its highest),
    or None when a shard needs more (its call failed, its walk was cut at the work limit, its
    shard is stale): the general path then scores again."""
    out: dict[str, dict[int, float]] = {}
    for reply in replies:
        if reply is None:
            return None
        for part in reply:
            if not isinstance(part, list):
                if not _shard_again(part):
                    raise translate(_error_text(part))
                return None
            if int(part[1]) and int(part[0]) < length:  # cut: walk on from there
                return None
            for i in range(2, len(part) - 4, 5):
                ranks = out.setdefault(bytes_text(part[i]), {})
                rank, value = int(part[i + 1]), float(part[i + 2])
                known = ranks.get(rank)
                ranks[rank] = value if known is None or value > known else known
    return out


# -- engine keys ---------------------------------------------------------------------------------


def _request_key_factory(key: int) -> Callable[[CoreState], Op[int | None]]:
    def factory(state: CoreState) -> Op[int | None]:
        layout = state.layout
        reply = yield ScriptCall(
            "request_key",
            (layout.meta,),
            (layout.gen, layout.eprefix, layout.bucket_bits, hash_field(key)),
        )
        return None if reply is None else int.from_bytes(reply, "big")

    return factory


def op_cluster_get_request_key(core: ClusterCore, engine_key: int) -> WaveOp[int]:
    """``Index.get_request_key``: the mapping of the engine key in every shard, in one wave;
    the lowest-numbered shard's that has one (in the key layout: the engine key's shard's)."""
    key = check_hash(engine_key, "engine key")
    found = yield from on_shards(core, {s: _request_key_factory(key) for s in range(core.count)})
    order = sorted(found)
    if not core.by_pod:  # the key layout's mapping, in the engine key's shard, first
        order.sort(key=lambda s: s != core.shard(key))
    for shard in order:
        mapped = found[shard]
        if mapped is not None:
            return mapped
    raise EngineKeyNotFoundError(key)


# -- clear and drop ----------------------------------------------------------------------------


def op_cluster_clear(
    core: ClusterCore,
    pod_identifier: str,
    progress: ClearProgress | None = None,
    fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL,
    selection: EntrySelection | None = None,
) -> WaveOp[int]:
    """``Index.clear``: the single-server clear on the pod's shard (its entries, and the
    mappings left without holders there); the pairs removed. With ``selection``
    (``clear_entries``) only the pod's entries it matches."""
    pod = check_pod_identifier(pod_identifier)
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a callable(done, removed), got {progress!r}")
    shard = core.pod_shard(pod)
    if not core.by_pod:
        return (yield from _op_converting_clear(core, pod, progress, fields_per_call, selection))

    def factory(state: CoreState) -> Op[int]:
        return op_clear(state, pod, progress, fields_per_call, True, selection)

    done = yield from on_shards(core, {shard: factory})
    return done[shard]


def _op_converting_clear(
    core: ClusterCore,
    pod: str,
    progress: ClearProgress | None,
    fields_per_call: int,
    selection: EntrySelection | None,
) -> WaveOp[int]:
    """``Index.clear`` while a namespace of the key layout is converted (:mod:`.migrate`): the
    pod's entries may be in any shard. Every other shard is cleared first, then the pod's
    counter raised in its shard, then that shard (the order the mover relies on); no mapping is
    dropped (the conversion's last step drops those left without holders)."""
    home = core.pod_shard(pod)
    done: dict[int, tuple[int, int]] = {}

    def reporter(shard: int) -> ClearProgress:
        def report(keys: int, removed: int) -> None:
            done[shard] = (keys, removed)
            if progress is not None:
                progress(sum(d[0] for d in done.values()), sum(d[1] for d in done.values()))

        return report

    def factory(shard: int) -> Callable[[CoreState], Op[int]]:
        def op(state: CoreState) -> Op[int]:
            report = reporter(shard)
            return (yield from op_clear(state, pod, report, fields_per_call, False, selection))

        return op

    others = yield from on_shards(core, {s: factory(s) for s in range(core.count) if s != home})
    yield from on_shards(core, {home: _bump_one(pod)})
    own = yield from on_shards(core, {home: factory(home)})
    return sum(others.values()) + own[home]


def _bump_one(pod: str) -> Callable[[CoreState], Op[None]]:
    def factory(state: CoreState) -> Op[None]:
        yield Command(("HINCRBY", state.layout.mv, text_bytes(pod), 1))

    return factory


def op_cluster_drop(core: ClusterCore) -> WaveOp[int]:
    """Drop every shard (each scans its own node), then the descriptor; keys deleted."""
    deleted = yield from on_every_shard(core, op_drop_namespace)
    desc = descriptor_key(core.namespace)
    removed = yield from slot_command(core, shard_slot(desc.decode()), "DEL", desc)
    core.stream_homes.clear()
    return sum(deleted.values()) + int(removed)


def op_cluster_block_key_scheme(
    core: ClusterCore, scheme: BlockKeyScheme, record: bool = False
) -> WaveOp[BlockKeyScheme | None]:
    """:func:`~kvredis.redis.ops.op_block_key_scheme` on every shard (each shard's namespace
    records the scheme); the scheme recorded (None: none yet on some shard)."""
    found = yield from on_every_shard(core, lambda s: op_block_key_scheme(s, scheme, record))
    schemes = list(found.values())
    return schemes[0] if schemes and all(s is not None for s in schemes) else None

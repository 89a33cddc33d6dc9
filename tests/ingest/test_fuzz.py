"""Fuzzing the ingester with random and mutated msgpack payloads.

The ingester must never raise, and the index it builds must equal the one a plain reference
model builds by applying every decodable event one Index call at a time (the llm-d pool way),
which checks batching, the parent cache and same-batch barriers against sequential semantics.
Chains here end on index-block boundaries, also those of 8-token pages (kept to a KV-cache group
of their own, as a pod's page size is learned per group); pages ending inside an index block,
and the records that continue them, have their own tests against the pods' truth in
``test_fidelity.py`` and ``test_branches.py``.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvredis.errors import EngineKeyNotFoundError
from kvredis.features import BlockExtraFeatures, MMHash, split_extra_keys
from kvredis.hashing import ChunkedTokenDatabase
from kvredis.ingest import EventIngester, IngesterConfig, group_engine_key
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    decode_batch,
    encode_batch,
)
from kvredis.memory import InMemoryIndex
from kvredis.types import KeyType, PodEntry


def _fuzz_settings(examples: int) -> settings:
    """Derandomized in the suite (CI stays deterministic); ``KVREDIS_FUZZ_EXAMPLES=N`` runs N
    random examples per test instead, for a long search."""
    wanted = os.environ.get("KVREDIS_FUZZ_EXAMPLES")
    return settings(
        max_examples=int(wanted) if wanted else examples,
        derandomize=not wanted,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


TP = ChunkedTokenDatabase()
POD, MODEL = "pod-f", "model-f"
TOPIC = f"kv@{POD}@{MODEL}"
CONFIG = IngesterConfig(peer_grace_s=0.0, poll_interval_s=0.001)

# -- an independent reference: one Index call per event ----------------------------------


def _features(
    parsed: list[BlockExtraFeatures | None] | None,
    blocks: int,
    n_tokens: int,
    n_hashes: int,
    engine_block_size: int,
) -> list[BlockExtraFeatures | None] | None:
    """Extra keys per index block. More engine blocks than index blocks: with one list per
    engine block, an index block takes the items of every engine block whose tokens it shares
    (the tokens split evenly over the engine blocks when they can, else each engine block
    covers ``engine_block_size`` tokens, cut at the end); otherwise the lists spread by index."""
    if not parsed:
        return None
    n = len(parsed)
    size = TP.block_size()

    def shares(j: int, i: int) -> bool:
        if n != n_hashes:
            return j * blocks // n == i
        per = n_tokens // n if n_tokens % n == 0 else max(engine_block_size, 1)
        lo, hi = min(j * per, n_tokens), min((j + 1) * per, n_tokens)
        return lo < (i + 1) * size and hi > i * size

    out: list[BlockExtraFeatures | None] = []
    for i in range(blocks):
        if n <= blocks:
            out.append(parsed[i * n // blocks])
            continue
        ids: list[str] = []
        before: list[str] = []
        for j in (j for j in range(n) if shares(j, i)):
            nxt = [m.hash for m in parsed[j].mm_hashes] if parsed[j] is not None else []
            overlap = max(
                k
                for k in range(len(nxt) + 1)
                if k <= len(before) and before[len(before) - k :] == nxt[:k]
            )
            ids += nxt[overlap:]
            before = nxt
        out.append(BlockExtraFeatures([MMHash(x) for x in ids]) if ids else None)
    return out if any(f is not None and f.mm_hashes for f in out) else None


def _request_key(index: InMemoryIndex, engine_key: int) -> int | None:
    try:
        return index.get_request_key(engine_key)
    except EngineKeyNotFoundError:
        return None


def reference_apply(
    index: InMemoryIndex, events: tuple[Event, ...], seen: set[int], ends: dict[int, int]
) -> None:
    """The events one Index call at a time; a reset clears the GPU tier (vLLM keeps its CPU
    copies), and each KV-cache group's engine keys are its own (``group_engine_key``).

    ``ends`` is what an ingester remembers of the pod's chains: the request key each stored
    event's last engine key ends on. A parent resolves through it first, then through the index:
    a reset clears the entries (and with them the index's mappings), not what the engine keys
    name, so a chain continued from a remembered end gets its true keys. An end is forgotten
    when the pod removes its key or stores it again inside a chain."""

    def resolve_parent(engine_key: int) -> int | None:
        found = ends.get(engine_key)
        return found if found is not None else _request_key(index, engine_key)

    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            index.clear_entries(POD, device_tiers={"gpu"})
            continue
        tier = ev.medium.lower() if ev.medium else "gpu"
        group = ev.group_idx
        entry = PodEntry(POD, tier, has_group=group is not None, group_idx=group or 0)

        def key(h: int, group: int | None = group) -> int:
            return group_engine_key(h, group)

        if isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                index.evict(key(h), KeyType.ENGINE, [entry])
                ends.pop(key(h), None)
            continue
        blocks = len(ev.token_ids) // TP.block_size()
        if not ev.token_ids:
            resolved: list[int] = []
            for h in ev.block_hashes:
                r = _request_key(index, key(h))
                if r is not None and r not in resolved:
                    resolved.append(r)
            if resolved:
                index.add(None, resolved, [entry])
            continue
        parent = 0
        if ev.parent_block_hash:
            found = resolve_parent(key(ev.parent_block_hash))
            if found is None:
                continue
            parent = found
        try:
            split = split_extra_keys(
                None if ev.extra_keys is None else list(ev.extra_keys),
                lora_name=ev.lora_name,
                chain_start=not ev.parent_block_hash,
            )
        except ValueError:
            continue
        feats = _features(
            split.features, blocks, len(ev.token_ids), len(ev.block_hashes), ev.block_size
        )
        salt = split.cache_salt if not ev.parent_block_hash else None
        request = TP.tokens_to_kv_block_keys(
            parent, ev.token_ids, ev.lora_name or MODEL, feats, cache_salt=salt
        )
        seen.update(request)
        engine = [key(h) for h in ev.block_hashes]
        index.add(engine, request, [entry])
        if engine and request:
            for inner in engine[:-1]:
                ends.pop(inner, None)
            ends[engine[-1]] = request[-1]


# -- strategies -----------------------------------------------------------------------------

engine_keys = st.integers(0, 12) | st.integers(2**63 - 2, 2**63 + 2)
token_runs = st.sampled_from([0, 16, 32, 48]).flatmap(
    lambda n: st.lists(st.integers(0, 3), min_size=n, max_size=n).map(tuple)
)
mediums = st.sampled_from([None, "GPU", "CPU", "cpu"])
groups = st.sampled_from([None, None, 0, 1])
extra = st.none() | st.lists(
    st.none() | st.lists(st.sampled_from(["img-1", "img-2", "aud"]), max_size=2), max_size=4
).map(tuple)

whole_pages = st.builds(
    BlockStored,
    block_hashes=st.lists(engine_keys, max_size=4).map(tuple),
    parent_block_hash=st.none() | engine_keys,
    token_ids=token_runs,
    block_size=st.sampled_from([16, 32]),
    medium=mediums,
    lora_name=st.sampled_from([None, None, "lora-x"]),
    extra_keys=extra,
    group_idx=groups,
)

FINE_GROUP = 2
"""The KV-cache group of the 8-token pages: a pod's page size is learned per group, and a
group once seen with pages that can end inside an index block maps every later page of it
page by page."""


@st.composite
def fine_pages(draw: st.DrawFn) -> BlockStored:
    """An event of 8-token pages, its hashes splitting its tokens into whole index blocks (one
    hash per 16, 32 or 48 tokens), so every chain still ends on a block boundary: page by page
    mapping, derived boundary keys and parents resolved through them, without the partial-block
    records the reference does not model."""
    tokens = draw(token_runs)
    blocks = len(tokens) // TP.block_size()
    if blocks:
        count = draw(st.sampled_from([k for k in range(1, 4) if blocks % k == 0]))
    else:
        count = draw(st.integers(0, 4))  # no tokens: a tier update of stored pages
    return BlockStored(
        tuple(draw(st.lists(engine_keys, min_size=count, max_size=count))),
        draw(st.none() | engine_keys),
        tokens,
        8,
        medium=draw(mediums),
        lora_name=draw(st.sampled_from([None, None, "lora-x"])),
        extra_keys=draw(extra),
        group_idx=FINE_GROUP,
    )


stored = st.one_of(whole_pages, whole_pages, fine_pages())
removed = st.builds(
    BlockRemoved,
    st.lists(engine_keys, max_size=3).map(tuple),
    mediums,
    st.sampled_from([None, None, 0, 1, FINE_GROUP]),
)
event = st.one_of(stored, stored, removed, st.just(AllBlocksCleared()))

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "medium", "x"]), inner, max_size=5
        )
    ),
    max_leaves=25,
)
raw_event = st.one_of(
    msgpack_values,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "Nope"])},
        optional={
            "block_hashes": msgpack_values,
            "token_ids": msgpack_values,
            "parent_block_hash": msgpack_values,
            "medium": msgpack_values,
            "group_idx": msgpack_values,
            "extra_keys": msgpack_values,
        },
    ),
)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["valid", "valid", "mixed", "mutated", "random"]))
    fmt = draw(st.sampled_from(["map", "array"]))
    if kind == "random":
        return msgpack.packb(draw(msgpack_values), use_bin_type=True)  # type: ignore[no-any-return]
    events: list[Any] = draw(st.lists(event, max_size=5))
    if kind == "mixed":
        for _ in range(draw(st.integers(1, 3))):
            events.insert(draw(st.integers(0, len(events))), draw(raw_event))
    data = bytearray(encode_batch(events, fmt=fmt))
    if kind == "mutated":
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            pos = draw(st.integers(0, max(0, len(data) - 1)))
            if op == "flip" and data:
                data[pos] ^= draw(st.integers(1, 255))
            elif op == "cut":
                del data[pos:]
            else:
                data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


@st.composite
def engine_streams(draw: st.DrawFn) -> list[bytes]:
    """Batches shaped like an engine's: chains continue stored blocks, removals and tier moves
    name stored blocks, so parents resolve (or just got evicted) as in production."""
    stored: list[int] = []
    next_hash = [1]

    def fresh(n: int) -> tuple[int, ...]:
        out = []
        for _ in range(n):
            if stored and draw(st.integers(0, 9)) == 0:
                out.append(draw(st.sampled_from(stored)))  # an engine hash seen before
            else:
                out.append(next_hash[0])
                next_hash[0] += 1
        return tuple(out)

    batches: list[bytes] = []
    for _ in range(draw(st.integers(1, 7))):
        events: list[Any] = []
        for _ in range(draw(st.integers(1, 6))):
            action = draw(st.sampled_from(["root", "child", "child", "remove", "tier", "clear"]))
            medium, group = draw(mediums), draw(groups)
            if action in ("root", "child"):
                engine_bs = draw(st.sampled_from([16, 32]))
                n_engine = draw(st.integers(1, 3))
                tokens = tuple(
                    draw(
                        st.lists(
                            st.integers(0, 3),
                            min_size=n_engine * engine_bs,
                            max_size=n_engine * engine_bs,
                        )
                    )
                )
                parent = draw(st.sampled_from(stored)) if action == "child" and stored else None
                hashes = fresh(n_engine)
                keys_extra = draw(extra) if draw(st.booleans()) else None
                events.append(
                    BlockStored(
                        hashes,
                        parent,
                        tokens,
                        engine_bs,
                        medium=medium,
                        group_idx=group,
                        extra_keys=keys_extra,
                    )
                )
                stored.extend(hashes)
            elif action == "remove" and stored:
                events.append(
                    BlockRemoved(
                        tuple(draw(st.lists(st.sampled_from(stored), min_size=1, max_size=2))),
                        medium,
                        group,
                    )
                )
            elif action == "tier" and stored:
                hashes = tuple(draw(st.lists(st.sampled_from(stored), min_size=1, max_size=3)))
                events.append(BlockStored(hashes, None, (), 16, medium="CPU", group_idx=group))
            elif action == "clear" and draw(st.integers(0, 3)) == 0:
                events.append(AllBlocksCleared())
        batches.append(encode_batch(events, fmt=draw(st.sampled_from(["map", "array"]))))
    return batches


@_fuzz_settings(150)
@given(engine_streams())
def test_engine_like_streams_match_the_reference(batch_payloads: list[bytes]) -> None:
    assert _chains_end_on_block_boundaries(batch_payloads)
    check_against_reference(batch_payloads)


@_fuzz_settings(100)
@given(st.lists(payloads(), min_size=1, max_size=8))
def test_random_and_mutated_payloads_match_the_reference(batch_payloads: list[bytes]) -> None:
    assume(_chains_end_on_block_boundaries(batch_payloads))
    check_against_reference(batch_payloads)


def _chains_end_on_block_boundaries(payloads: list[bytes]) -> bool:
    """Whether every page of the stored events ends on an index-block boundary, as far as the
    ingester can tell: events of whole blocks, and in a KV-cache group once seen with pages of
    a size not dividing into whole blocks (a mutated ``block_size``), pages spanning whole
    blocks (the tokens split evenly over the hashes when they can, else ``block_size`` each)."""
    size = TP.block_size()
    fine: set[int] = set()
    for payload in payloads:
        for ev in decode_batch(payload).events:
            if not isinstance(ev, BlockStored) or not ev.token_ids:
                continue
            n, k, bs = len(ev.token_ids), len(ev.block_hashes), ev.block_size
            if n % size:
                return False
            if bs <= 0 or bs % size:
                fine.add(ev.group_idx or 0)
            if k and (ev.group_idx or 0) in fine:
                per = n // k if n % k == 0 else max(bs, 1)
                if any(min((j + 1) * per, n) % size for j in range(k)):
                    return False
    return True


def check_against_reference(batch_payloads: list[bytes]) -> None:
    index, ref = InMemoryIndex(), InMemoryIndex()
    ing = EventIngester(index, TP, config=CONFIG)
    request_keys: set[int] = set()
    ends: dict[int, int] = {}
    engine: set[int] = set()
    for seq, payload in enumerate(batch_payloads):
        ing.process(TOPIC, seq, payload)  # must not raise
        decoded = decode_batch(payload)
        reference_apply(ref, decoded.events, request_keys, ends)
        for ev in decoded.events:
            if not isinstance(ev, AllBlocksCleared):
                engine.update(ev.block_hashes)
    for key in request_keys:
        got, want = index.lookup([key]).get(key, []), ref.lookup([key]).get(key, [])
        assert set(got) == set(want), key
        assert all(e.pod_identifier == POD and e.device_tier for e in got)
    for key in engine:
        assert _request_key(index, key) == _request_key(ref, key), key
    c = ing.counters.snapshot()
    assert c["batches"] == len(batch_payloads)
    assert c["batches_failed"] == c["batches_abandoned"] == 0
    assert c["events"] == sum(decode_batch(p).total_events for p in batch_payloads)


@_fuzz_settings(60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([b"", b"kv@p1@m", b"kv@p2@m", b"kv@@", b"\xff\xfe", b"kv@p1@m@x"]),
            st.integers(-3, 12) | st.integers(2**47 - 3, 2**64),
            payloads(),
        ),
        max_size=10,
    )
)
def test_arbitrary_messages_never_raise_and_keep_entries_well_formed(
    messages: list[tuple[bytes, int, bytes]],
) -> None:
    index = InMemoryIndex()
    ing = EventIngester(index, TP, config=CONFIG)
    for topic, seq, payload in messages:
        ing.process(topic, seq, payload, "fuzz-endpoint")
    c = ing.counters.snapshot()
    assert c["messages"] == len(messages)
    assert c["batches_failed"] == 0
    for key in range(13):
        try:
            request = index.get_request_key(key)
        except EngineKeyNotFoundError:
            continue
        for entry in index.lookup([request]).get(request, []):
            assert entry.pod_identifier in {"p1", "p2"}
            assert entry.device_tier in {"gpu", "cpu"}


@pytest.mark.parametrize(
    "event",
    [
        # 12 tokens per engine block: the image of block 2 spans index blocks 1 and 2
        BlockStored((0, 0, 0, 0), None, (0,) * 48, 8, extra_keys=(None, None, ("img-1",), None)),
        # more extra-key lists than engine blocks: spread by index
        BlockStored((1, 2, 3), None, (0,) * 48, 16, extra_keys=(None, None, ("img-1",), None)),
        # 16 tokens over 3 engine blocks of 8: the third covers no token, nor does its image
        BlockStored((0, 0, 0), None, (0,) * 16, 8, extra_keys=(None, None, ("img-1",))),
    ],
)
def test_extra_keys_of_engine_blocks_that_straddle_index_blocks(event: BlockStored) -> None:
    check_against_reference([encode_batch([event])])


@pytest.mark.parametrize("reset_alone", [False, True])
def test_a_reset_keeps_the_chain_ends_its_own_batch_stored_before_it(reset_alone: bool) -> None:
    """A reset clears the rank's entries, not what its chain ends say: a chain whose end was
    stored earlier in the reset's own batch continues afterwards exactly as one whose end came
    in a batch before it (the same index, however the engine's events were batched)."""
    stored, child = BlockStored((3,), None, (0,) * 16, 16), BlockStored((5,), 3, (0,) * 32, 32)
    batches = [[stored], [AllBlocksCleared()], [child]] if reset_alone else None
    batches = batches or [[stored, AllBlocksCleared()], [child]]
    index = InMemoryIndex()
    ing = EventIngester(index, TP, config=CONFIG)
    for seq, events in enumerate(batches):
        ing.process(TOPIC, seq, encode_batch(list(events)))
    first, *continued = TP.tokens_to_kv_block_keys(0, (0,) * 48, MODEL, None)
    held = {k: index.lookup([k]).get(k) for k in (first, *continued)}  # each key alone
    assert held == {first: None, **{k: [PodEntry(POD, "gpu")] for k in continued}}
    assert index.get_request_key(5) == continued[-1]
    check_against_reference([encode_batch(list(events)) for events in batches])

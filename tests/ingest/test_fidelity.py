"""Engine fidelity: what real vLLM 0.34 and SGLang 0.5.23 publish gets every full block's key.

Every message is built by :mod:`tests.ingest.wire` in the engines' own wire shapes, goes through
:class:`~kvredis.ingest.EventIngester` (what ``kvredis ingest`` runs) into every backend of the
``index`` fixture (in-memory and a real Redis), and is then looked up with the keys a router
computes for the prompt.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from typing import Any

import pytest

from kvredis.features import (
    PROMPT_EMBEDS_PREFIX,
    BlockExtraFeatures,
    MMHash,
    PlaceholderRange,
    compute_block_extra_features,
)
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.indexer import Indexer
from kvredis.ingest import EndpointConfig, EventIngester, IngesterConfig
from kvredis.ingest.journal import journal_for
from kvredis.scoring import LongestPrefixScorer
from kvredis.tiers import TierMap
from kvredis.types import PodEntry
from tests.ingest.engine import FakeEngine, wait_until
from tests.ingest.wire import (
    all_cleared,
    sglang_batch,
    sglang_pages,
    vllm_batch,
    vllm_map_batch,
    vllm_offload_placeholder,
    vllm_removed,
    vllm_stored,
)

MODEL = "base-model"
LORA = "sql-lora"
TP16 = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=16))
TP64 = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=64))
PROMPT = tuple(range(1000, 1128))  # 128 tokens


def ingest(
    index: Any,
    payloads: Sequence[bytes],
    tp: ChunkedTokenDatabase = TP16,
    pod: str = "pod-a",
    ing: EventIngester | None = None,
) -> EventIngester:
    """Feed ``payloads`` as the next messages of ``pod``'s publisher (one stream per pod)."""
    ing = EventIngester(index, tp) if ing is None else ing
    for payload in payloads:
        streams = _SEQ.setdefault(ing, {})
        seq = streams[pod] = streams.get(pod, -1) + 1
        ing.process(f"kv@{pod}@{MODEL}", seq, payload, endpoint=pod)
    return ing


# The next sequence number of each ingester's pod streams. Keyed by the ingester itself, held
# weakly: an id() could be reused by a later test's ingester and start its streams mid-way.
_SEQ: weakref.WeakKeyDictionary[EventIngester, dict[str, int]] = weakref.WeakKeyDictionary()


def hits(index: Any, keys: Sequence[int], pod: str = "pod-a") -> int:
    """How many of the router's keys, from the first, the pod holds."""
    found = index.lookup(list(keys), {pod})
    n = 0
    for key in keys:
        if key not in found:
            break
        n += 1
    return n


# -- vLLM extra keys ----------------------------------------------------------------------------


def test_lora_name_is_not_a_feature(index: Any) -> None:
    tokens = PROMPT[:64]
    event = vllm_stored(
        [1, 2, 3, 4],
        None,
        tokens,
        16,
        lora_id=1,
        lora_name=LORA,
        extra_keys=[[LORA]] * 4,
        group_idx=0,
    )
    ingest(index, [vllm_batch([event])])
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, LORA)) == 4
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 0


def test_cache_salt_isolates_and_matches(index: Any) -> None:
    tokens = PROMPT[:64]
    salted = vllm_stored([1, 2], None, tokens[:32], 16, extra_keys=[["salt-1"], None])
    more = vllm_stored([3, 4], 2, tokens[32:], 16)
    ingest(index, [vllm_batch([salted]), vllm_batch([more])])
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, cache_salt="salt-1")) == 4
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 0
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, cache_salt="salt-2")) == 0


def test_lora_image_and_salt_together(index: Any) -> None:
    tokens = PROMPT[:64]
    image = PlaceholderRange(4, 20)  # tokens 4..23: blocks 0 and 1
    extra = [[LORA, ["img-a", 4], "salt-1"], [LORA, ["img-a", -12]], [LORA], [LORA]]
    event = vllm_stored([1, 2, 3, 4], None, tokens, 16, lora_name=LORA, extra_keys=extra)
    ingest(index, [vllm_batch([event])])
    feats = compute_block_extra_features({"image": ["img-a"]}, {"image": [image]}, 16, 64)
    want = TP16.tokens_to_kv_block_keys(0, tokens, LORA, feats, cache_salt="salt-1")
    assert hits(index, want) == 4
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, LORA, feats)) == 0
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, LORA, cache_salt="salt-1")) == 0


def test_legacy_bare_identifiers_still_work(index: Any) -> None:
    tokens = PROMPT[:64]
    event = vllm_stored(
        [1, 2, 3, 4], None, tokens, 16, extra_keys=[["img-a"], ["img-a"], None, None]
    )
    ingest(index, [vllm_batch([event])])
    feats = compute_block_extra_features(
        {"image": ["img-a"]}, {"image": [PlaceholderRange(0, 32)]}, 16, 64
    )
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, feats)) == 4


def test_prompt_embedding_digests_are_features(index: Any) -> None:
    tokens = (0,) * 32
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(2)]
    event = vllm_stored([1, 2], None, tokens, 16, extra_keys=[[d] for d in digests])
    ingest(index, [vllm_batch([event])])
    feats = [BlockExtraFeatures([MMHash(PROMPT_EMBEDS_PREFIX + d.hex())]) for d in digests]
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL, feats)) == 2
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 0


def test_batch_as_a_map(index: Any) -> None:
    tokens = PROMPT[:32]
    ingest(index, [vllm_map_batch([vllm_stored([1, 2], None, tokens, 16)], data_parallel_rank=0)])
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 2


# -- SGLang -------------------------------------------------------------------------------------


def test_sglang_salt_and_lora_fields(index: Any) -> None:
    tokens = PROMPT[:64]
    events, _ = sglang_pages(tokens, 16, 5000, cache_salt="s", lora_name=LORA)
    ingest(index, [sglang_batch(events)])
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, LORA, cache_salt="s")) == 4


def test_sglang_eagle_bigram_pages_hash_like_plain_pages(index: Any) -> None:
    tokens = PROMPT[:64]
    first, last = sglang_pages(tokens[:40], 1, 100, bigram_next=tokens[40])
    second, _ = sglang_pages(tokens[40:], 1, 200, parent=last, bigram_next=7)
    ingest(index, [sglang_batch(first), sglang_batch(second)])
    assert hits(index, TP16.tokens_to_kv_block_keys(0, tokens, MODEL)) == 4


# -- partial-block tails ------------------------------------------------------------------------

SPLITS = [(40, 24, 64), (7, 20, 37, 64), (64, 64), (1,) * 20 + (108,)]


def sglang_nodes(
    split: Sequence[int], page: int, tokens: Sequence[int] = PROMPT, first_hash: int = 1
) -> list[bytes]:
    """SGLang batches of radix nodes continuing one chain of ``tokens``, ``split`` tokens each
    (page hashes from ``first_hash`` on)."""
    payloads, parent, start, h = [], None, 0, first_hash
    for size in split:
        events, parent = sglang_pages(tokens[start : start + size], page, h, parent)
        payloads.append(sglang_batch(events))
        start += size
        h += size
    return payloads


@pytest.mark.parametrize("tp", [TP16, TP64], ids=["index16", "index64"])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("split", SPLITS, ids=["40+24", "7+20+37", "64+64", "1x20+108"])
def test_every_full_block_however_the_engine_splits(
    index: Any, tp: ChunkedTokenDatabase, page: int, split: Sequence[int]
) -> None:
    ingest(index, sglang_nodes(split, page), tp)
    want = tp.tokens_to_kv_block_keys(0, PROMPT, MODEL)
    assert hits(index, want) == len(want)


def test_vllm_engine_blocks_smaller_than_index_blocks(index: Any) -> None:
    # vLLM publishes the blocks each scheduler step filled: 5 blocks, then 3 more.
    first = vllm_stored([1, 2, 3, 4, 5], None, PROMPT[:80], 16)
    second = vllm_stored([6, 7, 8], 5, PROMPT[80:], 16)
    ing = ingest(index, [vllm_batch([first]), vllm_batch([second])], TP64)
    assert hits(index, TP64.tokens_to_kv_block_keys(0, PROMPT, MODEL)) == 2
    # Removing an engine block that an index block spans removes that index block.
    ingest(index, [vllm_batch([vllm_removed([6])])], TP64, ing=ing)
    assert hits(index, TP64.tokens_to_kv_block_keys(0, PROMPT, MODEL)) == 1


def test_image_across_a_split(index: Any) -> None:
    image = PlaceholderRange(30, 20)  # tokens 30..49, split at 40
    first = vllm_stored(
        list(range(1, 41)),
        None,
        PROMPT[:40],
        1,
        extra_keys=[None] * 30 + [[["img", 30 - i]] for i in range(30, 40)],
    )
    second = vllm_stored(
        list(range(41, 65)),
        40,
        PROMPT[40:64],
        1,
        extra_keys=[[["img", 30 - i]] for i in range(40, 50)] + [None] * 14,
    )
    ingest(index, [vllm_batch([first]), vllm_batch([second])])
    feats = compute_block_extra_features({"image": ["img"]}, {"image": [image]}, 16, 64)
    assert hits(index, TP16.tokens_to_kv_block_keys(0, PROMPT[:64], MODEL, feats)) == 4


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_a_continuation_another_replica_stored(index: Any, journal: bool) -> None:
    # Replica A stored the first event (a 40-token chain end); replica B only sees the second.
    # B recalls A's page records from the pod's journal; without one (no journal, or an index
    # that keeps none) B counts a parent miss and writes nothing, not a wrong key.
    first = sglang_batch(sglang_pages(PROMPT[:40], 1, 1)[0])
    second = sglang_batch(sglang_pages(PROMPT[40:64], 1, 41, parent=40)[0])
    ingest(index, [first])
    b = EventIngester(index, TP16, config=IngesterConfig(page_journal=journal))
    b.process(f"kv@pod-a@{MODEL}", 0, second, endpoint="replica-b")
    want = TP16.tokens_to_kv_block_keys(0, PROMPT[:64], MODEL)
    if journal and journal_for(index) is not None:
        assert b.counters.snapshot()["parent_misses"] == 0
        assert hits(index, want) == 4
        return
    assert b.counters.snapshot()["parent_misses"] == 1
    assert hits(index, want) == 2  # the blocks A could hash; B wrote nothing, not a wrong key
    assert set(index.lookup(want[2:])) == set()


# -- locality and tiers -------------------------------------------------------------------------


def test_remote_copies_are_their_own_entries(index: Any) -> None:
    tokens = PROMPT[:32]
    local = vllm_stored([1, 2], None, tokens, 16, group_idx=0)
    remote = vllm_stored([1, 2], None, tokens, 16, medium="STORAGE", locality="REMOTE", group_idx=0)
    ing = ingest(index, [vllm_batch([local, remote])])
    keys = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
    local_entry = PodEntry("pod-a", "gpu", has_group=True, group_idx=0)
    remote_entry = PodEntry("pod-a", "storage:remote", has_group=True, group_idx=0)
    assert set(index.lookup(keys)[keys[0]]) == {local_entry, remote_entry}
    removed = vllm_removed([1, 2], medium="STORAGE", locality="REMOTE", group_idx=0)
    ingest(index, [vllm_batch([removed])], ing=ing)
    assert set(index.lookup(keys)[keys[0]]) == {local_entry}


def test_ingester_config_carries_the_tier_map(index: Any) -> None:
    tiers = TierMap.from_dict({"mediums": {"STORAGE": "disk"}, "defaultTier": "hbm"})
    ing = EventIngester(index, TP16, config=IngesterConfig(tiers=tiers))
    tokens = PROMPT[:32]
    plain = vllm_stored([1, 2], None, tokens, 16, medium=None, group_idx=0)
    stored = vllm_stored([3, 4], None, tokens, 16, medium="STORAGE", group_idx=0)
    ingest(index, [vllm_batch([plain, stored])], ing=ing)
    keys = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
    assert set(index.lookup(keys)[keys[0]]) == {
        PodEntry("pod-a", "hbm", has_group=True, group_idx=0),
        PodEntry("pod-a", "disk", has_group=True, group_idx=0),
    }


def test_remote_block_scores_below_a_local_one(index: Any) -> None:
    tokens = PROMPT[:32]
    ingest(index, [vllm_batch([vllm_stored([1, 2], None, tokens, 16)])], pod="pod-local")
    remote = vllm_stored([1, 2], None, tokens, 16, locality="REMOTE")
    ingest(index, [vllm_batch([remote])], pod="pod-remote")
    pinned = sglang_pages(tokens, 16, 1, medium="CPU_PINNED")[0]
    ingest(index, [sglang_batch(pinned)], pod="pod-pinned")
    scores = Indexer(index, TP16, LongestPrefixScorer()).score_tokens(tokens, MODEL)
    assert scores["pod-local"] > scores["pod-remote"] > 0
    assert scores["pod-local"] > scores["pod-pinned"] > 0


@pytest.mark.parametrize("split", [(40, 24), (7, 20, 37)], ids=["40+24", "7+20+37"])
def test_ha_replicas_take_turns_and_agree(index: Any, split: Sequence[int]) -> None:
    # Both replicas receive every batch of the stream; whoever comes first applies it, the other
    # finds it applied. Each one plans every batch, so each knows every tail: the keys are the
    # same whichever replica applies which batch.
    payloads = sglang_nodes(split, 1)
    replicas = [EventIngester(index, TP16), EventIngester(index, TP16)]
    for seq, payload in enumerate(payloads):
        order = replicas if seq % 2 == 0 else replicas[::-1]
        for ing in order:
            ing.process(f"kv@pod-a@{MODEL}", seq, payload, endpoint="engine-a")
    want = TP16.tokens_to_kv_block_keys(0, PROMPT[: sum(split)], MODEL)
    assert hits(index, want) == len(want) == 4
    for ing in replicas:
        assert ing.counters.snapshot().get("parent_misses", 0) == 0


def test_ha_branches_from_a_learned_tail(index: Any) -> None:
    # Node A (40 tokens) and its child B (24) are applied by replica 1; replica 2 only learns
    # them, then applies C, a second child of A: its keys must continue A, not B.
    a_events, a_last = sglang_pages(PROMPT[:40], 1, 1)
    b_events, _ = sglang_pages(PROMPT[40:64], 1, 100, parent=a_last)
    other = tuple(range(5000, 5024))
    c_events, _ = sglang_pages(other, 1, 200, parent=a_last)
    one, two = EventIngester(index, TP16), EventIngester(index, TP16)
    topic = f"kv@pod-a@{MODEL}"
    for seq, events in enumerate([a_events, b_events]):
        one.process(topic, seq, sglang_batch(events), endpoint="engine-a")
        two.process(topic, seq, sglang_batch(events), endpoint="engine-a")
    two.process(topic, 2, sglang_batch(c_events), endpoint="engine-a")
    assert two.counters.snapshot()["batches_applied"] == 1
    for tokens in (PROMPT[:64], PROMPT[:40] + other):
        want = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
        assert hits(index, want) == 4


# -- data-parallel ranks, hybrid groups, prefix-cache resets --------------------------------------


class DPPod:
    """One pod's data-parallel ranks as vLLM 0.34 runs them: each rank its own publisher (the
    endpoint's port offset by the rank), all on the topic ``kv@POD@MODEL``, each batch carrying
    its ``data_parallel_rank``."""

    def __init__(self, index: Any, ranks: int = 2, pod: str = "pod-a") -> None:
        self.ing = EventIngester(index, TP16)
        self.topic = f"kv@{pod}@{MODEL}"
        self.seq = [0] * ranks

    def send(self, rank: int, *events: Any) -> None:
        payload = vllm_batch(list(events), data_parallel_rank=rank)
        endpoint = f"tcp://127.0.0.1:{5557 + rank}"
        self.ing.process(self.topic, self.seq[rank], payload, endpoint=endpoint)
        self.seq[rank] += 1


def score(index: Any, tokens: Sequence[int]) -> dict[str, float]:
    return Indexer(index, TP16, LongestPrefixScorer()).score_tokens(tokens, MODEL)


def gpu(group: int = 0, rank: int = 0) -> PodEntry:
    return PodEntry("pod-a", "gpu", has_group=True, group_idx=group, dp_rank=rank)


def test_dp_ranks_hold_a_shared_prefix_on_their_own(index: Any) -> None:
    tokens = PROMPT[:64]
    pod = DPPod(index)
    kind = "full_attention"
    for rank in (0, 1):
        pod.send(
            rank, vllm_stored([1, 2, 3, 4], None, tokens, 16, group_idx=0, kv_cache_spec_kind=kind)
        )
    keys = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
    assert score(index, tokens) == {"pod-a": 4.0}  # two ranks holding a block: scored once
    pod.send(0, vllm_removed([1, 2, 3, 4], group_idx=0))
    assert score(index, tokens) == {"pod-a": 4.0}  # rank 1 still holds every block
    assert set(index.lookup(keys)[keys[3]]) == {gpu(rank=1)}
    pod.send(0, vllm_stored([1, 2, 3, 4], None, tokens, 16, group_idx=0))
    assert set(index.lookup(keys)[keys[0]]) == {gpu(rank=0), gpu(rank=1)}
    pod.send(0, vllm_removed([3, 4], group_idx=0))
    pod.send(1, vllm_removed([3, 4], group_idx=0))
    assert score(index, tokens) == {"pod-a": 2.0}
    index.clear("pod-a")  # a pod clear covers every rank
    assert index.lookup(keys) == {}


@pytest.mark.parametrize("cause", ["restart", "gap"])
def test_a_rank_stream_clear_leaves_the_other_ranks(index: Any, cause: str) -> None:
    # Rank 0's publisher restarts (seq goes back to 0) or loses a batch: what rank 0 held is in
    # doubt and is cleared; rank 1's copies are not.
    tokens = PROMPT[:64]
    pod = DPPod(index)
    pod.ing = EventIngester(index, TP16, config=IngesterConfig(peer_grace_s=0.01))
    for rank in (0, 1):
        pod.send(rank, vllm_stored([1, 2, 3, 4], None, tokens, 16, group_idx=0))
    pod.seq[0] = 0 if cause == "restart" else 5
    pod.send(0, vllm_stored([1, 2], None, tokens[:32], 16, group_idx=0))
    assert pod.ing.counters.get("clears") == 1
    keys = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
    found = index.lookup(keys)
    assert [set(found[k]) for k in keys] == [{gpu(0, 0), gpu(0, 1)}] * 2 + [{gpu(0, 1)}] * 2
    assert score(index, tokens) == {"pod-a": 4.0}


def test_one_ranks_reset_leaves_the_chains_the_other_ranks_are_extending(index: Any) -> None:
    # Rank 1 stores a chain that ends inside an index block (pages of one token); rank 0 resets
    # its prefix cache; rank 1's continuation must still hang from the chain rank 1 stored.
    tokens = PROMPT[:32]
    pod = DPPod(index)
    pod.send(1, vllm_stored([1, 2, 3], None, tokens[:3], 1, group_idx=0))
    pod.send(0, all_cleared())
    pod.send(1, vllm_stored(list(range(4, 33)), 3, tokens[3:], 1, group_idx=0))
    assert pod.ing.counters.get("parent_misses") == 0
    keys = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
    assert [set(v) for v in index.lookup(keys).values()] == [{gpu(0, 1)}] * 2


def test_a_groups_page_size_is_its_own(index: Any) -> None:
    # Group 1 stores whole index blocks; group 0 pages of 4 tokens. A branch of group 1 from
    # the middle of its chain hangs from its parent's block as whole-block engines do.
    tokens = PROMPT[:64]
    other = tuple(range(9000, 9016))
    ing = ingest(index, [vllm_batch([vllm_stored([1, 2, 3, 4], None, tokens, 16, group_idx=1)])])
    fine = vllm_stored(list(range(101, 117)), None, tokens, 4, group_idx=0)
    branch = vllm_stored([5], 2, other, 16, group_idx=1)
    ingest(index, [vllm_batch([fine]), vllm_batch([branch])], ing=ing)
    assert ing.counters.get("parent_misses") == 0
    keys = TP16.tokens_to_kv_block_keys(0, (*tokens[:32], *other), MODEL)
    g1 = PodEntry("pod-a", "gpu", has_group=True, group_idx=1)
    assert [g1 in v for v in index.lookup(keys).values()] == [True] * 3


# Index block size 16 (TP16) or 64 (TP64); group 0's and group 1's engine block sizes. vLLM
# hashes at the smallest size and a group of k times that size publishes every k-th hash.
GROUP_SHAPES = [(TP16, 16, 32), (TP16, 32, 64), (TP16, 16, 64), (TP64, 16, 32)]


@pytest.mark.parametrize(
    ("tp", "size0", "size1"), GROUP_SHAPES, ids=["16:16+32", "16:32+64", "16:16+64", "64:16+32"]
)
def test_hybrid_group_eviction_removes_what_its_block_covered(
    index: Any, tp: ChunkedTokenDatabase, size0: int, size1: int
) -> None:
    tokens = PROMPT  # 128 tokens
    hashes = list(range(1, 129 // 16 + 1))  # one per 16 tokens: 1..8
    group_hashes = {g: hashes[size // 16 - 1 :: size // 16] for g, size in ((0, size0), (1, size1))}
    full = vllm_stored(group_hashes[0], None, tokens, size0, group_idx=0)
    window = vllm_stored(
        group_hashes[1],
        None,
        tokens,
        size1,
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
    )
    ing = ingest(index, [vllm_batch([full, window])], tp)
    keys = tp.tokens_to_kv_block_keys(0, tokens, MODEL)
    blocks = len(keys)

    def held(group: int) -> list[int]:
        """Which index blocks hold the group's entry."""
        found = index.lookup(keys)
        want = PodEntry("pod-a", "gpu", has_group=True, group_idx=group)
        out = []
        for i, key in enumerate(keys):
            if key in found and want in found[key]:
                out.append(i)
        return out

    def covered(size: int, engine_hashes: Sequence[int]) -> set[int]:
        """The index blocks the engine blocks named by these hashes hold tokens of."""
        bs = tp.block_size()
        out: set[int] = set()
        for h in engine_hashes:
            end = h * 16
            out.update(range((end - size) // bs, (end - 1) // bs + 1))
        return out

    assert held(0) == held(1) == list(range(blocks))
    # Group 0 evicts its blocks from the last one back: after each, it holds exactly the index
    # blocks no evicted group-0 block held tokens of; group 1 keeps every block.
    evicted: list[int] = []
    for h in reversed(group_hashes[0]):
        ingest(index, [vllm_batch([vllm_removed([h], group_idx=0)])], tp, ing=ing)
        evicted.append(h)
        gone = covered(size0, evicted)
        assert held(0) == [i for i in range(blocks) if i not in gone], f"after evicting {h}"
        assert held(1) == list(range(blocks))
    # Group 1 evicting one block removes only its own entry from the blocks that block held.
    last = group_hashes[1][-1]
    ingest(index, [vllm_batch([vllm_removed([last], group_idx=1)])], tp, ing=ing)
    assert held(1) == [i for i in range(blocks) if i not in covered(size1, [last])]


def test_prefix_cache_reset_keeps_offloaded_copies(index: Any) -> None:
    # vLLM 0.34: reset_prefix_cache() resets the block pools (AllBlocksCleared, on each rank)
    # and keeps the offloading connector's CPU chunks (one block per chunk here, so each
    # placeholder names its block).
    tokens = PROMPT[:64]
    pod = DPPod(index)
    for rank in (0, 1):
        pod.send(rank, vllm_stored([1, 2, 3, 4], None, tokens, 16, group_idx=0))
    pod.send(0, *[vllm_offload_placeholder(h, 0) for h in (1, 2, 3, 4)])
    pod.send(0, all_cleared())
    assert score(index, tokens) == {"pod-a": 4.0}  # rank 1's GPU copies are untouched
    pod.send(1, all_cleared())
    assert score(index, tokens) == {"pod-a": pytest.approx(4 * 0.8)}  # rank 0's CPU copies
    keys = TP16.tokens_to_kv_block_keys(0, tokens, MODEL)
    cpu = PodEntry("pod-a", "cpu", has_group=True, group_idx=0)
    assert all(index.lookup(keys)[k] == [cpu] for k in keys)


def test_offloaded_chunk_credits_every_block(index: Any) -> None:
    # blocks_per_chunk 4, self-describing events off: each CPU event names the chunk's last hash.
    ing = EventIngester(index, TP16, config=IngesterConfig(offload_blocks_per_chunk=4))
    hashes = list(range(1, 9))
    gpu_store = vllm_stored(hashes, None, PROMPT, 16, group_idx=0)
    chunks = [vllm_offload_placeholder(4, 0), vllm_offload_placeholder(8, 0)]
    ingest(index, [vllm_batch([gpu_store]), vllm_batch(chunks)], ing=ing)
    keys = TP16.tokens_to_kv_block_keys(0, PROMPT, MODEL)
    ingest(index, [vllm_batch([vllm_removed([4], group_idx=0)])], ing=ing)
    found = index.lookup(keys)  # the GPU removal of a chunk's last block removes only that block
    assert [gpu(0) in found[k] for k in keys] == [True] * 3 + [False] + [True] * 4
    ingest(index, [vllm_batch([vllm_removed(hashes, group_idx=0)])], ing=ing)
    assert score(index, PROMPT) == {"pod-a": pytest.approx(8 * 0.8)}  # every block on CPU
    # The second chunk leaves the CPU; an ingester that did not see it stored (a restart, an
    # HA peer) removes the whole chunk too: the index maps the chunk to its blocks.
    removed = vllm_removed([8], medium="CPU", group_idx=0)
    fresh = EventIngester(index, TP16, config=IngesterConfig(offload_blocks_per_chunk=4))
    fresh.process(f"kv@pod-a@{MODEL}", 4, vllm_batch([removed]), endpoint="pod-a")
    assert fresh.counters.get("batches_applied") == 1
    assert score(index, PROMPT) == {"pod-a": pytest.approx(4 * 0.8)}
    assert len(index.lookup(keys)) == 4


@pytest.mark.zmq
def test_over_zmq_into_redis(redis_backend_index: Any) -> None:
    # The transport `kvredis ingest` runs: the engine's 3-frame messages on a real socket.
    with FakeEngine(topic=f"kv@pod-a@{MODEL}") as engine:
        ing = EventIngester(redis_backend_index, TP16, [EndpointConfig(engine.endpoint)])
        ing.start()
        try:
            engine.wait_subscribed()
            for payload in sglang_nodes((7, 20, 37), 1):
                engine.publish_payload(payload)
            salted = vllm_stored(
                [1, 2], None, PROMPT[:32], 16, lora_name=LORA, extra_keys=[[LORA, "s"], [LORA]]
            )
            engine.publish_payload(vllm_map_batch([salted]))
            wait_until(lambda: ing.counters.get("batches") >= 4)
            assert ing.wait_idle(10)
        finally:
            assert ing.stop()
    want = TP16.tokens_to_kv_block_keys(0, PROMPT[:64], MODEL)
    assert hits(redis_backend_index, want) == 4
    lora = TP16.tokens_to_kv_block_keys(0, PROMPT[:32], LORA, cache_salt="s")
    assert hits(redis_backend_index, lora) == 2

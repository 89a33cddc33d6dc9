"""LongestPrefixScorer and the Indexer, on every backend (client-side and server-side scoring)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.errors import InvalidInputError
from kvredis.features import BlockExtraFeatures, MMHash
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.indexer import Indexer
from kvredis.memory import InMemoryIndex
from kvredis.scoring import DEFAULT_MEDIUM_WEIGHTS, LongestPrefixScorer
from kvredis.tiers import DEFAULT_TIERS
from kvredis.types import KeyType, PodEntry

MODEL = "test/model-7b"
BLOCK = 4


def E(pod: str, tier: str = "gpu", **kwargs: Any) -> PodEntry:
    return PodEntry(pod, tier, **kwargs)


# -- LongestPrefixScorer -----------------------------------------------------------------------


def test_default_weights() -> None:
    assert (DEFAULT_MEDIUM_WEIGHTS["gpu"], DEFAULT_MEDIUM_WEIGHTS["cpu"]) == (1.0, 0.8)
    assert dict(LongestPrefixScorer().medium_weights) == dict(DEFAULT_MEDIUM_WEIGHTS)
    assert LongestPrefixScorer().weight("nvme") == 1.0  # a tier nobody maps to


# What vLLM 0.34 and SGLang 0.5.23 put in (medium, locality, ownership), and the order of worth.
ENGINE_COPIES = [
    ("GPU", None, None),
    ("CPU", "LOCAL", None),  # vLLM CPU offloading
    ("CPU_PINNED", None, None),  # SGLang host pinned memory
    ("CPU", None, "kvcr"),  # a vLLM KVCR inventory copy
    ("STORAGE", "LOCAL", None),
    ("DISK", None, None),
    ("EXTERNAL", None, None),
    ("STORAGE", "REMOTE", None),
]


def test_default_weights_cover_what_engines_send() -> None:
    scorer = LongestPrefixScorer()
    weights = []
    for medium, locality, ownership in ENGINE_COPIES:
        tier = DEFAULT_TIERS.tier(medium, locality, ownership)
        assert tier in DEFAULT_MEDIUM_WEIGHTS, tier
        weights.append(scorer.weight(tier))
    assert weights == sorted(weights, reverse=True)
    # Pinned host memory is host memory: worth less than GPU, the same as vLLM's CPU tier.
    assert scorer.weight(DEFAULT_TIERS.tier("CPU_PINNED")) == scorer.weight("cpu") < 1.0
    # A remote copy is worth less than the same tier on the pod.
    for base in ("gpu", "cpu", "disk", "storage", "external"):
        assert scorer.weight(base + ":remote") < scorer.weight(base)


def test_pods_score_their_consecutive_prefix_and_drop_out_at_their_first_miss() -> None:
    keys = [10, 11, 12, 13]
    key_to_pods = {
        10: [E("a"), E("b", "cpu"), E("c")],
        11: [E("a"), E("b", "cpu")],
        12: [E("a"), E("c"), E("d")],  # c missed key 11, d never held key 10
        13: [E("a"), E("b", "cpu")],  # b missed key 12
    }
    scores = LongestPrefixScorer().score(keys, key_to_pods)
    assert scores == {"a": 4.0, "b": pytest.approx(1.6), "c": 1.0}
    assert "d" not in scores


def test_highest_tier_weight_counts_once_per_key() -> None:
    keys = [1, 2, 3]
    key_to_pods = {
        1: [E("a", "cpu"), E("a", "gpu"), E("a", "gpu", speculative=True)],
        2: [E("a", "cpu")],
        3: [E("a", "cpu"), E("a", "nvme")],  # unknown tier weighs 1.0, beating cpu
    }
    assert LongestPrefixScorer().score(keys, key_to_pods) == {"a": 1.0 + 0.8 + 1.0}


def test_custom_and_empty_weights() -> None:
    keys = [1, 2]
    key_to_pods = {1: [E("a", "cpu"), E("b", "ssd")], 2: [E("a", "cpu"), E("b", "ssd")]}
    assert LongestPrefixScorer({"cpu": 0.25, "ssd": 3}).score(keys, key_to_pods) == {
        "a": 0.5,
        "b": 6.0,
    }
    assert LongestPrefixScorer({}).score(keys, key_to_pods) == {"a": 2.0, "b": 2.0}
    weights = {"cpu": 0.5}
    scorer = LongestPrefixScorer(weights)
    weights["cpu"] = 9.0  # the scorer keeps its own copy
    assert scorer.score(keys, key_to_pods)["a"] == 1.0
    with pytest.raises(TypeError):
        scorer.medium_weights["cpu"] = 2.0  # type: ignore[index]


def test_each_data_parallel_rank_scores_its_own_prefix() -> None:
    keys = [1, 2, 3]
    # Rank 0 holds blocks 1 and 3, rank 1 block 2: no rank can reuse more than block 1.
    key_to_pods = {1: [E("a")], 2: [E("a", dp_rank=1)], 3: [E("a")]}
    scorer = LongestPrefixScorer()
    assert scorer.score_by_rank(keys, key_to_pods) == {"a": {0: 1.0}}
    assert scorer.score(keys, key_to_pods) == {"a": 1.0}


def test_a_pods_score_is_its_best_ranks() -> None:
    keys = [1, 2, 3, 4]
    key_to_pods = {
        1: [E("a"), E("a", "cpu", dp_rank=1), E("a", dp_rank=2), E("b", "cpu", dp_rank=3)],
        2: [E("a"), E("a", "cpu", dp_rank=1), E("a", dp_rank=2), E("b", "cpu", dp_rank=3)],
        3: [E("a", "cpu", dp_rank=1), E("a", "gpu", dp_rank=1), E("a", dp_rank=2)],
        4: [E("a", dp_rank=1), E("a", dp_rank=2), E("a")],  # rank 0 dropped out at key 3
    }
    scorer = LongestPrefixScorer()
    assert scorer.score_by_rank(keys, key_to_pods) == {
        "a": {0: 2.0, 1: 0.8 + 0.8 + 1.0 + 1.0, 2: 4.0},
        "b": {3: 1.6},
    }
    assert scorer.score(keys, key_to_pods) == {"a": 4.0, "b": 1.6}
    assert scorer.score_by_rank([], key_to_pods) == {}
    assert scorer.score_by_rank([9, 1], key_to_pods) == {}


@settings(max_examples=200, deadline=None)
@given(
    holdings=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.integers(0, 2),
            st.sampled_from(["gpu", "cpu", "x"]),
            st.integers(0, 5),
            st.integers(1, 6),
        ),
        max_size=12,
    )
)
def test_without_ranks_a_pod_scores_as_the_union_of_its_entries(holdings: list[Any]) -> None:
    """With one rank per pod the per-rank race is the per-pod race; with several, each rank's
    score is the race of that rank's entries alone."""
    keys = list(range(6))
    key_to_pods: dict[int, list[PodEntry]] = {}
    for pod, rank, tier, start, end in holdings:
        for key in keys[start:end]:
            key_to_pods.setdefault(key, []).append(E(pod, tier, dp_rank=rank))
    scorer = LongestPrefixScorer({"gpu": 1.0, "cpu": 0.3})
    by_rank = scorer.score_by_rank(keys, key_to_pods)
    for pod, ranks in by_rank.items():
        for rank, total in ranks.items():
            alone = {
                k: [e for e in v if (e.pod_identifier, e.dp_rank) == (pod, rank)]
                for k, v in key_to_pods.items()
            }
            assert scorer.score(keys, alone) == {pod: total}
    for pod, total in scorer.score(keys, key_to_pods).items():
        assert total == max(by_rank[pod].values())


def test_empty_inputs() -> None:
    scorer = LongestPrefixScorer()
    assert scorer.score([], {1: [E("a")]}) == {}
    assert scorer.score([1, 2], {}) == {}
    assert scorer.score([1, 2], {2: [E("a")]}) == {}


@pytest.mark.parametrize(
    "weights",
    [
        {"gpu": "1"},
        {"gpu": True},
        {"gpu": float("nan")},
        {"gpu": float("inf")},
        {1: 1.0},
        [("gpu", 1.0)],
    ],
)
def test_bad_weights_are_rejected(weights: Any) -> None:
    with pytest.raises(InvalidInputError):
        LongestPrefixScorer(weights)


def test_each_data_parallel_rank_is_scored_on_its_own() -> None:
    """A request runs on one rank, and reuses only that rank's copies: rank 0 holding blocks 1
    and 3 of a chain and rank 1 holding block 2 reuse 1 block at most, not the union's 3."""
    keys = [1, 2, 3]
    key_to_pods = {1: [E("a")], 2: [E("a", dp_rank=1)], 3: [E("a")]}
    scorer = LongestPrefixScorer()
    assert scorer.score(keys, key_to_pods) == {"a": 1.0}
    assert scorer.score_by_rank(keys, key_to_pods) == {"a": {0: 1.0}}  # rank 1 misses block 1
    key_to_pods[1].append(E("a", "cpu", dp_rank=1))
    assert scorer.score_by_rank(keys, key_to_pods) == {"a": {0: 1.0, 1: 1.8}}
    assert scorer.score(keys, key_to_pods) == {"a": 1.8}  # the pod's best rank
    # a pod without data parallelism has only rank 0; other pods are scored as before
    key_to_pods[1].append(E("b", "cpu"))
    key_to_pods[2].append(E("b"))
    assert scorer.score_by_rank(keys, key_to_pods) == {"a": {0: 1.0, 1: 1.8}, "b": {0: 1.8}}


def reference_score_by_rank(
    keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]], weights: Mapping[str, float]
) -> dict[str, dict[int, float]]:
    """The definition, (pod, rank) by (pod, rank): sum the best tier weight per key among that
    rank's entries until its first miss."""
    if not keys:
        return {}
    slots = {(e.pod_identifier, e.dp_rank) for e in key_to_pods.get(keys[0], [])}
    out: dict[str, dict[int, float]] = {}
    for pod, rank in slots:
        total = 0.0
        for key in keys:
            tiers = [
                e.device_tier
                for e in key_to_pods.get(key, [])
                if (e.pod_identifier, e.dp_rank) == (pod, rank)
            ]
            if not tiers:
                break
            total += max(weights.get(t, 1.0) for t in tiers)
        out.setdefault(pod, {})[rank] = total
    return out


def reference_score(
    keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]], weights: Mapping[str, float]
) -> dict[str, float]:
    """A pod's score: its best rank's."""
    by_rank = reference_score_by_rank(keys, key_to_pods, weights)
    return {pod: max(ranks.values()) for pod, ranks in by_rank.items()}


ENTRY = st.builds(
    E,
    st.sampled_from(["a", "b", "c", "d"]),
    st.sampled_from(["gpu", "cpu", "x"]),
    dp_rank=st.sampled_from([0, 0, 1, 2]),
)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 8),
    held=st.dictionaries(st.integers(0, 9), st.lists(ENTRY, max_size=6)),
    weights=st.none() | st.dictionaries(st.sampled_from(["gpu", "cpu", "x"]), st.floats(0, 4)),
)
def test_scorer_matches_the_definition(
    n: int, held: dict[int, list[PodEntry]], weights: dict[str, float] | None
) -> None:
    keys = list(range(n))
    w = DEFAULT_MEDIUM_WEIGHTS if weights is None else weights
    scorer = LongestPrefixScorer(weights)
    assert scorer.score_by_rank(keys, held) == reference_score_by_rank(keys, held, w)
    assert scorer.score(keys, held) == reference_score(keys, held, w)


# -- Indexer -----------------------------------------------------------------------------------


@pytest.fixture
def processor() -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=BLOCK))


def prompt(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK))


def test_compute_block_keys_chains_from_the_model_root(processor: ChunkedTokenDatabase) -> None:
    indexer = Indexer(InMemoryIndex(), processor)
    tokens = [*prompt(5), 7, 7]  # a partial tail block is not hashed
    keys = indexer.compute_block_keys(tokens, MODEL)
    assert keys == processor.tokens_to_kv_block_keys(0, tokens, MODEL)
    assert len(keys) == 5
    assert indexer.compute_block_keys(tokens[:8], MODEL) == keys[:2]
    assert indexer.compute_block_keys(tokens, "other/model") != keys
    features: list[BlockExtraFeatures | None] = [None, BlockExtraFeatures([MMHash("img")]), None]
    mm = indexer.compute_block_keys(prompt(3), MODEL, features)
    assert mm[0] == keys[0] and mm[1] != keys[1]


def test_score_tokens_on_every_backend(index: Any, processor: ChunkedTokenDatabase) -> None:
    indexer = Indexer(index, processor)
    tokens = prompt(6)
    keys = indexer.compute_block_keys(tokens, MODEL)
    index.add(None, keys[:4], [E("pod-a")])
    index.add(None, keys, [E("pod-b", "cpu")])
    index.add(None, keys[:2], [E("pod-b", "gpu")])
    index.add(None, keys[1:], [E("pod-c")])  # never held the first block
    assert indexer.score_tokens(tokens, MODEL) == pytest.approx({"pod-a": 4.0, "pod-b": 5.2})
    assert indexer.score_tokens(tokens, MODEL, ["pod-b", "pod-c"]) == pytest.approx({"pod-b": 5.2})
    assert indexer.score_tokens(tokens, MODEL, {"pod-c"}) == {}
    assert indexer.score_tokens(tokens, MODEL, []) == pytest.approx({"pod-a": 4.0, "pod-b": 5.2})
    assert indexer.score_tokens(tokens[: BLOCK - 1], MODEL) == {}  # no full block
    assert indexer.score_tokens([], MODEL) == {}
    assert indexer.score_tokens(tokens, "other/model") == {}
    weighted = Indexer(index, processor, LongestPrefixScorer({"gpu": 2.0, "cpu": 0.5}))
    assert weighted.score_tokens(tokens, MODEL) == pytest.approx({"pod-a": 8.0, "pod-b": 6.0})


def test_score_tokens_by_rank_on_every_backend(index: Any, processor: ChunkedTokenDatabase) -> None:
    """A router that pins the data-parallel rank gets every rank's score; without that, each
    pod's best rank's (never the union of its ranks': rank 0 lost block 3 of 6)."""
    indexer = Indexer(index, processor, LongestPrefixScorer({"gpu": 1.0, "cpu": 0.75}))
    tokens = prompt(6)
    keys = indexer.compute_block_keys(tokens, MODEL)
    index.add(None, keys, [E("pod-a")])
    index.evict(keys[2], KeyType.REQUEST, [E("pod-a")])
    index.add(None, keys[:4], [E("pod-a", "cpu", dp_rank=1)])
    index.add(None, keys[:1], [E("pod-b", dp_rank=2)])
    assert indexer.score_tokens_by_rank(tokens, MODEL) == {
        "pod-a": {0: 2.0, 1: 3.0},
        "pod-b": {2: 1.0},
    }
    assert indexer.score_tokens_by_rank(tokens, MODEL, {"pod-b"}) == {"pod-b": {2: 1.0}}
    assert indexer.score_tokens_by_rank(tokens[: BLOCK - 1], MODEL) == {}
    assert indexer.score_tokens(tokens, MODEL) == {"pod-a": 3.0, "pod-b": 1.0}


def test_client_side_and_server_side_scoring_are_identical(
    redis_backend_index: Any, processor: ChunkedTokenDatabase
) -> None:
    index = redis_backend_index
    score = index.score
    tokens = prompt(40)
    keys = processor.tokens_to_kv_block_keys(0, tokens, MODEL)
    tiers = ["gpu", "cpu", "disk", "x"]
    for p in range(6):
        for t, tier in enumerate(tiers):
            if (p + t) % 3:
                index.add(None, keys[: 40 - 5 * p - t], [E(f"pod-{p}", tier)])
    # Weights whose sums are inexact in binary: any lossy number formatting shows.
    weight_sets: list[dict[str, float] | None] = [
        None,
        {"gpu": 0.1, "cpu": 0.7, "disk": 1 / 3},
        {"gpu": 1e-7, "cpu": 123456.789, "x": 0.0},
        {},
    ]
    for weights in weight_sets:
        scorer = LongestPrefixScorer(weights)
        for pods in (None, ["pod-1", "pod-4", "pod-none"]):
            expected = scorer.score(keys, index.lookup(keys, pods))
            assert len(expected) >= 2
            got = score(keys, scorer.medium_weights, pods)
            assert got == expected, (weights, pods)
            assert Indexer(index, processor, scorer).score_tokens(tokens, MODEL, pods) == expected
    assert score([], None, None) == {}


class ScoringMemoryIndex(InMemoryIndex):
    """An embedded index that also scores on its own, the way the Redis backend does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[int], dict[str, float] | None, Collection[str] | None]] = []

    def score(
        self,
        request_keys: Sequence[int],
        medium_weights: Mapping[str, float] | None = None,
        pod_identifier_set: Collection[str] | None = None,
    ) -> dict[str, float]:
        self.calls.append(
            (
                list(request_keys),
                None if medium_weights is None else dict(medium_weights),
                pod_identifier_set,
            )
        )
        scorer = LongestPrefixScorer(medium_weights)
        return scorer.score(request_keys, self.lookup(request_keys, pod_identifier_set))


def test_indexer_delegates_to_an_index_that_scores(processor: ChunkedTokenDatabase) -> None:
    index = ScoringMemoryIndex()
    tokens = prompt(3)
    keys = processor.tokens_to_kv_block_keys(0, tokens, MODEL)
    index.add(None, keys, [E("pod-a", "cpu")])
    indexer = Indexer(index, processor, LongestPrefixScorer({"cpu": 0.5}))
    assert indexer.score_tokens(tokens, MODEL, ["pod-a"]) == {"pod-a": 1.5}
    assert index.calls == [(keys, {"cpu": 0.5}, ["pod-a"])]
    assert indexer.score_tokens(prompt(3, start=100), MODEL) == {}
    assert len(index.calls) == 2
    assert indexer.score_tokens(tokens[:2], MODEL) == {}  # no keys: the index is not asked
    assert len(index.calls) == 2


def test_a_scorer_that_changes_scoring_is_used_client_side(
    processor: ChunkedTokenDatabase,
) -> None:
    class FirstBlockOnly(LongestPrefixScorer):
        def score(
            self, keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]]
        ) -> dict[str, float]:
            return super().score(keys[:1], key_to_pods)

    index = ScoringMemoryIndex()
    tokens = prompt(3)
    index.add(None, processor.tokens_to_kv_block_keys(0, tokens, MODEL), [E("pod-a")])
    assert Indexer(index, processor, FirstBlockOnly()).score_tokens(tokens, MODEL) == {"pod-a": 1.0}
    assert index.calls == []


def test_add_speculative_scores_until_the_ttl_then_expires(
    index: Any, processor: ChunkedTokenDatabase
) -> None:
    import time

    indexer = Indexer(index, processor)
    tokens = prompt(4)
    keys = indexer.add_speculative(tokens, MODEL, "pod-a", 0.2)
    assert keys == indexer.compute_block_keys(tokens, MODEL)
    assert index.lookup(keys) == {k: [PodEntry("pod-a", speculative=True)] for k in keys}
    index.add(None, keys[:2], [E("pod-b")])
    spec_weight = LongestPrefixScorer().medium_weights.get("", 1.0)
    before = indexer.score_tokens(tokens, MODEL)
    assert before["pod-a"] == pytest.approx(4 * spec_weight) and "pod-b" in before
    time.sleep(0.35)
    assert indexer.score_tokens(tokens, MODEL) == {"pod-b": before["pod-b"]}
    assert indexer.add_speculative(tokens[:1], MODEL, "pod-a", 0.2) == []
    for bad in (0, float("nan"), -1.0):
        with pytest.raises(InvalidInputError):
            indexer.add_speculative(tokens, MODEL, "pod-a", bad)
    named = indexer.add_speculative(tokens=tokens, model=MODEL, pod="pod-c", ttl=60)
    assert named == keys and PodEntry("pod-c", speculative=True) in index.lookup(keys)[keys[0]]

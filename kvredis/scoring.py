"""Scoring pods by the longest prefix of a request's blocks they hold, weighted by device tier."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import reduce
from itertools import repeat
from operator import add
from types import MappingProxyType

from kvredis.errors import InvalidInputError
from kvredis.types import PodEntry

#: Tier weights used when none are given, for every tier :data:`kvredis.tiers.DEFAULT_TIERS`
#: makes of what vLLM 0.34 and SGLang 0.5 publish: the faster the copy is to load, the more it
#: is worth. Host memory (vLLM ``CPU``, SGLang ``CPU_PINNED``) is worth less than GPU, local disk
#: and storage tiers less again, and a copy on remote storage less than the same tier on the pod.
DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {
        "gpu": 1.0,
        "cpu": 0.8,
        "cpu/kvcr": 0.8,
        "disk": 0.5,
        "storage": 0.5,
        "storage/kvcr": 0.5,
        "external": 0.4,
        "gpu:remote": 0.6,
        "cpu:remote": 0.5,
        "disk:remote": 0.3,
        "storage:remote": 0.3,
        "external:remote": 0.3,
    }
)

#: Weight of a device tier missing from the weight map.
UNKNOWN_TIER_WEIGHT = 1.0
#: A (pod, data-parallel rank) as the scorer names it: the pod id (rank 0), or (pod id, rank).
Slot = str | tuple[str, int]


class LongestPrefixScorer:
    """Scores each pod by the consecutive prefix of keys it holds, from the first key.

    Each data-parallel rank of a pod is scored on its own (a request runs on one rank, and only
    that rank's cache is reused): for every key along the chain a (pod, rank) earns the highest
    weight among its tiers holding that key (:data:`UNKNOWN_TIER_WEIGHT` for a tier not in
    ``medium_weights``) and drops out at the first key it does not hold; a pod scores its best
    rank's score. A pod that does not hold the first key is absent from the result. Scores are
    summed in key order, the order the Redis ``score`` script uses too, so both give
    bit-identical floats. This is the reference every other scoring path (the Redis and Valkey
    scripts, the cluster client, the embedded indexes) is tested against.
    """

    __slots__ = ("_weights",)

    def __init__(self, medium_weights: Mapping[str, float] | None = None) -> None:
        if medium_weights is None:
            medium_weights = DEFAULT_MEDIUM_WEIGHTS
        if not isinstance(medium_weights, Mapping):
            raise InvalidInputError(
                f"medium_weights must be a mapping of tier to weight, got {medium_weights!r}"
            )
        weights: dict[str, float] = {}
        for tier, weight in medium_weights.items():
            if not isinstance(tier, str):
                raise InvalidInputError(f"medium_weights keys must be str tiers, got {tier!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise InvalidInputError(f"weight of tier {tier!r} must be a number, got {weight!r}")
            if not math.isfinite(weight):
                raise InvalidInputError(f"weight of tier {tier!r} must be finite, got {weight!r}")
            weights[tier] = float(weight)
        self._weights = weights

    @property
    def medium_weights(self) -> Mapping[str, float]:
        """The tier weights in effect (read-only)."""
        return MappingProxyType(self._weights)

    def weight(self, device_tier: str) -> float:
        """The weight of one device tier."""
        return self._weights.get(device_tier, UNKNOWN_TIER_WEIGHT)

    def score(
        self, keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]]
    ) -> dict[str, float]:
        """Per-pod scores for the chain ``keys`` given which entries hold each key: each pod's
        best data-parallel rank's score (:meth:`score_by_rank`; a request runs on one rank,
        and only that rank's copies are reused).

        ``key_to_pods`` is typically the result of ``Index.lookup(keys, ...)``; keys it lacks
        count as held by no pod.
        """
        return best_ranks(self.score_by_rank(keys, key_to_pods))

    def score_by_rank(
        self, keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]]
    ) -> dict[str, dict[int, float]]:
        """Per-pod, per-data-parallel-rank scores: pod -> ``dp_rank`` -> score.

        Each (pod, rank) is scored on its own, over the entries of that rank only: a rank that
        misses a key drops out there, whatever the pod's other ranks hold. A pod without data
        parallelism (every entry ``dp_rank=0``) has only rank 0. Pods and ranks come in the
        order they first appear at the first key.
        """
        if not keys:
            return {}
        weights = self._weights
        # A (pod, rank) is named by its pod id for rank 0 (most pods run no data parallelism:
        # no tuple to make per entry), else by the tuple (pod id, rank).
        scores: dict[Slot, float] = {}
        for entry in key_to_pods.get(keys[0], ()):
            w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
            rank = entry.dp_rank
            slot = (entry.pod_identifier, rank) if rank else entry.pod_identifier
            if slot not in scores or w > scores[slot]:
                scores[slot] = w
        active: Mapping[Slot, float] = scores
        previous: object = None
        for key in keys[1:]:
            if not active:
                break
            held = key_to_pods.get(key, ())
            # Keys sharing one entry list (as shared lookups give them) weigh the same for the
            # (pod, rank)s still in: the best weights of the key before hold for this one.
            if held is not previous:
                best: dict[Slot, float] = {}
                for entry in held:
                    rank = entry.dp_rank
                    slot = (entry.pod_identifier, rank) if rank else entry.pod_identifier
                    if slot in active:
                        w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
                        if slot not in best or w > best[slot]:
                            best[slot] = w
                previous = held
            for slot, w in best.items():
                scores[slot] += w
            active = best
        out: dict[str, dict[int, float]] = {}
        for slot, total in scores.items():
            pod, rank = (slot, 0) if isinstance(slot, str) else slot
            ranks = out.get(pod)
            if ranks is None:
                out[pod] = {rank: total}
            else:
                ranks[rank] = total
        return out


def best_ranks(by_rank: Mapping[str, Mapping[int, float]]) -> dict[str, float]:
    """Each pod's score from its per-rank scores (:meth:`LongestPrefixScorer.score_by_rank`):
    its best rank's."""
    return {pod: max(ranks.values()) for pod, ranks in by_rank.items() if ranks}


_DEFAULT_WEIGHTS = dict(DEFAULT_MEDIUM_WEIGHTS)
#: Below this, float sums of integral values are exact (the 53-bit significand).
_EXACT_INTS = float(1 << 52)


def score_weights(medium_weights: Mapping[str, float] | None) -> dict[str, float]:
    """Validated tier weights as a plain dict (``None``: the scorer's defaults)."""
    if medium_weights is None:
        return _DEFAULT_WEIGHTS
    return dict(LongestPrefixScorer(medium_weights).medium_weights)


def add_times(total: float, weight: float, times: int) -> float:
    """``total`` plus ``weight`` added ``times`` times one by one, as the scorer sums: the
    same float, at C speed (in one step where every partial sum is an exact integer)."""
    if times == 1:
        return total + weight
    if (
        weight.is_integer()
        and total.is_integer()
        and abs(total) + abs(weight) * times < _EXACT_INTS
    ):
        return total + weight * times
    return reduce(add, repeat(weight, times), total)

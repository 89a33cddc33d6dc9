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


class LongestPrefixScorer:
    """Scores each pod by the consecutive prefix of keys it holds, from the first key.

    A request runs on one data-parallel rank of a pod and reuses only that rank's cache, so each
    (pod, rank) is scored on its own (:meth:`score_by_rank`) and a pod's score is its best
    rank's (:meth:`score`); a pod without data parallelism has only rank 0. For every key along
    the chain a (pod, rank) earns the highest weight among its entries holding that key (its
    tiers, groups, speculative copies; :data:`UNKNOWN_TIER_WEIGHT` for a tier not in
    ``medium_weights``) and drops out at the first key it does not hold. A pod none of whose
    ranks holds the first key is absent from the result. Scores are summed in key order, the
    order every backend's ``score`` uses too, so all give bit-identical floats.
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
        best data-parallel rank's score (see :meth:`score_by_rank`).

        ``key_to_pods`` is typically the result of ``Index.lookup(keys, ...)``; keys it lacks
        count as held by no pod.
        """
        out: dict[str, float] = {}
        for racer, total in self._race(keys, key_to_pods).items():
            pod = racer if isinstance(racer, str) else racer[0]
            if pod not in out or total > out[pod]:
                out[pod] = total
        return out

    def score_by_rank(
        self, keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]]
    ) -> dict[str, dict[int, float]]:
        """Per-pod, per-data-parallel-rank scores (pod -> dp_rank -> score) for the chain
        ``keys``: each (pod, rank) scored on its own prefix of the chain. A rank that does not
        hold the first key is absent; a pod without data parallelism has only rank 0."""
        out: dict[str, dict[int, float]] = {}
        for racer, total in self._race(keys, key_to_pods).items():
            pod, rank = (racer, 0) if isinstance(racer, str) else racer
            ranks = out.get(pod)
            if ranks is None:
                out[pod] = {rank: total}
            else:
                ranks[rank] = total
        return out

    def _race(
        self, keys: Sequence[int], key_to_pods: Mapping[int, Sequence[PodEntry]]
    ) -> dict[str | tuple[str, int], float]:
        """The score of each (pod, rank) holding the first key: rank 0 named by the pod alone,
        any other rank as (pod, rank)."""
        if not keys:
            return {}
        weights = self._weights
        scores: dict[str | tuple[str, int], float] = {}
        for entry in key_to_pods.get(keys[0], ()):
            w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
            racer: str | tuple[str, int] = entry.pod_identifier
            if entry.dp_rank:
                racer = (entry.pod_identifier, entry.dp_rank)
            if racer not in scores or w > scores[racer]:
                scores[racer] = w
        active: Mapping[str | tuple[str, int], float] = scores
        for key in keys[1:]:
            if not active:
                break
            best: dict[str | tuple[str, int], float] = {}
            for entry in key_to_pods.get(key, ()):
                racer = entry.pod_identifier
                if entry.dp_rank:
                    racer = (entry.pod_identifier, entry.dp_rank)
                if racer in active:
                    w = weights.get(entry.device_tier, UNKNOWN_TIER_WEIGHT)
                    if racer not in best or w > best[racer]:
                        best[racer] = w
            for racer, w in best.items():
                scores[racer] += w
            active = best
        return scores


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

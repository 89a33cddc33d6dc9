"""The Indexer: from a prompt's token ids to per-pod prefix-cache scores."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

from kvredis.checks import check_ttl
from kvredis.features import BlockExtraFeatures
from kvredis.hashing import TokenProcessor
from kvredis.hashing.config import BlockKeyScheme
from kvredis.hashing.database import SchemedTokenProcessor
from kvredis.index import Index, RankScoringIndex, SchemeIndex, ScoringIndex
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import EMPTY_BLOCK_HASH, PodEntry

#: Seconds between two checks of the namespace's block key scheme while it records none.
SCHEME_RECHECK_S = 1.0


class Indexer:
    """Turns token ids into block keys and scores the pods holding the longest prefix of them.

    When the index scores on its own (a :class:`~kvredis.index.ScoringIndex`, like the Redis
    backend, which scores server-side and sends back only the per-pod scores), the Indexer
    delegates to it with the scorer's tier weights;
    otherwise it looks the keys up and scores them with the :class:`LongestPrefixScorer`. Both
    paths give identical results. A pod scores its best data-parallel rank's score;
    :meth:`score_tokens_by_rank` gives every rank's.

    When the index's namespace records the block key scheme of its keys (a
    :class:`~kvredis.index.SchemeIndex`: its writers' token processor) and the token processor
    names its own (a :class:`~kvredis.hashing.database.SchemedTokenProcessor`, as
    :class:`~kvredis.hashing.ChunkedTokenDatabase`), a different one raises
    :class:`~kvredis.errors.BlockKeySchemeError` naming both, when the Indexer is built or when
    the namespace is loaded again; while the namespace records none, a score that finds nothing
    asks again (at most once per :data:`SCHEME_RECHECK_S`), so a router started before its
    writers still fails clearly instead of scoring ``{}`` for ever.
    """

    __slots__ = (
        "_checked_at",
        "_index",
        "_rank_score",
        "_scheme",
        "_scheme_index",
        "_scorer",
        "_server_score",
        "_token_processor",
    )

    def __init__(
        self,
        index: Index,
        token_processor: TokenProcessor,
        scorer: LongestPrefixScorer | None = None,
    ) -> None:
        self._index = index
        self._token_processor = token_processor
        self._scorer = LongestPrefixScorer() if scorer is None else scorer
        # A scorer subclass that changes score() must see the entries, so score client-side.
        custom = type(self._scorer).score is not LongestPrefixScorer.score
        self._server_score: ScoringIndex | None = (
            index if isinstance(index, ScoringIndex) and not custom else None
        )
        custom_ranks = type(self._scorer).score_by_rank is not LongestPrefixScorer.score_by_rank
        self._rank_score: RankScoringIndex | None = (
            index if isinstance(index, RankScoringIndex) and not custom_ranks else None
        )
        self._scheme: BlockKeyScheme | None = None
        self._scheme_index: SchemeIndex | None = None
        self._checked_at = 0.0
        if isinstance(token_processor, SchemedTokenProcessor) and isinstance(index, SchemeIndex):
            self._scheme, self._scheme_index = token_processor.scheme, index
            self._check_scheme()

    def _check_scheme(self) -> None:
        """Check the scheme the namespace records (raises on another one); once one is
        recorded, the index checks it at every load of the namespace by itself."""
        if self._scheme is None or self._scheme_index is None:
            return
        self._checked_at = time.monotonic()
        if self._scheme_index.check_block_key_scheme(self._scheme) is not None:
            self._scheme_index = None  # checked: the index checks it again on every reload

    @property
    def index(self) -> Index:
        """The index the Indexer reads."""
        return self._index

    @property
    def token_processor(self) -> TokenProcessor:
        """The token processor computing block keys."""
        return self._token_processor

    @property
    def scorer(self) -> LongestPrefixScorer:
        """The scorer (its tier weights also drive server-side scoring)."""
        return self._scorer

    def compute_block_keys(
        self,
        tokens: Sequence[int],
        model_name: str,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Request keys of the full blocks of ``tokens``, chained from the model's root (salted
        by ``cache_salt``, the request's vLLM/SGLang ``cache_salt``, when given)."""
        if cache_salt is None:
            return self._token_processor.tokens_to_kv_block_keys(
                EMPTY_BLOCK_HASH, tokens, model_name, extra_features
            )
        return self._token_processor.tokens_to_kv_block_keys(
            EMPTY_BLOCK_HASH, tokens, model_name, extra_features, cache_salt=cache_salt
        )

    def add_speculative(
        self,
        tokens: Sequence[int],
        model: str,
        pod: str,
        ttl: float,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Record that ``pod`` (its pod identifier) will soon hold the blocks of ``tokens`` of
        ``model`` (a request just routed to it): a speculative entry, without tier or engine
        keys, under every request key, expiring after ``ttl`` seconds unless the engine's event
        confirms it first. Returns the request keys (``[]`` for a prompt shorter than one
        block)."""
        entry = PodEntry(pod, speculative=True)
        check_ttl(ttl, [entry])
        keys = self.compute_block_keys(tokens, model, extra_features, cache_salt=cache_salt)
        if keys:
            self._index.add(None, keys, [entry], ttl=ttl)
        return keys

    def score_tokens(
        self,
        tokens: Sequence[int],
        model_name: str,
        pod_identifiers: Collection[str] | None = None,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> dict[str, float]:
        """Per-pod scores for a prompt; only ``pod_identifiers`` are considered when given.

        For a LoRA request pass the adapter's name as ``model_name`` (ingestion hashes a LoRA
        event under its ``lora_name``); for a salted request its ``cache_salt``. A prompt
        shorter than one block, or one no pod holds, gives ``{}``.
        """
        keys = self.compute_block_keys(tokens, model_name, extra_features, cache_salt=cache_salt)
        if not keys:
            return {}
        pods = pod_identifiers or None
        if self._server_score is not None:
            weights: Mapping[str, float] = dict(self._scorer.medium_weights)
            scores = dict(self._server_score.score(keys, weights, pods))
        else:
            scores = self._scorer.score(keys, self._index.lookup(keys, pods))
        self._recheck_scheme(scores)
        return scores

    def score_tokens_by_rank(
        self,
        tokens: Sequence[int],
        model_name: str,
        pod_identifiers: Collection[str] | None = None,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> dict[str, dict[int, float]]:
        """Per-pod, per-data-parallel-rank scores for a prompt (pod -> ``dp_rank`` -> score),
        for a router that pins the rank a request runs on; :meth:`score_tokens` gives each
        pod its best rank's. Scored by the index itself when it can
        (:class:`~kvredis.index.RankScoringIndex`), else looked up and scored here."""
        keys = self.compute_block_keys(tokens, model_name, extra_features, cache_salt=cache_salt)
        if not keys:
            return {}
        pods = pod_identifiers or None
        if self._rank_score is not None:
            weights: Mapping[str, float] = dict(self._scorer.medium_weights)
            scores = dict(self._rank_score.score_by_rank(keys, weights, pods))
        else:
            scores = self._scorer.score_by_rank(keys, self._index.lookup(keys, pods))
        self._recheck_scheme(scores)
        return scores

    def _recheck_scheme(self, scores: Mapping[str, object]) -> None:
        """A score that found nothing asks the namespace's block key scheme again (at most once
        per :data:`SCHEME_RECHECK_S`) while it records none: keys of another scheme?"""
        recheck = time.monotonic() - self._checked_at >= SCHEME_RECHECK_S
        if not scores and self._scheme_index is not None and recheck:
            self._check_scheme()

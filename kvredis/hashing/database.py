"""The :class:`TokenProcessor` protocol and :class:`ChunkedTokenDatabase`, its standard form.

:class:`ChunkedTokenDatabase` validates a call (token ids, parent key, model name, per-block
extra features), caches the per-model chain roots and runs the configured scheme
(:mod:`kvredis.hashing.xxh3` or :mod:`kvredis.hashing.fnv_cbor`) over the validated token array.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvredis.errors import ConfigError, InvalidInputError
from kvredis.features import BlockExtraFeatures
from kvredis.hashing.config import BlockKeyScheme, TokenProcessorConfig
from kvredis.hashing.fnv_cbor import FnvCborScheme
from kvredis.hashing.tokens import U32_CODE, token_array
from kvredis.hashing.xxh3 import Xxh3Scheme
from kvredis.types import MAX_BLOCK_HASH

__all__ = ["ChunkedTokenDatabase", "SchemedTokenProcessor", "TokenProcessor"]


@runtime_checkable
class TokenProcessor(Protocol):
    """Anything that turns token ids into chained block keys."""

    def tokens_to_kv_block_keys(
        self,
        parent_key: int,
        tokens: Sequence[int],
        model_name: str,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Keys of the full blocks of ``tokens``, chained from ``parent_key`` (0: the root of
        the model, under ``cache_salt`` when given)."""
        ...

    def block_size(self) -> int:
        """Tokens per block."""
        ...


@runtime_checkable
class SchemedTokenProcessor(TokenProcessor, Protocol):
    """A token processor that names its block key scheme (:class:`ChunkedTokenDatabase` does):
    the Indexer and the EventIngester check it against the one their namespace records."""

    @property
    def scheme(self) -> BlockKeyScheme:
        """The block key scheme of its keys."""
        ...


_ROOT_CACHE_LIMIT = 4096


class ChunkedTokenDatabase:
    """The standard :class:`TokenProcessor`: fixed-size blocks, chained hashes.

    Thread-safe (it holds only immutable configuration and a cache of per-model roots).
    """

    __slots__ = ("_algo", "_block_size", "_config", "_roots", "_scheme", "_seed_bytes")

    def __init__(self, config: TokenProcessorConfig | Mapping[str, Any] | None = None) -> None:
        if config is None:
            config = TokenProcessorConfig()
        elif isinstance(config, Mapping):
            config = TokenProcessorConfig.from_dict(config)
        elif not isinstance(config, TokenProcessorConfig):
            raise ConfigError(f"config must be a TokenProcessorConfig, got {type(config).__name__}")
        self._config = config
        self._algo = config.hash_algo
        self._block_size = config.resolved_block_size
        self._scheme: Xxh3Scheme | FnvCborScheme = (
            Xxh3Scheme(self._block_size)
            if self._algo == "xxh3_64"
            else FnvCborScheme(self._block_size)
        )
        self._seed_bytes = config.hash_seed.encode("utf-8")
        self._roots: dict[tuple[str, str | None], int] = {}

    @property
    def config(self) -> TokenProcessorConfig:
        """The configuration this database was built with."""
        return self._config

    @property
    def scheme(self) -> BlockKeyScheme:
        """The block key scheme of its keys (what a namespace records)."""
        return self._config.scheme

    @property
    def hash_algo(self) -> str:
        """``"xxh3_64"`` or ``"fnv64a_cbor"``."""
        return self._algo

    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    def __repr__(self) -> str:
        return f"ChunkedTokenDatabase(block_size={self._block_size}, hash_algo={self._algo!r})"

    def root_key(self, model_name: str, *, cache_salt: str | None = None) -> int:
        """The chain root used for ``model_name`` (and ``cache_salt``) when ``parent_key`` is 0.

        An empty ``cache_salt`` is no salt (as in vLLM and SGLang, which ignore an empty one).
        """
        if not isinstance(model_name, str):
            raise InvalidInputError(f"model_name must be a str, got {type(model_name).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidInputError(
                f"cache_salt must be a str or None, got {type(cache_salt).__name__}"
            )
        salt = cache_salt or None
        cache_key = (model_name, salt)
        root = self._roots.get(cache_key)
        if root is None:
            for name, value in (("model_name", model_name), ("cache_salt", salt or "")):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise InvalidInputError(f"{name} is not encodable as UTF-8: {exc}") from None
            root = self._scheme.root_key(self._seed_bytes, model_name, salt)
            if len(self._roots) >= _ROOT_CACHE_LIMIT:
                self._roots.clear()
            self._roots[cache_key] = root
        return root

    def tokens_to_kv_block_keys(
        self,
        parent_key: int,
        tokens: Sequence[int],
        model_name: str,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[int]:
        """The keys of the full blocks of ``tokens``, in order.

        ``parent_key`` 0 starts from the model's root, salted by ``cache_salt`` when it is a
        non-empty str (vLLM's and SGLang's per-request ``cache_salt``: a salted prompt shares no
        key with the same prompt unsalted or under another salt); any other ``parent_key``
        continues that chain, which already carries its salt, so ``cache_salt`` must then be
        ``None`` (passing one raises, as it could not take effect).
        ``extra_features``, when given, has one element per full block (``None`` for a text
        block). Raises :class:`~kvredis.errors.InvalidInputError` (a ``ValueError``) for token
        ids outside [0, 2**32), a parent key outside [0, 2**64), a non-str model name or a
        feature list of the wrong length.
        """
        if type(parent_key) is not int and (
            isinstance(parent_key, bool) or not isinstance(parent_key, int)
        ):
            raise InvalidInputError(f"parent_key must be an int, got {type(parent_key).__name__}")
        if not 0 <= parent_key <= MAX_BLOCK_HASH:
            raise InvalidInputError(f"parent_key must be in [0, 2**64), got {parent_key}")
        values = token_array(tokens, U32_CODE)
        bs = self._block_size
        n_blocks = len(values) // bs
        identifiers = self._block_identifiers(extra_features, n_blocks, len(values))
        if parent_key:
            if not isinstance(model_name, str):
                raise InvalidInputError(
                    f"model_name must be a str, got {type(model_name).__name__}"
                )
            if cache_salt is not None:
                raise InvalidInputError(
                    "cache_salt applies to the chain root: pass it with parent_key=0 (a "
                    "non-zero parent_key already carries the salt of its chain)"
                )
            parent = int(parent_key)
        else:
            parent = self.root_key(model_name, cache_salt=cache_salt)
        if n_blocks == 0:
            return []
        return self._scheme.block_keys(parent, values, identifiers)

    def _block_identifiers(
        self,
        extra_features: Sequence[BlockExtraFeatures | None] | None,
        n_blocks: int,
        n_tokens: int,
    ) -> list[tuple[str, ...] | None] | None:
        """Per block, the identifier strings (None for text blocks); None when all are text."""
        if extra_features is None:
            return None
        if isinstance(extra_features, (str, bytes)) or not isinstance(extra_features, Sequence):
            raise InvalidInputError(
                "extra_features must be a list with one BlockExtraFeatures or None per full "
                f"block, got {type(extra_features).__name__}"
            )
        if len(extra_features) != n_blocks:
            raise InvalidInputError(
                f"extra_features has {len(extra_features)} elements but the tokens form "
                f"{n_blocks} full blocks (block_size={self._block_size}, tokens={n_tokens})"
            )
        result: list[tuple[str, ...] | None] = [None] * n_blocks
        any_extra = False
        for index, features in enumerate(extra_features):
            if features is None:
                continue
            if not isinstance(features, BlockExtraFeatures):
                raise InvalidInputError(
                    f"extra_features[{index}] must be BlockExtraFeatures or None, "
                    f"got {type(features).__name__}"
                )
            if features.mm_hashes:
                result[index] = tuple([mm.hash for mm in features.mm_hashes])
                any_extra = True
        return result if any_extra else None

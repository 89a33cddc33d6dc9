"""How prompts are cut into blocks and hashed: :class:`TokenProcessorConfig`, and the scheme it
makes (:class:`BlockKeyScheme`: what a namespace records, so that every client computes the keys
it holds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvredis.errors import ConfigError
from kvredis.jsonconfig import take_fields

__all__ = ["DEFAULT_BLOCK_SIZE", "HASH_ALGOS", "BlockKeyScheme", "TokenProcessorConfig"]

DEFAULT_BLOCK_SIZE = 16
HASH_ALGOS = ("xxh3_64", "fnv64a_cbor")

_CONFIG_KEYS: dict[str, str] = {
    "blockSizeTokens": "block_size_tokens",
    "blockSize": "block_size",
    "hashSeed": "hash_seed",
    "hashAlgo": "hash_algo",
}


def _resolve_block_size(block_size_tokens: int, block_size: int) -> int:
    """The upstream rule: ``block_size_tokens`` unless it is 0 (unset); then the deprecated
    ``block_size``; both 0 -> 16. A resolved size <= 0 is an error naming the value given."""
    if block_size_tokens == 0 and block_size == 0:
        return DEFAULT_BLOCK_SIZE
    value = block_size if block_size_tokens == 0 else block_size_tokens
    if value <= 0:
        raise ConfigError(f"blockSizeTokens must be greater than 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class BlockKeyScheme:
    """How block keys are computed: the hash algorithm, the block size (tokens per block) and
    the hash seed. Two token processors of one scheme compute the same keys for the same
    prompts; of different schemes, keys that never meet. A namespace records the scheme of its
    first writer that knows it (docs/api.md, "Block key schemes"); :attr:`text` is how it is
    recorded (``<algo>:<block size>:<seed>``, the seed last and verbatim, e.g. ``xxh3_64:16:``).
    """

    hash_algo: str
    block_size: int
    hash_seed: str = ""

    def __post_init__(self) -> None:
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"unknown hash_algo {self.hash_algo!r}; valid values are "
                + ", ".join(repr(a) for a in HASH_ALGOS)
            )
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ConfigError(f"block_size must be an int, got {self.block_size!r}")
        if self.block_size <= 0:
            raise ConfigError(f"blockSizeTokens must be greater than 0, got {self.block_size}")
        if not isinstance(self.hash_seed, str):
            raise ConfigError(f"hash_seed must be a str, got {type(self.hash_seed).__name__}")

    @property
    def text(self) -> str:
        """The scheme as a namespace records it: ``<algo>:<block size>:<seed>``."""
        return f"{self.hash_algo}:{self.block_size}:{self.hash_seed}"

    @classmethod
    def parse(cls, text: str | bytes) -> BlockKeyScheme:
        """The scheme a namespace records (:attr:`text`); ConfigError if malformed."""
        raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        algo, _, rest = raw.partition(":")
        size, colon, seed = rest.partition(":")
        if not colon or not size.isdigit():
            raise ConfigError(f"malformed block key scheme {raw!r} (<algo>:<block size>:<seed>)")
        return cls(algo, int(size), seed)

    def __str__(self) -> str:
        return f"{self.hash_algo} (block size {self.block_size}, hash seed {self.hash_seed!r})"


@dataclass(frozen=True, slots=True)
class TokenProcessorConfig:
    """How prompts are cut into blocks and hashed.

    ``block_size`` is the deprecated spelling of ``block_size_tokens``. As in the upstream,
    ``block_size_tokens`` 0 means unset (the default): then ``block_size`` is used, so
    ``TokenProcessorConfig(block_size=8)`` hashes 8-token blocks; both unset means 16; both
    given keeps ``block_size_tokens``. A resolved size <= 0 raises
    :class:`~kvredis.errors.ConfigError` (a ``ValueError``) whose message contains
    ``blockSizeTokens must be greater than 0, got <n>``. Read the size in use from
    :attr:`resolved_block_size`. For ``"fnv64a_cbor"`` keys to match the engines',
    ``hash_seed`` must match theirs (vLLM's ``PYTHONHASHSEED``).
    """

    block_size_tokens: int = 0
    hash_seed: str = ""
    block_size: int = 0
    hash_algo: str = "xxh3_64"

    def __post_init__(self) -> None:
        for name in ("block_size_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if not isinstance(self.hash_seed, str):
            raise ConfigError(f"hash_seed must be a str, got {type(self.hash_seed).__name__}")
        try:
            self.hash_seed.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"hash_seed is not encodable as UTF-8: {exc}") from None
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"unknown hash_algo {self.hash_algo!r}; valid values are "
                + ", ".join(repr(a) for a in HASH_ALGOS)
            )
        _resolve_block_size(self.block_size_tokens, self.block_size)

    @property
    def resolved_block_size(self) -> int:
        """The number of tokens per block actually used."""
        return _resolve_block_size(self.block_size_tokens, self.block_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenProcessorConfig:
        """Build from the upstream JSON shape (``blockSizeTokens``, ``blockSize``, ``hashSeed``,
        ``hashAlgo``) or the Python field names. Unknown keys raise ``ConfigError``.

        A missing ``blockSizeTokens`` is unset, so ``{"blockSize": 8}`` means 8 and ``{}``
        means 16.
        """
        return cls(**take_fields("token processor config", data, _CONFIG_KEYS))

    @property
    def scheme(self) -> BlockKeyScheme:
        """The block key scheme this configuration computes keys with."""
        return BlockKeyScheme(self.hash_algo, self.resolved_block_size, self.hash_seed)

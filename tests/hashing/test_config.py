"""TokenProcessorConfig: defaults, block-size resolution, field checks, the upstream JSON shape."""

from __future__ import annotations

import pytest

from kvredis.errors import ConfigError
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessor, TokenProcessorConfig


def test_defaults() -> None:
    config = TokenProcessorConfig()
    assert (config.block_size_tokens, config.hash_seed, config.block_size, config.hash_algo) == (
        0,
        "",
        0,
        "xxh3_64",
    )
    assert config.resolved_block_size == 16
    processor = ChunkedTokenDatabase()
    assert processor.block_size() == 16
    assert processor.hash_algo == "xxh3_64"
    assert processor.config == config
    assert isinstance(processor, TokenProcessor)


@pytest.mark.parametrize(
    ("block_size_tokens", "block_size", "resolved"),
    [(0, 0, 16), (32, 0, 32), (0, 8, 8), (16, 8, 16), (4, -5, 4)],
)
def test_block_size_resolution(block_size_tokens: int, block_size: int, resolved: int) -> None:
    config = TokenProcessorConfig(block_size_tokens=block_size_tokens, block_size=block_size)
    assert config.resolved_block_size == resolved
    processor = ChunkedTokenDatabase(config)
    assert processor.block_size() == resolved
    assert len(processor.tokens_to_kv_block_keys(0, list(range(64)), "m")) == 64 // resolved


@pytest.mark.parametrize(
    ("block_size_tokens", "block_size", "reported"),
    [(-1, 0, -1), (-1, 16, -1), (0, -5, -5)],
)
def test_invalid_block_size_message(block_size_tokens: int, block_size: int, reported: int) -> None:
    message = f"blockSizeTokens must be greater than 0, got {reported}"
    with pytest.raises(ValueError, match=message) as info:
        ChunkedTokenDatabase(
            TokenProcessorConfig(block_size_tokens=block_size_tokens, block_size=block_size)
        )
    assert isinstance(info.value, ConfigError)
    with pytest.raises(ConfigError, match=message):
        TokenProcessorConfig.from_dict(
            {"blockSizeTokens": block_size_tokens, "blockSize": block_size}
        )


def test_deprecated_block_size_alone_means_that_many_tokens() -> None:
    # As upstream, where an unset BlockSizeTokens defers to BlockSize: 8-token blocks, not 16.
    config = TokenProcessorConfig(block_size=8)
    assert config.resolved_block_size == 8
    processor = ChunkedTokenDatabase(config)
    assert processor.block_size() == 8
    tokens = list(range(32))
    assert processor.tokens_to_kv_block_keys(0, tokens, "m") == ChunkedTokenDatabase(
        TokenProcessorConfig(block_size_tokens=8)
    ).tokens_to_kv_block_keys(0, tokens, "m")
    with pytest.raises(ConfigError, match="blockSizeTokens must be greater than 0, got -8"):
        TokenProcessorConfig(block_size=-8)


def test_unknown_hash_algo() -> None:
    with pytest.raises(ConfigError, match="sha256") as info:
        TokenProcessorConfig(hash_algo="sha256")
    assert "xxh3_64" in str(info.value)
    assert "fnv64a_cbor" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size_tokens": "16"},
        {"block_size_tokens": 16.0},
        {"block_size": True},
        {"hash_seed": 5},
        {"hash_seed": "bad\ud800"},
        {"hash_algo": None},
    ],
)
def test_config_field_types(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TokenProcessorConfig(**kwargs)  # type: ignore[arg-type]


def test_from_dict_upstream_keys() -> None:
    config = TokenProcessorConfig.from_dict(
        {"blockSizeTokens": 32, "hashSeed": "42", "hashAlgo": "fnv64a_cbor"}
    )
    assert config == TokenProcessorConfig(
        block_size_tokens=32, hash_seed="42", hash_algo="fnv64a_cbor"
    )
    legacy = TokenProcessorConfig.from_dict({"blockSize": 8})
    assert legacy.resolved_block_size == 8
    assert TokenProcessorConfig.from_dict({}).resolved_block_size == 16
    assert TokenProcessorConfig.from_dict({"blockSize": 8, "blockSizeTokens": 32}) == (
        TokenProcessorConfig(block_size_tokens=32, block_size=8)
    )
    assert TokenProcessorConfig(block_size=8, block_size_tokens=32).resolved_block_size == 32
    assert TokenProcessorConfig.from_dict({"block_size_tokens": 4}).resolved_block_size == 4
    # Only a seed set: the block size falls back to the default.
    assert TokenProcessorConfig.from_dict({"hashSeed": "x"}).resolved_block_size == 16
    processor = ChunkedTokenDatabase({"blockSizeTokens": 8, "hashAlgo": "fnv64a_cbor"})
    assert (processor.block_size(), processor.hash_algo) == (8, "fnv64a_cbor")


def test_from_dict_rejects_unknown_and_duplicate_keys() -> None:
    with pytest.raises(ConfigError, match="'chunkSize'"):
        TokenProcessorConfig.from_dict({"chunkSize": 16})
    with pytest.raises(ConfigError, match="twice"):
        TokenProcessorConfig.from_dict({"blockSize": 16, "block_size": 16})
    with pytest.raises(ConfigError, match="mapping"):
        TokenProcessorConfig.from_dict([("blockSize", 16)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ChunkedTokenDatabase("fnv64a_cbor")  # type: ignore[arg-type]

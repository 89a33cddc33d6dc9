"""A namespace records the block key scheme of the keys it holds (hash algorithm, block size,
hash seed), written by its first writer that knows it, and every client that computes keys
checks its own against it: a mismatch is a clear error naming both, never an empty score."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis

import kvredis.indexer as indexer_module
from kvredis import (
    AsyncRedisClusterIndex,
    AsyncRedisIndex,
    BlockKeyScheme,
    BlockKeySchemeError,
    ChunkedTokenDatabase,
    EventIngester,
    Indexer,
    InstrumentedIndex,
    PodEntry,
    RedisClusterIndex,
    RedisIndex,
    RedisIndexConfig,
    TokenProcessorConfig,
)
from kvredis.redis.layout import meta_key
from tests.conftest import TEST_PREFIX
from tests.servers import LocalCluster, RedisServer

MODEL = "m"
TOKENS = list(range(64))
FNV = TokenProcessorConfig(block_size_tokens=16, hash_algo="fnv64a_cbor")
XXH3 = TokenProcessorConfig(block_size_tokens=16)
SEEDED = TokenProcessorConfig(block_size_tokens=16, hash_seed="42")


@pytest.fixture
def config(redis_server_url: str) -> Iterator[RedisIndexConfig]:
    cfg = RedisIndexConfig(address=redis_server_url, namespace=f"{TEST_PREFIX}{uuid.uuid4().hex}")
    yield cfg
    with RedisIndex(cfg) as index:
        index.drop_namespace()


@pytest.fixture
def raw(redis_server_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server_url)
    yield client
    client.close()


def _fill(index: RedisIndex, tp: TokenProcessorConfig) -> list[int]:
    """What an ingester of ``tp`` stores: the prompt's keys on pod-a."""
    keys = ChunkedTokenDatabase(tp).tokens_to_kv_block_keys(0, TOKENS, MODEL)
    index.add(None, keys, [PodEntry("pod-a", "gpu")])
    return keys


def test_the_scheme_text_round_trips() -> None:
    scheme = BlockKeyScheme("fnv64a_cbor", 16, "a:b c")
    assert scheme.text == "fnv64a_cbor:16:a:b c"
    assert BlockKeyScheme.parse(scheme.text) == scheme
    assert XXH3.scheme.text == "xxh3_64:16:"
    assert ChunkedTokenDatabase(SEEDED).scheme == BlockKeyScheme("xxh3_64", 16, "42")
    for bad in ("xxh3_64", "xxh3_64:x:", "md5:16:"):
        with pytest.raises(ValueError):
            BlockKeyScheme.parse(bad)


def test_the_ingester_records_its_scheme_and_a_router_of_another_fails_naming_both(
    config: RedisIndexConfig, raw: redis.Redis
) -> None:
    with RedisIndex(config) as index:
        EventIngester(index, ChunkedTokenDatabase(FNV))
        assert raw.hget(meta_key(config.namespace), "scheme") == b"fnv64a_cbor:16:"
        _fill(index, FNV)
        assert Indexer(index, ChunkedTokenDatabase(FNV)).score_tokens(TOKENS, MODEL) == {
            "pod-a": 4.0
        }
    with RedisIndex(config) as router, pytest.raises(BlockKeySchemeError) as caught:
        Indexer(router, ChunkedTokenDatabase(XXH3))
    message = str(caught.value)
    assert "fnv64a_cbor (block size 16, hash seed '')" in message
    assert "xxh3_64 (block size 16, hash seed '')" in message
    seeded_fnv = TokenProcessorConfig(block_size_tokens=16, hash_algo="fnv64a_cbor", hash_seed="42")
    with RedisIndex(config) as router, pytest.raises(BlockKeySchemeError, match="'42'"):
        Indexer(InstrumentedIndex(router), ChunkedTokenDatabase(seeded_fnv))  # wrapped too
    with RedisIndex(config) as other, pytest.raises(BlockKeySchemeError):
        EventIngester(other, ChunkedTokenDatabase(XXH3))  # a second writer of another scheme
    assert raw.hget(meta_key(config.namespace), "scheme") == b"fnv64a_cbor:16:"


@pytest.mark.parametrize("by_rank", [False, True], ids=["score_tokens", "score_tokens_by_rank"])
def test_a_router_started_before_its_writers_fails_at_its_first_empty_score(
    config: RedisIndexConfig, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch, by_rank: bool
) -> None:
    monkeypatch.setattr(indexer_module, "SCHEME_RECHECK_S", 0.0)
    with RedisIndex(config) as router_index, RedisIndex(config) as writer:
        router = Indexer(router_index, ChunkedTokenDatabase(XXH3))  # nothing recorded yet
        score = router.score_tokens_by_rank if by_rank else router.score_tokens
        assert score(TOKENS, MODEL) == {}
        EventIngester(writer, ChunkedTokenDatabase(FNV))
        _fill(writer, FNV)
        with pytest.raises(BlockKeySchemeError, match="fnv64a_cbor"):
            score(TOKENS, MODEL)


def test_a_namespace_of_bare_adds_records_nothing_and_checks_nothing(
    config: RedisIndexConfig, raw: redis.Redis
) -> None:
    with RedisIndex(config) as index:
        keys = _fill(index, XXH3)
        assert raw.hget(meta_key(config.namespace), "scheme") is None
        assert Indexer(index, ChunkedTokenDatabase(FNV)).score_tokens(TOKENS, MODEL) == {}
        assert index.score(keys) == {"pod-a": 4.0}
        EventIngester(index, ChunkedTokenDatabase(XXH3))  # the first writer that knows it
        assert raw.hget(meta_key(config.namespace), "scheme") == b"xxh3_64:16:"


def test_a_namespace_recreated_under_another_scheme_is_refused_at_its_reload(
    config: RedisIndexConfig,
) -> None:
    with RedisIndex(config) as router, RedisIndex(config) as writer:
        EventIngester(writer, ChunkedTokenDatabase(FNV))
        Indexer(router, ChunkedTokenDatabase(FNV))
        writer.drop_namespace()
        with RedisIndex(config) as again:
            EventIngester(again, ChunkedTokenDatabase(XXH3))  # a new incarnation, new scheme
        with pytest.raises(BlockKeySchemeError, match="xxh3_64"):
            router.score([1, 2])  # stale: the router reloads the namespace, and checks


def test_the_async_client_checks_and_records(config: RedisIndexConfig, raw: redis.Redis) -> None:
    async def main() -> None:
        index = AsyncRedisIndex(config)
        try:
            assert await index.check_block_key_scheme(FNV.scheme) is None
            assert await index.check_block_key_scheme(FNV.scheme, record=True) == FNV.scheme
            with pytest.raises(BlockKeySchemeError, match="fnv64a_cbor"):
                await index.check_block_key_scheme(XXH3.scheme)
        finally:
            await index.aclose()

    asyncio.run(main())
    assert raw.hget(meta_key(config.namespace), "scheme") == b"fnv64a_cbor:16:"


def test_cluster_clients_check_and_record_on_every_shard(redis_cluster: LocalCluster) -> None:
    config = RedisIndexConfig(
        address=redis_cluster.url, namespace=f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    )
    with RedisClusterIndex(config) as index:
        try:
            EventIngester(index, ChunkedTokenDatabase(FNV))
            assert index.check_block_key_scheme(FNV.scheme) == FNV.scheme
            with pytest.raises(BlockKeySchemeError, match="fnv64a_cbor"):
                Indexer(index, ChunkedTokenDatabase(XXH3))

            async def main() -> None:
                other = AsyncRedisClusterIndex(config)
                try:
                    with pytest.raises(BlockKeySchemeError, match="xxh3_64"):
                        await other.check_block_key_scheme(XXH3.scheme)
                    assert await other.check_block_key_scheme(FNV.scheme) == FNV.scheme
                finally:
                    await other.aclose()

            asyncio.run(main())
        finally:
            index.drop_namespace()


def test_an_ingester_built_while_the_server_is_down_records_before_its_first_write(
    own_redis_server: RedisServer,
) -> None:
    from kvredis.ingest.actions import BatchOutcome
    from tests.ingest.wire import vllm_batch, vllm_stored

    namespace = f"{TEST_PREFIX}{uuid.uuid4().hex[:8]}"
    config = RedisIndexConfig(
        address=own_redis_server.url, namespace=namespace, retries=0, connect_timeout=0.2
    )
    with RedisIndex(config) as index:
        own_redis_server.stop()
        ingester = EventIngester(index, ChunkedTokenDatabase(FNV))  # rides out the outage
        own_redis_server.start()
        batch = vllm_batch([vllm_stored([1, 2], None, TOKENS[:32], 16, medium="GPU")])
        assert ingester.process(f"kv@pod-a@{MODEL}", 0, batch, "pod-a") is BatchOutcome.APPLIED
        raw = redis.Redis(port=own_redis_server.port)
        try:
            assert raw.hget(meta_key(namespace), "scheme") == b"fnv64a_cbor:16:"
        finally:
            raw.close()

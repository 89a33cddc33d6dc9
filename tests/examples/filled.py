"""An index filled the way a deployment fills it: vLLM-shaped KV events (``tests/ingest/wire``)
through the Python ``EventIngester`` into a Redis namespace, with llm-d's ``fnv64a_cbor`` block
keys or kvredis's default ``xxh3_64`` ones (the namespace records which); what other clients
(Go, redis-cli, other ACL users) read back is checked against it."""

from __future__ import annotations

from dataclasses import dataclass

from kvredis import RedisIndex, RedisIndexConfig
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest.actions import BatchOutcome
from kvredis.ingest.service import EventIngester
from tests.ingest.wire import all_cleared, vllm_batch, vllm_removed, vllm_stored

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 16
#: tier weights both sides score with
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}
TOKENS = [(7 * i + 3) % 50_000 for i in range(40 * BLOCK)]
OTHER = [(11 * i + 5) % 50_000 for i in range(6 * BLOCK)]


def token_processor(hash_algo: str = "fnv64a_cbor") -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=BLOCK, hash_algo=hash_algo))


@dataclass(frozen=True)
class Filled:
    """The namespace filled, the router's keys of the prompts, and the Python client's scores."""

    namespace: str
    #: the block key scheme of the keys, as the namespace records it
    scheme: str
    keys: list[int]
    other_keys: list[int]
    scores: dict[str, float]
    other_scores: dict[str, float]
    rank_scores: dict[str, dict[int, float]]


def _engine_hashes(pod: int, n: int) -> list[int]:
    return [(pod << 40) + i + 1 for i in range(n)]


def fill(config: RedisIndexConfig, hash_algo: str = "fnv64a_cbor") -> Filled:
    """Fill ``config``'s namespace through the ingester (as ``config``'s user) and score."""
    tp = token_processor(hash_algo)
    with RedisIndex(config) as index:
        ingester = EventIngester(index, tp)
        seqs: dict[str, int] = {}

        def send(pod: str, *events: object, rank: int | None = None) -> None:
            endpoint = pod if rank is None else f"{pod}/rank-{rank}"
            seq = seqs[endpoint] = seqs.get(endpoint, -1) + 1
            payload = vllm_batch(list(events), data_parallel_rank=rank)
            outcome = ingester.process(f"kv@{pod}@{MODEL}", seq, payload, endpoint)
            assert outcome is BatchOutcome.APPLIED, (pod, outcome)

        a, b, c = _engine_hashes(1, 40), _engine_hashes(2, 40), _engine_hashes(3, 6)
        send("pod-a", vllm_stored(a, None, TOKENS, BLOCK, medium="GPU"))
        send("pod-b", vllm_stored(b[:24], None, TOKENS[: 24 * BLOCK], BLOCK, medium="CPU"))
        send("pod-b", vllm_stored(b[:10], None, TOKENS[: 10 * BLOCK], BLOCK, medium="GPU"))
        send("pod-a", vllm_removed(a[30:]))  # pod-a keeps the first 30 blocks
        send("pod-c", vllm_stored(c, None, OTHER, BLOCK, medium="GPU"))
        send("pod-d", vllm_stored(c[:3], None, OTHER[: 3 * BLOCK], BLOCK, medium="CPU"))
        send("pod-d", all_cleared())
        send("pod-b", vllm_stored(c[:4], None, OTHER[: 4 * BLOCK], BLOCK, medium="CPU"))
        # a data-parallel pod: rank 0 lost its 11th block, rank 1 holds the first 16; the union
        # of the two would hold 34, no rank more than 16
        e0, e1 = _engine_hashes(5, 34), _engine_hashes(6, 16)
        send("pod-e", vllm_stored(e0, None, TOKENS[: 34 * BLOCK], BLOCK, medium="GPU"), rank=0)
        send("pod-e", vllm_removed(e0[10:11]), rank=0)
        send("pod-e", vllm_stored(e1, None, TOKENS[: 16 * BLOCK], BLOCK, medium="CPU"), rank=1)
        keys = tp.tokens_to_kv_block_keys(0, TOKENS, MODEL)
        other = tp.tokens_to_kv_block_keys(0, OTHER, MODEL)
        scores = index.score(keys, WEIGHTS)
        other_scores = index.score(other, WEIGHTS)
        rank_scores = index.score_by_rank(keys, WEIGHTS)
    assert scores and other_scores
    assert rank_scores["pod-e"] == {0: 10.0, 1: sum([0.8] * 16)}  # each rank on its own
    return Filled(config.namespace, tp.scheme.text, keys, other, scores, other_scores, rank_scores)

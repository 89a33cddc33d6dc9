"""Event → index semantics, sequencing, rejections and HA fencing, fed directly (no transport).

Semantic tests run on every backend of the ``index`` fixture (the async Redis backend is not a
BatchIndex, so it exercises the one-call-per-operation path); sequencing and HA tests run on the
in-memory backend and on a real Redis.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import pytest

from kvredis.batch import Watermark
from kvredis.errors import BackendError, ConfigError, InvalidInputError
from kvredis.features import (
    BlockExtraFeatures,
    MMHash,
    parse_raw_extra_keys,
    realign_extra_features,
)
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.index import BatchIndex, Index
from kvredis.ingest import (
    PHASE_DONE,
    BatchOutcome,
    EndpointConfig,
    EventIngester,
    IngesterConfig,
    ReplayedMessage,
    split_position,
    stream_position,
)
from kvredis.ingest.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
)
from kvredis.memory import InMemoryIndex
from kvredis.types import GroupMetadata, PodEntry
from tests.ingest.engine import wait_until

TP = ChunkedTokenDatabase()
MODEL = "model-a"
TOPIC = f"kv@pod-a@{MODEL}"
STREAM = f"engine-1#{TOPIC}"
"""The watermark stream of the engine TOPIC names on endpoint ``engine-1``."""
FAST = IngesterConfig(peer_grace_s=0.05, takeover_timeout_s=0.2, poll_interval_s=0.005)


def toks(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def keys(tokens: Sequence[int], model: str = MODEL, parent: int = 0, **kw: Any) -> list[int]:
    return TP.tokens_to_kv_block_keys(parent, tokens, model, **kw)


class Feeder:
    """Sends batches of one publisher with consecutive sequence numbers."""

    def __init__(self, ing: EventIngester, topic: str = TOPIC, endpoint: str = "engine-1") -> None:
        self.ing, self.topic, self.endpoint, self.seq = ing, topic, endpoint, 0

    def send(self, *events: Event, fmt: Any = "map") -> BatchOutcome:
        return self.send_payload(encode_batch(list(events), fmt=fmt))

    def send_payload(self, payload: bytes) -> BatchOutcome:
        outcome = self.ing.process(self.topic, self.seq, payload, self.endpoint)
        self.seq += 1
        return outcome


def entries(index: Any, key: int) -> set[PodEntry]:
    return set(index.lookup([key]).get(key, []))


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def shared_index(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A BatchIndex (in memory, or on the session's Redis under a fresh namespace)."""
    if request.param == "memory":
        yield InMemoryIndex()
        return
    from kvredis import RedisIndex, RedisIndexConfig

    url = request.getfixturevalue("redis_server_url")
    idx = RedisIndex(RedisIndexConfig(address=url, namespace=f"kvt-{uuid.uuid4().hex[:12]}"))
    try:
        yield idx
    finally:
        idx.close()


@pytest.fixture
def second_client(shared_index: Any) -> Iterator[Any]:
    """Another client of the same shared index (a second replica's own connection)."""
    if isinstance(shared_index, InMemoryIndex):
        yield lambda _index: shared_index
        return
    from kvredis import RedisIndex

    clients: list[RedisIndex] = []

    def make(index: Any) -> Any:
        clients.append(RedisIndex(index.config))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


# -- semantics ------------------------------------------------------------------------------


def test_block_stored_chain_resolves_parents_locally(index: Any) -> None:
    ing = EventIngester(index, TP)
    feed = Feeder(ing)
    first, more = toks(100, 64), toks(164, 32)
    assert (
        feed.send(BlockStored((1, 2, 3, 4), None, first, 16, medium="GPU")) is BatchOutcome.APPLIED
    )
    assert feed.send(BlockStored((5, 6), 4, more, 16), fmt="array") is BatchOutcome.APPLIED
    chain = keys(first + more)
    got = index.lookup(chain)
    assert list(got) == chain
    assert all(v == [PodEntry("pod-a", "gpu")] for v in got.values())
    assert index.get_request_key(4) == chain[3]
    assert index.get_request_key(6) == chain[5]
    c = ing.counters.snapshot()
    assert c["index_lookups"] == 0
    assert (c["batches_applied"], c["blocks_stored"], c["request_keys_stored"]) == (2, 6, 6)
    # one round trip per batch with a BatchIndex (plus reading the stored watermark once)
    assert c["index_calls"] == (3 if isinstance(index, BatchIndex) else 2)


def test_parent_resolves_through_the_index(index: Any) -> None:
    a, b = EventIngester(index, TP), EventIngester(index, TP)
    Feeder(a, "kv@pod-a@m", "ea").send(BlockStored((1, 2), None, toks(0, 32), 16))
    Feeder(b, "kv@pod-b@m", "eb").send(BlockStored((3,), 2, toks(32, 16), 16))
    chain = keys(toks(0, 48), "m")
    assert b.counters.get("index_lookups") == 1
    got = index.lookup(chain)
    assert [set(v) for v in got.values()] == [
        {PodEntry("pod-a", "gpu")},
        {PodEntry("pod-a", "gpu")},
        {PodEntry("pod-b", "gpu")},
    ]


def test_unresolvable_parent_skips_only_that_event(index: Any) -> None:
    ing = EventIngester(index, TP)
    outcome = Feeder(ing).send(
        BlockStored((7,), 999, toks(0, 16), 16), BlockStored((8,), None, toks(50, 16), 16)
    )
    assert outcome is BatchOutcome.APPLIED
    assert ing.counters.get("parent_misses") == 1
    assert index.lookup(keys(toks(50, 16)))
    assert index.get_request_key(8) == keys(toks(50, 16))[0]
    assert not any(entries(index, k) for k in keys(toks(0, 16), parent=999))


def test_lora_name_is_the_hashing_model(index: Any) -> None:
    ing = EventIngester(index, TP)
    feed = Feeder(ing)
    feed.send(BlockStored((1, 2), None, toks(0, 32), 16, lora_name="sql-lora"))
    feed.send(BlockStored((3,), 2, toks(32, 16), 16, lora_name="sql-lora"))
    assert len(index.lookup(keys(toks(0, 48), "sql-lora"))) == 3
    assert index.lookup(keys(toks(0, 48), MODEL)) == {}


def test_endpoint_configuration_overrides_the_topic(index: Any) -> None:
    ep = EndpointConfig("engine-x", pod_id="configured-pod", model_name="configured-model")
    ing = EventIngester(index, TP, [ep])
    ing.process(
        b"kv@topic-pod@topic-model", 0, encode_batch([BlockStored((1,), None, toks(0, 16), 16)]), ep
    )
    assert entries(index, keys(toks(0, 16), "configured-model")[0]) == {
        PodEntry("configured-pod", "gpu")
    }


def test_multimodal_extra_keys_same_block_size(index: Any) -> None:
    ing = EventIngester(index, TP)
    raw = ([["img-a", 0]], None, [["img-b", 3]])
    Feeder(ing).send(BlockStored((1, 2, 3), None, toks(0, 48), 16, extra_keys=raw))
    features = parse_raw_extra_keys([list(x) if x else None for x in raw])
    mm = keys(toks(0, 48), extra_features=features)
    assert mm != keys(toks(0, 48))
    assert len(index.lookup(mm)) == 3
    assert index.lookup(keys(toks(0, 48))) == {}


def test_multimodal_one_to_many_replicates_features(index: Any) -> None:
    ing = EventIngester(index, TP)  # our blocks: 16 tokens; the engine's: 32
    Feeder(ing).send(BlockStored((1, 2), None, toks(0, 64), 32, extra_keys=([["img", 0]], None)))
    img = BlockExtraFeatures([MMHash("img")])
    expected = keys(toks(0, 64), extra_features=[img, img, None, None])
    assert len(index.lookup(expected)) == 4
    assert index.get_request_key(1) == expected[1]
    assert index.get_request_key(2) == expected[3]


def test_multimodal_many_to_one_merges_features(index: Any) -> None:
    tp64 = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=64))
    ing = EventIngester(index, tp64)  # our blocks: 64 tokens; the engine's: 16
    # image a spans engine blocks 0-1, b spans 5-6, c spans 6-7: each counts once
    raw = (["a"], ["a"], None, None, None, ["b"], ["b", "c"], ["c"])
    Feeder(ing).send(BlockStored(tuple(range(1, 9)), None, toks(0, 128), 16, extra_keys=raw))
    a, bc = [MMHash("a")], [MMHash("b"), MMHash("c")]
    expected = tp64.tokens_to_kv_block_keys(
        0, toks(0, 128), MODEL, [BlockExtraFeatures(a), BlockExtraFeatures(bc)]
    )
    assert len(index.lookup(expected)) == 2
    assert [index.get_request_key(e) for e in range(1, 9)] == [expected[0]] * 4 + [expected[1]] * 4


def test_realign_extra_features() -> None:
    f = [BlockExtraFeatures([MMHash(x)]) for x in "ab"]
    assert realign_extra_features(None, 3) is None
    assert realign_extra_features([None, None], 2) is None
    assert realign_extra_features(f, 2) == f
    assert realign_extra_features(f, 4) == [f[0], f[0], f[1], f[1]]
    assert realign_extra_features([f[0], None, None, f[1]], 2) == [f[0], f[1]]
    ab = BlockExtraFeatures([MMHash("a"), MMHash("b")])
    bc = BlockExtraFeatures([MMHash("b"), MMHash("c")])
    aa = BlockExtraFeatures([MMHash("a"), MMHash("a")])
    # an item continuing into the next engine block counts once; a new copy counts again
    assert realign_extra_features([f[0], f[0], None, f[0]], 1) == [aa]
    assert realign_extra_features([ab, bc], 1) == [
        BlockExtraFeatures([MMHash("a"), MMHash("b"), MMHash("c")])
    ]
    assert realign_extra_features([aa, None], 1) == [aa]
    assert realign_extra_features([f[0], f[1], f[0], None], 1) == [
        BlockExtraFeatures([MMHash("a"), MMHash("b"), MMHash("a")])
    ]
    assert realign_extra_features([None, None, f[0], None], 2) == [None, f[0]]


def test_tier_update_adds_the_new_tier_without_mappings(index: Any) -> None:
    ing = EventIngester(index, TP)
    feed = Feeder(ing)
    chain = keys(toks(0, 32))
    feed.send(BlockStored((1, 2), None, toks(0, 32), 16))
    feed.send(BlockStored((1, 2), None, (), 16, medium="CPU"))
    gpu, cpu = PodEntry("pod-a", "gpu"), PodEntry("pod-a", "cpu")
    assert [entries(index, k) for k in chain] == [{gpu, cpu}, {gpu, cpu}]
    feed.send(BlockRemoved((1, 2), medium="GPU"))
    assert [entries(index, k) for k in chain] == [{cpu}, {cpu}]
    assert index.get_request_key(2) == chain[1]  # the CPU copy keeps the mapping alive
    feed.send(BlockStored((77, 78), None, (), 16, medium="CPU"))
    c = ing.counters.snapshot()
    assert (c["tier_updates"], c["tier_update_misses"]) == (1, 1)
    feed.send(BlockRemoved((1, 2), medium="CPU"))
    assert index.lookup(chain) == {}


def test_group_events_and_catalog(index: Any) -> None:
    ing = EventIngester(index, TP)
    feed = Feeder(ing)
    chain = keys(toks(0, 32))
    feed.send(
        BlockStored(
            (1, 2), None, toks(0, 32), 16, group_idx=0, kv_cache_spec_kind="full_attention"
        ),
        BlockStored(
            (11, 12),
            None,
            toks(0, 32),
            16,
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
    )
    g0 = PodEntry("pod-a", "gpu", has_group=True, group_idx=0)
    g1 = PodEntry("pod-a", "gpu", has_group=True, group_idx=1)
    assert [entries(index, k) for k in chain] == [{g0, g1}, {g0, g1}]
    assert ing.catalog.get("pod-a", 1) == GroupMetadata("sliding_window", 16, 128)
    assert ing.catalog.get("pod-a", 0) == GroupMetadata("full_attention", 16, None)
    feed.send(BlockRemoved((11, 12), group_idx=1), fmt="array")
    assert [entries(index, k) for k in chain] == [{g0}, {g0}]
    feed.send(BlockRemoved((1, 2)))  # ungrouped entry: nothing to remove
    assert [entries(index, k) for k in chain] == [{g0}, {g0}]


def test_all_blocks_cleared_clears_only_this_pod_mid_batch(index: Any) -> None:
    a, b = EventIngester(index, TP), EventIngester(index, TP)
    fa, fb = Feeder(a, "kv@pod-a@m", "ea"), Feeder(b, "kv@pod-b@m", "eb")
    early, late = keys(toks(0, 32), "m"), keys(toks(500, 16), "m")
    fb.send(BlockStored((1, 2), None, toks(0, 32), 16))
    fa.send(BlockStored((1, 2), None, toks(0, 32), 16))
    fa.send(
        BlockStored((3,), 2, toks(32, 16), 16),
        AllBlocksCleared(),
        BlockStored((9,), None, toks(500, 16), 16),
    )
    assert [entries(index, k) for k in early] == [{PodEntry("pod-b", "gpu")}] * 2
    assert entries(index, late[0]) == {PodEntry("pod-a", "gpu")}
    assert not entries(index, keys(toks(0, 48), "m")[2])
    c = a.counters.snapshot()
    assert (c["clears"], c["clears_all_blocks_cleared"], c["events_applied"]) == (1, 1, 4)


def test_parent_removed_earlier_in_the_same_batch(index: Any) -> None:
    """Resolution sees the batch's own eviction, exactly as if events were applied one by one."""
    ing = EventIngester(index, TP)
    feed = Feeder(ing)
    chain = keys(toks(0, 48))
    feed.send(BlockStored((1, 2), None, toks(0, 32), 16))
    feed.send(BlockRemoved((2,)), BlockStored((3,), 2, toks(32, 16), 16))
    assert ing.counters.get("parent_misses") == 1
    assert not entries(index, chain[2])
    # with a CPU copy the mapping survives the GPU eviction, so the parent still resolves
    feed.send(BlockStored((2,), 1, toks(16, 16), 16), BlockStored((2,), None, (), 16, medium="CPU"))
    feed.send(BlockRemoved((2,)), BlockStored((3,), 2, toks(32, 16), 16))
    assert ing.counters.get("parent_misses") == 1
    assert entries(index, chain[2]) == {PodEntry("pod-a", "gpu")}
    assert entries(index, chain[1]) == {PodEntry("pod-a", "cpu")}


def test_without_watermarks_batches_still_apply_in_one_call() -> None:
    index = InMemoryIndex()
    ing = EventIngester(index, TP, config=IngesterConfig(use_watermarks=False))
    feed = Feeder(ing)
    feed.send(BlockStored((1, 2), None, toks(0, 32), 16), BlockRemoved((1,)))
    assert index.get_watermark(STREAM) is None
    assert ing.counters.get("index_calls") == 1
    assert index.lookup(keys(toks(0, 32))[1:]) != {}


# -- rejections -----------------------------------------------------------------------------


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


class AllowlistTokenProcessor:
    """A token processor that only hashes for the models it serves."""

    def __init__(self, models: set[str]) -> None:
        self._db, self._models = ChunkedTokenDatabase(), models

    def tokens_to_kv_block_keys(
        self, parent_key: int, tokens: Sequence[int], model_name: str, extra_features: Any = None
    ) -> list[int]:
        if model_name not in self._models:
            raise InvalidInputError(f"model {model_name!r} is not served here")
        return self._db.tokens_to_kv_block_keys(parent_key, tokens, model_name, extra_features)

    def block_size(self) -> int:
        return self._db.block_size()


def test_bad_events_are_counted_and_the_rest_applies() -> None:
    index = InMemoryIndex()
    ing = EventIngester(index, TP)
    events = [
        ["BlockStored", [1], None, list(toks(0, 16)), 16],
        {"type": "BlockMigrated"},
        ["BlockRemoved", [b""]],
        ["BlockStored", [2], None, [1, 2**32], 16],
        {
            "type": "BlockStored",
            "block_hashes": [3],
            "token_ids": list(toks(16, 16)),
            "extra_keys": 5,
        },
        ["BlockStored", [4], None, list(toks(40, 16)), 16],
    ]
    assert Feeder(ing).send_payload(pack([0.0, events])) is BatchOutcome.APPLIED
    c = ing.counters.snapshot()
    assert c["events"] == 6 and c["events_applied"] == 2 and c["rejected"] == 4
    assert c["rejected.unknown_tag"] == c["rejected.bad_hash"] == 1
    assert c["rejected.token_out_of_range"] == c["rejected.bad_extra_keys"] == 1
    assert index.lookup(keys(toks(0, 16))) and index.lookup(keys(toks(40, 16)))


@pytest.mark.parametrize(
    ("topic", "seq", "payload", "reason", "outcome"),
    [
        ("kv@pod-a@m", 0, b"\xc1garbage", "malformed_payload", BatchOutcome.REJECTED),
        ("kv@pod-a@m", 0, pack({"ts": 0.0, "evts": []}), "bad_batch", BatchOutcome.REJECTED),
        ("", 0, encode_batch([BlockRemoved((1,))]), "no_pod", BatchOutcome.REJECTED),
        ("kv@pod-a@m", 2**47 - 1, encode_batch([]), "seq_out_of_range", BatchOutcome.REJECTED),
        ("kv@pod-a@m", -1, encode_batch([]), "seq_out_of_range", BatchOutcome.REJECTED),
        ("kv@pod-a@m", 0, "not bytes", "bad_message", BatchOutcome.REJECTED),
        ("kv@pod-a@m", 0, None, "bad_message", BatchOutcome.REJECTED),
        ("kv@pod-a@m", 0, 12, "bad_message", BatchOutcome.REJECTED),
        (None, 0, encode_batch([]), "bad_message", BatchOutcome.REJECTED),
        (5, 0, encode_batch([]), "bad_message", BatchOutcome.REJECTED),
        (
            "kv@pod-a@",
            0,
            encode_batch([BlockStored((1,), None, toks(0, 16), 16)]),
            "no_model",
            BatchOutcome.APPLIED,
        ),
    ],
)
def test_message_rejects(
    topic: Any, seq: int, payload: Any, reason: str, outcome: BatchOutcome
) -> None:
    index = InMemoryIndex()
    ing = EventIngester(index, TP)
    assert ing.process(topic, seq, payload) is outcome
    c = ing.counters.snapshot()
    assert c[f"rejected.{reason}"] == 1 and c["rejected"] == 1
    assert c["events_applied"] == 0


def test_no_model_needs_no_model_for_removals_and_lora() -> None:
    index = InMemoryIndex()
    ing = EventIngester(index, TP)
    feed = Feeder(ing, topic="kv@pod-a@")
    feed.send(
        BlockStored((1,), None, toks(0, 16), 16),
        BlockStored((2,), None, toks(0, 16), 16, lora_name="lora-1"),
        BlockRemoved((2,), medium="CPU"),
    )
    c = ing.counters.snapshot()
    assert (c["rejected.no_model"], c["events_applied"]) == (1, 2)
    assert index.lookup(keys(toks(0, 16), "lora-1"))


def test_hashing_failure_is_rejected() -> None:
    index = InMemoryIndex()
    ing = EventIngester(index, AllowlistTokenProcessor({"served"}))
    Feeder(ing, topic="kv@pod-a@other").send(
        BlockStored((1,), None, toks(0, 16), 16),
        BlockStored((2,), None, toks(0, 16), 16, lora_name="served"),
    )
    c = ing.counters.snapshot()
    assert (c["rejected.hashing_failed"], c["events_applied"]) == (1, 1)


def test_rejects_are_logged_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    ing = EventIngester(InMemoryIndex(), TP, config=IngesterConfig(reject_log_interval_s=60))
    feed = Feeder(ing)
    with caplog.at_level(logging.WARNING, logger="kvredis.ingest"):
        for _ in range(5):
            feed.send_payload(pack([0.0, [{"type": "Nope"}]]))
    assert ing.counters.get("rejected.unknown_tag") == 5
    assert sum("unknown_tag" in r.getMessage() for r in caplog.records) == 1


def test_bad_configuration_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        IngesterConfig(workers=0)
    with pytest.raises(ConfigError):
        IngesterConfig(peer_grace_s=-1)
    with pytest.raises(ConfigError):
        EndpointConfig("")
    with pytest.raises(ConfigError):
        EndpointConfig("tcp://h:1", pod_id="")
    ing = EventIngester(InMemoryIndex(), TP, [EndpointConfig("a", pod_id="p")])
    with pytest.raises(ConfigError, match="stream"):
        ing.add_endpoint(EndpointConfig("b", pod_id="p"))
    with pytest.raises(ConfigError, match="twice"):
        ing.add_endpoint(EndpointConfig("a"))
    with pytest.raises(InvalidInputError):
        ing.submit("t", 0, b"")


# -- sequencing -----------------------------------------------------------------------------


def test_watermark_positions() -> None:
    assert stream_position(-1, 1) == 1
    assert stream_position(0) == (1 << 16) | PHASE_DONE
    assert split_position(stream_position(41, 7)) == (41, 7)
    assert stream_position(3, 1) < stream_position(3) < stream_position(4, 1)
    assert Watermark(0, stream_position(2**47 - 2)).seq < 2**63


def test_lost_batches_clear_the_pod(shared_index: Any) -> None:
    ing = EventIngester(shared_index, TP, config=FAST)
    feed = Feeder(ing)
    feed.send(BlockStored((1, 2), None, toks(0, 32), 16))
    feed.seq = 5
    feed.send(BlockStored((9,), None, toks(300, 16), 16))
    assert shared_index.lookup(keys(toks(0, 32))) == {}
    assert shared_index.lookup(keys(toks(300, 16)))
    c = ing.counters.snapshot()
    assert (c["gaps"], c["clears_gap"], c["replays"]) == (1, 1, 0)
    assert shared_index.get_watermark(STREAM) == Watermark(0, stream_position(5))


def test_gap_before_anything_was_applied_clears_without_waiting(shared_index: Any) -> None:
    """With watermarks a peer may hold the gap's first batches: the pod is cleared at once."""
    other = EventIngester(shared_index, TP)
    Feeder(other, "kv@pod-a@m", "e2").send(BlockStored((1,), None, toks(0, 16), 16))
    ing = EventIngester(shared_index, TP, config=FAST)
    feed = Feeder(ing, "kv@pod-a@m")
    feed.seq = 7
    feed.send(BlockStored((5,), None, toks(100, 16), 16))
    c = ing.counters.snapshot()
    assert (c["clears_gap"], c["gaps"], c["peer_waits"]) == (1, 1, 0)
    assert not shared_index.lookup(keys(toks(0, 16), "m"))
    assert shared_index.lookup(keys(toks(100, 16), "m"))


def test_engine_restart_clears_and_starts_an_epoch(shared_index: Any) -> None:
    ing = EventIngester(shared_index, TP, config=FAST)
    feed = Feeder(ing)
    for i in range(3):
        feed.send(BlockStored((i + 1,), i or None, toks(16 * i, 16), 16))
    feed.seq = 0
    assert feed.send(BlockStored((50,), None, toks(900, 16), 16)) is BatchOutcome.APPLIED
    assert shared_index.lookup(keys(toks(0, 16))) == {}
    assert shared_index.lookup(keys(toks(900, 16)))
    assert shared_index.get_watermark(STREAM) == Watermark(1, stream_position(0))
    c = ing.counters.snapshot()
    assert (c["restarts"], c["clears_restart"], c["gaps"]) == (1, 1, 0)
    # the new incarnation's chains resolve again
    feed.send(BlockStored((51,), 50, toks(916, 16), 16))
    assert len(shared_index.lookup(keys(toks(900, 32)))) == 2


def test_restarted_ingester_skips_what_was_applied(shared_index: Any, second_client: Any) -> None:
    payloads = [
        encode_batch([BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)]) for i in range(6)
    ]
    first = EventIngester(shared_index, TP, config=FAST)
    for seq in range(4):
        first.process(TOPIC, seq, payloads[seq], "engine-1")
    again = EventIngester(second_client(shared_index), TP, config=FAST)
    outcomes = [again.process(TOPIC, seq, payloads[seq], "engine-1") for seq in range(2, 6)]
    assert outcomes == [BatchOutcome.DUPLICATE] * 2 + [BatchOutcome.APPLIED] * 2
    assert again.counters.get("clears") == 0
    assert len(shared_index.lookup(keys(toks(0, 96)))) == 6


def test_ingester_and_engine_restarted_together(shared_index: Any, second_client: Any) -> None:
    first = EventIngester(shared_index, TP, config=FAST)
    feed = Feeder(first)
    for i in range(40):
        feed.send(BlockStored((i + 1,), i or None, toks(16 * i, 16), 16))
    again = EventIngester(second_client(shared_index), TP, config=FAST)
    assert (
        again.process(
            TOPIC, 0, encode_batch([BlockStored((7,), None, toks(5000, 16), 16)]), "engine-1"
        )
        is BatchOutcome.APPLIED
    )
    assert again.counters.get("clears_restart") == 1
    assert shared_index.lookup(keys(toks(0, 16))) == {}
    assert shared_index.get_watermark(STREAM) == Watermark(1, stream_position(0))


def test_stalled_peer_batch_is_taken_over(shared_index: Any) -> None:
    ing = EventIngester(shared_index, TP, config=FAST)
    feed = Feeder(ing)
    feed.send(BlockStored((1,), None, toks(0, 16), 16))
    # a peer claimed batch 1 (a multi-step batch: it clears) and died before finishing it
    shared_index.reset_watermark(STREAM, Watermark(0, stream_position(1, 1)))
    outcome = feed.send(AllBlocksCleared(), BlockStored((2,), None, toks(16, 16), 16))
    assert outcome is BatchOutcome.APPLIED
    c = ing.counters.snapshot()
    assert (c["takeovers"], c["peer_waits"], c["clears"]) == (1, 1, 1)
    assert shared_index.get_watermark(STREAM) == Watermark(0, stream_position(1))
    assert shared_index.lookup(keys(toks(0, 16))) == {}
    assert shared_index.lookup(keys(toks(16, 16)))


def test_single_step_plan_overtakes_a_stalled_multi_step_owner(shared_index: Any) -> None:
    ing = EventIngester(shared_index, TP, config=FAST)
    feed = Feeder(ing)
    feed.send(BlockStored((1,), None, toks(0, 16), 16))
    shared_index.reset_watermark(STREAM, Watermark(0, stream_position(1, 3)))
    assert feed.send(BlockStored((2,), 1, toks(16, 16), 16)) is BatchOutcome.APPLIED
    assert ing.counters.get("takeovers") == 0
    assert shared_index.get_watermark(STREAM) == Watermark(0, stream_position(1))
    assert len(shared_index.lookup(keys(toks(0, 32)))) == 2


# -- high availability: two replicas on one index -----------------------------------------


def workload(n: int) -> list[bytes]:
    """Batches that store chains and remove blocks stored two steps earlier."""
    out = []
    for i in range(n):
        events: list[Event] = [
            BlockStored((1000 + i,), None if i % 5 == 0 else 999 + i, toks(16 * i, 16), 16)
        ]
        if i >= 2 and i % 3 == 0:
            events.append(BlockRemoved((998 + i,)))
        out.append(encode_batch(events, fmt="array" if i % 2 else "map"))
    return out


def reference_state(payloads: list[bytes]) -> dict[int, set[PodEntry]]:
    ref = InMemoryIndex()
    ing = EventIngester(ref, TP)
    for seq, payload in enumerate(payloads):
        ing.process(TOPIC, seq, payload, "engine-1")
    return snapshot(ref, len(payloads))


def workload_keys(n: int) -> list[int]:
    """The request key of each workload block (chains restart every 5 blocks)."""
    out: list[int] = []
    for i in range(n):
        parent = 0 if i % 5 == 0 else out[-1]
        out.append(keys(toks(16 * i, 16), parent=parent)[0])
    return out


def snapshot(index: Index, n: int) -> dict[int, set[PodEntry]]:
    out: dict[int, set[PodEntry]] = {}
    for key in workload_keys(n):
        found = index.lookup([key]).get(key)
        if found:
            out[key] = set(found)
    return out


def test_two_replicas_apply_each_batch_once_in_turns(shared_index: Any, second_client: Any) -> None:
    payloads = workload(30)
    a = EventIngester(shared_index, TP, config=FAST)
    b = EventIngester(second_client(shared_index), TP, config=FAST)
    spans = [(a, 0, 10), (b, 0, 15), (a, 10, 22), (b, 15, 30), (a, 22, 30)]
    for ing, lo, hi in spans:
        for seq in range(lo, hi):
            ing.process(TOPIC, seq, payloads[seq], "engine-1")
    applied = a.counters.get("batches_applied") + b.counters.get("batches_applied")
    assert applied == 30
    assert a.counters.get("batches_duplicate") + b.counters.get("batches_duplicate") == 30
    assert snapshot(shared_index, 30) == reference_state(payloads)


def test_two_replicas_concurrently(shared_index: Any, second_client: Any) -> None:
    payloads = workload(60)
    # Fed directly, one replica may run the whole workload before the other starts (one GIL
    # slice with the in-memory backend): a lag no live subscription has, so the window that
    # tells a lagging replica from a restarted engine (without replay) is widened here.
    config = IngesterConfig(peer_grace_s=0.05, poll_interval_s=0.005, restart_window=100)
    replicas = [
        EventIngester(shared_index, TP, config=config),
        EventIngester(second_client(shared_index), TP, config=config),
    ]

    def run(ing: EventIngester) -> None:
        for seq, payload in enumerate(payloads):
            ing.process(TOPIC, seq, payload, "engine-1")

    threads = [threading.Thread(target=run, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(r.counters.get("batches_applied") for r in replicas) == 60
    assert sum(r.counters.get("batches_failed") for r in replicas) == 0
    assert snapshot(shared_index, 60) == reference_state(payloads)


def test_two_replicas_agree_on_a_restart(shared_index: Any, second_client: Any) -> None:
    a = EventIngester(shared_index, TP, config=FAST)
    b = EventIngester(second_client(shared_index), TP, config=FAST)
    old = workload(5)
    for seq, payload in enumerate(old):
        a.process(TOPIC, seq, payload, "engine-1")
        b.process(TOPIC, seq, payload, "engine-1")
    new = [
        encode_batch([BlockStored((70 + i,), None, toks(7000 + 16 * i, 16), 16)]) for i in range(3)
    ]
    for seq, payload in enumerate(new):
        a.process(TOPIC, seq, payload, "engine-1")
    for seq, payload in enumerate(new):
        b.process(TOPIC, seq, payload, "engine-1")
    assert (a.counters.get("restarts"), b.counters.get("restarts")) == (1, 1)
    assert a.counters.get("clears") + b.counters.get("clears") == 1
    assert b.counters.get("batches_applied") == 0
    assert shared_index.get_watermark(STREAM) == Watermark(1, stream_position(2))
    assert snapshot(shared_index, 5) == {}
    for i in range(3):
        assert shared_index.lookup(keys(toks(7000 + 16 * i, 16)))


def test_two_replicas_restart_concurrently(shared_index: Any, second_client: Any) -> None:
    a = EventIngester(shared_index, TP, config=FAST)
    b = EventIngester(second_client(shared_index), TP, config=FAST)
    old = workload(5)
    new = [
        encode_batch([BlockStored((70 + i,), None, toks(7000 + 16 * i, 16), 16)]) for i in range(20)
    ]
    barrier = threading.Barrier(2)

    def run(ing: EventIngester) -> None:
        for seq, payload in enumerate(old):
            ing.process(TOPIC, seq, payload, "engine-1")
        barrier.wait(10)
        for seq, payload in enumerate(new):
            ing.process(TOPIC, seq, payload, "engine-1")

    threads = [threading.Thread(target=run, args=(r,)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert (a.counters.get("restarts"), b.counters.get("restarts")) == (1, 1)
    assert a.counters.get("clears") + b.counters.get("clears") == 1
    applied = a.counters.get("batches_applied") + b.counters.get("batches_applied")
    assert applied == 5 + 20
    assert snapshot(shared_index, 5) == {}
    for i in range(20):
        assert shared_index.lookup(keys(toks(7000 + 16 * i, 16)))


@pytest.mark.redis
def test_backend_outage_retries_then_applies(own_redis_server: Any) -> None:
    """While Redis answers nothing, batches wait and retry; a stop gives them up.

    ``CLIENT PAUSE ... WRITE`` holds every script call (all the index sends) without giving up
    the server's port.
    """
    import redis

    from kvredis import RedisIndex, RedisIndexConfig

    admin = redis.Redis.from_url(own_redis_server.url)
    index = RedisIndex(
        RedisIndexConfig(
            address=own_redis_server.url, namespace="outage", socket_timeout=0.2, retries=0
        )
    )
    ing = EventIngester(index, TP, config=IngesterConfig(backend_retry_max_s=0.05))
    feed = Feeder(ing)
    outcome: list[BatchOutcome] = []

    def send(n: int) -> threading.Thread:
        event = BlockStored((n,), None, toks(16 * n, 16), 16)
        thread = threading.Thread(target=lambda: outcome.append(feed.send(event)))
        thread.start()
        return thread

    worker: threading.Thread | None = None
    try:
        feed.send(BlockStored((1,), None, toks(16, 16), 16))
        admin.execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        worker = send(2)
        wait_until(lambda: ing.counters.get("backend_retries") >= 2)
        assert worker.is_alive()  # the batch waits for the backend instead of being dropped
        worker.join(30)
        assert outcome == [BatchOutcome.APPLIED]
        assert index.lookup(keys(toks(32, 16)))
        assert index.get_watermark(STREAM) == Watermark(0, stream_position(1))

        admin.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
        retries = ing.counters.get("backend_retries")
        worker = send(3)
        wait_until(lambda: ing.counters.get("backend_retries") >= retries + 2)
        assert ing.stop(timeout=10)  # shutting down during an outage does not hang
        worker.join(10)
        assert outcome[-1] is BatchOutcome.ABANDONED
        assert ing.counters.get("batches_abandoned") == 1
    finally:
        ing.stop()
        if worker is not None:
            worker.join(10)
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        index.close()


@pytest.mark.parametrize("use_replay_gap", [False, True])
def test_shutdown_while_waiting_on_peers_abandons_instead_of_clearing(
    shared_index: Any, use_replay_gap: bool
) -> None:
    """A replica stopped while it waits to tell a lagging peer from a restart clears nothing."""
    payloads = workload(50)
    first = EventIngester(shared_index, TP, config=FAST)
    for seq, payload in enumerate(payloads[:40]):
        first.process(TOPIC, seq, payload, "engine-1")
    patient = IngesterConfig(peer_grace_s=60, poll_interval_s=0.005, restart_window=2)
    late = EventIngester(shared_index, TP, config=patient)
    if use_replay_gap:
        assert late.process(TOPIC, 40, payloads[40], "engine-1") is BatchOutcome.APPLIED
        seq = 45  # a gap (41..44) no replay endpoint can fill: wait for a peer to cover it
    else:
        seq = 3  # far below the stored position: a restarted engine, or a peer far ahead?
    before = snapshot(shared_index, 50)
    assert before
    calls = late.counters.get("index_calls")
    outcome: list[BatchOutcome] = []
    worker = threading.Thread(
        target=lambda: outcome.append(late.process(TOPIC, seq, payloads[seq], "engine-1"))
    )
    worker.start()
    wait_until(lambda: late.counters.get("index_calls") >= calls + 3)
    assert worker.is_alive()  # still waiting for a peer's watermark to move
    assert late.stop(timeout=10)
    worker.join(10)
    assert outcome == [BatchOutcome.ABANDONED]
    assert late.counters.get("clears") == 0
    assert snapshot(shared_index, 50) == before


def test_a_replica_lagging_across_a_restart_drops_its_old_backlog(
    shared_index: Any, second_client: Any
) -> None:
    """Issue 13: B still holds old batches 2 and 3 when A has seen the engine restart."""
    a = EventIngester(shared_index, TP, config=FAST)
    b = EventIngester(second_client(shared_index), TP, config=FAST)
    old = [encode_batch([BlockStored((i + 1,), None, toks(16 * i, 16), 16)]) for i in range(4)]
    new = [
        encode_batch([BlockStored((70 + i,), None, toks(7000 + 16 * i, 16), 16)]) for i in range(3)
    ]
    for seq in range(2):
        a.process(TOPIC, seq, old[seq], "engine-1")
        b.process(TOPIC, seq, old[seq], "engine-1")
    for seq in range(2, 4):
        a.process(TOPIC, seq, old[seq], "engine-1")
    assert a.process(TOPIC, 0, new[0], "engine-1") is BatchOutcome.APPLIED
    # B's backlog of the old engine: superseded by the restart clear, never applied
    assert [b.process(TOPIC, seq, old[seq], "engine-1") for seq in (2, 3)] == [
        getattr(BatchOutcome, "SUPERSEDED", "superseded")
    ] * 2
    held_new = [bool(shared_index.lookup(keys(toks(7000, 16))))]
    held_old = [bool(shared_index.lookup(keys(toks(16 * i, 16)))) for i in range(4)]
    assert (held_new, held_old) == ([True], [False] * 4)
    assert shared_index.get_watermark(STREAM) == Watermark(1, stream_position(0))
    # both follow the new engine: each batch applied once, by whoever comes first
    assert a.process(TOPIC, 1, new[1], "engine-1") is BatchOutcome.APPLIED
    assert [b.process(TOPIC, seq, new[seq], "engine-1") for seq in range(3)] == [
        BatchOutcome.DUPLICATE,
        BatchOutcome.DUPLICATE,
        BatchOutcome.APPLIED,
    ]
    assert a.process(TOPIC, 2, new[2], "engine-1") is BatchOutcome.DUPLICATE
    assert all(shared_index.lookup(keys(toks(7000 + 16 * i, 16))) for i in range(3))
    assert shared_index.get_watermark(STREAM) == Watermark(1, stream_position(2))
    ca, cb = a.counters.snapshot(), b.counters.snapshot()
    assert ca["clears"] + cb["clears"] == 1
    assert (ca["clears_restart"], cb["restarts"], cb["epochs_adopted"]) == (1, 1, 1)
    assert ca["batches_applied"] + cb["batches_applied"] == 4 + 3
    assert cb["batches_superseded"] == 2


class BufferedReplay:
    """An engine's replay buffer of its last ``size`` batches."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.batches: list[tuple[int, bytes]] = []

    def keep(self, seq: int, payload: bytes) -> bytes:
        self.batches = [*self.batches, (seq, payload)][-self.size :]
        return payload

    def fetch(self, start_seq: int) -> list[ReplayedMessage] | None:
        return [ReplayedMessage(TOPIC.encode(), s, p) for s, p in self.batches if s >= start_seq]

    def close(self) -> None:
        pass


def test_a_redis_restart_that_loses_the_data_is_detected_and_replay_recovers(
    own_redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 9.15: a restart without persistence empties the namespace under the ingester."""
    from kvredis import RedisIndex, RedisIndexConfig

    index = RedisIndex(RedisIndexConfig(address=own_redis_server.url, namespace="reset"))
    replay = BufferedReplay(4)
    config = IngesterConfig(reset_check_interval_s=0.0, backend_retry_max_s=0.05)
    ing = EventIngester(index, TP, config=config, replay_factory=lambda _ep: replay)
    endpoint = EndpointConfig("engine-1", replay_endpoint="tcp://replay")
    payloads = [
        encode_batch([BlockStored((i + 1,), None, toks(16 * i, 16), 16)]) for i in range(12)
    ]
    try:
        for seq in range(10):
            ing.process(TOPIC, seq, replay.keep(seq, payloads[seq]), endpoint)
        own_redis_server.restart()  # no persistence: everything is gone
        with caplog.at_level(logging.ERROR, logger="kvredis.ingest.sequencer"):
            outcome = ing.process(TOPIC, 10, replay.keep(10, payloads[10]), endpoint)
        assert outcome is BatchOutcome.APPLIED
        assert any("lost its data" in r.getMessage() for r in caplog.records)
        assert ing.process(TOPIC, 11, replay.keep(11, payloads[11]), endpoint) is (
            BatchOutcome.APPLIED
        )
        c = ing.counters.snapshot()
        assert (c["namespace_resets"], c["replays"]) == (1, 1)
        # the replay buffer held batches 7..10: they are back, the older ones are lost
        held = [bool(index.lookup(keys(toks(16 * i, 16)))) for i in range(12)]
        assert held == [False] * 7 + [True] * 5
        assert index.get_watermark(STREAM) == Watermark(0, stream_position(11))
    finally:
        index.close()


# -- batches applied together ----------------------------------------------------------------


class _NoGroups:
    """An index whose apply_batches always fails (the others delegate)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def apply_batches(self, batches: Any) -> list[bool]:
        raise BackendError("the index went away")


def _page1_nodes() -> list[tuple[str, int, bytes]]:
    """SGLang page-1 radix nodes of 7, 20, 37, 9 and 23 tokens, each continuing the last: chains
    ending inside 16-token blocks, which only the ingester's memory of their pages continues."""
    from tests.ingest.test_fidelity import MODEL, sglang_nodes

    payloads = sglang_nodes((7, 20, 37, 9, 23), 1)
    return [(f"kv@pod-a@{MODEL}", seq, p) for seq, p in enumerate(payloads)]


def _page1_keys() -> list[int]:
    from tests.ingest.test_fidelity import MODEL, PROMPT, TP16

    return TP16.tokens_to_kv_block_keys(0, PROMPT[:96], MODEL)


def test_a_group_that_failed_is_applied_again_and_its_chains_continue() -> None:
    from tests.ingest.test_fidelity import TP16

    index = InMemoryIndex()
    ing = EventIngester(_NoGroups(index), TP16)
    assert ing.process_many(_page1_nodes()) == [BatchOutcome.APPLIED] * 5
    assert ing.counters.get("parent_misses") == 0
    assert len(index.lookup(_page1_keys())) == 6


def test_a_replica_whose_group_a_peer_applied_first_continues_its_chains() -> None:
    """HA: the peer applied the first batches; this replica's group is refused at the first,
    handled again as duplicates, and its later batches still find their parents."""
    from tests.ingest.test_fidelity import TP16

    index = InMemoryIndex()
    messages = _page1_nodes()
    peer, mine = EventIngester(index, TP16), EventIngester(index, TP16)
    for topic, seq, payload in messages[:3]:
        assert peer.process(topic, seq, payload) is BatchOutcome.APPLIED
    assert mine.process_many(messages) == [BatchOutcome.DUPLICATE] * 3 + [BatchOutcome.APPLIED] * 2
    assert mine.counters.get("parent_misses") == 0
    assert len(index.lookup(_page1_keys())) == 6

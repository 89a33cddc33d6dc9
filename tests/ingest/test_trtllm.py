"""TensorRT-LLM fleets: trtllm-serve's ``/kv_cache_events`` polled over real HTTP on loopback.

:class:`~kvredis.testing.trtllm.FakeTrtllmServe` answers exactly as trtllm-serve 1.2 does
(``KVCacheEventSerializer``'s JSON, events handed out once, a bounded buffer, ids per
attention-DP rank); an :class:`~kvredis.ingest.EventIngester` (and ``kvredis ingest``) with an
``http://`` endpoint polls it into the embedded index, Redis 7 and Valkey 9, and a router's keys
for the prompts are looked up.
"""

from __future__ import annotations

import json
import re
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.features import PlaceholderRange, compute_block_extra_features
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest import EndpointConfig, EventIngester, IngesterConfig
from kvredis.ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, Engine
from kvredis.ingest.trtllm import TrtllmDecoder, decode_event, split_events
from kvredis.testing.engine import wait_until
from kvredis.testing.trtllm import FakeTrtllmServe, event, stored, stored_block, updated

MODEL = "meta-llama/Llama-3.1-8B"
POD = "pod-t"
PROMPT = tuple(range(1000, 1200))  # 200 tokens: never a whole number of 32- or 64-token blocks
DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"


def tp(block: int) -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=block))


def keys(tokens: Sequence[int], block: int = 16, **kwargs: Any) -> list[int]:
    return tp(block).tokens_to_kv_block_keys(0, tokens, MODEL, **kwargs)


def tiers(index: Any, ks: Sequence[int], pod: str = POD) -> list[set[str]]:
    """Per key, in order until the first the pod does not hold: the tiers it holds it on."""
    found = index.lookup(list(ks), {pod})
    out = []
    for key in ks:
        if key not in found:
            break
        out.append({e.device_tier for e in found[key]})
    return out


def hits(index: Any, ks: Sequence[int], pod: str = POD) -> int:
    return len(tiers(index, ks, pod))


@pytest.fixture
def serve() -> Iterator[FakeTrtllmServe]:
    with FakeTrtllmServe(tokens_per_block=32, wait_s=0.05) as s:
        yield s


FAST = IngesterConfig(peer_grace_s=0.05, poll_interval_s=0.01)


def start(
    index: Any, serve: FakeTrtllmServe, block: int = 16, config: IngesterConfig = FAST
) -> EventIngester:
    endpoint = EndpointConfig(serve.url, pod_id=POD, model_name=MODEL)
    ing = EventIngester(index, tp(block), [endpoint], config)
    _HANDED_OUT_BEFORE[ing] = serve.handed_out
    ing.start()
    return ing


_HANDED_OUT_BEFORE: weakref.WeakKeyDictionary[EventIngester, int] = weakref.WeakKeyDictionary()


def settle(ing: EventIngester, serve: FakeTrtllmServe) -> None:
    """Wait until every buffered event was handed out to ``ing``, queued and applied."""
    before = _HANDED_OUT_BEFORE.get(ing, 0)
    wait_until(
        lambda: serve.pending() == 0 and ing.counters.get("received") >= serve.handed_out - before
    )
    assert ing.wait_idle(10)


# -- decoding ------------------------------------------------------------------------------------


def test_decode_the_serializer_shapes() -> None:
    blocks = [
        stored_block(2**64 - 1, range(32)),
        stored_block(7, range(32, 64), mm_keys=[("ab" * 32, 3)]),
        stored_block(8, range(64, 70)),  # a partial last block
    ]
    one = decode_event(json.dumps(event(5, stored(None, blocks), 4096, 1)).encode())
    assert (one.data_parallel_rank, one.engine, one.rejects) == (1, Engine.TRTLLM, ())
    full, partial = one.events
    assert isinstance(full, BlockStored) and isinstance(partial, BlockStored)
    assert (full.block_hashes, full.block_size, full.parent_block_hash) == (
        (2**64 - 1, 7),
        32,
        None,
    )
    assert full.token_ids == tuple(range(64))
    # a partial block: an engine page of its own, of the engine's block size, chained on
    assert (partial.block_hashes, partial.block_size, partial.parent_block_hash) == ((8,), 32, 7)
    assert partial.token_ids == tuple(range(64, 70))
    assert full.group_idx == partial.group_idx == 4096 and full.medium == "GPU"
    assert full.extra_keys is not None and full.extra_keys[0] is None
    assert [k.hash for k in full.extra_keys[1]] == ["ab" * 32]
    # the block size is learned: a lone block smaller than the largest seen is partial
    decoder = TrtllmDecoder()
    decoder(json.dumps(event(6, stored(None, blocks[:2]), 4096)).encode())
    lone = json.dumps(event(7, stored(7, [stored_block(9, range(64, 80))]), 4096)).encode()
    (known,) = decoder(lone).events
    assert isinstance(known, BlockStored) and known.block_size == decoder.tokens_per_block == 32
    (unknown,) = decode_event(lone).events  # unknown block size: taken for a whole block
    assert isinstance(unknown, BlockStored) and unknown.block_size == 16
    # a full sibling covers the partial block: its removal and tier moves are not applied
    sibling = json.dumps(event(8, stored(7, [stored_block(10, range(64, 96))]), 4096)).encode()
    decoder(sibling)
    drop = json.dumps(event(9, {"type": "removed", "block_hashes": [9, 10]}, 4096)).encode()
    assert [e.block_hashes for e in decoder(drop).events] == [(10,), (10,)]
    move = decode_event(json.dumps(event(6, updated(7, cache_level=(0, 1)), 4096)).encode())
    (moved,) = move.events
    assert isinstance(moved, BlockStored) and (moved.medium, moved.moved_from) == ("CPU", "GPU")
    prio = decode_event(json.dumps(event(7, updated(7, priority=(35, 90)), 4096)).encode())
    assert prio.events == () and prio.rejects == ()
    gone = decode_event(
        b'{"event_id":8,"data":{"type":"removed","block_hashes":[7]},"window_size":64}'
    )
    assert gone.events == (
        BlockRemoved((7,), medium="GPU", group_idx=64),
        BlockRemoved((7,), medium="CPU", group_idx=64),
    )
    new = decode_event(
        b'{"event_id":0,"data":{"type":"created","num_blocks_per_cache_level":[9,0]}}'
    )
    assert new.events == (AllBlocksCleared(),)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{", "malformed_payload"),
        (b"[]", "bad_batch"),
        (b'{"event_id":1,"data":{"type":"evicted"}}', "unknown_tag"),
        (b'{"event_id":1,"data":{"type":"removed","block_hashes":[true]}}', "bad_hash"),
        (b'{"event_id":1,"data":{"type":"removed","block_hashes":[-1e30]}}', "bad_hash"),
        (
            b'{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[{"block_hash":1,'
            b'"tokens":[{"token_id":5,"token_extra_id":3}],"cache_level":0}]}}',
            "unplaced_extra_key",
        ),
        (
            b'{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[{"block_hash":1,'
            b'"tokens":[{"token_id":5,"token_extra_id":0}],"cache_level":0,"lora_id":3}]}}',
            "unplaced_extra_key",
        ),
        (
            b'{"event_id":1,"data":{"type":"stored","parent_hash":null,"blocks":[{"block_hash":1,'
            b'"tokens":[{"token_id":5}],"cache_level":2}]}}',
            "bad_field_value",
        ),
        (b'{"event_id":1,"data":{"type":"created"},"window_size":-4}', "bad_field_value"),
    ],
)
def test_bad_events_are_rejected_with_a_reason(body: bytes, reason: str) -> None:
    decoded = decode_event(body)
    assert decoded.events == ()
    assert [r.reason.value for r in decoded.rejects] == [reason]


def test_an_answer_is_cut_into_one_message_per_event() -> None:
    answer = json.dumps(
        [
            event(3, stored(None, [stored_block(1, range(4))]), 64, 0),
            {"data": {}},
            event(0, {"type": "removed", "block_hashes": [1]}, 64, 1),
            "x",
        ]
    ).encode()
    events, problems = split_events(answer)
    assert [(e.event_id, e.rank) for e in events] == [(3, 0), (0, 1)]
    assert len(problems) == 2
    assert json.loads(events[1].payload)["data"]["block_hashes"] == [1]
    assert split_events(b'{"detail":"Not Found"}')[0] == []


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
_KEYS = [
    "event_id",
    "data",
    "window_size",
    "attention_dp_rank",
    "type",
    "blocks",
    "parent_hash",
    "block_hash",
    "tokens",
    "token_id",
    "token_extra_id",
    "cache_level",
    "block_hashes",
    "mm_keys",
    "new_value",
    "old_value",
    "hash",
    "start_offset",
    "lora_id",
    "cache_salt",
]
_SHAPED = st.recursive(
    _JSON,
    lambda inner: (
        st.dictionaries(st.sampled_from(_KEYS), inner, max_size=6)
        | st.lists(inner, max_size=4)
        | st.fixed_dictionaries(
            {"type": st.sampled_from(["stored", "removed", "updated", "created", "stored_block"])},
            optional={k: inner for k in _KEYS if k != "type"},
        )
    ),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(_SHAPED)
def test_any_json_decodes_without_raising(obj: Any) -> None:
    body = json.dumps(obj).encode()
    decoded = TrtllmDecoder()(body)
    assert decoded.engine is Engine.TRTLLM
    assert decoded.events or decoded.rejects or decoded.total_events == 1
    events, problems = split_events(json.dumps([obj, {"event_id": 1, "data": obj}]).encode())
    assert len(events) + len(problems) == 2


# -- through the ingester ------------------------------------------------------------------------


@pytest.mark.parametrize("engine_block", [16, 32, 64])
@pytest.mark.parametrize("block", [16, 64])
def test_every_full_block_of_a_prompt_with_a_partial_last_block(
    engine_index: Any, engine_block: int, block: int
) -> None:
    with FakeTrtllmServe(tokens_per_block=engine_block, wait_s=0.05) as serve:
        ing = start(engine_index, serve, block)
        try:
            branch = PROMPT[:40] + tuple(range(9000, 9100))
            serve.store(PROMPT[:100])  # the last engine block partial
            serve.store(PROMPT)  # a longer prompt: it continues from the whole blocks
            serve.store(branch)  # a branch
            settle(ing, serve)
            assert ing.counters.get("rejected") == 0
            for prompt in (PROMPT[:100], PROMPT, branch):
                want = keys(prompt, block)
                assert hits(engine_index, want) == len(want)
                assert tiers(engine_index, want) == [{"gpu"}] * len(want)
            assert ing.counters.get("parent_misses") == 0
        finally:
            assert ing.stop()


def test_a_partial_blocks_removal_leaves_its_full_sibling(engine_index: Any) -> None:
    # partial reuse: a request extending a sequence copies its partial last block into a new,
    # full sibling; the partial block's removal must not take the sibling's index blocks away
    with FakeTrtllmServe(tokens_per_block=32, wait_s=0.05) as serve:
        ing = start(engine_index, serve, 16)
        try:
            serve.store(PROMPT[:56])  # a whole block, then a partial one of 24 tokens
            settle(ing, serve)
            assert hits(engine_index, keys(PROMPT[:56])) == 3  # the partial block's first
            serve.store(PROMPT[:128])  # a full block over the partial one's tokens, and on
            serve.evict(PROMPT[:56], 1)  # the partial block goes
            settle(ing, serve)
            assert hits(engine_index, keys(PROMPT[:128])) == 8
            serve.evict(PROMPT[:128], 3)  # the full blocks from the second on
            settle(ing, serve)
            assert hits(engine_index, keys(PROMPT[:128])) == 2
        finally:
            assert ing.stop()


def test_offload_and_onboard_move_the_tier(engine_index: Any) -> None:
    with FakeTrtllmServe(tokens_per_block=16, wait_s=0.05) as serve:
        ing = start(engine_index, serve)
        try:
            hashes = serve.store(PROMPT[:64])
            serve.offload(hashes[2])
            serve.offload(hashes[3])
            settle(ing, serve)
            assert tiers(engine_index, keys(PROMPT[:64])) == [{"gpu"}, {"gpu"}, {"cpu"}, {"cpu"}]
            serve.onboard(hashes[2])
            settle(ing, serve)
            assert tiers(engine_index, keys(PROMPT[:64])) == [{"gpu"}, {"gpu"}, {"gpu"}, {"cpu"}]
            # a removal names no level: the block goes from whichever holds it
            serve.evict(PROMPT[:64], 1)
            settle(ing, serve)
            assert tiers(engine_index, keys(PROMPT[:64])) == [{"gpu"}] * 3
            assert ing.counters.get("tier_updates") == 3
        finally:
            assert ing.stop()


def test_removed_blocks_leave_the_index(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        serve.store(PROMPT[:128])
        settle(ing, serve)
        assert hits(engine_index, keys(PROMPT[:128])) == 8
        serve.evict(PROMPT[:128], 2)  # the last two 32-token blocks
        settle(ing, serve)
        assert hits(engine_index, keys(PROMPT[:128])) == 4
    finally:
        assert ing.stop()


def test_a_restart_clears_the_pod(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        serve.store(PROMPT[:64])
        settle(ing, serve)
        serve.restart()  # event ids start over at 0, with created
        serve.store(PROMPT[100:164])
        settle(ing, serve)
        assert hits(engine_index, keys(PROMPT[:64])) == 0
        assert hits(engine_index, keys(PROMPT[100:164])) == 4
        c = ing.counters.snapshot()
        assert (c["restarts"], c["clears_restart"], c["gaps"]) == (1, 1, 0)
    finally:
        assert ing.stop()


def test_lost_events_clear_the_pod(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        serve.store(PROMPT[:64])
        settle(ing, serve)
        serve.skip(2)  # two events the buffer dropped
        serve.store(PROMPT[100:164])
        settle(ing, serve)
        assert hits(engine_index, keys(PROMPT[:64])) == 0  # no replay: a lost event clears
        assert hits(engine_index, keys(PROMPT[100:164])) == 4
        c = ing.counters.snapshot()
        assert (c["gaps"], c["clears_gap"], c["replays"], c["restarts"]) == (1, 1, 0, 0)
    finally:
        assert ing.stop()


def test_a_full_buffer_before_the_first_poll_is_a_gap(engine_index: Any) -> None:
    with FakeTrtllmServe(tokens_per_block=32, wait_s=0.05, buffer_size=3) as serve:
        for i in range(5):  # created, then 5 stores: the buffer keeps the last 3
            serve.store(PROMPT[40 * i : 40 * i + 32])
        assert serve.dropped == 3
        ing = start(engine_index, serve)
        try:
            settle(ing, serve)
            for i in range(2, 5):
                assert hits(engine_index, keys(PROMPT[40 * i : 40 * i + 32])) == 2
            c = ing.counters.snapshot()
            assert (c["gaps"], c["batches_applied"]) == (1, 3)
        finally:
            assert ing.stop()


def test_exactly_once_across_an_ingester_restart(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        serve.store(PROMPT[:64])
        settle(ing, serve)
    finally:
        assert ing.stop()
    serve.store(PROMPT[:128])  # while no ingester runs
    serve.evict(PROMPT[:128], 1)
    again = start(engine_index, serve)
    try:
        settle(again, serve)
        assert hits(engine_index, keys(PROMPT[:128])) == 6
        c = again.counters.snapshot()
        assert (c["batches_applied"], c["gaps"], c["restarts"], c["clears"]) == (2, 0, 0, 0)
        assert engine_index.get_watermark(POD) is not None
    finally:
        assert again.stop()


def test_attention_dp_ranks_are_streams_of_their_own(engine_index: Any) -> None:
    with FakeTrtllmServe(tokens_per_block=32, wait_s=0.05, attention_dp_size=2) as serve:
        ing = start(engine_index, serve)
        try:
            serve.store(PROMPT[:64], rank=0)
            serve.store(PROMPT[:64], rank=1)
            serve.store(PROMPT[100:164], rank=1)
            settle(ing, serve)
            found = engine_index.lookup(keys(PROMPT[:64]), {POD})
            assert {e.dp_rank for e in found[keys(PROMPT[:64])[0]]} == {0, 1}
            # rank 1 loses events: only its entries go
            serve.skip(1, rank=1)
            serve.store(PROMPT[:32] + PROMPT[150:182], rank=1)
            settle(ing, serve)
            found = engine_index.lookup(keys(PROMPT[:64]), {POD})
            assert {e.dp_rank for e in found[keys(PROMPT[:64])[0]]} == {0}
            assert hits(engine_index, keys(PROMPT[100:164])) == 0
            assert ing.counters.get("clears_gap") == 1
            assert engine_index.get_watermark(POD) is not None
            assert engine_index.get_watermark(f"{POD}#dp1") is not None
        finally:
            assert ing.stop()


def test_window_sizes_are_kv_cache_groups(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        full = serve.store(PROMPT[:64], window_size=4096)
        serve.emit(
            stored(
                None, [stored_block(h, PROMPT[32 * i : 32 * i + 32]) for i, h in enumerate(full)]
            ),
            window_size=128,
        )
        settle(ing, serve)
        found = engine_index.lookup(keys(PROMPT[:64]), {POD})
        assert {e.group_idx for e in found[keys(PROMPT[:64])[0]]} == {4096, 128}
        # the sliding window drops the blocks: the full-attention window still holds them
        serve.emit({"type": "removed", "block_hashes": full}, window_size=128)
        settle(ing, serve)
        found = engine_index.lookup(keys(PROMPT[:64]), {POD})
        assert all({e.group_idx for e in found[k]} == {4096} for k in keys(PROMPT[:64]))
    finally:
        assert ing.stop()


def test_multimodal_items_are_features(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        digest = "9f" * 32
        serve.store(PROMPT[:64], mm_keys={0: [(digest, 0)]})  # an image on tokens 4..27
        settle(ing, serve)
        feats = compute_block_extra_features(
            {"image": [digest]}, {"image": [PlaceholderRange(4, 24)]}, 16, 64
        )
        assert hits(engine_index, keys(PROMPT[:64], extra_features=feats)) == 4
        assert hits(engine_index, keys(PROMPT[:64])) == 0
    finally:
        assert ing.stop()


def test_a_token_extra_id_refuses_the_event(engine_index: Any, serve: FakeTrtllmServe) -> None:
    ing = start(engine_index, serve)
    try:
        block = stored_block(5, PROMPT[:32], token_extra_ids=[0] * 31 + [7])
        serve.emit(stored(None, [block]))
        serve.store(PROMPT[100:132])
        settle(ing, serve)
        assert ing.counters.get("rejected.unplaced_extra_key") == 1
        assert hits(engine_index, keys(PROMPT[:32])) == 0
        assert hits(engine_index, keys(PROMPT[100:132])) == 2
    finally:
        assert ing.stop()


def test_a_server_that_is_not_up_yet(engine_index: Any) -> None:
    from kvredis.testing.servers import free_port

    port = free_port()
    endpoint = EndpointConfig(f"http://127.0.0.1:{port}", pod_id=POD, model_name=MODEL)
    ing = EventIngester(engine_index, tp(16), [endpoint], FAST)
    ing.start()
    try:
        wait_until(lambda: ing.counters.get("transport_errors") >= 1)
        assert ing.counters.get("connects") == 0
        with FakeTrtllmServe(port=port, wait_s=0.05) as serve:
            serve.store(PROMPT[:32])
            settle(ing, serve)
            assert ing.counters.get("connects") == 1
            assert hits(engine_index, keys(PROMPT[:32])) == 2
    finally:
        assert ing.stop()


# -- kvredis ingest, as docs/engines.md runs it ---------------------------------------------------


def _documented(marker: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {marker} -->\n```\w+\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert m, f"docs/engines.md has no block marked {marker}"
    return m.group(1)


def test_documented_trtllm_serve_settings_turn_the_events_on() -> None:
    config = _documented("trtllm-serve-config")
    assert re.search(r"^kv_cache_config:\n(?:  .*\n)*  enable_block_reuse: true$", config, re.M)
    size = re.search(r"^  event_buffer_max_size: (\d+)$", config, re.M)
    assert size and int(size.group(1)) > 0


@pytest.mark.redis
def test_the_documented_ingest_command(redis_server_url: str, namespace: str) -> None:
    from kvredis import RedisIndex, RedisIndexConfig
    from kvredis.cli.ingest import ingest

    args = _documented("trtllm-ingest").replace("\\\n", " ").split()[2:]  # after "kvredis ingest"
    with FakeTrtllmServe(tokens_per_block=32, wait_s=0.05) as serve:
        port = serve.url.rsplit(":", 1)[1]
        args = [a.replace("redis://127.0.0.1:6379", redis_server_url) for a in args]
        args = [re.sub(r"^http://[^/]+:8000$", f"http://127.0.0.1:{port}", a) for a in args]
        assert f"http://127.0.0.1:{port}" in args
        serve.store(PROMPT[:100])
        serve.store(PROMPT)
        result = CliRunner().invoke(
            ingest, [*args, "--namespace", namespace, "--duration", "1.5", "--status-interval", "1"]
        )
    assert result.exit_code == 0, result.output
    pod = args[args.index("--pod") + 1]
    model = args[args.index("--model") + 1]
    block = int(args[args.index("--block-size") + 1])
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    try:
        want = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=block))
        ks = want.tokens_to_kv_block_keys(0, PROMPT, model)
        found = index.lookup(ks, {pod})
        assert len(found) == len(ks)
    finally:
        index.close()
    time.sleep(0)  # the command stopped its poller (checked by its own drain)

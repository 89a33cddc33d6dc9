"""Ingestion over real ZMQ sockets on loopback: live events, replay, gaps, restarts, HA, stop."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvredis.hashing import ChunkedTokenDatabase
from kvredis.ingest import BatchOutcome, EndpointConfig, EventIngester, IngesterConfig
from kvredis.ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvredis.memory import InMemoryIndex
from kvredis.types import PodEntry
from tests.ingest.engine import (
    FakeEngine,
    assert_no_leaked_ingesters,
    ingester_threads,
    wait_until,
)

pytestmark = pytest.mark.zmq

TP = ChunkedTokenDatabase()
CONFIG = IngesterConfig(workers=2, peer_grace_s=0.05, replay_timeout_s=1.0, poll_interval_s=0.005)
GPU = PodEntry("pod-a", "gpu")


def toks(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def chain(tokens: tuple[int, ...], model: str = "model-a") -> list[int]:
    return TP.tokens_to_kv_block_keys(0, tokens, model)


def held(index: Any, tokens: tuple[int, ...]) -> int:
    """How many leading blocks of ``tokens`` the index holds."""
    return len(index.lookup(chain(tokens)))


@pytest.fixture(autouse=True)
def no_leaked_ingesters() -> Iterator[None]:
    """Every test stops the ingesters it starts (a leaked one keeps retrying a gone backend)."""
    before = ingester_threads()
    yield
    assert_no_leaked_ingesters(before)


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with FakeEngine() as eng:
        yield eng


def start(index: Any, eng: FakeEngine, config: IngesterConfig = CONFIG, **ep: Any) -> EventIngester:
    ing = EventIngester(index, TP, [EndpointConfig(eng.endpoint, **ep)], config)
    ing.start()
    try:
        eng.wait_subscribed()
    except BaseException:
        ing.stop(drain=False)
        raise
    return ing


def settle(ing: EventIngester, batches: int) -> None:
    wait_until(lambda: ing.counters.get("batches") >= batches)
    assert ing.wait_idle(10)


def test_live_events_in_map_and_array_formats(engine: FakeEngine) -> None:
    index = InMemoryIndex()
    ing = start(index, engine)
    try:
        engine.publish([BlockStored((1, 2), None, toks(0, 32), 16)], fmt="map")
        engine.publish([BlockStored((3, 4), 2, toks(32, 32), 16, medium="GPU")], fmt="array")
        engine.publish(
            [BlockRemoved((4,)), BlockStored((9,), None, toks(900, 16), 16)], fmt="array"
        )
        engine.publish(
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [-5],
                    "parent_block_hash": 3,
                    "token_ids": list(toks(48, 16)),
                    "block_size": 16,
                    "medium": "CPU",
                }
            ]
        )
        settle(ing, 4)
        blocks = chain(toks(0, 64))
        assert held(index, toks(0, 64)) == 4
        assert index.lookup([blocks[2]]) == {blocks[2]: [GPU]}
        # block 3 left the GPU, then came back on the CPU (sent as signed hash -5)
        assert index.lookup([blocks[3]]) == {blocks[3]: [PodEntry("pod-a", "cpu")]}
        assert set(index.lookup(chain(toks(900, 16)))[chain(toks(900, 16))[0]]) == {GPU}
        # the signed hash -5 is stored as its two's complement
        assert index.get_request_key(2**64 - 5) == chain(toks(0, 64))[3]
        c = ing.counters.snapshot()
        assert (c["received"], c["batches_applied"], c["gaps"], c["rejected"]) == (4, 4, 0, 0)
    finally:
        assert ing.stop()


@pytest.mark.parametrize("topic_frame", [True, False], ids=["topic-frame", "no-topic-frame"])
def test_gap_is_filled_by_replay(topic_frame: bool) -> None:
    with FakeEngine(replay_topic_frame=topic_frame) as eng:
        index = InMemoryIndex()
        ing = start(index, eng, replay_endpoint=eng.replay_endpoint)
        try:
            eng.publish([BlockStored((1,), None, toks(0, 16), 16)])
            for i in range(1, 4):  # lost on the wire, still in the engine's replay buffer
                eng.publish([BlockStored((i + 1,), i, toks(16 * i, 16), 16)], send=False)
            eng.publish([BlockStored((5,), 4, toks(64, 16), 16)], fmt="array")
            settle(ing, 5)
            assert held(index, toks(0, 80)) == 5
            assert eng.replay_requests == [1]
            c = ing.counters.snapshot()
            # 1..3 replayed; the batch in hand is applied as received
            assert (c["gaps"], c["replays"], c["replayed_batches"], c["clears"]) == (1, 1, 3, 0)
            assert c["batches_applied"] == 5 and c["batches_duplicate"] == 0
        finally:
            assert ing.stop()


def test_gap_beyond_the_replay_buffer_clears_and_resumes() -> None:
    with FakeEngine(buffer_size=3) as eng:
        index = InMemoryIndex()
        ing = start(index, eng, replay_endpoint=eng.replay_endpoint)
        try:
            eng.publish([BlockStored((1,), None, toks(0, 16), 16)])
            for i in range(1, 6):  # lost, and pushed out of the 3-batch buffer
                eng.publish([BlockStored((i + 1,), i, toks(16 * i, 16), 16)], send=False)
            eng.publish([BlockStored((100,), None, toks(1000, 16), 16)], send=False)  # seq 6
            eng.publish([BlockStored((101,), 100, toks(1016, 16), 16)], send=False)  # seq 7
            eng.publish([BlockStored((102,), 101, toks(1032, 16), 16)])  # seq 8, live
            wait_until(lambda: ing.counters.get("clears_gap") == 1)
            assert ing.wait_idle(10)
            assert held(index, toks(0, 16)) == 0
            # the replayed tail (6, 7) and the live batch 8 apply after the clear
            assert held(index, toks(1000, 48)) == 3
            assert eng.replay_requests == [1]
            c = ing.counters.snapshot()
            assert (c["gaps"], c["replays"], c["replay_failures"], c["clears"]) == (1, 1, 1, 1)
            assert c["batches_applied"] == 4 and c["parent_misses"] == 0
        finally:
            assert ing.stop()


def test_engine_restart_clears_and_resumes(engine: FakeEngine) -> None:
    index = InMemoryIndex()
    ing = start(index, engine, replay_endpoint=engine.replay_endpoint)
    try:
        for i in range(3):
            engine.publish([BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)])
        settle(ing, 3)
        assert held(index, toks(0, 48)) == 3
        engine.restart()
        engine.wait_subscribed()
        engine.publish([BlockStored((100,), None, toks(5000, 16), 16)])
        engine.publish([BlockStored((101,), 100, toks(5016, 16), 16)])
        wait_until(lambda: ing.counters.get("batches_applied") >= 5)
        assert ing.wait_idle(10)
        assert held(index, toks(0, 48)) == 0
        assert held(index, toks(5000, 32)) == 2
        c = ing.counters.snapshot()
        assert (c["restarts"], c["clears_restart"], c["gaps"]) == (1, 1, 0)
        assert c["connects"] >= 2 and c["disconnects"] >= 1
        # the engine's stream: the endpoint's, and the engine its topic names
        stream = f"{engine.endpoint}#kv@pod-a@model-a"
        assert index.get_watermark(stream) is not None
        assert index.get_watermark(stream).epoch == 1  # type: ignore[union-attr]
    finally:
        assert ing.stop()


def test_configured_pod_and_model_with_the_default_empty_topic() -> None:
    with FakeEngine(topic="") as eng:
        index = InMemoryIndex()
        ing = start(index, eng, pod_id="pod-z", model_name="model-z")
        try:
            eng.publish(
                [
                    BlockStored((1,), None, toks(0, 16), 16),
                    AllBlocksCleared(),
                    BlockStored((2,), None, toks(16, 16), 16),
                ]
            )
            settle(ing, 1)
            assert index.lookup(chain(toks(0, 16), "model-z")) == {}
            key = chain(toks(16, 16), "model-z")[0]
            assert index.lookup([key]) == {key: [PodEntry("pod-z", "gpu")]}
            assert index.get_watermark("pod-z") is not None
        finally:
            assert ing.stop()


def test_malformed_messages_are_rejected_and_the_stream_goes_on(engine: FakeEngine) -> None:
    index = InMemoryIndex()
    ing = start(index, engine)
    try:
        engine.send_frames([b"kv@pod-a@model-a", b"\x00\x00"])
        engine.send_frames([b"kv@pod-a@model-a", b"\x00" * 4, b"payload"])
        engine.publish_payload(b"\xc1 not msgpack")
        engine.publish([BlockStored((1,), None, toks(0, 16), 16)])
        settle(ing, 2)
        c = ing.counters.snapshot()
        assert c["rejected.bad_message"] == 2 and c["rejected.malformed_payload"] == 1
        assert (c["batches_rejected"], c["batches_applied"], c["gaps"]) == (1, 1, 0)
        assert held(index, toks(0, 16)) == 1
    finally:
        assert ing.stop()


def test_backpressure_loses_nothing(engine: FakeEngine) -> None:
    index = InMemoryIndex()
    config = IngesterConfig(workers=1, queue_size=2, peer_grace_s=0.05)
    ing = start(index, engine, config)
    try:
        n = 300
        for i in range(n):
            engine.publish([BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)])
        settle(ing, n)
        assert ing.counters.get("gaps") == 0
        assert held(index, toks(0, 16 * n)) == n
    finally:
        assert ing.stop()


@pytest.mark.redis
def test_stop_drains_everything_received(redis_server_url: str, engine: FakeEngine) -> None:
    from kvredis import RedisIndex, RedisIndexConfig

    index = RedisIndex(
        RedisIndexConfig(address=redis_server_url, namespace=f"kvt-{uuid.uuid4().hex[:12]}")
    )
    try:
        ing = start(index, engine, IngesterConfig(workers=1, queue_size=10_000))
        try:
            n = 400
            for i in range(n):
                engine.publish([BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)])
            wait_until(lambda: ing.counters.get("received") == n)
            assert ing.stop(drain=True)
            assert ing.counters.get("batches_applied") == n
            assert held(index, toks(0, 16 * n)) == n
        finally:
            ing.stop(drain=False)
    finally:
        index.close()


@pytest.mark.redis
def test_two_ingesters_on_one_redis(redis_server_url: str, engine: FakeEngine) -> None:
    """HA: both replicas consume the same engine; each batch takes effect once, restarts too."""
    from kvredis import RedisIndex, RedisIndexConfig

    config = RedisIndexConfig(address=redis_server_url, namespace=f"kvt-{uuid.uuid4().hex[:12]}")
    clients = [RedisIndex(config), RedisIndex(config)]
    ings = [
        EventIngester(c, TP, [EndpointConfig(engine.endpoint, pod_id="pod-a")], CONFIG)
        for c in clients
    ]
    try:
        for ing in ings:
            ing.start()
            engine.wait_subscribed()
        n = 120
        for i in range(n):
            events: list[Any] = [BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)]
            if i % 4 == 3:
                events.append(BlockRemoved((i,)))  # drop the previous block
            engine.publish(events, fmt="array" if i % 2 else "map")
        for ing in ings:
            settle(ing, n)
        applied = sum(i.counters.get("batches_applied") for i in ings)
        assert applied == n
        expected = {k for j, k in enumerate(chain(toks(0, 16 * n))) if j % 4 != 2}
        present = {k for k in chain(toks(0, 16 * n)) if clients[0].lookup([k])}
        assert present == expected

        engine.restart()
        for _ in ings:
            engine.wait_subscribed()
        for i in range(10):
            engine.publish(
                [BlockStored((500 + i,), 499 + i if i else None, toks(8000 + 16 * i, 16), 16)]
            )
        for ing in ings:
            wait_until(lambda ing=ing: ing.counters.get("restarts") == 1)
            settle(ing, n + 10)
        assert sum(i.counters.get("clears_restart") for i in ings) == 1
        assert sum(i.counters.get("batches_applied") for i in ings) == n + 10
        assert not any(clients[0].lookup([k]) for k in expected)
        assert held(clients[0], toks(8000, 160)) == 10
        assert clients[0].get_watermark("pod-a").epoch == 1  # type: ignore[union-attr]
    finally:
        for ing in ings:
            ing.stop()
        for c in clients:
            c.close()


def test_fresh_replica_probes_replay_to_tell_a_restart_from_a_peer_ahead() -> None:
    """A new replica sees seq below the stored position: the engine's replay buffer decides."""
    with FakeEngine() as eng:
        index = InMemoryIndex()
        payloads = [
            encode_batch([BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)])
            for i in range(10)
        ]
        ahead = EventIngester(index, TP, config=CONFIG)
        for seq, payload in enumerate(payloads):
            eng.publish_payload(payload, send=False)  # in the engine's buffer, seq 0..9
            ahead.process(eng.topic, seq, payload, eng.endpoint)

        # a peer is ahead: the engine still buffers seq 9, so seq 5 is a duplicate
        ep = EndpointConfig(eng.endpoint, replay_endpoint=eng.replay_endpoint)
        late = EventIngester(index, TP, [ep], CONFIG)
        try:
            assert late.process(eng.topic, 5, payloads[5], ep) is BatchOutcome.DUPLICATE
            assert eng.replay_requests == [9]
            assert late.counters.get("clears") == 0
        finally:
            late.stop()

        # the engine restarted: nothing at or after seq 9 is buffered any more
        eng.restart()
        fresh = encode_batch([BlockStored((77,), None, toks(7000, 16), 16)])
        eng.publish_payload(fresh, send=False)
        restarted = EventIngester(index, TP, [ep], CONFIG)
        try:
            assert restarted.process(eng.topic, 0, fresh, ep) is BatchOutcome.APPLIED
            assert eng.replay_requests == [9, 9]
            assert restarted.counters.get("clears_restart") == 1
            assert held(index, toks(0, 160)) == 0
            assert held(index, toks(7000, 16)) == 1
        finally:
            restarted.stop()


def test_replay_fills_only_up_to_the_batch_in_hand() -> None:
    """Batches the engine published after the gap arrive live: no spurious restart."""
    with FakeEngine() as eng:
        index = InMemoryIndex()
        ep = EndpointConfig(eng.endpoint, replay_endpoint=eng.replay_endpoint)
        ing = EventIngester(index, TP, [ep], CONFIG)
        payloads = [
            encode_batch([BlockStored((i + 1,), i or None, toks(16 * i, 16), 16)]) for i in range(7)
        ]
        try:
            for payload in payloads:
                eng.publish_payload(payload, send=False)
            assert ing.process(eng.topic, 0, payloads[0], ep) is BatchOutcome.APPLIED
            # 1..3 were lost; 4 arrives while 5 and 6 are already in the engine's buffer
            # (1..3 are applied from the replay, then 4 as received)
            assert ing.process(eng.topic, 4, payloads[4], ep) is BatchOutcome.APPLIED
            assert eng.replay_requests == [1]
            assert held(index, toks(0, 112)) == 5
            for seq in (5, 6):
                assert ing.process(eng.topic, seq, payloads[seq], ep) is BatchOutcome.APPLIED
            c = ing.counters.snapshot()
            assert (c["restarts"], c["clears"], c["replayed_batches"]) == (0, 0, 3)
            assert held(index, toks(0, 112)) == 7
        finally:
            ing.stop()


@pytest.mark.redis
def test_stop_during_a_backend_outage_with_a_full_queue(
    own_redis_server: Any, engine: FakeEngine
) -> None:
    """A receiver blocked on a full queue while the backend is down does not hold up stop()."""
    from kvredis import RedisIndex, RedisIndexConfig

    index = RedisIndex(
        RedisIndexConfig(address=own_redis_server.url, connect_timeout=0.2, retries=0)
    )
    own_redis_server.stop()
    config = IngesterConfig(workers=1, queue_size=1, backend_retry_max_s=0.05)
    before = ingester_threads()
    ing = start(index, engine, config)
    try:
        for i in range(5):
            engine.publish([BlockStored((i + 1,), None, toks(16 * i, 16), 16)])
        # the worker retries the first batch, one waits in the queue, the receiver blocks
        wait_until(lambda: ing.counters.get("backend_retries") >= 2)
        wait_until(lambda: ing.counters.get("received") >= 3)
        assert ing.stop(timeout=5)
        assert ing.counters.get("batches_applied") == 0
        assert ing.counters.get("batches_abandoned") >= 1
        assert not ingester_threads() - before
    finally:
        ing.stop()
        index.close()


def test_oversized_messages_are_refused_at_the_socket_and_ingest_goes_on() -> None:
    """A flood over ``max_message_bytes`` never reaches the queues; valid batches still apply."""
    config = IngesterConfig(
        workers=2, peer_grace_s=0.05, poll_interval_s=0.005, max_message_bytes=1 << 20
    )
    with FakeEngine() as eng:
        index = InMemoryIndex()
        ing = start(index, eng, config)
        try:
            eng.publish([BlockStored((1,), None, toks(0, 16), 16)])
            settle(ing, 1)
            flood = bytes(4 << 20)
            for _ in range(20):
                eng.send_frames([eng.topic, eng.seq.to_bytes(8, "big"), flood])
                eng.seq += 1
            # ZMQ drops the connection at the first oversized header; the subscriber reconnects
            eng.wait_subscribed()
            eng.publish([BlockStored((2,), None, toks(100, 16), 16)])
            wait_until(lambda: held(index, toks(100, 16)) == 1)
            c = ing.counters.snapshot()
            assert c["received"] == 2 and c["rejected"] == 0
            assert c["gaps"] == 1 and c["batches_applied"] == 2
        finally:
            assert ing.stop()


def test_queue_bytes_bound_the_queued_payload() -> None:
    """A worker's queue takes messages up to ``queue_bytes`` of payload, then submit() blocks."""
    index = InMemoryIndex()
    ing = EventIngester(index, TP, config=IngesterConfig(workers=1, queue_bytes=1000))
    gate = threading.Event()
    original = ing._handle_many  # the worker waits on the gate: the queue fills up

    def gated(*args: Any) -> list[BatchOutcome]:
        gate.wait(10)
        return original(*args)

    ing._handle_many = gated  # type: ignore[method-assign]
    ing.start()
    try:
        payload = bytes(300)  # rejected when handled; 300 bytes of budget until then
        accepted = [ing.submit("kv@pod-a@model-a", s, payload, timeout=0.05) for s in range(6)]
        # one in the worker's hands, two more queued (3 × 300 bytes of 1000), then full
        assert accepted[:3] == [True] * 3 and not any(accepted[3:])
        gate.set()
        assert ing.wait_idle(10)
        assert ing.submit("kv@pod-a@model-a", 6, payload, timeout=1.0)
    finally:
        gate.set()
        assert ing.stop()


class _RecordingSink:
    """A :class:`~kvredis.ingest.MessageSink` that records what each hand-off carries; its
    first hand-off waits until the test lets it go (a busy worker)."""

    def __init__(self) -> None:
        from kvredis.ingest import IngestCounters

        self.counters = IngestCounters()
        self.calls: list[list[int]] = []
        self.rejects: list[str] = []
        self.release = threading.Event()

    def enqueue_from_transport(
        self, endpoint: EndpointConfig, topic: bytes, seq: int, payload: bytes
    ) -> bool:
        self.calls.append([seq])
        self.release.wait(10)
        return True

    def subscribing(self, endpoint: EndpointConfig) -> None:
        pass

    def reject_message(self, reason: Any, detail: str) -> None:
        self.rejects.append(detail)


class _BurstSink(_RecordingSink):
    """The same, taking the messages received together in one call (a ``BurstSink``)."""

    def enqueue_many_from_transport(self, endpoint: EndpointConfig, messages: Any) -> bool:
        self.calls.append([seq for _, seq, _ in messages])
        self.release.wait(10)
        return True


def _subscribe_busy(engine: FakeEngine, sink: _RecordingSink) -> list[int]:
    """Run a subscriber into ``sink``, publish 150 messages (a malformed one among them) while
    its first hand-off waits, let it go; the sequence numbers, in the order they arrived."""
    from kvredis.ingest.zmq import ZmqSubscriber, close_context, new_context

    context = new_context()
    sub = ZmqSubscriber(EndpointConfig(engine.endpoint), sink, context)
    sub.start()
    try:
        engine.wait_subscribed()
        engine.publish_payload(b"first")
        wait_until(lambda: sink.calls == [[0]])  # the subscriber is busy handing it off
        for n in range(149):
            if n == 70:
                engine.send_frames([b"topic", b"\x00"])  # malformed: rejected, not queued
            engine.publish_payload(b"more")
        time.sleep(0.3)  # what was published reaches the subscriber's socket meanwhile
        sink.release.set()
        wait_until(lambda: sum(map(len, sink.calls)) == 150)
        assert len(sink.rejects) == 1
        return [seq for call in sink.calls for seq in call]
    finally:
        sub.stop()
        sub.join(5)
        close_context(context)


def test_messages_waiting_on_the_socket_are_queued_together_in_order(
    engine: FakeEngine,
) -> None:
    sink = _BurstSink()
    assert _subscribe_busy(engine, sink) == list(range(150))
    sizes = [len(call) for call in sink.calls]
    assert max(sizes) <= 64 and len(sizes) < 150 // 2  # bursts of at most 64


def test_a_sink_that_takes_one_message_at_a_time_gets_them_one_by_one(
    engine: FakeEngine,
) -> None:
    sink = _RecordingSink()
    assert _subscribe_busy(engine, sink) == list(range(150))
    assert len(sink.calls) == 150

"""A stand-in for a vLLM/SGLang KV-event publisher, speaking the engine's wire protocol on loopback.

``FakeEngine`` binds a real publishing socket (XPUB, which is wire-compatible with the engine's
PUB and additionally reports subscriptions, so tests know when a subscriber is listening instead
of sleeping) and, optionally, a ROUTER replay socket served by a thread with the engine's replay
protocol: ``[b"", start_seq8]`` in, ``[b"", topic, seq8, payload]`` per buffered batch out (or
``[b"", seq8, payload]`` for older engines), then the end marker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvredis.ingest.events import Event, WireFormat, encode_batch

END = b"\xff" * 8


def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01
) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def ingester_threads() -> set[threading.Thread]:
    """The live worker and subscriber threads of every EventIngester in this process."""
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith(("kvredis-ingest-", "kvredis-sub-")) and t.is_alive()
    }


def assert_no_leaked_ingesters(before: set[threading.Thread], timeout: float = 10.0) -> None:
    """Fail if ingester threads started since ``before`` are still running (a missing stop())."""
    deadline = time.monotonic() + timeout
    while True:
        leaked = ingester_threads() - before
        if not leaked:
            return
        if time.monotonic() > deadline:
            names = ", ".join(sorted(t.name for t in leaked))
            raise AssertionError(f"ingester threads still running after the test: {names}")
        time.sleep(0.01)


class FakeEngine:
    """Publishes event batches like an engine; can lose, replay and restart."""

    def __init__(
        self,
        topic: str = "kv@pod-a@model-a",
        replay: bool = True,
        replay_topic_frame: bool = True,
        buffer_size: int = 10_000,
    ) -> None:
        self.topic = topic.encode()
        self.replay_topic_frame = replay_topic_frame
        self._ctx = zmq.Context()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self.seq = 0
        self.replay_requests: list[int] = []
        self.pub: Any = None
        self.port = 0
        self._bind_pub(0)
        self.replay_port = 0
        self._router: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self._start_replay(0)

    # -- endpoints ---------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @staticmethod
    def _bind(sock: Any, port: int) -> int:
        """Bind to ``port`` (0: any free port), retrying while a just-closed socket lingers."""
        deadline = time.monotonic() + 5
        while True:
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                if not port or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])

    def _bind_pub(self, port: int) -> None:
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.port = self._bind(pub, port)
        self.pub = pub

    def _start_replay(self, port: int) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self._bind(router, port)
        self._router = router
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
        self._thread.start()

    def _serve_replay(self, router: Any) -> None:
        while not self._stop.is_set():
            if not router.poll(20):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests.append(start)
            with self._lock:
                batches = [b for b in self._buffer if b[0] >= start]
            for seq, topic, payload in batches:
                seq8 = seq.to_bytes(8, "big")
                if self.replay_topic_frame:
                    router.send_multipart([ident, b"", topic, seq8, payload])
                else:
                    router.send_multipart([ident, b"", seq8, payload])
            if self.replay_topic_frame:
                router.send_multipart([ident, b"", b"", END, b""])
            else:
                router.send_multipart([ident, b"", END, b""])

    # -- subscriptions -----------------------------------------------------------------

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Block until a subscriber's subscription reached the publishing socket."""
        if not self.pub.poll(int(timeout * 1000)):
            raise AssertionError("no subscriber connected")
        while True:
            message = self.pub.recv()
            if message[:1] == b"\x01":
                return
            if not self.pub.poll(int(timeout * 1000)):
                raise AssertionError("no subscription arrived")

    # -- publishing --------------------------------------------------------------------

    def publish(
        self,
        events: Sequence[Event | Any],
        fmt: WireFormat = "map",
        send: bool = True,
        topic: bytes | None = None,
    ) -> int:
        """Publish one batch (``send=False``: buffer it for replay but lose it on the wire)."""
        payload = encode_batch(events, ts=time.time(), fmt=fmt)
        return self.publish_payload(payload, send=send, topic=topic)

    def publish_payload(self, payload: bytes, send: bool = True, topic: bytes | None = None) -> int:
        seq = self.seq
        self.seq += 1
        t = self.topic if topic is None else topic
        with self._lock:
            self._buffer.append((seq, t, payload))
        if send:
            self.pub.send_multipart([t, seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send arbitrary frames (malformed messages)."""
        self.pub.send_multipart(frames)

    # -- lifecycle ---------------------------------------------------------------------

    def restart(self) -> None:
        """Simulate an engine process restart: same ports, sequence numbers back to 0."""
        self.pub.close(linger=0)
        had_replay = self._router is not None
        if had_replay:
            self._stop.set()
            assert self._thread is not None
            self._thread.join(5)
            self._router.close(linger=0)
        with self._lock:
            self._buffer.clear()
        self.seq = 0
        self._bind_pub(self.port)
        if had_replay:
            self._start_replay(self.replay_port)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A fake inference engine for router tests: it publishes real vLLM/SGLang KV events on loopback.

:class:`FakeEngine` binds the sockets an engine binds (a publisher, XPUB, wire-compatible with the
engine's PUB, and optionally a ROUTER replay endpoint served by a thread with the engine's replay
protocol: ``[b"", start_seq8]`` in, ``[b"", topic, seq8, payload]`` per buffered batch out, then
an end marker) and publishes what an engine with a prefix cache would publish when it serves
prompts:

- :meth:`FakeEngine.store` caches a prompt: the blocks not yet held are published as one
  ``BlockStored`` (vLLM 0.34: full blocks of ``block_size`` tokens, one hash each, the parent
  being the last block already held) or as SGLang 0.5.23's radix-node events (one hash per page
  of ``page_size`` tokens);
- :meth:`FakeEngine.evict` drops a prompt's blocks from the end (``BlockRemoved``);
- :meth:`FakeEngine.reset` clears the prefix cache (``AllBlocksCleared``).

Messages are byte for byte the engines' (:mod:`kvredis.testing.wire`). Point ``kvredis ingest``
or an :class:`~kvredis.ingest.EventIngester` at :attr:`FakeEngine.endpoint` (and
:attr:`FakeEngine.replay_endpoint`) with ``pod_id``/``model_name`` or the ``kv@<pod>@<model>``
topic the engine publishes under, then route with the keys your router computes for the prompt.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Literal

import zmq

from kvredis.ingest.events import Event, WireFormat, encode_batch
from kvredis.testing import wire

#: The replay protocol's end-of-replay sequence number.
END = b"\xff" * 8

EngineKind = Literal["vllm", "sglang"]


def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01
) -> None:
    """Poll ``predicate`` until it is true; raise AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def _block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A stand-in for an engine's chained block hash: 8 bytes over the parent and the tokens."""
    data = parent + b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, digest_size=8).digest()


class FakeEngine:
    """A publisher of one engine's KV events (one pod, one model), with a prefix cache model.

    ``engine`` picks the wire shapes (``"vllm"``: vLLM 0.34, ``"sglang"``: SGLang 0.5.23);
    ``block_size`` is vLLM's block size, ``page_size`` SGLang's page size (1 is SGLang's
    default); ``medium`` the tier the engine reports (``"GPU"``, ``"CPU"``). Every socket binds
    127.0.0.1 on a free port.
    """

    def __init__(
        self,
        pod: str = "pod-a",
        model: str = "model-a",
        *,
        engine: EngineKind = "vllm",
        block_size: int = 16,
        page_size: int = 1,
        medium: str = "GPU",
        replay: bool = True,
        topic: str | None = None,
        replay_topic_frame: bool = True,
        buffer_size: int = 10_000,
    ) -> None:
        if engine not in ("vllm", "sglang"):
            raise ValueError(f"engine must be 'vllm' or 'sglang', not {engine!r}")
        if block_size < 1 or page_size < 1:
            raise ValueError("block_size and page_size must be positive")
        self.pod = pod
        self.model = model
        self.engine: EngineKind = engine
        self.block_size = block_size
        self.page_size = page_size
        self.medium = medium
        self.topic = (f"kv@{pod}@{model}" if topic is None else topic).encode()
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
        # the prefix cache: token prefix (a multiple of the unit) -> its engine hash
        self._cache: dict[tuple[int, ...], bytes] = {}
        self._closed = False
        if replay:
            self._start_replay(0)

    # -- endpoints ---------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The publisher's address (``tcp://127.0.0.1:<port>``)."""
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        """The replay endpoint's address, or None when the engine has none."""
        return f"tcp://127.0.0.1:{self.replay_port}" if self._router is not None else None

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
        self._thread = threading.Thread(
            target=self._serve_replay, args=(router,), name="kvredis-fake-engine", daemon=True
        )
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
        """Block until a subscriber's subscription reached the publisher (so nothing published
        from now on is lost to a slow joiner)."""
        if not self.pub.poll(int(timeout * 1000)):
            raise AssertionError("no subscriber connected")
        while True:
            message = self.pub.recv()
            if message[:1] == b"\x01":
                return
            if not self.pub.poll(int(timeout * 1000)):
                raise AssertionError("no subscription arrived")

    # -- the prefix cache ----------------------------------------------------------------

    @property
    def _unit(self) -> int:
        return self.block_size if self.engine == "vllm" else self.page_size

    def _hash_out(self, digest: bytes) -> wire.Hash:
        # vLLM publishes digests as bytes; SGLang as signed int64 (wire.sglang_* signs them)
        return digest if self.engine == "vllm" else int.from_bytes(digest, "big")

    def held_blocks(self) -> int:
        """How many blocks (vLLM) or pages (SGLang) the engine's prefix cache holds."""
        return len(self._cache)

    def store(self, tokens: Sequence[int], *, send: bool = True) -> int:
        """Cache a prompt, publishing what the engine would for the part not yet cached.

        Only whole blocks (pages) are cached, as the engines do. Returns the sequence number of
        the batch published, or -1 when everything was cached already.
        """
        unit = self._unit
        whole = len(tokens) - len(tokens) % unit
        prefix = tuple(int(t) for t in tokens[:whole])
        held = 0
        while held < whole and prefix[: held + unit] in self._cache:
            held += unit
        if held == whole:
            return -1
        parent = self._cache[prefix[:held]] if held else None
        digests: list[bytes] = []
        last = parent or b""
        for end in range(held + unit, whole + 1, unit):
            last = _block_hash(last, prefix[end - unit : end])
            self._cache[prefix[:end]] = last
            digests.append(last)
        new_tokens = prefix[held:]
        events: list[Any]
        if self.engine == "vllm":
            events = [
                wire.vllm_stored(
                    digests,
                    None if parent is None else parent,
                    new_tokens,
                    self.block_size,
                    medium=self.medium,
                )
            ]
            payload = wire.vllm_batch(events, ts=time.time())
        else:
            events = []
            parent_int = None if parent is None else int.from_bytes(parent, "big")
            for i, digest in enumerate(digests):
                page = new_tokens[i * unit : (i + 1) * unit]
                h = int.from_bytes(digest, "big")
                if events and events[-1]["block_size"] == len(page):
                    events[-1]["block_hashes"].append(wire.signed(h))
                    events[-1]["token_ids"].extend(page)
                else:
                    events.append(
                        wire.sglang_stored([h], parent_int, page, len(page), medium=self.medium)
                    )
                parent_int = h
            payload = wire.sglang_batch(events, ts=time.time())
        return self.publish_payload(payload, send=send)

    def evict(self, tokens: Sequence[int], blocks: int | None = None, *, send: bool = True) -> int:
        """Evict the last ``blocks`` cached blocks (default: all) of a prompt, deepest first,
        as the engines' LRU does. Returns the batch's sequence number, -1 if nothing was held."""
        unit = self._unit
        whole = len(tokens) - len(tokens) % unit
        prefix = tuple(int(t) for t in tokens[:whole])
        held = [prefix[:end] for end in range(unit, whole + 1, unit) if prefix[:end] in self._cache]
        # a block only stays cached while its parent does: evict from the deepest down
        chosen = held[::-1] if blocks is None else held[::-1][:blocks]
        if not chosen:
            return -1
        digests = [self._cache.pop(p) for p in chosen]
        if self.engine == "vllm":
            payload = wire.vllm_batch(
                [wire.vllm_removed(digests, medium=self.medium)], ts=time.time()
            )
        else:
            hashes = [int.from_bytes(d, "big") for d in digests]
            payload = wire.sglang_batch(
                [wire.sglang_removed(hashes, medium=self.medium)], ts=time.time()
            )
        return self.publish_payload(payload, send=send)

    def reset(self, *, send: bool = True) -> int:
        """Reset the prefix cache (``AllBlocksCleared``)."""
        self._cache.clear()
        events = [wire.all_cleared()]
        if self.engine == "vllm":
            return self.publish_payload(wire.vllm_batch(events, ts=time.time()), send=send)
        return self.publish_payload(wire.sglang_batch(events, ts=time.time()), send=send)

    # -- publishing --------------------------------------------------------------------

    def publish(
        self,
        events: Sequence[Event | Any],
        fmt: WireFormat = "map",
        send: bool = True,
        topic: bytes | None = None,
    ) -> int:
        """Publish one batch of kvredis :class:`~kvredis.ingest.events.Event` values (or wire
        maps) (``send=False``: buffer it for replay but lose it on the wire)."""
        payload = encode_batch(events, ts=time.time(), fmt=fmt)
        return self.publish_payload(payload, send=send, topic=topic)

    def publish_payload(self, payload: bytes, send: bool = True, topic: bytes | None = None) -> int:
        """Publish raw msgpack bytes as the next batch; returns its sequence number."""
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
        """An engine process restart: same ports, sequence numbers back to 0, cache empty."""
        self.pub.close(linger=0)
        had_replay = self._router is not None
        if had_replay:
            self._stop.set()
            assert self._thread is not None
            self._thread.join(5)
            self._router.close(linger=0)
        with self._lock:
            self._buffer.clear()
        self._cache.clear()
        self.seq = 0
        self._bind_pub(self.port)
        if had_replay:
            self._start_replay(self.replay_port)

    def close(self) -> None:
        """Stop the replay thread and close every socket."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

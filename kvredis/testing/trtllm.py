"""A fake ``trtllm-serve`` for router tests: TensorRT-LLM 1.2's KV cache events over real HTTP.

:class:`FakeTrtllmServe` serves ``POST /kv_cache_events`` on loopback the way trtllm-serve does:
it answers with every event buffered since the previous call as a JSON array (waiting up to
``wait_s`` for one when there is none) and forgets them; its buffer keeps at most
``buffer_size`` events (``kv_cache_config.event_buffer_max_size``), dropping the oldest. Events
are numbered per attention-DP rank from 0 and carry ``window_size`` (and ``attention_dp_rank``
when the server has attention data parallelism), exactly as ``KVCacheEventSerializer`` writes
them; the builders below write each event's ``data`` the same way.

Its prefix-cache model publishes what a TensorRT-LLM KV-cache manager would:

- :meth:`FakeTrtllmServe.store` caches a prompt: the blocks not yet held as one ``stored``
  event (``tokens_per_block`` tokens per block, the last block partial when the prompt ends
  inside one; the parent is the last block already held);
- :meth:`FakeTrtllmServe.offload` / :meth:`FakeTrtllmServe.onboard` move a block between the
  primary (GPU) and the secondary (host) level (``updated``);
- :meth:`FakeTrtllmServe.evict` drops a prompt's blocks from the end (``removed``);
- :meth:`FakeTrtllmServe.restart` is a new engine: event ids start over at 0 with ``created``.

Point ``kvredis ingest --endpoint`` (or an :class:`~kvredis.ingest.EndpointConfig`) at
:attr:`FakeTrtllmServe.url` with a pod and a model, then route with the keys your router
computes for the prompt.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "FakeTrtllmServe",
    "created",
    "event",
    "removed",
    "stored",
    "stored_block",
    "updated",
]

PRIORITY = 35
"""TensorRT-LLM's default block priority."""


def event(
    event_id: int, data: dict[str, Any], window_size: int, attention_dp_rank: int | None = None
) -> dict[str, Any]:
    """One serialized ``KVCacheEvent``: ``attention_dp_rank`` only when it is set."""
    out: dict[str, Any] = {"event_id": event_id, "data": data, "window_size": window_size}
    if attention_dp_rank is not None:
        out["attention_dp_rank"] = attention_dp_rank
    return out


def created(num_blocks_per_cache_level: Sequence[int] = (1024, 0)) -> dict[str, Any]:
    """``KVCacheCreatedData``: a new KV-cache manager (blocks per cache level)."""
    return {"type": "created", "num_blocks_per_cache_level": list(num_blocks_per_cache_level)}


def stored_block(
    block_hash: int,
    tokens: Sequence[int],
    *,
    cache_level: int = 0,
    priority: int = PRIORITY,
    mm_keys: Sequence[tuple[str, int]] = (),
    token_extra_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``KVCacheStoredBlockData``: ``mm_keys`` as ``(hash hex, start_offset)`` pairs."""
    extra = list(token_extra_ids) if token_extra_ids is not None else [0] * len(tokens)
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": [
            {"type": "unique_token", "token_id": t, "token_extra_id": e}
            for t, e in zip(tokens, extra, strict=True)
        ],
        "mm_keys": [{"type": "mm_key", "hash": h, "start_offset": o} for h, o in mm_keys],
        "cache_level": cache_level,
        "priority": priority,
    }


def stored(parent_hash: int | None, blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``KVCacheStoredData``: blocks chained from ``parent_hash`` (``None``: the root)."""
    return {"type": "stored", "parent_hash": parent_hash, "blocks": list(blocks)}


def removed(block_hashes: Sequence[int]) -> dict[str, Any]:
    """``KVCacheRemovedData``."""
    return {"type": "removed", "block_hashes": list(block_hashes)}


def _diff(old: int, new: int) -> dict[str, Any]:
    return {"type": "event_diff", "new_value": new, "old_value": old}


def updated(
    block_hash: int,
    *,
    cache_level: tuple[int, int] | None = None,
    priority: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """``KVCacheUpdatedData``: ``(old, new)`` diffs of the cache level and the priority."""
    return {
        "type": "updated",
        "block_hash": block_hash,
        "cache_level": None if cache_level is None else _diff(*cache_level),
        "priority": None if priority is None else _diff(*priority),
    }


def _block_hash(parent: int, tokens: Sequence[int]) -> int:
    """A stand-in for the block manager's hash (a ``size_t``) over the parent and the tokens."""
    data = parent.to_bytes(8, "big") + b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class FakeTrtllmServe:
    """A trtllm-serve stand-in on ``127.0.0.1``: its ``/kv_cache_events`` and a cache model."""

    def __init__(
        self,
        *,
        tokens_per_block: int = 32,
        window_size: int = 4096,
        buffer_size: int = 1024,
        wait_s: float = 0.2,
        attention_dp_size: int | None = None,
        port: int = 0,
    ) -> None:
        self.tokens_per_block = tokens_per_block
        self.window_size = window_size
        self.buffer_size = buffer_size
        self.wait_s = wait_s
        self.attention_dp_size = attention_dp_size
        self.polls = 0
        """``POST /kv_cache_events`` calls answered."""
        self.handed_out = 0
        """Events those calls answered with."""
        self.dropped = 0
        """Events the full buffer dropped (the oldest)."""
        self._cond = threading.Condition()
        self._buffer: deque[dict[str, Any]] = deque()
        self._next_id: dict[int, int] = {}
        self._held: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {}
        """Per rank: the prompt prefix (whole blocks, or a partial last block) → (hash, level)."""
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fake-trtllm-serve", daemon=True
        )
        self._thread.start()
        for rank in self._ranks():
            self.emit(created(), rank=rank)

    # -- the server -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, the address to give ``kvredis ingest --endpoint``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        serve = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path.rstrip("/") != "/kv_cache_events":
                    self._send(404, b'{"detail":"Not Found"}')
                    return
                self._send(200, json.dumps(serve._drain()).encode("utf-8"))

            def do_GET(self) -> None:
                self._send(405, b'{"detail":"Method Not Allowed"}')

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _drain(self) -> list[dict[str, Any]]:
        with self._cond:
            if not self._buffer:
                self._cond.wait(self.wait_s)
            events = list(self._buffer)
            self._buffer.clear()
            self.polls += 1
            self.handed_out += len(events)
        return events

    def pending(self) -> int:
        """Events buffered and not yet handed out."""
        with self._cond:
            return len(self._buffer)

    def emit(self, data: dict[str, Any], *, rank: int = 0, window_size: int | None = None) -> int:
        """Buffer one event (the next id of ``rank``); its id."""
        with self._cond:
            event_id = self._next_id.get(rank, 0)
            self._next_id[rank] = event_id + 1
            dp_rank = rank if self.attention_dp_size is not None else None
            window = self.window_size if window_size is None else window_size
            self._buffer.append(event(event_id, data, window, dp_rank))
            while len(self._buffer) > self.buffer_size:
                self._buffer.popleft()
                self.dropped += 1
            self._cond.notify_all()
        return event_id

    def skip(self, count: int = 1, *, rank: int = 0) -> None:
        """Lose the next ``count`` event ids of ``rank`` (as a buffer overflow would)."""
        with self._cond:
            self._next_id[rank] = self._next_id.get(rank, 0) + count

    # -- the cache model --------------------------------------------------------------------

    def _ranks(self) -> range:
        return range(self.attention_dp_size or 1)

    def _blocks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        size = self.tokens_per_block
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens), size)]

    def store(
        self,
        tokens: Sequence[int],
        *,
        rank: int = 0,
        cache_level: int = 0,
        mm_keys: dict[int, Sequence[tuple[str, int]]] | None = None,
        window_size: int | None = None,
    ) -> list[int]:
        """Cache ``tokens`` on ``rank``: publish the blocks not yet held as one ``stored`` event
        (``mm_keys``: per block index, its ``(hash, start_offset)`` items). The hashes of all
        the prompt's blocks."""
        held = self._held.setdefault(rank, {})
        prefix: tuple[int, ...] = ()
        parent: int | None = None
        hashes: list[int] = []
        new: list[dict[str, Any]] = []
        new_parent: int | None = None
        for i, block in enumerate(self._blocks(tokens)):
            prefix += block
            known = held.get(prefix)
            if known is None:
                block_hash = _block_hash(parent or 0, block)
                held[prefix] = (block_hash, cache_level)
                if not new:
                    new_parent = parent
                new.append(
                    stored_block(
                        block_hash,
                        block,
                        cache_level=cache_level,
                        mm_keys=(mm_keys or {}).get(i, ()),
                    )
                )
            else:
                block_hash = known[0]
            hashes.append(block_hash)
            parent = block_hash
        if new:
            self.emit(stored(new_parent, new), rank=rank, window_size=window_size)
        return hashes

    def _level(self, block_hash: int, rank: int) -> tuple[tuple[int, ...], int]:
        for prefix, (h, level) in self._held.get(rank, {}).items():
            if h == block_hash:
                return prefix, level
        raise KeyError(f"block {block_hash} is not held on rank {rank}")

    def offload(self, block_hash: int, *, rank: int = 0) -> None:
        """Move a block to the secondary level (host memory): ``updated`` 0 → 1."""
        self._move(block_hash, 1, rank)

    def onboard(self, block_hash: int, *, rank: int = 0) -> None:
        """Move a block back to the primary level: ``updated`` 1 → 0."""
        self._move(block_hash, 0, rank)

    def _move(self, block_hash: int, new: int, rank: int) -> None:
        prefix, old = self._level(block_hash, rank)
        self._held[rank][prefix] = (block_hash, new)
        self.emit(updated(block_hash, cache_level=(old, new)), rank=rank)

    def evict(self, tokens: Sequence[int], blocks: int | None = None, *, rank: int = 0) -> int:
        """Drop up to ``blocks`` (default all) of the prompt's held blocks, the last first, as
        one ``removed`` event; how many."""
        held = self._held.get(rank, {})
        prefixes: list[tuple[int, ...]] = []
        prefix: tuple[int, ...] = ()
        for block in self._blocks(tokens):
            prefix += block
            if prefix in held:
                prefixes.append(prefix)
        gone = prefixes[::-1][: blocks if blocks is not None else len(prefixes)]
        if gone:
            self.emit(removed([held.pop(p)[0] for p in gone]), rank=rank)
        return len(gone)

    def restart(self) -> None:
        """A new engine: nothing held, event ids from 0, a ``created`` event per rank."""
        with self._cond:
            self._buffer.clear()
            self._next_id.clear()
        self._held.clear()
        for rank in self._ranks():
            self.emit(created(), rank=rank)

    def close(self) -> None:
        """Stop serving."""
        with self._cond:
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeTrtllmServe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

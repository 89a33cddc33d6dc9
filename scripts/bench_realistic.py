"""Ingestion at fleet rate on indexes filled the way engines write them, against the Go layout.

The other benchmarks fill the index with 64-key adds. Engines do not write like that. This
benchmark simulates a fleet of 8 pods and feeds every message through
:class:`~kvredis.ingest.EventIngester` in the engines' own wire shapes (``kvredis.testing.wire``):

- **vLLM** (16-token blocks): conversations of several turns, each opening with one of 16 shared
  system prompts of 2-120 blocks; a user turn of 1-40 blocks of tokens (not block aligned), in
  prefill chunks of up to 128 blocks per ``BlockStored``, then one one-block ``BlockStored`` per
  16 generated tokens (1-40); each pod holds a bounded number of blocks, least recently used
  evicted as ``BlockRemoved`` (a request's tail first, as vLLM's free queue orders them);
- **SGLang** (page size 1, one engine hash per token, ``--engine sglang``): each pod is SGLang
  0.5.23's radix cache (:mod:`kvredis.testing.radix`): system prompts of 30-1,900 tokens and
  turns of 5-640 tokens in and 1-640 out, so that radix nodes begin and end anywhere inside
  16-token blocks; a node per prefill chunk (1,024 tokens) and per finished request, branches
  where prompts diverge (splits publish nothing), least recently used leaves evicted whole;
- in both, one turn in ten moves to another pod, and each insert is one engine batch (the worst
  case for fixed costs);
- **vllm-steps** (``--shape vllm-steps``): the vLLM shape published as vLLM's scheduler
  publishes, one batch per engine step holding the events of every request the step advanced:
  each pod runs up to ``--concurrency`` requests at once (64; as many conversations per pod,
  first turns arriving over the first 640 steps, each next turn queued when the last ends), a
  request admitted while its blocks fit beside those running requests use, its prefill stored
  in the step that admits it and each generated block 16 steps after the last, so a step holds
  about ``concurrency / 16`` one-block ``BlockStored`` events besides the prefills it admitted;
  blocks of running requests are never evicted, as vLLM never frees them, and a finished
  request's go back to the free queue tail first; **vllm-stores** is the same stream, event
  for event, published a batch per store: the two measure what packaging into engine steps
  saves;
- **vllm-long** (``--shape vllm-long``): vllm-steps serving long answers, as a reasoning model
  writes them: 64-640 generated blocks (1k-10k tokens) per turn, 8 requests at once per pod,
  caches of 6,000 blocks, so most stored blocks are one-block events appended after long
  chains.

Measured, side by side on one server pinned to one core (``taskset``; CPU is ``INFO cpu``
growth minus the idle server's, see ``bench_server_cpu.py``):

- **client**: the ingester's CPU per stored index block and blocks per CPU-second, through
  ``process`` (one message at a time), through ``process_many`` of the messages a busy worker
  finds queued (``--backlog``, default 16), and through the production path: ``kvredis ingest``
  in its own process subscribed over ZMQ on loopback (its CPU read from ``/proc``, startup
  excluded); and the ingester's cost split into what it pays per message (engine batch), per
  event, per stored block and per removed engine key (least squares, no cost below 0, over the
  CPU of each ``process`` and ``process_many``
  call), which sizes an ingester for engines batching differently from these streams;
- **Redis CPU per stored block** (stores and the evictions they cause): kvredis at backlog 1 and
  at ``--backlog``; the Go layout (``scripts/reference_layout.py``: one pipeline per event, an
  HSET per key and a ZADD per engine key) evicting as its own code does (``evict``, a round trip
  per key) and written well (``evict_many``: a removal's mappings read in one pipeline, its
  entries dropped in another);
- **memory per (block, pod) pair**: ``used_memory`` growth (clients' buffers left out) of the
  event-filled namespace (the page journal included, and apart: as the ingester left it, up to
  twice what a compaction keeps, and compacted) against the same pairs added by 64-key adds (no
  engine mappings; and again, with each block's engine mapping: what an index of engine events
  must hold to apply their removals);
- **scores** of every conversation against what each simulated pod holds (must be equal; the
  script fails otherwise), parent misses, and the share of request keys held in chain runs;
- **score CPU** (kvredis, Go layout, 64-key fill, a floor script that GETs one 4 KiB string, and
  a script that does nothing), the median of interleaved rounds.

It ends with a fleet-sizing table (Redis cores and ingester processes for 100 and 1,000 pods
storing ``--pod-rate`` blocks a second each, and evicting as many), printed as Markdown for
``docs/benchmarks.md``. ``--server valkey`` runs it all on Valkey 9 instead of redis-server.

``--before REF`` also measures, in the same server and in interleaved rounds, the Lua scripts of
the git revision ``REF`` of this repository against this checkout's, both by ``EVALSHA`` of the
same arguments from a bare client (each side in its own protocol): Redis CPU per conversation
score, per score of a chain of 3 parts (12,288 keys held by 8 pods, each of which evicted a
block elsewhere: the parts' stamps; and the same with a second data-parallel rank per pod, which
the scripts from before per-rank scores, function API 1 and 2, merge into the pod), and per
block ingested through the ingester (each side into namespaces of its own, fed in alternation,
a message per call and ``--backlog`` per call), and per conversation score by this checkout's
script on what each side's writes stored (how they group keys into chain runs decides how many
runs a score reads).

``--bucket-bits auto`` sizes the measured namespaces' buckets for the request keys the fleet
holds (:func:`kvredis.redis.layout.bucket_bits_for`, as docs/deploy.md advises an operator),
instead of the default 16 bits, which leaves a fleet of this size with sparse buckets.

Run:  .venv/bin/python scripts/bench_realistic.py [--quick]
      [--shape vllm,vllm-steps,vllm-stores,sglang]
      [--concurrency N]
      [--server valkey] [--backlog N] [--pod-rate R] [--no-zmq] [--zmq-workers N] [--zmq-runs N]
      [--before REF] [--bucket-bits N|auto] [--json PATH]
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import random
import statistics
import struct
import subprocess
import sys
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from bench_server_cpu import Server, pin

from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest import GC_THRESHOLD, EndpointConfig, EventIngester, tune_collector
from kvredis.ingest.journal import JOURNAL_KEY_INFIX, RedisPageJournal
from kvredis.ingest.stream import PHASE_DONE, split_position
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.redis.layout import DEFAULT_BUCKET_BITS, bucket_bits_for
from kvredis.redis.ops import SCORE_KEYS_PER_CALL
from kvredis.redis.scripts import Script, expand
from kvredis.scoring import LongestPrefixScorer
from kvredis.testing.radix import RadixCache, page_digest
from kvredis.testing.wire import (
    sglang_batch,
    vllm_batch,
    vllm_removed,
    vllm_stored,
)
from kvredis.tiers import DEFAULT_TIERS
from kvredis.types import KeyType, PodEntry

from _bench import REPO, RedisServer, bench_parser, write_json
from reference_layout import ReferenceLayout

MODEL = "base-model"
BLOCK = 16
PODS = 8
PROMPTS = 16
WEIGHTS = {"gpu": 1.0}
TP = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=BLOCK))
FLOOR = """
local run = redis.call('GET', KEYS[1])
return run == ARGV[1] and 1 or 0
"""
BARE = "return 1"
SGLANG_CHUNK = 1024
"""Tokens per SGLang prefill chunk: a radix node each."""
CONCURRENCY = 64
"""Requests a vllm-steps pod runs at once (``--concurrency``)."""
ARRIVALS = 640
"""Engine steps over which a vllm-steps fleet's first turns arrive (about two requests' life)."""


def _h(*parts: int) -> int:
    """A nonzero 63-bit engine hash of ``parts``."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


@dataclass
class Conversation:
    tokens: list[int]
    """Every token so far (prompt and output)."""
    keys: list[int] = field(default_factory=list)
    """The request keys of its full blocks, as a router computes them."""
    pod: int = 0
    blocks: list[tuple[int, ...]] = field(default_factory=list)
    """vLLM: the engine hash of each full block (a 1-tuple)."""
    last: int = 0
    """vLLM: the running engine hash after the last block."""
    digests: list[bytes] = field(default_factory=list)
    """SGLang: the digest of each page (token), chained as SGLang chains them."""

    def extend_keys(self) -> None:
        full = len(self.tokens) // BLOCK
        if full > len(self.keys):
            base = self.keys[-1] if self.keys else 0
            new = self.tokens[len(self.keys) * BLOCK : full * BLOCK]
            self.keys += TP.tokens_to_kv_block_keys(base, new, MODEL)

    def page_hashes(self, start: int, end: int) -> list[int]:
        """SGLang: the engine hashes of pages ``[start, end)``."""
        digests = self.digests
        for i in range(len(digests), end):
            digests.append(page_digest(digests[-1] if digests else None, self.tokens[i : i + 1]))
        return [int.from_bytes(d[:8], "big") for d in digests[start:end]]


@dataclass
class Message:
    """One engine batch: its payload, and what it did in index terms (for the Go layout)."""

    pod: int
    payload: bytes
    adds: list[tuple[list[int], list[int]]]
    """(engine keys, request keys) per index write of the Go layout."""
    removed: list[int]
    """Engine keys of ``BlockRemoved``."""
    blocks: int
    """Index blocks its stores complete."""
    parts: list[tuple[list[int], list[tuple[list[int], list[int]]]]] | None = None
    """(removed, adds) of each store the batch holds, in order, when it holds more than one
    (an engine step's): the Go layout applies them in turn. ``None``: one store."""
    events: int = 1
    """Events the batch holds (``BlockStored``, ``BlockRemoved``)."""

    def steps(self) -> list[tuple[list[int], list[tuple[list[int], list[int]]]]]:
        """(removed engine keys, adds) of each store of the batch, in order."""
        return self.parts if self.parts is not None else [(self.removed, self.adds)]


class Pod:
    """One vLLM engine's cache: blocks by their engine hash, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.pinned: dict[int, int] = {}
        """Blocks running requests use, by engine hash (how many use each): never evicted."""

    def touch(self, blocks: Sequence[tuple[int, ...]]) -> None:
        for b in reversed(blocks):  # a request's tail is the least recently used of its blocks
            self.lru.move_to_end(b[-1])

    def pin(self, blocks: Sequence[tuple[int, ...]], by: int = 1) -> None:
        """A request starts (``by`` 1) or ends (-1) using ``blocks``."""
        pinned = self.pinned
        for b in blocks:
            n = pinned.get(b[-1], 0) + by
            assert n >= 0, "a block unpinned more often than pinned"
            if n:
                pinned[b[-1]] = n
            else:
                del pinned[b[-1]]

    def evict(self, room: int) -> list[int]:
        """Evict the least recently used blocks no running request uses until ``room`` more
        fit (fewer when the rest is in use)."""
        lru, pinned = self.lru, self.pinned
        excess = len(lru) + room - self.capacity
        victims: list[int] = []
        if excess > 0:
            for key in lru:
                if key not in pinned:
                    victims.append(key)
                    if len(victims) == excess:
                        break
        out: list[int] = []
        for key in victims:
            out.extend(lru.pop(key))
        return out

    def hit(self, blocks: Sequence[tuple[int, ...]]) -> int:
        n = 0
        while n < len(blocks) and blocks[n][-1] in self.lru:
            n += 1
        return n


class Fleet:
    """The simulation's common part: conversations, messages, what every pod holds."""

    shape = ""
    engine = ""

    def __init__(self, conversations: int, turns: int, seed: int, pods: int = PODS) -> None:
        self.rng = random.Random(seed)
        self.npods = pods
        """How many pods the fleet has (``PODS`` here; ``scripts/bench_cluster.py`` asks more)."""
        self.turns = turns
        self.conversations = conversations
        self.messages: list[Message] = []
        self.convs: list[Conversation] = []
        self.pages = 0
        """Engine pages stored."""
        self.bucket_bits = DEFAULT_BUCKET_BITS
        """Bucket bits of the namespaces the fleet is measured on (``--bucket-bits``)."""

    def run(self) -> None:
        rng = self.rng
        for t in range(self.turns):
            for conv in self.convs:
                if t and rng.random() < 0.1:
                    conv.pod = rng.randrange(self.npods)  # the router moved it
                self.turn(conv)

    def turn(self, conv: Conversation) -> None:
        raise NotImplementedError

    def held(self, conv: Conversation, pod: int) -> int:
        """How many leading request keys of the conversation ``pod`` holds."""
        raise NotImplementedError

    def distinct_keys(self) -> int:
        """Request keys the pods hold, each counted once (what an index is sized for)."""
        return len({k for keys in self.pairs().values() for k in keys})

    def pairs(self) -> dict[int, list[int]]:
        """Every (request key, pod) pair the pods hold, by pod, in chain order."""
        out: dict[int, list[int]] = {p: [] for p in range(self.npods)}
        seen: set[tuple[int, int]] = set()
        for conv in self.convs:
            for p in range(self.npods):
                for k in conv.keys[: self.held(conv, p)]:
                    if (p, k) not in seen:
                        seen.add((p, k))
                        out[p].append(k)
        return out


class VllmFleet(Fleet):
    shape = "vllm"
    engine = "vllm"
    out_blocks = (1, 40)
    """The fewest and most blocks a turn generates (one one-block event each)."""

    def __init__(
        self, conversations: int, turns: int, capacity: int, seed: int, pods: int = PODS
    ) -> None:
        super().__init__(conversations, turns, seed, pods)
        rng = self.rng
        self.pods = [Pod(capacity) for _ in range(pods)]
        prompts = [
            [rng.randrange(1, 50_000) for _ in range(BLOCK * rng.randint(2, 120))]
            for _ in range(PROMPTS)
        ]
        self.convs = [
            Conversation(list(rng.choice(prompts)), pod=rng.randrange(pods))
            for _ in range(conversations)
        ]

    def _blocks(self, conv: Conversation) -> list[tuple[int, ...]]:
        h = conv.last
        for b in range(len(conv.blocks), len(conv.tokens) // BLOCK):
            h = _h(h, *conv.tokens[b * BLOCK : (b + 1) * BLOCK])
            conv.blocks.append((h,))
        conv.last = h
        return conv.blocks

    def turn(self, conv: Conversation) -> None:
        rng = self.rng
        user = rng.randint(1, 40) * BLOCK + rng.randrange(BLOCK)  # not block aligned
        conv.tokens += [rng.randrange(1, 50_000) for _ in range(user)]
        self._store(conv)
        for _ in range(rng.randint(*self.out_blocks)):  # one event per generated block
            conv.tokens += [rng.randrange(1, 50_000) for _ in range(BLOCK)]
            self._store(conv)

    def _store(self, conv: Conversation) -> None:
        events, adds, removed, stored = self._store_events(conv)
        if events:
            self.messages.append(
                Message(conv.pod, vllm_batch(events), adds, removed, stored, events=len(events))
            )

    def _store_events(
        self, conv: Conversation
    ) -> tuple[list[Any], list[tuple[list[int], list[int]]], list[int], int]:
        """Store the conversation's new full blocks in its pod: the events vLLM publishes for
        it (the evictions first), the Go layout's adds, the engine keys evicted, and how many
        blocks it stored."""
        pod = self.pods[conv.pod]
        blocks = self._blocks(conv)
        removed = pod.evict(len(blocks) - pod.hit(blocks))
        hit = pod.hit(blocks)  # an eviction may have taken a block of this prefix
        new = blocks[hit:]
        conv.extend_keys()
        events: list[Any] = [vllm_removed(removed)] if removed else []
        adds: list[tuple[list[int], list[int]]] = []
        for start in range(0, len(new), 128):  # prefill chunks of up to 128 blocks
            first = hit + start
            part = [h for b in new[start : start + 128] for h in b]
            parent = blocks[first - 1][-1] if first else None
            toks = conv.tokens[first * BLOCK : (first + len(part)) * BLOCK]
            events.append(vllm_stored(part, parent, toks, BLOCK))
            adds.append((part, conv.keys[first : first + len(part)]))
        for b in new:
            pod.lru[b[-1]] = b
        pod.touch(blocks)
        self.pages += len(new)
        return events, adds, removed, len(new)

    def held(self, conv: Conversation, pod: int) -> int:
        return self.pods[pod].hit(conv.blocks[: len(conv.keys)])


class VllmStepFleet(VllmFleet):
    """vLLM publishing as its scheduler does: one batch per engine step, holding the events of
    every request the step advanced (``Scheduler.update_from_output`` takes the KV cache
    manager's events once per step). Each pod runs up to ``concurrency`` requests at once,
    admitting a request while its blocks fit beside those running requests use; a
    request's prefill is stored in the step that admits it, then each of its generated blocks
    16 steps after the last (one token per request per step), so a step carries the blocks that
    its running requests completed in it: about ``concurrency / 16`` one-block ``BlockStored``
    events, plus the prefills it admitted and the evictions they all caused, in order. The
    conversations, turns and pods' caches are :class:`VllmFleet`'s.

    With ``per_store`` (shape ``vllm-stores``) the same stream, event for event, is published a
    batch per store instead: what the packaging into engine steps saves, measured apart."""

    shape = "vllm-steps"

    def __init__(
        self,
        conversations: int,
        turns: int,
        capacity: int,
        seed: int,
        concurrency: int,
        pods: int = PODS,
        per_store: bool = False,
    ) -> None:
        super().__init__(conversations, turns, capacity, seed, pods)
        self.concurrency = concurrency
        self.per_store = per_store
        if per_store:
            self.shape = "vllm-stores"

    def _emit(self, batch: _StepBatch, pod: int) -> _StepBatch:
        """Publish ``batch`` if it holds events; the batch to fill next."""
        if batch.events:
            self.messages.append(batch.message(pod))
            return _StepBatch()
        return batch

    def run(self) -> None:
        rng = self.rng
        waiting: list[deque[Conversation]] = [deque() for _ in range(self.npods)]
        # each queued turn: the step it arrives in, its prompt's tokens, its generated blocks
        turn: dict[int, tuple[int, list[int], int]] = {}

        def queue(conv: Conversation, arrives: int) -> None:
            """Queue the conversation's next turn at its pod, in the order turns arrive."""
            user = rng.randint(1, 40) * BLOCK + rng.randrange(BLOCK)  # not block aligned
            tokens = [rng.randrange(1, 50_000) for _ in range(user)]
            turn[id(conv)] = (arrives, tokens, rng.randint(*self.out_blocks))
            w = waiting[conv.pod]
            i = len(w)
            while i and turn[id(w[i - 1])][0] > arrives:
                i -= 1
            w.insert(i, conv)

        for conv in self.convs:
            queue(conv, rng.randrange(ARRIVALS))
        turns_left = {id(conv): self.turns for conv in self.convs}
        # per pod: [conversation, generated blocks still to come, step completing the next]
        running: list[list[list[Any]]] = [[] for _ in range(self.npods)]
        step = 0
        while any(waiting) or any(running):
            wake: list[int] = []  # the steps at which something happens next
            for p in range(self.npods):
                pod = self.pods[p]
                batch = _StepBatch()
                while len(running[p]) < self.concurrency and waiting[p]:
                    conv = waiting[p][0]
                    arrives, tokens, generated = turn[id(conv)]
                    if arrives > step:
                        wake.append(arrives)
                        break
                    # admitted while its blocks fit beside those running requests use (or
                    # into an idle pod); vLLM would otherwise keep it waiting
                    size = (len(conv.tokens) + len(tokens)) // BLOCK + generated
                    if running[p] and len(pod.pinned) + size > pod.capacity:
                        break
                    waiting[p].popleft()
                    conv.tokens += tokens
                    blocks = self._blocks(conv)
                    held = pod.hit(blocks)
                    pod.pin(blocks[:held])  # its cached prefix is its own before it allocates
                    batch.add(*self._store_events(conv))  # the prefill
                    pod.pin(blocks[held:])
                    if self.per_store:
                        batch = self._emit(batch, p)
                    first = step + BLOCK - len(conv.tokens) % BLOCK
                    running[p].append([conv, generated, first])
                still: list[list[Any]] = []
                for seq in running[p]:
                    conv = seq[0]
                    if seq[2] == step:  # one generated block completed in this step
                        conv.tokens += [rng.randrange(1, 50_000) for _ in range(BLOCK)]
                        batch.add(*self._store_events(conv))
                        if self.per_store:
                            batch = self._emit(batch, p)
                        pod.pin(conv.blocks[-1:])
                        seq[1] -= 1
                        seq[2] += BLOCK
                    if seq[1] > 0:
                        still.append(seq)
                        wake.append(seq[2])
                        continue
                    # the request ends: its blocks go back to the free queue, its tail first
                    pod.touch(conv.blocks)
                    pod.pin(conv.blocks, -1)
                    turns_left[id(conv)] -= 1
                    if turns_left[id(conv)]:  # its next turn is queued at once
                        if rng.random() < 0.1:
                            conv.pod = rng.randrange(self.npods)  # the router moved it
                        queue(conv, step + 1)
                        wake.append(step + 1)
                running[p] = still
                self._emit(batch, p)
            if not wake and any(waiting):
                wake.append(step + 1)  # a pod left idle admits its next turn
            step = min(wake) if wake else step + 1


class VllmLongFleet(VllmStepFleet):
    """:class:`VllmStepFleet` serving long answers (a reasoning model's): each turn generates
    64 to 640 blocks (1k-10k tokens), so most stored blocks are one-block ``BlockStored``
    events appended after long chains, those of the requests a pod runs at once interleaved in
    its engine steps."""

    shape = "vllm-long"
    out_blocks = (64, 640)


class _StepBatch:
    """The events of one pod's engine step, and what each of its stores did."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.parts: list[tuple[list[int], list[tuple[list[int], list[int]]]]] = []
        self.stored = 0

    def add(
        self,
        events: list[Any],
        adds: list[tuple[list[int], list[int]]],
        removed: list[int],
        stored: int,
    ) -> None:
        if events:
            self.events += events
            self.parts.append((removed, adds))
            self.stored += stored

    def message(self, pod: int) -> Message:
        removed = [k for r, _ in self.parts for k in r]
        adds = [a for _, part in self.parts for a in part]
        return Message(
            pod,
            vllm_batch(self.events),
            adds,
            removed,
            self.stored,
            self.parts,
            events=len(self.events),
        )


class SglangFleet(Fleet):
    shape = "sglang"
    engine = "sglang"

    def __init__(
        self, conversations: int, turns: int, capacity: int, seed: int, pods: int = PODS
    ) -> None:
        super().__init__(conversations, turns, seed, pods)
        rng = self.rng
        self.pods = [RadixCache(1, capacity) for _ in range(pods)]
        prompts = [
            [rng.randrange(1, 50_000) for _ in range(rng.randint(30, 1900))] for _ in range(PROMPTS)
        ]
        self.convs = [
            Conversation(list(rng.choice(prompts)), pod=rng.randrange(pods))
            for _ in range(conversations)
        ]

    def turn(self, conv: Conversation) -> None:
        rng = self.rng
        cache = self.pods[conv.pod]
        conv.tokens += [rng.randrange(1, 50_000) for _ in range(rng.randint(5, 640))]
        held = cache.match(conv.tokens)
        for end in range(held + SGLANG_CHUNK, len(conv.tokens), SGLANG_CHUNK):
            self._insert(conv, end)  # a node per prefill chunk
        self._insert(conv, len(conv.tokens))
        conv.tokens += [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 640))]
        self._insert(conv, len(conv.tokens))  # the finished request's node

    def _insert(self, conv: Conversation, end: int) -> None:
        cache = self.pods[conv.pod]
        start = cache.insert(conv.tokens[:end])
        events = cache.take()
        if not events:
            return
        conv.extend_keys()
        removed = [
            h % 2**64 for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]
        ]
        pages = conv.page_hashes(0, end)
        # the Go layout maps every page of a block it completes to the block
        first, last = start // BLOCK, end // BLOCK
        adds = [
            (pages[j * BLOCK : (j + 1) * BLOCK], [conv.keys[j]])
            for j in range(first, last)
            if (j + 1) * BLOCK > start
        ]
        self.pages += end - start
        self.messages.append(
            Message(conv.pod, sglang_batch(events), adds, removed, len(adds), events=len(events))
        )

    def held(self, conv: Conversation, pod: int) -> int:
        return self.pods[pod].match(conv.tokens) // BLOCK


def make_fleet(shape: str, quick: bool, seed: int, concurrency: int = CONCURRENCY) -> Fleet:
    fleet: Fleet
    if shape == "vllm":
        fleet = VllmFleet(24 if quick else 64, 4 if quick else 7, 800 if quick else 3000, seed)
    elif shape == "vllm-long":
        # 8 requests at once per pod (4 with --quick), 2 turns each, caches of 6,000 blocks
        # (3,000): long answers fill them, and about a quarter of what is stored is evicted
        running = 4 if quick else 8
        fleet = VllmLongFleet(PODS * running, 2, 3000 if quick else 6000, seed, concurrency=running)
    elif shape in ("vllm-steps", "vllm-stores"):
        # as many conversations per pod as it runs at once, each queued again for its next
        # turn; 60 blocks of cache per running request: about half of what is stored evicted,
        # as in the vllm shape
        if quick:
            concurrency = min(concurrency, 16)
        fleet = VllmStepFleet(
            PODS * concurrency,
            2,
            60 * concurrency,
            seed,
            concurrency=concurrency,
            per_store=shape == "vllm-stores",
        )
    elif shape == "sglang":
        fleet = SglangFleet(16 if quick else 64, 3 if quick else 7, 8000 if quick else 40_000, seed)
    else:
        raise SystemExit(
            f"unknown shape {shape!r} (vllm, vllm-long, vllm-steps, vllm-stores or sglang)"
        )
    fleet.run()
    return fleet


@dataclass
class Result:
    shape: str
    pinned: bool
    messages: int
    events: int
    """Events the engine batches hold."""
    blocks_stored: int
    """Index blocks the pods stored (request keys written; evicted ones stored again count)."""
    pages_stored: int
    """Engine pages (vLLM blocks, SGLang tokens) stored."""
    keys: int
    share_in_runs: float
    calls_per_score: float
    score_us: dict[str, float]
    ingest_us_per_block: dict[str, float]
    """Redis CPU per stored block: kvredis (at the backlog) and the Go layout (evict per key)."""
    scores_checked: int
    ratios: dict[str, float] = field(default_factory=dict)
    server: str = "redis"
    backlog: int = 16
    bucket_bits: int = DEFAULT_BUCKET_BITS
    redis_us_per_block: dict[str, float] = field(default_factory=dict)
    """Redis CPU per stored block, every side."""
    client_us_per_block: dict[str, float] = field(default_factory=dict)
    """Ingester CPU per stored block: process, process_many, kvredis ingest over ZMQ."""
    client_blocks_per_s: dict[str, float] = field(default_factory=dict)
    client_cost_us: dict[str, dict[str, float]] = field(default_factory=dict)
    """Ingester CPU µs per message, per event, per stored block and per removed engine key
    (:func:`cost_model`), through process and process_many."""
    memory: dict[str, float] = field(default_factory=dict)
    """Bytes per (block, pod) pair: event-filled (and its page journal), 64-key fill."""
    pairs: int = 0
    parent_misses: int = 0
    evicted_per_stored: float = 0.0
    """Engine pages removed per engine page stored (1.0: caches full, evicting what they store)."""
    before: dict[str, dict[str, float]] = field(default_factory=dict)
    """With ``--before REF``: per figure, Redis CPU µs of REF's scripts and of this checkout's."""
    zmq_runs_us: list[float] = field(default_factory=list)
    """Ingester CPU per stored block of each ``kvredis ingest`` run over ZMQ, in the order run
    (``client_us_per_block`` holds their median)."""


def _calls(raw: redis.Redis) -> tuple[int, int]:
    """(script calls, commands called from scripts) in INFO commandstats since the reset."""
    stats = raw.info("commandstats")
    scripts = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    inner = sum(
        v["calls"]
        for k, v in stats.items()
        if not k.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_eval"))
    )
    return scripts, inner


def used_memory(raw: redis.Redis) -> int:
    """The server's ``used_memory`` less its clients' buffers (``mem_clients_normal``), after
    giving back what the allocator can: the data's memory. A connection keeps the query buffer
    its largest recent command needed (an ingester's call of 16 batches: hundreds of KiB) until
    the server finds it idle, which is no part of what the index holds."""
    with contextlib.suppress(redis.ResponseError):
        raw.execute_command("MEMORY", "PURGE")
    info = raw.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


def settle_collector() -> None:
    """Put what this process already holds (the simulated fleet, its messages, an earlier
    ingester) out of the garbage collector's way, so that the ingester measured next pays
    for collecting its own objects only, as in a process of its own (``kvredis ingest``)."""
    gc.collect()
    gc.freeze()


def cpu_us(
    server: Server, call: Callable[[int], object], n: int, each: list[float] | None = None
) -> tuple[float, float]:
    """(server CPU µs less the idle server's, this process's CPU s) of ``call(i)`` for i in
    range(n); with ``each``, also the CPU seconds of each call (this thread's) appended to it."""
    before = server.cpu()
    start = time.perf_counter()
    mine = time.process_time()
    if each is None:
        for i in range(n):
            call(i)
    else:
        clock = time.thread_time
        for i in range(n):
            t = clock()
            call(i)
            each.append(clock() - t)
    client = time.process_time() - mine
    elapsed = time.perf_counter() - start
    return (server.cpu() - before - server.idle_per_s * elapsed) * 1e6, client


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """The coefficients ``c`` minimising ``sum((row . c - y)^2)`` (normal equations, solved by
    Gaussian elimination with partial pivoting; a column that is all zero gets 0)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        if abs(a[col][col]) < 1e-12:
            continue
        for i in range(k):
            if i != col and a[i][col]:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] if abs(a[i][i]) >= 1e-12 else 0.0 for i in range(k)]


COSTS = ("message", "event", "block", "removed key")
"""What the ingester's cost model prices: an engine batch, an event in it, a stored index block,
an engine key removed."""


def cost_model(
    messages: Sequence[Message], backlog: int, each: Sequence[float]
) -> dict[str, float]:
    """The ingester's CPU µs per message, per event, per stored index block and per removed
    engine key (:data:`COSTS`), fitted (least squares, no cost below 0) to the CPU of each call
    that fed ``backlog`` consecutive messages."""
    rows: list[list[float]] = []
    backlog = max(backlog, 1)
    for i in range(len(each)):
        part = messages[i * backlog : (i + 1) * backlog]
        rows.append(
            [
                len(part),
                sum(m.events for m in part),
                sum(m.blocks for m in part),
                sum(len(m.removed) for m in part),
            ]
        )
    fitted = nonnegative_least_squares(rows, [t * 1e6 for t in each])
    return dict(zip(COSTS, fitted, strict=True))


def nonnegative_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """:func:`least_squares` with every coefficient at least 0 (a cost): the best fit over the
    subsets of columns whose own fit has no negative coefficient (noisy timings can make the
    unconstrained fit trade one cost for a negative other)."""
    k = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        coef = least_squares([[r[j] for j in cols] for r in rows], ys)
        if min(coef) < 0:
            continue
        full = [0.0] * k
        for j, c in zip(cols, coef, strict=True):
            full[j] = c
        residual = sum(
            (sum(c * x for c, x in zip(full, r, strict=True)) - y) ** 2
            for r, y in zip(rows, ys, strict=True)
        )
        if best is None or residual < best[0]:
            best = (residual, full)
    return best[1] if best is not None else [0.0] * k


def interleaved(
    server: Server, sides: dict[str, Callable[[int], object]], rounds: int, calls: int
) -> dict[str, float]:
    """Server CPU µs per call of each side: the median of ``rounds`` rounds, each measuring
    every side in turn over ``calls`` calls, so that a noisy spell of the machine hits every
    side alike instead of one side's whole measurement."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, call in sides.items():
            samples[name].append(server.measure(call, calls)[0])
    return {name: statistics.median(values) for name, values in samples.items()}


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def per_rank(script: Script) -> bool:
    """Whether a ``score`` script scores per (pod, data-parallel rank) and carries stamps (its
    parts take a more-keys flag, then (pod, rank, score, stamp) per slot carried), as this
    checkout's; else it is one of before that change (function API 1 and 2: (pod, score) per
    pod carried)."""
    return b"'more keys flag'" in script.source


def ref_scripts(ref: str) -> dict[str, Script]:
    """The command scripts (includes expanded) of the git revision ``ref`` of this repository."""
    git = _git
    sources = {}
    for path in git("ls-tree", "-r", "--name-only", ref, "lua/").split():
        if path.endswith(".lua"):
            sources[path[len("lua/") : -len(".lua")]] = git("show", f"{ref}:{path}")
    out = {}
    for name in sources:
        if "/" not in name:
            source = expand(name, sources).encode()
            out[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    return out


def _score_args(layout: Any, weights: dict[str, float]) -> list[Any]:
    flat: list[Any] = [layout.gen, layout.rprefix, layout.bucket_bits, 0, len(weights)]
    for tier, weight in weights.items():
        flat += (tier, repr(weight))
    return [*flat, "1.0"]


def score_now(raw: redis.Redis, sha: str, layout: Any, keys: list[int], w: dict[str, float]) -> int:
    """A whole chain scored by this checkout's ``score`` script, part by part as the client does
    (each part carrying the (pod, rank)s still in, their scores and stamps); script calls made."""
    fixed, names = _score_args(layout, w), (layout.meta, layout.pi, layout.pp, layout.sx)
    carried: list[Any] = [0]
    start = calls = 0
    while start < len(keys):
        part = keys[start : start + SCORE_KEYS_PER_CALL]
        more = 1 if start + len(part) < len(keys) else 0
        blob = struct.pack(f">{len(part)}Q", *part)
        reply = raw.evalsha(sha, 4, *names, *fixed, blob, more, *carried)
        calls += 1
        live = [reply[i : i + 5] for i in range(2, len(reply), 5) if int(reply[i + 3])]
        walked, cut = int(reply[0]), int(reply[1])
        if not live or walked == 0 or (walked < len(part) and not cut):
            break
        start += walked
        carried = [len(live)]
        for pod, rank, value, _, stamp in live:
            carried += (pod, rank, value, stamp)
    return calls


def score_then(
    raw: redis.Redis, sha: str, layout: Any, keys: list[int], w: dict[str, float]
) -> int:
    """The same by a ``score`` script from before per-rank scores (function API 1 and 2: parts
    carrying pods and scores)."""
    fixed, names = _score_args(layout, w), (layout.meta, layout.pi, layout.pp, layout.sx)
    carried: list[Any] = [0]
    start = calls = 0
    while start < len(keys):
        part = keys[start : start + SCORE_KEYS_PER_CALL]
        blob = struct.pack(f">{len(part)}Q", *part)
        reply = raw.evalsha(sha, 4, *names, *fixed, blob, *carried)
        calls += 1
        live = [reply[i : i + 3] for i in range(2, len(reply), 3) if int(reply[i + 2])]
        walked, cut = int(reply[0]), int(reply[1])
        if not live or walked == 0 or (walked < len(part) and not cut):
            break
        start += walked
        carried = [len(live)]
        for pod, value, _ in live:
            carried += (pod, value)
    return calls


def compare_before(
    ref: str, fleet: Fleet, url: str, server: Server, kv: RedisIndex, quick: bool, backlog: int
) -> dict[str, dict[str, float]]:
    """Redis CPU µs of REF's scripts and of this checkout's (see the module docstring)."""
    then = ref_scripts(ref)
    score_ref = score_now if per_rank(then["score"]) else score_then
    raw = server.raw
    now_sha = raw.script_load(kv.registry["score"].source)
    then_sha = raw.script_load(then["score"].source)
    assert now_sha == kv.registry["score"].sha and then_sha == then["score"].sha
    layout = kv._session.state.layout
    chains = [c.keys for c in fleet.convs]
    m = len(chains)
    for keys in chains:  # both protocols score the same
        score_now(raw, now_sha, layout, keys, WEIGHTS)
        score_ref(raw, then_sha, layout, keys, WEIGHTS)
    rounds, calls = (3, 40) if quick else (7, 100)
    sides: dict[str, Callable[[int], object]] = {
        f"score ({ref})": lambda i: score_ref(raw, then_sha, layout, chains[i % m], WEIGHTS),
        "score (now)": lambda i: score_now(raw, now_sha, layout, chains[i % m], WEIGHTS),
    }
    conv = interleaved(server, sides, rounds, calls)
    # chains of 3 parts held by 8 pods, each of which evicted a block elsewhere (so has a
    # version), the second also by a second data-parallel rank of each pod
    parts = RedisIndex(
        RedisIndexConfig(address=f"{url}/0", namespace=f"parts-{uuid.uuid4().hex[:6]}")
    )
    rng = random.Random(3)
    long_chains = [[_h(9, c, i) for i in range(3 * SCORE_KEYS_PER_CALL)] for c in range(2)]
    for c, chain in enumerate(long_chains):
        for p in range(PODS):
            held = rng.randint(2 * SCORE_KEYS_PER_CALL + 100, len(chain))
            parts.add(None, chain[:held], [PodEntry(f"pod-{p}", "gpu")])
            if c:
                rank = PodEntry(f"pod-{p}", "cpu", dp_rank=1)
                parts.add(None, chain[: held // 2], [rank])
            gone = _h(10, c, p)
            parts.add(None, [gone], [PodEntry(f"pod-{p}", "gpu")])
            parts.evict(gone, KeyType.REQUEST, [PodEntry(f"pod-{p}", "gpu")])
    playout = parts._session.state.layout
    long: dict[str, float] = {}
    for c, chain in enumerate(long_chains):
        assert score_now(raw, now_sha, playout, chain, WEIGHTS) == 3
        long_sides: dict[str, Callable[[int], object]] = {
            ref: lambda i, chain=chain: score_ref(raw, then_sha, playout, chain, WEIGHTS),
            "now": lambda i, chain=chain: score_now(raw, now_sha, playout, chain, WEIGHTS),
        }
        for side, us in interleaved(server, long_sides, rounds, max(5, calls // 8)).items():
            long[f"{side}/{c}"] = us
    parts.drop_namespace()
    parts.close()
    # ingest: each side into namespaces of its own, in alternation, a message per call and
    # ``backlog`` messages per call
    blocks = sum(msg.blocks for msg in fleet.messages)

    def fill(side: str, per_call: int) -> tuple[float, RedisIndex]:
        """Redis CPU µs per stored block of ``side``'s scripts fed ``per_call`` messages per
        ingester call, and the namespace it filled."""
        config = RedisIndexConfig(
            address=f"{url}/0", namespace=f"ing-{uuid.uuid4().hex[:6]}", use_functions=False
        )
        index = RedisIndex(config)
        if side == ref:
            index.registry._scripts = dict(then)
        feed, calls_needed = Ingest(fleet, url, per_call, index).calls()
        return cpu_us(server, feed, calls_needed)[0] / blocks, index

    ingest: dict[int, dict[str, list[float]]] = {1: {ref: [], "now": []}}
    ingest[backlog] = {ref: [], "now": []}
    filled: dict[str, RedisIndex] = {}
    for per_call in ingest:
        for last in (False, True):
            for side in (ref, "now"):
                us, index = fill(side, per_call)
                ingest[per_call][side].append(us)
                if last and per_call == backlog:
                    filled[side] = index
                else:
                    index.drop_namespace()
                    index.close()
    # the conversations scored by this checkout's script on what each side's writes stored
    # (how they group keys into runs decides how many runs a score reads)
    fill_sides: dict[str, Callable[[int], object]] = {
        side: lambda i, lay=index._session.state.layout: score_now(
            raw, now_sha, lay, chains[i % m], WEIGHTS
        )
        for side, index in filled.items()
    }
    fill_scores = interleaved(server, fill_sides, rounds, calls)
    for index in filled.values():
        index.drop_namespace()
        index.close()
    return {
        "conversation score": {ref: conv[f"score ({ref})"], "now": conv["score (now)"]},
        "3-part chain score": {ref: long[f"{ref}/0"], "now": long["now/0"]},
        "3-part chain, 2 ranks": {ref: long[f"{ref}/1"], "now": long["now/1"]},
        **{
            f"ingest per block, {n} per call": {
                side: statistics.median(v) for side, v in by_side.items()
            }
            for n, by_side in ingest.items()
        },
        "score, each side's fill": fill_scores,
    }


class Ingest:
    """One kvredis namespace filled through an :class:`EventIngester`, messages fed ``backlog``
    at a time (``process`` for 1, else ``process_many`` of that many consecutive messages, as a
    worker drains its queue): ``index``'s, or a new one's."""

    def __init__(
        self, fleet: Fleet, url: str, backlog: int, index: RedisIndex | None = None
    ) -> None:
        self.fleet = fleet
        if index is None:  # a namespace of its own, sized for the fleet
            config = RedisIndexConfig(
                address=f"{url}/0",
                namespace=f"real-{uuid.uuid4().hex[:6]}",
                bucket_bits=fleet.bucket_bits,
            )
            index = RedisIndex(config)
        self.ns = index.config.namespace
        self.index = index
        self.ingester = EventIngester(self.index, TP)
        self.endpoints = [
            EndpointConfig(f"pod-{p}", engine=fleet.engine, pod_id=f"pod-{p}", model_name=MODEL)
            for p in range(PODS)
        ]
        self.seqs = [0] * PODS
        self.backlog = backlog

    def calls(self) -> tuple[Callable[[int], object], int]:
        """The feeding call and how many times to make it."""
        messages, backlog = self.fleet.messages, self.backlog
        topics = [f"kv@pod-{p}@{MODEL}" for p in range(PODS)]

        def one(i: int) -> None:
            m = messages[i]
            self.ingester.process(topics[m.pod], self.seqs[m.pod], m.payload, self.endpoints[m.pod])
            self.seqs[m.pod] += 1

        def many(i: int) -> None:
            batch = []
            for m in messages[i * backlog : (i + 1) * backlog]:
                batch.append((topics[m.pod], self.seqs[m.pod], m.payload, self.endpoints[m.pod]))
                self.seqs[m.pod] += 1
            self.ingester.process_many(batch)

        if backlog <= 1:
            return one, len(messages)
        return many, -(-len(messages) // backlog)

    def counter(self, name: str) -> int:
        return self.ingester.counters.get(name)

    def close(self) -> None:
        self.index.close()


def zmq_client_cpu(
    fleet: Fleet, url: str, workers: int = 4, gc_threshold: int = GC_THRESHOLD
) -> float:
    """CPU seconds ``kvredis ingest`` spends applying the fleet's messages, received over ZMQ on
    loopback (8 publishers; startup excluded: read from ``/proc`` once it subscribed)."""
    import zmq

    from kvredis.testing.servers import free_port

    ns = f"zmq-{uuid.uuid4().hex[:6]}"
    ctx = zmq.Context()
    sockets, args = [], []
    for p in range(PODS):
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, 0)
        port = free_port()
        sock.bind(f"tcp://127.0.0.1:{port}")
        sockets.append(sock)
        args += ["--endpoint", f"tcp://127.0.0.1:{port}", "--pod", f"pod-{p}", "--model", MODEL]
        args += ["--engine", fleet.engine]
    # the namespace made first, with the fleet's bucket bits (the first client fixes them)
    index = RedisIndex(RedisIndexConfig(address=url, namespace=ns, bucket_bits=fleet.bucket_bits))
    cmd = [sys.executable, "-m", "kvredis.cli.ingest", "--redis", url, "--namespace", ns]
    tuning = ["--workers", str(workers), "--gc-threshold", str(gc_threshold)]
    proc = subprocess.Popen(
        [*cmd, "--status-interval", "600", *tuning, *args],
        cwd=str(REPO),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def cpu() -> float:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def applied(pod: int) -> int:
        wm = index.get_watermark(f"pod-{pod}")
        if wm is None:
            return -1
        seq, phase = split_position(wm.seq)
        return seq if phase == PHASE_DONE else seq - 1

    try:
        for sock in sockets:  # the subscription arrives once the ingester connected
            if not sock.poll(60_000):
                raise SystemExit("kvredis ingest did not subscribe within 60 s")
            sock.recv()
        time.sleep(0.5)
        start = cpu()
        seqs = [0] * PODS
        for n, m in enumerate(fleet.messages):
            topic = f"kv@pod-{m.pod}@{MODEL}".encode()
            sockets[m.pod].send_multipart([topic, seqs[m.pod].to_bytes(8, "big"), m.payload])
            seqs[m.pod] += 1
            if n % 128 == 127:  # stay within the subscriber's queue: never more than 512 ahead
                while any(applied(p) < seqs[p] - 512 for p in range(PODS)):
                    time.sleep(0.005)
        deadline = time.monotonic() + 600
        while any(applied(p) < seqs[p] - 1 for p in range(PODS)):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("kvredis ingest did not apply every message")
            time.sleep(0.01)
        return cpu() - start
    finally:
        proc.terminate()
        proc.wait(60)
        for sock in sockets:
            sock.close(0)
        ctx.term()
        index.drop_namespace()
        index.close()


def run_shape(
    fleet: Fleet,
    url: str,
    server: Server,
    quick: bool,
    backlog: int,
    zmq_runs: int,
    zmq_workers: int = 4,
    before_ref: str | None = None,
    gc_threshold: int = GC_THRESHOLD,
) -> Result:
    """One fleet measured on ``server``; ``kvredis ingest`` over ZMQ ``zmq_runs`` times (0:
    not at all)."""
    raw = server.raw
    raw.flushall()
    n = len(fleet.messages)
    blocks = sum(m.blocks for m in fleet.messages)
    # kvredis at backlog 1, then at the backlog: the latter's namespace is the one measured
    single = Ingest(fleet, url, 1)
    call, count = single.calls()
    settle_collector()
    single_each: list[float] = []
    single_redis, single_client = cpu_us(server, call, count, single_each)
    many = Ingest(fleet, url, backlog)
    call, count = many.calls()
    settle_collector()
    before = used_memory(raw)
    many_each: list[float] = []
    many_redis, many_client = cpu_us(server, call, count, many_each)
    event_filled = used_memory(raw) - before
    journal_keys = list(raw.scan_iter(match=f"{many.ns}{JOURNAL_KEY_INFIX}*", count=1000))
    # the Go layout, evicting as its own code does and written well
    tier = DEFAULT_TIERS.tier("GPU")
    entries = [PodEntry(f"pod-{p}", tier) for p in range(PODS)]
    ref_sides: dict[str, float] = {}
    ref_clients: list[redis.Redis] = []
    refs: dict[str, ReferenceLayout] = {}
    for db, name in ((1, "go layout"), (2, "go layout written well")):
        client = redis.Redis.from_url(url, db=db)
        ref_clients.append(client)
        ref = refs[name] = ReferenceLayout(client)

        def ref_feed(i: int, ref: ReferenceLayout = ref, well: bool = db == 2) -> None:
            m = fleet.messages[i]
            for removed, adds in m.steps():
                if well and removed:
                    ref.evict_many(removed, [entries[m.pod]])
                else:
                    for engine in removed:
                        ref.evict(engine, KeyType.ENGINE, [entries[m.pod]])
                for engine_keys, request_keys in adds:
                    if request_keys:
                        ref.add(engine_keys, request_keys, [entries[m.pod]])

        ref_sides[name] = cpu_us(server, ref_feed, n)[0]
    # the final pairs by 64-key adds, in chain order
    fill = RedisIndex(
        RedisIndexConfig(
            address=f"{url}/0", namespace=many.ns + "-64", bucket_bits=fleet.bucket_bits
        )
    )
    pairs = fleet.pairs()
    n_pairs = sum(map(len, pairs.values()))
    before = used_memory(raw)
    for p, keys in pairs.items():
        for j in range(0, len(keys), 64):
            fill.add(None, keys[j : j + 64], [entries[p]])
    fill_bytes = used_memory(raw) - before
    # the same, each key's adds naming the engine key the index maps to it (a vLLM block's hash,
    # the page ending an SGLang block): the mappings an index of engine events needs
    engine_of: dict[int, int] = {}
    for m in fleet.messages:
        for engine_keys, request_keys in m.adds:
            if len(engine_keys) == len(request_keys):
                engine_of.update(zip(request_keys, engine_keys, strict=True))
            elif len(request_keys) == 1 and engine_keys:
                engine_of[request_keys[0]] = engine_keys[-1]
    mapped = RedisIndex(
        RedisIndexConfig(
            address=f"{url}/0", namespace=many.ns + "-64e", bucket_bits=fleet.bucket_bits
        )
    )
    before = used_memory(raw)
    for p, keys in pairs.items():
        for j in range(0, len(keys), 64):
            part = keys[j : j + 64]
            mapped.add([engine_of[k] for k in part], part, [entries[p]])
    mapped_bytes = used_memory(raw) - before
    # the journal as the ingester left it (up to twice what compaction keeps), then compacted
    before = used_memory(raw)
    if journal_keys:
        journal = RedisPageJournal(raw, many.ns)
        prefix = len(f"{many.ns}{JOURNAL_KEY_INFIX}")
        for key in journal_keys:
            journal.compact(key[prefix:].decode())
    compacted = used_memory(raw)
    if journal_keys:
        raw.delete(*journal_keys)
    journal_bytes = before - used_memory(raw)
    journal_compacted = compacted - used_memory(raw)
    # scores against what the pods hold
    scorer = LongestPrefixScorer(WEIGHTS)
    chains = [c.keys for c in fleet.convs]
    checked = 0
    for conv in fleet.convs:
        want = {f"pod-{p}": float(h) for p in range(PODS) if (h := fleet.held(conv, p))}
        for side in (many.index, single.index, fill, mapped):
            got = side.score(conv.keys, WEIGHTS)
            assert got == want, (fleet.shape, got, want)
        assert scorer.score(conv.keys, refs["go layout"].lookup(conv.keys)) == want
        checked += 1
    misses = single.counter("parent_misses") + many.counter("parent_misses")
    assert misses == 0, f"{misses} parent misses"
    # share of request keys held through runs
    total = in_runs = 0
    for name in raw.scan_iter(match=f"{many.ns}:r:*", count=1000):
        values = raw.hvals(name)
        total += len(values)
        in_runs += sum(len(v) == 6 for v in values)
    m = len(chains)
    raw.config_resetstat()
    for i in range(m):
        many.index.score(chains[i], WEIGHTS)
    scripts, inner = _calls(raw)
    floor = raw.register_script(FLOOR)
    blob = bytes(512 * 8)
    raw.set("floor-run", blob)
    # What any script call costs the server on this machine (reading the request, writing the
    # reply: system calls, whose price differs much between machines), for reading the ratios.
    bare = raw.register_script(BARE)
    kv = many.index
    sides: dict[str, Callable[[int], object]] = {
        "kvredis": lambda i: kv.score(chains[i % m], WEIGHTS),
        "go layout": lambda i: refs["go layout"].lookup(chains[i % m]),
        "64-key fill": lambda i: fill.score(chains[i % m], WEIGHTS),
        "floor": lambda i: floor(keys=["floor-run"], args=[blob]),
        "bare call": lambda i: bare(),
    }
    score_us = interleaved(server, sides, rounds=3 if quick else 7, calls=40 if quick else 100)
    compared = (
        compare_before(before_ref, fleet, url, server, kv, quick, backlog) if before_ref else {}
    )
    # each run a fresh ingester process and namespace: the machine's pace moves between runs
    zmq_each = [zmq_client_cpu(fleet, url, zmq_workers, gc_threshold) for _ in range(zmq_runs)]
    for side in (single, many):
        side.close()
    fill.close()
    mapped.close()
    for client in ref_clients:
        client.close()
    redis_us = {
        "kvredis, backlog 1": single_redis / blocks,
        f"kvredis, backlog {backlog}": many_redis / blocks,
        "go layout": ref_sides["go layout"] / blocks,
        "go layout written well": ref_sides["go layout written well"] / blocks,
    }
    client_us = {
        "process": single_client * 1e6 / blocks,
        f"process_many({backlog})": many_client * 1e6 / blocks,
    }
    if zmq_each:
        client_us["kvredis ingest (ZMQ)"] = statistics.median(zmq_each) * 1e6 / blocks
    removed = sum(len(mm.removed) for mm in fleet.messages)
    result = Result(
        shape=fleet.shape,
        pinned=False,
        messages=n,
        events=sum(mm.events for mm in fleet.messages),
        blocks_stored=blocks,
        pages_stored=fleet.pages,
        keys=total,
        share_in_runs=in_runs / max(total, 1),
        calls_per_score=(scripts + inner) / m,
        score_us=score_us,
        ingest_us_per_block={
            "kvredis": redis_us[f"kvredis, backlog {backlog}"],
            "go layout": redis_us["go layout"],
        },
        scores_checked=checked,
        backlog=backlog,
        bucket_bits=fleet.bucket_bits,
        redis_us_per_block=redis_us,
        client_us_per_block=client_us,
        client_blocks_per_s={k: 1e6 / v for k, v in client_us.items() if v > 0},
        client_cost_us={
            "process": cost_model(fleet.messages, 1, single_each),
            f"process_many({backlog})": cost_model(fleet.messages, backlog, many_each),
        },
        memory={
            "event-filled": event_filled / n_pairs,
            "of which page journal": journal_bytes / n_pairs,
            "page journal compacted": journal_compacted / n_pairs,
            "64-key fill": fill_bytes / n_pairs,
            "64-key fill with engine mappings": mapped_bytes / n_pairs,
        },
        pairs=n_pairs,
        parent_misses=misses,
        evicted_per_stored=removed / max(fleet.pages, 1),
    )
    result.before = compared
    result.zmq_runs_us = [s * 1e6 / blocks for s in zmq_each]
    well = redis_us["go layout written well"]
    result.ratios = {
        "score vs go layout": score_us["kvredis"] / score_us["go layout"],
        "score vs 64-key fill": score_us["kvredis"] / score_us["64-key fill"],
        "score vs floor": score_us["kvredis"] / score_us["floor"],
        "ingest vs go layout": redis_us[f"kvredis, backlog {backlog}"] / redis_us["go layout"],
        "ingest vs go layout written well": redis_us[f"kvredis, backlog {backlog}"] / well,
        "memory vs 64-key fill": event_filled / fill_bytes,
        "memory without the journal vs 64-key fill": (event_filled - journal_bytes) / fill_bytes,
        "memory without the journal vs 64-key fill with engine mappings": (
            event_filled - journal_bytes
        )
        / mapped_bytes,
        "memory, journal compacted, vs 64-key fill": (
            event_filled - journal_bytes + journal_compacted
        )
        / fill_bytes,
    }
    return result


def print_result(r: Result) -> None:
    print(
        f"\n== {r.shape}: {r.messages} engine batches ({r.events} events), "
        f"{r.blocks_stored} blocks stored "
        f"({r.pages_stored} engine pages, {r.evicted_per_stored:.2f} evicted per stored), "
        f"{r.pairs} pairs held, {r.server}, pinned={r.pinned}"
    )
    print(f"  bucket bits                        {r.bucket_bits:6d}")
    print(f"  request keys in chain runs        {r.share_in_runs:7.1%}")
    print(f"  Redis calls per conversation score {r.calls_per_score:6.1f} (script calls included)")
    for name, us in r.score_us.items():
        print(f"  score CPU, {name:<12} {us:9,.1f} us")
    for name, us in r.redis_us_per_block.items():
        print(f"  Redis CPU per stored block, {name:<24} {us:7.1f} us")
    for name, us in r.client_us_per_block.items():
        print(
            f"  ingester CPU per stored block, {name:<22} {us:7.1f} us "
            f"({1e6 / us:9,.0f} blocks per CPU-second)"
        )
    if len(r.zmq_runs_us) > 1:
        runs = ", ".join(f"{us:.1f}" for us in r.zmq_runs_us)
        print(f"  kvredis ingest (ZMQ) runs, median above: {runs} us per block")
    for name, costs in r.client_cost_us.items():
        fitted = ", ".join(f"{us:.1f} us per {what}" for what, us in costs.items())
        print(f"  ingester CPU, {name}, fitted: {fitted}")
    for name, b in r.memory.items():
        print(f"  memory per pair, {name:<22} {b:7.1f} B")
    for name, ratio in r.ratios.items():
        print(f"  {name:<42} {ratio:6.2f}x")
    print(f"  scores checked against the pods: {r.scores_checked}, parent misses {r.parent_misses}")
    for name, sides in r.before.items():
        (ref, then), (_, now) = sides.items()
        print(f"  {name:<22} {ref}: {then:8,.1f} us, now: {now:8,.1f} us ({now / then:5.2f}x)")


def sizing_table(results: Sequence[Result], pod_rate: float) -> str:
    """Markdown: Redis cores and ingester processes for 100 and 1,000 pods storing ``pod_rate``
    blocks a second each (and evicting as many), at the measured per-block costs."""
    lines = [
        "| shape, server | pods | Redis cores, kvredis | Redis cores, Go layout written well "
        "| ingester processes (`kvredis ingest`) | pods per Redis core | pods per ingester "
        "process |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        redis_us = r.redis_us_per_block[f"kvredis, backlog {r.backlog}"]
        go_us = r.redis_us_per_block["go layout written well"]
        client = r.client_us_per_block
        client_us = client.get("kvredis ingest (ZMQ)", client[f"process_many({r.backlog})"])
        per_pod = pod_rate * 1e-6
        for pods in (100, 1000):
            lines.append(
                f"| {r.shape}, {r.server} | {pods:,} | {pods * per_pod * redis_us:.1f} "
                f"| {pods * per_pod * go_us:.1f} | {pods * per_pod * client_us:.1f} "
                f"| {1 / (per_pod * redis_us):.0f} | {1 / (per_pod * client_us):.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "fewer conversations and turns")
    parser.add_argument(
        "--shape",
        default="vllm,sglang",
        help="comma-separated: vllm (a batch per store), vllm-long (vllm with answers of 1k-10k "
        "tokens), vllm-steps (a batch per engine step), vllm-stores (vllm-steps' stream, a "
        "batch per store), sglang",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=CONCURRENCY,
        help=f"requests a vllm-steps pod runs at once (default {CONCURRENCY}; 16 at most with "
        "--quick)",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument(
        "--backlog",
        type=int,
        default=16,
        help="messages a busy worker finds queued, applied together with process_many",
    )
    parser.add_argument(
        "--pod-rate",
        type=float,
        default=1000.0,
        help="blocks a pod stores per second, for the sizing table",
    )
    parser.add_argument(
        "--no-zmq", action="store_true", help="skip the kvredis ingest over ZMQ measurement"
    )
    parser.add_argument(
        "--zmq-workers", type=int, default=4, help="kvredis ingest --workers (default 4)"
    )
    parser.add_argument(
        "--zmq-runs",
        type=int,
        default=None,
        help="kvredis ingest runs over ZMQ per shape, each a fresh process; the median is "
        "reported (default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--before", metavar="REF", help="also measure the Lua scripts of git revision REF"
    )
    parser.add_argument(
        "--bucket-bits",
        default=str(DEFAULT_BUCKET_BITS),
        help="bucket bits of the measured namespaces: a number, or auto (bucket_bits_for the "
        f"request keys the fleet holds; default {DEFAULT_BUCKET_BITS})",
    )
    parser.add_argument(
        "--gc-threshold",
        type=int,
        default=GC_THRESHOLD,
        help="the garbage collector's first threshold in this process and in kvredis ingest, "
        f"as kvredis ingest --gc-threshold sets it (default {GC_THRESHOLD}; 0: Python's)",
    )
    args = parser.parse_args(argv)
    tune_collector(args.gc_threshold)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    zmq_runs = args.zmq_runs if args.zmq_runs is not None else 1 if args.quick else 3
    if zmq_runs < 1:
        parser.error("--zmq-runs must be at least 1")
    fleets = [
        make_fleet(shape, args.quick, args.seed, args.concurrency)
        for shape in args.shape.split(",")
    ]
    for fleet in fleets:
        auto = args.bucket_bits.strip() == "auto"
        fleet.bucket_bits = (
            bucket_bits_for(fleet.distinct_keys()) if auto else int(args.bucket_bits)
        )
    server_proc = RedisServer(args.server)
    server_proc.start()
    results = []
    try:
        pid = server_proc.proc.pid if server_proc.proc is not None else None
        pinned = pid is not None and pin(pid)
        server = Server(server_proc.url, pid)
        server.calibrate()
        for fleet in fleets:
            r = run_shape(
                fleet,
                server_proc.url,
                server,
                args.quick,
                args.backlog,
                0 if args.no_zmq else zmq_runs,
                args.zmq_workers,
                args.before,
                args.gc_threshold,
            )
            r.pinned = pinned
            r.server = args.server
            print_result(r)
            results.append(r)
        server.close()
    finally:
        server_proc.close()
    print(f"\nFleet sizing at {args.pod_rate:,.0f} stored blocks per pod per second:\n")
    print(sizing_table(results, args.pod_rate))
    if args.json:
        write_json(args.json, [asdict(r) for r in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Redis CPU on indexes filled the way engines write them, against the Go llm-d layout.

The other benchmarks fill the index with 64-key adds. Engines do not write like that: vLLM
stores a prompt in prefill chunks (up to 128 blocks per ``BlockStored``), then one one-block
``BlockStored`` per 16 generated tokens; SGLang stores radix nodes, with page size 1 one engine
hash per token. This benchmark simulates a fleet and feeds every message through
:class:`~kvredis.ingest.EventIngester` in the engines' own wire shapes (``kvredis.testing.wire``):

- 8 pods; conversations of several turns, each opening with one of 16 shared system prompts of
  any length (2-120 blocks); a user turn of 1-40 blocks of tokens (not block aligned for vLLM,
  whole blocks for SGLang, whose mid-block chains are another matter), then 1-40 blocks of
  generated tokens (vLLM: one event per block; SGLang, page size 1: radix nodes of 1-4 blocks,
  one engine hash per token, each node extending the one before); one turn in ten moves to
  another pod;
- each pod holds a bounded number of blocks, least recently used evicted as ``BlockRemoved``
  (a request's tail blocks first, as vLLM's free queue orders them);
- each message is one engine batch (one ``apply_batch``), the worst case for fixed costs.

The same (engine event → request keys, entries) stream fills the Go layout
(``scripts/reference_layout.py``: one pipeline per event, an HSET per key and a ZADD per engine
key; evictions as the Go index makes them), and the final pairs fill a third namespace by
64-key adds. Reported: the share of request keys held through chain runs, Redis calls inside
a whole-conversation score, Redis CPU per score (kvredis, Go layout, 64-key fill and the floor:
a Lua script that GETs one string of 512 x 8 bytes and compares it; and a script call that does
nothing, what any call costs the server on the machine), ingest Redis CPU per stored
block (kvredis through the ingester, Go layout per-event pipeline), and scores checked against
what each simulated pod really holds. The server is pinned to one core (``taskset``) when
possible; CPU is ``INFO cpu`` growth minus the idle server's (see ``bench_server_cpu.py``); a
score's is the median of rounds that each measure every side in turn.
``--server valkey`` runs it all on Valkey 9 instead of redis-server.

``--before REF`` also measures, in the same server and in interleaved rounds, the Lua scripts of
the git revision ``REF`` of this repository against this checkout's, both by ``EVALSHA`` of the
same arguments from a bare client (each side in its own protocol): Redis CPU per conversation
score, per score of a chain of 3 parts (12,288 keys held by 8 pods, each of which evicted a
block elsewhere: the parts' stamps; and the same with a second data-parallel rank per pod, which
the scripts from before per-rank scores, function API 1 and 2, merge into the pod), and per
block ingested through the ingester (each side into namespaces of its own, fed in alternation).

Run:  .venv/bin/python scripts/bench_realistic.py [--quick] [--shape vllm,sglang] [--server valkey]
      [--before REF] [--json PATH]
"""

from __future__ import annotations

import hashlib
import random
import statistics
import struct
import subprocess
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from bench_server_cpu import Server, pin

from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest import EventIngester
from kvredis.redis import RedisIndex, RedisIndexConfig
from kvredis.redis.ops import SCORE_KEYS_PER_CALL
from kvredis.redis.scripts import Script, expand
from kvredis.scoring import LongestPrefixScorer
from kvredis.testing.wire import (
    sglang_batch,
    sglang_removed,
    sglang_stored,
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
    """The engine hashes of each full block (one per vLLM block, one per SGLang page)."""
    last: int = 0
    """The running engine hash after the last block."""

    def extend_keys(self) -> None:
        full = len(self.tokens) // BLOCK
        if full > len(self.keys):
            base = self.keys[-1] if self.keys else 0
            new = self.tokens[len(self.keys) * BLOCK : full * BLOCK]
            self.keys += TP.tokens_to_kv_block_keys(base, new, MODEL)


@dataclass
class Message:
    """One engine batch: its payload, and what it did in index terms (for the Go layout)."""

    pod: int
    payload: bytes
    adds: list[tuple[list[int], list[int]]]
    """(engine keys, request keys) per ``BlockStored``."""
    removed: list[int]
    """Engine keys of ``BlockRemoved``."""
    blocks: int


class Pod:
    """One engine's cache: blocks (their engine hashes) by their last engine hash, LRU order.
    SGLang evicts pages; here a block's pages go together (mid-block chains are another
    matter)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def touch(self, blocks: Sequence[tuple[int, ...]]) -> None:
        for b in reversed(blocks):  # a request's tail is the least recently used of its blocks
            self.lru.move_to_end(b[-1])

    def evict(self, room: int) -> list[int]:
        out: list[int] = []
        while self.lru and len(self.lru) + room > self.capacity:
            out.extend(self.lru.popitem(last=False)[1])
        return out

    def hit(self, blocks: Sequence[tuple[int, ...]]) -> int:
        n = 0
        while n < len(blocks) and blocks[n][-1] in self.lru:
            n += 1
        return n


class Fleet:
    """The simulation: messages in the engines' shapes, and what every pod holds."""

    def __init__(
        self,
        shape: str,
        conversations: int,
        turns: int,
        capacity: int,
        seed: int,
        pods: int = PODS,
    ) -> None:
        self.shape = shape
        self.rng = random.Random(seed)
        self.page = 1 if shape == "sglang" else BLOCK
        self.pods = [Pod(capacity) for _ in range(pods)]
        rng = self.rng
        self.prompts = [
            [rng.randrange(1, 50_000) for _ in range(BLOCK * rng.randint(2, 120))]
            for _ in range(PROMPTS)
        ]
        self.convs = [
            Conversation(list(rng.choice(self.prompts)), pod=rng.randrange(pods))
            for _ in range(conversations)
        ]
        self.turns = turns
        self.messages: list[Message] = []

    def blocks(self, conv: Conversation) -> list[tuple[int, ...]]:
        """The engine hashes of the conversation's full blocks, by a running hash of the tokens
        (the same prefix, the same hashes)."""
        h = conv.last
        for b in range(len(conv.blocks), len(conv.tokens) // BLOCK):
            block = []
            for end in range(b * BLOCK + self.page, (b + 1) * BLOCK + 1, self.page):
                h = _h(h, *conv.tokens[end - self.page : end])
                block.append(h)
            conv.blocks.append(tuple(block))
        conv.last = h
        return conv.blocks

    def run(self) -> None:
        order = [(t, c) for t in range(self.turns) for c in range(len(self.convs))]
        for t, c in order:
            conv = self.convs[c]
            if t and self.rng.random() < 0.1:
                conv.pod = self.rng.randrange(len(self.pods))  # the router moved it
            user = self.rng.randint(1, 40) * BLOCK
            if self.shape == "vllm":
                user += self.rng.randrange(BLOCK)  # prompts are not block aligned
            conv.tokens += [self.rng.randrange(1, 50_000) for _ in range(user)]
            self.store(conv, prefill=True)
            out = self.rng.randint(1, 40)
            while out > 0:  # vLLM: one event per block; SGLang: nodes of 1-4 blocks
                step = 1 if self.shape == "vllm" else min(out, self.rng.randint(1, 4))
                conv.tokens += [self.rng.randrange(1, 50_000) for _ in range(step * BLOCK)]
                self.store(conv, prefill=False)
                out -= step

    def store(self, conv: Conversation, prefill: bool) -> None:
        """The pod stores the conversation's full units it does not hold (prefill chunks of up
        to 128 blocks; a decode block; an SGLang node), evicting to make room."""
        pod = self.pods[conv.pod]
        blocks = self.blocks(conv)
        removed = pod.evict(len(blocks) - pod.hit(blocks))
        # an eviction may have taken a block of this prefix: the engine stores from the miss
        hit = pod.hit(blocks)
        new = blocks[hit:]
        conv.extend_keys()
        events: list[Any] = []
        adds: list[tuple[list[int], list[int]]] = []
        if removed:
            rm = vllm_removed if self.shape == "vllm" else sglang_removed
            events.append(rm(removed))
        chunk = 128 if self.shape == "vllm" else len(new) or 1
        for start in range(0, len(new), chunk):
            first = hit + start
            part = [h for b in new[start : start + chunk] for h in b]
            parent = blocks[first - 1][-1] if first else None
            toks = conv.tokens[first * BLOCK : first * BLOCK + len(part) * self.page]
            if self.shape == "vllm":
                events.append(vllm_stored(part, parent, toks, BLOCK))
            else:
                events.append(sglang_stored(part, parent, toks, self.page))
            adds.append((part, conv.keys[first : first + len(part) * self.page // BLOCK]))
        for b in new:
            pod.lru[b[-1]] = b
        pod.touch(blocks)
        if not events:
            return
        batch = vllm_batch if self.shape == "vllm" else sglang_batch
        self.messages.append(Message(conv.pod, batch(events), adds, removed, len(new)))

    def held(self, conv: Conversation, pod: int) -> int:
        """How many leading request keys of the conversation ``pod`` holds."""
        return self.pods[pod].hit(conv.blocks[: len(conv.keys)])


@dataclass
class Result:
    shape: str
    pinned: bool
    messages: int
    blocks_stored: int
    keys: int
    share_in_runs: float
    calls_per_score: float
    score_us: dict[str, float]
    ingest_us_per_block: dict[str, float]
    scores_checked: int
    ratios: dict[str, float] = field(default_factory=dict)
    server: str = "redis"
    before: dict[str, dict[str, float]] = field(default_factory=dict)
    """With ``--before REF``: per figure, Redis CPU µs of REF's scripts and of this checkout's."""


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


def cpu_us(server: Server, call: Callable[[int], object], n: int) -> float:
    """Server CPU µs (less the idle server's) of ``call(i)`` for i in range(n), in all."""
    before = server.cpu()
    start = time.perf_counter()
    for i in range(n):
        call(i)
    elapsed = time.perf_counter() - start
    return (server.cpu() - before - server.idle_per_s * elapsed) * 1e6


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


def score_now(
    raw: redis.Redis, sha: str, layout: Any, keys: list[int], w: dict[str, float]
) -> int:
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
    ref: str, fleet: Fleet, url: str, server: Server, kv: RedisIndex, quick: bool
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
    # ingest: each side into namespaces of its own, in alternation
    ingest: dict[str, list[float]] = {ref: [], "now": []}
    blocks = sum(msg.blocks for msg in fleet.messages)
    for _ in range(2):
        for side in (ref, "now"):
            config = RedisIndexConfig(
                address=f"{url}/0", namespace=f"ing-{uuid.uuid4().hex[:6]}", use_functions=False
            )
            index = RedisIndex(config)
            if side == ref:
                index.registry._scripts = dict(then)
            ing = EventIngester(index, TP)
            seqs = [0] * PODS

            def feed(i: int, ing: EventIngester = ing, seqs: list[int] = seqs) -> None:
                msg = fleet.messages[i]
                ing.process(
                    f"kv@pod-{msg.pod}@{MODEL}", seqs[msg.pod], msg.payload, f"pod-{msg.pod}"
                )
                seqs[msg.pod] += 1

            ingest[side].append(cpu_us(server, feed, len(fleet.messages)) / blocks)
            index.drop_namespace()
            index.close()
    return {
        "conversation score": {ref: conv[f"score ({ref})"], "now": conv["score (now)"]},
        "3-part chain score": {ref: long[f"{ref}/0"], "now": long["now/0"]},
        "3-part chain, 2 ranks": {ref: long[f"{ref}/1"], "now": long["now/1"]},
        "ingest per block": {side: statistics.median(v) for side, v in ingest.items()},
    }


def run_shape(
    shape: str, url: str, server: Server, quick: bool, seed: int, before: str | None = None
) -> Result:
    fleet = Fleet(shape, 24 if quick else 64, 4 if quick else 7, 800 if quick else 3000, seed)
    fleet.run()
    raw = server.raw
    raw.flushall()
    ns = f"real-{uuid.uuid4().hex[:6]}"
    kv = RedisIndex(RedisIndexConfig(address=f"{url}/0", namespace=ns))
    ing = EventIngester(kv, TP)
    seqs = [0] * PODS
    blocks = sum(m.blocks for m in fleet.messages)

    def feed(i: int) -> None:
        m = fleet.messages[i]
        ing.process(f"kv@pod-{m.pod}@{MODEL}", seqs[m.pod], m.payload, endpoint=f"pod-{m.pod}")
        seqs[m.pod] += 1

    n = len(fleet.messages)
    kv_ingest = cpu_us(server, feed, n)
    ref_client = redis.Redis.from_url(url, db=1)
    ref = ReferenceLayout(ref_client)
    tier = DEFAULT_TIERS.tier("GPU")
    entries = [PodEntry(f"pod-{p}", tier) for p in range(PODS)]

    def ref_feed(i: int) -> None:
        m = fleet.messages[i]
        for engine in m.removed:
            ref.evict(engine, KeyType.ENGINE, [entries[m.pod]])
        for engine_keys, request_keys in m.adds:
            if request_keys:
                ref.add(engine_keys, request_keys, [entries[m.pod]])

    ref_ingest = cpu_us(server, ref_feed, n)
    # the final pairs by 64-key adds, in chain order, each (pod, key) once
    fill = RedisIndex(RedisIndexConfig(address=f"{url}/0", namespace=ns + "-64"))
    done: set[tuple[int, int]] = set()
    for conv in fleet.convs:
        for p in range(PODS):
            keys = [k for k in conv.keys[: fleet.held(conv, p)] if (p, k) not in done]
            done.update((p, k) for k in keys)
            for j in range(0, len(keys), 64):
                fill.add(None, keys[j : j + 64], [entries[p]])
    # scores against what the pods hold
    scorer = LongestPrefixScorer(WEIGHTS)
    chains = [c.keys for c in fleet.convs]
    checked = 0
    for conv in fleet.convs:
        want = {f"pod-{p}": float(h) for p in range(PODS) if (h := fleet.held(conv, p))}
        got = kv.score(conv.keys, WEIGHTS)
        assert got == want, (got, want)
        assert fill.score(conv.keys, WEIGHTS) == want
        assert scorer.score(conv.keys, ref.lookup(conv.keys)) == want
        checked += 1
    # share of request keys held through runs
    total = in_runs = 0
    for name in raw.scan_iter(match=f"{ns}:r:*", count=1000):
        values = raw.hvals(name)
        total += len(values)
        in_runs += sum(len(v) == 6 for v in values)
    m = len(chains)
    raw.config_resetstat()
    for i in range(m):
        kv.score(chains[i], WEIGHTS)
    scripts, inner = _calls(raw)
    floor = raw.register_script(FLOOR)
    blob = bytes(512 * 8)
    raw.set("floor-run", blob)
    # What any script call costs the server on this machine (reading the request, writing the
    # reply: system calls, whose price differs much between machines), for reading the ratios.
    bare = raw.register_script(BARE)
    sides: dict[str, Callable[[int], object]] = {
        "kvredis": lambda i: kv.score(chains[i % m], WEIGHTS),
        "go layout": lambda i: ref.lookup(chains[i % m]),
        "64-key fill": lambda i: fill.score(chains[i % m], WEIGHTS),
        "floor": lambda i: floor(keys=["floor-run"], args=[blob]),
        "bare call": lambda i: bare(),
    }
    score_us = interleaved(server, sides, rounds=3 if quick else 7, calls=40 if quick else 100)
    compared = compare_before(before, fleet, url, server, kv, quick) if before else {}
    kv.close()
    fill.close()
    ref_client.close()
    per_block = {"kvredis": kv_ingest / blocks, "go layout": ref_ingest / blocks}
    result = Result(
        shape,
        False,
        n,
        blocks,
        total,
        in_runs / max(total, 1),
        (scripts + inner) / m,
        score_us,
        per_block,
        checked,
    )
    result.before = compared
    result.ratios = {
        "score vs go layout": score_us["kvredis"] / score_us["go layout"],
        "score vs 64-key fill": score_us["kvredis"] / score_us["64-key fill"],
        "score vs floor": score_us["kvredis"] / score_us["floor"],
        "ingest vs go layout": per_block["kvredis"] / per_block["go layout"],
    }
    return result


def print_result(r: Result) -> None:
    print(
        f"\n== {r.shape}: {r.messages} engine batches, {r.blocks_stored} blocks stored, "
        f"{r.keys} request keys, {r.server}, pinned={r.pinned}"
    )
    print(f"  request keys in chain runs        {r.share_in_runs:7.1%}")
    print(f"  Redis calls per conversation score {r.calls_per_score:6.1f} (script calls included)")
    for name, us in r.score_us.items():
        print(f"  score CPU, {name:<12} {us:9,.1f} us")
    for name, us in r.ingest_us_per_block.items():
        print(f"  ingest CPU per block, {name:<10} {us:7.1f} us")
    for name, ratio in r.ratios.items():
        print(f"  {name:<22} {ratio:6.2f}x")
    print(f"  scores checked against the pods: {r.scores_checked}")
    for name, sides in r.before.items():
        (ref, then), (_, now) = sides.items()
        print(f"  {name:<22} {ref}: {then:8,.1f} us, now: {now:8,.1f} us ({now / then:5.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "fewer conversations and turns")
    parser.add_argument("--shape", default="vllm,sglang", help="vllm, sglang or both")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument(
        "--before", metavar="REF", help="also measure the Lua scripts of git revision REF"
    )
    args = parser.parse_args(argv)
    server_proc = RedisServer(args.server)
    server_proc.start()
    results = []
    try:
        pid = server_proc.proc.pid if server_proc.proc is not None else None
        pinned = pid is not None and pin(pid)
        server = Server(server_proc.url, pid)
        server.calibrate()
        for shape in args.shape.split(","):
            r = run_shape(shape, server_proc.url, server, args.quick, args.seed, args.before)
            r.pinned = pinned
            r.server = args.server
            print_result(r)
            results.append(r)
        server.close()
    finally:
        server_proc.close()
    if args.json:
        write_json(args.json, [asdict(r) for r in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

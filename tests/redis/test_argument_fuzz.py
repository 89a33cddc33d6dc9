"""Every function of the ``kvredis`` library, called with hostile arguments, either answers or
fails with a documented ``KVREDIS_*`` error, never a raw Lua error, and a refused call changes
no key.

The calls start from real ones: a client fills a namespace and every call it sends is recorded,
reads in parts too (their later parts carry real stamps, data-parallel ranks and scores; the
cluster-only functions are built from the same namespace as a one-shard cluster would call
them). Each is then sent again mutated, by a seeded random generator: an argument or key
replaced by a hostile value (counts of ``"x"``, ``1e12``, ``inf``, ``nan``, ``-1``, numbers
with spaces or in hex, weights of ``"abc"``, blobs a byte too short or too long, long strings),
removed, duplicated, inserted, the call cut short or extended, the keys dropped, added or
swapped. Run on a fresh server of each kind (redis-server 7 and Valkey 9); the keyspace is put
back as it was after every call that wrote. ``KVREDIS_FUZZ_SEED`` and ``KVREDIS_FUZZ_CALLS``
(mutations per function) repeat or widen a run; the time is bounded by ``KVREDIS_FUZZ_SECONDS``.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis

from kvredis import (
    AddOp,
    Batch,
    EvictOp,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.redis import ops
from kvredis.redis.codec import hash_blob
from kvredis.redis.functions import FunctionRegistry, shipped_library
from kvredis.redis.layout import LAYOUT_VERSION, Layout
from kvredis.redis.requests import Arg, ScriptCall
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
SEED = int(os.environ.get("KVREDIS_FUZZ_SEED", "20240611"))
CALLS = int(os.environ.get("KVREDIS_FUZZ_CALLS", "70"))
SECONDS = float(os.environ.get("KVREDIS_FUZZ_SECONDS", "40"))

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
RANKED = PodEntry("pod-c", "gpu", False, True, 3, 2)
SPEC = PodEntry("pod-d", "gpu", speculative=True)

#: Server errors a call may meet that are not the library's own (docs/protocol.md, "Errors"): a
#: key of another type where the function expects a hash or a string.
SERVER_ERRORS = ("WRONGTYPE",)

HOSTILE: list[Arg] = [
    "", "x", "abc", "0", "1", "2", "3", "-1", "-0", "+1", "1.5", "0.5", "1e12", "1e308",
    "-1e308", "inf", "-inf", "nan", "NaN", "0x10", " 1", "1 ", "99999999999999999999",
    "2147483648", "4294967296", "9007199254740993", "A", "P", "R", "E", "s", "begin", "page",
    "end", "field", "key", "dropping:x", "gpu", "pod-a", "STALE", "\x00", b"\xff" * 7,
    b"\x00" * 8, b"\x01" * 9, b"\x00" * 16, b"\x00" * 4, b"\x00\x00\x00\x01", "x" * 5000,
    b"\x00\x00\x00\x05pod-a\x00\x00\x00\x03gpu\x00\x00\x00\x00\x00",
]  # fmt: skip


def documented_codes() -> set[str]:
    """The error codes of docs/protocol.md's table."""
    errors = DOC.read_text().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `KVREDIS_([A-Z_]+)` \|", errors, re.MULTILINE))


def error_text(reply: Any) -> str | None:
    """The text of an error reply (also one nested in an array), else None."""
    if isinstance(reply, redis.ResponseError):
        return str(reply)
    return None


def check_error(text: str, codes: set[str]) -> str | None:
    """What is wrong with an error reply's text, or None when it is a documented one."""
    head = text.split(" ", 1)[0]
    if head.startswith("KVREDIS_"):
        return None if head[len("KVREDIS_") :] in codes else f"undocumented code {head}"
    if head in SERVER_ERRORS:
        return None
    return f"raw error {text[:300]!r}"


#: The functions that reply each part's (shard's) error as a string.
PART_ERRORS = frozenset({"apply_shards", "apply_parts", "score_shards"})


def check_reply(name: str, reply: Any, codes: set[str]) -> str | None:
    """What is wrong with a normal reply: an error nested in it (``apply_shards`` returns each
    part's error as a string) must be a documented one too."""
    items = reply if isinstance(reply, list) else [reply]
    for item in items:
        nested = error_text(item)
        if nested is not None:
            problem = check_error(nested, codes)
            if problem:
                return problem
        if name in PART_ERRORS and isinstance(item, bytes) and item != b"STALE":
            text = item.decode("utf-8", "replace")
            if "non local key" not in text:
                problem = check_error(text, codes)
                if problem:
                    return f"part error: {problem}"
    return None


class Recorder(FunctionRegistry):
    """The client's registry, keeping every script call it turns into a command."""

    def __init__(self) -> None:
        super().__init__(use=True)
        self.calls: list[ScriptCall] = []

    def call_command(self, call: ScriptCall) -> Any:
        self.calls.append(call)
        return super().call_command(call)


def record_calls(
    server: RedisServer, client: redis.Redis, namespace: str
) -> tuple[list[ScriptCall], Layout, dict[bytes, tuple[bytes, int]]]:
    """Fill a namespace and record a call of every kind a client sends; returns the calls, the
    namespace's layout and the keyspace as it was before the recorded clears and drop."""
    config = RedisIndexConfig(address=server.url, namespace=namespace, bucket_bits=2)
    index = RedisIndex(config)
    recorder = Recorder()
    recorder.active = True
    index._session = type(index._session)(index._session.state, recorder, index._session.policy)
    chain = list(range(1000, 1040))
    engine = [k + 10**6 for k in chain]
    try:
        index.drop_namespace()  # the creation (kvredis_namespace) is recorded too
        index.add(engine, chain, [A, B])
        index.add(None, chain[:8], [RANKED])
        index.add(None, chain[:5], [SPEC], ttl=3600.0)
        index.apply_batch(
            [AddOp(None, (7, 8), (A,)), AddOp(engine[:2], (2000, 2001), (B,))],
            "stream-1",
            Watermark(1, 1),
        )
        index.apply_batch([EvictOp(7, KeyType.REQUEST, (A,))], "stream-1", Watermark(1, 2))
        index.apply_batches(
            [
                Batch(
                    [AddOp(engine[:3], tuple(chain[20:23]), (B,), chain[19])], "s2", Watermark(0, 1)
                ),
                Batch([EvictOp(engine[21], KeyType.ENGINE, (B,))], "s2", Watermark(0, 2)),
                Batch([AddOp(None, (3000,), (A,)), EvictOp(3000, KeyType.REQUEST, (A,))]),
            ]
        )
        index.evict(chain[3], KeyType.REQUEST, [A])
        index.evict(engine[9], KeyType.ENGINE, [B])
        index.lookup(chain)
        index.lookup(chain, {"pod-a", "pod-c"})
        index.score(chain, {"gpu": 1.0, "cpu": 0.5})
        index.score(chain, {"gpu": 0.3}, {"pod-b"})
        index.score_by_rank(chain, {"gpu": 1.0})
        # reads in parts: later parts carry (pod, rank)s, scores and stamps as a client sends
        # them (the speculative pod's stamps with a deadline)
        with (
            mock.patch.object(ops, "LOOKUP_KEYS_PER_CALL", 4),
            mock.patch.object(ops, "SCORE_KEYS_PER_CALL", 4),
        ):
            index.lookup(chain)
            index.score(chain, {"gpu": 1.0, "cpu": 0.5})
        index.get_request_key(engine[2])
        layout = index._session.state.layout
        calls = list(recorder.calls)
        snapshot = _snapshot(client)
        index.clear_entries("pod-c", device_tiers=["gpu"])
        index.clear("pod-a")
        calls += recorder.calls[len(calls) :]
        mark = len(recorder.calls)
        index.drop_namespace()
        calls += recorder.calls[mark:]
    finally:
        index.close()
    return calls, layout, snapshot


def hand_built(
    layout: Layout, chain: list[int], stamps: Sequence[Arg], slots: Sequence[Arg] = ()
) -> list[ScriptCall]:
    """The calls no single-server client sends: the cluster's per-node functions (with the
    namespace as their one shard), unmap, migrate and ping; ``stamps`` are the (pod id, stamp)
    pairs a recorded lookup carried, which a shard's part carries as well, ``slots`` the
    (pod id, rank, score, stamp) quadruples a recorded score carried."""
    names = (layout.meta, layout.pi, layout.pp, layout.sx)
    blob = hash_blob(chain)
    shard = (*names, layout.gen, layout.rprefix, layout.bucket_bits, 0, blob)
    carried = (*shard[:-1], hash_blob(chain[8:16]), "1", len(stamps) // 2, *stamps)
    writes = (layout.meta, layout.pe, layout.pi, layout.pp, layout.wm, layout.wp, layout.sx)
    program = ("1", b"\x00\x00\x00\x05pod-a\x00\x00\x00\x03gpu\x00\x00\x00\x00\x00", "1",
               "A", "1", "1", hash_blob([5, 6]), b"")  # fmt: skip
    part = (*writes, layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits, 0, 1, 1)
    apply_args = ("1024", "s-2", "1", "5", "ab12", str(len(part) + len(program)), *part, *program)
    meta_pi = (layout.meta, layout.pi, layout.sx, layout.mx)
    union = (*names, layout.gen, layout.rprefix, layout.bucket_bits, 0)
    scored = (*names, layout.gen, layout.rprefix, layout.bucket_bits)
    score_tail = ("0", "1", "gpu", "1.0", "0.5")
    cluster_part = (*part[:12], "s-2", "1", "5", "ab12", 1, 1, 1, 1, *program)
    moved = (*writes[:4], layout.sx, layout.mv)
    move_args = (layout.gen, layout.rprefix, layout.eprefix, layout.bucket_bits, "1024", "0",
                 "1", "pod-a", "", *program)  # fmt: skip
    engine = (chain[0] + 10**6).to_bytes(8, "big")
    mapping_args = (layout.gen, layout.eprefix, layout.bucket_bits, "1024", engine,
                    hash_blob(chain[:2]))  # fmt: skip
    return [
        ScriptCall(
            "lookup_union",
            names,
            ("1", "pod-a", blob, *union, 1, 41, "1", len(stamps) // 2, *stamps),
            read=True,
        ),
        ScriptCall("lookup_union", names, ("0", blob, *union, 3, 9, "0", "0"), read=True),
        ScriptCall("score_shards", names, ("1", 9, *scored, "0", "0", *score_tail, blob), True),
        ScriptCall(
            "score_shards",
            names,
            ("1", 9 + len(slots), *scored, "1", len(slots) // 4, *slots, *score_tail, blob),
            read=True,
        ),
        ScriptCall("apply_parts", writes, ("1024", len(cluster_part), *cluster_part)),
        ScriptCall("move_pairs", moved, move_args),
        ScriptCall("move_mappings", (layout.meta,), mapping_args),

        ScriptCall("lookup_shards", names, ("1", "pod-a", *shard, "0", "0", *carried), read=True),
        ScriptCall("apply_shards", writes, apply_args),
        ScriptCall(
            "unmap",
            (layout.meta,),
            (
                layout.gen,
                layout.eprefix,
                layout.bucket_bits,
                hash_blob([chain[0] + 10**6]),
                hash_blob([chain[0]]),
            ),
        ),
        ScriptCall(
            "migrate",
            meta_pi,
            ("begin", "kvredis-kvblock/1", LAYOUT_VERSION, "g1", "key", layout.rprefix, "10"),
        ),
        ScriptCall("migrate", meta_pi, ("page", layout.gen, layout.rprefix, "2", "10")),
        ScriptCall("ping", (), (), read=True),
    ]


def carried_parts(calls: Sequence[ScriptCall]) -> tuple[list[Arg], list[Arg]]:
    """The tails of the recorded later parts of a read in parts: a lookup's carried (pod id,
    stamp) pairs and a score's carried (pod id, rank, score, stamp) quadruples."""
    stamps: list[Arg] = []
    slots: list[Arg] = []
    for call in calls:
        args = list(call.args)
        if call.script == "lookup" and int(args[4]) == 0 and int(args[7]) > 0:
            stamps = args[8:]  # gen, rprefix, bits, known, f = 0, chain, more, c, pairs
        elif call.script == "score" and int(args[3]) == 0:
            at = 5 + 2 * int(args[4]) + 2  # the default weight, the chain, then more, c
            if int(args[at + 1]) > 0:
                slots = args[at + 2 :]
    return stamps, slots


class Mutator:
    """Seeded mutations of a call's keys and arguments."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def value(self, old: Arg | None) -> Arg:
        rng = self.rng
        roll = rng.random()
        if old is not None and roll < 0.25:
            raw = old if isinstance(old, bytes) else str(old).encode()
            if raw and rng.random() < 0.5:
                return raw[: rng.randrange(len(raw))]  # cut short
            return raw + rng.choice([b"\x00", b"x", b"\x00" * 7, raw])  # made longer
        if roll < 0.35:
            return str(rng.choice([-(2**31), -2, 2**24, 2**31, 2**53, 10**15, rng.randrange(64)]))
        return rng.choice(HOSTILE)

    def mutate(self, keys: list[Arg], args: list[Arg]) -> tuple[list[Arg], list[Arg], str]:
        rng = self.rng
        kind = rng.choice(
            ["replace"] * 6 + ["delete", "insert", "cut", "extend", "duplicate", "key", "keys"]
        )
        if kind == "replace" and args:
            i = rng.randrange(len(args))
            args[i] = self.value(args[i])
            return keys, args, f"ARGV[{i + 1}] = {args[i]!r:.60}"
        if kind == "delete" and args:
            i = rng.randrange(len(args))
            del args[i]
            return keys, args, f"ARGV[{i + 1}] removed"
        if kind == "insert":
            i = rng.randrange(len(args) + 1)
            args.insert(i, self.value(None))
            return keys, args, f"ARGV[{i + 1}] inserted {args[i]!r:.60}"
        if kind == "cut" and args:
            n = rng.randrange(len(args))
            return keys, args[:n], f"ARGV cut to {n}"
        if kind == "duplicate" and args:
            i = rng.randrange(len(args))
            args.insert(i, args[i])
            return keys, args, f"ARGV[{i + 1}] duplicated"
        if kind == "key" and keys:
            i = rng.randrange(len(keys))
            keys[i] = rng.choice([*keys, "", "x", self.value(keys[i])])
            return keys, args, f"KEYS[{i + 1}] = {keys[i]!r:.60}"
        if kind == "keys":
            roll = rng.random()
            if roll < 0.3:
                return [], args, "no KEYS"
            if roll < 0.6 and keys:
                n = rng.randrange(len(keys))
                return keys[:n], args, f"KEYS cut to {n}"
            return [*keys, *rng.choice([[b"x"], keys, [b"x"] * 9000])], args, "KEYS extended"
        extra = [self.value(None) for _ in range(rng.randrange(1, 4))]
        return keys, [*args, *extra], f"ARGV extended by {len(extra)}"


def _dirty(client: redis.Redis) -> int:
    return int(client.info("persistence")["rdb_changes_since_last_save"])


def _snapshot(client: redis.Redis) -> dict[bytes, tuple[bytes, int]]:
    return {key: (client.dump(key), client.pttl(key)) for key in client.scan_iter(count=1000)}


def _restore(client: redis.Redis, snapshot: dict[bytes, tuple[bytes, int]]) -> None:
    client.flushdb()
    for key, (dumped, ttl) in snapshot.items():
        client.restore(key, max(ttl, 0), dumped)


#: A call still running after this many seconds is a finding too (a loop the arguments drive).
CALL_SECONDS = 5.0


@pytest.fixture
def client(own_redis_server: RedisServer) -> Iterator[redis.Redis]:
    raw = redis.Redis(port=own_redis_server.port, socket_timeout=CALL_SECONDS)
    yield raw
    raw.close()


def _stop_running_call(server: RedisServer) -> None:
    """Kill a call that runs too long (a read-only one can be killed; else the server is shut
    down, and the test fails anyway)."""
    other = redis.Redis(port=server.port, socket_timeout=30)
    try:
        for kill in (("FUNCTION", "KILL"), ("SCRIPT", "KILL")):
            with contextlib.suppress(redis.ResponseError):
                other.execute_command(*kill)
    finally:
        other.close()


def test_every_function_answers_or_fails_with_a_documented_error(
    own_redis_server: RedisServer, client: redis.Redis
) -> None:
    namespace = f"kvt-{uuid.uuid4().hex[:8]}"
    recorded, layout, snapshot = record_calls(own_redis_server, client, namespace)
    _restore(client, snapshot)
    baseline: dict[str, list[ScriptCall]] = {}
    stamps, slots = carried_parts(recorded)
    assert stamps and slots, "the recorded reads in parts carried stamps"
    assert {int(slots[i]) for i in range(1, len(slots), 4)} > {0}, "and data-parallel ranks"
    assert any(b"@" in bytes(s) and not bytes(s).endswith(b"@") for s in stamps[1::2])  # deadlines
    for call in [*recorded, *hand_built(layout, list(range(1000, 1040)), stamps, slots)]:
        baseline.setdefault(call.script, []).append(call)
    library = shipped_library()
    assert set(baseline) == set(library.reads), set(library.reads) ^ set(baseline)
    registry = FunctionRegistry(use=True)
    registry.active = True
    for name in registry.names():
        client.execute_command(*registry.script_load_command(name).args)
    codes = documented_codes()
    rng = random.Random(SEED)
    mutate = Mutator(rng)
    problems: list[str] = []
    sent = 0
    deadline = time.monotonic() + SECONDS
    stuck = False
    for _ in range(CALLS):
        if time.monotonic() > deadline or stuck or len(problems) > 40:
            break
        for name in sorted(baseline):
            original = rng.choice(baseline[name])
            keys, args, what = mutate.mutate(list(original.keys), list(original.args))
            call = ScriptCall(name, keys, args, original.read)
            command = list(registry.call_command(call).args)
            roll = rng.random()
            if roll < 0.25:  # the same through EVALSHA, the scripts' own path
                command = list(registry.evalsha_command(call).args)
            elif roll < 0.3:  # another protocol version, or none: KVREDIS_VERSION
                command[-1:] = rng.choice([[], ["kvredis-api:1"], ["kvredis-api:99"], [""]])
                what += f", version argument {command[-1]!r:.20}"
            before = _dirty(client)
            problem: str | None = None
            if os.environ.get("KVREDIS_FUZZ_TRACE"):
                print(name, command[0], what, flush=True)
            try:
                reply: Any = client.execute_command(*command)
            except redis.TimeoutError:
                stuck = True
            except redis.ResponseError as exc:
                stuck = str(exc).startswith("BUSY")  # the client sent it again, while it runs
                problem = None if stuck else check_error(str(exc), codes)
                if problem is None and not stuck and _dirty(client) != before:
                    problem = "a refused call changed keys"
            else:
                problem = check_reply(name, reply, codes)
                if _dirty(client) != before:
                    _restore(client, snapshot)
            sent += 1
            if stuck:
                _stop_running_call(own_redis_server)
                problems.append(f"{name} ({command[0]}, {what}): ran over {CALL_SECONDS} s")
                break
            if problem:
                problems.append(f"{name} ({command[0]}, {what}): {problem}")
    assert not problems, f"seed {SEED}, {sent} calls:\n" + "\n".join(sorted(set(problems)))
    assert stuck or sent >= min(CALLS, 5) * len(baseline), sent


def _score_args(layout: Layout, count: Arg, weight: Arg, default: Arg) -> list[Arg]:
    return [layout.gen, layout.rprefix, layout.bucket_bits, "0", count, "gpu", weight, default,
            hash_blob([1, 2, 3, 4])]  # fmt: skip


#: (weight count, weight, weight of an unlisted tier) of a score call, each refused
BAD_WEIGHTS: list[tuple[Arg, Arg, Arg]] = [
    *((count, "1.0", "1.0") for count in ("x", "1e12", "inf", "nan", "-1", "1.5", "", " 1",
                                          "0x1", "2", "99999999999999999999")),
    *((1, weight, "1.0") for weight in ("abc", "", "nan", "inf", "-inf", "1e400", "0x10",
                                        " 1", "1,5")),
    (1, "1.0", "abc"),
    (1, "1.0", "inf"),
]  # fmt: skip


@pytest.mark.parametrize("path", ["FCALL_RO", "EVALSHA"])
def test_score_weights_are_checked_whole(
    own_redis_server: RedisServer, client: redis.Redis, path: str
) -> None:
    """A weight count of "x", 1e12, inf, nan or -1 and a weight of "abc" are KVREDIS_INVALID
    (before: a raw Lua error, or "abc" silently scored as the default weight)."""
    config = RedisIndexConfig(address=own_redis_server.url, namespace=f"kvt-{uuid.uuid4().hex}")
    with RedisIndex(config) as index:
        index.add(None, [1, 2, 3, 4], [A])
        layout = index._session.state.layout
    keys = [layout.meta, layout.pi, layout.pp, layout.sx]
    registry = FunctionRegistry(use=True)
    registry.active = path == "FCALL_RO"

    def send(args: list[Arg]) -> Any:
        command = registry.call_command(ScriptCall("score", keys, args, read=True))
        try:
            return client.execute_command(*command.args)
        except redis.exceptions.NoScriptError:
            client.execute_command(*registry.script_load_command("score").args)
            return client.execute_command(*command.args)

    if path == "FCALL_RO":
        client.function_load(shipped_library().code.decode(), replace=True)
    reply = send(_score_args(layout, 1, "0.5", "1.0"))
    assert reply[2:] == [b"pod-a", 0, b"2", 1, b""]  # the valid call: 4 keys of weight 0.5
    assert send(_score_args(layout, 1, "-0.25", "1.0"))[4] == b"-1"  # negative weights are valid
    for count, weight, default in BAD_WEIGHTS:
        with pytest.raises(redis.ResponseError, match=r"^KVREDIS_INVALID ") as caught:
            send(_score_args(layout, count, weight, default))
        assert "script:" in str(caught.value) or path == "FCALL_RO"

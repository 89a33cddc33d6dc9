"""Hardening figures, before and after: wrong answers, lost data, failover ride-out, longest
script call (SLOWLOG) and leftover definitions, for a base commit and for this checkout.

Each side runs in its own process against its own fresh redis-server (or valkey-server with
``--server valkey``): the base commit's ``kvredis`` is unpacked from git (``git archive``) into a
temporary folder and put first on ``PYTHONPATH``; the figures are printed side by side.

Run:  .venv/bin/python scripts/bench_hardening.py [--base main] [--quick] [--steps 8,8b]
          [--json PATH]
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import redis

from _bench import REPO, RedisServer, bench_parser, write_json

#: Set in the child process that measures the base commit: where its tree was unpacked.
BASE_VARIABLE = "KVREDIS_BENCH_BASE"


def _cfg(url: str, **kwargs: Any) -> Any:
    from kvredis import RedisIndexConfig

    base: dict[str, Any] = {"address": url, "namespace": f"kvb-{uuid.uuid4().hex[:10]}"}
    return RedisIndexConfig(**(base | kwargs))


def drop_nested(url: str) -> int:
    """1: keys of namespace ``<x>:prod`` deleted by ``drop_namespace()`` of ``<x>``."""
    from kvredis import PodEntry, RedisIndex

    try:
        from kvredis.redis.config import config_for_existing
    except ImportError:  # a release that still opened any name

        def config_for_existing(config: Any, namespace: str) -> Any:
            return _cfg(config.address, namespace=namespace)

    root = f"kvb-{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(url)
    with (
        RedisIndex(_cfg(url, namespace=root)) as one,
        # a name only an earlier release created (refused for new namespaces since)
        RedisIndex(config_for_existing(_cfg(url), root + ":prod")) as other,
    ):
        for idx in (one, other):
            idx.add([1, 2], [10, 20], [PodEntry("pod-a", "gpu")])
        before = len(list(raw.scan_iter(match=root + ":prod:*")))
        one.drop_namespace()
        after = len(list(raw.scan_iter(match=root + ":prod:*")))
        other.drop_namespace()
    raw.close()
    return before - after


def drop_race(url: str, trials: int) -> dict[str, int]:
    """2: lookups after a drop racing three writers that returned a wrong entry (or raised)."""
    from tests.redis.test_drop import _race_trial

    wrong = [len(_race_trial(url)) for _ in range(trials)]
    return {"trials": trials, "trials_wrong": sum(1 for w in wrong if w), "wrong": sum(wrong)}


def lost_meta(url: str) -> int:
    """3: lookups of 50 present keys that fail or miss after ``DEL <ns>:meta``."""
    from kvredis import KVRedisError, PodEntry, RedisIndex

    cfg = _cfg(url)
    raw = redis.Redis.from_url(url)
    bad = 0
    with RedisIndex(cfg) as index:
        for k in range(50):
            index.add(None, [k], [PodEntry(f"pod-{k}", "gpu")])
        raw.delete(f"{cfg.namespace}:meta")
        with RedisIndex(cfg) as fresh:
            for k in range(50):
                try:
                    bad += fresh.lookup([k]) != {k: [PodEntry(f"pod-{k}", "gpu")]}
                except KVRedisError:
                    bad += 1
        index.drop_namespace()
    raw.close()
    return bad


def half_applied(url: str) -> int:
    """4: request keys written by a batch that failed on a foreign key (watermark not moved)."""
    from kvredis import AddOp, KVRedisError, PodEntry, RedisIndex, Watermark

    cfg = _cfg(url)
    raw = redis.Redis.from_url(url)
    with RedisIndex(cfg) as index:
        bucket = f"{cfg.namespace}:r:".encode() + (77).to_bytes(2, "big")
        raw.set(bucket, "foreign")
        batch = [AddOp(None, (k,), (PodEntry("pod-a", "gpu"),)) for k in range(1, 11)]
        batch.append(AddOp(None, (77,), (PodEntry("pod-a", "gpu"),)))
        with contextlib.suppress(KVRedisError):
            index.apply_batch(batch, "s", Watermark(1, 1))
        raw.delete(bucket)
        written = len(index.lookup(list(range(1, 11))))
        index.drop_namespace()
    raw.close()
    return written


def lost_reply(url: str) -> bool:
    """5: what ``apply_batch`` returns when the reply to its first attempt was lost."""
    from kvredis import AddOp, PodEntry, RedisIndex, Watermark
    from tests.servers import Proxy

    proxy = Proxy(int(url.rsplit(":", 1)[1]))
    try:
        cfg = _cfg(proxy.url, retries=3, retry_backoff=0.01)
        with RedisIndex(cfg) as index:
            proxy.lose_next_reply(b"stream-lost")
            batch = [AddOp(None, (1,), (PodEntry("pod-a", "gpu"),))]
            applied = bool(index.apply_batch(batch, "stream-lost", Watermark(1, 1)))
            index.drop_namespace()
        return applied
    finally:
        proxy.close()


def failover(kind: str) -> dict[str, Any]:
    """7: longest add call while the primary is demoted and its replica promoted."""
    from tests.redis.failover import failover_ride_out

    server = RedisServer(kind)
    server.start()
    try:
        longest, errors, missing = failover_ride_out(server)
        return {"longest_s": round(longest, 3), "errors": len(errors), "acked_missing": missing}
    except Exception as exc:
        return {"failed": repr(exc)[:200]}
    finally:
        server.close()


#: An index operation of a longest-call case (``index`` -> anything).
Step = Callable[[Any], object]


def slowlog(url: str, scale: float) -> dict[str, Any]:
    """8: the longest script call (SLOWLOG, microseconds) of each oversized operation."""
    from kvredis import AddOp, PodEntry, Watermark

    entry = PodEntry("pod-a", "gpu")
    n = int(100_000 * scale)
    cases: dict[str, Step] = {
        f"add {n} request keys under one engine key": lambda i: i.add(
            [7], list(range(1, n + 1)), [entry]
        ),
        f"apply_batch of {int(60_000 * scale)} ops": lambda i: i.apply_batch(
            [AddOp((k + 1_000_000,), (k,), (entry,)) for k in range(1, int(60_000 * scale) + 1)],
            "s",
            Watermark(1, 1),
        ),
        f"add {n} engine/request key pairs (a ~4.8 MB BlockStored)": lambda i: i.add(
            list(range(10**9, 10**9 + n)), list(range(1, n + 1)), [entry]
        ),
    }
    return longest_calls(url, {name: (None, run) for name, run in cases.items()})


def fragmented_runs(url: str, scale: float) -> dict[str, Any]:
    """8b: the longest script call of writes and walks into fragmented chain runs. Each chain
    is 1024 new request keys added by one event (one full run on the runs layout); then every
    other key of it is evicted (512 holes, 1024 ranges). A write that reaches a key in a run
    rewrites that run whole, and a walk parses it whole, so the worst call touches one key in
    each of as many such runs as one call takes."""
    from kvredis import EvictOp, KeyType, PodEntry

    pod_a, pod_b, pod_c = (PodEntry(f"pod-{x}", "gpu") for x in "abc")
    n = max(2, int(1000 * scale))
    chains = [[(c << 20) + k for k in range(1, 1025)] for c in range(1, n + 1)]

    def fragmented(count: int) -> Step:
        def setup(index: Any) -> None:
            for chain in chains[:count]:
                index.add(None, chain, [pod_a])
            evicts = [k for chain in chains[:count] for k in chain[1::2]]
            index.apply_batch([EvictOp(k, KeyType.REQUEST, (pod_a,)) for k in evicts])

        return setup

    def mapped(count: int) -> Step:
        def setup(index: Any) -> None:
            fragmented(count)(index)
            index.add([7 << 60], [chain[4] for chain in chains[:count]], [pod_b])

        return setup

    cases: dict[str, tuple[Step | None, Step]] = {
        "add a pod to every 3rd key of a fragmented 1024-key chain": (
            fragmented(1),
            lambda i: i.add(None, chains[0][::3], [pod_b]),
        ),
        f"add a pod to one held key in each of {n} fragmented chains": (
            fragmented(n),
            lambda i: i.add(None, [chain[4] for chain in chains], [pod_c]),
        ),
        f"evict one key in each of {n} fragmented chains (apply_batch)": (
            fragmented(n),
            lambda i: i.apply_batch(
                [EvictOp(chain[8], KeyType.REQUEST, (pod_a,)) for chain in chains]
            ),
        ),
        f"evict by one engine key mapped to a held key in each of {n} fragmented chains": (
            mapped(n),
            lambda i: i.evict(7 << 60, KeyType.ENGINE, [pod_a]),
        ),
        f"lookup of one held key in each of {n} fragmented chains": (
            fragmented(n),
            lambda i: i.lookup([chain[4] for chain in chains]),
        ),
        f"score of one held key in each of {n} fragmented chains": (
            fragmented(n),
            lambda i: i.score([chain[4] for chain in chains]),
        ),
    }
    return longest_calls(url, cases)


def long_scores(url: str, quick: bool) -> dict[str, Any]:
    """8c: the longest script call of a score over a long chain every key of which two pods
    hold (8,192 keys: a 128k-token prompt), without and with an expiring entry live elsewhere
    in the namespace (then every key of the walk also reads its expiring bucket); the lookup of
    the same chain for reference."""
    from kvredis import PodEntry

    pods = [PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")]
    spec = PodEntry("pod-s", "gpu", speculative=True)
    sizes = (8192, 65536) if quick else (8192, 65536, 200_000)
    cases: dict[str, tuple[Step | None, Step]] = {}
    for n in sizes:
        chain = list(range(1, n + 1))

        def held(index: Any, chain: list[int] = chain) -> None:
            index.add(None, chain, pods)

        def held_and_expiring(index: Any, chain: list[int] = chain) -> None:
            held(index, chain)
            index.add(None, [10**12], [spec], ttl=600)

        def score(index: Any, chain: list[int] = chain) -> object:
            return index.score(chain, {"gpu": 1.0, "cpu": 0.5})

        def lookup(index: Any, chain: list[int] = chain) -> object:
            return index.lookup(chain)

        expiring = "an expiring entry live elsewhere"
        cases[f"score of a {n}-key chain"] = (held, score)
        cases[f"score of a {n}-key chain, {expiring}"] = (held_and_expiring, score)
        cases[f"lookup of a {n}-key chain, {expiring}"] = (held_and_expiring, lookup)
    return longest_calls(url, cases)


def longest_calls(url: str, cases: dict[str, tuple[Step | None, Step]]) -> dict[str, Any]:
    """Per case, on a fresh namespace: ``setup(index)``, then ``run(index)``; the longest
    EVALSHA of ``run`` (SLOWLOG, µs) and its wall time."""
    from kvredis import RedisIndex

    raw = redis.Redis.from_url(url)
    raw.config_set("slowlog-max-len", 100000)
    out: dict[str, Any] = {}
    for name, (setup, run) in cases.items():
        cfg = _cfg(url, socket_timeout=60.0, retries=0)
        with RedisIndex(cfg) as index:
            if setup is not None:
                setup(index)
            raw.config_set("slowlog-log-slower-than", 0)
            raw.slowlog_reset()
            start = time.perf_counter()
            error = None
            try:
                run(index)
            except Exception as exc:
                error = repr(exc)[:120]
            wall = time.perf_counter() - start
            longest = max(
                (e["duration"] for e in raw.slowlog_get(100000) if b"EVALSHA" in _command(e)),
                default=0,
            )
            raw.config_set("slowlog-log-slower-than", 10000)
            out[name] = {"longest_call_us": longest, "wall_s": round(wall, 3)}
            if error:
                out[name]["error"] = error
            index.drop_namespace()
    raw.close()
    return out


def _command(entry: dict[str, Any]) -> bytes:
    command = entry.get("command", b"")
    return command if isinstance(command, bytes) else str(command).encode()


def leftover_definitions(url: str, pods: int) -> int:
    """11: entry definitions left after ``pods`` pods were added and cleared."""
    from kvredis import PodEntry, RedisIndex

    cfg = _cfg(url)
    raw = redis.Redis.from_url(url)
    with RedisIndex(cfg) as index:
        for i in range(pods):
            index.add(None, [i], [PodEntry(f"pod-{i}", "gpu")])
        for i in range(pods):
            index.clear(f"pod-{i}")
        left = sum(1 for k in raw.hkeys(f"{cfg.namespace}:pi") if len(k) == 4)
        index.drop_namespace()
    raw.close()
    return left


def clear_race(url: str, seconds: float) -> dict[str, int]:
    """12: a clear of pod P racing adds of P (issue #21, 1): one client clears P over and over
    while another adds P (with an engine key) at keys 1..50 in turn, for ``seconds``; then one
    more clear. Counted afterwards: keys whose lookup is a hit without entries (unreadable) or
    any hit at all (P is cleared, nothing else was there), mappings left, lookups during the run
    that returned a hit without entries."""
    import threading

    from kvredis import EngineKeyNotFoundError, PodEntry, RedisIndex

    cfg = _cfg(url)
    p, q = PodEntry("pod-p", "gpu"), PodEntry("pod-q", "gpu")
    keys = list(range(1, 51))
    stop = threading.Event()
    counts = {"clears": 0, "adds": 0, "reads": 0, "empty reads": 0}
    with RedisIndex(cfg) as index, RedisIndex(cfg) as other, RedisIndex(cfg) as reader:
        index.add(None, [10**6], [q])

        def clears() -> None:
            while not stop.is_set():
                index.clear("pod-p")
                counts["clears"] += 1

        def adds() -> None:
            i = 0
            while not stop.is_set():
                key = keys[i % len(keys)]
                other.add([key + 10**9], [key], [p])
                counts["adds"] += 1
                i += 1

        def reads() -> None:
            i = 0
            while not stop.is_set():
                found = reader.lookup([keys[i % len(keys)], 10**6])
                counts["reads"] += 1
                counts["empty reads"] += sum(1 for v in found.values() if not v)
                i += 1

        threads = [threading.Thread(target=f) for f in (clears, adds, reads)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        index.clear("pod-p")
        found = {k: v for key in keys for k, v in index.lookup([key]).items()}
        mapped = 0
        for key in keys:
            try:
                index.get_request_key(key + 10**9)
                mapped += 1
            except EngineKeyNotFoundError:
                pass
        index.drop_namespace()
    return {
        **counts,
        "unreadable keys": sum(1 for v in found.values() if not v),
        "keys hit after the last clear": len(found),
        "mappings left": mapped,
    }


def expiring_holders(url: str, keys: int) -> dict[str, int]:
    """13: engine mappings dropped while a live expiring entry holds their request key (issue
    #21, 2), of ``keys`` by ``clear("a")`` and as many by evict by engine key; InMemoryIndex
    keeps them all. Each key: ``add([e], [k], [a@gpu or c@gpu])``, then ``add(None, [k],
    [b speculative], ttl=600)``."""
    from kvredis import EngineKeyNotFoundError, KeyType, PodEntry, RedisIndex

    a, c = PodEntry("a", "gpu"), PodEntry("c", "gpu")
    b = PodEntry("b", "gpu", speculative=True)
    out = {"dropped by clear": 0, "dropped by evict": 0}
    with RedisIndex(_cfg(url)) as index:
        for k in range(1, 2 * keys + 1):
            index.add([k + 10**9], [k], [a if k <= keys else c])
            index.add(None, [k], [b], ttl=600)
        index.clear("a")
        for k in range(keys + 1, 2 * keys + 1):
            index.evict(k + 10**9, KeyType.ENGINE, [c])
        for k in range(1, 2 * keys + 1):
            try:
                index.get_request_key(k + 10**9)
            except EngineKeyNotFoundError:
                out["dropped by clear" if k <= keys else "dropped by evict"] += 1
        index.drop_namespace()
    return out


def hot_paths(url: str, calls: int) -> dict[str, Any]:
    """Redis CPU (µs per call, from INFO commandstats) and commands per call of the hot paths."""
    import random

    from kvredis import AddOp, KeyType, PodEntry, RedisIndex, Watermark

    raw = redis.Redis.from_url(url)
    rng = random.Random(7)
    pods = [PodEntry(f"pod-{p}", t) for p in range(4) for t in ("gpu", "cpu")]
    chain = [rng.getrandbits(64) for _ in range(512)]
    out: dict[str, Any] = {}
    with RedisIndex(_cfg(url)) as index:
        index.add(None, chain, pods)
        seq = iter(range(1, 10**9))
        cases: dict[str, Callable[[], object]] = {
            "lookup 512 blocks x 8 entries": lambda: index.lookup(chain),
            "lookup, miss at block 16": lambda: index.lookup([*chain[:16], 1, *chain[16:]]),
            "score 512 blocks": lambda: index.score(chain),
            "add 64-block event": lambda: index.add(
                [rng.getrandbits(64) for _ in range(64)],
                [rng.getrandbits(64) for _ in range(64)],
                pods[:1],
            ),
            "apply_batch of 16 ops": lambda: index.apply_batch(
                [AddOp(None, (rng.getrandbits(64),), tuple(pods[:1])) for _ in range(16)],
                "s",
                Watermark(1, next(seq)),
            ),
            "evict by engine key": lambda: index.evict(
                rng.getrandbits(64), KeyType.ENGINE, pods[:1]
            ),
        }
        for name, run in cases.items():
            run()
            raw.config_resetstat()
            for _ in range(calls):
                run()
            stats = raw.info("commandstats")
            calls_of = ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_fcall_ro")  # either path
            script_usec = sum(stats.get(name, {}).get("usec", 0) for name in calls_of)
            sent = sum(
                v["calls"]
                for k, v in stats.items()
                if not k.startswith(("cmdstat_info", "cmdstat_config"))
            )
            out[name] = {
                "redis_us_per_call": round(script_usec / calls, 1),
                "commands_per_call": round(sent / calls, 2),
            }
        index.drop_namespace()
    raw.close()
    return out


def measure(kind: str, quick: bool, only: set[str] | None = None) -> dict[str, Any]:
    """Every figure (those whose number is in ``only``, when given), on one side (the
    ``kvredis`` this process imports)."""
    server = RedisServer(kind)
    server.start()
    url = server.url
    steps: dict[str, Callable[[], Any]] = {
        "1 keys of <ns>:prod deleted by drop of <ns>": lambda: drop_nested(url),
        "2 drop racing writers: wrong answers": lambda: drop_race(url, 3 if quick else 8),
        "3 lookups failing after DEL <ns>:meta (of 50)": lambda: lost_meta(url),
        "4 request keys written by a failed batch (of 10)": lambda: half_applied(url),
        "5 apply_batch result after a lost reply": lambda: lost_reply(url),
        "7 failover ride-out": lambda: failover(kind),
        "8 longest script call": lambda: slowlog(url, 0.2 if quick else 1.0),
        "8b longest script call, fragmented runs": lambda: fragmented_runs(
            url, 0.2 if quick else 1.0
        ),
        "8c longest script call, score of a long chain": lambda: long_scores(url, quick),
        "11 definitions left after N pods cleared": lambda: leftover_definitions(
            url, 200 if quick else 2000
        ),
        "12 clear racing adds of its pod": lambda: clear_race(url, 3.0 if quick else 10.0),
        "13 mappings dropped while an expiring entry holds the key": lambda: expiring_holders(
            url, 50 if quick else 200
        ),
        "hot paths": lambda: hot_paths(url, 200 if quick else 1000),
    }
    out: dict[str, Any] = {}
    try:
        for name, step in steps.items():
            if only and name.split()[0] not in only:
                continue
            try:
                out[name] = step()
            except Exception:
                out[name] = {"failed": traceback.format_exc(limit=2)[-300:]}
    finally:
        server.close()
    return out


def _side(pythonpath: str | None, kind: str, quick: bool, only: str) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop(BASE_VARIABLE, None)
    if pythonpath:
        env[BASE_VARIABLE] = pythonpath
    args = [sys.executable, __file__, "--child", "--server", kind, "--steps", only]
    args += ["--quick"] if quick else []
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False, cwd=REPO)
    if done.returncode != 0:
        return {"failed": done.stderr[-500:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "smaller inputs and fewer trials (about a minute)")
    parser.add_argument("--base", default="main", help="git revision of the 'before' side")
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument(
        "--steps", default="", help='comma-separated step numbers (e.g. "8,8b"; default: all)'
    )
    parser.add_argument("--child", action="store_true", help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        base = os.environ.get(BASE_VARIABLE)
        if base:  # the base commit's kvredis, ahead of this checkout's
            sys.path.insert(0, base)
        only = {s for s in args.steps.split(",") if s}
        print(json.dumps(measure(args.server, args.quick, only)))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvredis-base-") as base:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.base], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", base], input=archive.stdout, check=True)
        before = _side(base, args.server, args.quick, args.steps)
    after = _side(None, args.server, args.quick, args.steps)
    print(f"{args.server}: before = {args.base}, after = this checkout")
    for name in after:
        print(f"{name}\n  before: {before.get(name)}\n  after:  {after.get(name)}")
    if args.json:
        write_json(args.json, {"server": args.server, "before": before, "after": after})
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())

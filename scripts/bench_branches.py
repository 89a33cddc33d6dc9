"""Branches inside index blocks: an SGLang fleet's index against what its pods hold, before/after.

A fleet of SGLang pods (page size ``--page``, default 1) serves requests that share system
prompts of arbitrary length and continue earlier conversations; each pod's radix cache (the model
in ``kvredis/testing/radix.py``: node splits publish nothing, leaves evict first) publishes its
events, one batch per request, into an ingester on an in-memory index with 16-token blocks.
Printed, for this checkout ("after") and for the kvredis tree of ``--before``:

* wrong pairs: (request key, pod) pairs the index holds that no router computes for what the
  pod holds, as a share of the pairs held;
* low scores: (request, pod) scores below the blocks the pod holds for the request;
* parent misses counted;
* the ingester's per-pod state for partial blocks: pages remembered and bytes per page (deep
  size of the chain ends and pages inside blocks it keeps, shared objects counted once, token
  ints included);
* the index's engine mappings (pages, and the boundary keys of pages ending a block), or with
  ``--redis`` the growth of the server's ``used_memory``, and the time the ingester took (one
  thread).

    .venv/bin/python scripts/bench_branches.py [--before REF] [--page N] [--redis [--url URL]]
        [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _bench import REPO, bench_parser, redis_server, write_json

MODEL = "base-model"
BLOCK = 16


def fleet(page: int, requests: int, seed: int = 1) -> list[tuple[str, list[Any], Any]]:
    """The fleet's batches in order: ``(pod, events, caches)`` (``caches`` as after them)."""
    radix = _this_checkouts("radix")
    rng = random.Random(seed)
    pods = [f"pod-{i}" for i in range(4)]
    caches = {pod: radix.RadixCache(page) for pod in pods}
    fresh = iter(range(10_000, 10**9))
    systems = [tuple(next(fresh) for _ in range(rng.randint(20, 300))) for _ in range(8)]
    history: list[tuple[int, ...]] = []
    out = []
    for _ in range(requests):
        # A conversation goes on, or a new one starts from a system prompt.
        prompt = rng.choice(history) if history and rng.random() < 0.4 else rng.choice(systems)
        tokens = prompt + tuple(next(fresh) for _ in range(rng.randint(10, 200)))
        history.append(tokens)
        pod = rng.choice(pods)
        cache = caches[pod]
        cache.insert(tokens)
        while sum(len(p) for p in cache.held()) > 6000:  # the pod's KV budget: evict leaves
            cache.evict(rng.choice(cache.leaves()))
        out.append((pod, cache.take(), caches))
    return out


def _load(name: str, path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _this_checkouts(module: str) -> Any:
    """This checkout's ``kvredis.testing.<module>`` (the engines' wire shapes, the SGLang radix
    model), loaded from its file: a child measuring an older tree imports that tree's
    ``kvredis``, which may have neither. The radix model finds the wire shapes under their
    usual name."""
    wire = _load("kvredis_bench_wire", REPO / "kvredis" / "testing" / "wire.py")
    if module == "wire":
        return wire
    try:
        import kvredis.testing.wire  # noqa: F401
    except ImportError:
        sys.modules["kvredis.testing.wire"] = wire
    return _load(f"kvredis_bench_{module}", REPO / "kvredis" / "testing" / f"{module}.py")


def deep_size(obj: object, seen: set[int]) -> int:
    """Bytes of ``obj`` and what it refers to (containers, dataclass slots), each object once."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in obj.items())
    elif isinstance(obj, tuple | list):
        size += sum(deep_size(v, seen) for v in obj)
    elif hasattr(obj, "__slots__"):
        size += sum(deep_size(getattr(obj, s), seen) for s in obj.__slots__ if hasattr(obj, s))
    return size


def child(tree: str, page: int, requests: int, url: str | None) -> dict[str, Any]:
    sys.path.insert(0, tree)  # that tree's kvredis, ahead of this checkout's
    sys.path.insert(1, str(REPO))  # this checkout's tests (the radix model, the wire shapes)
    import kvredis

    assert Path(kvredis.__file__).resolve().is_relative_to(Path(tree).resolve()), kvredis.__file__
    from kvredis.batch import AddOp
    from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
    from kvredis.ingest import EventIngester
    from kvredis.memory import InMemoryIndex

    wire = _this_checkouts("wire")
    tp = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=BLOCK))
    index: Any = InMemoryIndex()
    server: Any = None
    if url is not None:
        import redis

        from kvredis.redis import RedisIndex, RedisIndexConfig

        index = RedisIndex(RedisIndexConfig(address=url, namespace=f"bb-{uuid.uuid4().hex[:8]}"))
        server = redis.Redis.from_url(url)
        memory_before = int(server.info("memory")["used_memory"])
    added: set[int] = set()
    apply_batch = index.apply_batch

    def recording(ops: Any, stream: Any = None, watermark: Any = None) -> bool:
        applied = bool(apply_batch(ops, stream, watermark))
        if applied:
            added.update(k for op in ops if isinstance(op, AddOp) for k in op.request_keys)
        return applied

    index.apply_batch = recording  # type: ignore[method-assign]
    ingester = EventIngester(index, tp)
    seqs: dict[str, int] = {}
    batches = fleet(page, requests)
    payloads = [(pod, wire.sglang_batch(events)) for pod, events, _ in batches]
    started = time.perf_counter()
    for pod, payload in payloads:
        seqs[pod] = seqs.get(pod, -1) + 1
        ingester.process(f"kv@{pod}@{MODEL}", seqs[pod], payload, pod)
    elapsed = time.perf_counter() - started
    redis_bytes = None
    if server is not None:
        redis_bytes = int(server.info("memory")["used_memory"]) - memory_before
    caches = batches[-1][2]
    held_pairs = wrong = 0
    low = scored = 0
    for pod, cache in caches.items():
        paths = cache.held()
        want = {k for p in paths for k in tp.tokens_to_kv_block_keys(0, p, MODEL)}
        held = {k for k in added if index.lookup([k], {pod})}
        held_pairs += len(held)
        wrong += len(held - want)
        for p in paths:
            keys = tp.tokens_to_kv_block_keys(0, p, MODEL)
            found = index.lookup(keys, {pod})
            hits = next((i for i, k in enumerate(keys) if k not in found), len(keys))
            scored += 1
            low += hits < len(keys)
    planner_caches = ingester._planner.caches  # measuring the state itself
    tails = [
        getattr(planner_caches.get(pod), name)
        for pod in caches
        for name in ("_tails", "_cuts")
        if hasattr(planner_caches.get(pod), name)
    ]
    pages = sum(len(getattr(t, "items", t)) for t in tails)  # a table of records, or a dict
    seen: set[int] = set()
    state = sum(deep_size(t, seen) for t in tails)
    counters = ingester.counters.snapshot()
    result = {
        "pairs": held_pairs,
        "wrong_pairs": wrong,
        "scores": scored,
        "low_scores": low,
        "parent_misses": counters.get("parent_misses", 0),
        "pages_remembered": pages,
        "state_bytes": state,
        "bytes_per_page": state / pages if pages else 0.0,
        # the index's engine keys (pages, boundary keys), or the Redis memory the index took
        "engine_mappings": (
            # (the engine table, and the engine keys kept in runs where the index has them)
            len(index._engine) + len(getattr(index, "_engine_resident", ()))
            if server is None
            else None
        ),
        "redis_bytes": redis_bytes,
        "ingest_ms": elapsed * 1000,
    }
    if server is not None:
        index.drop_namespace()
        index.close()
        server.close()
    return result


def run_child(tree: Path, page: int, requests: int, url: str | None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(tree), str(page), str(requests), url or "-"],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        url = None if sys.argv[5] == "-" else sys.argv[5]
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), url)))
        return
    from bench_fidelity import extract

    parser = bench_parser(__doc__, "150 requests instead of 600")
    parser.add_argument("--before", default="f32734f", help="git ref of the older behaviour")
    parser.add_argument("--page", type=int, default=1, help="SGLang page size")
    parser.add_argument(
        "--redis",
        action="store_true",
        help="ingest into a Redis index (a fresh redis-server, or --url) instead of in memory",
    )
    parser.add_argument("--url", help="the Redis to use with --redis")
    args = parser.parse_args()
    requests = 150 if args.quick else 600
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(args.url)) if args.redis else None
        with tempfile.TemporaryDirectory(prefix="kvredis-branches-") as tmp:
            extract(args.before, Path(tmp))
            before = run_child(Path(tmp), args.page, requests, url)
        after = run_child(REPO, args.page, requests, url)
    where = "Redis" if args.redis else "in-memory"
    print(
        f"SGLang fleet, page size {args.page}, index block {BLOCK}, {requests} requests, 4 pods,"
        f" {where} index"
    )
    print(f"{'':<28}{'before':>18}{'after':>18}")
    for name, key, total in [
        ("wrong pairs", "wrong_pairs", "pairs"),
        ("low scores", "low_scores", "scores"),
    ]:
        cells = [f"{r[key]}/{r[total]} ({r[key] / max(r[total], 1):.0%})" for r in (before, after)]
        print(f"{name:<28}{cells[0]:>18}{cells[1]:>18}")
    for name, key in [("parent misses", "parent_misses"), ("pages remembered", "pages_remembered")]:
        print(f"{name:<28}{before[key]:>18}{after[key]:>18}")
    if args.redis:
        print(
            f"{'Redis used_memory growth':<28}{before['redis_bytes']:>18}{after['redis_bytes']:>18}"
        )
    else:
        name, key = "index engine mappings", "engine_mappings"
        print(f"{name:<28}{before[key]:>18}{after[key]:>18}")
    print(f"{'ingest ms':<28}{before['ingest_ms']:>18.0f}{after['ingest_ms']:>18.0f}")
    print(
        f"{'state bytes per page':<28}{before['bytes_per_page']:>18.0f}"
        f"{after['bytes_per_page']:>18.0f}"
    )
    if args.json:
        write_json(args.json, {"before_ref": args.before, "before": before, "after": after})


if __name__ == "__main__":
    main()

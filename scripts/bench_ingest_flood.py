"""Peak RSS of an ingester under a flood of oversized messages, with and without the socket bound.

A publisher (this process) sends ``--count`` messages of ``--size-mb`` MB each over loopback ZMQ to
an ``EventIngester`` running in a child process, then valid batches until the child has applied
one. Each child reports its RSS before the flood and its peak RSS (``ru_maxrss``). Two children run
side by side in one invocation:

* ``unbounded``: ``max_message_bytes=-1`` and a ``queue_bytes`` larger than the flood (every
  message is received whole and queued, the way the ingester behaved before the bounds), and
* ``bounded``: the defaults (``max_message_bytes`` 8 MiB: ZMQ refuses each message from its size
  header and drops the connection; the subscriber reopens it).

Run:  .venv/bin/python scripts/bench_ingest_flood.py [--count 20] [--size-mb 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import zmq

from kvredis.hashing import ChunkedTokenDatabase
from kvredis.ingest import EndpointConfig, EventIngester, IngesterConfig
from kvredis.ingest.events import BlockStored, encode_batch
from kvredis.memory import InMemoryIndex

TOPIC = b"kv@pod-a@model-a"


def rss_mb(field: str = "VmRSS") -> float:
    """This process's RSS (``VmRSS``) or peak RSS (``VmHWM``) in MB, from /proc (Linux).

    ``VmHWM`` belongs to the process image: unlike ``ru_maxrss`` it does not carry over the
    parent's peak through fork and exec.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1e3
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(endpoint: str, mode: str) -> None:
    """Ingest from ``endpoint`` until a valid batch is applied; print the RSS figures."""
    config = IngesterConfig(workers=1, peer_grace_s=0.05)
    if mode == "unbounded":
        config = IngesterConfig(
            workers=1, peer_grace_s=0.05, max_message_bytes=-1, queue_bytes=1 << 40
        )
    index = InMemoryIndex()
    tp = ChunkedTokenDatabase()
    ing = EventIngester(index, tp, [EndpointConfig(endpoint)], config)
    before = rss_mb()
    ing.start()
    key = tp.tokens_to_kv_block_keys(0, tuple(range(16)), "model-a")
    deadline = time.monotonic() + 300
    while not index.lookup(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    applied = bool(index.lookup(key))
    snapshot = ing.counters.snapshot()
    ing.stop(drain=False)
    peak = rss_mb("VmHWM")
    print(
        json.dumps(
            {
                "mode": mode,
                "rss_before_mb": round(before, 1),
                "peak_rss_mb": round(peak, 1),
                "applied_after_flood": applied,
                "received": snapshot["received"],
                "transport_errors": snapshot["transport_errors"],
            }
        )
    )


def run(mode: str, count: int, size: int) -> dict[str, Any]:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", endpoint, mode], stdout=subprocess.PIPE, text=True
    )
    try:
        if not pub.poll(30_000):
            raise SystemExit("the child never subscribed")
        pub.recv()
        flood = bytes(size)
        for seq in range(count):
            pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), flood])
        valid = encode_batch([BlockStored((1,), None, tuple(range(16)), 16)])
        seq = count
        while proc.poll() is None:
            pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), valid])
            seq += 1
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close(linger=0)
        ctx.term()
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("ENDPOINT", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--size-mb", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    size = args.size_mb * 1_000_000
    results = [run(mode, args.count, size) for mode in ("unbounded", "bounded")]
    if args.json:
        print(json.dumps(results))
        return
    print(f"flood: {args.count} x {args.size_mb} MB messages, then valid batches")
    print(f"{'run':<12}{'RSS before':>12}{'peak RSS':>12}{'received':>10}  applied after")
    for r in results:
        print(
            f"{r['mode']:<12}{r['rss_before_mb']:>10.0f}MB{r['peak_rss_mb']:>10.0f}MB"
            f"{r['received']:>10}  {r['applied_after_flood']}"
        )
    unbounded, bounded = results
    print(f"peak RSS bounded / unbounded: {bounded['peak_rss_mb'] / unbounded['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()

"""The ingester's instructions per stored block: a CPU measure that a shared, noisy machine
does not blur.

Time measures of the ingester (``scripts/bench_realistic.py``) move by 10-30% from one run to
the next on a machine shared with other work, more than most changes to the ingester save. The
instructions the ingester's process runs do not: this benchmark runs the fleets of
``bench_realistic.py`` (``--shape``, the same seed) through ``EventIngester.process_many``
(backlog 16, as a busy worker drains its queue; ``--backlog 1``: ``process``, a call per
message) on a real server, in a child process under
``valgrind --tool=callgrind``, and counts the instructions (``Ir``); the loaded fleet is frozen
out of the garbage collector's way first, as ``bench_realistic.py`` does, so the ingester pays
for collecting its own objects only. A second child loads the same fleet and applies nothing;
the difference, per stored index block and per event, is what ingesting costs. Two runs of the
same code differ by well under 1%. Instructions are not time (a cache miss costs more than an
add), but a change that runs fewer of them on the same path runs faster: compare two revisions
by running this script in each checkout.

Needs ``valgrind`` (``apt-get install -y valgrind``). A child runs about 50x slower than
natively: the full vLLM fleet takes about two minutes per child, ``--quick`` seconds.

Run:  .venv/bin/python scripts/bench_ingest_instructions.py [--quick]
          [--shape vllm,vllm-steps,sglang] [--backlog 16] [--json PATH]
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from _bench import RedisServer, bench_parser, callgrind_instructions, write_json

BACKLOG = 16
"""Messages per ``process_many`` call by default (``bench_realistic.py``'s backlog 16);
``--backlog 1`` measures ``process`` (a call per message)."""


def child(fleet_path: str, url: str, reps: int, backlog: int = BACKLOG) -> None:
    """Load the pickled fleet and ingest it ``reps`` times (0: load only), ``backlog`` messages
    per call."""
    import bench_realistic as br

    br.tune_collector(br.GC_THRESHOLD)
    with open(fleet_path, "rb") as f:
        fleet = pickle.load(f)
    br.settle_collector()  # the fleet out of the collector's way, as in bench_realistic
    for _ in range(reps):
        ingest = br.Ingest(fleet, url, backlog)
        call, count = ingest.calls()
        for i in range(count):
            call(i)
        ingest.close()


def instructions(fleet_path: str, url: str, reps: int, backlog: int = BACKLOG) -> int:
    """The instructions a child ingesting the fleet ``reps`` times runs (callgrind's ``Ir``)."""
    return callgrind_instructions([__file__, "--child", fleet_path, url, str(reps), str(backlog)])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    parser = bench_parser(__doc__, "the small fleets of bench_realistic --quick")
    parser.add_argument("--shape", default="vllm,vllm-steps,sglang", help="fleets to measure")
    parser.add_argument(
        "--backlog",
        type=int,
        default=BACKLOG,
        help="messages per call: 16 is process_many as a busy worker drains its queue, 1 is"
        " process (a call per message)",
    )
    args = parser.parse_args()
    if args.backlog < 1:
        parser.error("--backlog must be at least 1")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
    import bench_realistic as br

    from kvredis.redis.layout import bucket_bits_for

    results: list[dict[str, Any]] = []
    server = RedisServer("redis")
    server.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for shape in args.shape.split(","):
                fleet = br.make_fleet(shape, args.quick, 7)
                fleet.bucket_bits = bucket_bits_for(fleet.distinct_keys())
                path = str(Path(tmp) / f"{shape}.pickle")
                with open(path, "wb") as f:
                    pickle.dump(fleet, f)
                blocks = sum(m.blocks for m in fleet.messages)
                events = sum(m.events for m in fleet.messages)
                load = instructions(path, server.url, 0, args.backlog)
                total = instructions(path, server.url, 1, args.backlog)
                row = {
                    "shape": shape,
                    "messages": len(fleet.messages),
                    "events": events,
                    "blocks": blocks,
                    "instructions": total - load,
                    "per_block": (total - load) / blocks,
                    "per_event": (total - load) / events,
                }
                results.append(row)
                print(
                    f"{shape}: {len(fleet.messages)} messages, {events} events, {blocks} blocks:"
                    f" {row['per_block'] / 1e3:.1f}k instructions per stored block,"
                    f" {row['per_event'] / 1e3:.1f}k per event",
                    flush=True,
                )
    finally:
        server.close()
    if args.json:
        write_json(args.json, {"backlog": args.backlog, "results": results})


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()

"""The command floor of an index written from Lua: the server's CPU per hash command a script runs.

kvredis applies engine events in scripts that read and write one field per request key and one
per engine key, in bucket hashes of a few dozen fields (listpacks). Whatever the Lua around
them, those commands are paid by every stored block: stored, its request key and its engine key
are read (is either known?) and written; evicted, both are read and deleted. This benchmark
times the commands alone inside a script, on buckets like the index's (``--fields`` fields of
8-byte names and 6-byte values, ``--buckets`` of them, bucket names built from the hash as the
scripts build them), and derives that floor:

- per row: a loop of ``--calls`` iterations in one ``EVAL``, less the same loop with nothing in
  it (the bucket and field choice stay), as the growth of the server's ``used_cpu_user +
  used_cpu_sys`` (``INFO cpu``), median of ``--rounds``: the bucket name alone, ``HGET`` of a
  missing field, ``HGET`` of a held one, and ``HSET`` of a new field followed by ``HDEL`` of it
  (a pair: the bucket is left as found), each command row with its bucket name built;
- the commands alone (a command row less the bucket name row), and a stored block's life in
  commands alone: two reads and two writes when stored, two reads and two deletes when
  evicted, ``4 x HGET (miss and hit alike) + 2 x (HSET + HDEL)``.

Compare the floor with the Redis CPU per stored block of ``scripts/bench_realistic.py`` (kvredis
and the Go layout written well, which pipelines its commands without a script): a target below
the floor needs a layout in which a stored block writes no field of its own. The server is
pinned to core 0 and this client to core 1 when there are two.

Run:  .venv/bin/python scripts/bench_lua_floor.py [--quick] [--server redis|valkey]
          [--calls N] [--rounds N] [--fields N] [--buckets N] [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

import redis

from _bench import RedisServer, bench_parser, write_json

#: The loop every row runs: ``ARGV[1]`` iterations over the ``ARGV[2]`` bucket suffixes (two
#: bytes each) and the held fields of each (``ARGV[3]``, 8 bytes each, ``ARGV[4]`` a bucket),
#: with the row's body in place of ``BODY``.
LOOP = """
local n, buckets, held, per = tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local nb = #buckets / 2
local missing = 'no-such-'
for i = 1, n do
  local b = i % nb
  local h = string.sub(buckets, 2 * b + 1, 2 * b + 2)
  local f = string.sub(held, 8 * (b * per + i % per) + 1, 8 * (b * per + i % per) + 8)
  BODY
end
return n
"""

#: Each row's body (``NAME``: the bucket name, built as ``lua/includes/layout.lua`` builds it).
ROWS = {
    "loop": "",
    "bucket name": "local k = 'ns:r:' .. h",
    "HGET miss": "redis.call('HGET', 'ns:r:' .. h, missing)",
    "HGET hit": "redis.call('HGET', 'ns:r:' .. h, f)",
    "HSET new + HDEL": (
        "local k = 'ns:r:' .. h "
        "redis.call('HSET', k, missing, 'xxxxxx') redis.call('HDEL', k, missing)"
    ),
}


def pin(pid: int, cpu: int) -> bool:
    """Pin ``pid`` to ``cpu`` when the machine has more than one."""
    if (os.cpu_count() or 1) < 2:
        return False
    try:
        os.sched_setaffinity(pid, {cpu})
    except OSError:
        return False
    return True


def server_cpu(client: redis.Redis) -> float:
    info: Any = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def fill(client: redis.Redis, buckets: int, fields: int) -> tuple[bytes, bytes]:
    """``buckets`` listpack buckets of ``fields`` fields; their suffixes and held fields."""
    suffixes = b"".join(b.to_bytes(2, "big") for b in range(buckets))
    held = []
    pipe = client.pipeline(transaction=False)
    for b in range(buckets):
        names = [os.urandom(8) for _ in range(fields)]
        held += names
        pipe.hset(b"ns:r:" + b.to_bytes(2, "big"), mapping={n: os.urandom(6) for n in names})
    pipe.execute()
    return suffixes, b"".join(held)


def measure(
    client: redis.Redis, calls: int, rounds: int, args: tuple[bytes, bytes, int]
) -> dict[str, float]:
    """Server CPU per iteration of each row, in microseconds (medians over ``rounds``)."""
    shas = {name: client.script_load(LOOP.replace("BODY", body)) for name, body in ROWS.items()}
    samples: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(rounds):
        for name, sha in shas.items():  # alternating, so that a busy moment hits every row
            before = server_cpu(client)
            client.evalsha(sha, 0, calls, *args)
            samples[name].append((server_cpu(client) - before) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "fewer calls and rounds")
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    parser.add_argument("--calls", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fields", type=int, default=48, help="fields per bucket (default 48)")
    parser.add_argument("--buckets", type=int, default=512, help="buckets (default 512)")
    args = parser.parse_args(argv)
    calls, rounds = (40_000, 3) if args.quick else (args.calls, args.rounds)
    server = RedisServer(args.server)
    server.start()
    try:
        pid = server.proc.pid if server.proc is not None else None
        pinned = pid is not None and pin(pid, 0) and pin(0, 1)
        client = redis.Redis.from_url(server.url)
        suffixes, held = fill(client, args.buckets, args.fields)
        raw = measure(client, calls, rounds, (suffixes, held, args.fields))
        client.close()
    finally:
        server.close()
    loop = raw["loop"]
    rows = {name: max(0.0, us - loop) for name, us in raw.items() if name != "loop"}
    name_us = rows["bucket name"]
    alone = {name: max(0.0, us - name_us) for name, us in rows.items() if name != "bucket name"}
    hget = (alone["HGET miss"] + alone["HGET hit"]) / 2
    floor = 4 * hget + 2 * alone["HSET new + HDEL"]
    print(
        f"{args.server}, {args.buckets} buckets of {args.fields} fields, {calls:,} calls a row, "
        f"median of {rounds}, pinned={pinned}",
        file=sys.stderr,
    )
    print("| server CPU per call from a script | with its bucket name | the command alone |")
    print("|---|---:|---:|")
    print(f"| the bucket name | {name_us:.3f} µs | |")
    for name, us in alone.items():
        print(f"| {name} | {rows[name]:.3f} µs | {us:.3f} µs |")
    print(f"| a stored block's life: 4 x HGET + 2 x (HSET + HDEL) | | **{floor:.2f} µs** |")
    if args.json:
        write_json(
            args.json,
            {
                "server": args.server,
                "pinned": pinned,
                "calls": calls,
                "rounds": rounds,
                "with_bucket_name_us": rows,
                "command_us": alone,
                "loop_us": loop,
                "block_life_floor_us": floor,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

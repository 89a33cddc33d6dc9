"""Redis Functions against EVALSHA: the server CPU one call of kvredis's own Lua costs each way.

An ``EVALSHA`` runs the whole script each call, so every call first defines the script's local
functions and tables (its includes) before the body runs. A Redis Function library runs that
top level once, at ``FUNCTION LOAD``, and an ``FCALL`` runs the body alone. This benchmark
builds, for each of kvredis's ``ping``, ``lookup`` and ``score`` scripts, a function library
out of the same expanded source: the includes become the library's top level, the script's
body the function. It then calls both forms with identical arguments on one server, in
alternating rounds, and reads the server's CPU per call from ``INFO commandstats``
(``cmdstat_evalsha`` against ``cmdstat_fcall_ro``). The server is pinned to core 0 and this
client to core 1 when the machine has two.

Datasets: a 512-block chain held by 4 pods (2 on gpu, 2 on cpu), stored by ``RedisIndex``.
Rows: the ping script (a call's floor), a lookup missing at its first key, lookups of 16 and 512
blocks, a score of 512 blocks.

Run:  .venv/bin/python scripts/bench_functions.py [--quick] [--server redis|valkey] [--json PATH]
"""

from __future__ import annotations

import os
import re
import statistics
import uuid
from typing import Any

import redis

from kvredis import PodEntry, RedisIndex, RedisIndexConfig
from kvredis.redis.codec import pack_hashes
from kvredis.redis.ops import pod_args
from kvredis.redis.scripts import expand, lua_sources
from kvredis.scoring import UNKNOWN_TIER_WEIGHT

from _bench import RedisServer, bench_parser, write_json

_INCLUDE = re.compile(r"^--@include\s+\S+\s*$", re.MULTILINE)
_SHEBANG = re.compile(r"^#!lua flags=(\S*)\n")


def function_library(script: str, name: str) -> str:
    """The script as a function library ``name`` with one function ``name``: its includes
    (expanded) as the library's top level, its own text as the function's body."""
    sources = lua_sources()
    source = sources[script]
    includes = "\n".join(_INCLUDE.findall(source))
    prelude = expand("_prelude", {**sources, "_prelude": includes + "\n"})
    shebang = _SHEBANG.match(source)
    flags = shebang.group(1).split(",") if shebang else []
    body = _INCLUDE.sub("", _SHEBANG.sub("", source))
    flag_list = ", ".join(f"'{f}'" for f in flags if f)
    return (
        f"#!lua name={name}\n{prelude}\n"
        f"redis.register_function{{function_name='{name}', flags={{{flag_list}}},\n"
        f"  callback=function(KEYS, ARGV)\n{body}\nend}}\n"
    )


def send(pipe: Any, command: str, target: str, keys: list[Any], args: list[Any]) -> None:
    """Queue one call of a script (EVALSHA, by SHA) or function (FCALL / FCALL_RO, by name)."""
    if command == "EVALSHA":
        pipe.evalsha(target, len(keys), *keys, *args)
    elif command == "FCALL_RO":
        pipe.fcall_ro(target, len(keys), *keys, *args)
    else:
        pipe.fcall(target, len(keys), *keys, *args)


def measure(kind: str, rounds: int, calls: int) -> dict[str, Any]:
    server = RedisServer(kind)
    server.start()
    if server.proc is not None and (os.cpu_count() or 1) > 1:  # server on core 0, client on 1
        os.sched_setaffinity(server.proc.pid, {0})
        os.sched_setaffinity(0, {1})
    raw = redis.Redis.from_url(server.url)
    tag = uuid.uuid4().hex[:8]
    out: dict[str, Any] = {}
    try:
        index = RedisIndex(RedisIndexConfig(address=server.url, namespace=f"kvb-{tag}"))
        chain = list(range(1, 513))
        pods = [PodEntry(f"pod-{i}", "gpu" if i < 2 else "cpu") for i in range(4)]
        for pod in pods:
            index.add(None, chain, [pod])
        layout = index._session.state.layout
        registry = index._session.registry
        weights: list[Any] = [2, b"gpu", "1.0", b"cpu", "0.8"]
        keys4 = [layout.meta, layout.pi, layout.pp, layout.sx]

        def lookup_args(blocks: list[int]) -> list[Any]:
            chain = pack_hashes(blocks, "request key")[1]
            return [layout.gen, layout.rprefix, layout.bucket_bits, 0, *pod_args(None), chain]

        score_args = [layout.gen, layout.rprefix, layout.bucket_bits, *pod_args(None), *weights]
        score_args += [repr(float(UNKNOWN_TIER_WEIGHT)), pack_hashes(chain, "request key")[1], 0]
        rows: dict[str, tuple[str, list[Any], list[Any]]] = {
            "ping (floor of a call)": ("ping", [b"k"], ["a"]),
            "lookup, miss at the first key": ("lookup", keys4, lookup_args([10**9])),
            "lookup, 16 blocks": ("lookup", keys4, lookup_args(chain[:16])),
            "lookup, 512 blocks": ("lookup", keys4, lookup_args(chain)),
            "score, 512 blocks": ("score", keys4, score_args),
        }
        for script in {row[0] for row in rows.values()}:
            raw.function_load(function_library(script, f"kvbench_{script}_{tag}"))
            raw.script_load(registry[script].source)
        for label, (script, keys, args) in rows.items():
            sha, name = registry[script].sha, f"kvbench_{script}_{tag}"
            fcall = "FCALL_RO" if script != "ping" else "FCALL"  # reads are no-writes
            target = {"EVALSHA": sha, fcall: name}
            check = raw.pipeline(transaction=False)
            for command in ("EVALSHA", fcall):
                send(check, command, target[command], keys, args)
            evalsha_reply, fcall_reply = check.execute()
            assert evalsha_reply == fcall_reply, label  # the same reply both ways
            per: dict[str, list[float]] = {"EVALSHA": [], fcall: []}
            for _ in range(rounds):
                for command in ("EVALSHA", fcall):
                    raw.config_resetstat()
                    pipe = raw.pipeline(transaction=False)
                    for _ in range(calls):
                        send(pipe, command, target[command], keys, args)
                    pipe.execute()
                    stat = raw.info("commandstats")[f"cmdstat_{command.lower()}"]
                    per[command].append(stat["usec"] / stat["calls"])
            evalsha, function = statistics.median(per["EVALSHA"]), statistics.median(per[fcall])
            out[label] = {
                "evalsha_us": round(evalsha, 2),
                "fcall_us": round(function, 2),
                "fcall/evalsha": round(function / evalsha, 2),
                "saved_us": round(evalsha - function, 2),
            }
        index.drop_namespace()
        index.close()
    finally:
        raw.close()
        server.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "3 rounds of 200 calls per row")
    parser.add_argument("--server", default="redis", choices=("redis", "valkey"))
    args = parser.parse_args(argv)
    rounds, calls = (3, 200) if args.quick else (7, 2000)
    result = measure(args.server, rounds, calls)
    print(f"{args.server}: Redis CPU per call (µs, median of {rounds} rounds of {calls} calls)")
    print(f"{'row':<32} {'EVALSHA':>9} {'FCALL':>9} {'ratio':>7} {'saved':>7}")
    for label, row in result.items():
        print(
            f"{label:<32} {row['evalsha_us']:>9} {row['fcall_us']:>9} "
            f"{row['fcall/evalsha']:>6}x {row['saved_us']:>7}"
        )
    if args.json:
        write_json(args.json, {"server": args.server, "rows": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Redis CPU of the per-call protocol version check of the ``kvredis`` function library.

Every function of the library first checks the call's last argument, the protocol version its
caller speaks (``kvredis-api:<n>``, ``lua/includes/api.lua``), and takes it off. This benchmark
measures what that costs the server, side by side on one server: the shipped library (with the
check; calls carry the version) and the same library built without the check line (calls
without the version), loaded in turn (``FUNCTION LOAD REPLACE``) in alternating rounds. The
calls are real ones, recorded from a client: ping (the floor, where the check is the largest
share), lookups and scores of 16 and 512 blocks, an add of 16 keys already held, and an unfenced
apply_batch of 64 evict ops (a long argument list). Per row: the server's CPU per call
(``INFO cpu``: ``used_cpu_user + used_cpu_sys``, all the server does for a call) and the
function's own time (``INFO commandstats`` usec of FCALL/FCALL_RO), medians over the rounds, and
the difference. The server is pinned to core 0 and this client to core 1 when there are two.
Those rows carry the networking of a call, and on a busy machine their noise is larger than the
check; the last rows time the check alone inside the server: one script runs ``api_arg`` (the
check, ``lua/includes/api.lua``) a million times over an argument list of 10 and of 10,000
arguments, against the same loop without the check (each loop one EVAL, timed whole), and
reports the difference per call.

Run:  .venv/bin/python scripts/bench_version_check.py [--quick] [--server redis|valkey]
          [--json PATH]
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from typing import Any

import redis

from kvredis import EvictOp, KeyType, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.redis.functions import FunctionRegistry, api_argument, shipped_library
from kvredis.redis.requests import ScriptCall
from kvredis.redis.scripts import expand, lua_sources
from kvredis.redis.session import Session

from _bench import RedisServer, bench_parser, write_json

PODS = [PodEntry(f"pod-{i}", "gpu" if i < 2 else "cpu") for i in range(4)]
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}
CHAIN = list(range(1, 513))
SIDES = ("with check", "without")


class _Recorder(FunctionRegistry):
    def __init__(self) -> None:
        super().__init__(use=True)
        self.calls: list[ScriptCall] = []

    def call_command(self, call: ScriptCall) -> Any:
        self.calls.append(call)
        return super().call_command(call)


def record(address: str) -> tuple[dict[str, ScriptCall], FunctionRegistry]:
    """A namespace with a 512-block chain on 4 pods, and one recorded call per row."""
    namespace = f"kvbench-{uuid.uuid4().hex[:8]}"
    index = RedisIndex(RedisIndexConfig(address=address, namespace=namespace))
    recorder = _Recorder()
    recorder.active = True
    session = index._session
    index._session = Session(session.state, recorder, session.policy)

    def one(run: Any) -> ScriptCall:
        start = len(recorder.calls)
        run()
        return recorder.calls[start]

    try:
        for pod in PODS:
            index.add(None, CHAIN, [pod])
        rows = {
            "ping": ScriptCall("ping", (), (), read=True),
            "lookup, 16 blocks": one(lambda: index.lookup(CHAIN[:16])),
            "lookup, 512 blocks": one(lambda: index.lookup(CHAIN)),
            "score, 16 blocks": one(lambda: index.score(CHAIN[:16], WEIGHTS)),
            "score, 512 blocks": one(lambda: index.score(CHAIN, WEIGHTS)),
            "add, 16 keys": one(lambda: index.add(None, CHAIN[:16], [PODS[1]])),
            "apply_batch, 64 evicts": one(
                lambda: index.apply_batch(
                    [EvictOp(k, KeyType.REQUEST, (PodEntry("pod-x", "gpu"),)) for k in CHAIN[:64]]
                )
            ),
        }
    finally:
        index.close()
    return rows, recorder


def _cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _function_usec(client: redis.Redis) -> tuple[float, int]:
    stats = client.info("commandstats")
    usec = calls = 0
    for name in ("cmdstat_fcall", "cmdstat_fcall_ro"):
        usec += float(stats.get(name, {}).get("usec", 0))
        calls += int(stats.get(name, {}).get("calls", 0))
    return usec, calls


def measure(address: str, port: int, rounds: int, calls: int) -> dict[str, dict[str, float]]:
    rows, registry = record(address)
    shipped = shipped_library()
    code = shipped.code.decode()
    marker = api_argument(shipped.api)
    check = f"api_arg(ARGV, '{marker}', "
    lines = code.split("\n")
    without = "\n".join(line for line in lines if not line.startswith(check))
    assert without.count("callback=function(KEYS, ARGV)") == len(shipped.reads)
    assert sum(line.startswith(check) for line in lines) == len(shipped.reads)
    libraries = {"with check": code, "without": without}
    client = redis.Redis(port=port)
    out: dict[str, dict[str, float]] = {}
    try:
        commands = {}
        for label, call in rows.items():
            full = list(registry.call_command(call).args)
            assert full[-1] == marker
            commands[label] = {"with check": full, "without": full[:-1]}
        for label in rows:
            cpu: dict[str, list[float]] = {s: [] for s in SIDES}
            own: dict[str, list[float]] = {s: [] for s in SIDES}
            replies = {}
            for _ in range(rounds):
                for side in SIDES:
                    client.function_load(libraries[side], replace=True)
                    command = commands[label][side]
                    replies[side] = client.execute_command(*command)
                    client.config_resetstat()
                    before = _cpu(client)
                    for _ in range(calls):
                        client.execute_command(*command)
                    cpu[side].append((_cpu(client) - before) / calls * 1e6)
                    usec, n = _function_usec(client)
                    own[side].append(usec / max(n, 1))
            assert replies["with check"] == replies["without"], label
            with_cpu, without_cpu = (statistics.median(cpu[s]) for s in SIDES)
            with_own, without_own = (statistics.median(own[s]) for s in SIDES)
            out[label] = {
                "with_check_cpu_us": round(with_cpu, 2),
                "without_cpu_us": round(without_cpu, 2),
                "check_cpu_us": round(with_cpu - without_cpu, 2),
                "with_check_function_us": round(with_own, 2),
                "without_function_us": round(without_own, 2),
                "check_function_us": round(with_own - without_own, 2),
                "ratio": round(with_own / without_own, 3) if without_own else 0.0,
            }
        client.function_load(code, replace=True)
    finally:
        client.close()
    return out


#: The check in a loop of ``reps`` calls over ``n`` arguments (ARGV: n, reps, the version, 1
#: with the check, 0 for the same loop without it).
_LOOP = """--@include api
local n, reps, marker = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local check = ARGV[4] == '1'
local args = {}
for i = 1, n do args[i] = 'x' end
for _ = 1, reps do
  args[n + 1] = marker
  if check then api_arg(args, marker, 'the library') else args[n + 1] = nil end
end
return #args
"""


def check_alone(port: int, reps: int) -> dict[str, dict[str, float]]:
    """The check's own cost per call: a loop of it inside the server against the same loop
    without it, each timed as one EVAL (µs per check; the EVAL's round trip is shared by
    ``reps`` checks)."""
    source = expand("loop", {**lua_sources(), "loop": _LOOP})
    client = redis.Redis(port=port)
    out: dict[str, dict[str, float]] = {}
    try:
        for n in (10, 10_000):
            samples = []
            for _ in range(5):
                took = []
                for check in (1, 0):
                    start = time.perf_counter()
                    assert client.eval(source, 0, n, reps, api_argument(), check) == n
                    took.append(time.perf_counter() - start)
                samples.append((took[0] - took[1]) / reps * 1e6)
            out[f"the check alone, {n} arguments"] = {
                "check_us_in_lua": round(statistics.median(samples), 4)
            }
    finally:
        client.close()
    return out


def main() -> None:
    parser = bench_parser(__doc__, "a run of seconds: 3 rounds of 300 calls")
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    rounds, calls = (3, 300) if args.quick else (args.rounds, args.calls)
    server = RedisServer(args.server)
    server.start()
    try:
        if (os.cpu_count() or 1) > 1 and server.pid is not None:
            os.sched_setaffinity(server.pid, {0})
            os.sched_setaffinity(0, {1})
        started = time.perf_counter()
        rows = measure(server.url, server.port, rounds, calls)
        alone = check_alone(server.port, 100_000 if args.quick else 1_000_000)
    finally:
        server.close()
    print(f"{args.server}: {rounds} rounds of {calls} calls per side "
          f"({time.perf_counter() - started:.0f} s); µs per call (medians)")  # fmt: skip
    print(f"{'row':<24}{'CPU with':>10}{'without':>10}{'check':>8}"
          f"{'fn with':>10}{'without':>10}{'check':>8}{'ratio':>7}")  # fmt: skip
    for label, row in rows.items():
        print(f"{label:<24}{row['with_check_cpu_us']:>10.2f}{row['without_cpu_us']:>10.2f}"
              f"{row['check_cpu_us']:>8.2f}{row['with_check_function_us']:>10.2f}"
              f"{row['without_function_us']:>10.2f}{row['check_function_us']:>8.2f}"
              f"{row['ratio']:>7.3f}")  # fmt: skip
    for label, row in alone.items():
        print(f"{label:<40}{row['check_us_in_lua']:>8.4f} µs per call, timed in Lua")
    if args.json:
        write_json(args.json, {"server": args.server, "rounds": rounds, "calls": calls,
                               "rows": rows, "alone": alone})  # fmt: skip


if __name__ == "__main__":
    main()

"""docs/engines.md, run: each engine's real publisher class (from its PyPI wheel) is started with
exactly the documented ``--kv-events-config`` (ports moved to free ones), the real
``kvredis ingest`` with exactly the documented arguments (the engine's address made loopback, the
test's Redis), and a router then scores the prompts the engine published."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvredis import ChunkedTokenDatabase, RedisIndex, RedisIndexConfig, TokenProcessorConfig
from kvredis.testing.servers import free_port
from tests.engines.wheels import EngineWheelUnavailable, sandbox
from tests.servers import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.zmq]

DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
TEXT = DOC.read_text(encoding="utf-8")
PUBLISH = Path(__file__).resolve().parent / "publish.py"


def documented(marker: str) -> str:
    """The fenced block right after ``<!-- marker -->``."""
    m = re.search(rf"<!-- {marker} -->\n```\w+\n(.*?)^```", TEXT, re.MULTILINE | re.DOTALL)
    assert m, f"docs/engines.md has no block marked {marker}"
    return m.group(1)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _free_ports(offsets: list[int]) -> int:
    """A base port such that base + each offset is free (publisher ranks bind base + rank),
    below the ephemeral range: a port the kernel hands out to outgoing connections (the
    suite's own clients) could be taken between this check and the engine's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = min(low, 65535) - max(offsets) - 1
    for _ in range(200):
        base = random.randrange(10000, top) if top > 10000 else free_port()
        if base + max(offsets) >= 65535:
            continue
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind(("0.0.0.0", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def _engine_hashes(engine: str, tokens: list[int], page: int) -> list[str]:
    """Stand-ins for the engine's chained page hashes (hex): vLLM 32-byte digests, SGLang 8."""
    out, parent = [], b""
    size = 32 if engine == "vllm" else 8
    for start in range(0, len(tokens) - len(tokens) % page, page):
        data = parent + json.dumps(tokens[start : start + page]).encode()
        parent = hashlib.sha256(data).digest()[:size]
        out.append(parent.hex())
    return out


class Publisher:
    """The engine's publisher in a child process (see publish.py)."""

    def __init__(self, engine: str, box: Path, config: dict[str, Any], plan: dict[str, Any]):
        self.proc = subprocess.Popen(
            [sys.executable, str(PUBLISH), engine, str(box), json.dumps(config), json.dumps(plan)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            errors = self.proc.stderr.read() if self.proc.stderr else ""
            self.close()
            raise AssertionError(f"publisher failed: {errors}")
        self.bound = json.loads(line)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.send("stop")
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _ingest(
    args: list[str], redis_url: str, namespace: str, metrics_port: int
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "kvredis", *args]
    command[command.index("--redis") + 1] = redis_url
    command += ["--namespace", namespace, "--metrics-port", str(metrics_port),
                "--metrics-address", "127.0.0.1"]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _received(port: int) -> bool:
    """Whether the ingester's counters show a batch received (``kvredis_ingest_batches``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as reply:
        text = reply.read().decode()
    m = re.search(r"^kvredis_ingest_batches_total (\S+)$", text, re.MULTILINE)
    return bool(m and float(m.group(1)) > 0)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _wait(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"kvredis ingest exited: {proc.stderr.read() if proc.stderr else ''}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _documented_ingest(marker: str) -> list[str]:
    text = documented(marker).replace("\\\n", " ")
    args = shlex.split(text)
    assert args[:2] == ["kvredis", "ingest"]
    return args[1:]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    server = RedisServer("redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


_BOXES: dict[str, Path] = {}


def _box(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine's sandbox, laid out once per session."""
    if engine not in _BOXES:
        try:
            _BOXES[engine] = sandbox(engine, tmp_path_factory.mktemp(engine))
        except EngineWheelUnavailable as exc:
            pytest.fail(str(exc))
    return _BOXES[engine]


@pytest.mark.parametrize(("engine", "page"), [("vllm", 16), ("sglang", 16), ("sglang", 1)])
def test_the_documented_settings_route_the_prompts_an_engine_published(
    engine: str, page: int, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    box = _box(engine, tmp_path_factory)
    config = json.loads(documented(f"{engine}-kv-events-config"))
    topic = config["topic"]
    _, pod, model = topic.split("@", 2)
    pub_port = _free_ports([0, 7])
    replay_port = pub_port + 7
    config["endpoint"] = config["endpoint"].replace(str(_port(config["endpoint"])), str(pub_port))
    config["replay_endpoint"] = config["replay_endpoint"].replace(
        str(_port(config["replay_endpoint"])), str(replay_port)
    )
    prompt = list(range(5000, 5000 + 100))  # 6 full 16-token blocks and 4 tokens
    hashes = _engine_hashes(engine, prompt, page)
    first_event = {"stored": hashes[:3], "parent": None, "tokens": prompt[: 3 * page],
                   "block_size": page}  # fmt: skip
    end = len(hashes) * page
    second_event = {"stored": hashes[3:], "parent": hashes[2], "tokens": prompt[3 * page : end],
                    "block_size": page}  # fmt: skip
    plan = {"batches": [[first_event], [second_event]]}
    publisher = Publisher(engine, box, config, plan)
    args = _documented_ingest(f"{engine}-ingest")
    for flag, port in (("--endpoint", pub_port), ("--replay", replay_port)):
        i = args.index(flag)
        args[i + 1] = re.sub(r":\d+$", f":{port}", args[i + 1])
    block_size = int(args[args.index("--block-size") + 1])
    namespace = f"eng-{uuid.uuid4().hex[:8]}"
    metrics = free_port()
    ingest = _ingest(args, redis.url, namespace, metrics)
    index = RedisIndex(RedisIndexConfig(address=redis.url, namespace=namespace))
    try:
        _wait(lambda: _ready(metrics), 30, "the ingester to be ready", ingest)
        publisher.send("warm")
        _wait(lambda: _received(metrics), 30, "the ingester to receive", ingest)
        publisher.send("go")
        db = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=block_size))
        keys = db.tokens_to_kv_block_keys(0, prompt, model)
        want = {pod: float(len(keys))}
        _wait(lambda: index.score(keys) == want, 30, f"the index to hold {want}", ingest)
        assert len(keys) == 6
    finally:
        publisher.close()
        ingest.terminate()
        _, err = ingest.communicate(timeout=30)
        index.drop_namespace()
        index.close()
    # the engine names pod and model in its topic, as documented: nothing to warn about (but
    # the engine's going away when the test stops it first)
    warnings = [line for line in err.splitlines() if " WARNING " in line]
    assert [w for w in warnings if "disconnected from" not in w] == [], warnings


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_data_parallel_rank_binds_the_documented_ports(
    engine: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    box = _box(engine, tmp_path_factory)
    config = json.loads(documented(f"{engine}-kv-events-config"))
    pub = _free_ports([0, 1, 10, 11])
    replay = pub + 10
    config["endpoint"] = f"tcp://*:{pub}"
    config["replay_endpoint"] = f"tcp://*:{replay}"
    publishers: list[Publisher] = []
    try:
        for rank in (0, 1):
            publishers.append(Publisher(engine, box, config, {"rank": rank, "batches": []}))
        bound = [p.bound for p in publishers]
        assert [_port(b["endpoint"]) for b in bound] == [pub, pub + 1]
        assert [_port(b["replay_endpoint"]) for b in bound] == [replay, replay + 1]
    finally:
        for p in publishers:
            p.close()

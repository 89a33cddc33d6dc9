"""``kvredis ingest`` as an operator runs it: argument errors and hints, a real run against a live
engine and Redis, signals, probes and metrics, hosts and secrets. Every test checks that the
command stopped its ingester on every exit path."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import redis
from click.testing import CliRunner

from kvredis.cli import cli
from kvredis.cli.ingest import ingest
from kvredis.hashing import ChunkedTokenDatabase
from kvredis.ingest.events import BlockStored
from tests.ingest.engine import (
    FakeEngine,
    assert_no_leaked_ingesters,
    ingester_threads,
    wait_until,
)
from tests.servers import RedisServer, free_port
from tests.test_metrics import get as _get

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_leaked_ingesters() -> Iterator[None]:
    """The command stops its ingester on every exit path."""
    before = ingester_threads()
    yield
    assert_no_leaked_ingesters(before)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "at least one --endpoint"),
        (["--pod", "p", "--endpoint", "tcp://h:1"], "--pod p comes before any --endpoint"),
        (["--endpoint", "tcp://h:1", "--model", "a", "--model", "b"], "--model is given twice"),
        (["--endpoint", "http://h:1"], "give pod_id and model_name (--pod and --model)"),
        (
            ["--endpoint", "http://h:1", "--pod", "p", "--model", "m", "--replay", "tcp://h:2"],
            "no replay",
        ),
        (["--endpoint", "udp://h:1"], "is not an engine endpoint"),
        (["--endpoint", "tcp://h"], "is not an engine endpoint"),
        (["--endpoint", "tcp://h:1", "--engine", "tgi"], "Invalid value for --engine"),
        (["--endpoint", "tcp://h:1", "--replay", "h:2"], "Invalid value for --replay"),
        (["--endpoint", "tcp://h:1", "--endpoint", "tcp://h:1"], "is given twice"),
        (
            ["--endpoint", "tcp://h:1", "--pod", "p", "--endpoint", "tcp://h:2", "--pod", "p"],
            "share the stream 'p'",
        ),
        (["--endpoint", "tcp://h:1", "--pod="], "non-empty string"),
        (["--endpoint", "tcp://h:1", "--block-size", "0"], "--block-size"),
        (["--endpoint", "tcp://h:1", "--hash-algo", "md5"], "--hash-algo"),
        (["--endpoint", "tcp://h:1", "--partial-block-pages", "0"], "--partial-block-pages"),
        (["--endpoint", "tcp://h:1", "--gc-threshold", "-1"], "--gc-threshold"),
        (["--endpoint", "tcp://h:1", "--bucket-bits", "0"], "--bucket-bits"),
        (["--endpoint", "tcp://h:1", "--bucket-bits", "25"], "--bucket-bits"),
        (["--endpoint", "tcp://h:1", "--redis", "http://nope"], "--redis"),
        (["--endpoint"], "requires an argument"),
    ],
)
def test_bad_arguments_exit_with_a_usage_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(ingest, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.parametrize(("given", "expected"), [([], 50_000), (["--gc-threshold", "1234"], 1234)])
def test_the_ingester_process_tunes_the_garbage_collector(given: list[str], expected: int) -> None:
    """``kvredis ingest`` raises the collector's first threshold (default 50,000)."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        with FakeEngine(topic="") as engine:
            args = ["--in-memory", "--endpoint", engine.endpoint, "--pod=p", "--model", "m"]
            result = CliRunner().invoke(ingest, [*args, "--duration", "0.2", *given])
        assert result.exit_code == 0, result.output
        assert gc.get_threshold()[0] == expected
    finally:
        gc.set_threshold(*before)


@pytest.mark.redis
def test_bucket_bits_size_a_new_namespace_and_leave_an_existing_one(
    redis_server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``--bucket-bits`` fixes the bucket count of the namespace the ingester creates; a second
    ingester asking another count adopts the namespace's, with a warning naming both."""
    namespace = f"kvt-bits-{uuid.uuid4().hex[:8]}"
    raw = redis.Redis.from_url(redis_server_url)
    try:
        for bits in (9, 12):
            with FakeEngine(topic="") as engine:
                args = ["--redis", redis_server_url, "--namespace", namespace]
                args += ["--endpoint", engine.endpoint, "--pod=p", "--model", "m"]
                result = CliRunner().invoke(
                    ingest, [*args, "--bucket-bits", str(bits), "--duration", "0.2"]
                )
            assert result.exit_code == 0, result.output
            assert raw.hget(f"{namespace}:meta", "bucket_bits") == b"9"
        warned = [r.getMessage() for r in caplog.records if "bucket bits" in r.getMessage()]
        assert len(warned) == 1 and "has 9 bucket bits" in warned[0]
        assert "--bucket-bits 12" in warned[0]
    finally:
        for key in raw.scan_iter(f"{namespace}:*"):
            raw.delete(key)
        raw.close()


def test_the_collector_threshold_zero_leaves_python_s() -> None:
    import gc

    from kvredis.errors import ConfigError
    from kvredis.ingest import tune_collector

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        tune_collector(0)
        assert gc.get_threshold() == (700, 10, 10)
        tune_collector(9000)
        assert gc.get_threshold() == (9000, 20, 10)
        for bad in (-1, True, 1.5, "5"):
            with pytest.raises(ConfigError):
                tune_collector(bad)  # type: ignore[arg-type]
        assert gc.get_threshold() == (9000, 20, 10)
    finally:
        gc.set_threshold(*before)


def test_unreachable_redis_exits_non_zero() -> None:
    result = CliRunner().invoke(
        ingest, ["--endpoint", "tcp://127.0.0.1:1", "--redis", "redis://127.0.0.1:1"]
    )
    assert result.exit_code == 1
    assert "cannot reach redis at redis://127.0.0.1:1" in result.output
    assert result.output.lower().count("cannot reach") == 1


def test_endpoint_groups_in_any_spelling(caplog: pytest.LogCaptureFixture) -> None:
    with FakeEngine(topic="") as a, FakeEngine(topic="") as b, caplog.at_level(logging.INFO):
        result = CliRunner().invoke(
            ingest,
            [
                "--in-memory",
                "--endpoint",
                a.endpoint,
                "--pod=pod-a",
                "--model",
                "m",
                "--status-interval",
                "0.05",
                "--duration",
                "0.3",
                f"--endpoint={b.endpoint}",
                "--replay",
                b.replay_endpoint,
                "--pod",
                "pod-b",
            ],
        )
    assert result.exit_code == 0, result.output
    text = caplog.text
    assert f"{a.endpoint} (pod pod-a)" in text and f"{b.endpoint} (pod pod-b)" in text
    assert "status: batches=0" in text and "stopped: batches=0" in text


@pytest.mark.redis
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_runs_until_signalled(redis_server_url: str, sig: signal.Signals) -> None:
    from kvredis import RedisIndex, RedisIndexConfig

    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    tp = ChunkedTokenDatabase()
    with FakeEngine() as engine:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvredis.cli.ingest",
                "--endpoint",
                engine.endpoint,
                "--replay",
                engine.replay_endpoint,
                "--redis",
                redis_server_url,
                "--namespace",
                namespace,
                "--status-interval",
                "0.1",
            ],
            cwd=str(ROOT),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        lines: list[str] = []
        assert proc.stderr is not None
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
        reader.start()
        index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
        try:
            engine.wait_subscribed(20)
            tokens = tuple(range(64))
            engine.publish([BlockStored((1, 2), None, tokens[:32], 16)])
            engine.publish([BlockStored((3, 4), 2, tokens[32:], 16)], fmt="array")
            keys = tp.tokens_to_kv_block_keys(0, tokens, "model-a")
            wait_until(lambda: len(index.lookup(keys)) == 4, timeout=20)
            wait_until(lambda: any("status: batches=2 applied=2" in line for line in lines), 20)
            proc.send_signal(sig)
            proc.wait(20)
            reader.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(10)
            proc.stderr.close()
            index.close()
    err = "".join(lines)
    assert proc.returncode == 0, err
    assert f"received {sig.name}" in err
    assert "stopped: batches=2 applied=2" in err
    assert "blocks=+4/-0 gaps=0 replays=0" in err and "rejects=0" in err


@pytest.mark.redis
@pytest.mark.parametrize("engine", [None, "sglang", "vllm"])
def test_engine_option_maps_sglang_pages_once_per_block(
    redis_server_url: str, engine: str | None
) -> None:
    # SGLang at page size 1 stores a 100-token prompt: with --engine sglang, or without
    # --engine (SGLang's batches name it), the index maps the page ending each of its 6 blocks;
    # an endpoint said to be an engine that may free any page (vllm) maps every page as well.
    import redis as redis_py

    from kvredis import RedisIndex, RedisIndexConfig

    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    tokens = tuple(range(1000, 1100))
    keys = ChunkedTokenDatabase().tokens_to_kv_block_keys(0, tokens, "model-a")
    with FakeEngine(engine="sglang", page_size=1) as fake:
        args = ["--endpoint", fake.endpoint, *(["--engine", engine] if engine else [])]
        args += ["--redis", redis_server_url, "--namespace", namespace, "--duration", "30"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvredis.cli.ingest", *args],
            cwd=str(ROOT),
            stderr=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
        raw = redis_py.Redis.from_url(redis_server_url)
        try:
            fake.wait_subscribed(20)
            fake.store(tokens)
            wait_until(lambda: len(index.lookup(keys)) == 6, timeout=20)
            buckets = raw.keys(f"{namespace}:e:*")
            mappings = sum(raw.hlen(b) for b in buckets)
        finally:
            proc.terminate()
            proc.wait(20)
            index.drop_namespace()
            index.close()
            raw.close()
    assert mappings == (96 + 6 if engine == "vllm" else 6)


def _sample(body: str, name: str) -> float | None:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.redis
def test_metrics_port_serves_metrics_and_probes(redis_server_url: str) -> None:
    from kvredis import RedisIndex, RedisIndexConfig

    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with FakeEngine(topic="") as engine:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvredis", "ingest",
                "--endpoint", engine.endpoint, "--pod", "pod-a", "--model", "m",
                "--redis", redis_server_url, "--namespace", namespace,
                "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
            ],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_until(lambda: _get(base + "/healthz") == (200, "ok\n"), timeout=30)
            engine.wait_subscribed(20)
            wait_until(lambda: _get(base + "/readyz")[0] == 200, timeout=20)
            body = _get(base + "/readyz")[1]
            assert "redis: ok" in body and "endpoints: 1/1 connected" in body
            engine.publish([BlockStored((1, 2), None, tuple(range(32)), 16)])

            def stored() -> bool:
                return (
                    _sample(_get(base + "/metrics")[1], "kvredis_ingest_blocks_stored_total") == 2
                )

            wait_until(stored, timeout=20)
            body = _get(base + "/metrics")[1]
            assert _sample(body, "kvredis_ingest_batches_applied_total") == 1
            assert _sample(body, 'kvcache_index_admissions_total{backend="redis"}') == 2
            assert _sample(body, 'kvredis_ingest_rejects_total{reason="no_pod"}') == 0
            assert _sample(body, "kvredis_ingest_endpoints_connected") == 1
            assert _sample(body, 'kvredis_index_redis_round_trips_total{backend="redis"}')
            assert "process_resident_memory_bytes" in body
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
            with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace)) as ix:
                ix.drop_namespace()
    assert proc.returncode == 0, err


def test_empty_topic_without_pod_and_model_warns_and_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with FakeEngine(topic="") as engine, caplog.at_level(logging.INFO):

        def publish() -> None:
            engine.wait_subscribed(20)
            for _ in range(3):
                engine.publish([BlockStored((1,), None, tuple(range(16)), 16)])

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        result = CliRunner().invoke(
            cli,
            [
                "ingest",
                "--in-memory",
                "--endpoint",
                engine.endpoint,
                "--duration",
                "2",
                "--status-interval",
                "0.2",
            ],
        )
        thread.join(20)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("names no pod" in w for w in warnings), warnings
    assert result.exit_code == 1, result.output
    assert "give --pod and --model after each --endpoint" in result.output


def test_unresolvable_endpoint_host_is_an_error() -> None:
    result = CliRunner().invoke(cli, ["ingest", "--endpoint", "tcp://no-such-host.invalid:5557"])
    assert result.exit_code == 2
    assert "does not resolve" in result.output and "--endpoint" in result.output


@pytest.mark.parametrize(
    "spec", ["[1]", '{"mediums": {"GPU": ""}}', '{"tiers": {}}', "@/no/such/file.json", "{"]
)
def test_bad_tier_map_is_an_error(spec: str) -> None:
    result = CliRunner().invoke(
        cli, ["ingest", "--tier-map", spec, "--endpoint", "tcp://127.0.0.1:1", "--pod", "p"]
    )
    assert result.exit_code == 2 and "--tier-map" in result.output


@pytest.mark.parametrize(
    ("args", "blamed"),
    [(["--reset-medium", ""], "--reset-medium"), (["--offload-blocks-per-chunk", "0"], "chunk")],
)
def test_bad_fidelity_options_are_errors(args: list[str], blamed: str) -> None:
    result = CliRunner().invoke(
        cli, ["ingest", *args, "--endpoint", "tcp://127.0.0.1:1", "--pod", "p"]
    )
    assert result.exit_code == 2 and blamed in result.output


def test_bad_namespace_is_blamed_on_namespace() -> None:
    result = CliRunner().invoke(
        cli, ["ingest", "--endpoint", "tcp://127.0.0.1:1", "--namespace", "kv:r:x"]
    )
    assert result.exit_code == 2
    assert "'--namespace'" in result.output and "--redis" not in result.output


@pytest.mark.redis
def test_password_is_masked_in_ingest_output(redis_server_url: str) -> None:
    url = redis_server_url.replace("redis://", "redis://:topsecret9@")
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvredis", "ingest", "-v", "--endpoint", "tcp://127.0.0.1:1",
            "--pod", "p", "--model", "m", "--redis", url, "--duration", "0.2",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "topsecret9" not in proc.stdout + proc.stderr
    assert "***" in proc.stderr


class _Lines:
    """The lines a child process writes to a pipe, collected by a thread."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        self._thread.join(10)


def test_ctrl_c_with_redis_down_says_how_long_it_drains_and_a_second_one_exits_at_once(
    own_redis_server: RedisServer,
) -> None:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    with FakeEngine(topic="") as engine:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvredis", "ingest",
                "--endpoint", engine.endpoint, "--pod", "pod-a", "--model", "m",
                "--redis", own_redis_server.url, "--namespace", namespace,
                "--status-interval", "60",
            ],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        err = _Lines(proc.stderr)  # type: ignore[arg-type]
        try:
            engine.wait_subscribed(30)
            client = redis.Redis(port=own_redis_server.port)
            engine.publish([BlockStored((1,), None, tuple(range(16)), 16)])
            wait_until(lambda: bool(client.keys(f"{namespace}:*")), timeout=30)
            client.close()
            own_redis_server.stop()  # Redis goes down; the engine keeps publishing
            for n in range(300):
                engine.publish([BlockStored((n + 2,), None, tuple(range(16)), 16)])
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            wait_until(lambda: "press Ctrl-C again" in err.text, timeout=20)
            first = err.text
            assert "waiting at most 30 s" in first and "abandon them and exit now" in first
            time.sleep(0.3)
            assert proc.poll() is None  # still draining: Redis is down
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=10)  # the drain alone would go on for 30 s
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            err.close()
            proc.stderr.close()  # type: ignore[union-attr]
    assert code == 130, err.text
    last = err.text.splitlines()[-1]
    assert "exiting now" in last and "were not applied" in last and "pod-a:" in last, err.text


def test_a_topic_naming_pod_and_model_gives_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """docs/engines.md's setting: the engine names pod and model in its topic, the command
    names neither: every batch is applied, and nothing is logged at WARNING."""
    with FakeEngine("pod-t", "m", topic="kv@pod-t@m") as engine, caplog.at_level(logging.INFO):

        def publish() -> None:
            engine.wait_subscribed(20)
            engine.publish([BlockStored((1,), None, tuple(range(16)), 16)])

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        result = CliRunner().invoke(
            cli,
            [
                "ingest", "--in-memory", "--endpoint", engine.endpoint,
                "--duration", "2", "--status-interval", "0.2",
            ],
        )  # fmt: skip
        thread.join(20)
    assert result.exit_code == 0, result.output
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w for w in warnings if "in-memory" not in w] == []
    assert any("applied=1" in r.getMessage() for r in caplog.records)


def test_without_redis_ingest_uses_the_default_server_as_every_command(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --redis and a misspelled KVREDIS_REDIS_URL: the ingester works on
    redis://127.0.0.1:6379 (here refused, or a server there), never in memory, and the
    misspelling is named."""
    monkeypatch.delenv("KVREDIS_REDIS_URL", raising=False)
    monkeypatch.setenv("KVREDIS_REDIS_ULR", "redis://127.0.0.1:1")
    with caplog.at_level(logging.INFO):
        result = CliRunner().invoke(
            cli, ["ingest", "--endpoint", "tcp://127.0.0.1:1", "--pod", "p", "--model", "m",
                  "--duration", "0.2"],
        )  # fmt: skip
    assert "in-memory index" not in caplog.text
    said = result.output + caplog.text
    assert "redis://127.0.0.1:6379" in said, said
    assert "KVREDIS_REDIS_ULR is not one kvredis reads (did you mean KVREDIS_REDIS_URL?)" in said


def test_redis_and_in_memory_together_are_a_usage_error() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "ingest",
            "--in-memory",
            "--redis",
            "redis://127.0.0.1:1",
            "--endpoint",
            "tcp://127.0.0.1:1",
        ],
    )
    assert result.exit_code == 2 and "not both" in result.output


def test_in_memory_says_so_at_warning_and_in_readyz() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "kvredis", "ingest", "--in-memory",
            "--endpoint", "tcp://127.0.0.1:1", "--pod", "p", "--model", "m",
            "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
        ],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    err = _Lines(proc.stderr)  # type: ignore[arg-type]
    try:
        wait_until(lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, timeout=30)
        body = _get(f"http://127.0.0.1:{port}/readyz")[1]
        assert "index: in memory" in body and "nothing is durable" in body, body
    finally:
        proc.terminate()
        proc.wait(30)
        err.close()
        proc.stderr.close()  # type: ignore[union-attr]
    warning = [line for line in err.lines if " WARNING " in line and "--in-memory" in line]
    assert warning and "no router can read it" in warning[0], err.text

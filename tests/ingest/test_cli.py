"""``kvredis ingest``: argument errors, and a real run against a live engine and Redis."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from kvredis.hashing import ChunkedTokenDatabase
from kvredis.ingest.cli import ingest
from kvredis.ingest.events import BlockStored
from tests.ingest.engine import (
    FakeEngine,
    assert_no_leaked_ingesters,
    ingester_threads,
    wait_until,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        (["--endpoint", "http://h:1"], "is not a ZMQ endpoint"),
        (["--endpoint", "tcp://h"], "is not a ZMQ endpoint"),
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
        (["--endpoint", "tcp://h:1", "--redis", "http://nope"], "--redis"),
        (["--endpoint"], "requires an argument"),
    ],
)
def test_bad_arguments_exit_with_a_usage_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(ingest, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


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
                "kvredis.ingest.cli",
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
            cwd=ROOT,
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

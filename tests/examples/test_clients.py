"""No Python on the read path: the Go client of ``examples/go`` (standard library only) and
``redis-cli`` alone score an index the Python ingester filled from vLLM-shaped events, and get
exactly the Python client's block keys and scores."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvredis import RedisIndexConfig
from tests.examples.filled import MODEL, TOKENS, WEIGHTS, Filled, fill
from tests.redis.test_acl_functions import NEWER, ROLES
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
GO_DIR = ROOT / "examples" / "go"
SHELL = Path(__file__).resolve().parent / "test_redis_cli.sh"


@pytest.fixture
def filled(own_redis_server: RedisServer) -> Iterator[Filled]:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    yield fill(RedisIndexConfig(address=own_redis_server.url, namespace=namespace))


@pytest.fixture(scope="session")
def go_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("no go toolchain (Debian: apt-get install golang-go; scripts/install-servers)")
    tmp = tmp_path_factory.mktemp("go")
    env = {
        **os.environ,
        "GOCACHE": str(tmp / "cache"),
        "GOPATH": str(tmp / "path"),
        "GOPROXY": "off",
        "GOFLAGS": "-mod=mod",
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
    }
    out = tmp / "score"
    subprocess.run(
        [go, "vet", "."], cwd=GO_DIR, env=env, check=True, capture_output=True, timeout=300
    )
    subprocess.run(
        [go, "build", "-o", str(out), "."],
        cwd=GO_DIR,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def _go(binary: Path, server: RedisServer, namespace: str, *extra: str) -> dict[str, object]:
    import json

    weights = ",".join(f"{tier}={weight}" for tier, weight in WEIGHTS.items())
    done = subprocess.run(
        [str(binary), "-addr", f"127.0.0.1:{server.port}", "-namespace", namespace,
         "-model", MODEL, "-block-size", "16", "-weights", weights, "-tokens", "-", *extra],
        input=",".join(map(str, TOKENS)), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


#: keys per kvredis_score call: the whole chain in one call, or in parts (pod-b drops out in the
#: fourth part of 7 keys, pod-a in the fifth; each key its own call with 1)
PARTS = [None, 7, 1]


@pytest.mark.parametrize("per_call", PARTS)
def test_the_go_client_gets_the_python_keys_and_scores(
    go_binary: Path, own_redis_server: RedisServer, filled: Filled, per_call: int | None
) -> None:
    extra = () if per_call is None else ("-keys-per-call", str(per_call))
    got = _go(go_binary, own_redis_server, filled.namespace, *extra)
    assert got["keys"] == [str(k) for k in filled.keys]  # llm-d's fnv64a_cbor keys
    scores, ranks = got["scores"], got["ranks"]
    assert isinstance(scores, dict) and isinstance(ranks, dict)
    assert {pod: float(s) for pod, s in scores.items()} == filled.scores  # bit for bit
    assert filled.scores["pod-b"] != round(filled.scores["pod-b"], 6)  # a sum with rounding
    assert {
        pod: {int(rank): float(s) for rank, s in by_rank.items()} for pod, by_rank in ranks.items()
    } == filled.rank_scores  # each data-parallel rank on its own, as the Python client
    assert filled.scores["pod-e"] == sum([0.8] * 16)  # the best rank's, not the union of the ranks'


def test_the_go_client_runs_as_the_router_user(
    go_binary: Path, own_redis_server: RedisServer, filled: Filled
) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    line = ROLES["router"].replace("<ns>", filled.namespace).replace("<password>", "pw")
    rules = [r for r in line.split()[3:]]
    try:
        admin.execute_command("ACL", "SETUSER", "router", "reset", *rules)
    except redis.ResponseError:
        admin.execute_command(
            "ACL", "SETUSER", "router", "reset", *(r for r in rules if r not in NEWER)
        )
    finally:
        admin.close()
    got = _go(go_binary, own_redis_server, filled.namespace, "-user", "router", "-password", "pw")
    scores = got["scores"]
    assert isinstance(scores, dict)
    assert {pod: float(s) for pod, s in scores.items()} == filled.scores


@pytest.mark.parametrize("per_call", PARTS)
def test_redis_cli_alone_gets_the_python_scores(
    own_redis_server: RedisServer, filled: Filled, per_call: int | None
) -> None:
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is missing (it comes with redis-server: scripts/install-servers)")
    weights = " ".join(f"{tier} {weight!r}" for tier, weight in WEIGHTS.items())
    done = subprocess.run(
        ["bash", str(SHELL), "127.0.0.1", str(own_redis_server.port), filled.namespace,
         weights, *(f"{k:016x}" for k in filled.keys)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, **({} if per_call is None else {"SCORE_KEYS_PER_CALL": str(per_call)})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    ranks: dict[str, dict[int, float]] = {}
    for line in done.stdout.splitlines():
        pod, rank, score = line.split(" ")
        ranks.setdefault(pod, {})[int(rank)] = float(score)
    assert ranks == filled.rank_scores
    assert {pod: max(by_rank.values()) for pod, by_rank in ranks.items()} == filled.scores

"""No Python on the read path: the Go client of ``examples/go`` (standard library only) and
``redis-cli`` alone score an index the Python ingester filled from vLLM-shaped events, and get
exactly the Python client's block keys (both schemes: its XXH3-64 is checked digest for digest
against the xxhash library too) and scores; a namespace of another block key scheme than the
client's is a clear error naming both, never an empty score."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import xxhash

from kvredis import ChunkedTokenDatabase, RedisIndexConfig, TokenProcessorConfig
from tests.examples.filled import MODEL, TOKENS, WEIGHTS, Filled, fill
from tests.redis.test_acl_functions import PASSWORD, create, printed
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[2]
GO_DIR = ROOT / "examples" / "go"
SHELL = Path(__file__).resolve().parent / "test_redis_cli.sh"


#: the two block key schemes a namespace may hold
ALGOS = ["fnv64a_cbor", "xxh3_64"]


@pytest.fixture(params=ALGOS)
def filled(own_redis_server: RedisServer, request: pytest.FixtureRequest) -> Iterator[Filled]:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    config = RedisIndexConfig(address=own_redis_server.url, namespace=namespace)
    yield fill(config, request.param)


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


def _run_go(
    binary: Path, server: RedisServer, filled: Filled, *extra: str
) -> subprocess.CompletedProcess[str]:
    weights = ",".join(f"{tier}={weight}" for tier, weight in WEIGHTS.items())
    return subprocess.run(
        [str(binary), "-addr", f"127.0.0.1:{server.port}", "-namespace", filled.namespace,
         "-model", MODEL, "-block-size", "16", "-weights", weights, "-tokens", "-", *extra],
        input=",".join(map(str, TOKENS)), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _go(binary: Path, server: RedisServer, filled: Filled, *extra: str) -> dict[str, object]:
    algo = filled.scheme.split(":", 1)[0]
    done = _run_go(binary, server, filled, "-hash-algo", algo, *extra)
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
    got = _go(go_binary, own_redis_server, filled, *extra)
    assert got["keys"] == [str(k) for k in filled.keys]  # the namespace's scheme's keys
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
    try:  # the line `kvredis acl --role router NS` prints
        user = create(admin, printed("router", filled.namespace))
    finally:
        admin.close()
    got = _go(go_binary, own_redis_server, filled, "-user", user, "-password", PASSWORD)
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
         filled.scheme, weights, *(f"{k:016x}" for k in filled.keys)],
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


def test_a_go_client_of_another_scheme_fails_naming_both(
    go_binary: Path, own_redis_server: RedisServer, filled: Filled
) -> None:
    other = "xxh3_64" if filled.scheme.startswith("fnv64a_cbor") else "fnv64a_cbor"
    for extra in (("-hash-algo", other), ("-hash-seed", "7"), ("-block-size", "8")):
        args = extra if extra[0] == "-hash-algo" else ("-hash-algo", filled.scheme.split(":")[0],
                                                        *extra)  # fmt: skip
        done = _run_go(go_binary, own_redis_server, filled, *args)
        assert done.returncode == 1 and done.stdout == "", done.stdout
        assert "holds block keys of scheme" in done.stderr, done.stderr
        algo, size, _ = filled.scheme.split(":", 2)
        assert f"{algo} (block size {size}, hash seed '')" in done.stderr, done.stderr


def test_redis_cli_refuses_keys_of_another_scheme(
    own_redis_server: RedisServer, filled: Filled
) -> None:
    other = "xxh3_64:16:" if filled.scheme.startswith("fnv64a_cbor") else "fnv64a_cbor:16:"
    done = subprocess.run(
        ["bash", str(SHELL), "127.0.0.1", str(own_redis_server.port), filled.namespace, other,
         "gpu 1", *(f"{k:016x}" for k in filled.keys)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert f"holds block keys of scheme {filled.scheme}, these keys are of {other}" in done.stderr


@pytest.mark.parametrize("algo", ALGOS)
def test_the_go_client_computes_the_python_keys_byte_for_byte(go_binary: Path, algo: str) -> None:
    """The same prompts, models, hash seeds and block sizes (blocks of 4 to 1,200 bytes: every
    length class of XXH3) give the same keys in Go and in Python."""
    rng = random.Random(7)
    roots = (("", MODEL), ("42", "m"), ("sëed", "a/LoRA-" + "x" * 70))
    cases = [(bs, seed, model) for bs in (1, 2, 3, 4, 16, 31, 45, 64, 300) for seed, model in roots]
    for bs, seed, model in cases:
        tokens = [rng.randrange(2**32) for _ in range(bs * 5 + rng.randrange(bs))]
        config = TokenProcessorConfig(block_size_tokens=bs, hash_algo=algo, hash_seed=seed)
        want = ChunkedTokenDatabase(config).tokens_to_kv_block_keys(0, tokens, model)
        done = subprocess.run(
            [str(go_binary), "-keys-only", "-hash-algo", algo, "-hash-seed", seed,
             "-block-size", str(bs), "-model", model, "-tokens", "-"],
            input=",".join(map(str, tokens)), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["keys"] == [str(k) for k in want], (bs, seed, model)


def test_the_go_xxh3_is_the_xxhash_librarys_digest_for_digest(go_binary: Path) -> None:
    rng = random.Random(11)
    lengths = [*range(0, 260), 511, 512, 1023, 1024, 1025, 2048, 2049, 4096, 5000]
    lines, want = [], []
    for n in lengths:
        for seed in (0, 1, rng.getrandbits(64)):
            message = rng.randbytes(n)
            lines.append(f"{seed} {message.hex()}")
            want.append(f"{xxhash.xxh3_64_intdigest(message, seed):016x}")
    done = subprocess.run(
        [str(go_binary), "-xxh3-digests"], input="\n".join(lines) + "\n",
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == want

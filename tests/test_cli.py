"""The kvredis command line: demo, keys, and argument errors."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from kvredis.cli import cli
from kvredis.demo import WorkloadConfig, generate_requests, routers, simulate
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.memory import InMemoryIndex

SMALL = [
    "--pods",
    "4",
    "--conversations",
    "24",
    "--turns",
    "3",
    "--system-prompts",
    "3",
    "--gpu-blocks",
    "300",
    "--cpu-blocks",
    "300",
    "--no-progress",
]


def _rates(output: str) -> dict[str, float]:
    rates = {}
    for line in output.splitlines():
        m = re.match(r"^(random|kvredis)\s+\d+\s+\d+\s+([\d.]+)%", line)
        if m:
            rates[m.group(1)] = float(m.group(2))
    return rates


def test_demo_memory_prefers_kvredis_routing() -> None:
    result = CliRunner().invoke(cli, ["demo", *SMALL])
    assert result.exit_code == 0, result.output
    rates = _rates(result.output)
    assert set(rates) == {"random", "kvredis"}
    assert rates["kvredis"] > rates["random"]


def test_demo_cost_aware_backend_runs() -> None:
    result = CliRunner().invoke(cli, ["demo", "--backend", "cost-aware", *SMALL])
    assert result.exit_code == 0, result.output
    assert _rates(result.output)["kvredis"] > 0


@pytest.mark.redis
def test_demo_on_redis_matches_memory(redis_server_url: str) -> None:
    """The same seeded workload routes identically on Redis and in memory."""
    mem = CliRunner().invoke(cli, ["demo", *SMALL])
    red = CliRunner().invoke(cli, ["demo", "--redis", redis_server_url, *SMALL])
    assert red.exit_code == 0, red.output
    assert _rates(red.output) == _rates(mem.output)


def test_demo_index_is_empty_afterwards() -> None:
    cfg = WorkloadConfig(
        pods=3,
        conversations=10,
        turns=2,
        system_prompts=2,
        gpu_blocks_per_pod=100,
        cpu_blocks_per_pod=50,
    )
    requests = generate_requests(cfg)
    index = InMemoryIndex()
    name, router = routers(cfg)[1]
    result = simulate(cfg, requests, index, name, router)
    assert result.hit_tokens > 0
    keys = ChunkedTokenDatabase().tokens_to_kv_block_keys(0, list(requests[-1].prompt), cfg.model)
    assert index.lookup(keys) == {}


def test_keys_prints_block_keys() -> None:
    tokens = list(range(1, 40))
    result = CliRunner().invoke(
        cli, ["keys", "--model", "m", "--tokens", ",".join(map(str, tokens))]
    )
    assert result.exit_code == 0, result.output
    expected = ChunkedTokenDatabase().tokens_to_kv_block_keys(0, tokens, "m")
    assert len(expected) == 2
    assert result.output.split() == [str(x) for pair in enumerate(expected) for x in pair]


def test_keys_fnv_algorithm_and_block_size() -> None:
    tokens = list(range(8))
    result = CliRunner().invoke(
        cli,
        [
            "keys",
            "--model",
            "m",
            "--tokens",
            "0,1,2,3,4,5,6,7",
            "--block-size",
            "4",
            "--hash-algo",
            "fnv64a_cbor",
        ],
    )
    assert result.exit_code == 0, result.output
    db = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=4, hash_algo="fnv64a_cbor"))
    assert result.output.split()[1::2] == [
        str(k) for k in db.tokens_to_kv_block_keys(0, tokens, "m")
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "--model", "m", "--tokens", "1,x,3"],
        ["keys", "--model", "m", "--tokens", "1,2", "--block-size", "-1"],
        ["keys", "--model", "m", "--tokens", "-5"],
        ["demo", "--pods", "0"],
    ],
)
def test_bad_arguments_exit_nonzero(args: list[str]) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "Error" in result.output


def test_demo_reports_an_unreachable_or_malformed_redis() -> None:
    from tests.servers import free_port

    address = f"redis://127.0.0.1:{free_port()}"
    down = CliRunner().invoke(cli, ["demo", "--redis", address, *SMALL])
    assert down.exit_code == 1
    assert f"127.0.0.1:{address.rsplit(':', 1)[1]}" in down.output
    bad = CliRunner().invoke(cli, ["demo", "--redis", "http://nope", *SMALL])
    assert bad.exit_code == 2
    assert "--redis" in bad.output

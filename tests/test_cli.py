"""The kvredis command line: demo, keys, and argument errors."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

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


def _keys(*args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        cli, ["keys", "--model", "m", "--block-size", "2", *args], input=input
    )
    return result.exit_code, result.output


def test_keys_tokens_separated_by_spaces_are_not_glued() -> None:
    expected = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=2))
    keys = [str(k) for k in expected.tokens_to_kv_block_keys(0, [1, 2, 3, 4], "m")]
    for spelling in ("1 2 3 4", "1,2,3,4", "1, 2,3 4", "[1, 2, 3, 4]"):
        code, out = _keys("--tokens", spelling)
        assert code == 0, out
        assert out.split()[1::2] == keys, spelling


def test_keys_tokens_from_file_and_stdin(tmp_path: Path) -> None:
    tokens = list(range(30_000))
    path = tmp_path / "prompt.txt"
    path.write_text("\n".join(map(str, tokens)))
    code, from_file = _keys("--tokens-file", str(path))
    assert code == 0, from_file
    assert len(from_file.splitlines()) == 15_000
    code, from_stdin = _keys("--tokens", "-", input=" ".join(map(str, tokens)))
    assert code == 0 and from_stdin == from_file
    code, out = _keys("--tokens", "1,2", "--tokens-file", str(path))
    assert code == 2 and "exactly one of --tokens, --tokens-file and -" in out


def test_keys_bare_dash_reads_stdin() -> None:
    code, expected = _keys("--tokens", "1,2,3,4")
    assert code == 0, expected
    code, out = _keys("-", input="1 2 3 4\n")
    assert code == 0, out
    assert out == expected
    code, out = _keys("-", "--tokens", "1,2", input="1 2 3 4")
    assert code == 2 and "exactly one of" in out
    code, out = _keys("prompt.txt")
    assert code == 2 and "'-'" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["keys", "--model", "m", "--tokens", "1,2", "--block-size", "0"], "--block-size"),
        (["keys", "--model", "", "--tokens", "1,2"], "--model"),
        (["keys", "--model", "  ", "--tokens", "1,2"], "must not be empty"),
        (["keys", "--model", "m", "--tokens", "1,,2x"], "is not a token id"),
        (["keys", "--model", "m", "--tokens", ""], "no token ids"),
        (["keys", "--model", "m"], "exactly one of --tokens, --tokens-file and -"),
        (["keys", "--model", "m", "--tokens", "1", "--seed", "a", "--hash-seed", "b"], "--seed"),
        (["demo", "--namespace", "x:e"], "--namespace"),
    ],
)
def test_hygiene_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_seed_is_a_hidden_alias_of_hash_seed() -> None:
    new = _keys("--tokens", "1,2,3,4", "--hash-seed", "42")
    old = _keys("--tokens", "1,2,3,4", "--seed", "42")
    plain = _keys("--tokens", "1,2,3,4")
    assert new == old and new[0] == 0 and new != plain
    help_text = CliRunner().invoke(cli, ["keys", "--help"]).output
    assert "--hash-seed" in help_text and "--seed" not in help_text.replace("--hash-seed", "")


def test_verbose_and_log_level_anywhere(caplog: pytest.LogCaptureFixture) -> None:
    for args in (
        ["-v", "keys", "--model", "m", "--tokens", "1,2"],
        ["keys", "--model", "m", "--tokens", "1,2", "-v"],
        ["keys", "-v", "--model", "m", "--tokens", "1,2"],
        ["--log-level", "info", "keys", "--model", "m", "--tokens", "1,2"],
        ["keys", "--model", "m", "--tokens", "1,2", "--log-level", "info"],
    ):
        logging.getLogger("kvredis").setLevel(logging.WARNING)
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
        assert logging.getLogger("kvredis").level == logging.INFO, args


@pytest.mark.parametrize(
    "command",
    [
        "demo",
        "keys",
        "ingest",
        "stats",
        "pods",
        "lookup",
        "score",
        "clear",
        "check",
        "watermarks",
        "dump",
        "restore",
        "migrate",
        "drop",
        "rename",
        "acl",
    ],
)
def test_every_command_has_an_example_and_log_options(command: str) -> None:
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output and "kvredis " in result.output
    assert "--log-level" in result.output and "-v, --verbose" in result.output


@pytest.mark.redis
def test_demo_namespace_is_cleaned_up_and_password_masked(redis_server_url: str) -> None:
    import redis

    server = redis.Redis.from_url(redis_server_url)
    name = f"kvt-demo-{uuid.uuid4().hex[:8]}"
    result = CliRunner().invoke(
        cli, ["demo", "--redis", redis_server_url, "--namespace", name, *SMALL]
    )
    assert result.exit_code == 0, result.output
    assert list(server.scan_iter(match=f"{name}*")) == []
    shown = redis_server_url.replace("redis://", "redis://:pw-hidden@")
    masked = CliRunner().invoke(cli, ["demo", "--redis", shown, *SMALL])
    assert "pw-hidden" not in masked.output


@pytest.mark.parametrize(
    "spelling",
    [
        "1,,2",
        "1,2,",
        ",1,2",
        "1, ,2",
        '[1, 2, "3"]',
        "[1, true]",
        "[1, 2.0]",
        "[1, null]",
        "[[1]]",
        "\uff11\uff12",  # full-width digits
        "1 \u0662",  # an Arabic-Indic digit
        "+1",
        "0x10",
        "1_000",
    ],
)
def test_every_malformed_token_list_is_the_promised_error(spelling: str) -> None:
    code, out = _keys("--tokens", spelling)
    assert code == 2, out
    assert "is not a token id" in out and "--tokens" in out


def test_token_ids_beyond_uint32_are_refused_as_such() -> None:
    code, out = _keys("--tokens", f"1 {2**32}")
    assert code == 2 and "out of range" in out and "--tokens" in out
    code, out = _keys("--tokens", f"1 {2**32 - 1}")
    assert code == 0, out


@pytest.mark.parametrize("weight", ["cpu=-1", "cpu=nan", "cpu=inf", "cpu=-inf", "cpu=\uff11"])
def test_score_refuses_negative_non_finite_or_non_ascii_weights(weight: str) -> None:
    result = CliRunner().invoke(
        cli,
        ["score", "--model", "m", "--tokens", "1,2", "--redis", "redis://127.0.0.1:1",
         "--weight", weight],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--weight" in result.output and "127.0.0.1:1" not in result.output


def test_every_command_on_a_server_defaults_to_the_local_one() -> None:
    """One rule: --redis (env KVREDIS_REDIS_URL) defaults to redis://127.0.0.1:6379 for every
    command that works on a server; only the demo runs embedded without it."""
    import click

    from kvredis.cli.options import DEFAULT_REDIS_URL

    def commands(group: click.Group) -> list[tuple[str, click.Command]]:
        out: list[tuple[str, click.Command]] = []
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                out += [(f"{name} {n}", c) for n, c in commands(command)]
            else:
                out.append((name, command))
        return out

    defaults = {}
    for name, command in commands(cli):  # type: ignore[arg-type]
        for param in command.params:
            if isinstance(param, click.Option) and "--redis" in param.opts:
                assert param.envvar == "KVREDIS_REDIS_URL", name
                defaults[name] = param.default
    assert "ingest" in defaults and "functions show" in defaults
    assert {n: d for n, d in defaults.items() if d != DEFAULT_REDIS_URL} == {
        "demo": None,  # embedded unless --redis
        "acl": None,  # prints without a server; --redis tailors the line
    }


def test_an_unknown_kvredis_variable_is_named(caplog: pytest.LogCaptureFixture) -> None:
    from kvredis.cli.options import unknown_environment

    lines = unknown_environment(
        {"KVREDIS_REDIS_URI": "x", "KVREDIS_NAMESPACE": "kv", "KVREDIS_TEST_CALLS": "scripts"}
    )
    assert len(lines) == 1 and "did you mean KVREDIS_REDIS_URL?" in lines[0]

"""Every command of the command line that works on a server, against the three ways a server
is not there for it: a refused connection, a server that wants a password, a port that is not
Redis (an HTTP server). Each prints one ``Error: ...`` line on stderr and exits 1: never a
traceback."""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import redis
from click.testing import CliRunner

from kvredis.cli import cli
from kvredis.redis.inspect import DUMP_FORMAT
from kvredis.testing.servers import RedisServer, free_port

#: The arguments each command is run with (besides --redis URL).
COMMANDS: dict[str, list[str]] = {
    "demo": ["demo", "--pods", "1", "--conversations", "2", "--no-progress"],
    "ingest": ["ingest", "--endpoint", "tcp://127.0.0.1:1", "--pod", "p", "--model", "m"],
    "stats": ["stats"],
    "pods": ["pods"],
    "lookup": ["lookup", "--model", "m", "--tokens", "1,2", "--block-size", "1"],
    "score": ["score", "--model", "m", "--tokens", "1,2", "--block-size", "1"],
    "clear": ["clear", "--pod", "p", "--yes"],
    "check": ["check"],
    "watermarks": ["watermarks"],
    "dump": ["dump", "{tmp}/out.jsonl"],
    "restore": ["restore", "{tmp}/in.jsonl"],
    "rename": ["rename", "kv-a", "kv-b", "--yes"],
    "migrate": ["migrate", "kv"],
    "drop": ["drop", "kv", "--yes"],
    "functions load": ["functions", "load"],
    "functions show": ["functions", "show"],
    "acl": ["acl", "--role", "ingester", "kv"],
}


def _server_commands(group: click.Group, prefix: str = "") -> set[str]:
    found: set[str] = set()
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found |= _server_commands(command, f"{prefix}{name} ")
        elif any("--redis" in p.opts for p in command.params if isinstance(p, click.Option)):
            found.add(prefix + name)
    return found


def test_every_command_that_takes_a_server_is_tried() -> None:
    assert _server_commands(cli) == set(COMMANDS)


@pytest.fixture(scope="module")
def password_url() -> Iterator[str]:
    server = RedisServer("redis")
    server.start()
    redis.Redis(port=server.port).config_set("requirepass", "s3cret-pw")
    try:
        yield server.url
    finally:
        server.close()


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Nothing on stderr (the command's stderr is what the test reads)."""


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("failure", ["refused", "password", "not-redis"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_one_error_line_and_exit_1(
    command: str, failure: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if failure == "refused":
        url, says = f"redis://127.0.0.1:{free_port()}", "cannot reach"
    elif failure == "password":
        url, says = request.getfixturevalue("password_url"), "requires a password"
    else:  # an HTTP server's answer, or its closing the connection on the request
        url, says = request.getfixturevalue("http_url"), "Redis/Valkey server answers|cannot reach"
    records = [{"format": DUMP_FORMAT, "namespace": "kv", "bucket_bits": 16}]
    records.append({"end": True, "keys": 0, "records": 0})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[command]]
    result = CliRunner().invoke(cli, [*args, "--redis", url])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and re.search(says, lines[0]), lines[0]
    assert url.rsplit(":", 1)[1] in lines[0]  # names the server

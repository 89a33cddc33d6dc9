"""Least privilege on the Functions path: the ACL lines of docs/operations.md ("Access
control"), each role working with exactly its documented line on Redis 7.0 and Valkey 9, and a
router unable to change any key through any function."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvredis import RedisIndex, RedisIndexConfig
from kvredis.cli import cli
from kvredis.errors import BackendError
from kvredis.redis.functions import function_name, shipped_library
from tests.examples.filled import WEIGHTS, fill
from tests.servers import RedisServer

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
#: The roles' ACL lines as docs/operations.md gives them (<ns>, <password> filled in by a test).
ROLES = {
    "router": "ACL SETUSER router on ><password> resetkeys %R~<ns>:* resetchannels -@all "
    "+fcall_ro +ping +hello +client|setname +client|setinfo "
    "+hget +hmget +hgetall +hexists +exists +get +time",
    "ingester": "ACL SETUSER ingester on ><password> resetkeys ~<ns>:* resetchannels -@all "
    "+fcall +fcall_ro +ping +hello +client|setname +client|setinfo +info +scan "
    "+hget +hmget +hgetall +hexists +hstrlen +exists +get +type +time "
    "+hset +hsetnx +hdel +set +del +unlink +pexpireat +hpexpireat",
    "kvredis-admin": "ACL SETUSER kvredis-admin on ><password> resetkeys resetchannels -@all "
    "+function|load +fcall_ro +ping +hello +client|setname +client|setinfo",
}
#: Commands a line names that older servers do not have (Redis 7.0: CLIENT SETINFO arrived in
#: 7.2, HPEXPIREAT in 7.4); the doc says to leave them out there.
NEWER = ("+client|setinfo", "+hpexpireat")


def test_the_documented_lines_are_these() -> None:
    text = " ".join(DOC.read_text().split())
    for role, line in ROLES.items():
        assert line in text, role


def _create(admin: redis.Redis, role: str, namespace: str, password: str) -> None:
    rules = ROLES[role].replace("<ns>", namespace).replace("<password>", password).split()[3:]
    try:
        admin.execute_command("ACL", "SETUSER", role, "reset", *rules)
    except redis.ResponseError as exc:
        assert "Unknown command" in str(exc) or "unknown" in str(exc).lower(), exc
        kept = [r for r in rules if r not in NEWER]
        admin.execute_command("ACL", "SETUSER", role, "reset", *kept)


@pytest.fixture
def users(own_redis_server: RedisServer) -> Iterator[tuple[str, redis.Redis]]:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    admin = redis.Redis(port=own_redis_server.port)
    for role in ROLES:
        _create(admin, role, namespace, f"{role}-pw")
    yield namespace, admin
    admin.close()


def _url(server: RedisServer, role: str) -> str:
    return f"redis://{role}:{role}-pw@127.0.0.1:{server.port}"


def _dump(admin: redis.Redis, namespace: str) -> dict[bytes, bytes | None]:
    return {k: admin.dump(k) for k in admin.scan_iter(match=f"{namespace}:*", count=1000)}


def test_each_role_works_with_its_line_and_a_router_cannot_write(
    own_redis_server: RedisServer, users: tuple[str, redis.Redis]
) -> None:
    namespace, admin = users
    loaded = CliRunner().invoke(
        cli, ["functions", "load", "--redis", _url(own_redis_server, "kvredis-admin")]
    )
    assert loaded.exit_code == 0, loaded.output

    ingest = RedisIndexConfig(address=_url(own_redis_server, "ingester"), namespace=namespace)
    filled = fill(ingest)
    with RedisIndex(ingest) as ingester:
        assert ingester.registry.active  # FCALL, not the EVALSHA fallback
        ingester.clear("pod-c")
        other_scores = ingester.score(filled.other_keys, WEIGHTS)
    assert "pod-c" not in other_scores and other_scores.get("pod-b") == 3.2

    route = RedisIndexConfig(address=_url(own_redis_server, "router"), namespace=namespace)
    with RedisIndex(route) as router:
        assert router.registry.active
        assert router.score(filled.keys, WEIGHTS) == filled.scores
        assert router.lookup(filled.keys[:5])
        assert router.score(filled.other_keys, WEIGHTS) == other_scores
    before = _dump(admin, namespace)
    assert before

    client = redis.Redis.from_url(_url(own_redis_server, "router"))
    try:
        keys = [f"{namespace}:meta", f"{namespace}:pi", f"{namespace}:pp", f"{namespace}:sx"]
        for name, read in shipped_library().reads.items():
            if read:
                continue
            for verb in ("FCALL", "FCALL_RO"):
                with pytest.raises(redis.ResponseError) as refused:
                    client.execute_command(verb, function_name(name), len(keys), *keys, "x")
                assert re.search(r"NOPERM|no permissions|write flag", str(refused.value), re.I), (
                    verb,
                    name,
                    refused.value,
                )
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.hset(f"{namespace}:meta", "gen", "x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.function_load(shipped_library().code.decode(), replace=True)
    finally:
        client.close()
    assert _dump(admin, namespace) == before  # nothing changed


def test_a_router_waits_for_a_flushed_library_and_recovers(
    own_redis_server: RedisServer, users: tuple[str, redis.Redis]
) -> None:
    namespace, admin = users
    admin.function_load(shipped_library().code.decode())
    filled = fill(RedisIndexConfig(address=own_redis_server.url, namespace=namespace))
    route = RedisIndexConfig(address=_url(own_redis_server, "router"), namespace=namespace)
    with RedisIndex(route) as router:
        assert router.score(filled.keys, WEIGHTS) == filled.scores
        admin.function_flush()
        with pytest.raises(BackendError, match="function"):  # it may neither load nor EVALSHA
            router.score(filled.keys, WEIGHTS)
        admin.function_load(shipped_library().code.decode())  # the operator loads it again
        assert router.score(filled.keys, WEIGHTS) == filled.scores
        assert router.registry.active

"""Least privilege, measured: the ACL each role of kvredis needs (docs/operations.md, "Access
control") on real Redis 7.0 and Valkey 9 servers.

For each role an ACL user with exactly the documented rules runs that role's whole surface
(router: lookup and score, sync and async, with the handshake redis-py sends; ingester: the
writes of the ingest path; operator: the CLI's stats, pods, watermarks, check, dump, restore,
clear and drop), and the same user without any one of the listed commands cannot: the list is
minimal. A router user cannot change a key through any call: every write API, and a raw FCALL
of every function and EVALSHA of every script that may write, is refused, and every key of the
namespace, its value and expiry times are the same afterwards."""

from __future__ import annotations

import asyncio
import shlex
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from click.testing import CliRunner

from kvredis import (
    AddOp,
    AsyncRedisIndex,
    EvictOp,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.cli import cli
from kvredis.errors import KVRedisError
from kvredis.ingest.chains import Tail
from kvredis.ingest.journal import RedisPageJournal, encode_entry, journal_for
from kvredis.redis.functions import api_argument, function_name, shipped_library
from kvredis.redis.layout import EXPIRY_FIELD, EXPIRY_KEY
from kvredis.redis.ops import expiry_mode_of
from kvredis.redis.requests import Command, ScriptCall
from kvredis.redis.scripts import ScriptRegistry
from tests.conftest import TEST_PREFIX

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu")
SPEC = PodEntry("pod-s", "gpu", speculative=True)
KEYS = list(range(1, 40))
WEIGHTS = {"gpu": 1.0, "cpu": 0.5}
PASSWORD = "kvredis-acl-test"

#: The commands each role runs, as docs/operations.md's "Access control" lists them: the whole
#: ACL is ``on >password resetkeys ~<ns>:* resetchannels -@all``, these, and :data:`EXPIRY`'s.
ROLES: dict[str, tuple[str, ...]] = {
    "router": (
        "+evalsha",
        "+script|load",
        "+hmget",
        "+hget",
        "+exists",
        "+time",
        "+ping",
        "+client|setname",
    ),
    "ingester": (
        "+evalsha",
        "+script|load",
        "+hmget",
        "+hget",
        "+hgetall",
        "+hexists",
        "+hstrlen",
        "+hset",
        "+hdel",
        "+get",
        "+set",
        "+del",
        "+exists",
        "+type",
        "+scan",
        "+time",
        "+ping",
        "+client|setname",
        "+rpush",
        "+lrange",
        "+llen",
        "+watch",
        "+unwatch",
        "+multi",
        "+exec",
    ),
    "operator": (
        "+evalsha",
        "+script|load",
        "+hmget",
        "+hget",
        "+hgetall",
        "+hscan",
        "+hlen",
        "+hexists",
        "+hset",
        "+hdel",
        "+get",
        "+set",
        "+del",
        "+unlink",
        "+exists",
        "+type",
        "+scan",
        "+memory|usage",
        "+info",
        "+time",
        "+ping",
        "+client|setname",
    ),
}
#: The expiry commands of each role, by how the namespace expires speculative entries
#: (kvredis.redis.ops.expiry_mode_of: per hash field on Redis 7.4+ and Valkey 9+, else per key).
EXPIRY: dict[str, dict[str, tuple[str, ...]]] = {
    EXPIRY_FIELD: {
        "router": (),
        "ingester": ("+info", "+hpexpireat"),
        "operator": ("+hpexpireat", "+hpexpiretime"),
    },
    EXPIRY_KEY: {
        "router": (),
        "ingester": ("+pexpireat",),
        "operator": ("+pexpireat", "+pexpiretime"),
    },
}


def commands_of(role: str, mode: str) -> tuple[str, ...]:
    return ROLES[role] + EXPIRY[mode][role]


def acl_rules(namespace: str, commands: tuple[str, ...]) -> list[str]:
    head = ["reset", "on", f">{PASSWORD}", "resetkeys", f"~{namespace}:*", "resetchannels"]
    return [*head, "-@all", *commands]


def user_url(url: str, user: str) -> str:
    return url.replace("redis://", f"redis://{quote(user)}:{quote(PASSWORD)}@", 1)


def config(url: str, namespace: str) -> RedisIndexConfig:
    return RedisIndexConfig(address=url, namespace=namespace)


# -- the roles' surfaces ----------------------------------------------------------------------


def populate(url: str, namespace: str) -> None:
    """What a router reads: entries on two tiers, a live expiring entry (its reads then go
    through the expiring buckets and the server's clock), engine mappings, a watermark."""
    with RedisIndex(config(url, namespace)) as index:
        index.add([1001, 1002], KEYS, [A])
        index.add(None, KEYS[:20], [B])
        index.add(None, KEYS[:5], [SPEC], ttl=600)
        index.apply_batch([AddOp(None, (KEYS[0],), (B,))], "pod-b", Watermark(1, 1))


def router(url: str, namespace: str) -> None:
    """lookup and score, with and without a pod filter, on a sync and an async client."""
    with RedisIndex(config(url, namespace)) as index:
        assert len(index.lookup(KEYS)) == len(KEYS)
        assert len(index.lookup(KEYS, {"pod-b"})) == 20
        assert index.score(KEYS, WEIGHTS) == {"pod-a": 39.0, "pod-b": 10.0, "pod-s": 5.0}
        assert index.score(KEYS, WEIGHTS, {"pod-b"}) == {"pod-b": 10.0}

    async def run() -> None:
        async with AsyncRedisIndex(config(url, namespace)) as index:
            assert len(await index.lookup(KEYS)) == len(KEYS)
            assert await index.score(KEYS, WEIGHTS, {"pod-a"}) == {"pod-a": 39.0}

    asyncio.run(run())


def ingester(url: str, namespace: str) -> None:
    """The writes of the ingest path (a new namespace): stored and removed blocks with engine
    keys, speculative entries, fenced batches, all-blocks-cleared, and the reads it makes."""
    with RedisIndex(config(url, namespace)) as index:
        index.add([2001, 2002], KEYS[:10], [A])
        index.add(None, KEYS[:3], [SPEC], ttl=600)
        index.evict(KEYS[9], KeyType.REQUEST, [A])
        index.evict(2001, KeyType.ENGINE, [A])
        assert index.get_request_key(2002) in KEYS
        batch = [AddOp((2003,), tuple(KEYS[10:20]), (B,)), EvictOp(2002, KeyType.ENGINE, (A,))]
        assert index.apply_batch(batch, "pod-b", Watermark(1, 5))
        assert index.get_watermark("pod-b") == Watermark(1, 5)
        index.reset_watermark("pod-b", None)
        index.clear("pod-b")
        assert index.lookup(KEYS[:3]) == {k: [SPEC] for k in KEYS[:3]}
        index.evict(KEYS[0], KeyType.REQUEST, [SPEC])  # an expiring entry removed before it expires
        assert index.lookup(KEYS[:3]) == {}
        page_journals(index)


def page_journals(index: RedisIndex) -> None:
    """What ingesters do with the pods' page journals: append (one entry, and several in one
    round trip), read, compact from memory and by replay (under WATCH), skip a compaction of a
    journal of one entry, and delete."""
    journal = journal_for(index)
    assert isinstance(journal, RedisPageJournal)
    first = encode_entry({7: Tail(0, "m", None, (1, 2, 3), engine_keys=(7,))}, frozenset())
    second = encode_entry({}, frozenset({7}))
    journal.append([("pod-a", first)])
    journal.append([("pod-a", second), ("pod-b", first)])
    assert journal.read("pod-a") == [first, second]
    assert journal.compact("pod-b") is None  # one entry: nothing to rewrite
    assert journal.compact("pod-a", 2, lambda: first) == len(first)
    journal.append([("pod-a", second)])
    assert journal.compact("pod-a") is not None
    assert len(journal.read("pod-a")) == 1
    journal.delete("pod-a")
    journal.delete("pod-b")
    assert journal.read("pod-a") == journal.read("pod-b") == []


def cli_run(url: str, namespace: str, *args: str) -> str:
    result = CliRunner().invoke(cli, [*args, "--redis", url, "--namespace", namespace])
    if result.exit_code != 0:
        raise RuntimeError(f"kvredis {' '.join(args)} exited {result.exit_code}: {result.output}")
    return result.output


def operator(url: str, namespace: str, tmp: Path) -> None:
    """The operator's CLI on a namespace a router reads (stats, pods, watermarks, check, dump,
    restore in its place, clear of a pod), and the drop of the namespace."""
    for command in ("stats", "pods", "watermarks", "check"):
        cli_run(url, namespace, command)
    dump = tmp / "dump.jsonl"
    cli_run(url, namespace, "dump", "--no-progress", str(dump))
    cli_run(url, namespace, "restore", "--replace", str(dump))
    cli_run(url, namespace, "clear", "--pod", "pod-a", "--yes", "--no-progress")
    with RedisIndex(config(url, namespace)) as index:
        assert index.drop_namespace() > 0


# -- the tests --------------------------------------------------------------------------------


Workload = Callable[[str, str, Path], None]
WORKLOADS: dict[str, Workload] = {
    "router": lambda url, ns, _: router(url, ns),
    "ingester": lambda url, ns, _: ingester(url, ns),
    "operator": operator,
}


class Server:
    """The server of the test, an admin client, and ACL users made for the test."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.admin = redis.Redis.from_url(url)
        self.mode = expiry_mode_of(self.admin.info("server"))
        self.users: list[str] = []
        self.namespaces: list[str] = []

    def namespace(self, role: str) -> str:
        """A fresh namespace, holding what the role works on (an ingester starts empty)."""
        ns = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
        self.namespaces.append(ns)
        if role != "ingester":
            populate(self.url, ns)
        self.admin.script_flush()  # the role loads the scripts it runs
        return ns

    def user(self, namespace: str, commands: tuple[str, ...]) -> str:
        """The URL of a new user allowed ``commands`` on the keys of ``namespace``."""
        name = f"{TEST_PREFIX}{uuid.uuid4().hex[:8]}"
        self.admin.execute_command("ACL", "SETUSER", name, *acl_rules(namespace, commands))
        self.users.append(name)
        return user_url(self.url, name)

    def snapshot(self, namespace: str) -> dict[bytes, Any]:
        """Every key of the namespace: its value, expiry time, and (with hash field expiry) its
        fields' expiry times."""
        out: dict[bytes, Any] = {}
        for key in self.admin.scan_iter(match=f"{namespace}:*", count=1000):
            expires = self.admin.execute_command("PEXPIRETIME", key)
            if self.admin.type(key) != b"hash":
                out[key] = (self.admin.get(key), expires)
                continue
            fields = self.admin.hgetall(key)
            if self.mode == EXPIRY_FIELD:
                names = list(fields)
                times = self.admin.execute_command(
                    "HPEXPIRETIME", key, "FIELDS", len(names), *names
                )
                expires = (expires, dict(zip(names, times, strict=True)))
            out[key] = (fields, expires)
        return out

    def dump(self, namespace: str) -> dict[bytes, tuple[bytes, int]]:
        keys = self.admin.scan_iter(match=f"{namespace}:*", count=1000)
        return {k: (self.admin.dump(k), self.admin.execute_command("PEXPIRETIME", k)) for k in keys}

    def close(self) -> None:
        for name in self.users:
            self.admin.execute_command("ACL", "DELUSER", name)
        for ns in self.namespaces:  # and what a refused role left (the copy of a restore)
            for key in self.admin.scan_iter(match=f"{ns}:*", count=1000):
                self.admin.unlink(key)
        self.admin.close()


@pytest.fixture
def server(redis_server_url: str) -> Iterator[Server]:
    s = Server(redis_server_url)
    yield s
    s.close()


#: How a role's surface breaks without a command it needs: refused, or (a script that reads
#: the expiring gate with pcall takes a refusal for "no gate") answering wrong.
DENIED = (KVRedisError, RuntimeError, redis.RedisError, AssertionError)


@pytest.mark.parametrize("role", list(ROLES))
def test_each_role_works_with_its_acl(server: Server, role: str, tmp_path: Path) -> None:
    ns = server.namespace(role)
    WORKLOADS[role](server.user(ns, commands_of(role, server.mode)), ns, tmp_path)


@pytest.mark.parametrize("role", list(ROLES))
def test_without_any_one_listed_command_a_role_fails(
    server: Server, role: str, tmp_path: Path
) -> None:
    commands = commands_of(role, server.mode)
    needless = []
    for dropped in commands:
        ns = server.namespace(role)
        url = server.user(ns, tuple(c for c in commands if c != dropped))
        try:
            WORKLOADS[role](url, ns, tmp_path)
        except DENIED:
            continue
        needless.append(dropped)
    assert needless == [], f"{role} works without {needless}"


def writes(index: RedisIndex) -> None:
    """Every write of the index API, on the populated namespace."""
    index.add([3001], KEYS[30:], [B])
    index.add(None, KEYS[:2], [SPEC], ttl=60)
    index.evict(KEYS[1], KeyType.REQUEST, [A])
    index.evict(1001, KeyType.ENGINE, [A])
    index.apply_batch([AddOp(None, (KEYS[2],), (B,))], "pod-b", Watermark(1, 2))
    index.apply_batch([EvictOp(KEYS[3], KeyType.REQUEST, (B,))])
    index.reset_watermark("pod-b", Watermark(1, 9))
    index.clear("pod-a")
    index.drop_namespace()


#: A recorded call: the script's name, and the command's arguments.
Recorded = tuple[str, tuple[Any, ...]]


def recorded_writes(server: Server, namespace: str) -> list[Recorded]:
    """The calls of the scripts that may write, as :func:`writes` sends them when an admin runs
    it on the namespace: each as sent (``FCALL kvredis_<name>``: the library is in use) and as
    its ``EVALSHA`` (the path a client falls back to); the namespace is then put back as it was."""
    before, dumped = server.snapshot(namespace), server.dump(namespace)
    with RedisIndex(config(server.url, namespace)) as index:
        registry = index.registry
        assert registry.active  # the admin's writes go to the function library
        sent: list[Recorded] = []
        call_command = registry.call_command

        def record(call: ScriptCall) -> Command:
            command = call_command(call)
            if not registry[call.script].no_writes:
                sent.append((call.script, command.args))
                sent.append((call.script, registry.evalsha_command(call).args))
            return command

        registry.call_command = record  # type: ignore[method-assign]
        writes(index)
    for key in server.admin.scan_iter(match=f"{namespace}:*", count=1000):
        server.admin.unlink(key)
    for key, (value, ttl) in dumped.items():
        server.admin.restore(key, max(ttl, 0), value, absttl=ttl > 0)
    assert server.snapshot(namespace) == before
    return sent


def test_a_router_cannot_change_a_key_through_any_call(server: Server, tmp_path: Path) -> None:
    ns = server.namespace("router")
    calls = recorded_writes(server, ns)
    url = server.user(ns, commands_of("router", server.mode))
    before = server.snapshot(ns)
    with RedisIndex(config(url, ns)) as index:
        router(url, ns)  # the router works
        for attempt in _write_attempts(index):
            with pytest.raises(DENIED):
                attempt()

    async def async_writes() -> None:
        async with AsyncRedisIndex(config(url, ns)) as index:
            with pytest.raises(DENIED):
                await index.add(None, KEYS, [B])
            with pytest.raises(DENIED):
                await index.drop_namespace()

    asyncio.run(async_writes())
    registry = ScriptRegistry()
    library = shipped_library()
    may_write = {n for n in registry.names() if not registry[n].no_writes}
    assert may_write == {n for n, read in library.reads.items() if not read}
    tried = {name for name, _ in calls}
    assert {args[0] for _, args in calls} == {"FCALL", "EVALSHA"}
    layout = (f"{ns}:meta", f"{ns}:pe", f"{ns}:pi", f"{ns}:pp", f"{ns}:sx", f"{ns}:wm")
    for name in sorted(may_write - tried):  # cluster-only and repair scripts: the namespace's keys
        fcall = ("FCALL", function_name(name), len(layout), *layout, "1", "2", "3", api_argument())
        calls.append((name, fcall))
        calls.append((name, ("EVALSHA", registry[name].sha, len(layout), *layout, "1", "2", "3")))
    raw = redis.Redis.from_url(url)
    try:
        for name in may_write:
            raw.script_load(registry[name].source)  # allowed: the router loads what it runs
        refused: dict[str, set[str]] = {"FCALL": set(), "EVALSHA": set()}
        for name, args in calls:
            try:
                raw.execute_command(*args)
            except redis.ResponseError:
                refused[args[0]].add(name)
            assert server.snapshot(ns) == before, (args[0], name)
        # each script the admin's writes ran was refused at least once on both paths
        assert refused["FCALL"] >= tried and refused["EVALSHA"] >= tried
        key = f"{ns}:meta"
        for command in (
            ("HSET", key, "gen", "x"),
            ("HDEL", key, "gen"),
            ("DEL", key),
            ("UNLINK", key),
            ("SET", key, "x"),
            ("PEXPIRE", key, 1),
            ("RENAME", key, f"{ns}:other"),
            ("RESTORE", f"{ns}:new", 0, server.dump(ns)[key.encode()][0]),
            ("EVAL", "return redis.call('DEL', KEYS[1])", 1, key),
            ("EVAL_RO", "return 1", 0),
            ("FUNCTION", "LOAD", "#!lua name=kvt\nredis.register_function('f', function() end)"),
            ("FCALL", "f", 1, key),
            ("FLUSHDB",),
            ("FLUSHALL",),
            ("SCRIPT", "FLUSH"),
        ):
            with pytest.raises(redis.ResponseError, match=r"NOPERM|permission"):
                raw.execute_command(*command)
    finally:
        raw.close()
    assert server.snapshot(ns) == before
    assert len(calls) >= 2 * len(may_write)


def _write_attempts(index: RedisIndex) -> list[Callable[[], Any]]:
    return [
        lambda: index.add([3001], KEYS[30:], [B]),
        lambda: index.add(None, KEYS[:2], [SPEC], ttl=60),
        lambda: index.evict(KEYS[1], KeyType.REQUEST, [A]),
        lambda: index.evict(1001, KeyType.ENGINE, [A]),
        lambda: index.apply_batch([AddOp(None, (KEYS[2],), (B,))], "pod-b", Watermark(1, 2)),
        lambda: index.apply_batch([EvictOp(KEYS[3], KeyType.REQUEST, (B,))]),
        lambda: index.reset_watermark("pod-b", Watermark(1, 9)),
        lambda: index.reset_watermark("pod-b", None),
        lambda: index.clear("pod-a"),
        lambda: index.drop_namespace(),
    ]


@pytest.mark.parametrize("role", list(ROLES))
def test_kvredis_acl_evalsha_prints_these_lines(server: Server, role: str) -> None:
    """``kvredis acl --role ROLE NS --evalsha --redis URL`` (docs/operations.md, "Access
    control") prints exactly the rules measured here, for the server's expiry mode."""
    ns = f"{TEST_PREFIX}{uuid.uuid4().hex[:12]}"
    result = CliRunner().invoke(
        cli, ["acl", "--role", role, ns, "--evalsha", "--redis", server.url]
    )
    assert result.exit_code == 0, result.output
    args = shlex.split(result.stdout)
    assert args[:3] == ["ACL", "SETUSER", f"{role}-{ns}"]
    assert args[3:6] == ["reset", "on", "><password>"]
    assert args[6:9] == [f"~{ns}:*", "resetchannels", "-@all"]
    assert sorted(args[9:]) == sorted(commands_of(role, server.mode))

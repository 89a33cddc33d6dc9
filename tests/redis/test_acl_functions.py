"""Tenants that cannot see each other: the lines ``kvredis acl --role ROLE NS`` prints, on the
function-library path (``FCALL``/``FCALL_RO``), on Redis 7.0 and Valkey 9.

- a user made from the printed line (the line for every server, and the least one ``--redis``
  gives for one server and namespace) does its role's whole work on NS: the router scores and
  looks up (sync, async, ``kvredis lookup|score``) with read-only keys, the ingester fills the
  namespace through the ``EventIngester`` and makes every other write, the operator runs every
  operator command on it, the library role loads the library;
- without any one command of the least line, the role's work fails: the line is minimal;
- against every other namespace name (prefixes of NS, names extending it, names NS extends,
  near names, and the keys of names only an earlier kvredis created: with ``:`` or glob
  characters), each role's user reads and writes nothing: every index call, every raw read,
  write and function call is refused, and the other namespace stays byte for byte as it was;
- a router cannot change a key of its own namespace through any function.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import shlex
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from click.testing import CliRunner

from kvredis import AsyncRedisIndex, PodEntry, RedisIndex, RedisIndexConfig
from kvredis.cli import cli
from kvredis.errors import ConfigError, KVRedisError
from kvredis.redis.config import config_for_existing
from kvredis.redis.functions import API_VERSION, api_argument, function_name, shipped_library
from kvredis.redis.layout import EXPIRY_FIELD, LAYOUT_VERSION, meta_key
from kvredis.redis.ops import expiry_mode_of
from tests.examples.filled import WEIGHTS, fill
from tests.redis import test_acl
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

PASSWORD = "kvt-acl-pw"
ROLES = ("router", "ingester", "operator")
A = PodEntry("pod-a", "gpu")

#: What a role's work raises without a command it needs (a refusal, or a script that took a
#: refused read for "nothing there" and answered wrong).
DENIED = (KVRedisError, RuntimeError, redis.RedisError, AssertionError)


# -- the printed lines ---------------------------------------------------------------------------


def printed(role: str, namespace: str | None, url: str | None = None) -> list[str]:
    """The arguments of the line ``kvredis acl`` prints (stdout: exactly one line)."""
    args = ["acl", "--role", role, *([namespace] if namespace else [])]
    result = CliRunner().invoke(cli, [*args, *(["--redis", url] if url else [])])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert "<password>" in lines[0]
    return shlex.split(lines[0].replace("<password>", PASSWORD))


def create(admin: redis.Redis, args: list[str], drop: str | None = None) -> str:
    """Run the printed ``ACL SETUSER`` (less the rule ``drop``); the user's name."""
    assert args[:2] == ["ACL", "SETUSER"]
    admin.execute_command(*(a for a in args if a != drop))
    return args[2]


def user_url(server: RedisServer, user: str) -> str:
    return f"redis://{quote(user, safe='')}:{PASSWORD}@127.0.0.1:{server.port}"


def cli_ok(url: str, namespace: str | None, *args: str) -> str:
    extra = ["--namespace", namespace] if namespace else []
    result = CliRunner().invoke(cli, [*args, "--redis", url, *extra])
    if result.exit_code != 0:
        raise RuntimeError(f"kvredis {' '.join(args)} exited {result.exit_code}: {result.output}")
    return result.output


# -- the roles' work -----------------------------------------------------------------------------


class Tenant:
    """A server, its admin client, and a namespace filled the way a deployment fills it."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.admin = redis.Redis(port=server.port)
        self.admin.function_load(shipped_library().code.decode(), replace=True)
        self.field = expiry_mode_of(self.admin.info("server")) == EXPIRY_FIELD

    def config(self, namespace: str, user: str | None = None) -> RedisIndexConfig:
        address = user_url(self.server, user) if user else self.server.url
        return RedisIndexConfig(address=address, namespace=namespace)

    def fresh(self) -> str:
        return f"kvt-{uuid.uuid4().hex[:10]}"

    def filled(self) -> str:
        namespace = self.fresh()
        fill(self.config(namespace))
        test_acl.populate(self.server.url, namespace)
        return namespace

    def key_expiring(self) -> str:
        """A new namespace whose speculative entries expire per bucket key (what a namespace
        created before the server had hash field expiry keeps)."""
        namespace = self.fresh()
        meta, pi = meta_key(namespace), namespace.encode() + b":pi"
        self.admin.fcall(
            function_name("namespace"), 2, meta, pi,
            LAYOUT_VERSION, 16, secrets.token_hex(8), "key", API_VERSION, api_argument(),
        )  # fmt: skip
        return namespace


def router_work(tenant: Tenant, namespace: str, user: str) -> None:
    config = tenant.config(namespace, user)
    with RedisIndex(config) as index:
        assert index.registry.active  # FCALL_RO, not the EVALSHA fallback
    test_acl.router(user_url(tenant.server, user), namespace)
    url = user_url(tenant.server, user)
    for command in ("lookup", "score"):
        cli_ok(url, namespace, command, "--model", "m", "--tokens", "1,2,3,4", "--block-size", "2")


def ingester_work(tenant: Tenant, namespace: str, user: str) -> None:
    new = not tenant.admin.exists(meta_key(namespace))
    url = user_url(tenant.server, user)
    test_acl.ingester(url, namespace)  # every write, speculative entries with a ttl included
    config = tenant.config(namespace, user)
    filled = fill(config)  # the ingest path: vLLM events through the EventIngester
    with RedisIndex(config) as index:
        assert index.registry.active  # FCALL, not the EVALSHA fallback
        assert index.score(filled.keys, WEIGHTS) == filled.scores
    if new and tenant.field:  # a namespace the ingester creates expires per field here
        assert tenant.admin.hget(meta_key(namespace), "expiry") == EXPIRY_FIELD.encode()


def operator_work(tenant: Tenant, namespace: str, user: str, tmp: Path) -> None:
    url = user_url(tenant.server, user)
    cli_ok(url, None, "functions", "show")
    for command in ("stats", "pods", "watermarks", "check"):
        cli_ok(url, namespace, command)
    cli_ok(url, namespace, "check", "--repair")
    cli_ok(url, namespace, "lookup", "--model", "m", "--tokens", "1,2,3,4", "--block-size", "2")
    cli_ok(url, namespace, "score", "--model", "m", "--tokens", "1,2,3,4", "--block-size", "2")
    dump = tmp / f"{namespace}.jsonl"
    cli_ok(url, namespace, "dump", "--no-progress", str(dump))
    cli_ok(url, namespace, "restore", "--replace", str(dump))
    cli_ok(url, namespace, "clear", "--pod", "pod-a", "--yes", "--no-progress")
    cli_ok(url, namespace, "migrate")
    result = CliRunner().invoke(cli, ["drop", namespace, "--redis", url, "--yes"])
    assert result.exit_code == 0, result.output
    cli_ok(url, namespace, "restore", str(dump))  # into a namespace that no longer exists


Work = Callable[[Tenant, str, str, Path], None]
WORK: dict[str, Work] = {
    "router": lambda t, ns, user, _tmp: router_work(t, ns, user),
    "ingester": lambda t, ns, user, _tmp: ingester_work(t, ns, user),
    "operator": operator_work,
}


@pytest.fixture
def tenant(own_redis_server: RedisServer) -> Iterator[Tenant]:
    t = Tenant(own_redis_server)
    yield t
    t.admin.close()


def workspace(tenant: Tenant, kind: str) -> str:
    """The namespace a role works on: ``new`` (not created yet: the ingester creates it),
    ``filled`` (by an admin), ``key`` (filled, its speculative entries expiring per bucket key,
    as a namespace created before the server had hash field expiry does)."""
    if kind == "new":
        return tenant.fresh()
    if kind == "filled":
        return tenant.filled()
    namespace = tenant.key_expiring()
    test_acl.populate(tenant.server.url, namespace)
    return namespace


#: (role, the namespace it works on)
WORKSPACES = [
    ("router", "filled"),
    ("ingester", "new"),
    ("ingester", "key"),
    ("operator", "filled"),
    ("operator", "key"),
]


@pytest.mark.parametrize("least", [False, True], ids=["every-server", "least"])
@pytest.mark.parametrize(("role", "kind"), WORKSPACES)
def test_a_user_made_from_the_printed_line_does_its_roles_work(
    tenant: Tenant, role: str, kind: str, least: bool, tmp_path: Path
) -> None:
    namespace = workspace(tenant, kind)
    url = tenant.server.url if least else None
    user = create(tenant.admin, printed(role, namespace, url))
    WORK[role](tenant, namespace, user, tmp_path)


def test_the_library_role_loads_the_library(tenant: Tenant) -> None:
    user = create(tenant.admin, printed("library", None))
    tenant.admin.function_delete("kvredis")
    url = user_url(tenant.server, user)
    assert "loaded" in cli_ok(url, None, "functions", "load")
    assert tenant.admin.function_list(library="kvredis")
    assert "this release's" in cli_ok(url, None, "functions", "show")


@pytest.mark.parametrize(("role", "kind"), [*WORKSPACES, ("library", "")])
def test_without_any_one_command_of_the_least_line_the_role_fails(
    tenant: Tenant, role: str, kind: str, tmp_path: Path
) -> None:
    probe = workspace(tenant, kind) if kind else None
    commands = [a for a in printed(role, probe, tenant.server.url) if a.startswith("+")]
    assert commands and "+@hash" not in commands
    needless = []
    for dropped in commands:
        if role == "library":
            tenant.admin.function_delete("kvredis")
            user = create(tenant.admin, printed(role, None, tenant.server.url), dropped)
            try:
                cli_ok(user_url(tenant.server, user), None, "functions", "load")
            except DENIED:
                continue
            finally:
                tenant.admin.function_load(shipped_library().code.decode(), replace=True)
        else:
            namespace = workspace(tenant, kind)
            user = create(tenant.admin, printed(role, namespace, tenant.server.url), dropped)
            try:
                WORK[role](tenant, namespace, user, tmp_path)
            except DENIED:
                continue
        needless.append(dropped)
    assert needless == [], f"{role} works without {needless}"


# -- isolation -----------------------------------------------------------------------------------

#: The namespaces whose users are checked, each against every name :func:`other_names` makes.
NAMESPACES = ["tenant", "t", "it's-a.b_c/d@e{f}"]
#: Characters a name may hold, used to extend and vary names.
EXTRA = ["x", "-", ".", "_", "0", "{", "}", "/", "@", "%", "~", "!", "'", '"', "é"]
#: What the name rules refuse (the characters that would make ACL patterns overlap).
REFUSED = [":", "*", "?", "[", "]", "\\"]


def other_names(ns: str) -> tuple[list[str], list[str]]:
    """(names the rules accept, names only an earlier kvredis created), all but ``ns``."""
    accepted = {ns[:i] for i in range(1, len(ns))}  # prefixes
    accepted |= {ns + c for c in EXTRA} | {c + ns for c in EXTRA}  # extensions
    accepted |= {ns + c + "b" for c in EXTRA} | {ns[:-1] + c for c in EXTRA}
    accepted |= {ns.upper(), ns.capitalize(), ns[::-1], ns + ns}
    legacy = {ns[:-1] + c for c in REFUSED} | {c + ns for c in REFUSED}
    legacy |= {ns[:i] + "*" for i in range(1, len(ns))} | {
        ns[:i] + "?" * (len(ns) - i) for i in range(len(ns))
    }
    legacy |= {ns + c for c in "*?[]\\"} | {f"[{ns[0]}]{ns[1:]}"}
    # names holding ':' after ns itself match ~ns:* by construction: the rules refuse them
    legacy = {n for n in legacy if not n.startswith(ns + ":")}
    accepted.discard(ns)
    legacy.discard(ns)
    return sorted(accepted), sorted(legacy)


def _snapshot(admin: redis.Redis, namespace: str) -> dict[bytes, Any]:
    """Every key of the namespace, DUMPed, with its expiry time (unix ms)."""
    pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", namespace.encode()) + b":*"
    keys = admin.scan_iter(match=pattern, count=1000)
    return {k: (admin.dump(k), admin.execute_command("PEXPIRETIME", k)) for k in keys}


def _attempts(url: str, namespace: str, commands: bool) -> list[Callable[[], Any]]:
    """Every way the user at ``url`` might read or write ``namespace`` (with ``commands``, the
    operator's commands too)."""
    meta = meta_key(namespace)
    pe, pi = namespace.encode() + b":pe", namespace.encode() + b":pi"

    def raw(*args: Any) -> Callable[[], Any]:
        def call() -> Any:
            client = redis.Redis.from_url(url)
            try:
                return client.execute_command(*args)
            finally:
                client.close()

        return call

    def index(op: Callable[[RedisIndex], Any]) -> Callable[[], Any]:
        def call() -> Any:
            config = config_for_existing(RedisIndexConfig(address=url), namespace)
            with RedisIndex(config) as idx:
                return op(idx)

        return call

    def async_lookup() -> Any:
        async def run() -> Any:
            config = config_for_existing(RedisIndexConfig(address=url), namespace)
            idx = await AsyncRedisIndex.create(config)  # closes its connections if refused
            try:
                return await idx.lookup([1, 2])
            finally:
                await idx.aclose()

        return asyncio.run(run())

    attempts = [
        index(lambda i: i.lookup([1, 2])),
        index(lambda i: i.score([1, 2])),
        index(lambda i: i.add([9], [9], [A])),
        index(lambda i: i.clear("pod-a")),
        index(lambda i: i.drop_namespace()),
        async_lookup,
        raw("HGETALL", meta),
        raw("HGET", meta, "gen"),
        raw("HMGET", pi, b"\x00\x00\x00\x01"),
        raw("HSCAN", pe, 0),
        raw("EXISTS", meta),
        raw("TYPE", meta),
        raw("HSET", meta, "gen", "x"),
        raw("DEL", pe),
        raw("UNLINK", pe),
        raw("PEXPIREAT", meta, 1),
        raw("FCALL_RO", function_name("lookup"), 2, meta, pi, "1", api_argument()),
        raw("FCALL", function_name("drop"), 2, meta, pi, "x", api_argument()),
    ]
    for command in ("stats", "dump", "clear"):
        args = ["--pod", "pod-a", "--yes"] if command == "clear" else []
        args += ["-"] if command == "dump" else []

        def run_cli(command: str = command, args: list[str] = args) -> Any:
            result = CliRunner().invoke(
                cli, [command, *args, "--redis", url, "--namespace", namespace]
            )
            if result.exit_code != 0:
                raise RuntimeError(result.output)
            return result.output

        if commands:
            attempts.append(run_cli)
    return attempts


def _populate_other(tenant: Tenant, namespace: str) -> None:
    config = config_for_existing(RedisIndexConfig(address=tenant.server.url), namespace)
    with RedisIndex(config) as index:
        index.add([1, 2], [1, 2], [A, PodEntry("pod-b", "cpu")])
        index.add(None, [3], [PodEntry("pod-s", "gpu", speculative=True)], ttl=600)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_a_roles_user_reads_and_writes_no_other_namespace(tenant: Tenant, ns: str) -> None:
    accepted, legacy = other_names(ns)
    assert len(accepted) + len(legacy) > 40
    for name in legacy:  # the rules refuse them everywhere a name enters
        with pytest.raises(ConfigError, match="kvredis rename"):
            RedisIndexConfig(namespace=name)
        result = CliRunner().invoke(cli, ["acl", "--role", "router", name])
        assert result.exit_code == 2 and "may not contain" in result.output
    test_acl.populate(tenant.server.url, ns)
    for name in [*accepted, *legacy]:
        _populate_other(tenant, name)
    users = {role: create(tenant.admin, printed(role, ns)) for role in ROLES}
    router_work(tenant, ns, users["router"])  # the users work on their own namespace
    before = {name: _snapshot(tenant.admin, name) for name in [*accepted, *legacy]}
    assert all(before.values())
    sample = set(accepted[:: max(1, len(accepted) // 8)])  # the commands are slower
    for user in users.values():
        url = user_url(tenant.server, user)
        for name in [*accepted, *legacy]:
            for attempt in _attempts(url, name, commands=name in sample):
                with pytest.raises(DENIED):
                    attempt()
    after = {name: _snapshot(tenant.admin, name) for name in [*accepted, *legacy]}
    for name in before:
        assert after[name].keys() == before[name].keys(), name
        assert after[name] == before[name], name


def test_names_that_would_overlap_are_refused() -> None:
    for name in ["a:b", "kv:prod", "t*", "t?", "[t]", "t\\x", "a b", "a\tb", "a\x00b", "x]"]:
        with pytest.raises(ConfigError, match="may not contain"):
            RedisIndexConfig(namespace=name)
    for name in ["a", "a-b", "a.b", "tenant_1", "it's", "x{y}", "é", "a/b@c%d~e!f"]:
        assert RedisIndexConfig(namespace=name).namespace == name


# -- a router cannot write -----------------------------------------------------------------------


def test_a_router_cannot_change_a_key_through_any_function(tenant: Tenant) -> None:
    namespace = tenant.filled()
    user = create(tenant.admin, printed("router", namespace))
    before = _snapshot(tenant.admin, namespace)
    client = redis.Redis.from_url(user_url(tenant.server, user))
    try:
        keys = [f"{namespace}:meta", f"{namespace}:pi", f"{namespace}:pp", f"{namespace}:sx"]
        for name, read in shipped_library().reads.items():
            if read:
                continue
            for verb in ("FCALL", "FCALL_RO"):
                with pytest.raises(redis.ResponseError) as refused:
                    args = (*keys, "x", api_argument())
                    client.execute_command(verb, function_name(name), len(keys), *args)
                assert re.search(r"NOPERM|no permissions|write flag", str(refused.value), re.I)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.hset(f"{namespace}:meta", "gen", "x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.function_load(shipped_library().code.decode(), replace=True)
    finally:
        client.close()
    assert _snapshot(tenant.admin, namespace) == before


def test_a_router_waits_for_a_flushed_library_and_recovers(tenant: Tenant) -> None:
    namespace = tenant.fresh()
    filled = fill(tenant.config(namespace))
    user = create(tenant.admin, printed("router", namespace))
    with RedisIndex(tenant.config(namespace, user)) as router:
        assert router.score(filled.keys, WEIGHTS) == filled.scores
        tenant.admin.function_flush()
        with pytest.raises(KVRedisError, match="function"):  # it may neither load nor EVALSHA
            router.score(filled.keys, WEIGHTS)
        tenant.admin.function_load(shipped_library().code.decode())  # the library role loads it
        assert router.score(filled.keys, WEIGHTS) == filled.scores
        assert router.registry.active

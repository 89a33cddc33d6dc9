"""``kvredis functions load|show``: the ``kvredis`` Redis Functions library, for operators who
load it themselves (a router's ACL user may call the functions without being allowed to load
them; see docs/operations.md, "Access control", and docs/protocol.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from kvredis.cli.options import RedisTarget, handle_errors, logging_options, redis_options
from kvredis.redis.functions import LIBRARY, Library, op_load_library, op_server_library
from kvredis.redis.requests import Op

Version = tuple[str, int, str, str, str] | None


def _shown(version: Version) -> str:
    if version is None:
        return f"no {LIBRARY} library"
    name, api, layout, release, build = version
    return f"{name} api {api}, layout {layout}, release {release}, build {build}"


def _as_dict(version: Version) -> dict[str, Any] | None:
    if version is None:
        return None
    name, api, layout, release, build = version
    return {"library": name, "api": api, "layout": layout, "release": release, "build": build}


@contextmanager
def _servers(target: RedisTarget) -> Iterator[list[tuple[str, Callable[[Op[Any]], Any]]]]:
    """(name, run) of the server, or of every primary of a cluster: ``run(op)`` drives a
    sans-IO operation of plain commands against it."""
    config = target.config()
    if config.cluster:
        from kvredis.redis.cluster.core import op_on_node
        from kvredis.redis.cluster.executor import SyncClusterExecutor

        cluster = SyncClusterExecutor(config)
        try:
            primaries = cluster.slot_map.primaries

            def on(node: Any) -> Callable[[Op[Any]], Any]:
                return lambda op: cluster.run(op_on_node(node, op))

            yield [(f"primary {node}", on(node)) for node in primaries]
        finally:
            cluster.close()
        return
    from kvredis.redis.executor import SyncExecutor
    from kvredis.redis.scripts import ScriptRegistry
    from kvredis.redis.session import RetryPolicy, Session, op_drive
    from kvredis.redis.state import CoreState

    single = SyncExecutor(config)
    # retries, and a refused connection, password or protocol as one typed error
    policy = RetryPolicy(config.retries, config.retry_backoff, config.server())
    session = Session(CoreState(config.namespace), ScriptRegistry(), policy)
    try:
        yield [(target.shown, lambda op: single.run(op_drive(session, op)))]
    finally:
        single.close()


def _library() -> Library:
    from kvredis.redis.functions import shipped_library

    return shipped_library()


@click.group(
    "functions",
    epilog="\b\nExamples:\n  kvredis functions show --redis redis://10.0.0.7:6379\n"
    "  kvredis functions load --redis redis://admin@10.0.0.7:6379\n"
    "  kvredis functions show --code > kvredis.lua",
)
def functions() -> None:
    """The kvredis Redis Functions library (FUNCTION LOAD, FCALL): load it, show it."""


@functions.command(
    "load",
    epilog="\b\nExamples:\n  kvredis functions load --redis redis://admin@10.0.0.7:6379\n"
    "  kvredis functions load --redis redis+cluster://10.0.0.7:7000 --replace",
)
@redis_options(default_namespace=None, url_required=True)
@click.option(
    "--replace", is_flag=True, help="Load it even where the same or a newer one is loaded."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@logging_options
@handle_errors
def load_command(target: RedisTarget, namespace: str | None, replace: bool, as_json: bool) -> None:
    """Load this release's kvredis library on the server (every primary of a cluster; their
    replicas get it by replication) where it is missing or older."""
    library = _library()
    rows = []
    with _servers(target) as servers:
        for name, run in servers:
            before, loaded = run(op_load_library(library, replace))
            rows.append((name, before, loaded))
    if as_json:
        out = [
            {"server": name, "before": _as_dict(before), "loaded": loaded}
            for name, before, loaded in rows
        ]
        click.echo(json.dumps({"library": _as_dict(library.version), "servers": out}))
        return
    for name, before, loaded in rows:
        if loaded:
            click.echo(f"{name}: loaded {_shown(library.version)} (was: {_shown(before)})")
        else:
            click.echo(f"{name}: kept {_shown(before)}")


@functions.command(
    "show",
    epilog="\b\nExamples:\n  kvredis functions show --redis redis://10.0.0.7:6379\n"
    "  kvredis functions show --code | redis-cli -x FUNCTION LOAD REPLACE",
)
@redis_options(default_namespace=None, url_required=True)
@click.option("--code", is_flag=True, help="Print this release's library code (for FUNCTION LOAD).")
@click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
@logging_options
@handle_errors
def show_command(
    target: RedisTarget | None, namespace: str | None, code: bool, as_json: bool
) -> None:
    """Show the kvredis library this release would load, and the one the server (every
    primary of a cluster) holds."""
    library = _library()
    if code:
        click.echo(library.code.decode("utf-8"), nl=False)
        return
    rows = []
    if target is not None:  # the server of --redis (default: the local one)
        with _servers(target) as servers:
            rows = [(name, run(op_server_library())) for name, run in servers]
    if as_json:
        out = [{"server": name, "version": _as_dict(version)} for name, version in rows]
        click.echo(json.dumps({"library": _as_dict(library.version), "servers": out}))
        return
    click.echo(f"this release: {_shown(library.version)}")
    click.echo(f"functions: {', '.join(library.functions())}")
    for name, version in rows:
        state = "" if version is None or version[4] != library.build else " (this release's)"
        click.echo(f"{name}: {_shown(version)}{state}")


COMMANDS = (functions,)

"""``kvredis acl``: the ACL SETUSER line of a role on a namespace (see :mod:`kvredis.redis.acl`)."""

from __future__ import annotations

from typing import Any

import click

from kvredis.cli.options import (
    RedisTarget,
    handle_errors,
    logging_options,
    redis_options,
)

__all__ = ["COMMANDS"]

ROLES = ("router", "ingester", "operator", "library")


def _expiry(target: RedisTarget, namespace: str | None) -> Any:
    """The expiry commands ``target``'s server and namespace need: the namespace's own mode
    where it exists, else the mode a client creating it there picks."""
    from kvredis.redis.acl import Expiry
    from kvredis.redis.inspect import Inspector
    from kvredis.redis.layout import EXPIRY_FIELD, meta_key
    from kvredis.redis.ops import expiry_mode_of
    from kvredis.redis.requests import Command, Op

    def op() -> Op[tuple[Any, Any]]:
        info = yield Command(("INFO", "server"))
        stored = None
        if namespace is not None:
            stored = yield Command(("HMGET", meta_key(namespace), "layout", "expiry"))
        return info, stored

    config = target.config(namespace=namespace or "kvblock")
    if config.cluster:
        raise click.UsageError(
            "--redis names a cluster: give a node of it as redis://HOST:PORT (the rules are "
            "the same on every node; a cluster adds +cluster|slots +cluster|shards)"
        )
    with Inspector(config) as inspector:
        info, stored = inspector.run(op())
    if stored is not None and stored[0] is not None:  # the namespace exists: its own mode
        return Expiry.FIELD if stored[1] == EXPIRY_FIELD.encode() else Expiry.KEY
    return Expiry.FIELD if expiry_mode_of(info) == EXPIRY_FIELD else Expiry.KEY


@click.command(
    "acl",
    epilog="\b\nExamples:\n  kvredis acl --role router kvblock\n"
    "  kvredis acl --role ingester kvblock --redis redis://admin@10.0.0.7:6379\n"
    "  kvredis acl --role library",
)
@click.argument("namespace", metavar="NAMESPACE", required=False)
@click.option(
    "--role", type=click.Choice(ROLES), required=True, help="Whose line: see the description."
)
@click.option("--user", metavar="NAME", help="The ACL user (default: ROLE-NAMESPACE).")
@click.option(
    "--evalsha",
    is_flag=True,
    help="The rules of the EVALSHA path (clients that cannot use the function library).",
)
@redis_options(default_namespace=None, namespace_option=False)
@logging_options
@handle_errors
def acl(
    target: RedisTarget | None,
    namespace: str | None,
    role: str,
    user: str | None,
    evalsha: bool,
) -> None:
    """Print the ACL SETUSER line of a role on NAMESPACE (on stdout; notes on stderr).

    \b
    router    lookup and score, read-only keys (FCALL_RO)
    ingester  kvredis ingest: adds, evicts, batches, watermarks, clears of a pod
    operator  stats, pods, watermarks, check, lookup, score, clear, dump,
              restore, migrate, drop on the namespace
    library   kvredis functions load: the function library, one per server
              (an administrator's role: no namespace)

    A user made from the line reaches the keys of NAMESPACE and of no other namespace. Without
    --redis the line works on every supported server (Redis 7.0+, Valkey 7.2+); with --redis,
    it holds the least rules for that server and namespace. Replace <password> with the
    user's password (or give #<its sha256 in hex>).
    """
    from kvredis.redis.acl import Expiry, Role, acl_line

    chosen = Role(role)
    if chosen is Role.LIBRARY:
        if namespace is not None:
            raise click.UsageError("the library role is one per server: give no NAMESPACE")
    elif namespace is None:
        raise click.UsageError(f"name the namespace: kvredis acl --role {role} NAMESPACE")
    else:
        from kvredis.redis.layout import check_namespace_name

        try:
            check_namespace_name(namespace)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="NAMESPACE") from None
    expiry = Expiry.ANY
    if target is not None and chosen is not Role.LIBRARY:
        expiry = _expiry(target, namespace)
    try:
        line = acl_line(chosen, namespace, user=user, expiry=expiry, evalsha=evalsha)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--user") from None
    click.echo(str(line))
    for note in _notes(chosen, namespace, evalsha, expiry):
        click.echo(note, err=True)


def _notes(role: Any, namespace: str | None, evalsha: bool, expiry: Any) -> list[str]:
    from kvredis.redis.acl import Expiry, Role

    notes = ["# replace <password> with the user's password (or #<its sha256 in hex>)"]
    if role is Role.LIBRARY:
        notes.append(
            "# the library is one per server, shared by every namespace: keep this user to the "
            "server's administrators"
        )
        return notes
    if not evalsha:
        notes.append(
            "# the function-library path: load the library first (kvredis functions load, as "
            f"the library role); without it clients need `kvredis acl --role {role.value} "
            f"{namespace} --evalsha`"
        )
    if expiry is Expiry.ANY and role is not Role.ROUTER:
        notes.append(
            "# for every supported server (+@hash holds the hash field expiry commands where the "
            "server has them); --redis URL gives the least rules for one server and namespace"
        )
    if role is Role.ROUTER:
        notes.append("# read_from_replicas also needs +info")
    notes.append(
        "# on a cluster add +cluster|slots +cluster|shards"
        + (" (and +wait with cluster_wait_replicas)" if role is Role.INGESTER else "")
    )
    return notes


COMMANDS = (acl,)

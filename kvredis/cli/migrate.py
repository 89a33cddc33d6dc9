"""The operator's commands across layouts: ``kvredis migrate`` (convert a namespace of an
earlier layout in place) and ``kvredis drop`` (delete a namespace, whatever its layout)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import click
from click.core import ParameterSource

from kvredis.cli.options import (
    RedisTarget,
    check_existing_namespace,
    echo_json,
    handle_errors,
    json_option,
    logging_options,
    redis_options,
)

__all__ = ["COMMANDS", "drop", "migrate"]

#: kvredis.redis.migrate.PAIRS_PER_CALL and MAX_PAIRS_PER_CALL (that module loads redis-py: not
#: imported up front; tests compare them)
PAIRS_PER_CALL = 250
MAX_PAIRS_PER_CALL = 10_000

_NAMESPACE_ARG = click.argument("namespace_arg", metavar="[NAMESPACE]", required=False)


def _command(example: str) -> Callable[[Callable[..., Any]], click.Command]:
    """A command taking the namespace as an argument or as --namespace."""

    def decorate(f: Callable[..., Any]) -> click.Command:
        f = handle_errors(f)
        f = redis_options(url_required=True)(f)
        f = logging_options(f)
        f = _NAMESPACE_ARG(f)
        return click.command(epilog=f"\b\nExample:\n  {example}")(f)

    return decorate


def _target(target: RedisTarget | None, namespace_arg: str | None) -> RedisTarget:
    """The target, its namespace from the argument when one is given (it wins over
    KVREDIS_NAMESPACE; with a different --namespace on the command line it is a usage error)."""
    assert target is not None
    ctx = click.get_current_context()
    if namespace_arg is not None:
        given = ctx.get_parameter_source("namespace") is ParameterSource.COMMANDLINE
        if given and target.namespace != namespace_arg:
            raise click.UsageError(
                f"two namespaces given: {namespace_arg!r} and --namespace {target.namespace!r}"
            )
        # also a name the rules refuse now: an earlier kvredis's namespace, to migrate or drop
        target.namespace = check_existing_namespace(namespace_arg)
        target.existing = True
    return target


def _where(target: RedisTarget) -> str:
    return f"namespace {target.namespace!r} at {target.shown}"


class _ProgressLine:
    """``progress(done, total)`` as one line on stderr: redrawn in place on a terminal,
    otherwise printed at most every few seconds (and at the end)."""

    def __init__(self, label: str, enabled: bool, out: TextIO | None = None) -> None:
        self.label, self.enabled = label, enabled
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        now = time.monotonic()
        if not self.tty and done < total and now - self._last < 5:
            return
        self._last = now
        line = f"{self.label}: {done:,}/{total:,} speculative pairs converted ({done / total:.0%})"
        if self.tty:
            self.out.write("\r" + line)
            self._drawn = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def close(self) -> None:
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False


@_command("kvredis migrate --redis redis://10.0.0.7:6379 kvblock")
@click.option("--no-progress", is_flag=True, help="Do not print the progress line.")
@click.option(
    "--pairs-per-call",
    type=click.IntRange(1, MAX_PAIRS_PER_CALL),
    default=PAIRS_PER_CALL,
    show_default=True,
    help="Speculative entries converted per server call (each call is atomic).",
)
@json_option
def migrate(
    target: RedisTarget | None,
    namespace: str | None,
    namespace_arg: str | None,
    no_progress: bool,
    pairs_per_call: int,
    as_json: bool,
) -> None:
    """Convert a namespace of layout kvredis-kvblock/1 to this kvredis's layout, in place.

    Online: clients of this kvredis read and write the namespace meanwhile; clients of the
    earlier release are refused from the first step on (upgrade them first). Interrupted, run
    it again: it goes on where it stopped. A namespace already in this layout is left alone.

    On a cluster address, converts a namespace of the cluster key layout (kvredis-cluster/1)
    to pod placement (kvredis-cluster/2), shard by shard, online (stop the clients of the
    earlier release first).
    """
    from kvredis.redis.migrate import migrate_namespace

    tgt = _target(target, namespace_arg)
    if tgt.config().cluster:
        _migrate_cluster(tgt, no_progress, as_json)
        return
    line = _ProgressLine(f"migrating {tgt.namespace!r}", not no_progress and not as_json)
    try:
        report = migrate_namespace(tgt.config(), line, pairs_per_call)
    finally:
        line.close()
    if as_json:
        echo_json(
            {
                "namespace": report.namespace,
                "server": tgt.shown,
                "migrated": report.migrated,
                "resumed": report.resumed,
                "from": report.source,
                "to": report.target,
                "speculative_pairs": report.pairs,
                "moved": report.moved,
                "dropped": report.dropped,
                "seconds": round(report.seconds, 3),
            }
        )
        return
    if not report.migrated:
        click.echo(f"{_where(tgt)} is in layout {report.target} already: nothing to migrate")
        return
    how = "finished the migration" if report.resumed else "migrated"
    pairs = (
        f"; {report.pairs:,} speculative entries with a ttl converted ({report.moved:,} moved "
        f"to expiring buckets, {report.dropped:,} past their deadline or gone dropped)"
        if report.pairs
        else ""
    )
    click.echo(
        f"{how} {_where(tgt)} from {report.source} to {report.target} in "
        f"{report.seconds:.2f} s{pairs}"
    )


def _migrate_cluster(tgt: RedisTarget, no_progress: bool, as_json: bool) -> None:
    """``kvredis migrate`` of a cluster namespace (:mod:`kvredis.redis.cluster.migrate`)."""
    from kvredis.errors import NamespaceMissingError
    from kvredis.redis.cluster.index import RedisClusterIndex
    from kvredis.redis.cluster.shards import CLUSTER_LAYOUT

    show = not no_progress and not as_json

    def progress(done: int, total: int) -> None:
        if show:
            click.echo(f"migrating {tgt.namespace!r}: {done}/{total} shards moved", err=True)

    try:
        index = RedisClusterIndex(tgt.config(), create=False)
    except NamespaceMissingError:
        raise NamespaceMissingError(
            f"namespace {tgt.namespace!r} does not exist at {tgt.shown}: nothing to migrate "
            "(check the namespace and --redis)"
        ) from None
    with index:
        report = index.migrate(progress)
    if as_json:
        echo_json(
            {
                "namespace": report.namespace,
                "server": tgt.shown,
                "migrated": report.migrated,
                "resumed": report.resumed,
                "from": report.source,
                "to": CLUSTER_LAYOUT,
                "shards": report.shards,
                "pairs": report.pairs,
                "expiring": report.expiring,
                "mappings": report.mappings,
                "dropped_mappings": report.dropped_mappings,
                "retried_pages": report.retried_pages,
                "seconds": round(report.seconds, 3),
            }
        )
        return
    if not report.migrated:
        click.echo(f"{_where(tgt)} is in layout {CLUSTER_LAYOUT} already: nothing to migrate")
        return
    how = "finished the migration" if report.resumed else "migrated"
    click.echo(
        f"{how} {_where(tgt)} from {report.source} to {CLUSTER_LAYOUT} in "
        f"{report.seconds:.2f} s: {report.pairs:,} pairs and {report.expiring:,} expiring "
        f"entries moved to their pods' shards, {report.mappings:,} mappings copied"
    )


@_command("kvredis drop --redis redis://10.0.0.7:6379 kvblock --yes")
@click.option("--yes", is_flag=True, help="Really delete the namespace (required).")
def drop(
    target: RedisTarget | None, namespace: str | None, namespace_arg: str | None, yes: bool
) -> None:
    """Delete every key of a namespace, whatever its layout (also one an older or newer
    kvredis wrote, or one whose drop was cut short).

    Without --yes, says what would be deleted and deletes nothing. Keys of other namespaces
    (also those whose names extend this one) are never touched. Clients of the namespace start
    over with an empty one.
    """
    from kvredis.redis.factories import drop_namespace

    source = click.get_current_context().get_parameter_source("namespace")
    if namespace_arg is None and source in (None, ParameterSource.DEFAULT):
        raise click.UsageError("name the namespace to drop: kvredis drop NAMESPACE --yes")
    tgt = _target(target, namespace_arg)
    config = tgt.config()
    if config.cluster:
        what = f"every key of {_where(tgt)} (on every shard)"
    else:
        survey = _survey(config)
        if not survey.exists:
            click.echo(f"{_where(tgt)} does not exist: nothing to drop")
            return
        state = [f"layout {survey.layout}" if survey.layout else "no meta record"]
        if survey.dropping:
            state.append("a drop cut short")
        if survey.migrating:
            state.append(f"being migrated from {survey.migrating}")
        what = f"{survey.keys:,} keys of {_where(tgt)} ({', '.join(state)})"
    if not yes:
        raise click.ClickException(
            f"this would delete {what}; nothing deleted: pass --yes to delete them"
        )
    deleted = drop_namespace(config)
    click.echo(f"dropped {_where(tgt)}: {deleted:,} keys deleted")


def _survey(config: Any) -> Any:
    from kvredis.redis.inspect import Inspector
    from kvredis.redis.migrate import op_survey

    inspector = Inspector(config)
    try:
        return inspector.run(op_survey(config.namespace))
    finally:
        inspector.close()


COMMANDS = (migrate, drop)

"""What the operator's commands share: the command decorator (``--redis``, ``--namespace``,
the password, logging, one-line errors), and the clients they open on an existing namespace (an
inspector for the layout-reading commands, an index for the calls of the index API) on a single
server or a cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from kvredis.cli.options import RedisTarget, handle_errors, logging_options, redis_options

__all__ = [
    "NO_PROGRESS",
    "existing_layout",
    "missing_namespace",
    "on_cluster",
    "open_index",
    "open_inspector",
    "operator_command",
    "single_layout",
]


NO_PROGRESS = click.option("--no-progress", is_flag=True, help="Do not draw a progress bar.")


def operator_command(example: str) -> Callable[[Callable[..., Any]], click.Command]:
    """A command with the shared options, error handling and an example in its help."""

    def decorate(f: Callable[..., Any]) -> click.Command:
        f = handle_errors(f)
        f = redis_options(url_required=True)(f)
        f = logging_options(f)
        return click.command(epilog=f"\b\nExample:\n  {example}")(f)

    return decorate


@contextmanager
def open_inspector(target: RedisTarget | None) -> Iterator[Any]:
    """The operator's client: an Inspector on a single server, a ClusterInspector on a
    cluster (``redis+cluster://``)."""
    from kvredis.redis.inspect import Inspector

    assert target is not None
    config = target.config()
    if config.cluster:
        from kvredis.redis.cluster.inspect import ClusterInspector

        inspector: Any = ClusterInspector(config)
    else:
        inspector = Inspector(config)
    try:
        yield inspector
    finally:
        inspector.close()


def on_cluster(inspector: Any) -> bool:
    from kvredis.redis.inspect import Inspector

    return not isinstance(inspector, Inspector)


def missing_namespace(target: RedisTarget) -> click.ClickException:
    return click.ClickException(
        f"namespace {target.namespace!r} does not exist at {target.shown} "
        "(check --namespace and --redis)"
    )


def existing_layout(inspector: Any, target: RedisTarget) -> Any:
    """The namespace's layout (single server), or its shards' layouts (cluster); a one-line
    error if it does not exist, or if a single-server address names a node of a cluster."""
    if on_cluster(inspector):
        shards = inspector.shards()
        if shards is None:
            raise missing_namespace(target)
        return shards
    layout = single_layout(inspector, target)
    if layout is None:
        raise missing_namespace(target)
    return layout


def single_layout(inspector: Any, target: RedisTarget) -> Any:
    """The namespace's layout on a single server (None: it does not exist); a one-line error
    when the address names a node of a cluster."""
    from kvredis.errors import ClusterModeError

    try:
        return inspector.layout()
    except ClusterModeError:
        address = target.config().parsed_address()
        raise click.ClickException(
            f"{target.shown}: this is a node of a Redis Cluster; use --redis "
            f"redis+cluster://{address.host}:{address.port} (a namespace is sharded over the "
            "cluster)"
        ) from None


@contextmanager
def open_index(target: RedisTarget) -> Iterator[Any]:
    """A RedisIndex (or RedisClusterIndex) on an existing namespace (never creates one)."""
    from kvredis.redis.index import RedisIndex

    config = target.config()
    if config.cluster:
        from kvredis.errors import NamespaceMissingError
        from kvredis.redis.cluster.index import RedisClusterIndex

        try:
            cluster = RedisClusterIndex(config, create=False)
        except NamespaceMissingError:
            raise click.ClickException(
                f"namespace {target.namespace!r} does not exist at {target.shown} "
                "(check --namespace and --redis)"
            ) from None
        try:
            yield cluster
        finally:
            cluster.close()
        return
    with open_inspector(target) as inspector:
        existing_layout(inspector, target)
    index = RedisIndex(target.config())
    try:
        yield index
    finally:
        index.close()

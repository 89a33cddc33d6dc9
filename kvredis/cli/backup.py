"""``kvredis dump`` and ``restore``: a namespace exported to JSON lines and loaded back; ``kvredis
rename``: a namespace moved to another name the same way."""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, suppress
from typing import IO, Any

import click

from kvredis.cli.namespace import (
    NO_PROGRESS,
    existing_layout,
    on_cluster,
    open_inspector,
    operator_command,
    single_layout,
)
from kvredis.cli.options import (
    RedisTarget,
    check_existing_namespace,
    echo_json,
    handle_errors,
    json_option,
    logging_options,
    progress_bar,
    redis_options,
)
from kvredis.errors import NamespaceLayoutError

__all__ = ["COMMANDS"]


# -- dump and restore ---------------------------------------------------------------------------


def _open(path: str, mode: str) -> IO[str]:
    if path == "-":
        return sys.stdout if "w" in mode else sys.stdin
    if path.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return open(path, mode, encoding="utf-8")


def _open_output(path: str) -> IO[str]:
    """``path`` opened for writing (BadParameter naming it when the file cannot be created)."""
    try:
        return _open(path, "w")
    except OSError as exc:
        parent = os.path.dirname(os.path.abspath(path))
        hint = "" if os.path.isdir(parent) else f" (the directory {parent} does not exist)"
        raise click.BadParameter(
            f"cannot write {path}: {exc.strerror or exc}{hint}", param_hint="FILE"
        ) from None


class _CountingWriter:
    """Writes JSON records, one per line, counting records and (uncompressed) bytes."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.records = 0
        self.bytes = 0

    def __call__(self, record: Any) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        self.out.write(line)
        self.records += 1
        self.bytes += len(line.encode("utf-8"))


def _export(
    inspector: Any, target: RedisTarget, layout: Any, write: _CountingWriter, bar: Any
) -> tuple[int, int]:
    """Write the dump of the namespace ``layout`` (:func:`existing_layout`) describes: the
    header, every key's records (on a cluster tagged with their shard) and the end record;
    returns (keys, bucket bits)."""
    from kvredis.redis.inspect import DUMP_FORMAT, op_dump

    if on_cluster(inspector):  # every shard's records, tagged with their shard
        first = next(iter(layout.values()), None)
        bits = first.bucket_bits if first is not None else target.config().bucket_bits
        write(
            {
                "format": DUMP_FORMAT,
                "namespace": target.namespace,
                "bucket_bits": bits,
                "shards": inspector.core.count,
                "cluster_layout": inspector.layout_name,
            }
        )
        keys = inspector.dump(write, bar)
    else:
        bits = layout.bucket_bits
        write({"format": DUMP_FORMAT, "namespace": layout.namespace, "bucket_bits": bits})
        keys = inspector.run(op_dump(layout, write, bar))
    write({"end": True, "keys": keys, "records": write.records - 1})
    return keys, bits


@operator_command("kvredis dump kvblock-$(date +%F).jsonl.gz --namespace kvblock")
@click.argument("file", metavar="FILE")
@NO_PROGRESS
@json_option
def dump(target: RedisTarget, namespace: str, file: str, no_progress: bool, as_json: bool) -> None:
    """Export a namespace to FILE (JSON lines; gzip if it ends in .gz; '-': stdout).

    `kvredis restore` loads it back, on this server or another, byte for byte. With --json, a
    summary (records, keys, bytes, namespace, layout) is printed on stdout.
    """
    from kvredis.redis.inspect import DUMP_FORMAT

    if as_json and file == "-":
        raise click.UsageError(
            "--json prints the summary on stdout, which FILE '-' takes: name a file"
        )
    parent = os.path.dirname(os.path.abspath(file))
    if file != "-" and not os.path.isdir(parent):
        raise click.BadParameter(
            f"cannot write {file}: the directory {parent} does not exist", param_hint="FILE"
        )
    with open_inspector(target) as inspector:
        layout = existing_layout(inspector, target)
        out = _open_output(file)
        write = _CountingWriter(out)
        bar = progress_bar("dumping", no_progress)
        complete = False
        try:
            keys, bits = _export(inspector, target, layout, write, bar)
            if file != "-":
                out.close()
            complete = True
        except BrokenPipeError:
            raise click.ClickException(
                f"{file}: the reader stopped reading before the dump ended (a pipe into `head`?); "
                "the dump is incomplete"
            ) from None
        except OSError as exc:
            if isinstance(exc, ConnectionError):
                raise
            raise click.ClickException(
                f"cannot write {file}: {exc.strerror or exc}; the dump is incomplete (restore "
                "refuses it): free space or pick another FILE, then run the dump again"
            ) from None
        finally:
            bar.close()
            if file == "-":
                with suppress(BrokenPipeError):
                    out.flush()
            elif not complete:
                with suppress(OSError):
                    out.close()
    if as_json:
        echo_json(
            {
                "file": file,
                "namespace": target.namespace,
                "layout": {"format": DUMP_FORMAT, "bucket_bits": bits},
                "keys": keys,
                "records": write.records,
                "bytes": write.bytes,
                "file_bytes": os.path.getsize(file),
            }
        )
        return
    click.echo(f"dumped {keys} keys of namespace {target.namespace!r} to {file}", err=True)


@operator_command("kvredis restore kvblock-2026-01-31.jsonl.gz --namespace kvblock")
@click.argument("file", metavar="FILE")
@click.option("--replace", is_flag=True, help="Drop the namespace first if it holds keys.")
def restore(target: RedisTarget, namespace: str, file: str, replace: bool) -> None:
    """Load a namespace exported by `kvredis dump` (into --namespace; '-': stdin).

    Refuses a namespace that already holds keys unless --replace.
    """
    with ExitStack() as stack:
        if file == "-":  # read twice below: spool stdin to a file
            spool = stack.enter_context(
                tempfile.NamedTemporaryFile("w+", encoding="utf-8", suffix=".jsonl")
            )
            shutil.copyfileobj(sys.stdin, spool)
            spool.flush()
            file = spool.name
        header, trailer = _load(target, file, replace)
    click.echo(
        f"restored {trailer['keys']} keys of namespace {header['namespace']!r} into "
        f"{target.namespace!r}",
        err=True,
    )


def _load(target: RedisTarget, file: str, replace: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore the dump ``file`` into ``target``'s namespace; (header, end record)."""
    from kvredis.redis.inspect import DUMP_FORMAT

    header, trailer = _check_dump(file, DUMP_FORMAT)
    shards = header.get("shards", 1)
    if target.config().cluster:
        _restore_cluster(target, file, replace, shards, _cluster_layout(header))
    elif shards != 1:  # the shards merged into one namespace
        from kvredis.redis.cluster.shards import KEY_LAYOUT
        from kvredis.redis.merge import merge_pod_shards, merge_shards

        # the key layout holds a request key in one shard; pod placement in each of its pods'
        merge = merge_shards if _cluster_layout(header) == KEY_LAYOUT else merge_pod_shards

        def key_records() -> Iterator[dict[str, Any]]:
            return (r for r in _records(file) if "key" in r)

        try:  # the whole merge once before the server is touched (it reads the file again)
            for _ in merge(key_records, shards):
                pass
        except NamespaceLayoutError as exc:
            raise click.BadParameter(f"{file}: {exc}", param_hint="FILE") from None
        merged = merge(key_records, shards)
        _restore_records(target, replace, int(header["bucket_bits"]), merged)
    else:
        records = (r for r in _records(file) if "key" in r)
        _restore_records(target, replace, int(header["bucket_bits"]), records)
    return header, trailer


@click.command(
    "rename",
    epilog="\b\nExample:\n  kvredis rename kv:prod kv-prod --redis redis://10.0.0.7:6379 --yes",
)
@click.argument("old", metavar="OLD")
@click.argument("new", metavar="NEW")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@NO_PROGRESS
@redis_options(url_required=True, namespace_option=False)
@logging_options
@handle_errors
def rename(target: RedisTarget, old: str, new: str, yes: bool, no_progress: bool) -> None:
    """Move the namespace OLD to the name NEW on the same server (or cluster), byte for byte.

    For a namespace whose name this kvredis refuses (one holding ':' or a glob character,
    made by an earlier kvredis): stop its writers (the ingesters) first; routers and ingesters
    then use NEW. Refuses a NEW that holds keys. OLD is deleted once NEW holds all of it.
    """
    from kvredis.redis.index import drop_namespace
    from kvredis.redis.layout import check_namespace_name

    old = check_existing_namespace(old, "OLD")
    try:
        new = check_namespace_name(new)
    except ValueError as exc:
        raise click.BadParameter(str(exc).split("; ", 1)[0], param_hint="NEW") from None
    if old == new:
        raise click.BadParameter(f"{new!r} is the name OLD already has", param_hint="NEW")
    source = RedisTarget(target.url, old, target.password)
    source.existing = True
    dest = RedisTarget(target.url, new, target.password)
    if not yes:
        click.confirm(
            f"Move namespace {old!r} at {target.shown} to {new!r}? Its writers must be stopped",
            abort=True,
            err=True,
        )
    with tempfile.NamedTemporaryFile("w+", encoding="utf-8", suffix=".jsonl") as spool:
        with open_inspector(source) as inspector:
            layout = existing_layout(inspector, source)
            bar = progress_bar("reading", no_progress)
            try:
                keys, _bits = _export(inspector, source, layout, _CountingWriter(spool), bar)
            finally:
                bar.close()
        spool.flush()
        _load(dest, spool.name, replace=False)
    try:
        drop_namespace(source.config())
    except Exception as exc:
        raise click.ClickException(
            f"{new!r} holds the namespace now, but deleting {old!r} failed ({exc}): run "
            f"`kvredis drop {shlex.quote(old)} --redis {shlex.quote(target.shown)} --yes`"
        ) from None
    click.echo(
        f"renamed namespace {old!r} to {new!r} at {target.shown} ({keys} keys); give its "
        f"routers and ingesters --namespace {shlex.quote(new)}"
    )


def _check_dump(file: str, dump_format: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and end records of a complete dump (BadParameter for anything else)."""
    header: dict[str, Any] = {}
    last: dict[str, Any] = {}
    count = 0
    for n, record in enumerate(_records(file)):
        if n == 0:
            header = record
        elif "key" in record:
            count += 1
        last = record
    shards = header.get("shards", 1)
    if (
        header.get("format") != dump_format
        or not isinstance(header.get("bucket_bits"), int)
        or not isinstance(shards, int)
        or isinstance(shards, bool)
        or shards < 1
    ):
        raise click.BadParameter(f"{file} is not a {dump_format} dump", param_hint="FILE")
    if not last.get("end") or last.get("records") != count:
        raise click.BadParameter(f"{file} is truncated (no end record)", param_hint="FILE")
    return header, last


def _restore_records(
    target: RedisTarget, replace: bool, bucket_bits: int, records: Iterable[dict[str, Any]]
) -> None:
    from kvredis.redis.inspect import op_namespace_keys, op_restore
    from kvredis.redis.layout import Layout

    with open_inspector(target) as inspector:
        probe = Layout(target.namespace, bucket_bits, b"")
        try:
            existing = single_layout(inspector, target) or probe
            other = ""
        except NamespaceLayoutError:  # another layout: --replace drops it all the same
            existing, other = None, " (in a layout this kvredis does not read)"
        if existing is None or inspector.run(op_namespace_keys(existing)):
            if not replace:
                raise click.ClickException(
                    f"namespace {target.namespace!r} at {target.shown} already holds keys"
                    f"{other}; pass --replace to drop them first"
                )
            from kvredis.redis.index import drop_namespace

            drop_namespace(target.config())
        prefix = probe.meta[: -len(b"meta")]
        inspector.run(op_restore(prefix, records))


def _cluster_layout(header: dict[str, Any]) -> str:
    """The cluster layout a dump's records are in: its header's (a cluster dump of kvredis
    before pod placement has none: the key layout; a single-server dump: the pod layout, its
    one shard holding every pod)."""
    from kvredis.redis.cluster.shards import CLUSTER_LAYOUT, CLUSTER_LAYOUTS, KEY_LAYOUT

    layout = header.get("cluster_layout")
    if layout is None:
        return KEY_LAYOUT if "shards" in header else CLUSTER_LAYOUT
    if layout not in CLUSTER_LAYOUTS:
        raise click.ClickException(
            f"the dump is of cluster layout {layout!r}, which this kvredis does not read "
            f"({', '.join(CLUSTER_LAYOUTS)})"
        )
    return str(layout)


def _restore_cluster(
    target: RedisTarget, file: str, replace: bool, shards: int, layout: str
) -> None:
    """Restore into a cluster namespace: each record into its shard, the dump's shard count
    and cluster layout becoming the namespace's (a single-server dump makes a namespace of one
    shard)."""
    from kvredis.errors import NamespaceMissingError
    from kvredis.redis.cluster.index import RedisClusterIndex
    from kvredis.redis.cluster.shards import MAX_SHARDS

    if shards > MAX_SHARDS:
        raise click.BadParameter(
            f"{file} has {shards} shards (at most {MAX_SHARDS})", param_hint="FILE"
        )
    with open_inspector(target) as inspector:
        if inspector.holds_keys():
            if not replace:
                raise click.ClickException(
                    f"namespace {target.namespace!r} at {target.shown} already holds keys; "
                    "pass --replace to drop them first"
                )
            try:
                with RedisClusterIndex(target.config(), create=False) as index:
                    index.drop_namespace()
            except NamespaceMissingError:
                raise click.ClickException(
                    f"namespace {target.namespace!r} at {target.shown} holds keys but no "
                    "cluster descriptor: delete them, or restore into another namespace"
                ) from None

        def records(shard: int) -> Iterator[dict[str, Any]]:
            return (r for r in _records(file) if "key" in r and r.get("shard", 0) == shard)

        inspector.restore(shards, records, layout)


def _records(file: str) -> Iterator[dict[str, Any]]:
    """The JSON records of a dump file, one per line."""
    try:
        with _open(file, "r") as fh:
            for line in fh:
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"a record is not an object: {line[:80]!r}")
                    yield record
    except (OSError, ValueError, EOFError) as exc:
        raise click.BadParameter(f"cannot read {file}: {exc}", param_hint="FILE") from None


COMMANDS = (dump, restore, rename)

"""The operator's commands on a namespace in Redis: stats, pods, lookup, score, clear, check,
watermarks, dump and restore."""

from __future__ import annotations

import gzip
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import IO, Any

import click

from kvredis.cli.options import (
    Prompt,
    RedisTarget,
    echo_json,
    handle_errors,
    json_option,
    logging_options,
    progress_bar,
    prompt_options,
    redis_options,
    table,
)
from kvredis.errors import BackendError, BackendUnavailableError

__all__ = ["COMMANDS"]

_NO_PROGRESS = click.option("--no-progress", is_flag=True, help="Do not draw a progress bar.")


def _command(example: str) -> Callable[[Callable[..., Any]], click.Command]:
    """A command with the shared options, error handling and an example in its help."""

    def decorate(f: Callable[..., Any]) -> click.Command:
        f = handle_errors(f)
        f = redis_options(url_required=True)(f)
        f = logging_options(f)
        return click.command(epilog=f"\b\nExample:\n  {example}")(f)

    return decorate


@contextmanager
def _inspector(target: RedisTarget | None) -> Iterator[Any]:
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


def _on_cluster(inspector: Any) -> bool:
    from kvredis.redis.inspect import Inspector

    return not isinstance(inspector, Inspector)


def _missing(target: RedisTarget) -> click.ClickException:
    return click.ClickException(
        f"namespace {target.namespace!r} does not exist at {target.shown} "
        "(check --namespace and --redis)"
    )


def _existing_layout(inspector: Any, target: RedisTarget) -> Any:
    """The namespace's layout (single server), or its shards' layouts (cluster); a one-line
    error if it does not exist, or if a single-server address names a node of a cluster."""
    if _on_cluster(inspector):
        shards = inspector.shards()
        if shards is None:
            raise _missing(target)
        return shards
    layout = _single_layout(inspector, target)
    if layout is None:
        raise _missing(target)
    return layout


def _single_layout(inspector: Any, target: RedisTarget) -> Any:
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
def _index(target: RedisTarget) -> Iterator[Any]:
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
    with _inspector(target) as inspector:
        _existing_layout(inspector, target)
    index = RedisIndex(target.config())
    try:
        yield index
    finally:
        index.close()


# -- stats and pods -----------------------------------------------------------------------------


@_command("kvredis stats --redis redis://10.0.0.7:6379 --namespace kvblock")
@_NO_PROGRESS
@click.option("--no-memory", is_flag=True, help="Skip MEMORY USAGE (faster on huge namespaces).")
@json_option
def stats(
    target: RedisTarget, namespace: str, no_progress: bool, no_memory: bool, as_json: bool
) -> None:
    """What a namespace holds: keys, entries, pods per tier, engine mappings, bytes, server."""
    from kvredis.redis.inspect import op_server_info, op_stats

    nodes = 0
    with _inspector(target) as inspector:
        layout = _existing_layout(inspector, target)
        bar = progress_bar("scanning", no_progress)
        try:
            if _on_cluster(inspector):
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


@_command("kvredis pods --namespace kvblock --json")
@_NO_PROGRESS
@json_option
def pods(target: RedisTarget, namespace: str, no_progress: bool, as_json: bool) -> None:
    """The pods in a namespace, with their (key, entry) pairs per device tier."""
    from kvredis.redis.inspect import op_stats

    with _inspector(target) as inspector:
        layout = _existing_layout(inspector, target)
        bar = progress_bar("scanning", no_progress)
        try:
            if _on_cluster(inspector):
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


# -- lookup and score ---------------------------------------------------------------------------


def _block_keys(prompt: Prompt) -> list[int]:
    keys = prompt.block_keys()
    if not keys:
        raise click.UsageError(
            f"no full block: {len(prompt.tokens)} tokens < block size {prompt.block_size} "
            "(check --block-size)"
        )
    return keys


_POD_FILTER = click.option(
    "--pod", "pods_filter", multiple=True, metavar="ID", help="Only these pods (repeatable)."
)


@_command("kvredis lookup --model meta-llama/Llama-3.1-8B --tokens-file prompt.txt")
@prompt_options
@_POD_FILTER
@json_option
def lookup(
    target: RedisTarget,
    namespace: str,
    prompt: Prompt,
    pods_filter: tuple[str, ...],
    as_json: bool,
) -> None:
    """The cached prefix of a prompt: per pod, how many leading blocks it holds, on which tiers."""
    keys = _block_keys(prompt)
    with _index(target) as index:
        found = index.lookup(keys, set(pods_filter) if pods_filter else None)
    chains: dict[str, dict[str, Any]] = {}
    for position, key in enumerate(keys):
        holders = found.get(key, [])
        if not holders:
            break
        for entry in holders:
            chain = chains.setdefault(entry.pod_identifier, {"blocks": 0, "tiers": set()})
            if chain["blocks"] == position:
                chain["blocks"] = position + 1
            if chain["blocks"] == position + 1:
                chain["tiers"].add(entry.device_tier)
    result = {
        pod: {
            "blocks": c["blocks"],
            "tokens": c["blocks"] * prompt.block_size,
            "tiers": sorted(c["tiers"]),
        }
        for pod, c in sorted(chains.items(), key=lambda kv: (-kv[1]["blocks"], kv[0]))
    }
    if as_json:
        echo_json({"blocks": len(keys), "keys_found": len(found), "pods": result})
        return
    click.echo(f"{len(keys)} blocks; the chain is cached up to block {len(found)}")
    if result:
        rows = [(p, r["blocks"], r["tokens"], ",".join(r["tiers"])) for p, r in result.items()]
        click.echo(table(("pod", "blocks", "tokens", "tiers"), rows))


def _weights(items: tuple[str, ...]) -> dict[str, float]:
    """``--weight TIER=W`` values: a tier name and a finite weight >= 0, each tier once."""
    medium: dict[str, float] = {}
    for item in items:
        tier, sep, text = item.partition("=")
        try:
            if not sep or not tier.strip() or not text.isascii():
                raise ValueError
            value = float(text)
        except ValueError:
            raise click.BadParameter(
                f"expected TIER=WEIGHT (e.g. cpu=0.8), got {item!r}", param_hint="--weight"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise click.BadParameter(
                f"{item!r}: a weight is a finite number >= 0 (e.g. cpu=0.8)", param_hint="--weight"
            )
        if tier in medium:
            raise click.BadParameter(f"tier {tier!r} is given twice", param_hint="--weight")
        medium[tier] = value
    return medium


@_command("kvredis score --model m --tokens 1,2,3,4 --block-size 2 --weight gpu=1 --weight cpu=0.8")
@prompt_options
@_POD_FILTER
@click.option(
    "--weight", "weights", multiple=True, metavar="TIER=W", help="Device tier weight (repeatable)."
)
@json_option
def score(
    target: RedisTarget,
    namespace: str,
    prompt: Prompt,
    pods_filter: tuple[str, ...],
    weights: tuple[str, ...],
    as_json: bool,
) -> None:
    """Per-pod longest-prefix scores of a prompt, as a router computes them."""
    medium = _weights(weights)
    keys = _block_keys(prompt)
    with _index(target) as index:
        scores = index.score(keys, medium or None, set(pods_filter) if pods_filter else None)
    ranked = dict(sorted(scores.items(), key=lambda kv: (-kv[1], kv[0])))
    if as_json:
        echo_json({"blocks": len(keys), "scores": ranked})
    elif not ranked:
        click.echo(f"no pod holds the first block of these {len(keys)} blocks")
    else:
        click.echo(table(("pod", "score"), [(p, f"{s:g}") for p, s in ranked.items()]))


# -- clear --------------------------------------------------------------------------------------


@_command("kvredis clear --pod vllm-7f9c-0 --yes")
@click.option("--pod", required=True, metavar="ID", help="The pod whose entries to remove.")
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="TIER",
    help="Only the entries on this device tier (repeatable; default: every tier).",
)
@click.option(
    "--dp-rank",
    type=click.IntRange(0, 2**31 - 1),
    default=None,
    help="Only the entries of this data-parallel rank (default: every rank).",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_NO_PROGRESS
@json_option
def clear(
    target: RedisTarget,
    namespace: str,
    pod: str,
    tiers: tuple[str, ...],
    dp_rank: int | None,
    yes: bool,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Remove every entry of one pod (e.g. a pod that died without its engine saying so), or
    only those on some tiers or of one data-parallel rank."""
    from kvredis.redis.inspect import op_scan

    if not pod:
        raise click.BadParameter("must not be empty", param_hint="--pod")
    scope = "every entry"
    if tiers or dp_rank is not None:
        scope = "the entries" + (f" on {', '.join(tiers)}" if tiers else "")
        scope += f" of rank {dp_rank}" if dp_rank is not None else ""
    if not yes:
        click.confirm(
            f"Remove {scope} of pod {pod!r} from namespace {target.namespace!r} at {target.shown}?",
            abort=True,
            err=True,
        )
    total = 0  # on a cluster the keys are not counted first: the bar shows keys done
    if not target.config().cluster:
        with _inspector(target) as inspector:
            layout = _existing_layout(inspector, target)
            total = len(inspector.run(op_scan(layout.request_pattern())))
            total += len(inspector.run(op_scan(layout.engine_pattern())))
    bar = progress_bar(f"clearing {pod}", no_progress)
    again = _clear_again(target, pod, tiers, dp_rank)
    try:
        with _index(target) as index:
            removed = index.clear_entries(
                pod,
                device_tiers=tiers or None,
                dp_rank=dp_rank,
                progress=lambda done, _n: bar(done, max(total, done)),
            )
    except KeyboardInterrupt:
        bar.close()
        click.echo(
            f"Interrupted: the clear of pod {pod!r} is incomplete (some of its entries and the "
            f"engine mappings leading to them are left; `kvredis check` notes the pod as "
            f"clear_pending). Run it again to finish:\n  {again}",
            err=True,
        )
        sys.exit(130)
    except (BackendUnavailableError, BackendError) as exc:
        raise click.ClickException(
            f"{exc}\nThe clear of pod {pod!r} is incomplete; once the server answers, run it "
            f"again to finish:\n  {again}"
        ) from None
    finally:
        bar.close()
    if as_json:
        echo_json({"pod": pod, "removed": removed})
    else:
        click.echo(f"removed {removed} (key, entry) pairs of pod {pod!r}")


def _clear_again(
    target: RedisTarget, pod: str, tiers: Sequence[str] = (), dp_rank: int | None = None
) -> str:
    """The command that finishes an interrupted clear of ``pod`` (the same tiers and rank)."""
    shown = target.shown
    command = (
        f"kvredis clear --pod {shlex.quote(pod)} --namespace {shlex.quote(target.namespace)} "
        f"--redis {shlex.quote(shown)} --yes"
    )
    command += "".join(f" --tier {shlex.quote(tier)}" for tier in tiers)
    if dp_rank is not None:
        command += f" --dp-rank {dp_rank}"
    return command + ("  (with your password in place of ***)" if "***" in shown else "")


# -- check --------------------------------------------------------------------------------------


@_command("kvredis check --namespace kvblock --repair")
@click.option("--repair", is_flag=True, help="Fix what is found (stop the writers first).")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Findings to list (0: all).",
)
@_NO_PROGRESS
@json_option
def check(
    target: RedisTarget, namespace: str, repair: bool, limit: int, no_progress: bool, as_json: bool
) -> None:
    """Verify every invariant of the key layout; with --repair, fix what is broken.

    Exits 1 when something is left broken.
    """
    from kvredis.redis.inspect import op_check

    with _inspector(target) as inspector:
        layout = _existing_layout(inspector, target)
        bar = progress_bar("checking", no_progress)
        try:
            if _on_cluster(inspector):
                report = inspector.check(repair, bar)
            else:
                report = inspector.run(op_check(layout, repair, bar))
        finally:
            bar.close()
    if as_json:
        echo_json(
            {
                "namespace": report.namespace,
                "keys_checked": report.keys_checked,
                "ok": report.ok,
                "counts": report.counts(),
                "findings": [f.as_json() for f in report.findings],
                "hints": _check_hints(report, target, repair),
                "note_counts": report.note_counts(),
                "notes": [f.as_json() for f in report.notes],
            }
        )
    else:
        repaired = sum(f.repaired for f in report.findings)
        click.echo(
            f"checked {report.keys_checked} keys of namespace {report.namespace!r}: "
            f"{len(report.findings)} problems found, {repaired} repaired"
        )
        if report.findings:
            click.echo(table(("problem", "count"), report.counts().items()))
            shown = report.findings if limit == 0 else report.findings[:limit]
            for f in shown:
                fld = "" if f.field is None else f" field {f.field.hex()}"
                mark = "repaired" if f.repaired else "found"
                where = "" if f.shard is None else f" (shard {f.shard})"
                click.echo(
                    f"  {mark}: {f.problem.value} in {f.as_json()['key']}{where}{fld}: {f.detail}"
                )
            if len(shown) < len(report.findings):
                click.echo(f"  ... {len(report.findings) - len(shown)} more (--limit 0 lists all)")
        for kind, count in report.note_counts().items():
            reclaimed = sum(f.repaired for f in report.notes if f.problem.value == kind)
            done = f", {reclaimed} reclaimed" if reclaimed else ""
            click.echo(f"note: {count} {kind} (legitimate states, not problems{done})")
        for hint in _check_hints(report, target, repair):
            click.echo(hint)
    if not report.ok:
        sys.exit(1)


def _check_hints(report: Any, target: RedisTarget, repair: bool) -> list[str]:
    """What to do about what is left broken, and about clears left unfinished."""
    from kvredis.redis.inspect import Problem

    left = [f for f in report.findings if not f.repaired]
    hints = []
    scopes: dict[str, tuple[set[str], set[int]]] = {}  # pod -> tiers, ranks (every shard's)
    for note in report.notes:
        if note.problem is Problem.CLEAR_PENDING and note.field is not None:
            pod = note.field.decode("utf-8", "surrogatepass")
            tiers, ranks = scopes.setdefault(pod, (set(), set()))
            if note.scope is not None:
                tiers.update(note.scope[0])
                ranks.update(note.scope[1])
    for pod, (tiers, ranks) in sorted(scopes.items()):
        # the same tiers (and each rank on its own), so a clear of some tiers or of one rank
        # that was cut short is finished without touching the pod's other entries
        commands = [_clear_again(target, pod, sorted(tiers), rank) for rank in sorted(ranks)]
        hints.append(
            f"pod {pod!r} has an unfinished clear: unless a clear of it is running now, run it "
            "again to finish it:\n  " + "\n  ".join(commands or [_clear_again(target, pod)])
        )
    if left and not repair:
        hints.append("`kvredis check --repair` fixes what it can (stop the writers first)")
    return hints


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


@_command("kvredis watermarks --reset vllm-7f9c-0 --yes")
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
        with _index(target) as index:
            for stream in resets:
                if index.get_watermark(stream) is None:
                    raise click.BadParameter(
                        f"no watermark for stream {stream!r}", param_hint="--reset"
                    )
                index.reset_watermark(stream, None)
        click.echo(f"reset {len(resets)} watermark(s)", err=True)
    with _inspector(target) as inspector:
        layout = _existing_layout(inspector, target)
        if _on_cluster(inspector):  # over the shards, and how many hold one
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


@_command("kvredis dump kvblock-$(date +%F).jsonl.gz --namespace kvblock")
@click.argument("file", metavar="FILE")
@_NO_PROGRESS
@json_option
def dump(target: RedisTarget, namespace: str, file: str, no_progress: bool, as_json: bool) -> None:
    """Export a namespace to FILE (JSON lines; gzip if it ends in .gz; '-': stdout).

    `kvredis restore` loads it back, on this server or another, byte for byte. With --json, a
    summary (records, keys, bytes, namespace, layout) is printed on stdout.
    """
    from kvredis.redis.inspect import DUMP_FORMAT, op_dump

    if as_json and file == "-":
        raise click.UsageError(
            "--json prints the summary on stdout, which FILE '-' takes: name a file"
        )
    parent = os.path.dirname(os.path.abspath(file))
    if file != "-" and not os.path.isdir(parent):
        raise click.BadParameter(
            f"cannot write {file}: the directory {parent} does not exist", param_hint="FILE"
        )
    with _inspector(target) as inspector:
        layout = _existing_layout(inspector, target)
        out = _open_output(file)
        write = _CountingWriter(out)
        bar = progress_bar("dumping", no_progress)
        complete = False
        try:
            if _on_cluster(inspector):  # every shard's records, tagged with their shard
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
                write(
                    {
                        "format": DUMP_FORMAT,
                        "namespace": layout.namespace,
                        "bucket_bits": bits,
                    }
                )
                keys = inspector.run(op_dump(layout, write, bar))
            write({"end": True, "keys": keys, "records": write.records - 1})
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


@_command("kvredis restore kvblock-2026-01-31.jsonl.gz --namespace kvblock")
@click.argument("file", metavar="FILE")
@click.option("--replace", is_flag=True, help="Drop the namespace first if it holds keys.")
def restore(target: RedisTarget, namespace: str, file: str, replace: bool) -> None:
    """Load a namespace exported by `kvredis dump` (into --namespace; '-': stdin).

    Refuses a namespace that already holds keys unless --replace.
    """
    from kvredis.redis.inspect import DUMP_FORMAT

    with ExitStack() as stack:
        if file == "-":  # read twice below: spool stdin to a file
            spool = stack.enter_context(
                tempfile.NamedTemporaryFile("w+", encoding="utf-8", suffix=".jsonl")
            )
            shutil.copyfileobj(sys.stdin, spool)
            spool.flush()
            file = spool.name
        header, trailer = _check_dump(file, DUMP_FORMAT)
        shards = header.get("shards", 1)
        if target.config().cluster:
            _restore_cluster(target, file, replace, shards, _cluster_layout(header))
        elif shards != 1:
            raise click.BadParameter(
                f"{file} is a dump of a cluster namespace of {shards} shards: restore it to a "
                "cluster (--redis redis+cluster://host:port)",
                param_hint="FILE",
            )
        else:
            _restore_records(target, file, replace, int(header["bucket_bits"]))
    click.echo(
        f"restored {trailer['keys']} keys of namespace {header['namespace']!r} into "
        f"{target.namespace!r}",
        err=True,
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


def _restore_records(target: RedisTarget, file: str, replace: bool, bucket_bits: int) -> None:
    from kvredis.errors import NamespaceLayoutError
    from kvredis.redis.inspect import op_namespace_keys, op_restore
    from kvredis.redis.layout import Layout

    with _inspector(target) as inspector:
        probe = Layout(target.namespace, bucket_bits, b"")
        try:
            existing = _single_layout(inspector, target) or probe
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
        inspector.run(op_restore(prefix, (r for r in _records(file) if "key" in r)))


def _cluster_layout(header: dict[str, Any]) -> str:
    """The cluster layout a dump's records are in: its header's (a cluster dump of kvredis
    before pod placement has none: the key layout; a single-server dump: the pod layout, its
    one shard holding every pod)."""
    from kvredis.redis.cluster.shards import CLUSTER_LAYOUT, CLUSTER_LAYOUTS, KEY_LAYOUT

    layout = header.get("cluster_layout")
    if layout is None:
        return KEY_LAYOUT if "shards" in header else CLUSTER_LAYOUT
    if layout not in CLUSTER_LAYOUTS:
        raise click.ClickException(f"the dump is of cluster layout {layout!r}, which this "
                                   f"kvredis does not read ({', '.join(CLUSTER_LAYOUTS)})")
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
    with _inspector(target) as inspector:
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


COMMANDS = (stats, pods, lookup, score, clear, check, watermarks, dump, restore)

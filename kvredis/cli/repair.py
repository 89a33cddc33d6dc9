"""``kvredis clear`` and ``check``: remove a pod's entries, verify and repair the layout."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
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
from kvredis.errors import BackendError, BackendUnavailableError

__all__ = ["COMMANDS"]


# -- clear --------------------------------------------------------------------------------------


@operator_command("kvredis clear --pod vllm-7f9c-0 --yes")
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
@NO_PROGRESS
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
        with open_inspector(target) as inspector:
            layout = existing_layout(inspector, target)
            total = len(inspector.run(op_scan(layout.request_pattern())))
            total += len(inspector.run(op_scan(layout.engine_pattern())))
    bar = progress_bar(f"clearing {pod}", no_progress)
    again = _clear_again(target, pod, tiers, dp_rank)
    try:
        with open_index(target) as index:
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


@operator_command("kvredis check --namespace kvblock --repair")
@click.option("--repair", is_flag=True, help="Fix what is found (stop the writers first).")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Findings to list (0: all).",
)
@NO_PROGRESS
@json_option
def check(
    target: RedisTarget, namespace: str, repair: bool, limit: int, no_progress: bool, as_json: bool
) -> None:
    """Verify every invariant of the key layout; with --repair, fix what is broken.

    Exits 1 when something is left broken.
    """
    from kvredis.redis.inspect import op_check

    with open_inspector(target) as inspector:
        layout = existing_layout(inspector, target)
        bar = progress_bar("checking", no_progress)
        try:
            if on_cluster(inspector):
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


COMMANDS = (clear, check)

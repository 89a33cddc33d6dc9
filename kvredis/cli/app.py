"""The ``kvredis`` command group: the demo, block keys, ingestion and the operator's commands.

Every command takes ``--log-level``/``-v`` (before or after its name) and shows an example in
its ``--help``; ``kvredis --version`` prints the version. ``python -m kvredis`` runs the same.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable

import click

from kvredis._version import __version__
from kvredis.cli.acl import COMMANDS as ACL_COMMANDS
from kvredis.cli.backup import COMMANDS as BACKUP_COMMANDS
from kvredis.cli.cluster import COMMANDS as CLUSTER_COMMANDS
from kvredis.cli.functions import COMMANDS as FUNCTION_COMMANDS
from kvredis.cli.ingest import ingest
from kvredis.cli.migrate import COMMANDS as LAYOUT_COMMANDS
from kvredis.cli.options import (
    Prompt,
    RedisTarget,
    handle_errors,
    logging_options,
    logging_params,
    prompt_options,
    redis_options,
    warn_unknown_environment,
)
from kvredis.cli.query import COMMANDS as QUERY_COMMANDS
from kvredis.cli.repair import COMMANDS as REPAIR_COMMANDS
from kvredis.cli.report import COMMANDS as REPORT_COMMANDS
from kvredis.index import Closeable, Index, NamespaceIndex

BACKENDS = ("memory", "cost-aware")
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(
    context_settings=CONTEXT,
    epilog="\b\nExamples:\n  kvredis demo\n  kvredis stats --redis redis://10.0.0.7:6379\n"
    "  kvredis ingest --redis redis://10.0.0.7:6379 --endpoint tcp://10.0.0.5:5557 "
    "--pod pod-a --model m",
)
@click.version_option(__version__, "--version", prog_name="kvredis")
@logging_options
def cli() -> None:
    """kvredis: a shared KV-cache block index for LLM routers, kept in Redis or Valkey.

    Every command that works on a server takes --redis URL (env KVREDIS_REDIS_URL; default
    redis://127.0.0.1:6379). Only `kvredis demo` without --redis and `kvredis ingest
    --in-memory` use an index in the process instead, and say so.
    """
    warn_unknown_environment()


def _index_factory(
    backend: str, target: RedisTarget | None, namespace: str
) -> Callable[[str], Index]:
    if target is not None:
        from kvredis.redis.factories import new_redis_index

        return lambda router: new_redis_index(target.config(namespace=f"{namespace}-{router}"))
    if backend == "cost-aware":
        from kvredis.memory import CostAwareMemoryIndex

        return lambda _router: CostAwareMemoryIndex()
    from kvredis.memory import InMemoryIndex

    return lambda _router: InMemoryIndex()


@cli.command(epilog="\b\nExample:\n  kvredis demo --redis redis://127.0.0.1:6379 --pods 16")
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default="memory",
    show_default=True,
    help="Embedded index backend (ignored with --redis).",
)
@redis_options(default_namespace=None)
@click.option("--pods", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--conversations", type=click.IntRange(1, 100_000), default=200, show_default=True)
@click.option("--turns", type=click.IntRange(1, 100), default=6, show_default=True)
@click.option("--system-prompts", type=click.IntRange(1, 1000), default=16, show_default=True)
@click.option(
    "--gpu-blocks",
    type=click.IntRange(1),
    default=400,
    show_default=True,
    help="GPU-tier prefix-cache capacity per pod, in blocks.",
)
@click.option(
    "--cpu-blocks",
    type=click.IntRange(0),
    default=400,
    show_default=True,
    help="CPU-tier (offload) capacity per pod, in blocks.",
)
@click.option("--seed", type=int, default=7, show_default=True, help="Workload seed.")
@click.option("--no-progress", is_flag=True, help="Do not draw progress bars.")
@logging_options
@handle_errors
def demo(
    backend: str,
    target: RedisTarget | None,
    namespace: str | None,
    pods: int,
    conversations: int,
    turns: int,
    system_prompts: int,
    gpu_blocks: int,
    cpu_blocks: int,
    seed: int,
    no_progress: bool,
) -> None:
    """Route a synthetic multi-turn chat workload with kvredis vs. random routing.

    With --redis, each router gets the namespace <NAMESPACE>-<router> (default NAMESPACE: a
    fresh demo-<id>), dropped when the demo ends.
    """
    from kvredis.demo import WorkloadConfig, generate_requests, routers, simulate

    cfg = WorkloadConfig(
        pods=pods,
        conversations=conversations,
        turns=turns,
        system_prompts=system_prompts,
        gpu_blocks_per_pod=gpu_blocks,
        cpu_blocks_per_pod=cpu_blocks,
        seed=seed,
    )
    ns = namespace or f"demo-{uuid.uuid4().hex[:8]}"
    make_index = _index_factory(backend, target, ns)
    where = f"Redis at {target.shown} (namespace {ns})" if target else f"{backend} index"
    requests = generate_requests(cfg)
    click.echo(
        f"{len(requests)} requests from {conversations} conversations over {system_prompts} "
        f"system prompts, {pods} pods, {where}"
    )
    results = []
    for name, router in routers(cfg):
        index = make_index(name)
        try:
            with click.progressbar(
                length=len(requests),
                label=f"{name:>8}",
                show_eta=False,
                file=io.StringIO() if no_progress else None,
            ) as bar:
                results.append(simulate(cfg, requests, index, name, router, lambda: bar.update(1)))
        finally:
            if isinstance(index, NamespaceIndex):
                index.drop_namespace()
            if isinstance(index, Closeable):
                index.close()
    click.echo("")
    header = (
        f"{'router':<10}{'requests':>10}{'prompt tokens':>15}{'prefix hit rate':>17}"
        f"{'saved prefill tokens':>22}{'busiest pod':>13}"
    )
    click.echo(header)
    click.echo("-" * len(header))
    for r in results:
        click.echo(
            f"{r.router:<10}{r.requests:>10}{r.prompt_tokens:>15}{r.hit_rate:>16.1%} "
            f"{r.hit_tokens:>21}{r.max_pod_share:>12.1%}"
        )
    base, best = results[0], results[-1]
    if base.hit_tokens:
        click.echo(
            f"\nkvredis routing saved {best.hit_tokens / base.hit_tokens:.1f}x the prefill "
            "tokens of random routing."
        )


@cli.command(epilog="\b\nExample:\n  kvredis keys --model m --tokens '1 2 3 4' --block-size 2")
@prompt_options
@click.option(
    "--parent",
    type=click.IntRange(0, 2**64 - 1),
    default=0,
    show_default=True,
    help="Parent block key to continue a chain from (0 = start at the model root).",
)
@logging_options
@handle_errors
def keys(prompt: Prompt, parent: int) -> None:
    """Print the request keys (one per full block) of a token sequence."""
    block_keys = prompt.block_keys(parent)
    if not block_keys:
        click.echo(
            f"no full block: {len(prompt.tokens)} tokens < block size {prompt.block_size}",
            err=True,
        )
    for i, key in enumerate(block_keys):
        click.echo(f"{i}\t{key}")


ingest.params.extend(logging_params())
cli.add_command(ingest)
for _command in (
    *REPORT_COMMANDS,
    *QUERY_COMMANDS,
    *REPAIR_COMMANDS,
    *BACKUP_COMMANDS,
    *LAYOUT_COMMANDS,
    *CLUSTER_COMMANDS,
    *FUNCTION_COMMANDS,
    *ACL_COMMANDS,
):
    cli.add_command(_command)


def main() -> None:
    """Entry point of the ``kvredis`` console script."""
    cli.main(prog_name="kvredis")


if __name__ == "__main__":  # pragma: no cover
    main()

"""The ``kvredis`` command line: the routing demo, block-key inspection and event ingestion."""

from __future__ import annotations

import io
import logging
import uuid
from collections.abc import Callable

import click

from kvredis.errors import ConfigError, KVRedisError
from kvredis.index import Closeable, Index, NamespaceIndex
from kvredis.ingest.cli import ingest

BACKENDS = ("memory", "cost-aware")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """kvredis: a shared KV-cache block index for LLM routers."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _index_factory(backend: str, redis_url: str | None, namespace: str) -> Callable[[str], Index]:
    if redis_url is not None:
        from kvredis.redis.config import RedisIndexConfig
        from kvredis.redis.index import new_redis_index

        def make_redis(router: str) -> Index:
            return new_redis_index(
                RedisIndexConfig(address=redis_url, namespace=f"{namespace}:{router}")
            )

        return make_redis
    if backend == "cost-aware":
        from kvredis.memory import CostAwareMemoryIndex

        return lambda _router: CostAwareMemoryIndex()
    from kvredis.memory import InMemoryIndex

    return lambda _router: InMemoryIndex()


@cli.command()
@click.option(
    "--backend", type=click.Choice(BACKENDS), default="memory", show_default=True,
    help="Embedded index backend (ignored with --redis).",
)
@click.option("--redis", "redis_url", metavar="URL", default=None,
              help="Use a shared Redis/Valkey index at URL (redis://, valkey://, rediss://, ...).")
@click.option("--namespace", default=None,
              help="Key namespace on Redis (default: a fresh demo-<id> namespace, removed after).")
@click.option("--pods", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--conversations", type=click.IntRange(1, 100_000), default=200, show_default=True)
@click.option("--turns", type=click.IntRange(1, 100), default=6, show_default=True)
@click.option("--system-prompts", type=click.IntRange(1, 1000), default=16, show_default=True)
@click.option("--gpu-blocks", type=click.IntRange(1), default=400, show_default=True,
              help="GPU-tier prefix-cache capacity per pod, in blocks.")
@click.option("--cpu-blocks", type=click.IntRange(0), default=400, show_default=True,
              help="CPU-tier (offload) capacity per pod, in blocks.")
@click.option("--seed", type=int, default=7, show_default=True)
@click.option("--no-progress", is_flag=True, help="Do not draw progress bars.")
def demo(
    backend: str, redis_url: str | None, namespace: str | None, pods: int, conversations: int,
    turns: int, system_prompts: int, gpu_blocks: int, cpu_blocks: int, seed: int,
    no_progress: bool,
) -> None:
    """Route a synthetic multi-turn chat workload with kvredis vs. random routing."""
    from kvredis.demo import WorkloadConfig, generate_requests, routers, simulate

    cfg = WorkloadConfig(
        pods=pods, conversations=conversations, turns=turns, system_prompts=system_prompts,
        gpu_blocks_per_pod=gpu_blocks, cpu_blocks_per_pod=cpu_blocks, seed=seed,
    )
    ns = namespace or f"demo-{uuid.uuid4().hex[:8]}"
    make_index = _index_factory(backend, redis_url, ns)
    where = f"Redis at {redis_url} (namespace {ns})" if redis_url else f"{backend} index"
    requests = generate_requests(cfg)
    click.echo(
        f"{len(requests)} requests from {conversations} conversations over {system_prompts} "
        f"system prompts, {pods} pods, {where}"
    )
    results = []
    try:
        for name, router in routers(cfg):
            index = make_index(name)
            try:
                with click.progressbar(
                    length=len(requests), label=f"{name:>8}", show_eta=False,
                    file=io.StringIO() if no_progress else None,
                ) as bar:
                    results.append(simulate(cfg, requests, index, name, router,
                                            lambda: bar.update(1)))
            finally:
                if namespace is None and isinstance(index, NamespaceIndex):
                    index.drop_namespace()
                if isinstance(index, Closeable):
                    index.close()
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--redis") from exc
    except KVRedisError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo("")
    header = (f"{'router':<10}{'requests':>10}{'prompt tokens':>15}{'prefix hit rate':>17}"
              f"{'saved prefill tokens':>22}{'busiest pod':>13}")
    click.echo(header)
    click.echo("-" * len(header))
    for r in results:
        click.echo(f"{r.router:<10}{r.requests:>10}{r.prompt_tokens:>15}{r.hit_rate:>16.1%} "
                   f"{r.hit_tokens:>21}{r.max_pod_share:>12.1%}")
    base, best = results[0], results[-1]
    if base.hit_tokens:
        click.echo(f"\nkvredis routing saved {best.hit_tokens / base.hit_tokens:.1f}x the prefill "
                   "tokens of random routing.")


def _parse_tokens(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    try:
        return [int(t) for t in value.replace(" ", "").split(",") if t]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated token ids, got {value!r}") from exc


@cli.command()
@click.option("--model", required=True, help="Model name the keys are derived for.")
@click.option("--tokens", required=True, callback=_parse_tokens,
              help="Comma-separated token ids, e.g. 1,2,3,...")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--hash-algo", type=click.Choice(["xxh3_64", "fnv64a_cbor"]), default="xxh3_64",
              show_default=True)
@click.option("--seed", "hash_seed", default="", help="Hash seed (PYTHONHASHSEED of the engine).")
@click.option("--parent", type=int, default=0, show_default=True,
              help="Parent block key to continue a chain from (0 = start at the model root).")
def keys(model: str, tokens: list[int], block_size: int, hash_algo: str, hash_seed: str,
         parent: int) -> None:
    """Print the request keys (one per full block) of a token sequence."""
    from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig

    try:
        db = ChunkedTokenDatabase(TokenProcessorConfig(
            block_size_tokens=block_size, hash_seed=hash_seed, hash_algo=hash_algo))
        block_keys = db.tokens_to_kv_block_keys(parent, tokens, model)
    except (KVRedisError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    if not block_keys:
        click.echo(f"no full block: {len(tokens)} tokens < block size {db.block_size()}", err=True)
    for i, key in enumerate(block_keys):
        click.echo(f"{i}\t{key}")


cli.add_command(ingest)


def main() -> None:
    """Entry point of the ``kvredis`` console script."""
    cli.main(prog_name="kvredis")


if __name__ == "__main__":  # pragma: no cover
    main()

"""``kvredis lookup`` and ``score``: a prompt's cached prefix, as a router reads it."""

from __future__ import annotations

import math
from typing import Any

import click

from kvredis.cli.namespace import open_index, operator_command
from kvredis.cli.options import Prompt, RedisTarget, echo_json, json_option, prompt_options, table

__all__ = ["COMMANDS"]


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


@operator_command("kvredis lookup --model meta-llama/Llama-3.1-8B --tokens-file prompt.txt")
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
    with open_index(target) as index:
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


@operator_command(
    "kvredis score --model m --tokens 1,2,3,4 --block-size 2 --weight gpu=1 --weight cpu=0.8"
)
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
    with open_index(target) as index:
        scores = index.score(keys, medium or None, set(pods_filter) if pods_filter else None)
    ranked = dict(sorted(scores.items(), key=lambda kv: (-kv[1], kv[0])))
    if as_json:
        echo_json({"blocks": len(keys), "scores": ranked})
    elif not ranked:
        click.echo(f"no pod holds the first block of these {len(keys)} blocks")
    else:
        click.echo(table(("pod", "score"), [(p, f"{s:g}") for p, s in ranked.items()]))


COMMANDS = (lookup, score)

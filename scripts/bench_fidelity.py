"""Ingestion fidelity: the hit rates real vLLM/SGLang message shapes get, before and after.

Each case publishes a prompt the way an engine does (messages built by ``tests/ingest/wire.py``
in vLLM 0.34's and SGLang 0.5.23's shapes), ingests them into an in-memory index and counts how
many of the router's block keys for that prompt the pod holds, from the first. "Before" runs
the same cases in a child process on the kvredis tree of an older commit (``--before``, default
the commit this work started from), "after" on this checkout; both child processes get the same
router keys, computed here.

    .venv/bin/python scripts/bench_fidelity.py [--before REF] [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

from _bench import REPO, bench_parser, write_json

# The repository root is on sys.path once _bench is imported.
wire = __import__("tests.ingest.wire", fromlist=["wire"])
sglang_batch, sglang_pages = wire.sglang_batch, wire.sglang_pages
vllm_batch, vllm_stored = wire.vllm_batch, wire.vllm_stored
vllm_removed, vllm_offload_placeholder = wire.vllm_removed, wire.vllm_offload_placeholder

MODEL = "base-model"
LORA = "sql-lora"
PROMPT = tuple(range(1000, 1256))  # 256 tokens


@dataclass(frozen=True)
class Case:
    """One prompt as an engine publishes it, and what the router asks for it."""

    name: str
    payloads: list[tuple[str, bytes]] | list[tuple[str, bytes, str]]
    """(pod, payload[, endpoint]): the publisher is the endpoint (default: the pod)."""
    block_size: int = 16
    tokens: tuple[int, ...] = PROMPT[:64]
    model: str = MODEL
    image: tuple[str, int, int] | None = None
    """(identifier, offset, length) of an image in the prompt."""
    salt: str | None = None
    pods: tuple[str, ...] = ("pod-a",)
    notes: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    """IngesterConfig options (an older tree without one runs with its defaults)."""
    group: int | None = None
    """Count only the entries of this KV-cache group."""


def _nodes(sizes: list[int], page: int, tokens: tuple[int, ...]) -> list[tuple[str, bytes]]:
    """SGLang radix nodes of these sizes, one batch each, chained."""
    out, parent, start = [], None, 0
    for size in sizes:
        events, parent = sglang_pages(tokens[start : start + size], page, 10_000 + start, parent)
        out.append(("pod-a", sglang_batch(events)))
        start += size
    return out


def _vllm_steps(steps: list[int], engine_block: int) -> list[tuple[str, bytes]]:
    """vLLM publishing the blocks each scheduler step filled (``steps`` counts blocks)."""
    out, parent, start, h = [], None, 0, 1
    for blocks in steps:
        n = blocks * engine_block
        hashes = list(range(h, h + blocks))
        event = vllm_stored(hashes, parent, PROMPT[start : start + n], engine_block)
        out.append(("pod-a", vllm_batch([event])))
        parent, start, h = hashes[-1], start + n, h + blocks
    return out


def _vllm_one(**fields: Any) -> list[tuple[str, bytes]]:
    """One vLLM batch storing the first 64 prompt tokens as 4 blocks on pod-a."""
    return [("pod-a", vllm_batch([vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16, **fields)]))]


def _dp_ranks() -> list[tuple[str, bytes, str]]:
    """Two DP ranks of pod-a (one endpoint each) store one prefix; rank 0 evicts it."""
    store = vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16, group_idx=0)
    out = []
    for rank in (0, 1):
        out.append(("pod-a", vllm_batch([store], data_parallel_rank=rank), f"dp{rank}"))
    removed = vllm_removed([1, 2, 3, 4], group_idx=0)
    out.append(("pod-a", vllm_batch([removed], data_parallel_rank=0), "dp0"))
    return out


def _hybrid() -> list[tuple[str, bytes]]:
    """Group 0 (16-token blocks) and group 1 (32-token: every second hash); group 0 evicts its
    last block."""
    full = vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16, group_idx=0)
    window = vllm_stored([2, 4], None, PROMPT[:64], 32, group_idx=1)
    removed = vllm_removed([4], group_idx=0)
    return [("pod-a", vllm_batch([full, window])), ("pod-a", vllm_batch([removed]))]


def _reset() -> list[tuple[str, bytes]]:
    """GPU blocks, their CPU offloads (one block per chunk), then a prefix-cache reset."""
    store = vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16, group_idx=0)
    cpu = [vllm_offload_placeholder(h, 0) for h in (1, 2, 3, 4)]
    return [
        ("pod-a", vllm_batch([store])),
        ("pod-a", vllm_batch(cpu)),
        ("pod-a", vllm_batch([wire.all_cleared()])),
    ]


def _chunk() -> list[tuple[str, bytes]]:
    """GPU blocks, one CPU chunk of all 4 (the event names its last block), GPU eviction."""
    store = vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16, group_idx=0)
    removed = vllm_removed([1, 2, 3, 4], group_idx=0)
    return [
        ("pod-a", vllm_batch([store])),
        ("pod-a", vllm_batch([vllm_offload_placeholder(4, 0)])),
        ("pod-a", vllm_batch([removed])),
    ]


def cases() -> list[Case]:
    turns = [23, 41, 9, 57, 30, 18, 50, 28]  # a conversation's radix nodes, 256 tokens
    lora_extra: list[Any] = [[LORA]] * 4
    image_extra: list[Any] = [[LORA, ["img-a", 4]], [LORA, ["img-a", -12]], [LORA], [LORA]]
    salt_extra: list[Any] = [["tenant-7"], None, None, None]
    bigram, last = sglang_pages(PROMPT[:40], 1, 1, bigram_next=PROMPT[40])
    bigram2, _ = sglang_pages(PROMPT[40:64], 1, 41, last, bigram_next=PROMPT[64])
    return [
        Case("SGLang page size 1, 8 radix nodes", _nodes(turns, 1, PROMPT), tokens=PROMPT),
        Case("SGLang page size 1, 40+24", _nodes([40, 24], 1, PROMPT)),
        Case("SGLang page size 1, 7+20+37", _nodes([7, 20, 37], 1, PROMPT)),
        Case(
            "vLLM 16-token blocks, index 64, 5+3+8 blocks",
            _vllm_steps([5, 3, 8], 16),
            block_size=64,
            tokens=PROMPT,
        ),
        Case(
            "SGLang EAGLE bigram pages, 40+24",
            [("pod-a", sglang_batch(bigram)), ("pod-a", sglang_batch(bigram2))],
        ),
        Case("vLLM LoRA", _vllm_one(lora_id=1, lora_name=LORA, extra_keys=lora_extra), model=LORA),
        Case("vLLM cache salt", _vllm_one(extra_keys=salt_extra), salt="tenant-7"),
        Case(
            "vLLM LoRA + image",
            _vllm_one(lora_name=LORA, extra_keys=image_extra),
            model=LORA,
            image=("img-a", 4, 20),
        ),
        Case(
            "vLLM locality (remote copy on pod-b)",
            [
                ("pod-a", vllm_batch([vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16)])),
                (
                    "pod-b",
                    vllm_batch(
                        [vllm_stored([1, 2, 3, 4], None, PROMPT[:64], 16, locality="REMOTE")]
                    ),
                ),
            ],
            pods=("pod-a", "pod-b"),
        ),
        Case("vLLM DP ranks, rank 0 evicts a shared prefix", _dp_ranks()),
        Case("vLLM hybrid 16+32, group 0 evicts block 3 (exact: 3/4)", _hybrid(), group=0),
        Case("vLLM prefix-cache reset, CPU copies kept", _reset()),
        Case(
            "vLLM offloaded chunk of 4 blocks, GPU evicted",
            _chunk(),
            config={"offload_blocks_per_chunk": 4},
        ),
    ]


# -- the child: ingest with whatever kvredis is importable, report the tiers of the hits --------


def child(tree: str, router_keys: dict[str, list[int]]) -> dict[str, dict[str, list[list[str]]]]:
    sys.path.insert(0, tree)  # that tree's kvredis, ahead of this checkout's
    import kvredis

    assert Path(kvredis.__file__).resolve().is_relative_to(Path(tree).resolve()), kvredis.__file__
    from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
    from kvredis.ingest import EventIngester, IngesterConfig
    from kvredis.memory import InMemoryIndex

    out: dict[str, dict[str, list[list[str]]]] = {}
    for case in cases():
        index = InMemoryIndex()
        tp = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=case.block_size))
        try:
            config = IngesterConfig(**case.config)
        except TypeError:  # an older tree without the option
            config = IngesterConfig()
        ingester = EventIngester(index, tp, config=config)
        seqs: dict[str, int] = {}
        for pod, payload, *endpoint in case.payloads:
            source = endpoint[0] if endpoint else pod
            seqs[source] = seqs.get(source, -1) + 1
            ingester.process(f"kv@{pod}@{MODEL}", seqs[source], payload, source)
        keys = router_keys[case.name]
        per_pod: dict[str, list[list[str]]] = {}
        for pod in case.pods:
            found = index.lookup(keys, {pod})
            tiers: list[list[str]] = []
            for key in keys:
                entries = found.get(key, [])
                if case.group is not None:
                    entries = [e for e in entries if e.has_group and e.group_idx == case.group]
                if not entries:
                    break
                tiers.append(sorted(e.device_tier for e in entries))
            per_pod[pod] = tiers
        out[case.name] = per_pod
    return out


# -- the parent ---------------------------------------------------------------------------------


def router_keys() -> dict[str, list[int]]:
    from kvredis.features import PlaceholderRange, compute_block_extra_features
    from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig

    out = {}
    for case in cases():
        tp = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=case.block_size))
        feats = None
        if case.image is not None:
            ident, offset, length = case.image
            feats = compute_block_extra_features(
                {"image": [ident]},
                {"image": [PlaceholderRange(offset, length)]},
                case.block_size,
                len(case.tokens),
            )
        out[case.name] = tp.tokens_to_kv_block_keys(
            0, case.tokens, case.model, feats, cache_salt=case.salt
        )
    return out


def extract(ref: str, into: Path) -> None:
    """The ``kvredis`` and ``lua`` trees of ``ref`` under ``into``."""
    data = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "kvredis", "lua"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")


def run_child(tree: Path, keys: dict[str, list[int]]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(tree)],
        input=json.dumps(keys),
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def describe(case: Case, result: dict[str, list[list[str]]], n: int) -> str:
    from kvredis.scoring import LongestPrefixScorer

    if len(case.pods) == 1:
        hit = len(result[case.pods[0]])
        tiers = sorted({t for held in result[case.pods[0]] for t in held} - {"gpu"})
        return f"{hit}/{n} ({100 * hit / n:.0f}%)" + (f" on {','.join(tiers)}" if tiers else "")
    scorer = LongestPrefixScorer()
    scores = [sum(max(scorer.weight(t) for t in tiers) for tiers in result[p]) for p in case.pods]
    tier = result[case.pods[1]][0][0] if result[case.pods[1]] else "-"
    return f"remote as {tier!r}, score {scores[1] / scores[0]:.2f}x local"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], json.load(sys.stdin))))
        return
    parser = bench_parser(__doc__, "the same run (it takes about a second)")
    parser.add_argument("--before", default="cac6feb", help="git ref of the older behaviour")
    args = parser.parse_args()
    keys = router_keys()
    with tempfile.TemporaryDirectory(prefix="kvredis-fidelity-") as tmp:
        extract(args.before, Path(tmp))
        before = run_child(Path(tmp), keys)
    after = run_child(REPO, keys)
    rows = []
    width = max(len(c.name) for c in cases())
    print(f"{'case':<{width}}  {'before':>32}  {'after':>32}")
    print("-" * (width + 68))
    for case in cases():
        n = len(keys[case.name])
        b, a = describe(case, before[case.name], n), describe(case, after[case.name], n)
        print(f"{case.name:<{width}}  {b:>32}  {a:>32}")
        rows.append({"case": case.name, "keys": n, "before": b, "after": a})
    if args.json:
        write_json(args.json, {"before_ref": args.before, "cases": rows})


if __name__ == "__main__":
    main()

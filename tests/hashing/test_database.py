"""ChunkedTokenDatabase: golden vectors, agreement with the references, chain properties,
what the keys depend on, and validation of a call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvredis.errors import InvalidInputError
from kvredis.features import BlockExtraFeatures, MMHash
from kvredis.hashing import HASH_ALGOS, database
from tests.hashing.references import (
    WIDTHS,
    algos,
    db,
    features,
    identifiers,
    ref_keys,
    ref_root,
    token_ids,
)

# ---------------------------------------------------------------------------------------------
# golden vectors (derived with the references; both the implementation and the
# references must keep producing them)
# ---------------------------------------------------------------------------------------------

GOLDEN: dict[str, dict[str, list[int]]] = {
    "fnv64a_cbor": {
        "root": [17515353698173365712],
        "plain": [9540012594951042066, 16921089685996993662],
        "seeded": [9813823192409008620, 682745025325898328],
        "widths": [8078559862639537929],
        "multimodal": [3617441907670486243, 3180482294496593672],
        "parent": [18137631916912190772, 10945505651717803727],
    },
    "xxh3_64": {
        "root": [8044481312616520306],
        "plain": [16085461295652143629, 1789221180696624359],
        "seeded": [9829702935778301529, 5423237596058905403],
        "widths": [5218838959922454925],
        "multimodal": [11273059169360330803, 7335300795518578555],
        "parent": [2043797638476133447, 5278559266387306128],
    },
}

GOLDEN_CASES: dict[str, dict[str, object]] = {
    "plain": {"tokens": list(range(1, 33)), "model": "test-model"},
    "seeded": {"tokens": list(range(1, 33)), "model": "test-model", "seed": "test-seed"},
    "widths": {"tokens": WIDTHS * 2 + [7], "model": "m"},
    "multimodal": {
        "tokens": list(range(40)),
        "model": "llava",
        "extra": [None, ["img-a", "img-b"]],
    },
    "parent": {"tokens": list(range(1, 10)), "model": "m", "block_size": 4, "parent": 12345},
}


def _case_keys(algo: str, case: dict[str, object], *, reference: bool) -> list[int]:
    tokens = case["tokens"]
    assert isinstance(tokens, list)
    model = str(case["model"])
    block_size = int(case.get("block_size", 16))  # type: ignore[call-overload]
    seed = str(case.get("seed", ""))
    parent = int(case.get("parent", 0))  # type: ignore[call-overload]
    extra = case.get("extra")
    if reference:
        return ref_keys(
            algo,
            tokens,
            model,
            block_size=block_size,
            seed=seed,
            parent=parent,
            extra=extra,  # type: ignore[arg-type]
        )
    return db(algo, block_size, seed).tokens_to_kv_block_keys(
        parent,
        tokens,
        model,
        features(extra) if extra is not None else None,  # type: ignore[arg-type]
    )


@algos
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_vectors(algo: str, name: str) -> None:
    case = GOLDEN_CASES[name]
    expected = GOLDEN[algo][name]
    assert _case_keys(algo, case, reference=True) == expected
    assert _case_keys(algo, case, reference=False) == expected


@algos
def test_golden_roots(algo: str) -> None:
    (expected,) = GOLDEN[algo]["root"]
    assert ref_root(algo, "test-model") == expected
    assert db(algo).root_key("test-model") == expected
    # The root is the parent of the first block.
    tokens = list(range(1, 17))
    assert db(algo).tokens_to_kv_block_keys(0, tokens, "test-model") == db(
        algo
    ).tokens_to_kv_block_keys(expected, tokens, "test-model")


# ---------------------------------------------------------------------------------------------
# agreement with the references on random inputs
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    tokens=st.lists(token_ids, max_size=70),
    block_size=st.integers(1, 20),
    seed=st.text(max_size=5),
    model=st.text(max_size=8),
    parent=st.one_of(st.just(0), st.integers(1, 2**64 - 1)),
    data=st.data(),
)
def test_matches_reference(
    algo: str,
    tokens: list[int],
    block_size: int,
    seed: str,
    model: str,
    parent: int,
    data: st.DataObject,
) -> None:
    n_blocks = len(tokens) // block_size
    extra = data.draw(
        st.one_of(
            st.none(),
            st.lists(st.one_of(st.none(), identifiers), min_size=n_blocks, max_size=n_blocks),
        )
    )
    expected = ref_keys(
        algo, tokens, model, block_size=block_size, seed=seed, parent=parent, extra=extra
    )
    got = db(algo, block_size, seed).tokens_to_kv_block_keys(
        parent, tokens, model, features(extra) if extra is not None else None
    )
    assert got == expected
    assert len(got) == n_blocks
    assert all(0 <= k < 2**64 for k in got)


# ---------------------------------------------------------------------------------------------
# prefix and chaining properties
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    tokens=st.lists(token_ids, max_size=120),
    block_size=st.integers(1, 17),
    cut=st.integers(0, 10),
)
def test_prefix_property(algo: str, tokens: list[int], block_size: int, cut: int) -> None:
    processor = db(algo, block_size)
    full = processor.tokens_to_kv_block_keys(0, tokens, "model")
    k = min(cut, len(full))
    assert processor.tokens_to_kv_block_keys(0, tokens[: k * block_size], "model") == full[:k]
    # A partial tail never changes the keys of the full blocks.
    assert (
        processor.tokens_to_kv_block_keys(0, tokens[: k * block_size + block_size - 1], "model")
        == full[:k]
    )


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    first=st.lists(token_ids, min_size=1, max_size=60),
    second=st.lists(token_ids, max_size=60),
    block_size=st.integers(1, 12),
    data=st.data(),
)
def test_chaining_property(
    algo: str, first: list[int], second: list[int], block_size: int, data: st.DataObject
) -> None:
    processor = db(algo, block_size)
    first = first[: len(first) // block_size * block_size]
    keys1 = processor.tokens_to_kv_block_keys(0, first, "m")
    n1, n2 = len(keys1), len(second) // block_size
    extra = data.draw(
        st.lists(st.one_of(st.none(), identifiers), min_size=n1 + n2, max_size=n1 + n2)
    )
    feats = features(extra)
    whole = processor.tokens_to_kv_block_keys(0, first + second, "m", feats)
    head = processor.tokens_to_kv_block_keys(0, first, "m", feats[:n1])
    if not head:
        assert processor.tokens_to_kv_block_keys(0, second, "m", feats[n1:]) == whole
        return
    tail = processor.tokens_to_kv_block_keys(head[-1], second, "m", feats[n1:])
    assert whole == head + tail


@algos
def test_chain_continues_across_calls(algo: str) -> None:
    processor = db(algo)
    tokens = list(range(1000, 1000 + 16 * 6))
    keys = processor.tokens_to_kv_block_keys(0, tokens, "m")
    parent = 0
    step_by_step = []
    for i in range(6):
        (key,) = processor.tokens_to_kv_block_keys(parent, tokens[i * 16 : (i + 1) * 16], "m")
        step_by_step.append(key)
        parent = key
    assert step_by_step == keys


# ---------------------------------------------------------------------------------------------
# what the keys depend on
# ---------------------------------------------------------------------------------------------


@algos
def test_keys_depend_on_model_seed_block_size_parent_and_content(algo: str) -> None:
    tokens = list(range(64))
    base = db(algo).tokens_to_kv_block_keys(0, tokens, "model-a")
    variants = [
        db(algo).tokens_to_kv_block_keys(0, tokens, "model-b"),
        db(algo, seed="s").tokens_to_kv_block_keys(0, tokens, "model-a"),
        db(algo, block_size=32).tokens_to_kv_block_keys(0, tokens, "model-a"),
        db(algo).tokens_to_kv_block_keys(777, tokens, "model-a"),
        db(algo).tokens_to_kv_block_keys(0, [1, *tokens[1:]], "model-a"),
    ]
    for other in variants:
        assert other[0] != base[0]
    # A change in block 2 leaves blocks 0 and 1 alone and changes every key after it.
    changed = db(algo).tokens_to_kv_block_keys(0, [*tokens[:40], 9, *tokens[41:]], "model-a")
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(changed[2:], base[2:], strict=True))


@algos
def test_model_name_is_ignored_when_continuing_a_chain(algo: str) -> None:
    tokens = list(range(32))
    assert db(algo).tokens_to_kv_block_keys(99, tokens, "a") == db(algo).tokens_to_kv_block_keys(
        99, tokens, "b"
    )


@algos
@pytest.mark.parametrize(
    ("left", "right"),
    [
        (None, ["img"]),  # multimodal taints a block
        (["ab"], ["a", "b"]),  # no concatenation ambiguity between identifiers
        (["a"], ["a", ""]),  # an empty identifier still counts
        (["a\x00"], ["a"]),  # padding cannot be confused with content
        (["a", "b"], ["b", "a"]),  # order matters
        (["img"], ["img", "img"]),
    ],
)
def test_extra_features_are_unambiguous(
    algo: str, left: list[str] | None, right: list[str] | None
) -> None:
    processor = db(algo, block_size=4)
    tokens = [1, 2, 3, 4]
    a = processor.tokens_to_kv_block_keys(42, tokens, "m", features([left]))
    b = processor.tokens_to_kv_block_keys(42, tokens, "m", features([right]))
    assert a != b


@algos
def test_empty_features_hash_like_text(algo: str) -> None:
    processor = db(algo)
    tokens = list(range(32))
    text = processor.tokens_to_kv_block_keys(0, tokens, "m")
    assert processor.tokens_to_kv_block_keys(0, tokens, "m", [None, None]) == text
    assert processor.tokens_to_kv_block_keys(0, tokens, "m", [BlockExtraFeatures([]), None]) == text


# ---------------------------------------------------------------------------------------------
# inputs and validation
# ---------------------------------------------------------------------------------------------


@algos
def test_short_inputs(algo: str) -> None:
    processor = db(algo)
    assert processor.tokens_to_kv_block_keys(0, [], "m") == []
    assert processor.tokens_to_kv_block_keys(0, list(range(15)), "m") == []
    assert processor.tokens_to_kv_block_keys(0, list(range(15)), "m", []) == []
    assert len(processor.tokens_to_kv_block_keys(0, list(range(16)), "m")) == 1


SUBPROCESS = """
import json, sys
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.features import BlockExtraFeatures, MMHash
tokens = [(i * 2654435761) % 2**32 for i in range(200)]
extra = [None] * 12
extra[3] = BlockExtraFeatures([MMHash("img-1"), MMHash("\u00e9")])
out = {}
for algo in ("xxh3_64", "fnv64a_cbor"):
    p = ChunkedTokenDatabase(TokenProcessorConfig(hash_seed="s", hash_algo=algo))
    out[algo] = [p.tokens_to_kv_block_keys(0, tokens, "model-\u00e9", extra),
                 p.root_key("model-\u00e9")]
json.dump(out, sys.stdout)
"""


def test_keys_are_identical_in_another_process() -> None:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    child = subprocess.run(
        [sys.executable, "-c", SUBPROCESS], capture_output=True, check=True, env=env, text=True
    )
    theirs = json.loads(child.stdout)
    tokens = [(i * 2654435761) % 2**32 for i in range(200)]
    extra: list[BlockExtraFeatures | None] = [None] * 12
    extra[3] = BlockExtraFeatures([MMHash("img-1"), MMHash("\u00e9")])
    for algo in HASH_ALGOS:
        p = db(algo, seed="s")
        ours = [
            p.tokens_to_kv_block_keys(0, tokens, "model-\u00e9", extra),
            p.root_key("model-\u00e9"),
        ]
        assert theirs[algo] == ours
        assert ours[0] == ref_keys(
            algo,
            tokens,
            "model-\u00e9",
            seed="s",
            extra=[None, None, None, ["img-1", "\u00e9"]] + [None] * 8,
        )


@algos
@pytest.mark.parametrize("parent", [-1, 2**64, True, "1", 1.0, None])
def test_bad_parent_key(algo: str, parent: object) -> None:
    with pytest.raises(InvalidInputError, match="parent_key"):
        db(algo).tokens_to_kv_block_keys(parent, list(range(16)), "m")  # type: ignore[arg-type]


@algos
def test_largest_parent_key_is_accepted(algo: str) -> None:
    assert len(db(algo).tokens_to_kv_block_keys(2**64 - 1, list(range(16)), "m")) == 1


@algos
@pytest.mark.parametrize("parent", [0, 5])
@pytest.mark.parametrize("model", [None, 3, b"m"])
def test_bad_model_name(algo: str, parent: int, model: object) -> None:
    with pytest.raises(InvalidInputError, match="model_name"):
        db(algo).tokens_to_kv_block_keys(parent, list(range(16)), model)  # type: ignore[arg-type]


@algos
def test_model_name_without_utf8_form(algo: str) -> None:
    with pytest.raises(InvalidInputError, match="model_name"):
        db(algo).tokens_to_kv_block_keys(0, list(range(16)), "bad\ud800")


@algos
def test_extra_features_length_must_match_full_blocks(algo: str) -> None:
    processor = db(algo)
    with pytest.raises(InvalidInputError, match=r"extra_features has 3 elements .* 2 full blocks"):
        processor.tokens_to_kv_block_keys(0, list(range(40)), "m", [None, None, None])
    with pytest.raises(InvalidInputError, match=r"has 1 elements .* 0 full blocks"):
        processor.tokens_to_kv_block_keys(0, list(range(10)), "m", [None])
    with pytest.raises(ValueError, match=r"has 1 elements .* 2 full blocks"):
        processor.tokens_to_kv_block_keys(0, list(range(32)), "m", [None])


@algos
@pytest.mark.parametrize("bad", [["img"], [MMHash("img")], [{"Hash": "img"}], [1]])
def test_extra_features_elements_must_be_features(algo: str, bad: list[object]) -> None:
    with pytest.raises(InvalidInputError, match=r"extra_features\[0\]"):
        db(algo).tokens_to_kv_block_keys(0, list(range(16)), "m", bad)  # type: ignore[arg-type]


@algos
def test_extra_features_must_be_a_sequence(algo: str) -> None:
    with pytest.raises(InvalidInputError, match="extra_features"):
        db(algo).tokens_to_kv_block_keys(0, list(range(16)), "m", "x")  # type: ignore[arg-type]


def test_root_cache_is_per_model_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(database, "_ROOT_CACHE_LIMIT", 3)
    processor = db("xxh3_64")
    roots = [processor.root_key(f"model-{i}") for i in range(10)]
    assert len(set(roots)) == 10
    assert [processor.root_key(f"model-{i}") for i in range(10)] == roots
    assert len(processor._roots) <= 3

"""The constants the Lua scripts and the Python client share are the same on both sides.

Widths, run sizes, work limits and argument bounds are written twice, once in ``lua/`` (a script
cannot import Python) and once in the package. This test reads them out of the Lua sources, each
named constant (``local NAME = <number>``, in ``lua/`` and ``lua/includes/``) and each literal
bound of an ``int_arg`` check, and compares every one with its Python twin, so that a change on
either side alone fails here. A Lua constant or bound that has no entry below also fails: give
it its Python twin, or list it as Lua-only with the reason.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvredis import checks, scoring, types
from kvredis.redis import codec, layout, migrate

LUA_DIR = Path(__file__).resolve().parents[2] / "lua"

#: Lua named constant -> its Python twin (a value computed from the package's constants).
TWINS: dict[str, Callable[[], float]] = {
    "HASH_WIDTH": lambda: codec.HASH_WIDTH,
    "ID_WIDTH": lambda: codec.ID_WIDTH,
    "REF_WIDTH": lambda: codec.REF_WIDTH,
    "RUN_ID_WIDTH": lambda: codec.RUN_ID_WIDTH,
    "ITEM_WIDTH": lambda: layout.EXPIRING_ITEM_WIDTH,
    "MIN_BUCKET_BITS": lambda: layout.MIN_BUCKET_BITS,
    "MAX_BUCKET_BITS": lambda: layout.MAX_BUCKET_BITS,
    "RUN_MAX": lambda: layout.RUN_MAX,
    "RUN_MIN": lambda: layout.RUN_MIN,
    "RUN_APPEND_MAX": lambda: layout.RUN_APPEND_MAX,
    "RUN_APPEND_SHARE": lambda: layout.RUN_APPEND_SHARE,
    "RUN_READ_COST": lambda: layout.RUN_READ_COST,
    "RUN_WORK_LIMIT": lambda: layout.RUN_WORK_LIMIT,
    "WALK_WORK_LIMIT": lambda: layout.WALK_WORK_LIMIT,
    # ids are fixed-width big-endian integers: the largest is all ones
    "MAX_ENTRY_ID": lambda: 256**codec.ID_WIDTH - 1,
    "MAX_RUN_ID": lambda: 256**codec.RUN_ID_WIDTH - 1,
    # the score's sums in one step: both sides stop below the 53-bit significand
    "EXACT": lambda: scoring._EXACT_INTS,
    "MAX_DP_RANK": lambda: types.MAX_DP_RANK,
}

#: Lua named constants with no Python twin, and why.
LUA_ONLY = {
    "CHUNK": "how many items one redis.call gets through unpack (a Lua stack limit)",
    "TWO_32": "2^32, the arithmetic of a deadline split into two u32 halves",
    "DEFINITIONS_PER_CALL": "how many definitions a lookup reply carries: the client takes "
    "what comes (EntryCache.learn)",
    "PROBE_LIMIT": "how many keys one lookup_union call passes over: the client asks again from "
    "where the reply says the walk stopped",
}

#: (what, "min" | "max") of an ``int_arg(value, what, min, max)`` check with a literal bound
#: -> its Python twin. Bounds of 0 and 1 (counts, "at least one") are not listed.
BOUND_TWINS: dict[tuple[str, str], Callable[[], float]] = {
    ("ttl ms", "max"): lambda: round(checks.MAX_TTL * 1000),
    ("pairs per call", "max"): lambda: migrate.MAX_PAIRS_PER_CALL,
    ("bucket bits", "max"): lambda: layout.MAX_BUCKET_BITS,
}

#: Literal bounds with no Python twin, and why.
INT32 = "a sanity bound (the largest 32-bit signed integer): the client sends far less"
LUA_ONLY_BOUNDS = {
    ("request keys per engine key", "max"): INT32,
    ("parts", "max"): INT32,
    ("first request key", "max"): INT32,
    ("api", "max"): INT32,
    ("part length", "min"): "the argument count of an apply_shards part (its fixed arguments "
    "and a program of at least its two counts)",
    ("batch", "max"): INT32,
    ("shard argument count", "min"): "the argument count of a score_shards shard (its keys, "
    "namespace, more-keys flag and carried count)",
}

_NAMED = re.compile(
    r"^[ \t]*local[ \t]+([A-Z][A-Z0-9_]*)[ \t]*=[ \t]*([^\n]*?)[ \t]*(?:--[^\n]*)?$", re.MULTILINE
)
_OPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Pow: operator.pow,
}


def lua_number(text: str) -> float | None:
    """The value of a Lua numeric constant expression (literals, + - * ^), else None."""
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.expr) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value  # type: ignore[no-any-return]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(ast.dump(node))

    try:
        return value(tree)
    except ValueError:
        return None


def lua_sources() -> Iterator[tuple[str, str]]:
    for path in sorted([*LUA_DIR.glob("*.lua"), *LUA_DIR.glob("includes/*.lua")]):
        yield str(path.relative_to(LUA_DIR)), path.read_text()


def named_constants() -> dict[str, dict[str, float]]:
    """NAME -> {file: value} for every ``local NAME = <number>`` of the Lua sources."""
    found: dict[str, dict[str, float]] = {}
    for name, text in lua_sources():
        for match in _NAMED.finditer(text):
            number = lua_number(match.group(2))
            if number is not None:
                found.setdefault(match.group(1), {})[name] = number
    return found


def _call_args(text: str, start: int) -> list[str]:
    """The top-level arguments of the call whose ``(`` is at ``start``."""
    args, depth, quote, current = [], 0, "", ""
    for char in text[start + 1 :]:
        if quote:
            current += char
            if char == quote:
                quote = ""
            continue
        if char in "'\"":
            quote = char
        elif char in "({[":
            depth += 1
        elif char in ")}]":
            if depth == 0:
                break
            depth -= 1
        elif char == "," and depth == 0:
            args.append(current.strip())
            current = ""
            continue
        current += char
    args.append(current.strip())
    return args


def literal_bounds() -> dict[tuple[str, str], dict[str, float]]:
    """(what, "min" | "max") -> {file: value} for every literal bound (other than 0 and 1) of
    an ``int_arg`` call of the Lua sources (the definition in includes/args.lua aside)."""
    found: dict[tuple[str, str], dict[str, float]] = {}
    for name, text in lua_sources():
        for match in re.finditer(r"\bint_arg\(", text):
            args = _call_args(text, match.end() - 1)
            if len(args) != 4 or not re.fullmatch(r"'[^']*'", args[1]):
                continue  # the function's own definition
            for side, arg in (("min", args[2]), ("max", args[3])):
                number = lua_number(arg)
                if number is not None and number not in (0, 1):
                    found.setdefault((args[1].strip("'"), side), {})[name] = number
    return found


NAMED = named_constants()
BOUNDS = literal_bounds()


def test_the_lua_sources_are_read() -> None:
    """The parsers see what the sources hold (a parser that finds nothing passes nothing)."""
    assert NAMED["RUN_MAX"] == {"includes/runs.lua": 1024}
    assert NAMED["EXACT"] == {"score.lua": 2**52}
    ttl_scripts = ("add.lua", "apply_shards.lua", "apply_parts.lua", "move_pairs.lua")
    assert BOUNDS[("ttl ms", "max")] == dict.fromkeys(ttl_scripts, 2592000000)
    assert lua_number("2 ^ 52") == 2**52 and lua_number("#ARGV - pos") is None


@pytest.mark.parametrize("name", sorted(TWINS))
def test_every_named_lua_constant_equals_its_python_twin(name: str) -> None:
    assert name in NAMED, f"{name} is no longer a constant of lua/: drop its entry here"
    twin = TWINS[name]()
    for source, value in NAMED[name].items():
        assert value == twin, f"lua/{source} {name} = {value:g}, its Python twin is {twin:g}"


@pytest.mark.parametrize("bound", sorted(BOUND_TWINS))
def test_every_literal_argument_bound_equals_its_python_twin(bound: tuple[str, str]) -> None:
    assert bound in BOUNDS, f"no int_arg of lua/ checks {bound} with a literal: drop it here"
    twin = BOUND_TWINS[bound]()
    for source, value in BOUNDS[bound].items():
        assert value == twin, f"lua/{source} {bound} is {value:g}, its Python twin is {twin:g}"


def test_every_lua_constant_has_a_twin_or_a_reason() -> None:
    """A constant or a literal bound new to ``lua/`` is listed here, with its Python twin or as
    Lua-only; no entry outlives its constant."""
    assert sorted(set(NAMED) - set(TWINS) - set(LUA_ONLY)) == []
    assert sorted(set(LUA_ONLY) - set(NAMED)) == []
    assert sorted(set(BOUNDS) - set(BOUND_TWINS) - set(LUA_ONLY_BOUNDS)) == []
    assert sorted(set(LUA_ONLY_BOUNDS) - set(BOUNDS)) == []


@pytest.mark.parametrize("bound", sorted(LUA_ONLY_BOUNDS))
def test_a_lua_only_bound_is_one_value(bound: tuple[str, str]) -> None:
    """A Lua-only bound written in several scripts is the same in each."""
    assert len(set(BOUNDS[bound].values())) == 1, BOUNDS[bound]


def test_the_client_stays_within_the_scripts_bounds() -> None:
    """What the client sends under a Lua-only bound is within it."""
    most = BOUNDS[("request keys per engine key", "max")]
    assert all(v >= checks.MAX_REQUEST_KEYS_PER_ENGINE_KEY for v in most.values())
    assert all(
        limit >= layout.RUN_MAX + layout.RUN_READ_COST
        for limit in (layout.RUN_WORK_LIMIT, layout.WALK_WORK_LIMIT)
    )  # one run fits

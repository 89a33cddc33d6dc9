"""docs/design/maintaining.md stays true: every repository path its recipes name exists, and
every recipe names the files it touches."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "design" / "maintaining.md"
#: A backticked repository path: a top-level folder of the repository, then a path.
PATH = re.compile(r"`((?:kvredis|lua|tests|scripts|docs|examples)/[^`\s<>*]*)`")


def sections() -> dict[str, str]:
    text = GUIDE.read_text()
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    return {part.splitlines()[0]: part for part in parts[1:]}


def test_every_path_the_guide_names_exists() -> None:
    named = PATH.findall(GUIDE.read_text())
    assert len(named) > 40
    missing = sorted({p for p in named if not (ROOT / p.rstrip("/")).exists()})
    assert missing == []


def test_every_recipe_names_the_files_it_touches() -> None:
    recipes = {title: body for title, body in sections().items() if title.startswith("Recipe")}
    assert {t.removeprefix("Recipe: ") for t in recipes} >= {
        "add a field to a pod entry",
        "add an engine event source or wire format",
        "change how a cluster places keys",
        "add a Lua function",
    }
    for title, body in recipes.items():
        assert len(set(PATH.findall(body))) >= 5, title


def test_the_compatibility_rules_name_each_version() -> None:
    rules = sections()["Compatibility rules"]
    for version in ("API_VERSION", "LAYOUT_VERSION", "ingest protocol", "kvredis migrate"):
        assert version in rules

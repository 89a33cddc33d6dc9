"""docs/protocol.md documents every function of the library and every error code."""

from __future__ import annotations

from pathlib import Path

from kvredis.errors import LUA_ERROR_CODES
from kvredis.redis.functions import API_VERSION, shipped_library
from kvredis.redis.layout import LAYOUT_VERSION

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def test_every_function_has_its_section_and_table_row() -> None:
    text = DOC.read_text()
    for name in shipped_library().functions():
        assert f"\n### `{name}`\n" in text, name
        assert f"`{name}`" in text.split("## Namespaces", 1)[0], name  # the library's table


def test_every_error_code_is_documented() -> None:
    errors = DOC.read_text().split("\n## Errors\n", 1)[1]
    for code in LUA_ERROR_CODES:
        assert f"| `KVREDIS_{code}` |" in errors, code


def test_the_versions_named_are_the_current_ones() -> None:
    title = DOC.read_text().splitlines()[0]
    assert f"function API {API_VERSION}" in title and f"`{LAYOUT_VERSION}`" in title

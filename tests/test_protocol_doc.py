"""docs/protocol.md documents every function of the library and every error code."""

from __future__ import annotations

import re
from pathlib import Path

from kvredis.errors import LUA_ERROR_CODES
from kvredis.redis.functions import API_VERSION, api_argument, shipped_library
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


def test_every_client_and_page_speaks_the_current_version() -> None:
    """The protocol version the docs, the Go client and the redis-cli example send and check is
    the library's (a bump of API_VERSION must reach all of them)."""
    root = DOC.parents[1]
    texts = {
        path: (root / path).read_text()
        for path in ("docs/protocol.md", "docs/operations.md", "examples/go/main.go",
                     "examples/go/README.md", "tests/examples/test_redis_cli.sh")
    }  # fmt: skip
    for path, text in texts.items():
        assert set(re.findall(r"kvredis-api:(\d+)", text)) <= {str(API_VERSION)}, path
    assert re.search(rf"apiVersion\s+= {API_VERSION}\n", texts["examples/go/main.go"])
    script = texts["tests/examples/test_redis_cli.sh"]
    assert f'[ "$api" = {API_VERSION} ]' in script and f"kvredis-api:{API_VERSION})" in script
    assert api_argument() == f"kvredis-api:{API_VERSION}"

"""The README is executable: every fenced ``python`` block runs as written against a test server.

Blocks name ``redis://127.0.0.1:6379`` (or another ``redis://`` address); the test points them at
a redis-server of its own and runs each block in a fresh namespace of globals. A block naming a
cluster (``redis+cluster://...``) runs against the session's local cluster of the same kind.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvredis import RedisClusterIndex, RedisIndex
from tests.servers import RedisServer

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_ADDRESS = re.compile(r"redis://[A-Za-z0-9.:\-]+")
_CLUSTER = re.compile(r"(?:redis|valkey)s?\+cluster://[A-Za-z0-9.:,\-]+")


def python_blocks() -> list[tuple[int, str]]:
    """``(line, code)`` of each fenced python block of the README."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize(
    ("line", "code"),
    [
        pytest.param(n, code, marks=[pytest.mark.cluster] if _CLUSTER.search(code) else [])
        for n, code in BLOCKS
    ],
    ids=[f"README.md:{n}" for n, _ in BLOCKS],
)
def test_readme_block_runs(
    line: int, code: str, own_redis_server: RedisServer, request: pytest.FixtureRequest
) -> None:
    source = _ADDRESS.sub(own_redis_server.url, code)
    if _CLUSTER.search(source):
        cluster = request.getfixturevalue("cluster_pool").get(own_redis_server.kind)
        source = _CLUSTER.sub(cluster.url, source)
    scope: dict[str, Any] = {"__name__": "readme"}
    try:
        exec(compile(source, f"README.md:{line}", "exec"), scope)
    finally:
        for value in scope.values():  # release what the snippet opened (connection pools)
            if isinstance(value, (RedisIndex, RedisClusterIndex)):
                value.close()

"""The README and docs/ are executable: every fenced ``python`` block runs as written against a
test server.

Blocks name ``redis://127.0.0.1:6379`` (or another ``redis://`` address); the test points them at
a redis-server of its own and runs each block in a fresh namespace of globals. A block naming a
cluster (``redis+cluster://...``) runs against the session's local cluster of the same kind. A
block that defines ``test_*`` functions is a user's test file: it runs under pytest (with the
``kvredis.testing`` fixtures) in a project of its own, and every test in it must pass. ZMQ
endpoints in blocks must be on loopback (the suite's network guard fails the block otherwise).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvredis import RedisClusterIndex, RedisIndex
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_ADDRESS = re.compile(r"redis://[A-Za-z0-9.:\-]+")
_CLUSTER = re.compile(r"(?:redis|valkey)s?\+cluster://[A-Za-z0-9.:,\-]+")
_TEST_FUNCTION = re.compile(r"^(?:async )?def (test_\w+)\(", re.MULTILINE)


def python_blocks() -> list[tuple[str, int, str]]:
    """``(page, line, code)`` of each fenced python block of the README and docs/."""
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = str(page.relative_to(ROOT))
        blocks += [
            (name, text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _FENCE.finditer(text)
        ]
    return blocks


BLOCKS = python_blocks()


def test_the_readme_has_python_blocks() -> None:
    assert sum(1 for page, _, _ in BLOCKS if page == "README.md") >= 3
    assert len(BLOCKS) >= 6


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_every_local_link_of_the_docs_leads_somewhere() -> None:
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    broken = []
    for page in PAGES:
        for target in link.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


@pytest.mark.parametrize(
    ("page", "line", "code"),
    [
        pytest.param(
            page, n, code, marks=[pytest.mark.cluster] if _CLUSTER.search(code) else []
        )
        for page, n, code in BLOCKS
    ],
    ids=[f"{page}:{n}" for page, n, _ in BLOCKS],
)
def test_readme_block_runs(
    page: str, line: int, code: str, own_redis_server: RedisServer, request: pytest.FixtureRequest
) -> None:
    source = _ADDRESS.sub(own_redis_server.url, code)
    if _CLUSTER.search(source):
        cluster = request.getfixturevalue("cluster_pool").get(own_redis_server.kind)
        source = _CLUSTER.sub(cluster.url, source)
    if _TEST_FUNCTION.search(source):
        _run_as_test_file(source, request, own_redis_server.url)
        return
    scope: dict[str, Any] = {"__name__": "readme"}
    try:
        exec(compile(source, f"{page}:{line}", "exec"), scope)
    finally:
        for value in scope.values():  # release what the snippet opened (connection pools)
            if isinstance(value, (RedisIndex, RedisClusterIndex)):
                value.close()


def _run_as_test_file(source: str, request: pytest.FixtureRequest, url: str) -> None:
    pytester: pytest.Pytester = request.getfixturevalue("pytester")
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("KVREDIS_TEST_REDIS_URL", url)
    pytester.makepyfile(test_block=source)
    tests = len(_TEST_FUNCTION.findall(source))
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=tests)


def test_the_benchmarks_page_lists_every_script() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    scripts = sorted(
        p.name
        for p in (ROOT / "scripts").iterdir()
        if p.suffix == ".py" and not p.name.startswith("_")
    )
    assert [name for name in scripts if f"`{name}`" not in text] == []

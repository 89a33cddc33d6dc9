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

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvredis import AsyncRedisIndex, RedisClusterIndex, RedisIndex, RedisIndexConfig
from kvredis.redis.cluster.index import AsyncRedisClusterIndex
from tests.servers import RedisServer

#: The namespace ``kvredis ingest`` (and every client without one) writes to: a live
#: deployment's. No example may drop or clear it.
LIVE_NAMESPACE = RedisIndexConfig().namespace
#: What deletes entries of a namespace.
_DESTRUCTIVE = ("drop_namespace", "clear", "clear_entries", "clear_with_progress")

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


def _namespaces(tree: ast.AST) -> list[str | None]:
    """The namespace of each index config a block makes (``None``: not a literal; a config
    without one names the default)."""
    found: list[str | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RedisIndexConfig":
            given = [k.value for k in node.keywords if k.arg == "namespace"]
            value = given[0] if given else ast.Constant(LIVE_NAMESPACE)
            found.append(value.value if isinstance(value, ast.Constant) else None)
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if "redisConfig" in keys or "address" in keys:
                values = dict(zip(keys, node.values, strict=False))
                inner = values.get("redisConfig", node)
                names = [
                    v
                    for k, v in zip(inner.keys, inner.values, strict=False)  # type: ignore[attr-defined]
                    if isinstance(k, ast.Constant) and k.value == "namespace"
                ]
                value = names[0] if names else ast.Constant(LIVE_NAMESPACE)
                found.append(value.value if isinstance(value, ast.Constant) else None)
    return found


def test_no_example_drops_or_clears_the_live_namespace() -> None:
    """An example that drops or clears works in a scratch namespace of its own, never in the
    default one a deployment's ingester writes (pasted next to it, it would wipe it)."""
    seen: dict[str, str] = {}
    for page, line, code in BLOCKS:
        tree = ast.parse(code)
        calls = {
            node.func.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        if not calls & set(_DESTRUCTIVE) or "kvredis_index" in code:
            continue
        where = f"{page}:{line}"
        namespaces = _namespaces(tree)
        assert namespaces, f"{where} drops or clears an index whose namespace it does not name"
        for namespace in namespaces:
            assert namespace is not None, f"{where}: name the scratch namespace literally"
            assert namespace != LIVE_NAMESPACE, f"{where} drops or clears {namespace!r}"
            assert seen.setdefault(namespace, where) == where, f"{where} shares {namespace!r}"


@pytest.fixture
def destroyed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The namespaces the code run under the fixture dropped or cleared."""
    names: list[str] = []
    for cls in (RedisIndex, AsyncRedisIndex, RedisClusterIndex, AsyncRedisClusterIndex):
        for method in _DESTRUCTIVE:
            original = getattr(cls, method, None)
            if original is None:
                continue

            def record(
                self: Any, *args: Any, _original: Callable[..., Any] = original, **kw: Any
            ) -> Any:
                names.append(self.namespace)
                return _original(self, *args, **kw)

            monkeypatch.setattr(cls, method, record)
    yield names


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
        pytest.param(page, n, code, marks=[pytest.mark.cluster] if _CLUSTER.search(code) else [])
        for page, n, code in BLOCKS
    ],
    ids=[f"{page}:{n}" for page, n, _ in BLOCKS],
)
def test_readme_block_runs(
    page: str,
    line: int,
    code: str,
    own_redis_server: RedisServer,
    request: pytest.FixtureRequest,
    destroyed: list[str],
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
    assert LIVE_NAMESPACE not in destroyed, f"{page}:{line} drops or clears {LIVE_NAMESPACE!r}"


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

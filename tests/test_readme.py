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


#: Every page whose links are checked: the README, docs/ and the examples' pages.
LINKED_PAGES = [*PAGES, *sorted((ROOT / "examples").rglob("*.md"))]
_CODE_FENCE = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]*)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """The page without its fenced code blocks (a ``#`` there is no heading, a ``](`` no link)."""
    return _CODE_FENCE.sub("", text)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped (``-`` and
    ``_`` kept), spaces as ``-``."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(page: Path) -> list[str]:
    """The headings of a Markdown page, in order."""
    return _HEADING.findall(prose(page.read_text(encoding="utf-8")))


def anchors(page: Path) -> set[str]:
    """The anchors a link may name in a page (see :func:`anchors_of`)."""
    return anchors_of(page.read_text(encoding="utf-8"))


def anchors_of(text: str) -> set[str]:
    """The anchors a link may name in a page's text: each heading's slug (a repeated one
    numbered ``-1``, ``-2``, ... as GitHub does) and explicit ``<a id=...>`` anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(prose(text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found | set(_HTML_ANCHOR.findall(text))


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """The local links of ``page`` (or of ``text`` as if it were that page) that lead nowhere:
    a missing file, or an anchor its target page does not have."""
    broken = []
    if text is None:
        text = page.read_text(encoding="utf-8")
    for target in _LINK.findall(prose(text)):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.relative_to(ROOT)} -> {target} (no such file)")
        elif anchor:
            known = anchors_of(text) if file == page else anchors(file)
            if file.suffix != ".md" or anchor not in known:
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such section)")
    return broken


def test_every_local_link_of_the_docs_leads_somewhere() -> None:
    """Every relative link of the README, docs/ and examples/ pages names a file that exists,
    and its ``#anchor`` a section of that page."""
    assert [b for page in LINKED_PAGES for b in broken_links(page)] == []


@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("[a](docs/api.md#redis--valkey-backend) [b](docs/api.md#reads-from-replicas)", []),
        ("[a](docs/protocol.md#kvredis_score) [b](#ingest) [c](docs/design/)", []),
        ("[a](docs/nope.md)", ["no such file"]),
        ("[a](docs/api.md#nope)", ["no such section"]),
        ("[a](#nope)\n```\n[b](nope.md)\n```", ["no such section"]),
    ],
)
def test_the_link_check_tells_good_links_from_broken_ones(text: str, broken: list[str]) -> None:
    """A page at the top of the repository with one heading, "Ingest", and ``text``."""
    found = broken_links(ROOT / "README.md", f"# Ingest\n\n{text}\n")
    assert [b.rpartition(" (")[2].rstrip(")") for b in found] == broken


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


#: Text that names sections of the pages, or files of the repository, in prose: the package,
#: scripts, tests (this file aside: its examples), Lua sources and the pages themselves.
TEXT_SOURCES = sorted(
    {
        *(ROOT / "kvredis").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(p for p in (ROOT / "tests").rglob("*.py") if "layout_v1" not in p.parts),
        *(ROOT / "lua").rglob("*.lua"),
        *LINKED_PAGES,
    }
    - {Path(__file__).resolve()}
)
_DOC = r"(?P<doc>README(?:\.md)?|docs/[\w/.-]+\.md)"
_TITLE = r"[\"*]{1,2}(?P<title>[A-Z][^\"*]{0,60}?)[\"*]{1,2}"
_SECTION_AFTER = re.compile(_DOC + r"`{0,2}(?:'s)?,?\s*\(?(?:section\s+)?" + _TITLE)
_SECTION_BEFORE = re.compile(_TITLE + r"\s+(?:in|of|under)\s+(?:the\s+)?`{0,2}" + _DOC)
_REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:lua|docs|scripts|kvredis|tests|examples)/[\w./-]*\.(?:py|lua|md|go|sh))\b"
)


def section_references(text: str) -> list[tuple[str, str]]:
    """(page, section title) of each place ``text`` names a section of a page by its title:
    ``docs/x.md, "Title"``, ``docs/x.md ("Title")``, ``"Title" in the README``, ..."""
    matches = [*_SECTION_AFTER.finditer(text), *_SECTION_BEFORE.finditer(text)]
    return [(m["doc"], " ".join(m["title"].split())) for m in matches]


def has_section(doc: str, title: str) -> bool:
    """Whether page ``doc`` has a heading, or a bold lead-in (``**Title**``), named ``title``."""
    page = ROOT / ("README.md" if doc.startswith("README") else doc)
    if not page.exists():
        return False
    wanted = re.sub(r"[`*]", "", title).strip().lower()
    names = {re.sub(r"[`*]", "", h).strip().lower() for h in headings(page)}
    bold = re.findall(r"\*\*([^*\n]+)\*\*", page.read_text(encoding="utf-8"))
    return wanted in names | {b.strip().lower() for b in bold}


def test_every_section_named_in_prose_exists() -> None:
    """A docstring, comment or page that names a section of the README or of docs/ by its
    title names one that exists (sections move when pages split)."""
    broken = [
        f"{path.relative_to(ROOT)}: {doc}, {title!r}"
        for path in TEXT_SOURCES
        for doc, title in section_references(path.read_text(encoding="utf-8"))
        if not has_section(doc, title)
    ]
    assert broken == []


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ('see the README, "Key layout"', [("README", "Key layout")]),
        ('``docs/ingest-protocol.md`` ("Memory")', [("docs/ingest-protocol.md", "Memory")]),
        ("see *Branches inside a block* in the README", [("README", "Branches inside a block")]),
        ('ROOT / "README.md", *sorted(', []),
        ('the README, "Redis\nCluster")', [("README", "Redis Cluster")]),
    ],
)
def test_section_references_are_found(text: str, found: list[tuple[str, str]]) -> None:
    assert section_references(text) == found
    assert all(not has_section(doc, title) for doc, title in found if doc == "README")


def test_every_repository_file_named_in_prose_exists() -> None:
    """A docstring, comment or page that names a file of the repository by its path
    (``lua/includes/runs.lua``, ``docs/design/expiry.md``, ``scripts/bench_redis.py``) names one
    that exists."""
    placeholders = {"scripts/bench_X.py"}
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in TEXT_SOURCES
        for name in _REPO_PATH.findall(path.read_text(encoding="utf-8"))
        if name not in placeholders and not (ROOT / name).exists()
    ]
    assert missing == []

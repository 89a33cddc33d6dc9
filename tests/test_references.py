"""Every cross-reference of the code names something that exists.

Docstrings and ``#:`` comments name objects with Sphinx roles (``:func:``, ``:class:``,
``:mod:``, ``:meth:``, ``:data:``, ``:attr:``, ``:exc:``, each followed by a name in
backquotes): in the package, in ``scripts/`` and in the tests' helpers. A rename or a split that
leaves one pointing at nothing fails here, with the file and line. A name resolves as Sphinx
would look it up: in the enclosing classes, then the module (its imports included, also those
made for type checking only), then as a dotted path from the top (``kvredis.x.y``, the standard
library, installed packages) or a builtin; ``.name`` relative to the module's packages.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(
    [
        *(ROOT / "kvredis").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(p for p in (ROOT / "tests").rglob("*.py") if "layout_v1" not in p.parts),
    ]
)
ROLE = re.compile(r":(func|class|mod|meth|data|attr|exc):`([^`]+)`")
_MISSING = object()


@dataclass
class SourceFile:
    """What one file defines at its top level and in its classes, read from its syntax tree."""

    path: Path
    module: str | None  # its import name, None for a script (not imported here)
    names: dict[str, ast.AST] = field(default_factory=dict)  # top level: defs, assignments
    imports: dict[str, str] = field(default_factory=dict)  # local name -> what it names
    classes: dict[str, set[str]] = field(default_factory=dict)  # "A.B" -> its members
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # class lines -> "A.B"


def module_name(path: Path) -> str | None:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] not in ("kvredis", "tests"):
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _members(node: ast.ClassDef) -> set[str]:
    """The names a class body defines, and the ``self.name`` its methods assign."""
    found: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            found.add(item.target.id)
        elif isinstance(item, ast.Assign):
            found.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for item in ast.walk(node):
        targets = (
            item.targets
            if isinstance(item, ast.Assign)
            else [item.target]
            if isinstance(item, ast.AnnAssign)
            else []
        )
        found.update(
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        )
    return found


@cache
def parse(path: Path) -> SourceFile:
    module = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    source = SourceFile(path, module)
    package = module if path.name == "__init__.py" else (module or "").rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                source.imports[alias.asname or alias.name.partition(".")[0]] = (
                    alias.name if alias.asname else alias.name.partition(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                source.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            source.names[node.name] = node
        elif isinstance(node, ast.Assign):
            source.names.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            source.names[node.target.id] = node

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                source.classes[name] = _members(node)
                source.spans.append((node.lineno, node.end_lineno or node.lineno, name))
                visit(node.body, name + ".")

    visit(tree.body, "")
    return source


def _import(name: str) -> Any:
    if name.split(".")[0] == "scripts":
        return _MISSING  # scripts are not imported: read from their syntax tree instead
    try:
        return importlib.import_module(name)
    except ImportError:
        return _MISSING


def has_member(owner: Any, name: str) -> bool:
    """Whether a class (or module) has ``name``: an attribute, or an instance attribute its
    classes declare (annotations, ``__slots__``, dataclass fields, ``self.name = ...``)."""
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    for klass in owner.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        if dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}:
            return True
        try:
            if re.search(rf"\bself\.{re.escape(name)}\s*[:=]", inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            pass
    return False


def qualified(name: str) -> bool:
    """Whether the dotted path ``name`` names an importable module or an object in one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        obj = _import(".".join(parts[:cut]))
        if obj is _MISSING:
            continue
        for part in parts[cut:]:
            if not has_member(obj, part):
                return False
            obj = getattr(obj, part, None)
        return True
    return False


def in_file(source: SourceFile, dotted: str) -> bool:
    """Whether ``dotted`` resolves at the top level of ``source``."""
    head, _, rest = dotted.partition(".")
    if head in source.imports:
        target = source.imports[head] + ("." + rest if rest else "")
        if qualified(target):
            return True
        sibling = source.path.parent / (source.imports[head].split(".")[0] + ".py")
        first = source.imports[head].split(".")
        if source.module is None and sibling.exists():  # a script's helper: scripts/_bench.py
            return in_file(parse(sibling), ".".join([*first[1:], *([rest] if rest else [])]))
        return False
    if head not in source.names:
        return False
    if not rest:
        return True
    if source.module is not None and qualified(f"{source.module}.{dotted}"):
        return True
    owner, _, member = dotted.rpartition(".")
    return member in source.classes.get(owner, set())


def resolves(source: SourceFile, line: int, target: str) -> bool:
    name = target.lstrip("~").removesuffix("()")
    if name.startswith("."):
        module = source.module or ""
        packages = [module.rsplit(".", n)[0] for n in range(module.count(".") + 1)]
        return any(qualified(package + name) for package in packages if package)
    enclosing = [n for start, end, n in source.spans if start <= line <= end]
    for klass in sorted(enclosing, key=len, reverse=True):
        head = name.partition(".")[0]
        if head in source.classes[klass] and in_file(source, f"{klass}.{name}"):
            return True
        if head in source.classes[klass] and "." not in name:
            return True
    if in_file(source, name) or qualified(name):
        return True
    return "." not in name and hasattr(builtins, name)


def references() -> list[tuple[Path, int, str, str]]:
    found = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        for match in ROLE.finditer(text):
            found.append((path, text.count("\n", 0, match.start()) + 1, *match.groups()))
    return found


REFERENCES = references()


def test_the_sources_hold_references() -> None:
    assert len(REFERENCES) > 200
    assert {role for _, _, role, _ in REFERENCES} >= {"func", "class", "mod", "meth", "data"}


def test_every_role_reference_names_an_object() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        broken = [
            f"{path.relative_to(ROOT)}:{line}: :{role}:`{target}`"
            for path, line, role, target in REFERENCES
            if not resolves(parse(path), line, target)
        ]
    finally:
        sys.path.remove(str(ROOT))
    assert broken == []


@pytest.mark.parametrize(
    ("target", "ok"),
    [
        ("kvredis.redis.index.RedisIndex.lookup", True),
        ("~kvredis.redis.layout.Layout", True),
        ("kvredis.redis.layout.Layout.rprefix", True),  # a slot
        ("kvredis.redis.index.NoSuchThing", False),
        ("kvredis.nosuchmodule", False),
        ("RedisIndexConfig.namespace", True),  # a dataclass field, imported name
        ("RedisIndexConfig.nosuchfield", False),
        ("ValueError", True),
        ("asyncio.Task", True),
        (".cluster.ops", True),
        (".cluster.nosuch", False),
    ],
)
def test_the_resolver_tells_real_names_from_gone_ones(target: str, ok: bool) -> None:
    source = parse(ROOT / "kvredis" / "redis" / "inspect.py")
    assert resolves(source, 1, target) is ok


def _top_imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that ``path`` imports when it is loaded (its top-level
    imports, type-checking-only ones aside; imports inside functions are lazy)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(
                n.split(".")[len(package.split("."))] for n in names if n.startswith(package + ".")
            )
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[len(package.split("."))]
                for a in node.names
                if a.name.startswith(package + ".")
            )
    return found


_TABLE = re.compile(r"^(=+)[ ]+=+\n(.*?)\n^=+[ ]+=+$", re.MULTILINE | re.DOTALL)


def module_tables() -> list[tuple[Path, list[str]]]:
    """(package ``__init__.py``, its modules in the order its docstring's table lists them) for
    every package whose docstring holds a table of its modules."""
    tables = []
    for init in sorted((ROOT / "kvredis").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        for match in _TABLE.finditer(doc):
            width = len(match.group(1))
            rows = [line[:width].strip() for line in match.group(2).splitlines()]
            names = [r for r in rows if r]
            if names and all(re.fullmatch(r"[a-z_][a-z0-9_]*", n) for n in names):
                tables.append((init, names))
    return tables


def test_the_module_tables_of_the_packages_are_true() -> None:
    """A package docstring's table of its modules lists every module, none that is gone, each
    after the modules it imports."""
    tables = module_tables()
    assert [init.parent.name for init, _ in tables] == ["ingest", "memory"]
    for init, listed in tables:
        folder = init.parent
        package = module_name(init) or ""
        actual = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        actual |= {p.parent.name for p in folder.glob("*/__init__.py")}
        assert sorted(listed) == sorted(actual), init
        for at, name in enumerate(listed):
            path = folder / f"{name}.py"
            later = _top_imports(path, package) & set(listed[at + 1 :])
            assert later == set(), f"{package}.{name} imports {sorted(later)}, listed after it"

"""Import hygiene: the sans-IO modules and the package itself load no redis-py (nor pyzmq), and
the backend's modules import only the modules their package's docstring lists before them (its
config no cluster package and no operation, its single-server index no cluster package)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

SANS_IO = [
    "kvredis.redis",
    "kvredis.redis.address",
    "kvredis.redis.requests",
    "kvredis.redis.codec",
    "kvredis.redis.layout",
    "kvredis.redis.state",
    "kvredis.redis.scripts",
    "kvredis.redis.functions",
    "kvredis.redis.session",
    "kvredis.redis.program",
    "kvredis.redis.ops",
    "kvredis.redis.config",
    "kvredis.redis.replicas",
    "kvredis.redis.cluster",
    "kvredis.redis.cluster.slots",
    "kvredis.redis.cluster.redirect",
    "kvredis.redis.cluster.topology",
    "kvredis.redis.cluster.routing",
    "kvredis.redis.cluster.shards",
    "kvredis.redis.cluster.core",
    "kvredis.redis.cluster.placement",
    "kvredis.redis.cluster.calls",
    "kvredis.redis.cluster.writes",
    "kvredis.redis.cluster.ops",
    "kvredis.redis.cluster.migrate",
]


def _loaded_after(statement: str) -> set[str]:
    """Which of redis-py and pyzmq a fresh interpreter has loaded after ``statement``."""
    report = "print(' '.join(m for m in ('redis', 'zmq') if m in sys.modules))"
    probe = f"{statement}\nimport sys\n{report}"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_modules_do_not_load_redis_py(module: str) -> None:
    assert _loaded_after(f"import {module}") == set()


def test_the_packages_load_redis_py_only_when_a_client_is_used() -> None:
    assert _loaded_after("import kvredis, kvredis.redis; kvredis.RedisIndexConfig()") == set()
    assert _loaded_after("import kvredis; kvredis.parse_address('h:1')") == set()
    assert _loaded_after("import kvredis.redis; kvredis.redis.RedisIndex") == {"redis"}


def _modules_after(statement: str, prefix: str) -> set[str]:
    """The modules named ``prefix...`` a fresh interpreter has loaded after ``statement``."""
    report = f"print(' '.join(m for m in sys.modules if m.startswith({prefix!r})))"
    probe = f"{statement}\nimport sys\n{report}"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_config_loads_no_cluster_package_and_no_operation() -> None:
    loaded = _modules_after("import kvredis.redis.config", "kvredis.redis.")
    assert {m for m in loaded if m.startswith("kvredis.redis.cluster")} == set()
    assert "kvredis.redis.ops" not in loaded and "kvredis.redis.session" not in loaded


def test_the_single_server_index_loads_no_cluster_package() -> None:
    loaded = _modules_after("import kvredis.redis.index", "kvredis.redis.cluster")
    assert loaded == set()


def test_the_factories_pick_the_index_and_keep_their_old_place() -> None:
    """``new_redis_index`` and the others live in :mod:`kvredis.redis.factories`; the names
    ``kvredis``, ``kvredis.redis`` and (for importers of the old place) ``kvredis.redis.index``
    export are the same functions."""
    import kvredis
    import kvredis.redis
    from kvredis.redis import factories, index

    for name in ("new_redis_index", "new_valkey_index", "new_async_redis_index", "drop_namespace"):
        assert getattr(kvredis, name) is getattr(factories, name) is getattr(index, name)
        if name != "drop_namespace":
            assert getattr(kvredis.redis, name) is getattr(factories, name)
    with pytest.raises(AttributeError):
        index.no_such_name  # noqa: B018


ROOT = Path(__file__).resolve().parents[2]
#: A package docstring's list of its modules in dependency order: lines ``- ``name``[, ...]``.
_LISTED = re.compile(r"^- ((?:``[\w/]+``(?:, )?)+)", re.MULTILINE)
LAYERED = ["kvredis.redis", "kvredis.redis.cluster"]


def listed_modules(package: str) -> list[list[str]]:
    """The groups of modules ``package``'s docstring lists, in order (a subpackage as
    ``name/``)."""
    doc = importlib.import_module(package).__doc__ or ""
    return [re.findall(r"``([\w/]+)``", m.group(1)) for m in _LISTED.finditer(doc)]


def top_imports(path: Path) -> set[str]:
    """Every ``kvredis`` module ``path`` imports when loaded (top-level imports; those for type
    checking only, and those inside functions, aside)."""
    found: set[str] = set()
    stack: list[ast.stmt] = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("kvredis.")}


@pytest.mark.parametrize("package", LAYERED)
def test_each_module_imports_only_those_listed_before_it(package: str) -> None:
    groups = listed_modules(package)
    folder = ROOT / package.replace(".", "/")
    units = [name.rstrip("/") for group in groups for name in group]
    on_disk = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    on_disk |= {p.parent.name for p in folder.glob("*/__init__.py")}
    assert sorted(units) == sorted(on_disk), "the docstring lists every module, none gone"
    order = {name: at for at, name in enumerate(units)}
    late = []
    for name in units:
        files = [folder / f"{name}.py"] if (folder / f"{name}.py").exists() else []
        files += sorted((folder / name).rglob("*.py")) if (folder / name).is_dir() else []
        for path in files:
            for imported in top_imports(path):
                parts = imported.removeprefix(package + ".").split(".")
                if not imported.startswith(package + ".") or parts[0] == name:
                    continue
                if parts[0] in order and order[parts[0]] > order[name]:
                    late.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert late == []

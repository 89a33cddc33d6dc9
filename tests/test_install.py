"""The way in: README's "Install" block, run as written in a copy of the repository (a clone as
a user has it): it builds a wheel, installs it into a fresh virtual environment, and the
installed ``kvredis`` runs from there, Lua scripts and all. And no page tells a user to install
``kvredis`` from a package index, where it is not published.

Building and installing takes a while (the wheel's build requirements and the dependencies come
from pip's cache or the package index, as for ``scripts/setup``), so the test is marked ``slow``;
CI runs it with the rest of the suite.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: What a clone holds that a build does not need (or that would not be in a fresh clone).
_NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", ".venv*", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache",
    ".ruff_cache", ".pytest_cache", ".hypothesis",
)  # fmt: skip


def _install_block() -> list[str]:
    m = re.search(r"<!-- install -->\n```sh\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
    assert m, "README.md has no block marked <!-- install -->"
    return [line.split("  #")[0].strip() for line in m.group(1).splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_install_builds_a_wheel_that_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    clone = tmp_path / "kvredis"
    shutil.copytree(ROOT, clone, ignore=_NOT_IN_A_CLONE)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p
    )
    outputs = []
    for line in _install_block():
        command = re.sub(r"^python3 ", f"{sys.executable} ", line)  # this test's Python
        done = subprocess.run(
            ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
            timeout=500,
        )  # fmt: skip
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
        outputs.append(done.stdout)
    assert outputs[-1].startswith("Usage: kvredis"), outputs[-1]
    (wheel,) = (clone / "dist").glob("kvredis-*-py3-none-any.whl")
    venv = home / "kvredis-env"
    python = venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import kvredis, sys; print(kvredis.__file__); print(sys.prefix)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    module, prefix = where.stdout.split()
    assert Path(prefix) == venv and Path(module).is_relative_to(venv), where.stdout
    kvredis = str(venv / "bin" / "kvredis")
    code = subprocess.run(
        [kvredis, "functions", "show", "--code"], env=env, capture_output=True, text=True
    )
    assert code.returncode == 0 and code.stdout.startswith("#!lua name=kvredis"), code.stderr
    keys = subprocess.run(
        [kvredis, "keys", "--model", "m", "--tokens", "1,2,3,4", "--block-size", "2"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert keys.returncode == 0 and len(keys.stdout.splitlines()) == 2, keys.stderr
    assert wheel.stat().st_size > 50_000


#: ``pip install kvredis`` / ``pip install 'kvredis[otel]'``: a name a package index would serve.
_FROM_AN_INDEX = re.compile(r"pip install (?:-\S+ )*['\"]?kvredis(?:\[[a-z,]+\])?['\"]?(?:\s|$|`)")


def test_no_page_installs_kvredis_from_a_package_index() -> None:
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "kvredis").rglob("*.py")]
    found = [
        f"{page.relative_to(ROOT)}: {m.group(0).strip()}"
        for page in pages
        for m in _FROM_AN_INDEX.finditer(page.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_the_wheel_lists_every_package_of_the_source_tree() -> None:
    """``[tool.setuptools] packages`` is a list written by hand: a package folder it misses is
    left out of the wheel (and found only in a checkout), so each one must be on it."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = r"^\[tool\.setuptools\]\npackages = \[(.*?)\]"
    m = re.search(block, pyproject, re.MULTILINE | re.DOTALL)
    assert m, "pyproject.toml has no [tool.setuptools] packages list"
    listed = set(re.findall(r'"([\w.]+)"', m.group(1)))
    assert "kvredis" in listed
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "kvredis").rglob("__init__.py")
    }
    assert on_disk - listed == set()

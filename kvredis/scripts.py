"""The Lua script registry: loads ``lua/*.lua`` once, calls scripts by EVALSHA, survives flushes.

Sources come from the installed package data (``kvredis/lua/`` inside a wheel) when present,
else from the repository's ``lua/`` directory next to the package (editable installs). Files whose
name starts with ``_`` are libraries: a command script pulls one in with a line
``--@include <name>``, which the registry replaces by the library's text before hashing. The SHA1
of every expanded script is computed locally, so the first call is already an EVALSHA.

When the server answers ``NOSCRIPT`` (after ``SCRIPT FLUSH``, a restart or a failover) the
registry loads the script and repeats the call, transparently, also for calls inside a pipeline:
only the pipeline's calls that failed with ``NOSCRIPT`` (and so did not run) are sent again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.exceptions import NoScriptError

import kvredis
from kvredis.errors import BackendError

#: A value redis-py can send as a command argument.
Arg = bytes | str | int | float

_INCLUDE_RE = re.compile(r"^--@include\s+(\S+)\s*$", re.MULTILINE)

#: How many times one call is re-sent after NOSCRIPT (a flush racing the reload).
_NOSCRIPT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Script:
    """One command script: its name (file stem), expanded source and SHA1 (hex)."""

    name: str
    source: bytes
    sha: str


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """An EVALSHA of a named script, as a value (see :class:`ScriptRegistry`)."""

    script: str
    keys: Sequence[Arg]
    args: Sequence[Arg]


#: One pipeline item: a script call, or a plain command given as its arguments.
PipelineItem = ScriptCall | tuple[Arg, ...]


def lua_sources() -> dict[str, str]:
    """The text of every ``*.lua`` file shipped with kvredis, by file stem."""
    files: dict[str, str] = {}
    try:
        package = importlib.resources.files("kvredis.lua")
        for entry in package.iterdir():
            if entry.name.endswith(".lua") and entry.is_file():
                files[entry.name[:-4]] = entry.read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        files = {}
    if files:
        return files
    directory = Path(kvredis.__file__).resolve().parent.parent / "lua"
    if not directory.is_dir():
        raise BackendError(
            f"kvredis Lua scripts not found (neither package data kvredis/lua nor {directory})"
        )
    return {path.stem: path.read_text(encoding="utf-8") for path in directory.glob("*.lua")}


def expand(name: str, sources: Mapping[str, str], _seen: tuple[str, ...] = ()) -> str:
    """The source of script ``name`` with its ``--@include`` lines replaced by the libraries."""
    if name in _seen:
        raise BackendError(f"Lua include cycle: {' -> '.join((*_seen, name))}")
    if name not in sources:
        raise BackendError(f"Lua script {name!r} not found")

    def include(match: re.Match[str]) -> str:
        return expand(match.group(1), sources, (*_seen, name)).rstrip("\n")

    return _INCLUDE_RE.sub(include, sources[name])


@functools.lru_cache(maxsize=1)
def _shipped_scripts() -> dict[str, Script]:
    sources = lua_sources()
    out = {}
    for name in sorted(sources):
        if name.startswith("_"):
            continue
        source = expand(name, sources).encode("utf-8")
        out[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    return out


def _scripts_of(items: Sequence[PipelineItem], positions: Sequence[int]) -> list[str]:
    names = {item.script for item in (items[i] for i in positions) if isinstance(item, ScriptCall)}
    return sorted(names)


class ScriptRegistry:
    """The command scripts of one client, called by EVALSHA with reload on NOSCRIPT.

    Works with a sync ``redis.Redis`` (:meth:`call`, :meth:`execute`) and an asyncio
    ``redis.asyncio.Redis`` (:meth:`acall`, :meth:`aexecute`); keeps no connection state, so one
    registry may serve both.
    """

    def __init__(self, scripts: Mapping[str, Script] | None = None) -> None:
        self._scripts: dict[str, Script] = dict(_shipped_scripts() if scripts is None else scripts)

    def __getitem__(self, name: str) -> Script:
        try:
            return self._scripts[name]
        except KeyError:
            raise BackendError(f"no Lua script named {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._scripts

    def names(self) -> list[str]:
        """Names of the registered scripts."""
        return sorted(self._scripts)

    @staticmethod
    def _check_loaded(script: Script, sha: Any) -> None:
        got = sha.decode() if isinstance(sha, bytes) else str(sha)
        if got != script.sha:
            raise BackendError(
                f"server hashed script {script.name} to {got}, expected {script.sha}"
            )

    # -- sync ----------------------------------------------------------------------------------

    def load(self, client: Any, name: str) -> None:
        """SCRIPT LOAD one script (normally not needed: calls load on demand)."""
        script = self[name]
        self._check_loaded(script, client.script_load(script.source))

    def call(self, client: Any, call: ScriptCall) -> Any:
        """EVALSHA ``call`` on a sync client, loading the script on NOSCRIPT."""
        script = self[call.script]
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            try:
                return client.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
            except NoScriptError:
                if attempt == _NOSCRIPT_ATTEMPTS - 1:
                    raise
                self.load(client, call.script)
        raise AssertionError("unreachable")  # pragma: no cover

    def _queue(self, pipe: Any, items: Sequence[PipelineItem]) -> None:
        for item in items:
            if isinstance(item, ScriptCall):
                pipe.evalsha(self[item.script].sha, len(item.keys), *item.keys, *item.args)
            else:
                pipe.execute_command(*item)

    def execute(self, client: Any, items: Sequence[PipelineItem]) -> list[Any]:
        """Send ``items`` in one pipeline (no MULTI); returns replies, errors as exception values.

        Script calls answered with NOSCRIPT did not run; their scripts are loaded and those calls
        alone are sent again, in their original relative order.
        """
        pipe = client.pipeline(transaction=False)
        self._queue(pipe, items)
        results: list[Any] = list(pipe.execute(raise_on_error=False))
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if not missing or attempt == _NOSCRIPT_ATTEMPTS - 1:
                break
            for name in _scripts_of(items, missing):
                self.load(client, name)
            pipe = client.pipeline(transaction=False)
            self._queue(pipe, [items[i] for i in missing])
            for i, reply in zip(missing, pipe.execute(raise_on_error=False), strict=True):
                results[i] = reply
        return results

    # -- asyncio -------------------------------------------------------------------------------

    async def aload(self, client: Any, name: str) -> None:
        """SCRIPT LOAD one script on an asyncio client."""
        script = self[name]
        self._check_loaded(script, await client.script_load(script.source))

    async def acall(self, client: Any, call: ScriptCall) -> Any:
        """EVALSHA ``call`` on an asyncio client, loading the script on NOSCRIPT."""
        script = self[call.script]
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            try:
                return await client.evalsha(script.sha, len(call.keys), *call.keys, *call.args)
            except NoScriptError:
                if attempt == _NOSCRIPT_ATTEMPTS - 1:
                    raise
                await self.aload(client, call.script)
        raise AssertionError("unreachable")  # pragma: no cover

    async def aexecute(self, client: Any, items: Sequence[PipelineItem]) -> list[Any]:
        """The asyncio form of :meth:`execute`."""
        pipe = client.pipeline(transaction=False)
        self._queue(pipe, items)
        results: list[Any] = list(await pipe.execute(raise_on_error=False))
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if not missing or attempt == _NOSCRIPT_ATTEMPTS - 1:
                break
            for name in _scripts_of(items, missing):
                await self.aload(client, name)
            pipe = client.pipeline(transaction=False)
            self._queue(pipe, [items[i] for i in missing])
            replies = await pipe.execute(raise_on_error=False)
            for i, reply in zip(missing, replies, strict=True):
                results[i] = reply
        return results

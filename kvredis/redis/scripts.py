"""The Lua script registry: the command scripts of ``lua/``, their includes expanded, and SHA1s.

Sources come from the installed package data (``kvredis/lua/`` inside a wheel) when present,
else from the repository's ``lua/`` directory (editable installs). Every ``lua/<name>.lua`` is a
command; ``lua/includes/<name>.lua`` are libraries, pulled into a command (or into another
include) by a line ``--@include <name>``. Expansion pastes each include once per script, before
the first include line naming it (later lines naming it again are dropped), so includes may
include each other; a cycle is an error. A line ``--@command <name>`` pastes another command
script whole as a local function ``command_<name>(KEYS, ARGV)`` (its includes first, each
once), so a script can run a command unchanged on keys and arguments it builds (the cluster's
``score_shards`` runs ``score`` per shard). The SHA1 of every expanded script is computed
locally, so the first call is already an EVALSHA.

The registry only builds commands, each method named after what it returns:
:meth:`~ScriptRegistry.call_command` for a :class:`~kvredis.redis.requests.ScriptCall` (here its
``EVALSHA``, :meth:`~ScriptRegistry.evalsha_command`) and :meth:`~ScriptRegistry.load_command`
for the reload after ``NOSCRIPT`` (here ``SCRIPT LOAD``,
:meth:`~ScriptRegistry.script_load_command`); its subclass
:class:`kvredis.redis.functions.FunctionRegistry` sends the same calls as ``FCALL``/``FCALL_RO``
of the ``kvredis`` function library. Sending them, and reloading what the server lacks
(:func:`missing_callee`), is the job of :func:`kvredis.redis.session.op_send`. No I/O library is
imported here.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.resources
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

from kvredis.errors import BackendError
from kvredis.redis.requests import Command, ErrorReply, Op, ScriptCall
from kvredis.redis.state import CoreState

_INCLUDE_RE = re.compile(r"^--@(include|command)\s+(\S+)\s*$", re.MULTILINE)
_SHEBANG_RE = re.compile(r"\A#!lua[^\n]*\n")
#: Folder (under ``lua/``) of the include files, and the prefix of their names in a source map.
INCLUDES = "includes"
_REPO_LUA = Path(__file__).resolve().parents[2] / "lua"
#: Text a server answers a call of a function it does not have with (``ERR Function not found``).
NOT_FOUND = "function not found"
#: The error code of a function's refusal of a call of another protocol version
#: (``lua/includes/api.lua``).
VERSION_CODE = "KVREDIS_VERSION"


class Missing(enum.Enum):
    """What a server lacked, by the error reply to a call of it."""

    #: ``NOSCRIPT``: the script an ``EVALSHA`` named (a flush, a restart, a failover)
    SCRIPT = "script"
    #: ``ERR Function not found``: the function an ``FCALL`` named (no library loaded)
    FUNCTION = "function"
    #: ``KVREDIS_VERSION``: the function of the protocol version the ``FCALL`` carried (the
    #: server's library was loaded by a kvredis of another version)
    VERSION = "version"


def missing_callee(reply: object) -> Missing | None:
    """What the server lacks when ``reply`` is the error reply of a call of a script or function
    it does not have; ``None`` for any other reply (not an error reply, or another error). The
    one reading of such replies: the single-server session and the cluster's waves decide with
    it whether loading and calling again helps (see :meth:`ScriptRegistry.missing`)."""
    if not isinstance(reply, ErrorReply):
        return None
    if reply.code == "NOSCRIPT":
        return Missing.SCRIPT
    if reply.code == VERSION_CODE:
        return Missing.VERSION
    if NOT_FOUND in reply.message.lower():
        return Missing.FUNCTION
    return None


@dataclass(frozen=True, slots=True)
class Script:
    """One command script: its name (file stem), expanded source and SHA1 (hex)."""

    name: str
    source: bytes
    sha: str

    @property
    def no_writes(self) -> bool:
        """Whether the script declares ``flags=no-writes`` (a read-only replica runs it)."""
        first = self.source.split(b"\n", 1)[0]
        if not first.startswith(b"#!lua"):
            return False
        flags = first.partition(b"flags=")[2].split()
        return bool(flags) and b"no-writes" in flags[0].split(b",")


def _read_lua(folder: Traversable | Path, prefix: str = "") -> dict[str, str]:
    files: dict[str, str] = {}
    for entry in folder.iterdir():
        if entry.is_file() and entry.name.endswith(".lua"):
            files[prefix + entry.name[:-4]] = entry.read_text(encoding="utf-8")
        elif entry.name == INCLUDES and not prefix and entry.is_dir():
            files.update(_read_lua(entry, f"{INCLUDES}/"))
    return files


def lua_sources() -> dict[str, str]:
    """The text of every Lua file shipped with kvredis: commands by file stem, includes as
    ``includes/<stem>``."""
    try:
        files = _read_lua(importlib.resources.files("kvredis.lua"))
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        files = {}
    if files:
        return files
    if not _REPO_LUA.is_dir():
        raise BackendError(
            f"kvredis Lua scripts not found (neither package data kvredis/lua nor {_REPO_LUA})"
        )
    return _read_lua(_REPO_LUA)


def expand(name: str, sources: Mapping[str, str]) -> str:
    """The source of command ``name`` with its ``--@include`` lines replaced by the includes.

    Each include is pasted once, where it is first named; a cycle raises BackendError.
    """
    if name not in sources:
        raise BackendError(f"Lua script {name!r} not found")
    done: set[str] = set()

    def paste(key: str, text: str, stack: tuple[str, ...]) -> str:
        def include(match: re.Match[str]) -> str:
            if match.group(1) == "command":
                return command(match.group(2), key, stack)
            child = f"{INCLUDES}/{match.group(2)}"
            if child in stack:
                chain = " -> ".join(k.removeprefix(f"{INCLUDES}/") for k in (*stack, child))
                raise BackendError(f"Lua include cycle: {chain}")
            if child in done:
                return ""
            if child not in sources:
                raise BackendError(f"Lua include {match.group(2)!r} (of {key}) not found")
            pasted = paste(child, sources[child], (*stack, child)).rstrip("\n")
            done.add(child)
            return pasted

        return _INCLUDE_RE.sub(include, text)

    def command(other: str, key: str, stack: tuple[str, ...]) -> str:
        if len(stack) > 1 or other not in sources or other.startswith(f"{INCLUDES}/"):
            raise BackendError(f"--@command {other} (in {key}): only a command pastes a command")
        source = _SHEBANG_RE.sub("", sources[other])
        lines = [m.group(0) for m in _INCLUDE_RE.finditer(source)]
        if any(line.startswith("--@command") for line in lines):
            raise BackendError(f"--@command {other} (in {key}): {other} pastes a command itself")
        body = _INCLUDE_RE.sub("", source).strip("\n")
        prelude = paste(other, "\n".join(lines), stack).strip("\n")
        return f"{prelude}\nlocal function command_{other}(KEYS, ARGV)\n{body}\nend"

    return paste(name, sources[name], (name,))


@functools.lru_cache(maxsize=1)
def _shipped_scripts() -> dict[str, Script]:
    sources = lua_sources()
    out = {}
    for name in sorted(sources):
        if "/" in name:
            continue
        source = expand(name, sources).encode("utf-8")
        out[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    return out


class ScriptRegistry:
    """The command scripts of one client, and the commands that call and load them."""

    #: Whether calls go to the ``kvredis`` function library now (never, for this registry:
    #: :class:`kvredis.redis.functions.FunctionRegistry` may).
    active: bool = False

    @property
    def api(self) -> int | None:
        """The protocol version of the function library calls may go to (None: EVALSHA only;
        a namespace this client creates then records the shipped one)."""
        return None

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

    def call_command(self, call: ScriptCall) -> Command:
        """The command that calls ``call`` the way calls are sent now: its ``EVALSHA``
        (:meth:`evalsha_command`) here, ``FCALL``/``FCALL_RO`` for a function registry using
        the library."""
        return self.evalsha_command(call)

    def evalsha_command(self, call: ScriptCall) -> Command:
        """The ``EVALSHA`` command of ``call`` (a read only for a ``no-writes`` script)."""
        keys, script = call.keys, self[call.script]
        if call.read and not script.no_writes:
            raise BackendError(f"script {call.script} may write: it cannot be sent as a read")
        return Command(("EVALSHA", script.sha, len(keys), *keys, *call.args), call.read)

    def load_command(self, name: str, read: bool = False) -> Command:
        """The command that loads what a call of ``name`` needs: :meth:`script_load_command`
        here, ``FUNCTION LOAD`` for a function registry using the library."""
        return self.script_load_command(name, read)

    def script_load_command(self, name: str, read: bool = False) -> Command:
        """The ``SCRIPT LOAD`` command of script ``name`` (``read``: for the server a read
        call of it goes to, a replica maybe)."""
        return Command(("SCRIPT", "LOAD", self[name].source), read)

    def check_loaded(self, name: str, reply: Any) -> None:
        """Check the reply of :meth:`load_command`: the server must hash the script as we did."""
        script = self[name]
        got = reply.decode() if isinstance(reply, bytes) else str(reply)
        if got != script.sha:
            raise BackendError(f"server hashed script {name} to {got}, expected {script.sha}")

    def missing(self, reply: object) -> bool:
        """Whether ``reply`` (to a call of :meth:`call_command`) is the error reply saying the
        server lacks what was called (:func:`missing_callee`: here a script, ``NOSCRIPT``), so
        that loading it (:meth:`load_command`) and calling again helps."""
        return missing_callee(reply) is Missing.SCRIPT

    def refused(self, reply: object) -> bool:
        """Whether ``reply`` is an error reply refusing the way calls are sent, where EVALSHA
        (:meth:`evalsha_command`) may still work; never, for EVALSHA itself."""
        return False

    def fall_back(self, message: str) -> None:
        """Keep to EVALSHA from now on, because of the refusal ``message``."""

    def op_choose(self, server: str = "the server", state: CoreState | None = None) -> Op[None]:
        """Decide, when connecting to ``server`` (for ``state``'s namespace), how calls are
        sent: by EVALSHA here (see :meth:`kvredis.redis.functions.FunctionRegistry.op_choose`)."""
        return
        yield

    def op_reload(
        self, names: Collection[str], read: bool = False, state: CoreState | None = None
    ) -> Op[None]:
        """After calls of ``names`` missed what they call (:meth:`missing`): load it, each
        distinct load command once (``read``: for the server a read call goes to)."""
        done: set[Command] = set()
        for name in sorted(names):
            command = self.load_command(name, read)
            if command not in done:
                done.add(command)
                self.check_loaded(name, (yield command))

"""The index as a Redis Functions library: ``kvredis``, built from the same ``lua/`` sources.

Every command script ``lua/<name>.lua`` becomes the function ``kvredis_<name>`` of one library
named ``kvredis`` (``FUNCTION LOAD``), with the script's flags (``no-writes`` functions can be
called with ``FCALL_RO``). The library is generated from the sources when a client starts, never
kept as a second copy: each script becomes one ``do ... end`` block whose top level holds the
script's includes (expanded as for ``EVALSHA``) and whose function is the script's own text, with
``KEYS`` and ``ARGV`` as its two parameters. The includes therefore run once, at ``FUNCTION
LOAD``, instead of at every call; the blocks keep each script's locals apart (Lua allows 200
active locals per function). Includes hold no state that a call changes (constants and local
functions only), so sharing them between calls keeps each call's result what ``EVALSHA`` gives.

``kvredis_version`` (``no-writes``) replies ``[library, api, layout, release, build]``:

- ``library``  ``"kvredis"``
- ``api``      :data:`API_VERSION`, an integer raised whenever a function's keys, arguments or
  reply change incompatibly (docs/protocol.md says what is stable);
- ``layout``   the namespace layout version the functions read and write
  (:data:`kvredis.redis.layout.LAYOUT_VERSION`, also in every namespace's ``<ns>:meta``);
- ``release``  the kvredis release that built the library;
- ``build``    16 hex digits of the SHA1 of the generated library code: any change of any script
  or include changes it.

The same text is each function's description, so ``FUNCTION LIST LIBRARYNAME kvredis`` shows it.
:func:`plan` decides, from that reply, whether a client loads its own library (``FUNCTION LOAD
REPLACE``), uses the one on the server, or keeps to ``EVALSHA``. No I/O library is imported here.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvredis._version import __version__
from kvredis.errors import BackendError, BackendUnavailableError, ConfigError
from kvredis.redis.layout import LAYOUT_VERSION
from kvredis.redis.requests import Command, ErrorReply, Op, ScriptCall
from kvredis.redis.scripts import INCLUDES, Script, ScriptRegistry, expand, lua_sources

logger = logging.getLogger(__name__)

#: ``use_functions`` of a client: ``True`` (the library, or fail), ``False`` (EVALSHA only),
#: ``"auto"`` (the library when the server and the ACL user allow it, else EVALSHA).
UseFunctions = bool | Literal["auto"]

#: The library name (``FUNCTION LOAD``, ``FUNCTION LIST LIBRARYNAME``, ``FUNCTION DELETE``).
LIBRARY = "kvredis"
#: Prefix of every function name (function names are global to a server, across libraries).
PREFIX = "kvredis_"
#: The function that reports the library's versions.
VERSION_FUNCTION = f"{PREFIX}version"
#: Version of the function protocol (keys, arguments, replies, error codes): docs/protocol.md.
API_VERSION = 2
#: Text a server answers a call of a function it does not have with (``ERR Function not found``).
NOT_FOUND = "function not found"

_INCLUDE_RE = re.compile(r"^--@include\s+\S+\s*$", re.MULTILINE)
_SHEBANG_RE = re.compile(r"\A#!lua flags=(\S*)[^\n]*\n")
_NAME_RE = re.compile(r"\A[a-z][a-z0-9_]*\Z")
_BUILD_MARK = "@@BUILD@@"


def function_name(script: str) -> str:
    """The function of command script ``script`` (``lookup`` -> ``kvredis_lookup``)."""
    return PREFIX + script


def _flags(source: str) -> list[str]:
    shebang = _SHEBANG_RE.match(source)
    return [f for f in shebang.group(1).split(",") if f] if shebang else []


def _lua_string(text: str) -> str:
    if any(c in text for c in "'\\\n"):
        raise BackendError(f"cannot quote {text!r} in the library source")
    return f"'{text}'"


def _block(name: str, sources: Mapping[str, str], description: str) -> str:
    """One script as a ``do`` block: includes at its top level, its body as the function."""
    source = sources[name]
    if not _NAME_RE.match(name):
        raise BackendError(f"script name {name!r} cannot name a function")
    includes = "\n".join(_INCLUDE_RE.findall(source))
    prelude_key = "\0prelude"
    prelude = expand(prelude_key, {**sources, prelude_key: includes + "\n"}).strip("\n")
    body = _INCLUDE_RE.sub("", _SHEBANG_RE.sub("", source)).strip("\n")
    flags = ", ".join(_lua_string(f) for f in _flags(source))
    return (
        f"do -- {name}\n{prelude}\n"
        f"redis.register_function{{function_name={_lua_string(function_name(name))},\n"
        f"  flags={{{flags}}}, description={_lua_string(description)},\n"
        f"  callback=function(KEYS, ARGV)\n{body}\nend}}\n"
        "end\n"
    )


def _description(build: str) -> str:
    release = __version__
    return f"{LIBRARY} api {API_VERSION} layout {LAYOUT_VERSION} release {release} build {build}"


@dataclass(frozen=True, slots=True)
class Library:
    """The generated library: its code (for ``FUNCTION LOAD``), build id and functions."""

    code: bytes
    build: str
    #: script name -> whether its function is ``no-writes`` (callable with ``FCALL_RO``)
    reads: Mapping[str, bool]

    @property
    def version(self) -> tuple[str, int, str, str, str]:
        """What ``kvredis_version`` replies: library, api, layout, release, build."""
        return (LIBRARY, API_VERSION, LAYOUT_VERSION, __version__, self.build)

    def functions(self) -> list[str]:
        """Every function name of the library, ``kvredis_version`` included."""
        return sorted([*(function_name(n) for n in self.reads), VERSION_FUNCTION])


def build_library(sources: Mapping[str, str]) -> Library:
    """The library of every command script in ``sources`` (as :func:`lua_sources` gives)."""
    names = sorted(n for n in sources if not n.startswith(f"{INCLUDES}/"))
    if "version" in names:
        raise BackendError("a script named version would clash with the kvredis_version function")
    description = _description(_BUILD_MARK)
    blocks = [_block(name, sources, description) for name in names]
    version = ", ".join(
        _lua_string(str(v)) if isinstance(v, str) else str(v)
        for v in (LIBRARY, API_VERSION, LAYOUT_VERSION, __version__, _BUILD_MARK)
    )
    code = (
        f"#!lua name={LIBRARY}\n"
        f"-- {description}: generated from kvredis's lua/ sources; see docs/protocol.md\n"
        + "".join(blocks)
        + f"redis.register_function{{function_name={_lua_string(VERSION_FUNCTION)},\n"
        f"  flags={{'no-writes'}}, description={_lua_string(description)},\n"
        f"  callback=function() return {{{version}}} end}}\n"
    )
    build = hashlib.sha1(code.encode("utf-8")).hexdigest()[:16]
    reads = {name: "no-writes" in _flags(sources[name]) for name in names}
    return Library(code.replace(_BUILD_MARK, build).encode("utf-8"), build, reads)


@functools.lru_cache(maxsize=1)
def shipped_library() -> Library:
    """The library built from the Lua sources shipped with kvredis (built once per process)."""
    return build_library(lua_sources())


class Plan(enum.Enum):
    """What a client does after reading the server's ``kvredis_version`` reply."""

    #: the server holds this client's library (or a compatible newer release): call it
    USE = "use"
    #: the library is missing or older: load this client's (``FUNCTION LOAD REPLACE``)
    LOAD = "load"
    #: the server holds a library of a newer api this client does not speak: use EVALSHA
    SCRIPTS = "scripts"


def _release(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def parse_version(reply: Any) -> tuple[str, int, str, str, str]:
    """The ``kvredis_version`` reply as (library, api, layout, release, build)."""
    if not isinstance(reply, Sequence) or isinstance(reply, (bytes, str)) or len(reply) < 5:
        raise BackendError(f"unexpected {VERSION_FUNCTION} reply {reply!r}")
    text = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in reply[:5]]
    try:
        api = int(text[1])
    except ValueError:
        raise BackendError(f"unexpected {VERSION_FUNCTION} reply {reply!r}") from None
    return text[0], api, text[2], text[3], text[4]


def plan(reply: Any, library: Library) -> Plan:
    """Whether to use the server's library, load ours, or keep to EVALSHA, given the reply of
    ``kvredis_version`` (``None``: the function does not exist).

    Ours is loaded when the server has none, an older api, an older release, or the same
    release built from other sources; a newer release of the same api is used as it is; a
    newer api means this client keeps to EVALSHA.
    """
    if reply is None:
        return Plan.LOAD
    _, api, _, release, build = parse_version(reply)
    if build == library.build:
        return Plan.USE
    if api != API_VERSION:
        return Plan.LOAD if api < API_VERSION else Plan.SCRIPTS
    ours, theirs = _release(__version__), _release(release)
    return Plan.USE if theirs > ours else Plan.LOAD


def not_found(message: str) -> bool:
    """Whether an error reply says the called function does not exist (a flushed server, a
    replica that never got the library)."""
    return NOT_FOUND in message.lower()


def check_use_functions(value: object) -> UseFunctions:
    """``value`` as a ``use_functions`` setting, or :class:`~kvredis.errors.ConfigError`."""
    if value is True or value is False or value == "auto":
        return value
    raise ConfigError(f'use_functions must be true, false or "auto", got {value!r}')


def _refusal(message: str) -> bool:
    """Whether an error reply means the server or the ACL user does not offer FUNCTION/FCALL
    (no such command, or the command not permitted: a refused key is no such reply), so that
    only EVALSHA is left."""
    text = message.lower()
    if "unknown command" in text:
        return True
    return "permissions" in text and any(f"'{verb}" in text for verb in ("fcall", "function"))


class FunctionRegistry(ScriptRegistry):
    """A script registry whose calls go to the ``kvredis`` library (``FCALL``/``FCALL_RO``)
    once :meth:`op_choose` found it usable, and by ``EVALSHA`` before that and after falling
    back. A miss (``Function not found``: a flushed server, a failover to a server without the
    library) reloads the whole library with ``FUNCTION LOAD REPLACE``, on the primary."""

    def __init__(
        self,
        scripts: Mapping[str, Script] | None = None,
        library: Library | None = None,
        use: UseFunctions = "auto",
    ) -> None:
        super().__init__(scripts)
        self.library = shipped_library() if library is None else library
        self.use = check_use_functions(use)
        #: whether calls are sent as FCALL / FCALL_RO now
        self.active = False
        self._fell_back = False

    def evalsha(self, call: ScriptCall) -> Command:
        """``FCALL_RO`` (a ``no-writes`` function) or ``FCALL`` of ``call``'s function while
        the library is in use, else ``EVALSHA``."""
        reads = self.library.reads
        if not self.active or call.script not in reads:
            return super().evalsha(call)
        if call.read and not reads[call.script]:
            raise BackendError(f"function {call.script} may write: it cannot be sent as a read")
        verb = "FCALL_RO" if reads[call.script] else "FCALL"
        keys = call.keys
        return Command((verb, function_name(call.script), len(keys), *keys, *call.args), call.read)

    def load(self, name: str, read: bool = False) -> Command:
        """While the library is in use: ``FUNCTION LOAD REPLACE`` of the whole library, sent
        to the primary (a replica refuses it, and gets the library by replication)."""
        if not self.active:
            return super().load(name, read)
        return self.load_library()

    def load_library(self) -> Command:
        """The ``FUNCTION LOAD REPLACE`` command of the library."""
        return Command(("FUNCTION", "LOAD", "REPLACE", self.library.code))

    def check_loaded(self, name: str, reply: Any) -> None:
        """Check the reply of :meth:`load` (the library's name after ``FUNCTION LOAD``)."""
        if not self.active:
            super().check_loaded(name, reply)
            return
        got = reply.decode() if isinstance(reply, bytes) else str(reply)
        if got != LIBRARY:
            raise BackendError(f"FUNCTION LOAD answered {got!r}, expected {LIBRARY!r}")

    def missing(self, message: str) -> bool:
        """``NOSCRIPT``, or a function the server does not have."""
        return super().missing(message) or (self.active and not_found(message))

    def refused(self, message: str) -> bool:
        """While the library is in use: whether ``message`` (an error reply to ``FCALL`` or
        ``FUNCTION LOAD``) says the server or the ACL user does not offer functions."""
        return self.active and self.use is not True and _refusal(message)

    def fall_back(self, message: str) -> None:
        """Keep to ``EVALSHA`` from now on (logged once); with ``use=True`` an error."""
        self._use_scripts(message)

    def _use_scripts(self, reason: str) -> None:
        if self.use is True:
            raise BackendError(
                f"use_functions is true, but the {LIBRARY} function library cannot be used: "
                f"{reason}; load it (kvredis functions load) or grant FCALL/FUNCTION"
            )
        self.active = False
        if not self._fell_back:
            self._fell_back = True
            logger.warning(
                "kvredis calls its Lua scripts by EVALSHA: the %s function library cannot be "
                "used (%s)",
                LIBRARY,
                reason,
            )

    def op_choose(self, server: str = "the server") -> Op[None]:
        """Decide how calls are sent (what connecting does): ask ``kvredis_version``, load the
        library when it is missing or older (:func:`plan`), and fall back to ``EVALSHA`` when
        the server or the ACL user does not offer functions. Yields plain commands; run it with
        :func:`kvredis.redis.ops.op_drive` (error replies arrive as
        :mod:`kvredis.errors` exceptions)."""
        if self.use is False or self._fell_back:
            self.active = False
            return
        try:
            reply = yield Command(("FCALL_RO", VERSION_FUNCTION, 0))
        except BackendUnavailableError:
            raise
        except BackendError as exc:
            if not not_found(str(exc)):
                self._use_scripts(f"{server} refused FCALL_RO {VERSION_FUNCTION}: {exc}")
                return
            reply = None
        action = plan(reply, self.library)
        if action is Plan.SCRIPTS:
            self._use_scripts(f"{server} holds a {LIBRARY} library of a newer api: {reply!r}")
            return
        if action is Plan.LOAD:
            try:
                loaded = yield self.load_library()
            except BackendUnavailableError:
                raise
            except BackendError as exc:
                if not _refusal(str(exc)):
                    raise
                if reply is None or parse_version(reply)[1] != API_VERSION:
                    self._use_scripts(f"{server} refused FUNCTION LOAD of {LIBRARY}: {exc}")
                    return
                logger.info(
                    "%s holds another build of the %s library (same api) and refused to "
                    "replace it: using it (%s)",
                    server,
                    LIBRARY,
                    exc,
                )
                self.active = True
                return
            self.active = True
            self.check_loaded(LIBRARY, loaded)
            build = self.library.build
            logger.info("loaded the %s library (build %s) on %s", LIBRARY, build, server)
            return
        self.active = True


def _version_or_none(text: str) -> None:
    if not not_found(text):
        raise BackendError(f"{VERSION_FUNCTION} failed: {text}")


def op_server_library() -> Op[tuple[str, int, str, str, str] | None]:
    """The version of the library a server holds (see :func:`parse_version`), ``None`` when it
    holds none. Error replies may arrive as :class:`~kvredis.redis.requests.ErrorReply` or as
    :mod:`kvredis.errors` exceptions."""
    try:
        reply = yield Command(("FCALL_RO", VERSION_FUNCTION, 0))
    except (ErrorReply, BackendError) as exc:
        _version_or_none(str(exc))
        return None
    return parse_version(reply)


def op_load_library(
    library: Library, replace: bool = False
) -> Op[tuple[tuple[str, int, str, str, str] | None, bool]]:
    """Load ``library`` on a server when it holds none or an older one (:func:`plan`), or
    always with ``replace``: (the version held before, whether it was loaded)."""
    before = yield from op_server_library()
    if not replace and plan(before and list(before), library) is not Plan.LOAD:
        return before, False
    try:
        reply = yield Command(("FUNCTION", "LOAD", "REPLACE", library.code))
    except (ErrorReply, BackendError) as exc:
        raise BackendError(f"FUNCTION LOAD of the {LIBRARY} library failed: {exc}") from None
    got = reply.decode() if isinstance(reply, bytes) else str(reply)
    if got != LIBRARY:
        raise BackendError(f"FUNCTION LOAD answered {got!r}, expected {LIBRARY!r}")
    return before, True

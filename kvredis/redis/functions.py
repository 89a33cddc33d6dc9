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

Every call carries the protocol version its caller speaks as its last argument
(``kvredis-api:<api>``, :func:`api_argument`): each function (``kvredis_version`` aside) first
checks it against its own and fails ``KVREDIS_VERSION`` (a
:class:`~kvredis.errors.ProtocolVersionError`) when they differ, so a call is never read with a
meaning its caller did not give it (``lua/includes/api.lua``); the function then sees its
arguments without it, exactly as its ``EVALSHA`` script does.

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
REPLACE``), uses the one on the server, or keeps to ``EVALSHA``. A client never replaces a
library of a newer api with its own, and never loads its own into a server without one when its
namespace records (``<ns>:meta`` field ``api``, :data:`API_FIELD`) that clients of a newer api
use it: it keeps to ``EVALSHA`` of its own scripts then, which cannot disturb newer clients.
No I/O library is imported here.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import re
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvredis._version import __version__
from kvredis.errors import BackendError, BackendUnavailableError, ConfigError
from kvredis.redis.layout import LAYOUT_VERSION, Layout, meta_key
from kvredis.redis.requests import (
    TRANSIENT_REPLIES,
    Arg,
    Command,
    ErrorReply,
    Op,
    ScriptCall,
    error_reply,
)
from kvredis.redis.scripts import (
    INCLUDES,
    Missing,
    Script,
    ScriptRegistry,
    expand,
    lua_sources,
    missing_callee,
)
from kvredis.redis.scripts import NOT_FOUND as NOT_FOUND
from kvredis.redis.scripts import VERSION_CODE as VERSION_CODE
from kvredis.redis.state import CoreState

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
API_VERSION = 3
#: The ``<ns>:meta`` field recording the newest api of the clients that loaded the library or
#: created the namespace (written by ``kvredis_namespace``).
API_FIELD = "api"
#: The include every function's block starts with (the protocol version check).
_API_INCLUDE = "api"


def api_argument(api: int = API_VERSION) -> str:
    """The last argument of every function call: the protocol version its caller speaks."""
    return f"kvredis-api:{api}"


_INCLUDE_RE = re.compile(r"^--@(?:include|command)\s+\S+\s*$", re.MULTILINE)
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


def _block(name: str, sources: Mapping[str, str], description: str, api: int) -> str:
    """One script as a ``do`` block: includes at its top level, its body as the function, which
    first checks and takes off the call's protocol version (``lua/includes/api.lua``)."""
    source = sources[name]
    if not _NAME_RE.match(name):
        raise BackendError(f"script name {name!r} cannot name a function")
    includes = "\n".join([f"--@include {_API_INCLUDE}", *_INCLUDE_RE.findall(source)])
    prelude_key = "\0prelude"
    prelude = expand(prelude_key, {**sources, prelude_key: includes + "\n"}).strip("\n")
    body = _INCLUDE_RE.sub("", _SHEBANG_RE.sub("", source)).strip("\n")
    flags = ", ".join(_lua_string(f) for f in _flags(source))
    return (
        f"do -- {name}\n{prelude}\n"
        f"redis.register_function{{function_name={_lua_string(function_name(name))},\n"
        f"  flags={{{flags}}}, description={_lua_string(description)},\n"
        f"  callback=function(KEYS, ARGV)\n"
        f"api_arg(ARGV, {_lua_string(api_argument(api))}, {_lua_string(description)})\n"
        f"{body}\nend}}\n"
        "end\n"
    )


def _description(build: str, api: int, release: str) -> str:
    return f"{LIBRARY} api {api} layout {LAYOUT_VERSION} release {release} build {build}"


@dataclass(frozen=True, slots=True)
class Library:
    """The generated library: its code (for ``FUNCTION LOAD``), build id and functions."""

    code: bytes
    build: str
    #: script name -> whether its function is ``no-writes`` (callable with ``FCALL_RO``)
    reads: Mapping[str, bool]
    #: the protocol version its functions speak (:data:`API_VERSION` for the shipped one)
    api: int = API_VERSION
    #: the kvredis release that built it
    release: str = __version__

    @property
    def version(self) -> tuple[str, int, str, str, str]:
        """What ``kvredis_version`` replies: library, api, layout, release, build."""
        return (LIBRARY, self.api, LAYOUT_VERSION, self.release, self.build)

    @property
    def argument(self) -> str:
        """The protocol version argument its functions take last (:func:`api_argument`)."""
        return api_argument(self.api)

    def functions(self) -> list[str]:
        """Every function name of the library, ``kvredis_version`` included."""
        return sorted([*(function_name(n) for n in self.reads), VERSION_FUNCTION])


def build_library(
    sources: Mapping[str, str], api: int = API_VERSION, release: str = __version__
) -> Library:
    """The library of every command script in ``sources`` (as :func:`lua_sources` gives),
    speaking protocol version ``api`` (another ``api`` or ``release`` builds what another
    kvredis would load: tests of rolling upgrades do)."""
    names = sorted(n for n in sources if not n.startswith(f"{INCLUDES}/"))
    if "version" in names:
        raise BackendError("a script named version would clash with the kvredis_version function")
    if f"{INCLUDES}/{_API_INCLUDE}" not in sources:
        raise BackendError(f"the Lua sources lack {INCLUDES}/{_API_INCLUDE}.lua")
    description = _description(_BUILD_MARK, api, release)
    blocks = [_block(name, sources, description, api) for name in names]
    version = ", ".join(
        _lua_string(str(v)) if isinstance(v, str) else str(v)
        for v in (LIBRARY, api, LAYOUT_VERSION, release, _BUILD_MARK)
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
    return Library(code.replace(_BUILD_MARK, build).encode("utf-8"), build, reads, api, release)


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
    newer api means this client keeps to EVALSHA (a client never replaces a newer api).
    """
    if reply is None:
        return Plan.LOAD
    _, api, _, release, build = parse_version(reply)
    if build == library.build:
        return Plan.USE
    if api != library.api:
        return Plan.LOAD if api < library.api else Plan.SCRIPTS
    ours, theirs = _release(library.release), _release(release)
    return Plan.USE if theirs > ours else Plan.LOAD


def check_use_functions(value: object) -> UseFunctions:
    """``value`` as a ``use_functions`` setting, or :class:`~kvredis.errors.ConfigError`."""
    if value is True or value is False or value == "auto":
        return value
    raise ConfigError(f'use_functions must be true, false or "auto", got {value!r}')


def _refusal(reply: object) -> bool:
    """Whether ``reply`` is an error reply meaning the server or the ACL user does not offer
    FUNCTION/FCALL (no such command, or the command not permitted: a refused key is no such
    reply), so that only EVALSHA is left."""
    if not isinstance(reply, ErrorReply):
        return False
    text = reply.message.lower()
    if "unknown command" in text:
        return True
    return "permissions" in text and any(f"'{verb}" in text for verb in ("fcall", "function"))


def _exists(reply: object) -> bool:
    """Whether ``reply`` is the error reply to ``FUNCTION LOAD`` (without ``REPLACE``) saying
    the server holds the library already (another client loaded one since it was asked)."""
    return isinstance(reply, ErrorReply) and "already exists" in reply.message


def _raise_transient(exc: Exception) -> None:
    """Raise ``exc`` again when it means the server or the connection is in trouble (retried by
    the caller) rather than a refusal."""
    if isinstance(exc, BackendUnavailableError) or (
        isinstance(exc, ErrorReply) and exc.code in TRANSIENT_REPLIES
    ):
        raise exc


def _shown(reply: Any) -> str:
    try:
        _, api, layout, release, build = parse_version(reply)
    except BackendError:
        return repr(reply)
    return f"api {api}, layout {layout}, release {release}, build {build}"


def _recorded_api(reply: Any) -> int | None:
    """The api a namespace records (``HGET <ns>:meta api``), or None."""
    if isinstance(reply, bytes):
        reply = reply.decode("ascii", "replace")
    try:
        return int(reply) if reply is not None else None
    except ValueError:
        return None


def namespace_call(state: CoreState, api: int, scheme: str | None = None) -> ScriptCall:
    """The ``namespace`` call that creates ``state``'s namespace when it is missing (with the
    client's bucket bits and expiry mode) and records ``api`` in it (the namespace keeps the
    highest api recorded), and ``scheme`` (a block key scheme's text) when it records none:
    what connecting sends, what a client that loaded its library sends, and what a writer that
    knows its keys' scheme sends."""
    layout = Layout(state.namespace, state.bucket_bits, b"")
    args: tuple[Arg, ...] = (
        LAYOUT_VERSION, state.bucket_bits, secrets.token_hex(8), state.expiry_mode, api,
    )  # fmt: skip
    if scheme is not None:
        args = (*args, scheme)
    return ScriptCall("namespace", (layout.meta, layout.pi), args)


#: How many times settling on a library asks the server again after another client changed it
#: in between (a load racing another client's).
SETTLE_ATTEMPTS = 3


class FunctionRegistry(ScriptRegistry):
    """A script registry whose calls go to the ``kvredis`` library (``FCALL``/``FCALL_RO``)
    once :meth:`op_choose` found it usable, and by ``EVALSHA`` before that and after falling
    back. Every call carries the library's protocol version last (:func:`api_argument`).

    A miss (``Function not found``: a flushed server, a failover to a server without the
    library) or a refusal of another protocol version (``KVREDIS_VERSION``: another kvredis
    loaded its library) settles again (:meth:`op_reload`): a library of a newer api is used by
    no call of this client, which keeps to ``EVALSHA`` from then on; an older one, or none, is
    replaced by this client's (``FUNCTION LOAD``, on the primary), except that a client never
    loads its library into a server without one when its namespace records a newer api (the
    ``api`` field of ``<ns>:meta``, raised by every client that loads its library)."""

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

    @property
    def api(self) -> int:
        """The protocol version of this registry's library."""
        return self.library.api

    def call_command(self, call: ScriptCall) -> Command:
        """``FCALL_RO`` (a ``no-writes`` function) or ``FCALL`` of ``call``'s function, its
        protocol version last, while the library is in use, else ``EVALSHA``."""
        reads = self.library.reads
        if not self.active or call.script not in reads:
            return super().call_command(call)
        if call.read and not reads[call.script]:
            raise BackendError(f"function {call.script} may write: it cannot be sent as a read")
        verb = "FCALL_RO" if reads[call.script] else "FCALL"
        keys = call.keys
        return Command(
            (verb, function_name(call.script), len(keys), *keys, *call.args, self.library.argument),
            call.read,
        )

    def load_command(self, name: str, read: bool = False) -> Command:
        """While the library is in use: ``FUNCTION LOAD REPLACE`` of the whole library, sent
        to the primary (a replica refuses it, and gets the library by replication)."""
        if not self.active:
            return super().load_command(name, read)
        return self.function_load_command()

    def function_load_command(self, replace: bool = True) -> Command:
        """The ``FUNCTION LOAD`` command of the library (``REPLACE`` unless ``replace`` is
        false: then it fails where the server holds any ``kvredis`` library)."""
        verb = ("FUNCTION", "LOAD", "REPLACE") if replace else ("FUNCTION", "LOAD")
        return Command((*verb, self.library.code))

    def check_loaded(self, name: str, reply: Any) -> None:
        """Check the reply of :meth:`load_command` (the library's name after ``FUNCTION
        LOAD``)."""
        if not self.active:
            super().check_loaded(name, reply)
            return
        got = reply.decode() if isinstance(reply, bytes) else str(reply)
        if got != LIBRARY:
            raise BackendError(f"FUNCTION LOAD answered {got!r}, expected {LIBRARY!r}")

    def missing(self, reply: object) -> bool:
        """``NOSCRIPT``, or (while the library is in use) a function the server does not have
        or a function of another protocol version (``KVREDIS_VERSION``), both read by
        :func:`~kvredis.redis.scripts.missing_callee`: :meth:`op_reload` settles which library
        to call, or EVALSHA."""
        lacked = missing_callee(reply)
        return lacked is Missing.SCRIPT or (
            self.active and lacked in (Missing.FUNCTION, Missing.VERSION)
        )

    def refused(self, reply: object) -> bool:
        """While the library is in use: whether ``reply`` (to ``FCALL`` or ``FUNCTION LOAD``)
        is an error reply saying the server or the ACL user does not offer functions."""
        return self.active and self.use is not True and _refusal(reply)

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

    def op_reload(
        self, names: Collection[str], read: bool = False, state: CoreState | None = None
    ) -> Op[None]:
        """After a call missed (:meth:`missing`) while the library is in use: settle again
        which library to call. The server's library is used when it is this client's (or a
        newer release of its api: another client loaded it meanwhile); a newer api means
        ``EVALSHA`` from now on; an older one is replaced with this client's, and a missing one
        loaded, unless ``state``'s namespace records a newer api (then ``EVALSHA`` too). Runs
        inside :func:`kvredis.redis.session.op_send`: error replies arrive as
        :class:`~kvredis.redis.requests.ErrorReply`, and a refused load propagates (the caller
        tries ``EVALSHA``, as for a refused call). Without the library: load the scripts."""
        if not self.active:
            yield from super().op_reload(names, read, state)
            return
        try:
            reply = yield Command(("FCALL_RO", VERSION_FUNCTION, 0))
        except ErrorReply as failure:
            if missing_callee(failure) is not Missing.FUNCTION:
                raise
            reply = None
        action = plan(reply, self.library)
        if action is Plan.USE:
            return
        if action is Plan.SCRIPTS:
            self._use_scripts(self._newer(reply, "the server"))
            return
        if reply is None and state is not None:
            recorded = yield from self._op_recorded(state)
            if recorded is not None and recorded > self.library.api:
                self._use_scripts(self._recorded_newer(recorded, "the server", state))
                return
        try:
            loaded = yield self.function_load_command(replace=reply is not None)
        except ErrorReply as failure:
            if _exists(failure):
                return  # another client loaded one meanwhile: the call finds out which
            raise
        self.check_loaded(LIBRARY, loaded)
        logger.info("reloaded the %s library (build %s)", LIBRARY, self.library.build)
        if state is not None:
            yield from self._op_record(state)

    def _newer(self, reply: Any, server: str) -> str:
        return (
            f"{server} holds a {LIBRARY} library of a newer api ({_shown(reply)}) than this "
            f"client's ({self.library.api}): upgrade this client"
        )

    def _recorded_newer(self, recorded: int, server: str, state: CoreState) -> str:
        return (
            f"{server} holds no {LIBRARY} library, and namespace {state.namespace!r} records "
            f"clients of api {recorded}, newer than this client's ({self.library.api}): this "
            "client does not load its older library under them; upgrade this client"
        )

    def op_choose(
        self, server: str = "the server", state: CoreState | None = None
    ) -> Op[None]:
        """Decide how calls are sent (what connecting does, and what a call that missed the
        library does again): ask ``kvredis_version``, load the library when it is missing or
        older (:func:`plan`; never over a newer api, nor, when the server holds none, when
        ``state``'s namespace records a newer api), and fall back to ``EVALSHA`` when the
        server or the ACL user does not offer functions or a newer api holds the server.
        Yields plain commands; run it with :func:`kvredis.redis.session.op_drive`, or on raw
        replies: an error reply is read as it came (:func:`~kvredis.redis.requests.error_reply`),
        whether it arrives raw or as the :mod:`kvredis.errors` exception made of it)."""
        if self.use is False or self._fell_back:
            self.active = False
            return
        for _ in range(SETTLE_ATTEMPTS):
            try:
                reply = yield Command(("FCALL_RO", VERSION_FUNCTION, 0))
            except BackendUnavailableError:
                raise
            except (ErrorReply, BackendError) as exc:
                if missing_callee(error_reply(exc)) is not Missing.FUNCTION:
                    self._use_scripts(f"{server} refused FCALL_RO {VERSION_FUNCTION}: {exc}")
                    return
                reply = None
            action = plan(reply, self.library)
            if action is Plan.USE:
                self.active = True
                return
            if action is Plan.SCRIPTS:
                self._use_scripts(self._newer(reply, server))
                return
            if reply is None and state is not None:
                recorded = yield from self._op_recorded(state)
                if recorded is not None and recorded > self.library.api:
                    self._use_scripts(self._recorded_newer(recorded, server, state))
                    return
            try:
                loaded = yield self.function_load_command(replace=reply is not None)
            except BackendUnavailableError:
                raise
            except (ErrorReply, BackendError) as exc:
                if _exists(error_reply(exc)):
                    continue  # another client loaded one meanwhile: decide again
                if not _refusal(error_reply(exc)):
                    raise
                if reply is None or parse_version(reply)[1] != self.library.api:
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
            if state is not None:
                yield from self._op_record(state)
            return
        raise BackendError(
            f"{server}: the {LIBRARY} library kept changing while this client settled on it"
        )

    def _op_recorded(self, state: CoreState) -> Op[int | None]:
        """The api ``state``'s namespace records (None: none, or not readable). Error replies
        may arrive as exceptions of either kind; a transient one propagates."""
        try:
            reply = yield Command(("HGET", meta_key(state.namespace), API_FIELD))
        except (BackendError, ErrorReply) as exc:
            _raise_transient(exc)  # a user that may not read it: nothing recorded for it
            logger.debug("cannot read %s of namespace %r: %s", API_FIELD, state.namespace, exc)
            return None
        return _recorded_api(reply)

    def _op_record(self, state: CoreState) -> Op[None]:
        """Raise the api ``state``'s namespace records to this library's (best effort: a user
        that may not write it leaves it; creates the namespace when missing, as connecting
        does)."""
        try:
            yield self.call_command(namespace_call(state, self.library.api))
        except (BackendError, ErrorReply) as exc:
            _raise_transient(exc)
            logger.debug("cannot record api %d in namespace %r: %s", self.library.api,
                         state.namespace, exc)  # fmt: skip


def op_server_library() -> Op[tuple[str, int, str, str, str] | None]:
    """The version of the library a server holds (see :func:`parse_version`), ``None`` when it
    holds none. Error replies may arrive as :class:`~kvredis.redis.requests.ErrorReply` or as
    :mod:`kvredis.errors` exceptions (read as the reply they were made of)."""
    try:
        reply = yield Command(("FCALL_RO", VERSION_FUNCTION, 0))
    except (ErrorReply, BackendError) as exc:
        if missing_callee(error_reply(exc)) is not Missing.FUNCTION:
            raise BackendError(f"{VERSION_FUNCTION} failed: {exc}") from None
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

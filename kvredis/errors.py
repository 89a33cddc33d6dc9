"""The kvredis exception hierarchy, and the one table of server-side error codes.

Every error raised on purpose by kvredis derives from :class:`KVRedisError` and from the builtin
that matches its meaning, so callers may catch either ``KVRedisError`` or e.g. ``ValueError``.
Server-side scripts report failures as ``KVREDIS_<CODE> message``; :data:`LUA_ERROR_CODES` maps
every code a script under ``lua/`` can raise to its exception class (a test scans the scripts and
fails on a code missing here, or on a code here that no script raises), and :func:`translate`
turns an error reply into the matching exception.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType


class KVRedisError(Exception):
    """Base class of every error kvredis raises on purpose."""


class InvalidInputError(KVRedisError, ValueError):
    """An argument is malformed (out-of-range hash, empty entry list, bad token id, ...)."""


class ConfigError(InvalidInputError):
    """A configuration value is missing, malformed or names an unsupported option."""


class BlockKeySchemeError(ConfigError):
    """The namespace holds block keys of another scheme (hash algorithm, block size, hash seed)
    than this client computes: its keys would never meet the namespace's, and every lookup and
    score would come back empty. The message names both schemes."""


class EngineKeyNotFoundError(KVRedisError, KeyError):
    """No engine-key to request-key mapping exists for the given engine key."""

    def __init__(self, engine_key: int) -> None:
        super().__init__(engine_key)
        self.engine_key = engine_key

    def __str__(self) -> str:
        return (
            f"engine key {self.engine_key} has no request-key mapping "
            "(never added with engine keys, or already evicted)"
        )


class BackendUnavailableError(KVRedisError, ConnectionError):
    """The index backend (Redis/Valkey) cannot be reached or stopped answering in time."""


class BackendAuthenticationError(BackendUnavailableError):
    """The server asked for a password that was not given, or refused the one given (retrying
    cannot help): pass the right user name and password."""


class BackendError(KVRedisError, RuntimeError):
    """The backend answered with an error kvredis did not expect (server bug, wrong server)."""


class BackendOutOfMemoryError(BackendError):
    """The server refused a write: it reached ``maxmemory`` (with policy ``noeviction``).

    Lookups, evictions and clears keep working; free memory (evict or clear pods, raise
    ``maxmemory``) before adding again.
    """


class UnsafeServerConfigError(BackendError):
    """The server is configured in a way that makes the index lie (e.g. an ``allkeys-*``
    ``maxmemory-policy`` that deletes its keys); raised instead of a warning with ``strict``."""


class ClusterModeError(ConfigError, BackendError):
    """The server is a Redis Cluster node, but the address names a single server.

    Raised when connecting (the server reports ``cluster_enabled:1``) or when a node answers a
    command with a cluster redirection (``MOVED``, ``ASK``, ``CROSSSLOT``, ``CLUSTERDOWN``).
    A cluster is addressed as ``redis+cluster://host:port[,host:port...]``.
    """


#: Error codes only a Redis Cluster node answers.
CLUSTER_REPLY_CODES = frozenset({"MOVED", "ASK", "CROSSSLOT", "CLUSTERDOWN"})


def cluster_mode_error(server: str, evidence: str) -> ClusterModeError:
    """The error for a single-server client that reached a cluster node."""
    return ClusterModeError(
        f"{server} is a Redis Cluster node ({evidence}), but the address names a single "
        "server; address the cluster as redis+cluster://host:port[,host:port...] "
        "(valkey+cluster:// for Valkey)"
    )


class NamespaceLayoutError(BackendError):
    """The namespace holds data in a layout this client does not understand."""


class NamespaceMissingError(BackendError):
    """An operation that never creates a namespace found none (e.g. ``create=False``)."""


class StaleNamespaceError(BackendError):
    """The namespace was recreated (flush, restart without persistence) since the client loaded it.

    The Redis executors reload the namespace and run the operation again; it reaches callers only
    if that keeps failing.
    """


class CallBudgetError(BackendError):
    """A script call would do more work than one call may (its keys reach too many fragmented
    chain runs); it wrote nothing.

    ``ops`` and ``keys`` say how much of the call fits one call: its first ``ops`` ops, or (with
    ``ops`` 0) the first ``keys`` request keys of its first op (an add, or an evict by engine
    key). The Redis clients send the call in pieces of that size; the error reaches callers
    only from a call that cannot be split, which the server never refuses.
    """

    def __init__(self, message: str = "", ops: int = 0, keys: int = 0) -> None:
        head = message.split(" ", 2)
        if len(head) == 3 and head[0].isdigit() and head[1].isdigit():  # a server's reply
            ops, keys, message = int(head[0]), int(head[1]), head[2]
        super().__init__(message)
        self.ops, self.keys = ops, keys


class ProtocolVersionError(BackendError):
    """A function of the ``kvredis`` library refused a call of another protocol version (the
    server's library was loaded by a client of another kvredis api): the call was neither read
    nor applied. The Redis clients handle it themselves (they reload their library where it is
    older, and keep to ``EVALSHA`` of their own scripts where it is newer); it reaches callers
    only when neither is possible (``use_functions=True``)."""


#: Every ``KVREDIS_<CODE>`` a Lua script can raise (the part after ``KVREDIS_``) -> exception.
LUA_ERROR_CODES: Mapping[str, type[KVRedisError]] = MappingProxyType(
    {
        "INVALID": InvalidInputError,
        "LAYOUT": NamespaceLayoutError,
        "STALE": StaleNamespaceError,
        "BUDGET": CallBudgetError,
        "VERSION": ProtocolVersionError,
    }
)

_PREFIX = "KVREDIS_"


def lua_error_code(cls: type[KVRedisError]) -> str:
    """The error code (``KVREDIS_<CODE>``, the reply's first word) the scripts raise for
    ``cls`` (:data:`LUA_ERROR_CODES`), to tell a raw error reply apart by its code."""
    for code, mapped in LUA_ERROR_CODES.items():
        if mapped is cls:
            return _PREFIX + code
    raise KeyError(f"no script error code maps to {cls.__name__}")


def translate(message: str) -> KVRedisError:
    """The exception for an error reply of the server (``str`` of the client library's error).

    ``KVREDIS_<CODE> text`` replies of the scripts map through :data:`LUA_ERROR_CODES` (Redis
    appends `` script: <sha>, on @user_script:<line>.``, which is cut off); ``WRONGTYPE`` means a
    foreign key sits inside the namespace; a cluster redirection (``MOVED``, ``ASK``,
    ``CROSSSLOT``, ``CLUSTERDOWN``) means a cluster node was addressed as a single server
    (:class:`ClusterModeError`); anything else is a :class:`BackendError`.
    """
    if message.startswith(_PREFIX):
        text = message.split(" script: ", 1)[0]
        code, _, detail = text.partition(" ")
        cls = LUA_ERROR_CODES.get(code[len(_PREFIX) :])
        if cls is None:
            return BackendError(f"server error: {text}")
        return cls(detail or code)
    if message.startswith("OOM"):
        return BackendOutOfMemoryError(
            f"the server is out of memory and refuses writes ({message.split(' script:', 1)[0]}); "
            "evict or clear entries, or raise maxmemory"
        )
    if message.split(" ", 1)[0] in CLUSTER_REPLY_CODES:
        return cluster_mode_error("the server", f"it answered {message!r}")
    if message.startswith("WRONGTYPE"):
        return NamespaceLayoutError(
            f"a key of the namespace holds another type of value ({message}); the namespace "
            "is shared with foreign data: use another namespace"
        )
    return BackendError(f"server error: {message}")


def error_from_reply(message: str) -> KVRedisError:
    """Alias of :func:`translate` (kept for callers of the 0.1 API)."""
    return translate(message)

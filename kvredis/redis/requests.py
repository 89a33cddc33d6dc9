"""The sans-IO vocabulary between the index core and an executor: requests, replies, failures.

An index operation (an :data:`Op`) is a generator. It yields a :data:`Request` and is resumed
with the reply (``op.send(reply)``), or with a :class:`Failure` thrown into it
(``op.throw(failure)``) when the request did not produce a reply. The core decides what a
failure means (retry, reload, translate to a :mod:`kvredis.errors` exception); an executor only
sends requests and maps its client library's exceptions to these failures.

Requests an executor sends:

- :class:`Command`: one Redis command, as its arguments (``EVALSHA`` and ``SCRIPT LOAD`` are
  commands too);
- :class:`Pipeline`: several commands in one round trip (no ``MULTI``); the reply is the list of
  replies, with a :class:`Failure` value in place of each command that failed;
- :class:`Sleep`: wait, then resume the operation with ``None``.

A command or script call marked ``read`` only reads (its script is flagged ``no-writes``), and
no caller relies on it seeing the latest writes: with ``read_from_replicas`` an executor may send
it to a replica of the server (:mod:`kvredis.redis.replicas`); others ignore the mark.

A :class:`ScriptCall` names a Lua script (``lua/<name>.lua``) instead of its SHA1; the core turns
it into an ``EVALSHA`` command (see :func:`kvredis.redis.ops.op_send`) before an executor sees it.
This module imports no I/O library.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

#: A value a client library can send as a command argument.
Arg = bytes | str | int | float


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """A call of the Lua script ``script`` with ``keys`` (KEYS) and ``args`` (ARGV); ``read``:
    a replica may answer it (a ``no-writes`` script)."""

    script: str
    keys: Sequence[Arg]
    args: Sequence[Arg]
    read: bool = False


@dataclass(frozen=True, slots=True)
class Command:
    """A plain Redis command, as its arguments; ``read``: a replica may answer it."""

    args: tuple[Arg, ...]
    read: bool = False


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Several requests sent in one round trip (no MULTI); the reply is the list of replies."""

    items: tuple[ScriptCall | Command, ...]


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds`` before the operation goes on (the backoff between retries)."""

    seconds: float


Request = ScriptCall | Command | Pipeline | Sleep
#: An index operation: yields requests, receives their replies, returns the result.
Op = Generator[Request, Any, T]


class Failure(Exception):
    """A request that produced no reply; ``message`` is what the client library said."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


#: Error replies of a server that is up but cannot serve right now (retried like timeouts).
TRANSIENT_REPLIES = frozenset({"BUSY", "LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN"})


class ErrorReply(Failure):
    """The server answered with an error reply: ``message`` is the reply, starting with its code.

    E.g. ``"NOSCRIPT No matching script"``, ``"BUSY Redis is busy running a script"`` or
    ``"KVREDIS_STALE namespace layout changed ..."``.
    """

    @property
    def code(self) -> str:
        """The error code: the reply's first word (``NOSCRIPT``, ``BUSY``, ``KVREDIS_STALE``)."""
        return self.message.split(" ", 1)[0]


def error_reply(exc: BaseException) -> ErrorReply | None:
    """The server's error reply behind ``exc``, as it came: ``exc`` itself (an operation run on
    raw replies, as a cluster wave runs them, gets it thrown in as it is), or the reply a
    :mod:`kvredis.errors` exception was made from (:func:`~kvredis.redis.session.op_send` and
    the cluster's per-node runs raise it ``from`` the reply); ``None`` for an error no reply
    caused. What an operation decides from an error reply it reads here, from the reply's code
    and text, never from the message of the exception made of it."""
    if isinstance(exc, ErrorReply):
        return exc
    cause = exc.__cause__
    return cause if isinstance(cause, ErrorReply) else None


class ConnectionLost(Failure):
    """The server could not be reached, or did not answer in time."""


class AuthenticationFailed(Failure):
    """The server refused the credentials (retrying cannot help)."""


class TlsFailed(Failure):
    """The TLS handshake got no TLS answer (it timed out, or the peer answered in plain text):
    the server does not serve TLS on that port (retrying cannot help)."""


class NotRedis(Failure):
    """The peer does not speak the Redis protocol (an HTTP server on that port; retrying cannot
    help)."""

"""The kvredis exception hierarchy.

Every error raised on purpose by kvredis derives from :class:`KVRedisError` and from the builtin
that matches its meaning, so callers may catch either ``KVRedisError`` or e.g. ``ValueError``.
Server-side scripts report failures as ``KVREDIS_<CODE> message``; :func:`error_from_reply` turns
such a reply into the matching class.
"""

from __future__ import annotations


class KVRedisError(Exception):
    """Base class of every error kvredis raises on purpose."""


class InvalidInputError(KVRedisError, ValueError):
    """An argument is malformed (out-of-range hash, empty entry list, bad token id, ...)."""


class ConfigError(InvalidInputError):
    """A configuration value is missing, malformed or names an unsupported option."""


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


class BackendError(KVRedisError, RuntimeError):
    """The backend answered with an error kvredis did not expect (server bug, wrong server)."""


class NamespaceLayoutError(BackendError):
    """The namespace holds data in a layout this client does not understand."""


_CODES: dict[str, type[KVRedisError]] = {
    "KVREDIS_INVALID": InvalidInputError,
    "KVREDIS_NOTFOUND": BackendError,
    "KVREDIS_LAYOUT": NamespaceLayoutError,
}


def error_from_reply(message: str) -> KVRedisError:
    """Map a ``KVREDIS_<CODE> text`` script error reply to the matching exception instance."""
    code, _, text = message.partition(" ")
    cls = _CODES.get(code)
    if cls is None:
        return BackendError(message)
    return cls(text or code)

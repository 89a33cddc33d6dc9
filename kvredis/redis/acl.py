"""The ACL rules each role of kvredis needs on one namespace (``kvredis acl``; sans-IO).

A role is allowed the commands its work sends, on the keys of its namespace only: every key of
a namespace ``<ns>`` starts with ``<ns>:``, and a namespace name holds neither ``:`` nor a glob
character (:func:`kvredis.redis.layout.check_namespace_name`), so the key pattern ``~<ns>:*``
(``%R~<ns>:*``, read-only) matches the keys of ``<ns>`` and of no other namespace.

- ``router``: ``lookup`` and ``score`` (also ``kvredis lookup|score``), read-only keys: its
  calls are ``FCALL_RO`` of ``no-writes`` functions, which cannot write whatever they are sent;
- ``ingester``: the writes of ``kvredis ingest`` / ``EventIngester`` (adds, evicts, batches
  with watermarks, clears of a pod, speculative entries with a ttl) and the pods' page
  journals (lists ``<ns>:pj:<pod>``: appended, read, compacted under ``WATCH``);
- ``operator``: the operator's commands on the namespace (``stats``, ``pods``, ``watermarks``,
  ``check [--repair]``, ``lookup``, ``score``, ``clear``, ``dump``, ``restore``, ``migrate``,
  ``drop``);
- ``library``: loading the ``kvredis`` function library (``kvredis functions load``), which is
  one per server, shared by every namespace: a server administrator's role, given to no
  tenant (whoever may replace the library decides what every tenant's calls run).

The rules are for the function-library path (``FCALL``/``FCALL_RO``, the default). A client
that cannot use the library falls back to ``EVALSHA``; that path needs ``+evalsha
+script|load`` in place of ``+fcall +fcall_ro``, and full key access (``~<ns>:*``) for the
router too: ``EVALSHA`` declares its keys as keys it may write, so ``%R~`` refuses it (the
router still cannot write: none of its commands writes). ``evalsha=True`` gives those rules.

How speculative entries expire decides two commands: per hash field (``HPEXPIREAT``,
``HPEXPIRETIME``; Redis 7.4+, Valkey 9+, for a namespace created there by a client that may
read ``INFO``) or per bucket key (``PEXPIREAT``, ``PEXPIRETIME``). For a known server and
namespace, :class:`Expiry` names the mode; unknown, the rules name both, the field commands
through the category ``+@hash`` (it holds them where they exist, and a line naming
``+hpexpireat`` is refused by a server without it): the line works on every supported server
and namespace, and the hash commands it adds touch only the namespace's own keys.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvredis.errors import InvalidInputError
from kvredis.redis.layout import check_namespace_name

__all__ = ["AclLine", "Expiry", "Role", "acl_line", "acl_rules", "default_user"]


class Role(enum.Enum):
    """A role of kvredis, as ``kvredis acl --role`` names it."""

    ROUTER = "router"
    INGESTER = "ingester"
    OPERATOR = "operator"
    LIBRARY = "library"


class Expiry(enum.Enum):
    """Which expiry commands a role needs (see the module docstring)."""

    #: per hash field: the namespace expires its entries with HPEXPIREAT
    FIELD = "field"
    #: per bucket key: PEXPIREAT
    KEY = "key"
    #: either (unknown server or namespace): both, the field commands through ``+@hash``
    ANY = "any"


#: What redis-py sends on every connection (a name; ``CLIENT SETINFO`` may be refused).
_CONNECT = ("+client|setname",)
_ROUTER = ("+ping", *_CONNECT, "+hget", "+hmget", "+exists", "+time")
_INGESTER = (
    "+ping",
    *_CONNECT,
    "+scan",
    "+hget",
    "+hmget",
    "+hgetall",
    "+hexists",
    "+hstrlen",
    "+exists",
    "+get",
    "+type",
    "+time",
    "+hset",
    "+hdel",
    "+set",
    "+del",
    # the pods' page journals (kvredis.ingest.journal): appended, read, compacted under WATCH
    "+rpush",
    "+lrange",
    "+llen",
    "+watch",
    "+unwatch",
    "+multi",
    "+exec",
)
_OPERATOR = (
    "+ping",
    *_CONNECT,
    "+info",
    "+scan",
    "+hget",
    "+hmget",
    "+hgetall",
    "+hscan",
    "+hlen",
    "+hexists",
    "+exists",
    "+get",
    "+type",
    "+time",
    "+hset",
    "+hdel",
    "+set",
    "+del",
    "+unlink",
    "+memory|usage",
)
#: The expiry commands by role and mode (the ingester reads INFO to pick field expiry for a
#: namespace it creates).
_EXPIRY: dict[Role, dict[Expiry, tuple[str, ...]]] = {
    Role.ROUTER: {Expiry.FIELD: (), Expiry.KEY: (), Expiry.ANY: ()},
    Role.INGESTER: {
        Expiry.FIELD: ("+info", "+hpexpireat"),
        Expiry.KEY: ("+pexpireat",),
        Expiry.ANY: ("+info", "+pexpireat", "+@hash"),
    },
    Role.OPERATOR: {
        Expiry.FIELD: ("+hpexpireat", "+hpexpiretime"),
        Expiry.KEY: ("+pexpireat", "+pexpiretime"),
        Expiry.ANY: ("+pexpireat", "+pexpiretime", "+@hash"),
    },
}
_LIBRARY = ("+function|load", "+fcall_ro", *_CONNECT)


def default_user(role: Role, namespace: str | None) -> str:
    """The user name ``kvredis acl`` proposes: ``<role>-<namespace>`` (``kvredis-library``)."""
    return "kvredis-library" if namespace is None else f"{role.value}-{namespace}"


def acl_rules(
    role: Role, namespace: str | None, *, expiry: Expiry = Expiry.ANY, evalsha: bool = False
) -> list[str]:
    """The rules after ``ACL SETUSER <user> reset on ><password>`` for ``role`` on
    ``namespace`` (``None`` for the library role, which has no namespace)."""
    if role is Role.LIBRARY:
        if namespace is not None:
            raise InvalidInputError("the library role is one per server: it takes no namespace")
        return ["resetchannels", "-@all", *_LIBRARY]
    if namespace is None:
        raise InvalidInputError(f"the {role.value} role needs a namespace")
    name = check_namespace_name(namespace)
    read_only = role is Role.ROUTER and not evalsha
    keys = f"{'%R' if read_only else ''}~{name}:*"
    if role is Role.ROUTER:
        calls = ["+evalsha", "+script|load"] if evalsha else ["+fcall_ro"]
        commands: Sequence[str] = _ROUTER
    else:
        calls = ["+evalsha", "+script|load"] if evalsha else ["+fcall", "+fcall_ro"]
        commands = _INGESTER if role is Role.INGESTER else _OPERATOR
    extra = [c for c in _EXPIRY[role][expiry] if c not in commands]
    return [keys, "resetchannels", "-@all", *calls, *commands, *extra]


@dataclass(frozen=True, slots=True)
class AclLine:
    """An ``ACL SETUSER`` line: the user and its rules."""

    user: str
    rules: tuple[str, ...]

    def command(self) -> list[str]:
        """The command's arguments (for ``execute_command``)."""
        return ["ACL", "SETUSER", self.user, *self.rules]

    def __str__(self) -> str:
        return " ".join(_quoted(a) for a in self.command())


def acl_line(
    role: Role,
    namespace: str | None,
    *,
    user: str | None = None,
    password: str = "<password>",
    expiry: Expiry = Expiry.ANY,
    evalsha: bool = False,
) -> AclLine:
    """``ACL SETUSER <user> reset on ><password> <rules>`` (:func:`acl_rules`): ``reset``
    first, so running the line again replaces what the user had. ``password`` may be a
    ``#<sha256 hex>`` instead (the rule then holds no clear text)."""
    name = user or default_user(role, namespace)
    if not name or any(c.isspace() or not c.isprintable() for c in name):
        raise InvalidInputError(f"user name {name!r} must be non-empty, without spaces")
    secret = password if password.startswith("#") else f">{password}"
    rules = acl_rules(role, namespace, expiry=expiry, evalsha=evalsha)
    return AclLine(name, ("reset", "on", secret, *rules))


def _quoted(arg: str) -> str:
    """``arg`` as redis-cli reads it: in double quotes when it holds a quote (a namespace may;
    spaces and backslashes it may not)."""
    if any(c in arg for c in "\"'") or not arg:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


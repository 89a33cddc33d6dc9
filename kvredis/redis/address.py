"""Redis/Valkey server addresses: URL parsing into connection parameters.

Accepted forms::

    redis://[user[:password]@]host[:port][/db]      plain TCP (port 6379, db 0 by default)
    rediss://...                                    TLS
    valkey://...  valkeys://...                     the same as redis:// and rediss://
    unix://[user[:password]@]/path/to/socket[?db=N]
    host[:port][/db]                                a bare address, treated as redis://
    redis+cluster://[user[:password]@]host:port[,host:port...]   a Redis Cluster, by seed nodes
    valkey+cluster://...                            the same
    rediss+cluster://...  valkeys+cluster://...     a cluster over TLS

A cluster address lists one or more seed nodes (any nodes of the cluster: the client learns
the rest from them; IPv6 hosts in brackets); a cluster has database 0 only.

User and password are percent-decoded. ``db`` may also be given as a ``?db=N`` query parameter
(``?password=`` and ``?username=`` too, as redis-py accepts them). Every malformed address raises
:class:`~kvredis.errors.ConfigError` naming it, with any password masked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from kvredis.errors import ConfigError

DEFAULT_PORT = 6379

#: URL scheme -> (transport, tls)
_SCHEMES: dict[str, tuple[str, bool]] = {
    "redis": ("tcp", False),
    "valkey": ("tcp", False),
    "rediss": ("tcp", True),
    "valkeys": ("tcp", True),
    "unix": ("unix", False),
    "redis+cluster": ("tcp", False),
    "valkey+cluster": ("tcp", False),
    "rediss+cluster": ("tcp", True),
    "valkeys+cluster": ("tcp", True),
}
#: The suffix of the schemes of cluster addresses.
CLUSTER_SUFFIX = "+cluster"

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_QUERY_PASSWORD_RE = re.compile(r"([?&]password=)([^&#]*)")


@dataclass(frozen=True, slots=True)
class RedisAddress:
    """A parsed server address.

    ``transport`` is ``"tcp"`` (with ``host`` and ``port``) or ``"unix"`` (with ``path``).
    ``display`` is the address as given with the password masked, for logs and error messages.
    ``cluster`` tells a Redis Cluster address (``redis+cluster://`` ...), whose ``seeds`` are the
    ``(host, port)`` nodes it lists, in order (``host`` and ``port`` are the first of them); a
    single-server TCP address has itself as its one seed, a unix socket none.
    """

    transport: str
    host: str
    port: int
    path: str
    tls: bool
    username: str | None
    password: str | None
    db: int
    display: str
    cluster: bool = False
    seeds: tuple[tuple[str, int], ...] = ()


def mask_password(address: str) -> str:
    """``address`` with its password (``scheme://user:password@`` or ``?password=``) as ``***``.

    The user part runs from ``//`` to the LAST ``@`` of the address, whatever it holds: a
    password with a raw ``@``, ``/``, ``?`` or ``#`` is masked whole even though such an
    address does not parse. The user name before the first ``:`` stays; without a ``:``, the
    part is kept as a user name unless it holds ``/``, ``?`` or ``#`` (then it is masked).
    """
    text = _QUERY_PASSWORD_RE.sub(r"\1***", address)
    match = _SCHEME_RE.match(text)
    start = match.end() if match else 0
    at = text.rfind("@", start)
    if at < 0:
        return text
    user, colon, _password = text[start:at].partition(":")
    if colon:
        return f"{text[:start]}{user}:***{text[at:]}"
    if any(c in user for c in "/?#"):
        return f"{text[:start]}***{text[at:]}"
    return text


def _check_userinfo(text: str, start: int, shown: str) -> None:
    """Refuse a user part holding a raw ``/``, ``?`` or ``#`` (it would be read as the path,
    query or fragment, and the password as the host)."""
    text = _QUERY_PASSWORD_RE.sub(r"\1", text)  # a query password may hold "@"
    at = text.rfind("@", start)
    if at >= 0 and any(c in text[start:at] for c in "/?#"):
        raise ConfigError(
            f"address {shown!r}: the user name or password holds a raw '/', '?' or '#': "
            "percent-encode it (%2F, %3F, %23) or pass the password apart from the address "
            "(the password setting; KVREDIS_REDIS_PASSWORD or --password-file FILE for the "
            "kvredis command line)"
        )


def _parse_db(text: str, shown: str) -> int:
    if not text.isdigit():
        raise ConfigError(
            f"address {shown!r}: database must be a non-negative integer, got {text!r}"
        )
    return int(text)


def parse_address(address: str) -> RedisAddress:
    """Parse a Redis/Valkey address (see the module docstring for the accepted forms)."""
    if not isinstance(address, str):
        raise ConfigError(f"address must be a str, got {type(address).__name__}")
    text = address.strip()
    shown = mask_password(text)
    if not text:
        raise ConfigError("address is empty: expected e.g. redis://127.0.0.1:6379")
    match = _SCHEME_RE.match(text)
    if match is None:
        text = "redis://" + text
        scheme = "redis"
    else:
        scheme = match.group(1).lower()
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"address {shown!r}: unsupported scheme {scheme!r}; use redis://, rediss://, "
            "valkey://, valkeys://, unix://, a bare host:port, or redis+cluster:// (valkey+, "
            "rediss+, valkeys+cluster://) for a cluster"
        )
    transport, tls = _SCHEMES[scheme]
    cluster = scheme.endswith(CLUSTER_SUFFIX)
    start = text.index("://") + 3
    _check_userinfo(text, start, shown)
    end = min((i for i in map(text.find, "/?#", (start,) * 3) if i >= 0), default=len(text))
    userinfo, at, hosts = text[start:end].rpartition("@")
    if "," in hosts and not cluster:
        raise ConfigError(
            f"address {shown!r} lists several hosts: a Redis Cluster address starts with "
            "redis+cluster:// (or valkey+cluster://, rediss+cluster://, valkeys+cluster://)"
        )
    seeds = _seeds(hosts, shown) if cluster else ()
    if cluster:  # parse the rest as the address of the first seed
        host0, port0 = seeds[0]
        first = f"[{host0}]:{port0}" if ":" in host0 else f"{host0}:{port0}"
        text = f"{text[:start]}{userinfo}{at}{first}{text[end:]}"
    try:
        parts = urlsplit(text)
        port_value = parts.port
    except ValueError as exc:
        raise ConfigError(f"address {shown!r}: {exc}") from exc
    if parts.fragment:
        raise ConfigError(f"address {shown!r}: unexpected fragment {parts.fragment!r}")
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ConfigError(f"address {shown!r}: malformed query {parts.query!r}") from exc
    unknown = sorted(set(query) - {"db", "password", "username"})
    if unknown:
        raise ConfigError(
            f"address {shown!r}: unsupported query parameters {', '.join(unknown)} "
            "(only db, username and password are understood)"
        )
    for name, values in query.items():
        if len(values) != 1:
            raise ConfigError(f"address {shown!r}: query parameter {name!r} given more than once")

    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if "username" in query:
        username = query["username"][0] or None
    if "password" in query:
        password = query["password"][0]
    if password == "":
        password = None

    db: int | None = None
    if "db" in query:
        db = _parse_db(query["db"][0], shown)

    if transport == "unix":
        path = unquote(parts.path)
        if not path:
            raise ConfigError(
                f"address {shown!r}: unix:// needs a socket path, e.g. unix:///run/redis.sock"
            )
        if parts.hostname:
            raise ConfigError(
                f"address {shown!r}: unix:// takes no host; write unix:///absolute/path.sock"
            )
        return RedisAddress("unix", "", 0, path, False, username, password, db or 0, shown)

    host = parts.hostname
    if not host:
        raise ConfigError(f"address {shown!r}: missing host, expected e.g. redis://127.0.0.1:6379")
    port = DEFAULT_PORT if port_value is None else port_value
    if not 0 < port < 65536:
        raise ConfigError(f"address {shown!r}: port must be in 1..65535, got {port}")
    path_db = parts.path.strip("/")
    if path_db:
        if "/" in path_db:
            raise ConfigError(f"address {shown!r}: the path must be a database number only")
        parsed = _parse_db(path_db, shown)
        if db is not None and db != parsed:
            raise ConfigError(f"address {shown!r}: database given twice ({parsed} and {db})")
        db = parsed
    if cluster and db:
        raise ConfigError(
            f"address {shown!r}: a Redis Cluster has database 0 only, got database {db}"
        )
    return RedisAddress(
        "tcp", host, port, "", tls, username, password, db or 0, shown, cluster,
        seeds or ((host, port),),
    )  # fmt: skip


def _seeds(hosts: str, shown: str) -> tuple[tuple[str, int], ...]:
    """The ``host:port`` entries of a cluster address, in order, each once."""
    seeds: dict[tuple[str, int], None] = {}
    for entry in hosts.split(","):
        try:
            parts = urlsplit(f"//{entry.strip()}")
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"address {shown!r}: seed {entry!r}: {exc}") from exc
        if not parts.hostname:
            raise ConfigError(
                f"address {shown!r}: seed {entry!r} has no host; list the seed nodes as "
                "host:port,host:port"
            )
        port = DEFAULT_PORT if port is None else port
        if not 0 < port < 65536:
            raise ConfigError(f"address {shown!r}: port must be in 1..65535, got {port}")
        seeds[(parts.hostname, port)] = None
    return tuple(seeds)

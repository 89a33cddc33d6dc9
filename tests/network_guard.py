"""The suite's network guard: nothing a test runs may connect beyond loopback.

Installed for the whole session by ``tests/conftest.py``. Every outgoing connection is checked
before it is made: Python sockets (``socket.socket.connect``/``connect_ex``, which redis-py,
asyncio and ``socket.create_connection`` go through) and ZMQ endpoints
(``zmq.Socket.connect``, checked before libzmq sees them). A destination that is not a loopback
address (127.0.0.0/8, ::1, ``localhost``) raises :class:`NonLoopbackConnectionError` where the
connection was attempted, and is recorded, so the test fails even when the code under test
catches the error and retries (an ingester reconnecting, a client's retry loop).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from typing import Any

#: hosts accepted without an IP literal
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class NonLoopbackConnectionError(ConnectionRefusedError):
    """A test tried to connect to an address that is not on loopback."""


_violations: list[str] = []
_lock = threading.Lock()
_installed: dict[str, Any] = {}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, bracketed IPv6 allowed, or a name) is loopback."""
    host = host.strip("[]").split("%", 1)[0]
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # any other name would need a lookup: refused, tests use loopback literals
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _refuse(what: str) -> None:
    message = f"a test connected beyond loopback: {what}"
    with _lock:
        _violations.append(message)
    raise NonLoopbackConnectionError(message)


def check_socket_address(family: int, address: Any) -> None:
    """Refuse an AF_INET/AF_INET6 destination that is not loopback (others pass: AF_UNIX...)."""
    inet = family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple)
    if inet and address and not is_loopback(str(address[0])):
        _refuse(f"socket connect to {address[0]}:{address[1] if len(address) > 1 else ''}")


def check_zmq_endpoint(endpoint: str) -> None:
    """Refuse a ``tcp://``/``udp://``/``ws://`` ZMQ endpoint whose host is not loopback."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme in ("ipc", "inproc"):
        return
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.rsplit(";", 1)[-1]  # "source;destination": the destination counts
    if not is_loopback(host):
        _refuse(f"ZMQ connect to {endpoint}")


def install() -> None:
    """Patch the connect calls (idempotent)."""
    if _installed:
        return
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex

    def connect(self: socket.socket, address: Any) -> None:
        check_socket_address(self.family, address)
        original_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        check_socket_address(self.family, address)
        return original_connect_ex(self, address)

    _installed["connect"] = original_connect
    _installed["connect_ex"] = original_connect_ex
    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
    try:
        import zmq
    except ImportError:  # pragma: no cover - pyzmq is a dependency
        return
    original_zmq_connect = zmq.Socket.connect

    def zmq_connect(self: Any, addr: str) -> Any:
        check_zmq_endpoint(addr if isinstance(addr, str) else bytes(addr).decode())
        return original_zmq_connect(self, addr)

    _installed["zmq_connect"] = original_zmq_connect
    zmq.Socket.connect = zmq_connect


def take_violations() -> list[str]:
    """The violations recorded since the last call (and forget them)."""
    with _lock:
        found = list(_violations)
        _violations.clear()
    return found

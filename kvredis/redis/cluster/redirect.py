"""MOVED and ASK error replies as typed values.

A cluster node answers a command for a key in a slot it does not serve with

- ``MOVED <slot> <host>:<port>``: the slot belongs to that node now (refresh the slot map and
  send the command there);
- ``ASK <slot> <host>:<port>``: the slot is being migrated and this key is already at that
  node (send ``ASKING`` and then the command there, once; the slot map stays as it is).

The host may be empty (``MOVED 3999 :6381``): the node does not know its own address and means
the host of the node that replied. IPv6 hosts come bare (``MOVED 3999 ::1:6381``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvredis.redis.cluster.slots import SLOT_COUNT


class RedirectKind(enum.Enum):
    """Which redirection a node answered."""

    MOVED = "MOVED"
    ASK = "ASK"


@dataclass(frozen=True, slots=True)
class Redirect:
    """A MOVED or ASK reply: ``slot`` is served by ``host:port`` (``host`` empty: the host of
    the node that replied)."""

    kind: RedirectKind
    slot: int
    host: str
    port: int

    def address(self, replied_host: str) -> tuple[str, int]:
        """``(host, port)`` to send to, given the host of the node that replied."""
        return (self.host or replied_host, self.port)


def parse_redirect(message: str | bytes) -> Redirect | None:
    """The redirection an error reply stands for, or None if it is no (well-formed) MOVED or
    ASK reply."""
    text = message.decode("utf-8", "replace") if isinstance(message, bytes) else message
    parts = text.split()
    if len(parts) != 3:
        return None
    code, slot, address = parts
    try:
        kind = RedirectKind(code)
    except ValueError:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not slot.isdigit() or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    slot_number, port_number = int(slot), int(port)
    if not 0 <= slot_number < SLOT_COUNT or not 0 < port_number < 65536:
        return None
    return Redirect(kind, slot_number, host, port_number)

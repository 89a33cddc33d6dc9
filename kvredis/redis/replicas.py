"""Reads from replicas of a single server: which replicas there are, and where each read goes.

With ``read_from_replicas`` an executor sends the requests marked ``read`` (the ``lookup`` and
``score`` script calls, and the ``SCRIPT LOAD`` of such a call after ``NOSCRIPT``) to the online
replicas of the server it is configured with (the primary), one replica after the other;
everything else (writes, namespace loading, watermarks, ``get_request_key``) goes to the
primary. The logic lives here, without I/O, once for the sync and the asyncio executor:

- :func:`parse_replicas`: the online replicas listed by the primary's ``INFO replication``
  (``slave<N>:ip=...,port=...,state=online,...,lag=...``), at the address each replica
  announces (``replica-announce-ip``/``-port`` where set, else the address the primary sees);
- :class:`ReplicaSet`: the replicas known, when to ask the primary again (every
  :data:`REFRESH_SECONDS`, and soon after a replica fails), round-robin choice, and failed
  replicas set aside for :data:`DOWN_SECONDS`;
- :class:`ReadRoute`: the route of one operation's reads. Its :meth:`~ReadRoute.route`
  generator yields ``(server, command)`` pairs (``None`` for the primary) and receives each
  outcome: the reply, or the :class:`~kvredis.redis.requests.Failure` the executor maps the
  exception to. A replica that fails (connection lost or refused, ``LOADING``, ``MASTERDOWN``,
  ``BUSY`` ...) is set aside and the read goes to the primary; so does a read the replica
  answers ``KVREDIS_STALE`` (it has not caught up with the namespace the client loaded from the
  primary). A read never fails because of a replica while the primary answers.

Every read of one operation goes to the same server (a script loaded after ``NOSCRIPT`` must
reach the server that lacked it, and a chain walked in parts sees one server's data). A replica
answers after its replication lag: it may miss writes the primary acknowledged moments ago.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

from kvredis.redis.requests import Command, ConnectionLost, ErrorReply, Failure
from kvredis.redis.scripts import Missing, missing_callee

logger = logging.getLogger(__name__)

#: Seconds between two ``INFO replication`` questions to the primary.
REFRESH_SECONDS = 5.0
#: Seconds a failed replica gets no reads (unless the primary lists it again after that).
DOWN_SECONDS = 5.0
#: After a replica fails, the primary is asked again at the next read, but at most this often.
MIN_REFRESH_SECONDS = 1.0
#: A replica whose last acknowledgement to the primary (``lag``, in seconds; a replica
#: acknowledges every second) is older than this is left out: its link is stuck.
MAX_LAG_SECONDS = 10
#: Error replies of a replica that cannot serve now: it loads a dataset, lost its primary (with
#: ``replica-serve-stale-data no``), runs a long script, or refuses the call.
UNAVAILABLE_REPLIES = frozenset({"LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN", "READONLY"})
#: The error reply of a server that does not hold the namespace generation the client loaded.
STALE_REPLY = "KVREDIS_STALE"
#: The command that lists the replicas of a primary.
DISCOVER = Command(("INFO", "replication"))

_REPLICA_FIELD = re.compile(r"^slave(\d+)$")


@dataclass(frozen=True, slots=True)
class Replica:
    """A replica, at the address it announces to its primary."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _fields(value: Any) -> dict[str, str]:
    """``ip=...,port=...`` (text, or a mapping as redis-py parses it) as a str mapping."""
    if isinstance(value, Mapping):
        return {_text(k): _text(v) for k, v in value.items()}
    pairs = (part.partition("=") for part in _text(value).split(","))
    return {name.strip(): v.strip() for name, _, v in pairs}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def parse_replicas(info: Any) -> list[Replica]:
    """The online replicas an ``INFO replication`` reply lists, in the primary's order.

    ``info`` is the reply as redis-py parses it (a mapping, ``slave0`` -> a mapping of its
    fields) or its text. Replicas whose ``state`` is not ``online`` (still syncing) or whose
    ``lag`` exceeds :data:`MAX_LAG_SECONDS` are left out.
    """
    found: dict[int, Any] = {}
    if isinstance(info, Mapping):
        for key, value in info.items():
            match = _REPLICA_FIELD.match(_text(key))
            if match:
                found[int(match.group(1))] = value
    elif isinstance(info, (bytes, str)):
        for line in _text(info).splitlines():
            name, _, value = line.strip().partition(":")
            match = _REPLICA_FIELD.match(name)
            if match:
                found[int(match.group(1))] = value
    replicas = []
    for _, value in sorted(found.items()):
        fields = _fields(value)
        if fields.get("state") != "online" or not fields.get("ip"):
            continue
        try:
            port = int(fields.get("port", ""))
            lag = int(fields.get("lag", "0"))
        except ValueError:
            continue
        if lag <= MAX_LAG_SECONDS:
            replicas.append(Replica(fields["ip"], port))
    return replicas


class ReplicaSet:
    """The replicas of one primary that reads may go to; thread-safe.

    ``clock`` (seconds, monotonic) is injected so tests step it.
    """

    def __init__(
        self,
        refresh_seconds: float = REFRESH_SECONDS,
        down_seconds: float = DOWN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        spread: bool = False,
    ) -> None:
        #: whether the primary takes its turn with the replicas (``read_from_replicas="spread"``)
        self.spread = spread
        self.refresh_seconds = refresh_seconds
        self.down_seconds = down_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._replicas: tuple[Replica, ...] = ()
        self._down: dict[Replica, float] = {}
        self._next_refresh = float("-inf")
        self._last_refresh = float("-inf")
        self._turn = 0
        self._refused = False

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The online replicas the primary listed last time it was asked."""
        return self._replicas

    def claim_refresh(self) -> bool:
        """Whether the primary is due to be asked again; the caller that gets True asks it (and
        calls :meth:`update`), the others go on with the replicas known."""
        with self._lock:
            now = self._clock()
            if now < self._next_refresh:
                return False
            self._next_refresh = now + self.refresh_seconds
            self._last_refresh = now
            return True

    def update(self, reply: Any) -> None:
        """Adopt the primary's ``INFO replication`` reply (or the failure that came instead).

        A lost connection keeps the replicas known (the primary may be the one that is down);
        an error reply (``INFO`` not permitted) leaves none, so reads go to the primary.
        """
        if isinstance(reply, ConnectionLost):
            return
        replicas: tuple[Replica, ...] = ()
        if not isinstance(reply, Failure):
            replicas = tuple(parse_replicas(reply))
        elif not self._refused:
            logger.warning("cannot list the replicas (%s); reading from the primary", reply)
        with self._lock:
            self._refused = isinstance(reply, Failure)
            if replicas != self._replicas:
                logger.info("reading from replicas: %s", ", ".join(map(str, replicas)) or "none")
            self._replicas = replicas
            now = self._clock()
            self._down = {r: until for r, until in self._down.items() if until > now}

    def pick(self) -> Replica | None:
        """The next replica in turn that is not set aside, or None (read from the primary);
        with :attr:`spread` the primary (None) takes its turn with them."""
        with self._lock:
            now = self._clock()
            live: list[Replica | None] = [
                r for r in self._replicas if self._down.get(r, now) <= now
            ]
            if self.spread:
                live.append(None)
            if not live:
                return None
            self._turn += 1
            return live[self._turn % len(live)]

    def failed(self, replica: Replica, failure: Failure) -> None:
        """Set ``replica`` aside for :attr:`down_seconds`, and ask the primary again soon."""
        logger.warning(
            "replica %s failed (%s); its reads go elsewhere for %gs",
            replica,
            failure.message,
            self.down_seconds,
        )
        with self._lock:
            now = self._clock()
            self._down[replica] = now + self.down_seconds
            soon = max(now, self._last_refresh + MIN_REFRESH_SECONDS)
            self._next_refresh = min(self._next_refresh, soon)


def unavailable(outcome: Any) -> bool:
    """Whether a replica's outcome says it cannot serve (the read goes elsewhere)."""
    if isinstance(outcome, ErrorReply):
        return outcome.code in UNAVAILABLE_REPLIES
    return isinstance(outcome, Failure)


def behind(outcome: Any) -> bool:
    """Whether a replica answered that it does not hold what the primary does: the client's
    namespace generation, or the function library (or its release) the client calls, which a
    replica gets only by replication (it refuses ``FUNCTION LOAD``), so a read arriving just
    after a load finds it missing."""
    if not isinstance(outcome, ErrorReply):
        return False
    return outcome.code == STALE_REPLY or missing_callee(outcome) in _REPLICATED_CALLEES


_REPLICATED_CALLEES = (Missing.FUNCTION, Missing.VERSION)


#: What :meth:`ReadRoute.route` yields: the server (None for the primary) and the command.
Send = tuple[Replica | None, Command]


class ReadRoute:
    """Where the reads of one operation go: the replica picked for its first read, and every
    later read of it too, until that replica fails; then the primary."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self._set = replicas
        self._target: Replica | None = None
        self._picked = False

    def route(self, command: Command) -> Generator[Send, Any, Any]:
        """Send ``command``: yields ``(server, command)`` and receives the outcome (a reply or
        a Failure value); returns the outcome the operation gets."""
        if not command.read:
            return (yield None, command)
        if not self._picked:
            self._picked = True
            if self._set.claim_refresh():
                self._set.update((yield None, DISCOVER))
            self._target = self._set.pick()
        target = self._target
        if target is None:
            return (yield None, command)
        outcome = yield target, command
        if unavailable(outcome):
            self._set.failed(target, outcome)
        elif not behind(outcome):
            return outcome
        self._target = None
        return (yield None, command)

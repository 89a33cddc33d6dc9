"""The client's side of stamps (``lua/includes/stamps.lua``): what keeps a read in parts true.

A chain longer than one script call is looked up or scored in several calls, and writes come
between them. Each call returns, for the pods it read, a stamp: the pod's removal version and
the earliest deadline of its expiring entries the call returned. The next call of the chain
carries the stamps back; the server answers, per pod, whether its stamp still holds. A pod
whose stamp broke lost an entry since an earlier part read it (an evict, a clear, an expiring
entry past its deadline): its entries are dropped from that part on, so the merged read never
credits a pod with more than it held at one instant. Stamps are opaque to clients: a client
only carries them. No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvredis.redis.codec import bytes_text
from kvredis.redis.requests import Arg


class StampBook:
    """The stamps one read in parts carries from call to call (one per namespace: a cluster
    read keeps one per shard)."""

    __slots__ = ("dropped", "gen", "stamps")

    def __init__(self) -> None:
        #: pod id -> the stamp the latest part gave (``b""``: none; it breaks at the next part)
        self.stamps: dict[bytes, bytes] = {}
        #: the pods whose stamps broke: their entries count up to the part before
        self.dropped: set[str] = set()
        #: the namespace generation the stamps were read in (a recreated namespace breaks them)
        self.gen: bytes | None = None

    def bind(self, gen: bytes) -> None:
        """Use the book with a namespace of generation ``gen``: the stamps of an earlier
        generation (the namespace was recreated) all break."""
        if self.gen is not None and gen != self.gen:
            self.dropped.update(bytes_text(pod) for pod in self.stamps)
            self.stamps.clear()
        self.gen = gen

    def args(self) -> list[Arg]:
        """``c`` and ``c`` (pod id, stamp) pairs, as a lookup call takes them."""
        flat: list[Arg] = [len(self.stamps)]
        for pod, stamp in self.stamps.items():
            flat += (pod, stamp)
        return flat

    def take(self, flat: Sequence[Any]) -> None:
        """Take in the stamps part of a reply: flat (pod id, stamp). A carried pod answered
        ``""`` is dropped; a pod already dropped stays dropped."""
        stamps, dropped = self.stamps, self.dropped
        for i in range(0, len(flat) - 1, 2):
            pod, stamp = bytes(flat[i]), bytes(flat[i + 1])
            if pod in stamps and not stamp:
                del stamps[pod]
                dropped.add(bytes_text(pod))
            elif bytes_text(pod) not in dropped:
                stamps[pod] = stamp

    def drop_all(self) -> None:
        """Break every stamp (a part that cannot be checked)."""
        self.dropped.update(bytes_text(pod) for pod in self.stamps)
        self.stamps.clear()

"""What one client knows about its namespace: the loaded layout and the entry dictionary.

Both are replaced together when the namespace's generation changes (see
:mod:`kvredis.redis.layout`); an operation takes one :meth:`CoreState.snapshot` and uses that
pair to the end, so a reply is always decoded with the dictionary of the generation it was
produced under.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvredis.errors import (
    BackendError,
    InvalidInputError,
    NamespaceLayoutError,
    StaleNamespaceError,
)
from kvredis.redis.codec import ID_WIDTH, decode_entry
from kvredis.redis.layout import (
    DEFAULT_BUCKET_BITS,
    EXPIRY_KEY,
    LAYOUT_VERSION,
    Layout,
    check_bucket_bits,
    check_namespace,
)
from kvredis.types import PodEntry

logger = logging.getLogger(__name__)


class EntryCache:
    """Thread-safe id -> PodEntry dictionary of one client, filled from lookup replies.

    Entry ids are allocated in increasing order and never reused within a namespace generation,
    so cached definitions stay valid as long as the generation (a new generation gets a new
    cache).
    An id whose definition was reclaimed (its pod was cleared: ``lua/reclaim.lua``) is known
    as such and left out of the entries (a key holding nothing else is no hit). ``floor`` is
    the highest id up to which every definition is known; lookups send it, and the server
    returns the definitions of the next ids (a bounded number per call) and of any hit id
    above them, so a client soon knows the whole dictionary and replies carry no definitions.
    """

    _MAX_LISTS = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._defs: dict[bytes, PodEntry | None] = {}
        self._lists: dict[bytes, tuple[PodEntry, ...]] = {}
        self.floor = 0

    def learn(self, flat: Sequence[bytes], floor: int) -> None:
        """Record definitions given as a flat ``id, encoded entry, ...`` sequence.

        ``floor`` is the id up to which the server has now sent every definition that exists.
        """
        decoded: dict[bytes, PodEntry | None] = {}
        for i in range(0, len(flat), 2):
            enc = bytes(flat[i + 1])
            # an empty definition: the id's entry was reclaimed (its pod cleared), skip it
            decoded[bytes(flat[i])] = decode_entry(enc) if enc else None
        with self._lock:
            self._defs.update(decoded)
            self.floor = max(self.floor, floor)

    def entries(self, ids: bytes) -> list[PodEntry]:
        """The entries of an id list (raises StaleNamespaceError on an unknown id)."""
        return list(self.holders(ids))

    def holders(self, ids: bytes) -> tuple[PodEntry, ...]:
        """:meth:`entries` as the tuple this cache keeps for the id list (one object per list:
        do not change it)."""
        known = self._lists.get(ids)
        if known is None:
            defs = self._defs
            try:
                found = tuple(defs[ids[i : i + ID_WIDTH]] for i in range(0, len(ids), ID_WIDTH))
            except KeyError:
                raise StaleNamespaceError("entry id unknown to this client") from None
            # An entry is held once per key: where a clear racing an add left it under two
            # ids for a moment (the retired one and the new one), it counts once, at its
            # most recently added place.
            known = tuple(reversed(dict.fromkeys(e for e in reversed(found) if e is not None)))
            with self._lock:
                if len(self._lists) >= self._MAX_LISTS:
                    self._lists = {}
                self._lists[ids] = known
        return known


class CoreState:
    """The namespace of one client: its name, configured bucket bits, and what was loaded."""

    def __init__(self, namespace: str, bucket_bits: int = DEFAULT_BUCKET_BITS) -> None:
        self.namespace = check_namespace(namespace)
        self.bucket_bits = check_bucket_bits(bucket_bits)
        #: How a namespace this client creates expires its expiring entries (``"field"`` or
        #: ``"key"``: see :mod:`kvredis.redis.layout`), set from the server when connecting.
        self.expiry_mode = EXPIRY_KEY
        self._current: tuple[Layout, EntryCache] | None = None
        self._lock = threading.Lock()

    def snapshot(self) -> tuple[Layout, EntryCache]:
        """The loaded layout and the entry cache of its generation."""
        current = self._current
        if current is None:
            raise BackendError("namespace not loaded yet")
        return current

    @property
    def layout(self) -> Layout:
        """The loaded layout (after :func:`kvredis.redis.ops.op_load_namespace`)."""
        return self.snapshot()[0]

    @property
    def cache(self) -> EntryCache:
        """The entry cache of the loaded generation."""
        return self.snapshot()[1]

    @property
    def loaded(self) -> bool:
        """Whether a layout was loaded."""
        return self._current is not None

    def adopt(self, reply: Sequence[Any]) -> Layout:
        """Take over the namespace record returned by the ``namespace`` script."""
        if not isinstance(reply, (list, tuple)) or len(reply) != 3 or not all(reply):
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} has an incomplete meta record {reply!r}; "
                "delete its keys or use another namespace"
            )
        version, bits_raw, gen = (bytes(v) for v in reply)
        if version.decode("utf-8", "replace") != LAYOUT_VERSION:
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} holds layout {version!r}, this client writes "
                f"{LAYOUT_VERSION!r}; use another namespace, or drop this one (drop_namespace(), "
                "`kvredis drop`) and ingest again"
            )
        try:
            bits = check_bucket_bits(int(bits_raw))
        except (ValueError, InvalidInputError) as exc:
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} has invalid bucket bits {bits_raw!r}"
            ) from exc
        if bits != self.bucket_bits:
            logger.info(
                "namespace %r was created with %d bucket bits; using them (configured %d)",
                self.namespace,
                bits,
                self.bucket_bits,
            )
        with self._lock:
            current = self._current
            if current is None or current[0].gen != gen or current[0].bucket_bits != bits:
                current = self._current = (Layout(self.namespace, bits, gen), EntryCache())
            return current[0]

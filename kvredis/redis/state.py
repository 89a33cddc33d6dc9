"""What one client knows about its namespace: the loaded layout and the entry dictionary.

Both are replaced together when the namespace's generation changes (see
:mod:`kvredis.redis.layout`); an operation takes one :meth:`CoreState.snapshot` and uses that
pair to the end, so a reply is always decoded with the dictionary of the generation it was
produced under.
"""

from __future__ import annotations

import logging
import shlex
import threading
from collections.abc import Sequence
from typing import Any

from kvredis.errors import (
    BackendError,
    BlockKeySchemeError,
    InvalidInputError,
    NamespaceLayoutError,
    NamespaceMissingError,
    StaleNamespaceError,
)
from kvredis.hashing.config import BlockKeyScheme
from kvredis.redis.codec import ID_WIDTH, decode_entry
from kvredis.redis.layout import (
    DEFAULT_BUCKET_BITS,
    EXPIRY_KEY,
    LAYOUT_FAMILY,
    LAYOUT_VERSION,
    MIGRATABLE_LAYOUTS,
    Layout,
    check_bucket_bits,
    check_namespace,
)
from kvredis.types import PodEntry

logger = logging.getLogger(__name__)


def _text(value: object) -> str:
    """A stored value as text for a message (bytes decoded, never a ``b'...'`` repr)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return str(value)


def _target(namespace: str, address: str | None) -> str:
    return f"--redis {shlex.quote(address) if address else 'URL'} {shlex.quote(namespace)}"


def migrate_command(namespace: str, address: str | None = None) -> str:
    """The command line that converts ``namespace`` to this kvredis's layout."""
    return f"`kvredis migrate {_target(namespace, address)}`"


def drop_command(namespace: str, address: str | None = None) -> str:
    """The command line that deletes ``namespace`` whatever its layout."""
    return f"`kvredis drop {_target(namespace, address)} --yes`"


#: Words of a reply refusing a command to the ACL user (a command, or one a script ran).
_REFUSALS = ("NOPERM", "no permissions", "can't run this command")


def refused_by_acl(message: str) -> bool:
    """Whether an error reply says the ACL user may not run what was sent."""
    return any(word in message for word in _REFUSALS)


def namespace_missing_error(state: CoreState, refusal: str | None) -> NamespaceMissingError:
    """The error of a client that found no namespace and may not, or would not, create it:
    ``refusal`` is the server's reply to the create (``None``: it waited in vain)."""
    where = f" at {state.address}" if state.address else ""
    head = f"namespace {state.namespace!r} does not exist yet{where}"
    if refusal is None:
        return NamespaceMissingError(
            f"{head}: it did not appear within wait_for_namespace={state.wait_for_namespace:g} s; "
            "an ingester (kvredis ingest) or kvredis restore creates it: check that one runs "
            "with this namespace"
        )
    return NamespaceMissingError(
        f"{head}, and this client may not create it (its ACL user only reads: "
        f"{refusal.splitlines()[0][:160]}); an ingester (kvredis ingest) or kvredis restore "
        "creates it. Start one first, or let this client wait for it: RedisIndexConfig("
        "wait_for_namespace=SECONDS) (JSON waitForNamespace)"
    )


def layout_number(version: str) -> int | None:
    """The number of a ``kvredis-kvblock/<n>`` layout version, ``None`` for any other text."""
    if not version.startswith(LAYOUT_FAMILY):
        return None
    number = version[len(LAYOUT_FAMILY) :]
    return int(number) if number.isdigit() and number.isascii() else None


def layout_error(
    namespace: str, found: bytes | str, address: str | None = None
) -> NamespaceLayoutError:
    """The error for a namespace whose meta record names layout ``found``: what it is, and the
    one command that fixes it (``kvredis migrate`` for an earlier layout, an upgrade of kvredis
    for a later one, ``kvredis drop`` for anything else)."""
    version = _text(found)
    ns = repr(namespace)
    number, ours = layout_number(version), layout_number(LAYOUT_VERSION)
    if version in MIGRATABLE_LAYOUTS:
        return NamespaceLayoutError(
            f"namespace {ns} is in layout {version}, this kvredis reads {LAYOUT_VERSION}: "
            f"convert it with {migrate_command(namespace, address)} (or drop it: "
            f"{drop_command(namespace, address)})"
        )
    if number is not None and ours is not None and number > ours:
        return NamespaceLayoutError(
            f"namespace {ns} is in layout {version}, written by a newer kvredis (this one reads "
            f"{LAYOUT_VERSION}): upgrade kvredis to a version that reads layout {version}"
        )
    if number is not None:
        return NamespaceLayoutError(
            f"namespace {ns} is in layout {version}, which this kvredis cannot convert (it "
            f"reads {LAYOUT_VERSION} and converts {', '.join(MIGRATABLE_LAYOUTS)}): drop it "
            f"with {drop_command(namespace, address)} and ingest again"
        )
    return NamespaceLayoutError(
        f"namespace {ns} holds layout {version!r}, which is no kvredis layout (this kvredis "
        f"reads {LAYOUT_VERSION}; another program's keys?): use another namespace, or drop it "
        f"with {drop_command(namespace, address)}"
    )


def incomplete_meta_error(
    namespace: str, reply: object, address: str | None = None
) -> NamespaceLayoutError:
    """The error for a meta record without its layout, bucket bits or generation."""
    names = ("layout", "bucket_bits", "gen")
    if isinstance(reply, (list, tuple)) and len(reply) == len(names):
        shown = ", ".join(
            f"{n}={_text(v)!r}" if v else f"{n} missing" for n, v in zip(names, reply, strict=True)
        )
    else:
        shown = f"not a hash record ({_text(reply)!r})"
    return NamespaceLayoutError(
        f"namespace {namespace!r} has an incomplete meta record ({shown}): drop it with "
        f"{drop_command(namespace, address)}, or use another namespace"
    )


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
        #: The server's address as shown to people (password masked), for error messages.
        self.address: str | None = None
        #: Seconds a client that finds no namespace waits for its creator instead of creating
        #: it (``RedisIndexConfig.wait_for_namespace``; 0: create it).
        self.wait_for_namespace = 0.0
        #: The block key scheme this client computes keys with, once an Indexer or an ingester
        #: said so (:meth:`check_scheme` compares it with the namespace's at every load).
        self.scheme: BlockKeyScheme | None = None
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

    def check_scheme(self, recorded: bytes | str | None) -> BlockKeyScheme | None:
        """The block key scheme the namespace records (``None``: none yet), checked against
        :attr:`scheme`: :class:`~kvredis.errors.BlockKeySchemeError` naming both when they
        differ."""
        if recorded is None or recorded in (b"", ""):
            return None
        try:
            theirs = BlockKeyScheme.parse(recorded)
        except InvalidInputError as exc:
            raise NamespaceLayoutError(f"namespace {self.namespace!r}: {exc}") from None
        ours = self.scheme
        if ours is not None and theirs != ours:
            raise BlockKeySchemeError(
                f"namespace {self.namespace!r} holds block keys of scheme {theirs}, but this "
                f"client computes {ours}: its lookups and scores would all miss; configure the "
                "token processor as the namespace's writers do (hashAlgo, blockSizeTokens, "
                "hashSeed), or use another namespace"
            )
        return theirs

    def adopt(self, reply: Sequence[Any]) -> Layout:
        """Take over the namespace record returned by the ``namespace`` script."""
        if not isinstance(reply, (list, tuple)) or len(reply) != 3 or not all(reply):
            raise incomplete_meta_error(self.namespace, reply, self.address)
        version, bits_raw, gen = (bytes(v) for v in reply)
        if version.decode("utf-8", "replace") != LAYOUT_VERSION:
            raise layout_error(self.namespace, version, self.address)
        try:
            bits = check_bucket_bits(int(bits_raw))
        except (ValueError, InvalidInputError) as exc:
            raise NamespaceLayoutError(
                f"namespace {self.namespace!r} has invalid bucket bits "
                f"{_text(bits_raw)!r} in its meta record: drop it "
                f"({drop_command(self.namespace, self.address)})"
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

"""Byte encodings of the Redis layout: text, 64-bit hashes, pod entries, SCAN patterns.

- text: UTF-8 with lone surrogates kept (``surrogatepass``), so every ``str`` round-trips;
- hash: a 64-bit block hash as 8 big-endian bytes (field names of the bucket hashes);
- hash blob: many hashes concatenated, how the client passes a chain in one argument;
- entry id: a 4-byte big-endian unsigned integer; an id list is ids concatenated;
- entry: ``u32 len | pod id | u32 len | tier | u8 flags (1 speculative, 2 has_group, 4 has
  rank) | u32 group [| u32 dp rank]``, integers big-endian, strings as text above; the rank is
  written only when it is not 0 (flag 4), so an entry of rank 0 encodes as before ranks existed.

The Lua side reads the same encodings (``lua/includes/entries.lua``, ``lua/includes/layout.lua``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvredis.checks import check_hashes
from kvredis.errors import NamespaceLayoutError
from kvredis.types import PodEntry

#: Width of a hash and of an entry id (``lua/includes/layout.lua`` HASH_WIDTH, ID_WIDTH).
HASH_WIDTH = 8
ID_WIDTH = 4
_U32 = struct.Struct(">I")
_ENTRY_TAIL = struct.Struct(">BI")
_SPECULATIVE, _HAS_GROUP, _HAS_RANK = 1, 2, 4
_GLOB_SPECIAL = frozenset(b"*?[]\\")
_INT_ONLY = frozenset((int,))


def text_bytes(text: str) -> bytes:
    """The UTF-8 bytes of any ``str`` (lone surrogates kept, so every str round-trips)."""
    return text.encode("utf-8", "surrogatepass")


def bytes_text(data: bytes) -> str:
    """Inverse of :func:`text_bytes`."""
    return data.decode("utf-8", "surrogatepass")


def hash_field(value: int) -> bytes:
    """The 8-byte big-endian form of a 64-bit hash (field names in the bucket hashes)."""
    return value.to_bytes(HASH_WIDTH, "big")


def hash_blob(values: Sequence[int]) -> bytes:
    """Checked 64-bit hashes as one blob of 8-byte big-endian values (the form the scripts take
    key lists in)."""
    packer = _BLOBS.get(len(values))
    if packer is None:
        if len(values) > _BLOB_SIZES:
            return struct.pack(f">{len(values)}Q", *values)
        packer = _BLOBS[len(values)] = struct.Struct(f">{len(values)}Q")
    return packer.pack(*values)


_BLOB_SIZES = 4096
"""The lengths up to which :func:`hash_blob` keeps its packer (a call's key lists are shorter)."""
_BLOBS: dict[int, struct.Struct] = {}
""":func:`hash_blob`'s packer of each length met: a format parsed once, not on every call."""


def blob_hashes(blob: bytes | None) -> list[int]:
    """The hashes of a blob of 8-byte big-endian values (``None``: none), in order."""
    data = blob or b""
    return [
        int.from_bytes(data[i : i + HASH_WIDTH], "big") for i in range(0, len(data), HASH_WIDTH)
    ]


def pack_hashes(values: Sequence[int], what: str = "block hash") -> tuple[list[int], bytes]:
    """Validate 64-bit hashes and pack them as one blob of 8-byte big-endian values.

    Returns the hashes as a list of ints and the blob. Fast for plain ``int`` inputs; anything
    else goes through :func:`kvredis.checks.check_hashes` (same errors as every backend).
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        keys = check_hashes(values, what)
    elif _INT_ONLY.issuperset(map(type, values)):  # one pass, in C
        keys = values if isinstance(values, list) else list(values)
    else:
        keys = check_hashes(values, what)
    try:
        return keys, hash_blob(keys)
    except struct.error:
        check_hashes(keys, what)
        raise


def encode_entry(entry: PodEntry) -> bytes:
    """Unambiguous binary encoding of all six fields of a pod entry (see the module docstring)."""
    pod = text_bytes(entry.pod_identifier)
    tier = text_bytes(entry.device_tier)
    flags = (_SPECULATIVE if entry.speculative else 0) | (_HAS_GROUP if entry.has_group else 0)
    rank = entry.dp_rank
    return b"".join(
        (
            _U32.pack(len(pod)),
            pod,
            _U32.pack(len(tier)),
            tier,
            _ENTRY_TAIL.pack(flags | (_HAS_RANK if rank else 0), entry.group_idx),
            _U32.pack(rank) if rank else b"",
        )
    )


def decode_entry(data: bytes) -> PodEntry:
    """Inverse of :func:`encode_entry`; a malformed encoding raises NamespaceLayoutError."""
    try:
        (n,) = _U32.unpack_from(data, 0)
        pod = data[4 : 4 + n]
        (m,) = _U32.unpack_from(data, 4 + n)
        tier = data[8 + n : 8 + n + m]
        flags, group = _ENTRY_TAIL.unpack_from(data, 8 + n + m)
        end = 8 + n + m + _ENTRY_TAIL.size
        rank = 0
        if flags & _HAS_RANK:
            (rank,) = _U32.unpack_from(data, end)
            end += _U32.size
            if not rank:
                raise ValueError("rank flag with rank 0")
        if len(data) != end or len(pod) != n or len(tier) != m:
            raise ValueError("length mismatch")
        return PodEntry(
            bytes_text(pod),
            bytes_text(tier),
            bool(flags & _SPECULATIVE),
            bool(flags & _HAS_GROUP),
            group,
            rank,
        )
    except (struct.error, ValueError) as exc:
        raise NamespaceLayoutError(f"malformed pod entry encoding {data!r}: {exc}") from exc


def escape_glob(data: bytes) -> bytes:
    """``data`` with the glob characters of SCAN MATCH escaped (``* ? [ ] \\``)."""
    return bytes(b for c in data for b in ((92, c) if c in _GLOB_SPECIAL else (c,)))


#: Width of a run id (``lua/includes/runs.lua`` RUN_ID_WIDTH).
RUN_ID_WIDTH = 4
#: Width of a ref to a run position: u32 run id, u16 position (1-based). Id lists are multiples
#: of 4 bytes, so a request bucket value of this width is a ref.
REF_WIDTH = 6
_RANGE = struct.Struct(">HH")


def decode_ref(value: bytes) -> tuple[bytes, int]:
    """(run id, position) of a ref."""
    return value[:RUN_ID_WIDTH], int.from_bytes(value[RUN_ID_WIDTH:REF_WIDTH], "big")


def encode_ref(run_id: bytes, position: int) -> bytes:
    """The ref to position ``position`` of run ``run_id``."""
    return run_id + position.to_bytes(2, "big")


def decode_run(keys: bytes, ranges: bytes) -> list[tuple[bytes, bytes]]:
    """(request key, id list) per position of a run (``b""`` for a hole), from its fields ``k``
    (keys) and ``r`` (ranges: ``u16 last position | u16 count | ids``, see
    ``lua/includes/runs.lua``); raises NamespaceLayoutError on a malformed run."""
    out: list[tuple[bytes, bytes]] = []
    at = 0
    while at < len(ranges):
        if at + 4 > len(ranges):
            raise NamespaceLayoutError("run ranges cut short")
        last, count = _RANGE.unpack_from(ranges, at)
        ids = ranges[at + 4 : at + 4 + ID_WIDTH * count]
        at += 4 + ID_WIDTH * count
        if len(ids) != ID_WIDTH * count or last <= len(out) or last * HASH_WIDTH > len(keys):
            raise NamespaceLayoutError("run ranges out of order or past the keys")
        for pos in range(len(out), last):
            out.append((keys[pos * HASH_WIDTH : (pos + 1) * HASH_WIDTH], ids))
    if len(out) * HASH_WIDTH != len(keys) or not out or not out[-1][1]:
        raise NamespaceLayoutError("run ranges do not cover its keys, or end in a hole")
    return out


def encode_run(positions: Sequence[tuple[bytes, bytes]]) -> tuple[bytes, bytes]:
    """The fields ``k`` and ``r`` of a run holding ``positions`` (trailing holes cut off)."""
    kept = list(positions)
    while kept and not kept[-1][1]:
        kept.pop()
    ranges: list[bytes] = []
    for pos, (_key, ids) in enumerate(kept, 1):
        if pos < len(kept) and kept[pos][1] == ids:
            continue
        ranges.append(_RANGE.pack(pos, len(ids) // ID_WIDTH) + ids)
    return b"".join(k for k, _ in kept), b"".join(ranges)

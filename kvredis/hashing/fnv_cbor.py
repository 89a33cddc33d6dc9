"""The ``"fnv64a_cbor"`` scheme: FNV-1a-64 over canonical CBOR, byte-compatible with Go llm-d.

Byte layout. ``H(parent, tokens, extra) = FNV-1a-64(canonical CBOR of [parent, tokens, extra])``:
parent an unsigned integer, tokens an array of unsigned integers (``null`` for the root), extra
``null`` for text blocks, the model name (a text string) for the root, or an array of single-key
maps ``{"Hash": identifier}`` for a multimodal block. The root of a model is
``H(FNV-1a-64(utf8(hash_seed)), null, model_name)``; under a cache salt (non-empty) it is
``H(FNV-1a-64(utf8(hash_seed)), null, [model_name, cache_salt])`` (extra a two-element array of
text strings, which no unsalted root can encode), and every block key descends from it.
Integers use the shortest CBOR head; map keys are sorted shortest first, then bytewise
(RFC 7049 section 3.9, Go fxamacker/cbor's canonical mode). Block features with an empty
identifier list encode as ``null`` (like Go's zero-value ``BlockExtraFeatures``). The Go
upstream has no cache salt: salted roots are kvredis's extension, and unsalted keys stay
byte-compatible.

This scheme runs in pure Python and is much slower than ``"xxh3_64"``; text blocks stream their
CBOR bytes straight into FNV-1a instead of building them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvredis.errors import InvalidInputError

__all__ = ["FnvCborScheme", "cbor_encode", "fnv1a64"]

_MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def fnv1a64(data: bytes | bytearray, state: int = _FNV_OFFSET) -> int:
    """FNV-1a 64 of ``data``, continuing from ``state``."""
    prime = _FNV_PRIME
    mask = _MASK64
    for byte in data:
        state = ((state ^ byte) * prime) & mask
    return state


def _cbor_head(major: int, value: int) -> bytes:
    """Shortest CBOR head for ``major`` (0..7, unshifted) and argument ``value``."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value <= 0xFF:
        return bytes((mt | 24, value))
    if value <= 0xFFFF:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value <= 0xFFFFFFFF:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    return bytes((mt | 27,)) + value.to_bytes(8, "big")


def cbor_encode(obj: object, out: bytearray) -> None:
    """Append the canonical CBOR encoding (RFC 7049 section 3.9) of ``obj`` to ``out``.

    Supports what the block payloads hold: None, unsigned ints below 2**64, str, lists/tuples/
    arrays and str-keyed dicts (keys sorted shortest first, then bytewise, as Go's
    fxamacker/cbor canonical mode does).
    """
    if obj is None:
        out.append(0xF6)
    elif isinstance(obj, int) and not isinstance(obj, bool):
        if not 0 <= obj <= _MASK64:
            raise InvalidInputError(f"cannot CBOR-encode {obj}: not an unsigned 64-bit integer")
        out += _cbor_head(0, obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += _cbor_head(3, len(raw))
        out += raw
    elif isinstance(obj, (list, tuple, array)):
        out += _cbor_head(4, len(obj))
        for item in obj:
            cbor_encode(item, out)
    elif isinstance(obj, dict):
        entries: list[tuple[bytes, object]] = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise InvalidInputError(
                    f"cannot CBOR-encode a map key of type {type(key).__name__}"
                )
            encoded_key = bytearray()
            cbor_encode(key, encoded_key)
            entries.append((bytes(encoded_key), value))
        entries.sort(key=lambda e: (len(e[0]), e[0]))
        out += _cbor_head(5, len(entries))
        for key_bytes, value in entries:
            out += key_bytes
            cbor_encode(value, out)
    else:
        raise InvalidInputError(f"cannot CBOR-encode {type(obj).__name__}")


def _hash(parent: int, tokens: Sequence[int] | None, extra: object) -> int:
    """Generic ``FNV-1a-64(canonical CBOR [parent, tokens, extra])``."""
    buf = bytearray(b"\x83")
    cbor_encode(parent, buf)
    cbor_encode(None if tokens is None else list(tokens), buf)
    cbor_encode(extra, buf)
    return fnv1a64(buf)


_FNV_AFTER_ARRAY3 = fnv1a64(b"\x83")
_FNV_AFTER_ARRAY3_U64 = fnv1a64(b"\x83\x1b")


def _text_block(parent: int, tokens: Iterable[int], array_head: bytes) -> int:
    """``H(parent, tokens, null)``, streaming the CBOR bytes straight into FNV-1a.

    Each step is ``h = (h ^ byte) * prime``; reducing modulo 2**64 once per token (not per byte)
    gives the same result, because XOR with a byte and multiplication modulo 2**64 depend only
    on the low 64 bits of their operands.
    """
    p = _FNV_PRIME
    m = _MASK64
    # fmt: off
    if parent > 0xFFFFFFFF:  # the usual case: a 64-bit hash, head 0x1b + 8 bytes
        b = parent.to_bytes(8, "big")
        h = ((((_FNV_AFTER_ARRAY3_U64 ^ b[0]) * p ^ b[1]) * p ^ b[2]) * p ^ b[3]) * p
        h = ((((h ^ b[4]) * p ^ b[5]) * p ^ b[6]) * p ^ b[7]) * p & m
        for byte in array_head:
            h = (h ^ byte) * p & m
    else:
        h = fnv1a64(_cbor_head(0, parent) + array_head, _FNV_AFTER_ARRAY3)
    for t in tokens:
        if t > 0xFFFF:  # head 0x1a + 4 bytes
            h = (((((h ^ 0x1A) * p ^ (t >> 24)) * p ^ ((t >> 16) & 0xFF)) * p
                  ^ ((t >> 8) & 0xFF)) * p ^ (t & 0xFF)) * p & m
        elif t > 0xFF:  # head 0x19 + 2 bytes
            h = (((h ^ 0x19) * p ^ (t >> 8)) * p ^ (t & 0xFF)) * p & m
        elif t > 23:  # head 0x18 + 1 byte
            h = ((h ^ 0x18) * p ^ t) * p & m
        else:  # the value fits the head byte
            h = (h ^ t) * p & m
    # fmt: on
    return ((h ^ 0xF6) * p) & m


class FnvCborScheme:
    """Roots and chained block keys of the ``"fnv64a_cbor"`` scheme for one block size."""

    __slots__ = ("_array_head", "_block_size")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._array_head = _cbor_head(4, block_size)

    def root_key(self, hash_seed: bytes, model_name: str, cache_salt: str | None = None) -> int:
        """The root of ``model_name``'s chains, under ``cache_salt`` when it is not ``None``."""
        extra: object = model_name if cache_salt is None else [model_name, cache_salt]
        return _hash(fnv1a64(hash_seed), None, extra)

    def block_keys(
        self, parent: int, values: Sequence[int], identifiers: list[tuple[str, ...] | None] | None
    ) -> list[int]:
        """FNV-1a-64 of each full block's CBOR payload, chained from ``parent``."""
        bs = self._block_size
        array_head = self._array_head
        keys: list[int] = []
        p = parent
        for index in range(len(values) // bs):
            block = values[index * bs : (index + 1) * bs]
            ids = None if identifiers is None else identifiers[index]
            if ids is None:
                p = _text_block(p, block, array_head)
            else:
                p = _hash(p, block, [{"Hash": i} for i in ids])
            keys.append(p)
        return keys

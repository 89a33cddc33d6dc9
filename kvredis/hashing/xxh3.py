"""The ``"xxh3_64"`` scheme (the default, kvredis's own): chained XXH3-64.

Byte layout (all integers little-endian). ``u32(x)`` is 4 bytes little-endian, ``pad4(b)`` is
``b`` followed by 0-3 zero bytes up to a multiple of 4, ``utf8(s)`` the UTF-8 bytes of ``s``,
``XXH3(msg, seed)`` the 64-bit XXH3 digest.

* Root of a model: ``XXH3(R, seed=0)`` with
  ``R = pad4(b"KVRXXH3\\x01" + u32(block_size) + u32(len(S)) + S + u32(len(N)) + N) + b"RR"``
  where ``S = utf8(hash_seed)``, ``N = utf8(model_name)`` and ``len`` counts bytes.
  ``len(R) % 4 == 2``.
* Root of a model under a cache salt ``C = utf8(cache_salt)`` (non-empty): ``XXH3(R', seed=0)`` with
  ``R' = pad4(b"KVRXXH3\\x01" + u32(block_size) + u32(len(S)) + S + u32(len(N)) + N
  + u32(len(C)) + C) + b"RS"``. The trailer tells salted from unsalted roots apart (and a salt
  from a model-name suffix: every length is explicit), so a salted chain shares no key with an
  unsalted one or with one under another salt. The salt is mixed into the root only: every
  block key descends from it, which is how vLLM isolates salted prefixes (its salt enters the
  first block's hash only).
* Text block: ``XXH3(T, seed=parent)`` where ``T`` is the block's ``block_size`` token ids as
  ``u32`` each (``4 * block_size`` bytes, the raw little-endian token array, no framing).
  ``len(T) % 4 == 0``.
* Multimodal block with identifiers ``id_1 .. id_k`` (``k >= 1``):
  ``XXH3(T + pad4(E) + u32(k) + u32(block_size) + b"M", seed=parent)`` with
  ``E = u32(len(utf8(id_1))) + utf8(id_1) + ... + u32(len(utf8(id_k))) + utf8(id_k)``.
  Its length is ``1 (mod 4)``.

The three message kinds have different lengths modulo 4, and each one decodes uniquely (fixed
token part whose size follows from the length or from the trailer, explicit counts and lengths),
so distinct (parent, tokens, block size, identifiers) give distinct ``(seed, message)`` pairs,
and distinct (hash seed, model, block size) give distinct root messages. Block features with an
empty identifier list hash like a text block.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

from kvredis.hashing.tokens import le_bytes

__all__ = ["Xxh3Scheme"]

_ROOT_MAGIC = b"KVRXXH3\x01"
_U32 = struct.Struct("<I")
_MM_TRAILER = struct.Struct("<IIc")


def _pad4(buf: bytearray) -> None:
    buf.extend(b"\x00" * (-len(buf) % 4))


def _root(block_size: int, hash_seed: bytes, model_name: bytes, salt: bytes | None) -> int:
    msg = bytearray(_ROOT_MAGIC)
    msg += _U32.pack(block_size)
    msg += _U32.pack(len(hash_seed))
    msg += hash_seed
    msg += _U32.pack(len(model_name))
    msg += model_name
    if salt is not None:
        msg += _U32.pack(len(salt))
        msg += salt
    _pad4(msg)
    msg += b"RR" if salt is None else b"RS"
    return xxh3_64_intdigest(bytes(msg), 0)


def _mm_suffix(identifiers: Sequence[str], block_size: int) -> bytes:
    """What follows the token bytes in a multimodal block's message: ``pad4(E) + trailer``.

    The token part is a multiple of 4 bytes long, so padding ``E`` alone pads ``T + E``.
    """
    msg = bytearray()
    for identifier in identifiers:
        raw = identifier.encode("utf-8")
        msg += _U32.pack(len(raw))
        msg += raw
    _pad4(msg)
    msg += _MM_TRAILER.pack(len(identifiers), block_size, b"M")
    return bytes(msg)


class Xxh3Scheme:
    """Roots and chained block keys of the ``"xxh3_64"`` scheme for one block size."""

    __slots__ = ("_block_size", "_block_struct")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._block_struct = struct.Struct(f"{4 * block_size}s")

    def root_key(self, hash_seed: bytes, model_name: str, cache_salt: str | None = None) -> int:
        """The root of ``model_name``'s chains, under ``cache_salt`` when it is not ``None``
        (both must be encodable as UTF-8)."""
        salt = None if cache_salt is None else cache_salt.encode("utf-8")
        return _root(self._block_size, hash_seed, model_name.encode("utf-8"), salt)

    def block_keys(
        self, parent: int, values: Sequence[int], identifiers: list[tuple[str, ...] | None] | None
    ) -> list[int]:
        """XXH3 of each full block's message, seeded by the previous key (``parent`` first)."""
        bs = self._block_size
        data = le_bytes(values)[: len(values) // bs * 4 * bs]
        blocks = self._block_struct.iter_unpack(data)
        h = xxh3_64_intdigest
        p = parent
        if identifiers is None:
            return [p := h(block, p) for (block,) in blocks]
        suffixes: dict[tuple[str, ...], bytes] = {}
        for ids in identifiers:
            if ids is not None and ids not in suffixes:
                suffixes[ids] = _mm_suffix(ids, bs)
        get = suffixes.get
        return [
            p := h(block if ids is None else block + get(ids, b""), p)
            for (block,), ids in zip(blocks, identifiers, strict=True)
        ]

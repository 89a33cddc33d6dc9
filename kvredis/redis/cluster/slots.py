"""The hash slot of a key, as Redis Cluster computes it.

A key's slot is ``CRC16(k) mod 16384``, with the XMODEM variant of CRC16 (polynomial 0x1021,
initial value 0, no reflection, no final XOR), where ``k`` is the whole key unless the key holds
a hash tag: if it contains a ``{``, and a ``}`` somewhere after the first ``{``, with at least
one byte between them, only the bytes between that first ``{`` and the first ``}`` after it are
hashed. So ``{user1000}.following`` and ``{user1000}.followers`` share a slot, ``{}x`` and
``x{}`` are hashed whole, and ``{{a}}`` hashes ``{a``.
"""

from __future__ import annotations

from binascii import crc_hqx

#: The number of hash slots of a Redis Cluster.
SLOT_COUNT = 16384


def hash_tag(key: bytes) -> bytes:
    """The part of ``key`` that decides its slot: its hash tag if it has one, else all of it."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def key_slot(key: bytes | str) -> int:
    """The hash slot (0..16383) of a key; a str key counts as its UTF-8 bytes."""
    data = key.encode() if isinstance(key, str) else bytes(key)
    # binascii.crc_hqx is CRC-CCITT with polynomial 0x1021: with initial value 0, that is XMODEM
    return crc_hqx(hash_tag(data), 0) & (SLOT_COUNT - 1)

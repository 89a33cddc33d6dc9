"""Key slots: CRC16 (XMODEM) modulo 16384 with hash tags, checked against the servers."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvredis.redis.cluster.slots import SLOT_COUNT, hash_tag, key_slot
from tests.servers import LocalCluster


def _crc16_bitwise(data: bytes) -> int:
    """CRC16/XMODEM written out bit by bit (the definition, independent of binascii)."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def test_the_reference_values_of_the_cluster_specification() -> None:
    # the specification's check value: CRC16/XMODEM of "123456789" is 0x31C3
    assert _crc16_bitwise(b"123456789") == 0x31C3
    assert key_slot(b"123456789") == 0x31C3 % SLOT_COUNT
    assert key_slot("foo") == 12182
    assert key_slot(b"bar") == 5061
    assert key_slot(b"") == 0


@pytest.mark.parametrize(
    ("key", "hashed"),
    [
        (b"{user1000}.following", b"user1000"),
        (b"foo{bar}{zap}", b"bar"),
        (b"foo{}{bar}", b"foo{}{bar}"),  # an empty tag: the whole key
        (b"foo{{bar}}zap", b"{bar"),  # from the first "{" to the first "}" after it
        (b"foo{bar}{zap}x", b"bar"),
        (b"{}", b"{}"),
        (b"x{", b"x{"),
        (b"x}y{", b"x}y{"),  # a "}" before the first "{" does not close anything
        (b"a}{b}", b"b"),
        (b"plain", b"plain"),
    ],
)
def test_hash_tags_as_redis_defines_them(key: bytes, hashed: bytes) -> None:
    assert hash_tag(key) == hashed
    assert key_slot(key) == key_slot(hashed)


@given(st.binary(max_size=64))
def test_the_slot_is_crc16_xmodem_of_the_tag(key: bytes) -> None:
    assert key_slot(key) == _crc16_bitwise(hash_tag(key)) % SLOT_COUNT


def test_str_keys_count_as_their_utf8_bytes() -> None:
    assert key_slot("ключ{тег}") == key_slot("ключ{тег}".encode())


def test_many_keys_agree_with_cluster_keyslot(redis_cluster: LocalCluster) -> None:
    rng = random.Random(12)
    keys = [rng.randbytes(rng.randrange(0, 24)) for _ in range(1500)]
    keys += [b"kv:{" + rng.randbytes(4) + b"}:" + rng.randbytes(6) for _ in range(300)]
    keys += [b"{", b"}", b"{}", b"{}{a}", b"a{b}c{d}", b"\x00{\x00}", b"{{}}"]
    client = redis_cluster.client(redis_cluster.ports[0])
    try:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.execute_command("CLUSTER", "KEYSLOT", key)
        assert pipe.execute() == [key_slot(key) for key in keys]
    finally:
        client.close()

"""The merge of a cluster dump's shards into one namespace (sans-IO): what it refuses. Its
result on real clusters and servers: tests/redis/cluster/test_cluster_operators.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvredis.errors import NamespaceLayoutError
from kvredis.redis.codec import encode_entry
from kvredis.redis.layout import LAYOUT_VERSION
from kvredis.redis.merge import merge_pod_shards, merge_shards
from kvredis.types import PodEntry


def _record(shard: int, key: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
    return {
        "key": key.hex(),
        "fields": [[f.hex(), v.hex()] for f, v in fields.items()],
        "shard": shard,
    }


def _shard(shard: int, bits: int = 16, held: bytes = b"\x00\x00\x00\x01") -> list[dict[str, Any]]:
    entry = encode_entry(PodEntry("pod-a", "gpu"))
    one = b"\x00\x00\x00\x01"
    meta = {b"layout": LAYOUT_VERSION.encode(), b"bucket_bits": str(bits).encode()}
    meta |= {b"gen": b"g", b"next_id": b"1"}
    return [
        _record(shard, b"r:\x00\x01", {(shard + 1).to_bytes(8, "big"): held}),
        _record(shard, b"pe", {entry: one}),
        _record(shard, b"pi", {one: entry, b"next_id": b"1", b"bucket_bits": str(bits).encode()}),
        _record(shard, b"pp", {b"pod-a": one}),
        _record(shard, b"meta", meta),
    ]


def _merged(
    records: list[dict[str, Any]], count: int, merge: Any = merge_shards
) -> dict[bytes, dict[bytes, bytes]]:
    out: dict[bytes, dict[bytes, bytes]] = {}
    for r in merge(lambda: iter(records), count):
        fields = {bytes.fromhex(f): bytes.fromhex(v) for f, v in r["fields"]}
        out.setdefault(bytes.fromhex(r["key"]), {}).update(fields)
    return out


def test_one_entry_in_every_shard_gets_one_id() -> None:
    merged = _merged(_shard(0) + _shard(1), 2)
    assert len(merged[b"pe"]) == 1 and merged[b"pp"] == {b"pod-a": b"\x00\x00\x00\x01"}
    assert set(merged[b"r:\x00\x01"].values()) == {b"\x00\x00\x00\x01"}
    assert merged[b"meta"][b"next_id"] == b"1" and merged[b"meta"][b"gen"] != b"g"


def test_shards_of_different_bucket_bits_are_refused() -> None:
    with pytest.raises(NamespaceLayoutError, match="different bucket bits"):
        _merged(_shard(0, 16) + _shard(1, 12), 2)


def test_an_undefined_id_is_refused() -> None:
    with pytest.raises(NamespaceLayoutError, match="not defined"):
        _merged(_shard(0) + _shard(1, held=b"\x00\x00\x00\x09"), 2)


def test_a_record_of_a_shard_beyond_the_count_is_refused() -> None:
    with pytest.raises(NamespaceLayoutError, match="shard 2 of 2"):
        _merged(_shard(0) + _shard(2), 2)


@pytest.mark.parametrize("merge", [merge_shards, merge_pod_shards])
def test_an_entry_listed_but_not_defined_is_refused(merge: Any) -> None:
    broken = _shard(1)
    broken[1] = _record(1, b"pe", {encode_entry(PodEntry("pod-b", "gpu")): b"\x00\x00\x00\x07"})
    with pytest.raises(NamespaceLayoutError, match="listed but not defined"):
        _merged(_shard(0) + broken, 2, merge)

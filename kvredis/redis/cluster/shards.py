"""How a namespace is spread over a cluster: its shards, their names and slots (sans-IO).

A cluster namespace ``<ns>`` is ``count`` shards. Shard ``i`` is a complete namespace of the
single-server layout (:mod:`kvredis.redis.layout`) whose name carries a hash tag,
``<ns>:{<ns>/<i>.<j>}``, so every key of the shard (its dictionary, buckets, runs, watermarks)
lives in one slot and one script call on one node can run the unchanged Lua commands on it.
The suffix ``j`` is the smallest that puts the tag's slot in the middle half of the ``i``-th of
``count`` equal slices of the slot space, so the shards are spread evenly over the nodes of any
cluster whose primaries own contiguous slot ranges (what ``redis-cli --cluster create`` and
resharding by ranges give).

A request key, and an engine key, belong to shard ``shard_of(key)``: a multiplicative hash of
the 64-bit key (independent of the bucket bits, which use the key's low bits). A chain's keys
are therefore spread over every shard, each shard holding its share of the chain in chain order
(so chain runs still form within a shard), and an engine key's mapping lives in its own shard.
Resharding moves whole slots, so it moves whole shards, and a shard is never split.

The descriptor ``<ns>:cluster`` (a HASH: ``layout``, ``shards``) fixes the shard count for
every client: the first client writes it (HSETNX), later clients adopt it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from kvredis.errors import InvalidInputError, NamespaceLayoutError
from kvredis.redis.cluster.slots import SLOT_COUNT, key_slot
from kvredis.redis.layout import DEFAULT_SHARDS as DEFAULT_SHARDS
from kvredis.redis.layout import MAX_SHARDS as MAX_SHARDS
from kvredis.redis.layout import check_cluster_namespace as check_cluster_namespace
from kvredis.redis.layout import check_shards as check_shards

#: The layout of the cluster descriptor this client writes and reads.
CLUSTER_LAYOUT = "kvredis-cluster/1"
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def descriptor_key(namespace: str) -> bytes:
    """The key of the cluster descriptor of ``namespace``."""
    return namespace.encode() + b":cluster"


@functools.lru_cache(maxsize=64)
def shard_names(namespace: str, count: int) -> tuple[str, ...]:
    """The namespace names of the ``count`` shards of ``namespace``, shard 0 first."""
    names: list[str] = []
    width = SLOT_COUNT / count
    for i in range(count):
        # the middle half of the i-th slice: a node boundary near a slice's edge leaves the
        # shard with the node that owns most of the slice
        low = int(i * width + width / 4)
        high = max(low + 1, int(i * width + 3 * width / 4))
        j = 0
        while True:
            tag = f"{namespace}/{i}.{j}"
            if low <= key_slot(tag) < high:
                break
            j += 1
        names.append(f"{namespace}:{{{tag}}}")
    return tuple(names)


def shard_slot(name: str) -> int:
    """The slot every key of the shard named ``name`` lives in."""
    return key_slot(name)


def shard_of(key: int, count: int) -> int:
    """The shard of a 64-bit request or engine key."""
    return (((key * _MIX) & _MASK) >> 32) % count


def shards_of(keys: Sequence[int], count: int) -> list[int]:
    """:func:`shard_of` of every key, in order (one pass, no call per key)."""
    return [(((key * _MIX) & _MASK) >> 32) % count for key in keys]


def parse_descriptor(reply: object, namespace: str) -> int | None:
    """The shard count from ``HMGET <ns>:cluster layout shards`` (None: no descriptor yet)."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        raise NamespaceLayoutError(f"unexpected cluster descriptor reply {reply!r}")
    layout, shards = reply
    if layout is None and shards is None:
        return None
    text = bytes(layout or b"").decode("utf-8", "replace")
    if text != CLUSTER_LAYOUT:
        family, _, number = CLUSTER_LAYOUT.rpartition("/")
        found_family, _, found = text.rpartition("/")
        if found_family == family and found.isdigit() and int(found) > int(number):
            raise NamespaceLayoutError(
                f"cluster namespace {namespace!r} is in layout {text}, written by a newer "
                f"kvredis (this one reads {CLUSTER_LAYOUT}): upgrade kvredis to a version that "
                f"reads layout {text}"
            )
        raise NamespaceLayoutError(
            f"cluster namespace {namespace!r} holds layout {text!r}, this client writes "
            f"{CLUSTER_LAYOUT!r}; use another namespace"
        )
    count = bytes(shards or b"").decode("utf-8", "replace")
    try:
        return check_shards(int(count))
    except (ValueError, InvalidInputError) as exc:
        raise NamespaceLayoutError(
            f"cluster namespace {namespace!r} has an invalid shard count {count!r}"
        ) from exc

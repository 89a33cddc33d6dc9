"""How a namespace is spread over a cluster: its shards, their names and slots, and which
shard holds what (sans-IO).

A cluster namespace ``<ns>`` is ``count`` shards. Shard ``i`` is a complete namespace of the
single-server layout (:mod:`kvredis.redis.layout`) whose name carries a hash tag,
``<ns>:{<ns>/<i>.<j>}``, so every key of the shard (its dictionary, buckets, runs, watermarks)
lives in one slot and one script call on one node can run the unchanged Lua commands on it.
The suffix ``j`` is the smallest that puts the tag's slot in the middle half of the ``i``-th of
``count`` equal slices of the slot space, so the shards are spread evenly over the nodes of any
cluster whose primaries own contiguous slot ranges (what ``redis-cli --cluster create`` and
resharding by ranges give). Resharding moves whole slots, so it moves whole shards.

Which shard holds what is the layout of the namespace, named in its descriptor ``<ns>:cluster``
(a HASH: ``layout``, ``shards``; the first client writes it with HSETNX, later clients adopt
it):

- :data:`CLUSTER_LAYOUT` (``kvredis-cluster/2``, pods): everything of one pod lives in the
  shard :func:`pod_shard` names (a hash of the pod id): its entries under every request key it
  holds, the engine-key mappings its adds record, its streams' watermarks, its speculative
  entries. A write of one pod is one script call on one node; a request key held by pods of
  several shards is stored once in each of them.
- :data:`KEY_LAYOUT` (``kvredis-cluster/1``, keys, kvredis before pod placement): a request
  key, and an engine key's mapping, live in shard :func:`shard_of` (a multiplicative hash of the
  64-bit key), whatever pod holds them. ``kvredis migrate`` converts such a namespace in place
  (:mod:`kvredis.redis.cluster.migrate`); until then this kvredis reads and writes it as one
  being converted.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvredis.errors import InvalidInputError, NamespaceLayoutError
from kvredis.redis.cluster.slots import SLOT_COUNT, key_slot
from kvredis.redis.layout import DEFAULT_SHARDS as DEFAULT_SHARDS
from kvredis.redis.layout import MAX_SHARDS as MAX_SHARDS
from kvredis.redis.layout import check_cluster_namespace as check_cluster_namespace
from kvredis.redis.layout import check_shards as check_shards

#: The layout of the cluster namespaces this client creates: shards by pod.
CLUSTER_LAYOUT = "kvredis-cluster/2"
#: The layout of kvredis before pod placement (shards by key), which ``kvredis migrate``
#: converts (this client reads and writes it as a namespace being converted).
KEY_LAYOUT = "kvredis-cluster/1"
#: Every cluster layout this client reads.
CLUSTER_LAYOUTS = (KEY_LAYOUT, CLUSTER_LAYOUT)
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
    """The shard of a 64-bit request or engine key in a namespace of :data:`KEY_LAYOUT`."""
    return (((key * _MIX) & _MASK) >> 32) % count


def shards_of(keys: Sequence[int], count: int) -> list[int]:
    """:func:`shard_of` of every key, in order (one pass, no call per key)."""
    return [(((key * _MIX) & _MASK) >> 32) % count for key in keys]


@functools.lru_cache(maxsize=65536)
def pod_shard(pod: str, count: int) -> int:
    """The shard of every entry of pod ``pod`` (a hash of its id: BLAKE2b, 8 bytes, of the id in
    UTF-8, big-endian, modulo ``count``), in a namespace of :data:`CLUSTER_LAYOUT`."""
    digest = hashlib.blake2b(pod.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def stream_shard(stream: str, count: int) -> int:
    """The shard a fenced batch without entries goes to when its stream's shard is unknown
    (the same hash as :func:`pod_shard`)."""
    return pod_shard(stream, count)


@dataclass(frozen=True, slots=True)
class Descriptor:
    """A cluster namespace's descriptor: its layout, its shard count, and, while ``kvredis
    migrate`` converts it, how far the conversion got (:mod:`kvredis.redis.cluster.migrate`)."""

    layout: str
    shards: int

    @property
    def by_pod(self) -> bool:
        """Whether every shard holds whole pods (:data:`CLUSTER_LAYOUT`)."""
        return self.layout == CLUSTER_LAYOUT


def parse_descriptor(reply: object, namespace: str) -> Descriptor | None:
    """The descriptor from ``HMGET <ns>:cluster layout shards`` (None: no descriptor yet)."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 2:
        raise NamespaceLayoutError(f"unexpected cluster descriptor reply {reply!r}")
    layout, shards = reply
    if layout is None and shards is None:
        return None
    text = bytes(layout or b"").decode("utf-8", "replace")
    if text not in CLUSTER_LAYOUTS:
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
        return Descriptor(text, check_shards(int(count)))
    except (ValueError, InvalidInputError) as exc:
        raise NamespaceLayoutError(
            f"cluster namespace {namespace!r} has an invalid shard count {count!r}"
        ) from exc

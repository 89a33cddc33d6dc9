"""A writer of the key layout (``kvredis-cluster/1``, kvredis before pod placement), for the
migration tests: a request key's entries, whatever their pod, in shard ``shard_of(key)``; an
engine key's mapping in shard ``shard_of(engine key)``; a fenced batch's watermark in every
shard. It writes each shard with the single-server write programs, as that kvredis did."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

from kvredis import PodEntry, RedisIndexConfig, Watermark
from kvredis.checks import infer_mappings
from kvredis.redis.cluster.core import on_shards
from kvredis.redis.cluster.index import RedisClusterIndex
from kvredis.redis.cluster.shards import KEY_LAYOUT, descriptor_key
from kvredis.redis.codec import blob_hashes, hash_field, text_bytes
from kvredis.redis.ops import add_call, evict_call
from kvredis.redis.program import program_of
from kvredis.redis.requests import Command, Op
from kvredis.redis.state import CoreState
from kvredis.types import KeyType


def create(config: RedisIndexConfig, shards: int) -> None:
    """Write the descriptor of a key-layout namespace (before any client connects)."""
    with _raw(config) as raw:
        desc = descriptor_key(config.namespace)
        raw.hset(desc, mapping={"layout": KEY_LAYOUT, "shards": shards})


def _raw(config: RedisIndexConfig) -> Any:
    import redis.cluster

    address = config.parsed_address()
    host, port = (address.seeds or ((address.host, address.port),))[0]
    return redis.cluster.RedisCluster(host=host, port=port)


class KeyLayoutWriter:
    """Writes a key-layout namespace through a cluster index's shard sessions."""

    def __init__(self, index: RedisClusterIndex) -> None:
        self.index = index
        self.core = index.core
        assert not self.core.by_pod, "the namespace must be in the key layout"

    def _run(self, ops: dict[int, Callable[[CoreState], Op[Any]]]) -> dict[int, Any]:
        return self.index._exec.run(on_shards(self.core, ops))

    def add(
        self,
        engine_keys: Sequence[int] | None,
        request_keys: Sequence[int],
        entries: Sequence[PodEntry],
        ttl_ms: int = 0,
    ) -> None:
        units: dict[int, list[Any]] = {}
        for key in request_keys:
            units.setdefault(self.core.shard(key), []).append(key)
        pairs: dict[int, list[tuple[int, int]]] = {}
        if engine_keys:
            for engine, request in infer_mappings(list(engine_keys), list(request_keys)):
                pairs.setdefault(self.core.shard(engine), []).append((engine, request))
        ents = list(dict.fromkeys(entries))

        def adder(keys: list[int], shard_pairs: list[tuple[int, int]]) -> Any:
            def op(state: CoreState) -> Op[Any]:
                program = program_of(state.layout, [("A", keys, shard_pairs, ents)])
                return (yield add_call(program, ttl_ms))

            return op

        shards = set(units) | set(pairs)
        self._run({s: adder(units.get(s, []), pairs.get(s, [])) for s in shards})

    def evict(self, key: int, key_type: KeyType, entries: Sequence[PodEntry]) -> None:
        keys = [key]
        if key_type is KeyType.ENGINE:
            shard = self.core.shard(key)

            def reader(state: CoreState) -> Op[Any]:
                return (yield Command(("HGET", state.layout.engine_bucket(key), hash_field(key))))

            mapping = self._run({shard: reader})[shard]
            keys = blob_hashes(mapping) if mapping else []

        def evicter(shard_keys: list[int]) -> Any:
            def op(state: CoreState) -> Op[Any]:
                units = [("R", k, list(entries)) for k in shard_keys]
                return (yield evict_call(program_of(state.layout, units)))

            return op

        by_shard: dict[int, list[int]] = {}
        for k in keys:
            by_shard.setdefault(self.core.shard(k), []).append(k)
        if by_shard:
            self._run({s: evicter(ks) for s, ks in by_shard.items()})

    def watermark(self, stream: str, mark: Watermark) -> None:
        """A fenced batch's watermark, as the key layout left it: in every shard."""
        value = f"{mark.epoch}:{mark.seq}:{secrets.token_hex(8)}"

        def op(state: CoreState) -> Op[Any]:
            return (yield Command(("HSET", state.layout.wm, text_bytes(stream), value)))

        self._run(dict.fromkeys(range(self.core.count), op))


def descriptor_layout(config: RedisIndexConfig) -> tuple[str, str | None]:
    """The descriptor's layout and the mover's progress field."""
    with _raw(config) as raw:
        layout, move = raw.hmget(descriptor_key(config.namespace), "layout", "move")
    return layout.decode(), move.decode() if move else None

"""Cluster executors: send the waves of a cluster operation (:mod:`.routing`) to the nodes of
a cluster with redis-py, in parallel; nothing else.

:class:`SyncClusterExecutor` keeps a blocking connection pool per node; a wave writes every
node's pipeline first, then reads the replies node by node, so the nodes work at the same time
without threads. :class:`AsyncClusterExecutor` does the same with asyncio connections and
``asyncio.gather``. Slot maps, redirections and retries are the operations' business.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry

from kvredis.redis.cluster.routing import (
    ClusterState,
    NodeBatch,
    SlotCommand,
    Wave,
    WaveOp,
    WavePolicy,
    op_refresh,
    op_wave,
)
from kvredis.redis.cluster.topology import ClusterNode, SlotMap
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.executor import _FAILURES, _pool, failure
from kvredis.redis.requests import Sleep

T = TypeVar("T")


class _Cluster:
    """What both executors keep: the config, the cluster state, a connection pool per node."""

    def __init__(self, config: RedisIndexConfig, lib: ModuleType, retry: Any) -> None:
        self.config = config
        self.address = config.parsed_address()
        hosts = self.address.seeds or ((self.address.host, self.address.port),)
        seeds = [ClusterNode(host, port) for host, port in hosts]
        self.state = ClusterState(seeds, self.address.tls)
        self.policy = WavePolicy(
            config.retries,
            config.retry_backoff,
            server=config.server(),
            migration_wait=config.socket_timeout,
        )
        self.pools: dict[ClusterNode, Any] = {}
        self.round_trips = 0
        self.lock = threading.Lock()
        self._lib = lib
        self._retry = retry

    def pool(self, node: ClusterNode) -> Any:
        pool = self.pools.get(node)
        if pool is None:
            address = replace(self.address, host=node.host, port=node.port, cluster=False)
            pool = self.pools.setdefault(node, _pool(self.config, address, self._lib, self._retry))
        return pool


def _resume(op: WaveOp[T], outcome: Any, result: list[T]) -> Wave | Sleep | None:
    """Resume ``op`` with ``outcome``: its next request, or None once it returned (its result
    then appended to ``result``; kept per call, so threads may share an executor)."""
    try:
        request = op.send(outcome)
    except StopIteration as stop:
        result.append(stop.value)
        return None
    if not isinstance(request, (Wave, Sleep)):
        raise TypeError(f"a cluster executor sends waves and sleeps, not {request!r}")
    return request


def _connection(pool: Any) -> Any:
    """A connection of ``pool`` (redis-py before 5.3 wants a command name; later ones none)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("PING")


def _read_all(connection: Any, count: int) -> list[Any]:
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except redis.ResponseError as exc:
            replies.append(failure(exc))
        except _FAILURES as exc:
            connection.disconnect()
            replies.extend([failure(exc)] * (count - len(replies)))
            break
    return replies


class _Executor:
    """What both executors show of their cluster."""

    _cluster: _Cluster

    @property
    def cluster_state(self) -> ClusterState:
        """The seeds and the slot map the operations route by."""
        return self._cluster.state

    @property
    def wave_policy(self) -> WavePolicy:
        """Retries and redirections of a wave."""
        return self._cluster.policy

    @property
    def round_trips(self) -> int:
        """Round trips so far (a wave counts one per node it involves)."""
        return self._cluster.round_trips


class SyncClusterExecutor(_Executor):
    """Sends waves to the nodes of a cluster over blocking connections."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self._cluster = _Cluster(config, redis, redis.retry.Retry)

    @property
    def slot_map(self) -> SlotMap:
        """The current slot map (fetched on first use)."""
        return self._cluster.state.slot_map or self.refresh()

    def refresh(self) -> SlotMap:
        """Fetch the slot map again."""
        return self.run(op_refresh(self._cluster.state, self._cluster.policy.server))

    def wave(self, commands: Sequence[SlotCommand], read: bool = False, pick: int = 0) -> list[Any]:
        """Send ``commands`` in one parallel wave (more while redirections come back); the
        replies in order, a Failure for each command the cluster refused."""
        cluster = self._cluster
        return self.run(op_wave(cluster.state, commands, cluster.policy, read, pick))

    def run(self, op: WaveOp[T]) -> T:
        """Drive a cluster operation to its end and return its result."""
        result: list[T] = []
        try:
            request = _resume(op, None, result)
            while request is not None:
                if isinstance(request, Sleep):
                    time.sleep(request.seconds)
                    request = _resume(op, None, result)
                else:
                    request = _resume(op, self._send(request), result)
            return result[0]
        finally:
            op.close()

    def _send(self, wave: Wave) -> list[list[Any]]:
        with self._cluster.lock:
            self._cluster.round_trips += len(wave.batches)
        out: list[list[Any]] = []
        held: list[tuple[Any, Any, list[Any], int]] = []
        try:
            for batch in wave.batches:  # write every pipeline first ...
                replies: list[Any] = []
                out.append(replies)
                count = len(batch.commands)
                pool = self._cluster.pool(batch.node)
                try:
                    connection = _connection(pool)
                except _FAILURES as exc:
                    replies.extend([failure(exc)] * count)
                    continue
                held.append((pool, connection, replies, count))
                try:
                    connection.send_packed_command(connection.pack_commands(batch.commands))
                except _FAILURES as exc:
                    connection.disconnect()
                    replies.extend([failure(exc)] * count)
            for _, connection, replies, count in held:  # ... then read, node by node
                if not replies:
                    replies.extend(_read_all(connection, count))
        finally:
            for pool, connection, _, _ in held:
                pool.release(connection)
        return out

    def close(self) -> None:
        """Close every node's connections."""
        for pool in self._cluster.pools.values():
            pool.disconnect()
        self._cluster.pools.clear()


class AsyncClusterExecutor(_Executor):
    """Sends waves to the nodes of a cluster over asyncio connections (one event loop)."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self._cluster = _Cluster(config, redis.asyncio, redis.asyncio.retry.Retry)

    async def refresh(self) -> SlotMap:
        """Fetch the slot map again."""
        return await self.run(op_refresh(self._cluster.state, self._cluster.policy.server))

    async def wave(
        self, commands: Sequence[SlotCommand], read: bool = False, pick: int = 0
    ) -> list[Any]:
        """See :meth:`SyncClusterExecutor.wave`."""
        cluster = self._cluster
        return await self.run(op_wave(cluster.state, commands, cluster.policy, read, pick))

    async def run(self, op: WaveOp[T]) -> T:
        """Drive a cluster operation to its end and return its result."""
        result: list[T] = []
        try:
            request = _resume(op, None, result)
            while request is not None:
                if isinstance(request, Sleep):
                    await asyncio.sleep(request.seconds)
                    request = _resume(op, None, result)
                else:
                    request = _resume(op, await self._send(request), result)
            return result[0]
        finally:
            op.close()

    async def _send(self, wave: Wave) -> list[list[Any]]:
        self._cluster.round_trips += len(wave.batches)
        return list(await asyncio.gather(*(self._batch(batch) for batch in wave.batches)))

    async def _batch(self, batch: NodeBatch) -> list[Any]:
        pool = self._cluster.pool(batch.node)
        count = len(batch.commands)
        try:
            connection = await _connection(pool)
        except _FAILURES as exc:
            return [failure(exc)] * count
        replies: list[Any] = []
        try:
            await connection.send_packed_command(connection.pack_commands(batch.commands))
            for _ in range(count):
                try:
                    replies.append(await connection.read_response())
                except redis.ResponseError as exc:
                    replies.append(failure(exc))
        except _FAILURES as exc:
            await connection.disconnect()
            replies.extend([failure(exc)] * (count - len(replies)))
        finally:
            await pool.release(connection)
        return replies

    async def aclose(self) -> None:
        """Close every node's connections."""
        for pool in self._cluster.pools.values():
            await pool.disconnect()
        self._cluster.pools.clear()

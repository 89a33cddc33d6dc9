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
from kvredis.redis.executor import _FAILURES, _pool, _takes_command_name, failure
from kvredis.redis.executor import hiredis_pack as _hiredis_pack
from kvredis.redis.requests import Sleep

T = TypeVar("T")


def _pack(connection: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The commands of one pipeline as the bytes to send: hiredis packs them in C from the
    arguments as the operations give them (bytes, str, int); redis-py's packer otherwise (it
    encodes each argument in Python first)."""
    if _hiredis_pack is None:
        return list(connection.pack_commands(commands))
    try:
        return [b"".join([_hiredis_pack(c) for c in commands])]
    except TypeError:  # an argument hiredis does not take (a memoryview): redis-py's way
        return list(connection.pack_commands(commands))


class _NodeConnections:
    """The connections to one node that waves check out and back in (LIFO), at most
    ``limit`` at a time; thread-safe.

    redis-py's pool probes a connection for unread data (a ``poll`` system call) every time it
    hands one out; a wave reads every reply it asks for and disconnects a connection on any
    failure, so its connections come back clean and need no probe. A connection that was
    dropped reconnects when next used (redis-py connects on send)."""

    def __init__(self, pool: Any, limit: int, timeout: float) -> None:
        self._pool = pool  # redis-py's: the connection class and its settings
        self._free: list[Any] = []
        self._slots = threading.BoundedSemaphore(max(1, limit))
        self._timeout = timeout
        self._lock = threading.Lock()
        self._all: list[Any] = []

    def get(self) -> Any:
        if not self._slots.acquire(timeout=self._timeout):
            raise redis.ConnectionError("No connection available.")
        with self._lock:
            if self._free:
                return self._free.pop()
        try:
            connection = self._pool.connection_class(**self._pool.connection_kwargs)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._all.append(connection)
        return connection

    def put(self, connection: Any) -> None:
        with self._lock:
            self._free.append(connection)
        self._slots.release()

    def disconnect(self) -> None:
        with self._lock:
            for connection in self._all:
                connection.disconnect()
            self._all.clear()
            self._free.clear()


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
        self.connections: dict[ClusterNode, _NodeConnections] = {}
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

    def node_connections(self, node: ClusterNode) -> _NodeConnections:
        """The sync executor's connections to ``node``."""
        found = self.connections.get(node)
        if found is None:
            with self.lock:
                found = self.connections.get(node)
                if found is None:
                    config = self.config
                    found = _NodeConnections(self.pool(node), config.pool_size, config.pool_timeout)
                    self.connections[node] = found
        return found


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
    return pool.get_connection("PING") if _takes_command_name(pool) else pool.get_connection()


_READONLY = ("READONLY",)


def _reads_already(connection: Any) -> bool:
    """Whether ``connection`` sent ``READONLY`` on its current socket (a reconnect loses it)."""
    sock = getattr(connection, "_sock", None)
    return sock is not None and getattr(connection, "_kvredis_readonly", None) is sock


def _mark_reads(connection: Any) -> None:
    connection._kvredis_readonly = getattr(connection, "_sock", None)


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

    def primary_client(self, slot: int) -> redis.Redis:
        """A redis-py client of the primary serving ``slot`` as the slot map has it (for a
        transaction under ``WATCH`` on one slot's keys; a node that no longer serves the slot
        answers ``MOVED``, which redis-py raises as a ``ResponseError``)."""
        return redis.Redis(connection_pool=self._cluster.pool(self.slot_map.primary(slot)))

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
        held: list[tuple[_NodeConnections, Any, list[Any], int, bool]] = []
        try:
            for batch in wave.batches:  # write every pipeline first ...
                replies: list[Any] = []
                out.append(replies)
                commands = batch.commands
                connections = self._cluster.node_connections(batch.node)
                try:
                    connection = connections.get()
                except _FAILURES as exc:
                    replies.extend([failure(exc)] * len(commands))
                    continue
                readonly = commands[0] == _READONLY
                if readonly and _reads_already(connection):
                    commands = commands[1:]  # READONLY holds for the connection's life
                    replies.append(b"OK")
                    readonly = False
                try:
                    connection.send_packed_command(_pack(connection, commands))
                except _FAILURES as exc:
                    connection.disconnect()
                    replies.extend([failure(exc)] * len(commands))
                    commands = ()
                held.append((connections, connection, replies, len(commands), readonly))
            for _, connection, replies, count, readonly in held:  # ... then read, node by node
                if count:
                    read = _read_all(connection, count)
                    if readonly and read[0] in (b"OK", "OK", True):
                        _mark_reads(connection)
                    replies.extend(read)
        finally:
            for connections, connection, _, _, _ in held:
                connections.put(connection)
        return out

    def close(self) -> None:
        """Close every node's connections."""
        for connections in self._cluster.connections.values():
            connections.disconnect()
        self._cluster.connections.clear()
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

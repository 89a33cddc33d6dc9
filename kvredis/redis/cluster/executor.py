"""Cluster executors: send the waves of :func:`~kvredis.redis.cluster.routing.op_wave` to the
nodes of a cluster with redis-py, in parallel; nothing else.

:class:`SyncClusterExecutor` keeps a blocking connection pool per node; a wave writes every
node's pipeline first, then reads the replies node by node, so the nodes work at the same time
without threads. :class:`AsyncClusterExecutor` does the same with asyncio connections and
``asyncio.gather``. Both keep the current :class:`~kvredis.redis.cluster.topology.SlotMap`,
refreshed from any node that answers (the map's nodes first, then the address's seeds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry

from kvredis.errors import BackendUnavailableError
from kvredis.redis.address import RedisAddress
from kvredis.redis.cluster.routing import (
    NodeBatch,
    RefreshSlotMap,
    SlotCommand,
    Wave,
    WaveOp,
    WavePolicy,
    op_wave,
)
from kvredis.redis.cluster.topology import ClusterNode, SlotMap, op_slot_map
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.executor import _FAILURES, _pool, failure
from kvredis.redis.requests import Command, Failure, Op, Sleep

T = TypeVar("T")


def _policy(config: RedisIndexConfig) -> WavePolicy:
    return WavePolicy(config.retries, config.retry_backoff, server=config.server())


class _Nodes:
    """What both executors keep: the config, the seeds, and the current slot map."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self.config = config
        self.address: RedisAddress = config.parsed_address()
        self.seeds = tuple(ClusterNode(host, port) for host, port in self.address.seeds)
        self.policy = _policy(config)
        self.slot_map: SlotMap | None = None
        self.round_trips = 0

    def node_address(self, node: ClusterNode) -> RedisAddress:
        return replace(self.address, host=node.host, port=node.port, cluster=False, seeds=())

    def candidates(self) -> list[ClusterNode]:
        known = self.slot_map.nodes if self.slot_map is not None else ()
        return list(dict.fromkeys((*known, *self.seeds)))

    def no_map(self, errors: list[str]) -> BackendUnavailableError:
        return BackendUnavailableError(
            f"no node of {self.config.server()} told its slot map: {'; '.join(errors)}"
        )


def _drive_map(op: Op[SlotMap], outcome: Any) -> Command | SlotMap:
    """Resume the slot-map operation with ``outcome``: its next command, or the map."""
    try:
        request = op.throw(outcome) if isinstance(outcome, Failure) else op.send(outcome)
    except StopIteration as stop:
        result: SlotMap = stop.value
        return result
    if not isinstance(request, Command):
        raise TypeError(f"unexpected request {request!r}")
    return request


class SyncClusterExecutor:
    """Sends waves to the nodes of a cluster over blocking connections; thread-safe."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self._nodes = _Nodes(config)
        self._pools: dict[ClusterNode, Any] = {}

    @property
    def slot_map(self) -> SlotMap:
        """The current slot map (fetched on first use)."""
        return self.refresh(force=False)

    @property
    def round_trips(self) -> int:
        """Round trips so far (a wave counts one per node it involves)."""
        return self._nodes.round_trips

    def wave(
        self, commands: Sequence[SlotCommand], read: bool = False, pick: int = 0
    ) -> list[Any]:
        """Send ``commands`` in one parallel wave (more while redirections come back); the
        replies in order, a Failure for each command the cluster refused."""
        return self.run(op_wave(commands, self._nodes.policy, read, pick))  # type: ignore[no-any-return]

    def run(self, op: WaveOp) -> Any:
        """Drive a cluster operation to its end and return its result."""
        try:
            request = next(op)
            while True:
                if isinstance(request, Wave):
                    request = op.send(self._send(request))
                elif isinstance(request, RefreshSlotMap):
                    request = op.send(self.refresh(request.force))
                elif isinstance(request, Sleep):
                    time.sleep(request.seconds)
                    request = op.send(None)
                else:
                    raise TypeError(f"a cluster executor sends waves, not {request!r}")
        except StopIteration as stop:
            return stop.value
        finally:
            op.close()

    def refresh(self, force: bool = True) -> SlotMap:
        """The slot map: the current one, or (``force``) a fresh one from the first node that
        tells it."""
        if self._nodes.slot_map is not None and not force:
            return self._nodes.slot_map
        errors: list[str] = []
        for node in self._nodes.candidates():
            op = op_slot_map(node.host, self._nodes.address.tls)
            outcome: Any = None
            try:
                while True:
                    step = _drive_map(op, outcome)
                    if isinstance(step, SlotMap):
                        self._nodes.slot_map = step
                        return step
                    outcome = self._command(node, step.args)
            except Exception as exc:  # this node cannot tell: ask the next one
                errors.append(f"{node}: {exc}")
        raise self._nodes.no_map(errors)

    def _pool(self, node: ClusterNode) -> Any:
        pool = self._pools.get(node)
        if pool is None:
            address = self._nodes.node_address(node)
            pool = _pool(self._nodes.config, address, redis, redis.retry.Retry)
            pool = self._pools.setdefault(node, pool)
        return pool

    def _command(self, node: ClusterNode, args: tuple[Any, ...]) -> Any:
        (reply,) = self._send(Wave((NodeBatch(node, (args,)),)))[0]
        return reply

    def _send(self, wave: Wave) -> list[list[Any]]:
        self._nodes.round_trips += len(wave.batches)
        out: list[list[Any]] = []
        held: list[tuple[Any, Any, list[Any], int]] = []
        try:
            for batch in wave.batches:  # write every pipeline first ...
                replies: list[Any] = []
                out.append(replies)
                count = len(batch.commands)
                pool = self._pool(batch.node)
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
        for pool in self._pools.values():
            pool.disconnect()
        self._pools.clear()


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


class AsyncClusterExecutor:
    """Sends waves to the nodes of a cluster over asyncio connections (one event loop)."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self._nodes = _Nodes(config)
        self._pools: dict[ClusterNode, Any] = {}

    @property
    def round_trips(self) -> int:
        """See :attr:`SyncClusterExecutor.round_trips`."""
        return self._nodes.round_trips

    async def slot_map(self) -> SlotMap:
        """The current slot map (fetched on first use)."""
        return await self.refresh(force=False)

    async def wave(
        self, commands: Sequence[SlotCommand], read: bool = False, pick: int = 0
    ) -> list[Any]:
        """See :meth:`SyncClusterExecutor.wave`."""
        return await self.run(op_wave(commands, self._nodes.policy, read, pick))  # type: ignore[no-any-return]

    async def run(self, op: WaveOp) -> Any:
        """Drive a cluster operation to its end and return its result."""
        try:
            request = next(op)
            while True:
                if isinstance(request, Wave):
                    request = op.send(await self._send(request))
                elif isinstance(request, RefreshSlotMap):
                    request = op.send(await self.refresh(request.force))
                elif isinstance(request, Sleep):
                    await asyncio.sleep(request.seconds)
                    request = op.send(None)
                else:
                    raise TypeError(f"a cluster executor sends waves, not {request!r}")
        except StopIteration as stop:
            return stop.value
        finally:
            op.close()

    async def refresh(self, force: bool = True) -> SlotMap:
        """See :meth:`SyncClusterExecutor.refresh`."""
        if self._nodes.slot_map is not None and not force:
            return self._nodes.slot_map
        errors: list[str] = []
        for node in self._nodes.candidates():
            op = op_slot_map(node.host, self._nodes.address.tls)
            outcome: Any = None
            try:
                while True:
                    step = _drive_map(op, outcome)
                    if isinstance(step, SlotMap):
                        self._nodes.slot_map = step
                        return step
                    (outcome,) = (await self._send(Wave((NodeBatch(node, (step.args,)),))))[0]
            except Exception as exc:  # this node cannot tell: ask the next one
                errors.append(f"{node}: {exc}")
        raise self._nodes.no_map(errors)

    def _pool(self, node: ClusterNode) -> Any:
        pool = self._pools.get(node)
        if pool is None:
            address = self._nodes.node_address(node)
            pool = _pool(self._nodes.config, address, redis.asyncio, redis.asyncio.retry.Retry)
            pool = self._pools.setdefault(node, pool)
        return pool

    async def _send(self, wave: Wave) -> list[list[Any]]:
        self._nodes.round_trips += len(wave.batches)
        return list(await asyncio.gather(*(self._batch(batch) for batch in wave.batches)))

    async def _batch(self, batch: NodeBatch) -> list[Any]:
        pool = self._pool(batch.node)
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
        for pool in self._pools.values():
            await pool.disconnect()
        self._pools.clear()


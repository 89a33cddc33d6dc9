"""Server failures: stopped or hung servers raise BackendUnavailableError promptly, then recover."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import redis

from kvredis import (
    AsyncRedisIndex,
    BackendUnavailableError,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
)
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

A = PodEntry("pod-a", "gpu")


def _config(server: RedisServer) -> RedisIndexConfig:
    return RedisIndexConfig(
        address=server.url,
        namespace=f"kvt-{uuid.uuid4().hex[:12]}",
        socket_timeout=0.5,
        connect_timeout=0.5,
        retries=2,
        retry_backoff=0.05,
    )


def _give_up_bound(cfg: RedisIndexConfig) -> float:
    """Longest a failing call may take by its configuration, plus slack for a loaded machine."""
    attempts = cfg.retries + 1
    backoff = sum(min(1.0, cfg.retry_backoff * 2**i) for i in range(cfg.retries))
    return attempts * max(cfg.socket_timeout, cfg.connect_timeout) + backoff + 3.0


def test_stopping_the_server_mid_workload_raises_then_the_client_recovers(
    own_redis_server: RedisServer,
) -> None:
    cfg = _config(own_redis_server)
    idx = RedisIndex(cfg)
    errors: list[BaseException] = []
    progress = threading.Event()
    stopped = threading.Event()

    def workload() -> None:
        i = 0
        while True:
            try:
                idx.add([i], [i + 1_000_000], [A])
                idx.lookup([i + 1_000_000])
                idx.evict(i, KeyType.ENGINE, [A])
            except BaseException as exc:  # recorded and checked below
                errors.append(exc)
                return
            i += 1
            if i == 20:
                progress.set()
            if stopped.is_set() and i > 10_000:
                return

    try:
        thread = threading.Thread(target=workload, daemon=True)
        thread.start()
        assert progress.wait(30)
        own_redis_server.stop()
        stopped.set()
        thread.join(_give_up_bound(cfg))
        assert not thread.is_alive(), "the client hung after the server stopped"
        assert len(errors) == 1 and isinstance(errors[0], BackendUnavailableError)
        assert own_redis_server.url.removeprefix("redis://") in str(errors[0])
        with pytest.raises(BackendUnavailableError):
            idx.get_request_key(1)
        own_redis_server.start()
        idx.add([7], [8], [A])
        assert idx.lookup([8]) == {8: [A]}
        assert idx.get_request_key(7) == 8
    finally:
        idx.close()


def test_a_hung_server_times_out_instead_of_blocking(own_redis_server: RedisServer) -> None:
    cfg = _config(own_redis_server)
    with RedisIndex(cfg) as idx:
        idx.add(None, [1], [A])
        assert own_redis_server.proc is not None
        pid = own_redis_server.proc.pid
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                idx.lookup([1])
                outcome.append(None)
            except BaseException as exc:  # recorded and checked below
                outcome.append(exc)

        os.kill(pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=call, daemon=True)
            thread.start()
            thread.join(_give_up_bound(cfg))
            assert not thread.is_alive(), "the client blocked on a hung server"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(outcome) == 1 and isinstance(outcome[0], BackendUnavailableError)
        assert idx.lookup([1]) == {1: [A]}


async def test_async_client_raises_when_stopped_and_recovers(
    own_redis_server: RedisServer,
) -> None:
    cfg = _config(own_redis_server)
    idx = await AsyncRedisIndex.create(cfg)
    try:
        await idx.add(None, [1], [A])
        own_redis_server.stop()
        with pytest.raises(BackendUnavailableError):
            await idx.lookup([1])
        with pytest.raises(BackendUnavailableError):
            await idx.add(None, [2], [A])
        own_redis_server.start()
        await idx.add(None, [2], [A])
        assert await idx.lookup([2]) == {2: [A]}
    finally:
        await idx.aclose()


def test_close_releases_connections(own_redis_server: RedisServer) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    try:
        before = len(admin.client_list())
        indexes = [RedisIndex(_config(own_redis_server)) for _ in range(3)]
        for idx in indexes:
            idx.lookup([1])
        assert len(admin.client_list()) >= before + 3
        for idx in indexes:
            idx.close()
        deadline = time.monotonic() + 5
        while len(admin.client_list()) != before and time.monotonic() < deadline:
            time.sleep(0.01)  # the server notices closed sockets on its next event loop turn
        assert len(admin.client_list()) == before
    finally:
        admin.close()


def test_a_server_busy_with_a_long_script_counts_as_unavailable(
    own_redis_server: RedisServer,
) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    admin.config_set("busy-reply-threshold", 50)
    busy = redis.Redis(port=own_redis_server.port, socket_timeout=30)
    spin = """
    local start = redis.call('TIME')
    while true do
      local now = redis.call('TIME')
      if (now[1] - start[1]) * 1000000 + (now[2] - start[2]) > 1500000 then return 1 end
    end"""
    cfg = _config(own_redis_server)
    try:
        with RedisIndex(cfg) as idx:
            idx.add(None, [1], [A])
            runner = threading.Thread(target=lambda: busy.eval(spin, 0), daemon=True)
            runner.start()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # wait until the server answers BUSY
                try:
                    admin.ping()
                except redis.ResponseError:
                    break
                time.sleep(0.02)
            with pytest.raises(BackendUnavailableError, match="BUSY"):
                idx.lookup([1])
            runner.join(10)
            assert idx.lookup([1]) == {1: [A]}
    finally:
        admin.close()
        busy.close()

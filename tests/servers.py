"""Real servers for the test suite: redis-server processes on free loopback ports.

``KVREDIS_TEST_REDIS_URL`` points the suite at an external server instead; when a Docker engine
is reachable and no ``redis-server`` binary is installed, testcontainers provides one.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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
    raise TimeoutError(f"redis-server on port {port} did not answer PING within {timeout}s")


class RedisServer:
    """A ``redis-server`` child process on a free port, which tests can stop and restart."""

    def __init__(self, binary: str | None = None, extra_args: list[str] | None = None) -> None:
        found = binary or shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise RuntimeError(
                "this test needs a Redis server, but neither redis-server nor valkey-server is "
                "on PATH: install one (scripts/install-servers), point KVREDIS_TEST_REDIS_URL at "
                'a server, or deselect such tests with -m "not redis"'
            )
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


def _docker_available() -> bool:
    return os.path.exists("/var/run/docker.sock") or bool(os.environ.get("DOCKER_HOST"))


@contextmanager
def redis_url() -> Iterator[tuple[str, RedisServer | None]]:
    """Yield ``(url, server)``: an external URL (server None), a local process, or a container."""
    external = os.environ.get("KVREDIS_TEST_REDIS_URL")
    if external:
        yield external, None
        return
    if shutil.which("redis-server") or shutil.which("valkey-server") or not _docker_available():
        server = RedisServer()
        server.start()
        try:
            yield server.url, server
        finally:
            server.close()
        return
    from testcontainers.redis import RedisContainer  # pragma: no cover - needs a Docker engine

    with RedisContainer("redis:7") as container:  # pragma: no cover
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        yield f"redis://{host}:{port}", None

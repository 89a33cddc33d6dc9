"""Import hygiene: the sans-IO modules and the package itself load no redis-py (nor pyzmq)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SANS_IO = [
    "kvredis.redis",
    "kvredis.redis.address",
    "kvredis.redis.requests",
    "kvredis.redis.codec",
    "kvredis.redis.layout",
    "kvredis.redis.state",
    "kvredis.redis.scripts",
    "kvredis.redis.ops",
    "kvredis.redis.config",
    "kvredis.redis.replicas",
    "kvredis.redis.cluster",
    "kvredis.redis.cluster.slots",
    "kvredis.redis.cluster.redirect",
    "kvredis.redis.cluster.topology",
    "kvredis.redis.cluster.routing",
    "kvredis.redis.cluster.shards",
    "kvredis.redis.cluster.core",
    "kvredis.redis.cluster.placement",
    "kvredis.redis.cluster.calls",
    "kvredis.redis.cluster.writes",
    "kvredis.redis.cluster.ops",
    "kvredis.redis.cluster.migrate",
]


def _loaded_after(statement: str) -> set[str]:
    """Which of redis-py and pyzmq a fresh interpreter has loaded after ``statement``."""
    report = "print(' '.join(m for m in ('redis', 'zmq') if m in sys.modules))"
    probe = f"{statement}\nimport sys\n{report}"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_modules_do_not_load_redis_py(module: str) -> None:
    assert _loaded_after(f"import {module}") == set()


def test_the_packages_load_redis_py_only_when_a_client_is_used() -> None:
    assert _loaded_after("import kvredis, kvredis.redis; kvredis.RedisIndexConfig()") == set()
    assert _loaded_after("import kvredis; kvredis.parse_address('h:1')") == set()
    assert _loaded_after("import kvredis.redis; kvredis.redis.RedisIndex") == {"redis"}

"""``kvredis check`` as the differential tests run it after every step."""

from __future__ import annotations

from kvredis.redis.cluster.inspect import ClusterInspector
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.inspect import Finding, Inspector, op_check


def check_findings(config: RedisIndexConfig) -> list[Finding]:
    """What ``check`` finds wrong in the namespace of ``config`` (per shard on a cluster);
    its notes (legitimate states) are not findings."""
    if config.cluster:
        with ClusterInspector(config) as cluster:
            return cluster.check().findings
    with Inspector(config) as inspector:
        layout = inspector.layout()
        assert layout is not None, f"namespace {config.namespace!r} does not exist"
        return inspector.run(op_check(layout)).findings

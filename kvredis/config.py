"""Choosing and configuring an index backend, in the upstream llm-d JSON shape or in Python."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvredis.errors import ConfigError
from kvredis.index import Index
from kvredis.jsonconfig import parse_duration, take_fields
from kvredis.memory import (
    CostAwareMemoryIndex,
    CostAwareMemoryIndexConfig,
    InMemoryIndex,
    InMemoryIndexConfig,
)

if TYPE_CHECKING:
    from types import ModuleType

    from kvredis.redis.config import RedisIndexConfig

logger = logging.getLogger(__name__)

_FIELDS = {
    "inMemoryConfig": "in_memory_config",
    "redisConfig": "redis_config",
    "valkeyConfig": "valkey_config",
    "costAwareMemoryConfig": "cost_aware_memory_config",
    "enableMetrics": "enable_metrics",
    "metricsLoggingInterval": "metrics_logging_interval",
}


def _redis_module() -> ModuleType:
    try:
        import kvredis.redis.factories as module
    except ImportError as exc:
        raise ConfigError(f"the Redis/Valkey backend is not available: {exc}") from exc
    return module


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Which backend :func:`new_index` builds, and its settings.

    ``None`` means "not configured". :func:`new_index` builds the first configured of
    cost-aware memory, Valkey, Redis and in-memory, and the in-memory index with its defaults
    when nothing is configured. ``enable_metrics`` wraps that index in a
    :class:`~kvredis.metrics.InstrumentedIndex`; ``metrics_logging_interval`` (seconds, 0: off)
    then logs a one-line summary of the metrics that often (it needs ``enable_metrics``).
    """

    in_memory_config: InMemoryIndexConfig | None = None
    redis_config: RedisIndexConfig | None = None
    valkey_config: RedisIndexConfig | None = None
    cost_aware_memory_config: CostAwareMemoryIndexConfig | None = None
    enable_metrics: bool = False
    metrics_logging_interval: float = 0.0

    def __post_init__(self) -> None:
        if self.in_memory_config is not None and not isinstance(
            self.in_memory_config, InMemoryIndexConfig
        ):
            raise ConfigError(
                f"in_memory_config must be an InMemoryIndexConfig, got {self.in_memory_config!r}"
            )
        if self.cost_aware_memory_config is not None and not isinstance(
            self.cost_aware_memory_config, CostAwareMemoryIndexConfig
        ):
            raise ConfigError(
                "cost_aware_memory_config must be a CostAwareMemoryIndexConfig, got "
                f"{self.cost_aware_memory_config!r}"
            )
        for name in ("redis_config", "valkey_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, _redis_module().RedisIndexConfig):
                raise ConfigError(f"{name} must be a RedisIndexConfig or a mapping, got {value!r}")
        if not isinstance(self.enable_metrics, bool):
            raise ConfigError(f"enable_metrics must be a bool, got {self.enable_metrics!r}")
        interval = self.metrics_logging_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ConfigError(
                f"metrics_logging_interval must be a number of seconds, got {interval!r}"
            )
        object.__setattr__(self, "metrics_logging_interval", parse_duration(interval))

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> IndexConfig:
        """Build from the upstream JSON shape.

        Keys: ``inMemoryConfig`` (``size``, ``podCacheSize``), ``costAwareMemoryConfig``
        (``size``), ``redisConfig`` and ``valkeyConfig`` (``address``, ``backendType``,
        ``enableRDMA``, ...), ``enableMetrics``, ``metricsLoggingInterval`` (seconds, or a Go
        duration string such as ``"30s"``). The snake_case field names are accepted too; a
        ``null`` value means not configured; any other key raises ``ConfigError`` naming it.
        """
        raw = take_fields("index config", mapping, _FIELDS)
        kwargs: dict[str, Any] = {}
        memory = raw.get("in_memory_config")
        if memory is not None:
            kwargs["in_memory_config"] = (
                memory
                if isinstance(memory, InMemoryIndexConfig)
                else InMemoryIndexConfig.from_dict(memory)
            )
        cost_aware = raw.get("cost_aware_memory_config")
        if cost_aware is not None:
            kwargs["cost_aware_memory_config"] = (
                cost_aware
                if isinstance(cost_aware, CostAwareMemoryIndexConfig)
                else CostAwareMemoryIndexConfig.from_dict(cost_aware)
            )
        for name in ("redis_config", "valkey_config"):
            value = raw.get(name)
            if value is None:
                continue
            module = _redis_module()
            if not isinstance(value, Mapping):
                kwargs[name] = value  # checked by __post_init__
                continue
            data = dict(value)
            if name == "valkey_config":
                if "backendType" not in data and "backend_type" not in data:
                    data["backendType"] = "valkey"
                if data.get("address") is None:
                    data["address"] = "valkey://127.0.0.1:6379"
            kwargs[name] = module.RedisIndexConfig.from_dict(data)
        if raw.get("enable_metrics") is not None:
            kwargs["enable_metrics"] = raw["enable_metrics"]
        if raw.get("metrics_logging_interval") is not None:
            kwargs["metrics_logging_interval"] = parse_duration(raw["metrics_logging_interval"])
        return cls(**kwargs)


def new_index(
    config: IndexConfig | Mapping[str, Any] | None = None, *, registry: Any = None
) -> Index:
    """Build the index ``config`` selects: cost-aware, Valkey, Redis or in-memory, in that order.

    ``config`` may also be the upstream JSON shape (see :meth:`IndexConfig.from_dict`); ``None``
    gives the default in-memory index. With ``enable_metrics`` the index is wrapped in an
    :class:`~kvredis.metrics.InstrumentedIndex` exporting to ``registry`` (a
    ``prometheus_client.CollectorRegistry``; default: the global one), which keeps every
    capability of the index.
    """
    cfg = _index_config(config)
    index = _backend(cfg)
    if not cfg.enable_metrics:
        if cfg.metrics_logging_interval > 0:
            logger.warning(
                "metrics_logging_interval is set but enable_metrics is not: nothing to log"
            )
        return index
    from kvredis.metrics import InstrumentedIndex, start_metrics_logging

    instrumented: Index = InstrumentedIndex(index, registry=registry)
    if cfg.metrics_logging_interval > 0:
        start_metrics_logging(cfg.metrics_logging_interval, registry, owner=instrumented)
    return instrumented


def _index_config(config: IndexConfig | Mapping[str, Any] | None) -> IndexConfig:
    if config is None:
        cfg = IndexConfig()
    elif isinstance(config, IndexConfig):
        cfg = config
    elif isinstance(config, Mapping):
        cfg = IndexConfig.from_dict(config)
    else:
        raise ConfigError(f"config must be an IndexConfig or a mapping, got {config!r}")
    return cfg


def _backend(cfg: IndexConfig) -> Index:
    if cfg.cost_aware_memory_config is not None:
        return CostAwareMemoryIndex(cfg.cost_aware_memory_config)
    if cfg.valkey_config is not None:
        index: Index = _redis_module().new_valkey_index(cfg.valkey_config)
        return index
    if cfg.redis_config is not None:
        index = _redis_module().new_redis_index(cfg.redis_config)
        return index
    return InMemoryIndex(cfg.in_memory_config)

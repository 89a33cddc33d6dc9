"""IndexConfig (the upstream JSON shape), durations and new_index's choice of backend."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvredis.config import IndexConfig, new_index
from kvredis.errors import ConfigError
from kvredis.jsonconfig import parse_duration
from kvredis.memory import (
    CostAwareMemoryIndex,
    CostAwareMemoryIndexConfig,
    InMemoryIndex,
    InMemoryIndexConfig,
)
from kvredis.types import PodEntry


@pytest.mark.parametrize(
    "value,seconds",
    [
        ("30s", 30.0),
        ("1m30s", 90.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        ("1.5h", 5400.0),
        ("2h45m", 9900.0),
        ("1h2m3s4ms", 3723.004),
        ("250us", 250e-6),
        ("250µs", 250e-6),
        ("250μs", 250e-6),
        ("10ns", 10e-9),
        ("+5s", 5.0),
        (".5s", 0.5),
        ("0", 0.0),
        ("0s", 0.0),
        (15, 15.0),
        (0.25, 0.25),
        (0, 0.0),
    ],
)
def test_parse_duration(value: Any, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "30",
        "1x",
        "-1s",
        "s",
        "1m30",
        "1.5.5s",
        "1 s",
        "5S",
        -1,
        -0.5,
        True,
        None,
        float("inf"),
        float("nan"),
        [30],
    ],
)
def test_parse_duration_rejects(bad: Any) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_from_dict_accepts_the_upstream_json_shape() -> None:
    raw = json.loads(
        """{"inMemoryConfig": {"size": 5000, "podCacheSize": 4},
            "costAwareMemoryConfig": {"size": "1.5GiB"},
            "enableMetrics": true,
            "metricsLoggingInterval": "1m30s"}"""
    )
    cfg = IndexConfig.from_dict(raw)
    assert cfg.in_memory_config == InMemoryIndexConfig(size=5000, pod_cache_size=4)
    assert cfg.cost_aware_memory_config == CostAwareMemoryIndexConfig("1.5GiB")
    assert cfg.cost_aware_memory_config.max_cost() == 1536 * 2**20
    assert cfg.enable_metrics is True
    assert cfg.metrics_logging_interval == 90.0
    assert cfg.redis_config is None and cfg.valkey_config is None


def test_from_dict_defaults_and_nulls() -> None:
    assert IndexConfig.from_dict({}) == IndexConfig()
    cfg = IndexConfig.from_dict(
        {"inMemoryConfig": None, "redisConfig": None, "metricsLoggingInterval": 2.5}
    )
    assert cfg.in_memory_config is None and cfg.redis_config is None
    assert cfg.metrics_logging_interval == 2.5
    assert IndexConfig().enable_metrics is False
    assert IndexConfig().metrics_logging_interval == 0.0
    snake = IndexConfig.from_dict(
        {"in_memory_config": {"size": 3, "pod_cache_size": 2}, "enable_metrics": False}
    )
    assert snake.in_memory_config == InMemoryIndexConfig(3, 2)
    assert IndexConfig.from_dict({"inMemoryConfig": {}}).in_memory_config == InMemoryIndexConfig()


def test_unknown_keys_are_named() -> None:
    with pytest.raises(ConfigError, match="'inMemoryConfg'") as info:
        IndexConfig.from_dict({"inMemoryConfg": {}, "enableMetrics": True})
    assert "inMemoryConfig" in str(info.value)  # the message lists what is accepted
    with pytest.raises(ConfigError, match="'podcachesize'"):
        IndexConfig.from_dict({"inMemoryConfig": {"podcachesize": 3}})
    with pytest.raises(ConfigError, match="'maxCost'"):
        IndexConfig.from_dict({"costAwareMemoryConfig": {"maxCost": 3}})
    with pytest.raises(ConfigError, match="twice"):
        IndexConfig.from_dict({"enableMetrics": True, "enable_metrics": True})


@pytest.mark.parametrize(
    "raw",
    [
        {"inMemoryConfig": {"size": 0}},
        {"inMemoryConfig": {"size": "big"}},
        {"inMemoryConfig": {"podCacheSize": -1}},
        {"inMemoryConfig": [1, 2]},
        {"costAwareMemoryConfig": {"size": "2 parsecs"}},
        {"enableMetrics": "yes"},
        {"metricsLoggingInterval": "-30s"},
        {"metricsLoggingInterval": "often"},
    ],
)
def test_bad_values_raise_config_error(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        IndexConfig.from_dict(raw)


def test_constructor_validates() -> None:
    with pytest.raises(ConfigError):
        IndexConfig(in_memory_config={"size": 3})  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        IndexConfig(cost_aware_memory_config="2GiB")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        IndexConfig(metrics_logging_interval=-1)
    with pytest.raises(ConfigError):
        IndexConfig(metrics_logging_interval="30s")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        IndexConfig(enable_metrics=1)  # type: ignore[arg-type]
    assert IndexConfig(metrics_logging_interval=3).metrics_logging_interval == 3.0


def test_new_index_defaults_to_in_memory() -> None:
    index = new_index()
    assert isinstance(index, InMemoryIndex)
    assert index.config == InMemoryIndexConfig()
    index.add(None, [1], [PodEntry("p", "gpu")])
    assert index.lookup([1]) == {1: [PodEntry("p", "gpu")]}


def test_new_index_uses_the_in_memory_settings() -> None:
    index = new_index({"inMemoryConfig": {"size": 2, "podCacheSize": 1}})
    assert isinstance(index, InMemoryIndex)
    index.add(None, [1, 2, 3], [PodEntry("p", "gpu"), PodEntry("q", "gpu")])
    assert index.lookup([1]) == {}
    assert index.lookup([2, 3]) == {2: [PodEntry("q", "gpu")], 3: [PodEntry("q", "gpu")]}
    same = new_index(IndexConfig(in_memory_config=InMemoryIndexConfig(size=2, pod_cache_size=1)))
    assert isinstance(same, InMemoryIndex) and same.config == index.config


def test_cost_aware_comes_first() -> None:
    index = new_index({"inMemoryConfig": {"size": 10}, "costAwareMemoryConfig": {"size": "1MiB"}})
    assert isinstance(index, CostAwareMemoryIndex)
    assert index.max_cost() == 2**20
    assert isinstance(new_index({"costAwareMemoryConfig": {}}), CostAwareMemoryIndex)


def test_new_index_rejects_other_types() -> None:
    with pytest.raises(ConfigError):
        new_index("inMemory")  # type: ignore[arg-type]


# -- Redis and Valkey --------------------------------------------------------------------------


def _redis_module() -> Any:
    return pytest.importorskip("kvredis.redis.index")


@pytest.mark.redis
def test_redis_and_valkey_configs_are_parsed_and_valkey_wins(redis_server_url: str) -> None:
    module = _redis_module()
    raw = {
        "inMemoryConfig": {"size": 10},
        "redisConfig": {"address": "redis://127.0.0.1:1", "namespace": "kvt-config-redis"},
        "valkeyConfig": {"address": redis_server_url, "namespace": "kvt-config-valkey"},
    }
    cfg = IndexConfig.from_dict(raw)
    assert isinstance(cfg.redis_config, module.RedisIndexConfig)
    assert isinstance(cfg.valkey_config, module.RedisIndexConfig)
    assert cfg.redis_config.backend_type == "redis"
    assert cfg.valkey_config.backend_type == "valkey"
    assert cfg.valkey_config.namespace == "kvt-config-valkey"
    index: Any = new_index(cfg)  # valkey comes before redis (whose address would not connect)
    try:
        assert isinstance(index, module.RedisIndex)
        index.add(None, [5], [PodEntry("p", "gpu")])
        assert index.lookup([5]) == {5: [PodEntry("p", "gpu")]}
    finally:
        index.close()


@pytest.mark.redis
def test_redis_config_builds_a_redis_index(redis_server_url: str, namespace: str) -> None:
    module = _redis_module()
    index: Any = new_index({"redisConfig": {"address": redis_server_url, "namespace": namespace}})
    try:
        assert isinstance(index, module.RedisIndex)
        assert len(index.lookup([1, 2])) == 0
    finally:
        index.close()


def test_valkey_config_defaults_to_the_valkey_address() -> None:
    module = _redis_module()
    cfg = IndexConfig.from_dict({"valkeyConfig": {}})
    assert isinstance(cfg.valkey_config, module.RedisIndexConfig)
    assert cfg.valkey_config.backend_type == "valkey"
    assert cfg.valkey_config.address.startswith("valkey://")


def test_valkey_config_accepts_snake_case_keys() -> None:
    cfg = IndexConfig.from_dict(
        {"valkeyConfig": {"address": "valkey://h:7000", "backend_type": "valkey"}}
    )
    assert cfg.valkey_config is not None and cfg.valkey_config.backend_type == "valkey"
    cfg = IndexConfig.from_dict({"valkey_config": {"enable_rdma": False, "address": None}})
    assert cfg.valkey_config is not None and cfg.valkey_config.address.startswith("valkey://")


def test_cost_aware_wins_over_configured_servers_without_connecting() -> None:
    _redis_module()
    index = new_index(
        {
            "costAwareMemoryConfig": {"size": "10MB"},
            "valkeyConfig": {"address": "valkey://127.0.0.1:1"},
            "redisConfig": {"address": "redis://127.0.0.1:1"},
        }
    )
    assert isinstance(index, CostAwareMemoryIndex)
    assert index.max_cost() == 10**7


def test_bad_redis_config_raises_config_error() -> None:
    _redis_module()
    with pytest.raises(ConfigError, match="'adress'"):
        IndexConfig.from_dict({"redisConfig": {"adress": "redis://127.0.0.1:6379"}})
    with pytest.raises(ConfigError):
        IndexConfig.from_dict({"redisConfig": "redis://127.0.0.1:6379"})
    with pytest.raises(ConfigError):
        IndexConfig(redis_config={"address": "redis://127.0.0.1:6379"})  # type: ignore[arg-type]

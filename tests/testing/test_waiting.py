"""LocalCluster's waits ride out a node that is down or still loading its data (a revived
node answers ``LOADING`` until its dataset is in memory), and stop on any other error."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from kvredis.testing.servers import LocalCluster


def _flaky(errors: list[Exception]) -> Callable[[], bool]:
    def check() -> bool:
        if errors:
            raise errors.pop(0)
        return True

    return check


def test_a_node_loading_or_refusing_connections_is_waited_for() -> None:
    errors: list[Exception] = [
        redis.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.ConnectionError("Connection refused"),
        redis.TimeoutError("Timeout reading from socket"),
    ]
    LocalCluster._wait(_flaky(errors), 5.0, "the test")
    assert errors == []


def test_any_other_error_stops_the_wait() -> None:
    with pytest.raises(redis.ResponseError, match="ERR unknown"):
        LocalCluster._wait(_flaky([redis.ResponseError("ERR unknown command")]), 5.0, "the test")

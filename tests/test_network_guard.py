"""The suite's network guard refuses, before any packet, every connection beyond loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import zmq

from tests import network_guard
from tests.network_guard import NonLoopbackConnectionError, is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("10.0.0.5", False),
        ("192.168.1.1", False),
        ("0.0.0.0", False),
        ("::ffff:10.0.0.5", False),
        ("redis.example", False),
    ],
)
def test_loopback_is_told_apart(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_socket_connect_beyond_loopback_is_refused_and_recorded() -> None:
    with socket.socket() as sock, pytest.raises(NonLoopbackConnectionError, match=r"10\.0\.0\.5"):
        sock.connect(("10.0.0.5", 6379))
    with pytest.raises(NonLoopbackConnectionError):
        socket.create_connection(("192.168.0.1", 80), timeout=0.1)
    assert len(network_guard.take_violations()) == 2


def test_a_swallowed_refusal_still_fails_the_test() -> None:
    with contextlib.suppress(OSError):  # what a retry loop does
        socket.create_connection(("10.1.2.3", 5557), timeout=0.1)
    assert network_guard.take_violations() == [
        "a test connected beyond loopback: socket connect to 10.1.2.3:5557"
    ]


async def test_asyncio_connections_are_checked_too() -> None:
    with pytest.raises(NonLoopbackConnectionError):
        await asyncio.open_connection("10.0.0.9", 6379)
    assert network_guard.take_violations()


def test_a_zmq_endpoint_beyond_loopback_is_refused_before_connecting() -> None:
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        with pytest.raises(NonLoopbackConnectionError, match=r"tcp://10\.0\.0\.5:5557"):
            sub.connect("tcp://10.0.0.5:5557")
        sub.connect("tcp://127.0.0.1:5557")  # loopback passes
        sub.connect("ipc:///tmp/kvredis-guard-test")
        sub.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    assert len(network_guard.take_violations()) == 1


def test_loopback_connections_pass(redis_server_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_server_url)
    try:
        assert client.ping()
    finally:
        client.close()
    assert network_guard.take_violations() == []

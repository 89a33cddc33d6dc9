"""MOVED and ASK replies as typed values, from text and from a real cluster."""

from __future__ import annotations

import pytest

from kvredis.redis.cluster.redirect import Redirect, RedirectKind, parse_redirect
from kvredis.redis.cluster.slots import key_slot
from tests.servers import LocalCluster


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("MOVED 3999 127.0.0.1:6381", Redirect(RedirectKind.MOVED, 3999, "127.0.0.1", 6381)),
        (b"ASK 16383 10.0.0.7:7000", Redirect(RedirectKind.ASK, 16383, "10.0.0.7", 7000)),
        ("MOVED 0 ::1:6381", Redirect(RedirectKind.MOVED, 0, "::1", 6381)),
        ("MOVED 5 [fe80::1]:7001", Redirect(RedirectKind.MOVED, 5, "fe80::1", 7001)),
        ("MOVED 12 :6380", Redirect(RedirectKind.MOVED, 12, "", 6380)),
        ("MOVED 1 r-0.svc:6379", Redirect(RedirectKind.MOVED, 1, "r-0.svc", 6379)),
    ],
)
def test_redirects_parse(message: str | bytes, expected: Redirect) -> None:
    assert parse_redirect(message) == expected


@pytest.mark.parametrize(
    "message",
    [
        "MOVED",
        "MOVED 3999",
        "MOVED x 127.0.0.1:6381",
        "MOVED 16384 127.0.0.1:6381",
        "MOVED 1 127.0.0.1",
        "MOVED 1 127.0.0.1:0",
        "MOVED 1 127.0.0.1:port",
        "ASKING 1 h:1",
        "moved 1 h:1",
        "ERR unknown command",
        "MOVED 1 h:1 extra",
    ],
)
def test_other_replies_are_no_redirects(message: str) -> None:
    assert parse_redirect(message) is None


def test_an_empty_host_means_the_node_that_replied() -> None:
    redirect = parse_redirect("MOVED 12 :6380")
    assert redirect is not None
    assert redirect.address("10.1.2.3") == ("10.1.2.3", 6380)
    assert Redirect(RedirectKind.ASK, 1, "h", 2).address("other") == ("h", 2)


def test_a_real_moved_reply_names_the_owner(redis_cluster: LocalCluster) -> None:
    import redis

    from kvredis.redis.executor import failure

    topology = redis_cluster.topology()
    owners = {p: slots for p, (role, _, slots) in topology.items() if role == "master"}
    asked = next(iter(owners))
    key = next(
        f"k{i}".encode() for i in range(10000) if not _serves(owners[asked], key_slot(f"k{i}"))
    )
    client = redis.Redis(port=asked)
    try:
        with pytest.raises(redis.ResponseError) as caught:
            client.execute_command("GET", key)
    finally:
        client.close()
    # the reply as the executors hand it on, whatever redis-py made of it (its cluster
    # client maps MOVED to a class and cuts the code off, its plain client may not)
    redirect = parse_redirect(failure(caught.value).message)
    assert redirect is not None and redirect.slot == key_slot(key)
    assert _serves(owners[redirect.port], redirect.slot)
    assert redirect.address("127.0.0.1") == ("127.0.0.1", redirect.port)


def _serves(slots: str, slot: int) -> bool:
    for part in slots.split():
        first, _, last = part.partition("-")
        if int(first) <= slot <= int(last or first):
            return True
    return False

"""op_migrate without a server: the requests it sends and what it makes of scripted replies."""

from __future__ import annotations

from typing import Any

import pytest

from kvredis import ConfigError, NamespaceLayoutError, NamespaceMissingError, StaleNamespaceError
from kvredis.redis import requests as rq
from kvredis.redis.layout import LAYOUT_VERSION
from kvredis.redis.migrate import op_migrate

KEYS = (b"ns:meta", b"ns:pi", b"ns:sx", b"ns:mx")


def _drive(op: rq.Op[Any], replies: list[Any]) -> tuple[list[rq.Request], Any]:
    """Run ``op`` answering its requests in order; an exception reply is thrown into it."""
    sent: list[rq.Request] = []
    answers = iter(replies)
    outcome: Any = None
    while True:
        try:
            failed = isinstance(outcome, Exception)
            request = op.throw(outcome) if failed else op.send(outcome)
        except StopIteration as stop:
            assert not list(answers)
            return sent, stop.value
        sent.append(request)
        outcome = next(answers)


def test_begin_converts_a_first_page_then_pages_follow_until_no_pair_is_left() -> None:
    seen: list[tuple[int, int]] = []
    op = op_migrate("ns", "field", lambda d, t: seen.append((d, t)), pairs_per_call=3)
    replies = [[b"begun", b"g2", 5, 8, 2, 1], [b"12"], [2, 1, 2], [2, 0, 0]]
    sent, report = _drive(op, replies)
    begin = sent[0]
    assert isinstance(begin, rq.ScriptCall) and begin.script == "migrate" and begin.keys == KEYS
    args = list(begin.args)
    assert args[:3] == ["begin", "kvredis-kvblock/1", LAYOUT_VERSION]
    assert args[4:] == ["field", b"ns:r:", 3]
    assert sent[1] == rq.Command(("HMGET", b"ns:meta", "bucket_bits"))
    assert sent[2] == rq.ScriptCall("migrate", KEYS, ("page", b"g2", b"ns:r:", 12, 3))
    assert sent[3] == sent[2]
    assert seen == [(3, 8), (6, 8), (8, 8)]
    assert (report.migrated, report.resumed, report.pairs, report.moved, report.dropped) == (
        True,
        False,
        8,
        6,
        2,
    )
    assert report.source == "kvredis-kvblock/1" and report.target == LAYOUT_VERSION


def test_a_namespace_without_pairs_or_in_this_layout_needs_no_page() -> None:
    begun = [b"begun", b"g2", 0, 4, 3, 1]  # all converted in the first call
    sent, report = _drive(op_migrate("ns", "key"), [begun, [b"16"]])
    assert len(sent) == 2 and report.migrated and (report.pairs, report.moved) == (4, 3)
    sent, report = _drive(op_migrate("ns", "key"), [[b"current", b"g", 0, 0, 0, 0]])
    assert len(sent) == 1 and not report.migrated and report.source is None
    resume = [b"resume", b"g", 1, 9, 0, 0]
    sent, report = _drive(op_migrate("ns", "key"), [resume, [b"16"], [1, 0, 0]])
    assert report.resumed and report.pairs == 9 and report.moved == 1


@pytest.mark.parametrize(
    ("reply", "error", "text"),
    [
        (
            [b"missing", b"", 0, 0, 0, 0],
            NamespaceMissingError,
            "namespace 'ns' does not exist at h",
        ),
        (
            [b"dropping", b"dropping:x", 0, 0, 0, 0],
            NamespaceLayoutError,
            "`kvredis drop --redis h ns",
        ),
        ([b"other", b"kvredis-kvblock/3", 0, 0, 0, 0], NamespaceLayoutError, "upgrade kvredis"),
        (
            [b"other", b"other/1", 0, 0, 0, 0],
            NamespaceLayoutError,
            "'other/1', which is no kvredis",
        ),
    ],
)
def test_what_cannot_be_migrated_says_what_to_do(
    reply: list[Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text.replace("(", r"\(")) as caught:
        _drive(op_migrate("ns", "key", address="h"), [reply])
    assert "b'" not in str(caught.value)


def test_a_drop_midway_stops_the_migration_and_bad_page_sizes_are_refused() -> None:
    stale = StaleNamespaceError("namespace layout changed or was removed; reload it")
    with pytest.raises(StaleNamespaceError, match="dropped or recreated while it was being"):
        _drive(op_migrate("ns", "key"), [[b"begun", b"g2", 4, 4, 0, 0], [b"16"], stale])
    for bad in (0, 10_001):
        with pytest.raises(ConfigError):
            _drive(op_migrate("ns", "key", pairs_per_call=bad), [])


def test_the_command_line_pages_as_the_api_does() -> None:
    from kvredis.cli import migrate as cli
    from kvredis.redis.migrate import MAX_PAIRS_PER_CALL, PAIRS_PER_CALL

    assert cli.PAIRS_PER_CALL == PAIRS_PER_CALL
    assert cli.MAX_PAIRS_PER_CALL == MAX_PAIRS_PER_CALL


@pytest.mark.parametrize(
    ("reply", "text"),
    [
        ([b"kvredis-cluster/9", b"8"], "written by a newer kvredis (this one reads kvredis-clus"),
        ([b"kvredis-cluster/1", b"zero"], "has an invalid shard count 'zero'"),
    ],
)
def test_cluster_descriptor_errors_show_text_and_say_when_to_upgrade(
    reply: list[bytes], text: str
) -> None:
    from kvredis.redis.cluster.shards import parse_descriptor

    with pytest.raises(NamespaceLayoutError, match=text.replace("(", r"\(")) as caught:
        parse_descriptor(reply, "ns")
    assert "b'" not in str(caught.value)

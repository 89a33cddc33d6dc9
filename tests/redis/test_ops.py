"""The sans-IO core without a server: the requests each operation yields, how replies decode, and
the combinators (NOSCRIPT reload, retry with backoff, stale-namespace reload, error translation),
driven with scripted replies."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvredis import (
    AddOp,
    BackendAuthenticationError,
    BackendError,
    BackendUnavailableError,
    CallBudgetError,
    EngineKeyNotFoundError,
    EvictOp,
    InvalidInputError,
    KeyType,
    NamespaceLayoutError,
    PodEntry,
    StaleNamespaceError,
    UnsafeServerConfigError,
    Watermark,
)
from kvredis.checks import MAX_REQUEST_KEYS_PER_ENGINE_KEY
from kvredis.errors import translate
from kvredis.redis import ops, program
from kvredis.redis import requests as rq
from kvredis.redis import session as sessions
from kvredis.redis.codec import encode_entry, hash_field
from kvredis.redis.functions import API_VERSION
from kvredis.redis.layout import LAYOUT_VERSION, Layout
from kvredis.redis.scripts import ScriptRegistry
from kvredis.redis.state import CoreState

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu", speculative=True)
GEN = b"0123456789abcdef"
NOSCRIPT = "NOSCRIPT No matching script. Please use EVAL."
SERVER = "redis at h:6379"


def _id(n: int) -> bytes:
    return struct.pack(">I", n)


def _blob(*hashes: int) -> bytes:
    return b"".join(hash_field(h) for h in hashes)


def _state(bits: int = 16) -> CoreState:
    state = CoreState("ns", bits)
    state.adopt([LAYOUT_VERSION.encode(), str(bits).encode(), GEN])
    return state


def _session(
    state: CoreState | None = None, retries: int = 2, backoff: float = 0.05
) -> ops.Session:
    return ops.Session(
        _state() if state is None else state,
        ScriptRegistry(),
        sessions.RetryPolicy(retries, backoff, SERVER),
    )


class Exchange:
    """Drives an operation like an executor, answering each request from a script of replies.

    Each reply is a value, a Failure (thrown into the operation), or a callable that computes
    either from the request. ``requests`` records what the operation sent.
    """

    def __init__(self, replies: Sequence[Any]) -> None:
        self.replies: Iterator[Any] = iter(replies)
        self.requests: list[rq.Request] = []

    def run(self, op: rq.Op[Any]) -> Any:
        outcome: Any = None
        while True:
            try:
                failed = isinstance(outcome, rq.Failure)
                request = op.throw(outcome) if failed else op.send(outcome)
            except StopIteration as stop:
                rest = list(self.replies)
                assert not rest, f"replies left over: {rest}"
                return stop.value
            self.requests.append(request)
            try:
                reply = next(self.replies)
            except StopIteration:
                raise AssertionError(f"no reply scripted for {request!r}") from None
            outcome = reply(request) if callable(reply) else reply


def _one(op: rq.Op[Any], reply: Any = None) -> tuple[rq.Request, Any]:
    """The single request ``op`` yields, and its result for ``reply``."""
    exchange = Exchange([reply])
    result = exchange.run(op)
    (request,) = exchange.requests
    return request, result


# -- what each operation sends, and how it decodes the reply ----------------------------------


def test_load_namespace_pings_then_creates_or_reads_the_meta_record() -> None:
    state = CoreState("ns", 12)
    exchange = Exchange([b"PONG", [None, None, None], [LAYOUT_VERSION.encode(), b"10", GEN]])
    layout = exchange.run(ops.op_load_namespace(state, ping=True))
    ping, read, call = exchange.requests
    assert ping == rq.Command(("PING",))
    assert read == rq.Command(("HMGET", b"ns:meta", "layout", "bucket_bits", "gen", "scheme"))
    assert isinstance(call, rq.ScriptCall) and call.script == "namespace"
    assert call.keys == (b"ns:meta", b"ns:pi")
    assert call.args[:2] == (LAYOUT_VERSION, 12) and len(call.args[2]) == 16
    assert call.args[4] == API_VERSION  # the api the namespace records
    assert isinstance(layout, Layout) and layout.bucket_bits == 10 and layout.gen == GEN
    assert state.layout is layout
    # An existing record is only read: a reader starts on a replica and under maxmemory.
    state = CoreState("ns", 12)
    exchange = Exchange([[LAYOUT_VERSION.encode(), b"10", GEN]])
    assert exchange.run(ops.op_load_namespace(state, ping=False)).gen == GEN


def test_load_namespace_finishes_a_drop_it_finds_then_creates_the_namespace() -> None:
    tomb = b"dropping:abc"
    exchange = Exchange(
        [
            [LAYOUT_VERSION.encode(), b"16", tomb],  # HMGET: a drop in progress
            [b"0", [b"ns:pe", b"ns:prod:pe", b"ns:meta"]],  # SCAN
            1,  # drop page (ns:pe only: ns:prod is another namespace)
            1,  # drop end
            [None, None, None],  # HMGET: gone
            [LAYOUT_VERSION.encode(), b"16", GEN],  # namespace script
        ]
    )
    state = CoreState("ns")
    assert exchange.run(ops.op_load_namespace(state, ping=False)).gen == GEN
    page = exchange.requests[2]
    assert page == rq.ScriptCall("drop", (b"ns:meta", b"ns:pe"), ("page", tomb))
    assert exchange.requests[3] == rq.ScriptCall("drop", (b"ns:meta",), ("end", tomb))


@pytest.mark.parametrize(
    "reply",
    [[b"someone-else/2", b"16", GEN], [LAYOUT_VERSION.encode(), b"99", GEN], [None, None, None]],
)
def test_a_foreign_or_broken_meta_record_is_a_layout_error(reply: list[Any]) -> None:
    with pytest.raises(NamespaceLayoutError):
        exchange = Exchange([reply] if all(reply) else [reply, reply])
        exchange.run(ops.op_load_namespace(CoreState("ns"), ping=False))


def test_lookup_sends_the_chain_as_one_blob_and_decodes_through_the_entry_cache() -> None:
    state = _state()
    defs = [_id(1), encode_entry(A), _id(2), encode_entry(B)]
    request, result = _one(
        ops.op_lookup(state, [5, 2**64 - 1, 7], {"pod-a"}),
        [2, defs, [], 1, _id(1) + _id(2), 1, _id(2)],
    )
    assert request == rq.ScriptCall(
        "lookup",
        (b"ns:meta", b"ns:pi", b"ns:pp", b"ns:sx"),
        (GEN, b"ns:r:", 16, 0, 1, b"pod-a", _blob(5, 2**64 - 1, 7), 0, 0),
        read=True,
    )
    assert result == {5: [A, B], 2**64 - 1: [B]}  # the walk stopped before key 7
    assert state.cache.floor == 2
    request, result = _one(ops.op_lookup(state, [5], None), [2, [], [], 1, _id(2)])
    assert isinstance(request, rq.ScriptCall) and request.args[3:5] == (2, 0)  # floor, no filter
    assert result == {5: [B]}


def test_lookup_of_an_id_the_client_never_learned_is_stale() -> None:
    with pytest.raises(StaleNamespaceError):
        _one(ops.op_lookup(_state(), [5], None), [0, [], [], 1, _id(9)])


def test_empty_chains_and_bad_input_send_nothing() -> None:
    state = _state()
    assert Exchange([]).run(ops.op_lookup(state, [], None)) == {}
    assert Exchange([]).run(ops.op_score(state, [], None, None)) == {}
    for op in (
        ops.op_lookup(state, [-1], None),
        ops.op_add(state, None, [1], []),
        ops.op_evict(state, 2**64, KeyType.ENGINE, [A]),
        ops.op_get_request_key(state, "7"),  # type: ignore[arg-type]
        ops.op_clear(state, "pod-a", progress=5),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidInputError):
            Exchange([]).run(op)


def test_score_sends_weights_and_decodes_scores() -> None:
    request, result = _one(
        ops.op_score(_state(), [1, 2], {"gpu": 1.0, "cpu": 0.5}, None),
        [2, 0, b"pod-a", 0, b"2", 1, b"", b"pod-b", 0, b"0.5", 0, b"", b"pod-b", 1, b"1", 0, b""],
    )
    assert request == rq.ScriptCall(
        "score",
        (b"ns:meta", b"ns:pi", b"ns:pp", b"ns:sx"),
        (GEN, b"ns:r:", 16, 0, 2, b"gpu", "1.0", b"cpu", "0.5", "1.0", _blob(1, 2), 0, 0),
        read=True,
    )
    assert result == {"pod-a": 2.0, "pod-b": 1.0}  # each pod's best rank


def test_a_long_chain_is_scored_in_parts_from_the_scores_reached() -> None:
    """A chain longer than one call's keys goes in parts; each part carries the pods still in
    the race with their scores so far, and the next part is sent only while one is left."""
    keys = list(range(1, 2 * ops.SCORE_KEYS_PER_CALL + 11))
    part = ops.SCORE_KEYS_PER_CALL
    third = 0.1 * 3
    exchange = Exchange(
        [
            [part, 0, b"pod-a", 2, repr(third).encode(), 1, b"7@", b"pod-b", 0, b"0.5", 0, b""],
            [part - 7, 1, b"pod-a", 2, b"12.5", 1, b"7@99"],  # stopped at the walk's work limit
            [3, 0, b"pod-a", 2, b"13.25", 1, b""],  # a key no pod holds: the chain ends here
        ]
    )
    result = exchange.run(ops.op_score_by_rank(_state(), keys, {"gpu": 1.0}, None))
    assert result == {"pod-a": {2: 13.25}, "pod-b": {0: 0.5}}
    calls = [r for r in exchange.requests if isinstance(r, rq.ScriptCall)]
    head = (GEN, b"ns:r:", 16, 0, 1, b"gpu", "1.0", "1.0")
    assert [c.args[: len(head)] for c in calls] == [head] * 3
    assert [c.args[len(head) :] for c in calls] == [
        (_blob(*keys[:part]), 1, 0),
        (_blob(*keys[part : 2 * part]), 1, 1, b"pod-a", 2, repr(third), b"7@"),
        # on from the first key not walked, with the stamp the latest part gave
        (_blob(*keys[2 * part - 7 :]), 0, 1, b"pod-a", 2, "12.5", b"7@99"),
    ]


def test_scoring_stops_once_no_pod_is_left() -> None:
    keys = list(range(1, ops.SCORE_KEYS_PER_CALL + 2))
    exchange = Exchange([[ops.SCORE_KEYS_PER_CALL, 0, b"pod-a", 0, b"3", 0, b""]])
    assert exchange.run(ops.op_score(_state(), keys, None, None)) == {"pod-a": 3.0}


def test_add_sends_one_op_with_interned_entries_and_inferred_mappings() -> None:
    request, result = _one(ops.op_add(_state(), [100, 200], [1, 2, 3, 4], [A, B, A]))
    assert result is None
    assert request == rq.ScriptCall(
        "add",
        (b"ns:meta", b"ns:pe", b"ns:pi", b"ns:pp", b"ns:sx"),
        [
            GEN, b"ns:r:", b"ns:e:", 16, MAX_REQUEST_KEYS_PER_ENGINE_KEY, 0,
            2, encode_entry(A), encode_entry(B),
            "A", 2, 1, 2, _blob(1, 2, 3, 4), _blob(100, 1, 100, 2, 200, 3, 200, 4),
        ],
    )  # fmt: skip


def test_evict_sends_no_mapping_cap() -> None:
    request, _ = _one(ops.op_evict(_state(), 9, KeyType.ENGINE, [B]))
    assert request == rq.ScriptCall(
        "evict",
        (b"ns:meta", b"ns:pe", b"ns:sx"),
        [GEN, b"ns:r:", b"ns:e:", 16, 1, encode_entry(B), 1, "E", hash_field(9), 0, 1, 1],
    )
    request, _ = _one(ops.op_evict(_state(), 9, KeyType.REQUEST, [A, B]))
    assert isinstance(request, rq.ScriptCall) and request.args[-5:] == ["R", hash_field(9), 2, 1, 2]


def test_apply_batch_sends_the_whole_program_and_the_fence() -> None:
    batch = [AddOp(None, (1,), (A,)), EvictOp(1, KeyType.REQUEST, (A, B)), AddOp((7,), (8,), (B,))]
    request, applied = _one(ops.op_apply_batch(_state(), batch, "s", Watermark(3, -1)), 1)
    assert applied is True
    assert request == rq.ScriptCall(
        "apply_batch",
        (b"ns:meta", b"ns:pe", b"ns:pi", b"ns:pp", b"ns:wm", b"ns:wp", b"ns:sx"),
        [
            GEN, b"ns:r:", b"ns:e:", 16, MAX_REQUEST_KEYS_PER_ENGINE_KEY,
            b"s", "3", "-1", request.args[8], 1, 1,
            2, encode_entry(A), encode_entry(B),
            3,
            "A", 1, 1, _blob(1), b"",
            "R", hash_field(1), 2, 1, 2,
            "A", 1, 2, _blob(8), _blob(7, 8),
        ],
    )  # fmt: skip
    assert Exchange([]).run(ops.op_apply_batch(_state(), [], None, None)) is True  # nothing sent
    request, applied = _one(ops.op_apply_batch(_state(), [], "s", Watermark(0, 0)), 0)
    assert applied is False and isinstance(request, rq.ScriptCall)


def test_get_request_key_decodes_the_key_or_raises_not_found() -> None:
    request, result = _one(ops.op_get_request_key(_state(8), 0x1234), hash_field(77))
    args = (GEN, b"ns:e:", 8, hash_field(0x1234))
    assert request == rq.ScriptCall("request_key", (b"ns:meta",), args)
    assert result == 77
    with pytest.raises(EngineKeyNotFoundError):
        _one(ops.op_get_request_key(_state(), 5), None)


def test_watermarks_are_one_hash_command() -> None:
    state = _state()
    request, mark = _one(ops.op_get_watermark(state, "s"), b"3:-1")
    assert request == rq.Command(("HGET", b"ns:wm", b"s")) and mark == Watermark(3, -1)
    assert _one(ops.op_get_watermark(state, "s"), None)[1] is None
    for bad in (b"3", b"x:1", b"1:-5"):
        with pytest.raises(NamespaceLayoutError):
            _one(ops.op_get_watermark(state, "s"), bad)
    request, _ = _one(ops.op_reset_watermark(state, "s", Watermark(4, 5)))
    assert request == rq.Command(("HSET", b"ns:wm", b"s", "4:5"))
    request, _ = _one(ops.op_reset_watermark(state, "s", None))
    assert request == rq.Command(("HDEL", b"ns:wm", b"s"))


def test_clear_pages_with_scan_and_sends_the_last_page_with_the_next_scan() -> None:
    state = _state(8)
    progress: list[tuple[int, int]] = []
    r1, r2, e1 = b"ns:r:\x01", b"ns:r:\x02", b"ns:e:\x01"
    c1, s1 = b"ns:c:\x00\x00\x00\x01", b"ns:s:\x01"
    exchange = Exchange(
        [
            _id(1) + _id(2),  # retire pod-a
            [b"0", [c1]],  # SCAN of the runs
            [0, 1],  # clear_runs(c1)
            [b"5", [r1]],  # first SCAN: one key, more to come
            [[2, 3], [b"0", [r2]]],  # clear(r1) pipelined with the next SCAN
            [1, 4],  # clear(r2)
            [b"0", [s1]],  # SCAN of the expiring buckets
            [1, 1],  # clear(s1)
            [b"0", [e1]],  # SCAN of the engine buckets
            [0, 1],  # clear_mappings(e1)
            2,  # reclaim
        ]
    )
    removed = exchange.run(ops.op_clear(state, "pod-a", lambda *a: progress.append(a)))
    assert removed == 4
    assert progress == [(1, 0), (2, 2), (3, 3), (4, 4), (5, 4)]
    retire, cscan, runs, scan, pipeline, last, sscan, sclear, escan, mappings, reclaim = (
        exchange.requests
    )
    assert cscan == rq.Command(("SCAN", 0, "MATCH", b"ns:c:????", "COUNT", 8))
    assert runs == rq.ScriptCall(
        "clear_runs", (b"ns:meta", c1), (GEN, _id(1) + _id(2), b"ns:r:", 8)
    )
    assert sscan == rq.Command(("SCAN", 0, "MATCH", b"ns:s:?", "COUNT", 8))
    assert sclear == rq.ScriptCall("clear", (b"ns:meta", s1), (GEN, _id(1) + _id(2), "s"))
    assert reclaim == rq.ScriptCall(
        "reclaim", (b"ns:meta", b"ns:pe", b"ns:pi", b"ns:pr"), (GEN, b"pod-a", _id(1) + _id(2))
    )
    assert retire == rq.ScriptCall(
        "retire", (b"ns:meta", b"ns:pe", b"ns:pi", b"ns:pp", b"ns:pr"), (GEN, b"pod-a")
    )
    assert scan == rq.Command(("SCAN", 0, "MATCH", b"ns:r:?", "COUNT", 8))
    clear_r1 = rq.ScriptCall("clear", (b"ns:meta", r1), (GEN, _id(1) + _id(2)))
    assert isinstance(pipeline, rq.Pipeline) and pipeline.items[0] == clear_r1
    assert pipeline.items[1] == rq.Command(("SCAN", 5, "MATCH", b"ns:r:?", "COUNT", 8))
    assert last == rq.ScriptCall("clear", (b"ns:meta", r2), (GEN, _id(1) + _id(2)))
    assert escan == rq.Command(("SCAN", 0, "MATCH", b"ns:e:?", "COUNT", 8))
    assert mappings == rq.ScriptCall(
        "clear_mappings", (b"ns:meta", b"ns:sx", e1), (GEN, b"ns:r:", 8)
    )
    assert Exchange([b""]).run(ops.op_clear(state, "never-seen")) == 0  # one call only


def test_drop_namespace_tombstones_then_deletes_its_own_keys_and_the_meta_record_last() -> None:
    tomb = b"dropping:t"
    exchange = Exchange(
        [tomb, [b"7", [b"ns:pe", b"ns:meta", b"ns:x:pe"]], 1, [b"0", [b"ns:wm"]], 1, 1]
    )
    assert exchange.run(ops.op_drop_namespace(_state(), keys_per_call=2)) == 3
    begin, _, page, _, page2, end = exchange.requests
    assert isinstance(begin, rq.ScriptCall) and begin.args[0] == "begin"
    assert page == rq.ScriptCall("drop", (b"ns:meta", b"ns:pe"), ("page", tomb))
    assert page2 == rq.ScriptCall("drop", (b"ns:meta", b"ns:wm"), ("page", tomb))
    assert end == rq.ScriptCall("drop", (b"ns:meta",), ("end", tomb))


# -- op_send: scripts by EVALSHA, NOSCRIPT reload -----------------------------------------------


def test_a_script_call_is_sent_as_evalsha_with_the_local_sha() -> None:
    session = _session()
    registry = session.registry
    call = rq.ScriptCall("ping", (b"k",), ("a", 1))
    request, reply = _one(ops.op_send(session, call), 1)
    assert request == rq.Command(("EVALSHA", registry["ping"].sha, 1, b"k", "a", 1))
    assert reply == 1


def test_noscript_loads_the_script_and_sends_the_call_again() -> None:
    session = _session()
    script = session.registry["ping"]
    exchange = Exchange([rq.ErrorReply(NOSCRIPT), script.sha.encode(), 1])
    assert exchange.run(ops.op_send(session, rq.ScriptCall("ping", (), ()))) == 1
    evalsha = rq.Command(("EVALSHA", script.sha, 0))
    assert exchange.requests == [evalsha, rq.Command(("SCRIPT", "LOAD", script.source)), evalsha]


def test_a_server_that_keeps_forgetting_scripts_gives_a_backend_error() -> None:
    session = _session()
    sha = session.registry["ping"].sha
    noscript = rq.ErrorReply(NOSCRIPT)
    exchange = Exchange([noscript, sha, noscript, sha, noscript])
    with pytest.raises(BackendError, match="NOSCRIPT"):
        exchange.run(ops.op_send(session, rq.ScriptCall("ping", (), ())))
    assert len(exchange.requests) == 5  # three calls, two loads, no retry of a permanent error


def test_a_server_hashing_a_script_differently_is_a_backend_error() -> None:
    exchange = Exchange([rq.ErrorReply(NOSCRIPT), b"0" * 40])
    with pytest.raises(BackendError, match="hashed script ping"):
        exchange.run(ops.op_send(_session(), rq.ScriptCall("ping", (), ())))


def test_noscript_in_a_pipeline_resends_only_the_calls_that_got_it() -> None:
    session = _session()
    registry = session.registry
    ping, ns = registry["ping"], registry["namespace"]
    items = (
        rq.ScriptCall("ping", (), ()),
        rq.Command(("GET", "x")),
        rq.ScriptCall("namespace", (b"m",), ("v", 16, "g")),
        rq.ScriptCall("ping", (), ()),
    )
    exchange = Exchange(
        [
            [rq.ErrorReply(NOSCRIPT), b"x", rq.ErrorReply(NOSCRIPT), 1],
            ns.sha,  # loads go in name order
            ping.sha,
            [1, [b"v", b"16", b"g"]],
        ]
    )
    replies = exchange.run(ops.op_send(session, rq.Pipeline(items)))
    assert replies == [1, b"x", [b"v", b"16", b"g"], 1]
    first, load_ns, load_ping, again = exchange.requests
    assert isinstance(first, rq.Pipeline) and first.items[1] == rq.Command(("GET", "x"))
    assert first.items[0] == rq.Command(("EVALSHA", ping.sha, 0))
    assert load_ns == rq.Command(("SCRIPT", "LOAD", ns.source))
    assert load_ping == rq.Command(("SCRIPT", "LOAD", ping.source))
    assert again == rq.Pipeline(
        (
            rq.Command(("EVALSHA", ping.sha, 0)),
            rq.Command(("EVALSHA", ns.sha, 1, b"m", "v", 16, "g")),
        )
    )


def test_an_error_inside_a_pipeline_fails_the_request() -> None:
    items = (rq.Command(("GET", "x")), rq.ScriptCall("ping", (), ()))
    with pytest.raises(StaleNamespaceError):
        Exchange([[b"x", rq.ErrorReply("KVREDIS_STALE reload")]]).run(
            ops.op_send(_session(), rq.Pipeline(items))
        )


# -- op_send: retries and translation -----------------------------------------------------------


@pytest.mark.parametrize(
    "failure",
    [
        rq.ConnectionLost("Connection refused"),
        rq.ConnectionLost("Timeout reading from socket"),
        rq.ErrorReply("BUSY Redis is busy running a script"),
        rq.ErrorReply("LOADING Redis is loading the dataset in memory"),
        rq.ErrorReply("MASTERDOWN Link with MASTER is down"),
        rq.ErrorReply("READONLY You can't write against a read only replica."),
        rq.ErrorReply("TRYAGAIN Multiple keys request during rehashing of slot"),
    ],
)
def test_transient_failures_are_retried_after_backoff_then_name_the_server(
    failure: rq.Failure,
) -> None:
    session = _session(retries=3, backoff=0.05)
    exchange = Exchange([failure, None, failure, None, failure, None, failure])
    with pytest.raises(BackendUnavailableError) as info:
        exchange.run(ops.op_send(session, rq.Command(("PING",))))
    assert str(info.value) == f"cannot reach {SERVER}: {failure.message}"
    assert isinstance(info.value.__cause__, type(failure))
    sleeps = [r for r in exchange.requests if isinstance(r, rq.Sleep)]
    assert sleeps == [rq.Sleep(0.05), rq.Sleep(0.1), rq.Sleep(0.2)]
    assert exchange.requests.count(rq.Command(("PING",))) == 4


def test_a_retry_that_succeeds_returns_the_reply() -> None:
    exchange = Exchange([rq.ConnectionLost("reset"), None, b"PONG"])
    assert exchange.run(ops.op_send(_session(), rq.Command(("PING",)))) == b"PONG"
    assert exchange.requests[1] == rq.Sleep(0.05)


def test_backoff_doubles_up_to_one_second() -> None:
    policy = sessions.RetryPolicy(8, 0.3, SERVER)
    assert [policy.delay(i) for i in range(4)] == [0.3, 0.6, 1.0, 1.0]


def test_no_retries_gives_up_at_once_and_a_refused_password_never_retries() -> None:
    with pytest.raises(BackendUnavailableError, match="cannot reach redis at h:6379: down"):
        ping = ops.op_send(_session(retries=0), rq.Command(("PING",)))
        Exchange([rq.ConnectionLost("down")]).run(ping)
    with pytest.raises(BackendAuthenticationError, match="redis at h:6379 refused the user name"):
        Exchange([rq.AuthenticationFailed("WRONGPASS invalid username-password pair")]).run(
            ops.op_send(_session(retries=5), rq.Command(("PING",)))
        )


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ("KVREDIS_INVALID unknown op X script: 1234, on @user_script:9.", InvalidInputError),
        ("KVREDIS_LAYOUT entry id space exhausted", NamespaceLayoutError),
        ("KVREDIS_STALE namespace layout changed", StaleNamespaceError),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", NamespaceLayoutError),
        ("ERR unknown command", BackendError),
        ("KVREDIS_NEW some code this client does not know", BackendError),
    ],
)
def test_other_error_replies_are_translated_without_retry(
    message: str, error: type[Exception]
) -> None:
    exchange = Exchange([rq.ErrorReply(message)])
    with pytest.raises(error) as info:
        exchange.run(ops.op_send(_session(), rq.Command(("PING",))))
    assert len(exchange.requests) == 1
    if message.startswith("KVREDIS_INVALID"):
        assert str(info.value) == "unknown op X"


# -- op_run: namespace loading and stale reloads ------------------------------------------------


def _namespace_reply(gen: bytes) -> Callable[[rq.Request], Any]:
    def reply(request: rq.Request) -> Any:
        assert isinstance(request, rq.Command) and request.args[0] == "HMGET"
        return [LAYOUT_VERSION.encode(), b"16", gen]

    return reply


def test_the_first_call_loads_the_namespace() -> None:
    session = _session(CoreState("ns"))
    exchange = Exchange([_namespace_reply(GEN), hash_field(3)])
    assert exchange.run(ops.op_run(session, lambda: ops.op_get_request_key(session.state, 1))) == 3
    assert session.state.layout.gen == GEN
    assert len(exchange.requests) == 2


def test_a_stale_namespace_is_reloaded_and_the_operation_runs_once_more() -> None:
    session = _session()
    old_cache = session.state.cache
    stale = rq.ErrorReply("KVREDIS_STALE namespace layout changed or was removed; reload it")
    exchange = Exchange([stale, _namespace_reply(b"new-generation"), hash_field(4)])
    assert exchange.run(ops.op_run(session, lambda: ops.op_get_request_key(session.state, 1))) == 4
    assert session.state.layout.gen == b"new-generation"
    assert session.state.cache is not old_cache  # a new generation gets a new entry cache
    first, _, again = exchange.requests
    assert isinstance(first, rq.Command) and first.args[4] == GEN
    assert isinstance(again, rq.Command) and again.args[4] == b"new-generation"


def test_a_namespace_stale_twice_in_a_row_raises() -> None:
    session = _session()
    stale = rq.ErrorReply("KVREDIS_STALE gone")
    exchange = Exchange([stale, _namespace_reply(b"g2"), stale])
    with pytest.raises(StaleNamespaceError):
        exchange.run(ops.op_run(session, lambda: ops.op_get_request_key(session.state, 1)))


def test_an_unknown_entry_id_reloads_too() -> None:
    session = _session()
    exchange = Exchange(
        [
            [0, [], [], 1, _id(1)],  # an id this client never learned
            _namespace_reply(GEN),  # same generation: the cache is kept
            [1, [_id(1), encode_entry(A)], [], 1, _id(1)],
        ]
    )
    lookup = ops.op_run(session, lambda: ops.op_lookup(session.state, [5], None))
    assert exchange.run(lookup) == {5: [A]}


def test_connect_pings_with_retries() -> None:
    session = _session(CoreState("ns"))
    info = {"maxmemory_policy": "noeviction"}
    standalone = {"cluster_enabled": 0}
    server = {"redis_version": "7.2.4", "valkey_version": "9.0.1"}
    replies = [rq.ConnectionLost("refused"), None, b"PONG", standalone, server]
    exchange = Exchange([*replies, _namespace_reply(GEN), info])
    layout = exchange.run(ops.op_connect(session))
    assert layout.gen == GEN
    assert exchange.requests[-1] == rq.Command(("INFO", "memory"))
    assert exchange.requests[:5] == [
        rq.Command(("PING",)),
        rq.Sleep(0.05),
        rq.Command(("PING",)),
        rq.Command(("INFO", "cluster")),
        rq.Command(("INFO", "server")),
    ]
    assert session.state.expiry_mode == "field"


@pytest.mark.parametrize(
    ("info", "mode"),
    [
        ({"redis_version": "7.0.15"}, "key"),
        ({"redis_version": "7.4.0"}, "field"),
        (b"# Server\r\nredis_version:8.2.1\r\n", "field"),
        ({"redis_version": "7.2.4", "valkey_version": "8.1.0"}, "key"),
        ({"redis_version": "7.2.4", "valkey_version": "9.0.0"}, "field"),
        ({"redis_version": "x.y"}, "key"),
        ({}, "key"),
    ],
)
def test_the_expiry_mode_follows_the_server_version(info: Any, mode: str) -> None:
    assert ops.expiry_mode_of(info) == mode


def test_a_new_namespace_records_the_expiry_mode_of_its_server() -> None:
    state = CoreState("ns")
    state.expiry_mode = "field"
    missing = [None, None, None]
    exchange = Exchange([missing, [LAYOUT_VERSION.encode(), b"16", GEN]])
    exchange.run(ops.op_load_namespace(state, ping=False))
    create = exchange.requests[1]
    assert isinstance(create, rq.ScriptCall) and create.script == "namespace"
    assert create.args[3] == "field"


def test_a_failure_thrown_into_an_operation_closes_it() -> None:
    closed: list[bool] = []

    def op() -> rq.Op[None]:
        try:
            yield rq.Command(("PING",))
        finally:
            closed.append(True)

    with pytest.raises(BackendUnavailableError):
        Exchange([rq.ConnectionLost("x")]).run(ops.op_run(_session(retries=0), op))
    assert closed == [True]


@pytest.mark.parametrize(
    ("info", "unsafe"),
    [
        ({"maxmemory_policy": "allkeys-lru"}, True),
        (b"# Memory\r\nmaxmemory_policy:allkeys-random\r\n", True),
        ({"maxmemory_policy": "volatile-lfu"}, False),
        ({"maxmemory_policy": "noeviction"}, False),
        ({}, False),
    ],
)
def test_the_eviction_policy_check(info: Any, unsafe: bool) -> None:
    ops.check_eviction_policy(info, SERVER, strict=False)
    if unsafe:
        with pytest.raises(UnsafeServerConfigError, match="noeviction"):
            ops.check_eviction_policy(info, SERVER, strict=True)
    else:
        ops.check_eviction_policy(info, SERVER, strict=True)


def test_connect_without_permission_to_read_info_still_connects() -> None:
    session = _session(CoreState("ns"))
    denied = rq.ErrorReply("NOPERM this user has no permissions to run the 'info' command")
    exchange = Exchange([b"PONG", denied, denied, _namespace_reply(GEN), denied])
    assert exchange.run(ops.op_connect(session, strict=True)).gen == GEN
    assert session.state.expiry_mode == "key"


def test_an_add_beyond_the_budget_goes_in_parts_within_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(program, "CALL_BUDGET", 64)
    request_keys = list(range(1, 301))
    op = ops.op_add(_state(), [7], request_keys, [A])
    calls: list[rq.ScriptCall] = []
    try:
        request = next(op)
        while True:
            assert isinstance(request, rq.ScriptCall)
            calls.append(request)
            request = op.send(None)
    except StopIteration:
        pass
    sent = b"".join(bytes(c.args[-2]) for c in calls)
    assert sent == b"".join(k.to_bytes(8, "big") for k in request_keys)  # chain order kept
    pairs = b"".join(bytes(c.args[-1]) for c in calls)
    # one engine key keeps its most recent MAX_REQUEST_KEYS_PER_ENGINE_KEY request keys only
    assert len(pairs) == 16 * min(300, MAX_REQUEST_KEYS_PER_ENGINE_KEY)
    for call in calls:
        units = len(bytes(call.args[-2])) // 8 + program.PAIR_COST * len(bytes(call.args[-1])) // 16
        assert units <= 64


def test_compress_pairs_keeps_what_decides_the_mapping() -> None:
    pairs = [(1, 10), (1, 11), (2, 20), (1, 10), (1, 12), (2, 21)]
    assert program.compress_pairs(pairs, 2) == [(2, 20), (1, 10), (1, 12), (2, 21)]
    assert program.compress_pairs(pairs, 10) == [(1, 11), (2, 20), (1, 10), (1, 12), (2, 21)]


def test_a_long_lookup_chain_goes_in_parts_and_stops_at_the_first_miss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ops, "LOOKUP_KEYS_PER_CALL", 2)
    state = _state()
    state.cache.learn([_id(1), encode_entry(A)], 1)
    exchange = Exchange(
        [[1, [], [b"pod-a", b"3@"], 2, _id(1)], [1, [], [b"pod-a", b"3@"], 1, _id(1)]]
    )
    assert exchange.run(ops.op_lookup(state, [1, 2, 3, 4, 5], None)) == {k: [A] for k in (1, 2, 3)}
    assert len(exchange.requests) == 2
    calls = [r for r in exchange.requests if isinstance(r, rq.ScriptCall)]
    assert [c.args[-3:] for c in calls] == [(_blob(1, 2), 1, 0), (1, b"pod-a", b"3@")]


def test_a_lookup_in_parts_drops_a_pod_from_the_part_its_stamp_broke_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server answers "" for a carried stamp that no longer holds: that pod's entries count
    only up to the part before, and a key left without entries ends the chain."""
    monkeypatch.setattr(ops, "LOOKUP_KEYS_PER_CALL", 2)
    state = _state()
    state.cache.learn([_id(1), encode_entry(A), _id(2), encode_entry(B)], 2)
    both = _id(1) + _id(2)
    exchange = Exchange(
        [
            [2, [], [b"pod-a", b"3@", b"pod-b", b"g0@"], 2, both],
            [2, [], [b"pod-a", b"", b"pod-b", b"g0@"], 1, both, 1, _id(1)],
        ]
    )
    got = exchange.run(ops.op_lookup(state, [1, 2, 3, 4, 5], None))
    assert got == {1: [A, B], 2: [A, B], 3: [B]}  # pod-a from the second part on: dropped


def test_add_with_a_ttl_sends_it_in_milliseconds() -> None:
    spec = PodEntry("pod-s", speculative=True)
    request, _ = _one(ops.op_add(_state(), None, [1], [spec], 0.2501))
    assert isinstance(request, rq.ScriptCall) and request.args[5] == 251
    with pytest.raises(InvalidInputError):
        _one(ops.op_add(_state(), None, [1], [A], 1.0))


# -- calls the server refuses as over budget ----------------------------------------------------


class BudgetServer:
    """Answers the write calls of an operation like a server whose work limit admits programs of
    at most ``most`` ops, and one add op of at most ``most`` request keys (it throws the error
    of its ``KVREDIS_BUDGET`` reply into the operation, as :func:`ops.op_drive` does, saying
    how much fits unless ``silent``); records every call and the ones applied."""

    def __init__(self, most: int, silent: bool = False) -> None:
        self.most, self.silent = most, silent
        self.calls: list[rq.ScriptCall] = []
        self.applied: list[rq.ScriptCall] = []

    @staticmethod
    def ops_of(call: rq.ScriptCall) -> tuple[int, int]:
        """(ops, request keys of a lone add op) of an add or apply_batch call."""
        args = list(call.args)
        at = 11 if call.script == "apply_batch" else 6  # the entry count, after the fixed args
        n = int(args[at])
        at += n + 1
        count = int(args[at]) if call.script == "apply_batch" else 1
        if call.script == "apply_batch":
            at += 1
        keys = len(args[at + 2 + int(args[at + 1])]) // 8 if args[at] == "A" else 0
        return count, keys

    def run(self, op: rq.Op[Any], reply: int = 1) -> Any:
        outcome: Any = None
        refused = False
        while True:
            try:
                request = op.throw(outcome) if refused else op.send(outcome)
            except StopIteration as stop:
                return stop.value
            assert isinstance(request, rq.ScriptCall)
            self.calls.append(request)
            count, keys = self.ops_of(request)
            refused = count > self.most or (count == 1 and keys > self.most)
            if refused:
                fits = "" if self.silent else f"{self.most if count > 1 else 0} {self.most} "
                outcome = translate(f"KVREDIS_BUDGET {fits}the keys reach chain runs of more")
            else:
                self.applied.append(request)
                outcome = reply


def _part(call: rq.ScriptCall) -> tuple[int, int]:
    return int(call.args[9]), int(call.args[10])


def test_a_batch_part_refused_as_over_budget_goes_in_pieces_numbered_anew() -> None:
    batch = [EvictOp(k, KeyType.REQUEST, (A,)) for k in range(1, 6)]
    server = BudgetServer(most=2)
    assert server.run(ops.op_apply_batch(_state(), batch, "s", Watermark(1, 2))) is True
    # 5 ops refused, 2 fit: pieces 2 + 2 + 1, the parts numbered anew
    assert [(_part(c), server.ops_of(c)[0]) for c in server.calls] == [
        ((1, 1), 5), ((1, 3), 2), ((2, 3), 2), ((3, 3), 1),
    ]  # fmt: skip
    order = [c.args[i + 1] for c in server.applied for i, a in enumerate(c.args) if a == "R"]
    assert order == [hash_field(k) for k in range(1, 6)]


def test_a_refusal_that_does_not_say_what_fits_cuts_the_part_in_two() -> None:
    batch = [EvictOp(k, KeyType.REQUEST, (A,)) for k in range(1, 6)]
    server = BudgetServer(most=2, silent=True)
    assert server.run(ops.op_apply_batch(_state(), batch, "s", Watermark(1, 2))) is True
    # 5 ops refused; halves 2 + 3; the 3 refused again: 1 + 2. Parts are numbered anew.
    assert [(_part(c), server.ops_of(c)[0]) for c in server.calls] == [
        ((1, 1), 5), ((1, 2), 2), ((2, 2), 3), ((2, 3), 1), ((3, 3), 2),
    ]  # fmt: skip
    assert len({c.args[8] for c in server.calls}) == 1  # one token: the parts done still count
    order = [c.args[i + 1] for c in server.applied for i, a in enumerate(c.args) if a == "R"]
    assert order == [hash_field(k) for k in range(1, 6)]  # the ops in their order, once each


def test_a_fenced_batch_stops_at_a_skipped_part_after_a_split() -> None:
    batch = [EvictOp(k, KeyType.REQUEST, (A,)) for k in range(1, 5)]
    server = BudgetServer(most=2)
    assert server.run(ops.op_apply_batch(_state(), batch, "s", Watermark(1, 2)), reply=0) is False
    assert [_part(c) for c in server.calls] == [(1, 1), (1, 2)]
    assert server.ops_of(server.calls[-1])[0] == 2


def test_an_add_refused_as_over_budget_goes_in_pieces_of_its_request_keys() -> None:
    server = BudgetServer(most=2)
    server.run(ops.op_add(_state(), [100], [1, 2, 3, 4, 5], [A]))
    added = [c.args[-2] for c in server.applied]
    assert added == [_blob(1, 2), _blob(3, 4), _blob(5)]  # chain order, every key once
    assert len(server.calls) == 4  # one refusal
    pairs = [c.args[-1] for c in server.applied]
    mappings = _blob(*(h for k in range(1, 6) for h in (100, k)))  # one engine key, 5 blocks
    assert pairs == [b"", b"", mappings]  # the mappings go with the last piece


def test_an_evict_by_engine_key_refused_as_over_budget_goes_as_evicts_by_request_key() -> None:
    mapped = _blob(11, 12, 13, 14, 15)  # the engine key's request keys, as the server holds them
    refusal = rq.ErrorReply("KVREDIS_BUDGET 0 2 the keys reach chain runs of more than 4096")
    exchange = Exchange([refusal, mapped, 0, 0, 0])
    exchange.run(ops.op_drive(_session(), ops.op_evict(_state(), 9, KeyType.ENGINE, [A])))
    refused, read, *sent = exchange.requests
    assert read == rq.Command(("HGET", _state().layout.engine_bucket(9), hash_field(9)))
    programs = [c.args[12:] for c in (refused, *sent) if isinstance(c, rq.Command)]
    assert programs == [
        (1, "E", hash_field(9), 0, 1, 1),  # the whole evict: refused, 2 request keys fit
        (2, "R", hash_field(11), 1, 1, "R", hash_field(12), 1, 1),
        (2, "R", hash_field(13), 1, 1, "R", hash_field(14), 1, 1),
        (2, "R", hash_field(15), 1, 1, "E", hash_field(9), 5, 1, 1),  # drops the mapping
    ]


def test_a_program_that_cannot_be_split_raises_the_budget_error() -> None:
    program = ops.program_of(_state().layout, [("R", 1, [A])])
    assert program.pieces() == [] and program.pieces(1, 1) == []
    server = BudgetServer(most=0)
    with pytest.raises(CallBudgetError):
        server.run(ops.op_parts([program], lambda p, part, parts: ops.add_call(p, 0)))


def test_op_drive_throws_a_request_error_into_the_operation() -> None:
    def op() -> rq.Op[str]:
        try:
            yield rq.Command(("GET", "k"))
        except NamespaceLayoutError as exc:
            return f"handled: {exc}"
        return "not raised"

    result = Exchange([rq.ErrorReply("KVREDIS_LAYOUT broken")]).run(ops.op_drive(_session(), op()))
    assert result == "handled: broken"


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        ("NOAUTH Authentication required.", "requires a password and none was given"),
        ("HELLO must be called with the client already authenticated", "requires a password"),
        ("WRONGPASS invalid username-password pair", "refused the user name and password"),
    ],
)
def test_an_authentication_failure_says_what_is_wrong_once(reply: str, said: str) -> None:
    with pytest.raises(BackendAuthenticationError) as info:
        Exchange([rq.AuthenticationFailed(reply)]).run(
            ops.op_send(_session(retries=5), rq.Command(("PING",)))
        )
    message = str(info.value)
    assert message.startswith(f"{SERVER} ") and said in message
    assert message.count(" at ") == 1


def test_a_peer_that_does_not_answer_tls_is_said_so_without_retrying() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        Exchange([rq.TlsFailed("no TLS handshake within 2 s")]).run(
            ops.op_send(_session(retries=5), rq.Command(("PING",)))
        )
    assert "did not answer TLS" in str(info.value) and "use redis://" in str(info.value)

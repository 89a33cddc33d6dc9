"""Scripts check their whole input before the first write: a refused call leaves the namespace
byte-identical (a DUMP of every key before and after), even when the refused part comes after
valid ops, and even when the entry id space runs out."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    EvictOp,
    InvalidInputError,
    KeyType,
    NamespaceLayoutError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.redis.codec import encode_entry, hash_field
from kvredis.redis.ops import op_add, op_apply_batch, op_evict
from kvredis.redis.requests import Op, ScriptCall
from kvredis.redis.session import op_send

A, B, C = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu"), PodEntry("pod-c", "gpu")
ENGINE, REQUEST = KeyType.ENGINE, KeyType.REQUEST


@pytest.fixture
def index(redis_server_url: str) -> Iterator[RedisIndex]:
    namespace = f"kvt-{uuid.uuid4().hex[:12]}"
    with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace)) as idx:
        idx.add([1, 2], [10, 20], [A, B])
        idx.apply_batch([AddOp(None, (30,), (C,))], "stream", Watermark(1, 1))
        yield idx


def _dump(raw: redis.Redis, namespace: str) -> dict[bytes, bytes]:
    return {key: raw.dump(key) for key in raw.scan_iter(match=f"{namespace}:*", count=1000)}


def _call(index: RedisIndex, op: Callable[[Any], Op[Any]]) -> ScriptCall:
    """The script call an operation yields (not sent)."""
    call = next(op(index._session.state))
    assert isinstance(call, ScriptCall)
    return call


def _refused(index: RedisIndex, call: ScriptCall, error: type[Exception], match: str) -> None:
    """Send ``call``; it must fail with ``error`` and leave every key of the namespace as it was."""
    raw = index.client
    before = _dump(raw, index.namespace)
    with pytest.raises(error, match=match):
        index._exec.run(op_send(index._session, call))
    assert _dump(raw, index.namespace) == before


def _with_args(call: ScriptCall, edit: Callable[[list[Any]], list[Any]]) -> ScriptCall:
    return ScriptCall(call.script, call.keys, edit(list(call.args)))


def _add(index: RedisIndex) -> ScriptCall:
    """An add of a new entry (pod-d) that would write to new keys and intern a new id."""
    return _call(index, lambda s: op_add(s, [5, 6], [50, 60], [A, PodEntry("pod-d", "gpu")]))


def _set(args: list[Any], index: int, value: Any) -> list[Any]:
    args[index] = value
    return args


ADD_REFUSALS: list[tuple[str, Callable[[list[Any]], list[Any]], str]] = [
    ("unknown op", lambda a: _set(a, 9, "X"), "unknown op X"),
    ("evict op in add", lambda a: _set(a, 9, "R"), "unknown op R"),
    ("entry index 0", lambda a: _set(a, 11, 0), "entry index"),
    ("entry index past the entries", lambda a: _set(a, 12, 3), "entry index"),
    ("malformed entry", lambda a: _set(a, 8, encode_entry(B)[:-1]), "malformed entry"),
    (
        "rank flag without its rank",
        lambda a: _set(a, 8, encode_entry(replace(B, dp_rank=1))[:-4]),
        "malformed entry",
    ),
    (
        "rank without its flag",
        lambda a: _set(a, 8, encode_entry(B) + b"\x00\x00\x00\x01"),
        "malformed entry",
    ),
    ("request keys of 7 bytes", lambda a: _set(a, 13, a[13][:-1]), "request keys"),
    ("pairs of one hash", lambda a: _set(a, 14, hash_field(5)), "pairs"),
    ("trailing argument", lambda a: [*a, b"extra"], "after the last op"),
    ("missing pairs", lambda a: a[:-1], "pairs"),
    ("bucket bits 25", lambda a: _set(a, 3, 25), "bucket bits"),
    ("mapping cap 0", lambda a: _set(a, 4, 0), "request keys per engine key"),
    ("negative ttl", lambda a: _set(a, 5, -1), "ttl ms"),
    ("ttl not a number", lambda a: _set(a, 5, "soon"), "ttl ms"),
    ("entry count past the arguments", lambda a: _set(a, 6, 99), "entry count"),
]


@pytest.mark.parametrize(
    ("edit", "match"), [r[1:] for r in ADD_REFUSALS], ids=[r[0] for r in ADD_REFUSALS]
)
def test_a_malformed_add_writes_nothing(
    index: RedisIndex, edit: Callable[[list[Any]], list[Any]], match: str
) -> None:
    call = _add(index)
    assert call.args[9] == "A" and call.args[6] == 2  # the positions the edits assume
    _refused(index, _with_args(call, edit), InvalidInputError, match)
    index._exec.run(op_send(index._session, call))  # the unedited call is fine
    assert index.lookup([50, 60]) == {50: [A, PodEntry("pod-d", "gpu")]} | {
        60: [A, PodEntry("pod-d", "gpu")]
    }


def test_a_malformed_evict_writes_nothing(index: RedisIndex) -> None:
    call = _call(index, lambda s: op_evict(s, 1, ENGINE, [A]))
    assert call.args[7] == "E"
    _refused(index, _with_args(call, lambda a: _set(a, 7, "A")), InvalidInputError, "unknown op A")
    short_key = _with_args(call, lambda a: _set(a, 8, a[8][:-1]))
    _refused(index, short_key, InvalidInputError, "evict key")
    _refused(index, _with_args(call, lambda a: _set(a, 9, -1)), InvalidInputError, "first")
    _refused(index, _with_args(call, lambda a: _set(a, 11, 2)), InvalidInputError, "entry index")
    _refused(index, _with_args(call, lambda a: _set(a, 6, 2)), InvalidInputError, "op")
    assert index.lookup([10, 20]) == {10: [A, B], 20: [A, B]}


def _batch(index: RedisIndex, stream: str = "other") -> ScriptCall:
    """A batch whose first ops are valid and write (evict, add of a new entry)."""
    ops = [
        EvictOp(10, REQUEST, (A,)),
        AddOp((7,), (70,), (PodEntry("pod-e", "gpu"),)),
        EvictOp(2, ENGINE, (B,)),
    ]
    return _call(index, lambda s: op_apply_batch(s, ops, stream, Watermark(5, 5)))


def test_a_batch_refused_by_its_last_op_applies_none_of_the_earlier_ones(index: RedisIndex) -> None:
    call = _batch(index)
    assert call.args[-5] == "E"
    last_op = len(call.args) - 5
    _refused(index, _with_args(call, lambda a: _set(a, last_op, "Z")), InvalidInputError, "op 3")
    count = 12 + call.args[11]
    assert call.args[count] == 3
    more_ops = _with_args(call, lambda a: _set(a, count, 4))
    _refused(index, more_ops, InvalidInputError, "unknown op nil")
    _refused(index, _with_args(call, lambda a: [*a, "R"]), InvalidInputError, "after the last op")
    for position, value in ((6, "01"), (7, "x"), (7, ""), (6, "-0")):
        fence = _with_args(call, lambda a, p=position, v=value: _set(a, p, v))
        _refused(index, fence, InvalidInputError, "must be a decimal integer")
    index._exec.run(op_send(index._session, call))
    assert index.lookup([10, 20, 70]) == {10: [B], 20: [A]} | {70: [PodEntry("pod-e", "gpu")]}
    assert index.get_watermark("other") == Watermark(5, 5)


def test_a_malformed_stored_watermark_refuses_the_batch_before_any_write(index: RedisIndex) -> None:
    index.client.hset(f"{index.namespace}:wm", "other", "no-colon")
    _refused(index, _batch(index), NamespaceLayoutError, "malformed watermark")


def test_a_full_entry_id_space_refuses_the_call_before_interning(index: RedisIndex) -> None:
    meta = f"{index.namespace}:meta"
    new_entries = [C, PodEntry("p", "t"), PodEntry("q", "t")]
    two_new = _call(index, lambda s: op_add(s, None, [80], new_entries))
    index.client.hset(meta, "next_id", 4294967294)  # room for exactly one more id
    _refused(index, two_new, NamespaceLayoutError, "entry id space exhausted")
    batch = _batch(index)  # one new entry, in the middle of the batch
    index.client.hset(meta, "next_id", 4294967295)
    _refused(index, batch, NamespaceLayoutError, "entry id space exhausted")
    index.client.hset(meta, "next_id", 4294967294)
    index._exec.run(op_send(index._session, batch))  # exactly one id left: fits
    assert index.client.hget(meta, "next_id") == b"4294967295"
    assert index.lookup([70]) == {70: [PodEntry("pod-e", "gpu")]}


@pytest.mark.parametrize(
    ("script", "edit", "match"),
    [
        ("clear", lambda a: _set(a, 1, b"\x00\x00\x00\x01\x00"), "entry ids"),
        ("clear_mappings", lambda a: _set(a, 2, "x"), "bucket bits"),
        ("namespace", lambda a: _set(a, 1, 0), "bucket bits"),
        ("namespace", lambda a: _set(a, 2, ""), "generation"),
    ],
)
def test_malformed_page_and_namespace_calls_write_nothing(
    index: RedisIndex, script: str, edit: Callable[[list[Any]], list[Any]], match: str
) -> None:
    layout = index._session.state.layout
    rbucket, ebucket = layout.request_bucket(10), layout.engine_bucket(1)
    valid = {
        "clear": ScriptCall("clear", (layout.meta, rbucket), (layout.gen, b"\x00\x00\x00\x01")),
        "clear_mappings": ScriptCall(
            "clear_mappings", (layout.meta, layout.sx, ebucket), (layout.gen, layout.rprefix, 16)
        ),
        "namespace": ScriptCall(
            "namespace",
            (f"{index.namespace}:new:meta", f"{index.namespace}:new:pi"),
            ("kvredis-kvblock/1", 16, "g"),
        ),
    }[script]
    _refused(index, _with_args(valid, edit), InvalidInputError, match)

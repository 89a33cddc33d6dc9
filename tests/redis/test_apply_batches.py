"""``apply_batches`` on a real server: the batches queued for an ingester in as few script calls
as their work allows, each fenced on its own, safe to send again, refused whole when malformed
(``lua/apply_batches.lua``; the contract every backend shares is in the conformance suite)."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvredis import (
    AddOp,
    Batch,
    EvictOp,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    Watermark,
)
from kvredis.errors import InvalidInputError
from kvredis.index import apply_batches_in_turn
from kvredis.memory import InMemoryIndex
from kvredis.redis import ops
from kvredis.redis.program import CALL_BUDGET
from kvredis.redis.requests import ScriptCall
from tests.conftest import TEST_PREFIX

pytestmark = pytest.mark.redis

A, B = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "gpu")


@pytest.fixture(params=["redis", "valkey"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[RedisIndex, redis.Redis]]:
    url = request.getfixturevalue("server_pool").url(request.param)
    index = RedisIndex(RedisIndexConfig(address=url, namespace=f"{TEST_PREFIX}{uuid.uuid4().hex}"))
    raw = redis.Redis.from_url(url)
    try:
        yield index, raw
    finally:
        index.drop_namespace()
        index.close()
        raw.close()


def script_calls(raw: redis.Redis) -> int:
    stats = raw.info("commandstats")
    return sum(
        int(stats.get(name, {}).get("calls", 0))
        for name in ("cmdstat_evalsha", "cmdstat_fcall", "cmdstat_fcall_ro")
    )


def writes(raw: redis.Redis) -> int:
    """Keys the server changed so far (``INFO stats`` is per server, the namespace is ours)."""
    return int(raw.info("persistence")["rdb_changes_since_last_save"])


def decode_batches(blob: bytes) -> list[tuple[int, bytes, int]]:
    """(stream, mark, op count) of every batch of an apply_batches call (its op bytes are
    skipped by walking the ops)."""
    out, pos = [], 0
    while pos < len(blob):
        stream, ml = struct.unpack_from(">HB", blob, pos)
        mark = blob[pos + 3 : pos + 3 + ml]
        pos += 3 + ml
        (nops,) = struct.unpack_from(">H", blob, pos)
        pos += 2
        for _ in range(nops):
            tag = blob[pos : pos + 1]
            (nent,) = struct.unpack_from(">H", blob, pos + 1)
            pos += 3 + 2 * nent + (8 if tag == b"P" else 0)
            for width in (8, 16) if tag in (b"A", b"P") else (8,):
                (n,) = struct.unpack_from(">I", blob, pos)
                pos += 4 + n * width
        out.append((stream, mark, nops))
    return out


def the_call(index: RedisIndex, batches: list[Batch]) -> ScriptCall:
    """The first script call ``apply_batches`` would send for ``batches``."""
    op = ops.op_apply_batches(index._session.state, batches)
    call = next(op)
    op.close()
    assert isinstance(call, ScriptCall) and call.script == "apply_batches"
    return call


def send(index: RedisIndex, call: ScriptCall) -> Any:
    return index._exec.run(ops.op_drive(index._session, iter_call(call)))


def iter_call(call: ScriptCall) -> Any:
    reply = yield call
    return reply


def test_small_batches_of_many_streams_take_one_script_call(served: Any) -> None:
    index, raw = served
    index.lookup([1])  # connected
    keys = list(range(1000, 1064))
    batches = [
        Batch(
            [AddOp((k + 10**6,), (k,), (A if i % 2 else B,))], f"pod-{i % 8}", Watermark(0, i // 8)
        )
        for i, k in enumerate(keys)
    ]
    before = script_calls(raw)
    assert index.apply_batches(batches) == [True] * len(batches)
    assert script_calls(raw) - before == 1
    assert {k: set(v) for k, v in index.lookup(keys[:1]).items()} == {keys[0]: {B}}
    assert index.get_watermark("pod-3") == Watermark(0, 7)


def test_work_over_one_calls_budget_goes_in_several_calls_in_order(served: Any) -> None:
    index, raw = served
    index.lookup([1])
    model = InMemoryIndex()
    size = 100  # keys per batch: a call holds CALL_BUDGET // about size + size units of them
    batches = []
    for i in range(3 * CALL_BUDGET // size):
        keys = tuple(range(10**6 * (i + 1), 10**6 * (i + 1) + size))
        ops_: list[Any] = [AddOp(tuple(k + 7 for k in keys), keys, (A,))]
        ops_.append(EvictOp(keys[0], KeyType.REQUEST, (A,)))
        batches.append(Batch(ops_, "s", Watermark(0, i)))
    big = tuple(range(10**9, 10**9 + 2 * CALL_BUDGET))  # over budget alone: parts
    batches.append(Batch([AddOp(None, big, (B,))], "s", Watermark(0, 10**6)))
    batches.append(Batch([EvictOp(big[5], KeyType.REQUEST, (B,))], "s", Watermark(0, 10**6 + 1)))
    before = script_calls(raw)
    assert index.apply_batches(batches) == apply_batches_in_turn(model, batches)
    assert script_calls(raw) - before >= 5
    sample = [b.ops[0].request_keys[i] for b in batches[:-2] for i in (0, 1, 50)]
    sample += [big[0], big[5], big[-1]]
    assert {k: set(v) for k, v in index.lookup(sample[:1]).items()} == {}
    for key in sample:
        assert {k: set(v) for k, v in index.lookup([key]).items()} == {
            k: set(v) for k, v in model.lookup([key]).items()
        }
    assert index.get_watermark("s") == Watermark(0, 10**6 + 1)


def test_a_batch_over_budget_by_itself_is_encoded_once_and_keeps_its_place(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, raw = served
    index.lookup([1])
    encoded: list[int] = []
    real = ops.blob_ops

    def counting(plan: Any, entry: Any) -> Any:
        encoded.append(len(plan))
        return real(plan, entry)

    monkeypatch.setattr(ops, "blob_ops", counting)
    big = tuple(range(10**9, 10**9 + 2 * CALL_BUDGET))
    batches = [
        Batch([AddOp(None, (11,), (A,))], "s", Watermark(0, 0)),
        Batch([AddOp(None, big, (B,)), EvictOp(11, KeyType.REQUEST, (A,))], "s", Watermark(0, 1)),
        Batch([AddOp(None, (11,), (B,))], "s", Watermark(0, 2)),
    ]
    before = script_calls(raw)
    assert index.apply_batches(batches) == [True, True, True]
    # the small batches once each in a group call; the big one once, found over budget by
    # itself, then sent alone (in parts) between them
    assert encoded == [1, 2, 1]
    assert script_calls(raw) - before >= 4
    assert {k: set(v) for k, v in index.lookup([11]).items()} == {11: {B}}
    for key in (big[0], big[-1]):
        assert set(index.lookup([key])[key]) == {B}
    assert index.get_watermark("s") == Watermark(0, 2)


def test_a_call_sent_again_after_a_lost_reply_applies_nothing_twice(served: Any) -> None:
    index, _raw = served
    index.lookup([1])
    [r1, r2] = [77, 78]
    batches = [
        Batch([AddOp(None, (r1,), (A,))], "s", Watermark(0, 0)),
        Batch([AddOp(None, (r2,), (A,))], "t", Watermark(3, 4)),
        Batch([AddOp(None, (r2,), (B,))]),
    ]
    call = the_call(index, batches)
    assert [int(x) for x in send(index, call)] == [1, 1, 1]
    index.evict(r1, KeyType.REQUEST, [A])  # a later batch's work, between the two sends
    # the reply was lost: the same call (same tokens) again. The fenced batches are recognised
    # as applied by this very call (1, not re-applied); the unfenced one applies again (a set
    # operation: nothing changes)
    assert [int(x) for x in send(index, call)] == [1, 1, 1]
    assert index.lookup([r1]) == {}
    assert {k: set(v) for k, v in index.lookup([r2]).items()} == {r2: {A, B}}
    # another call with the same batches (new tokens) is refused by the fences
    assert index.apply_batches(batches[:2]) == [False, False]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda blob: blob[:-1],  # cut short
        lambda blob: blob + b"\x00",  # a trailing byte: a batch cut short
        lambda blob: b"\x00\x09" + blob[2:],  # stream 9 of 2
        lambda blob: blob[:3] + b"x" + blob[4:],  # a mark that is not epoch:seq:token
        lambda blob: blob.replace(b"A\x00\x01\x00\x01", b"A\x00\x01\x00\x07", 1),  # entry 7
        lambda blob: blob.replace(b"A\x00\x01", b"Z\x00\x01", 1),  # unknown op
        lambda blob: 12345,  # not a string
    ],
)
def test_malformed_batches_are_refused_before_any_write(served: Any, mutate: Any) -> None:
    index, raw = served
    index.lookup([1])
    batches = [
        Batch([AddOp((5,), (55,), (A,))], "s", Watermark(0, 1)),
        Batch([AddOp(None, (56,), (A,)), EvictOp(55, KeyType.REQUEST, (A,))], "t", Watermark(0, 2)),
    ]
    call = the_call(index, batches)
    assert [b[0] for b in decode_batches(call.args[-1])] == [1, 2]
    bad = ScriptCall(call.script, call.keys, [*call.args[:-1], mutate(call.args[-1])])
    before = writes(raw)
    with pytest.raises(InvalidInputError):
        send(index, bad)
    assert writes(raw) == before
    assert index.lookup([55]) == {} and index.get_watermark("s") is None


def test_invalid_ops_raise_before_anything_is_sent(served: Any) -> None:
    index, raw = served
    index.lookup([1])
    before = script_calls(raw)
    with pytest.raises(InvalidInputError):
        index.apply_batches(
            [Batch([AddOp(None, (1,), (A,))], "s", Watermark(0, 0)), Batch([AddOp(None, (), (A,))])]
        )
    assert script_calls(raw) == before

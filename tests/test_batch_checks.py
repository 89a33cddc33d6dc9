"""``check_batch`` keeps ops already in normal form as they are (what an ingester builds) and
checks every other op field by field: both ways accept and refuse exactly the same ops. Ops the
ingester's planner built (:class:`~kvredis.batch.CheckedOps`) are taken whole; that the planner
builds only normal-form ops is checked by every ingestion test (``tests/ingest/conftest.py``)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvredis.batch import AddOp, CheckedOps, EvictOp, Watermark, check_batch
from kvredis.errors import InvalidInputError
from kvredis.types import KeyType, PodEntry

GPU = PodEntry("pod-a", "gpu")
SPEC = PodEntry("pod-a", speculative=True)
NO_TIER = PodEntry("pod-a")
NO_POD = PodEntry("", "gpu")


class _SlowAdd(AddOp):
    """An ``AddOp`` the normal-form shortcut does not take: checked field by field."""

    __slots__ = ()


class _SlowEvict(EvictOp):
    __slots__ = ()


_KEYS: list[Any] = [
    (1, 2, 3),
    [1, 2, 3],
    (),
    (0, 2**64 - 1),
    (2**64,),
    (-1,),
    (True,),
    (1.0,),
    ("1",),
]
_ENGINE_KEYS: list[Any] = [None, (7, 8, 9), (), [7], (2**64,), (False,)]
_ENTRIES: list[Any] = [(GPU,), (GPU, SPEC), [GPU], (), (NO_TIER,), (NO_POD,), ("pod",), (SPEC,)]
_PARENTS: list[Any] = [None, 5, 2**64, -1, True]


def _outcome(ops: list[Any]) -> Any:
    try:
        return ("ok", check_batch(ops, None, None))
    except InvalidInputError as exc:
        return ("refused", str(exc))


def test_adds_in_normal_form_are_kept_and_checked_alike() -> None:
    cases = itertools.product(_ENGINE_KEYS, _KEYS, _ENTRIES, _PARENTS)
    for eng, req, ents, parent in cases:
        fast = _outcome([AddOp(eng, req, ents, parent)])
        slow = _outcome([_SlowAdd(eng, req, ents, parent)])
        assert fast == slow, (eng, req, ents, parent)
        if fast[0] == "ok":
            [op] = fast[1]
            assert type(op) is AddOp
            assert type(op.request_keys) is tuple and type(op.entries) is tuple


def test_evicts_in_normal_form_are_kept_and_checked_alike() -> None:
    kinds: list[Any] = [KeyType.ENGINE, KeyType.REQUEST, "engine"]
    for key, kind, ents in itertools.product([5, 0, 2**64, -5, True, 5.0], kinds, _ENTRIES):
        fast = _outcome([EvictOp(key, kind, ents)])
        slow = _outcome([_SlowEvict(key, kind, ents)])
        assert fast == slow, (key, kind, ents)


def test_an_op_in_normal_form_is_the_same_object() -> None:
    add = AddOp((7,), (1, 2), (GPU,), 9)
    evict = EvictOp(3, KeyType.ENGINE, (GPU,))
    assert check_batch([add], None, None)[0] is add
    assert check_batch([evict, evict], None, None) == [evict, evict]
    assert check_batch([evict], None, None)[0] is evict


def test_entries_found_valid_once_are_not_trusted_for_another_tuple() -> None:
    good = (GPU,)
    bad: Any = ("not an entry",)
    with pytest.raises(InvalidInputError, match="batch op 1"):
        check_batch([EvictOp(1, KeyType.ENGINE, good), EvictOp(2, KeyType.ENGINE, bad)], None, None)
    with pytest.raises(InvalidInputError, match="batch op 1"):
        check_batch([AddOp(None, (1,), good), AddOp(None, (2,), (NO_POD,))], None, None)


def test_ops_the_planner_built_are_taken_whole_and_a_plain_list_is_checked() -> None:
    ops = CheckedOps([AddOp((7,), (1, 2), (GPU,), 9), EvictOp(3, KeyType.ENGINE, (GPU,))])
    assert check_batch(ops, "s", Watermark(0, 1)) is ops
    plain = list(ops)
    checked = check_batch(plain, "s", Watermark(0, 1))
    assert checked == plain and checked is not plain
    # the shortcut is for the ops alone: the fence is checked all the same
    with pytest.raises(InvalidInputError, match="both stream and watermark"):
        check_batch(ops, "s", None)
    with pytest.raises(InvalidInputError, match="stream"):
        check_batch(ops, "", Watermark(0, 1))
    # and a plain list holding the same kind of ops is still refused when one is bad
    with pytest.raises(InvalidInputError, match="batch op 2"):
        check_batch([*plain, EvictOp(2**64, KeyType.ENGINE, (GPU,))], None, None)


def test_a_watermark_is_checked_on_its_fast_path_as_on_its_slow_one() -> None:
    assert Watermark(-1, 2**63 - 1) == Watermark(-1, 2**63 - 1)
    for bad in [(0, 2**63), (-2, 0), (True, 0), (0, 1.0), ("1", 0)]:
        with pytest.raises(InvalidInputError, match="watermark"):
            Watermark(*bad)

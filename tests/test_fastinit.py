"""``slot_init``: a frozen, slotted dataclass built through its slots' setters behaves exactly as
the same dataclass built by its generated ``__init__``, and a class it cannot build the same
way is refused when decorated."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import InitVar, dataclass, field
from typing import Any

import pytest

from kvredis.batch import AddOp, EvictOp, Watermark
from kvredis.errors import InvalidInputError
from kvredis.fastinit import slot_init
from kvredis.features import ExtraKeys
from kvredis.ingest.actions import ApplyStep, StepResult
from kvredis.ingest.chains import Step, Tail
from kvredis.ingest.events import BlockRemoved, BlockStored, DecodedBatch, Rejection
from kvredis.ingest.planner import Lookup


def twin(name: str) -> Any:
    """A fresh class of one definition, named ``name`` (a module global, for pickle): built
    twice, once left as ``dataclass`` made it and once given :func:`slot_init`, the two cannot
    differ in anything but their ``__init__``."""

    @dataclass(frozen=True, slots=True)
    class Twin:
        a: int
        b: str | None
        c: tuple[int, ...] = ()
        d: int | None = None
        e: bytes | None = field(default=None, init=False, compare=False)

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("a < 0")

    Twin.__name__ = Twin.__qualname__ = name
    return Twin


Plain = twin("Plain")
Fast = slot_init(twin("Fast"))
assert "_set0" in Fast.__init__.__code__.co_names  # (the twin built through its slots)


CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((1, "x"), {}),
    ((1, None, (2, 3)), {}),
    ((1, "x", (2,), 4), {}),
    ((), {"a": 1, "b": "x", "d": 5}),
    ((1,), {"b": "y", "c": (9,)}),
]


def fields_of(obj: Any) -> list[Any]:
    return [getattr(obj, f.name) for f in dataclasses.fields(obj)]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_a_fast_built_object_is_the_plain_one(args: Any, kwargs: Any) -> None:
    plain, fast = Plain(*args, **kwargs), Fast(*args, **kwargs)
    assert fields_of(fast) == fields_of(plain)
    assert repr(fast).replace("Fast", "Plain") == repr(plain)
    assert fast == Fast(*args, **kwargs) and hash(fast) == hash(Fast(*args, **kwargs))
    assert pickle.loads(pickle.dumps(fast)) == fast
    assert copy.deepcopy(fast) == fast
    assert dataclasses.replace(fast, d=7).d == 7 and dataclasses.replace(fast, d=7).a == fast.a
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 2  # type: ignore[misc]


def test_bad_calls_fail_alike_and_post_init_still_runs() -> None:
    for args, kwargs in [((), {}), ((1,), {}), ((1, "x", (), None, 5), {}), ((1, "x"), {"z": 1})]:
        with pytest.raises(TypeError):
            Plain(*args, **kwargs)
        with pytest.raises(TypeError):
            Fast(*args, **kwargs)
    with pytest.raises(ValueError, match="a < 0"):
        Fast(-1, "x")


def test_classes_it_cannot_build_the_same_way_are_refused() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        a: int

    @dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    @dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        scale: InitVar[int] = 1

        def __post_init__(self, scale: int) -> None:
            pass

    for cls in (NoSlots, KeywordOnly, Factory, WithInitVar):
        with pytest.raises(TypeError):
            slot_init(cls)


def test_the_ingesters_classes_are_built_through_their_slots() -> None:
    for cls in (
        AddOp, EvictOp, Watermark, ApplyStep, StepResult, Tail, Step, BlockStored, BlockRemoved,
        DecodedBatch, Rejection, ExtraKeys, Lookup,
    ):  # fmt: skip
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
        assert "_set0" in cls.__init__.__code__.co_names, cls
    # and keep their checks
    with pytest.raises(InvalidInputError):
        Watermark(0, 2**63)
    assert BlockStored((1,)) == BlockStored((1,), None, (), 0)
    assert Tail(1, "m", None).packed is None

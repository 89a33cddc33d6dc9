"""Fixtures of the ingestion tests: ``engine_index``, the three indexes every engine-shape test
runs on (the embedded index, Redis 7 and Valkey 9; a fresh namespace each), and a check, in
every ingestion test, that the planner builds only ops ``check_batch`` would keep as they are
(it takes the planner's :class:`~kvredis.batch.CheckedOps` without looking)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import kvredis.batch
import kvredis.memory.index
import kvredis.redis.ops
from kvredis.batch import CheckedOps
from tests.conftest import close_backend, make_backend

ENGINE_BACKENDS = [
    "memory",
    pytest.param("redis@redis", marks=pytest.mark.redis),
    pytest.param("redis@valkey", marks=pytest.mark.redis),
]


@pytest.fixture(params=ENGINE_BACKENDS)
def engine_index(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh, empty index: embedded, Redis 7, Valkey 9."""
    idx = make_backend(request.param, request)
    try:
        yield idx
    finally:
        close_backend(idx)


@pytest.fixture(autouse=True)
def planned_ops_are_in_normal_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op list the ingester hands a backend, checked field by field as a plain list would
    be: accepted, and each op kept as the very object it is (normal form)."""
    real = kvredis.batch.check_batch

    def checking(ops: Any, stream: Any, watermark: Any) -> Any:
        if type(ops) is CheckedOps:
            plain = real(list(ops), stream, watermark)
            assert len(plain) == len(ops)
            for op, kept in zip(ops, plain, strict=True):
                assert kept is op, f"the planner built an op not in normal form: {op!r}"
        return real(ops, stream, watermark)

    for module in (kvredis.batch, kvredis.redis.ops, kvredis.memory.index):
        monkeypatch.setattr(module, "check_batch", checking)

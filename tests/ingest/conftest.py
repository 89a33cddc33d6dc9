"""Fixtures of the ingestion tests: ``engine_index``, the three indexes every engine-shape test
runs on (the embedded index, Redis 7 and Valkey 9; a fresh namespace each)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

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

"""A rolling upgrade with two kvredis versions side by side: a call is refused, never misread,
by a library of another protocol version, and no client replaces a newer library with an older
one (``FUNCTION LOAD REPLACE`` at connect, or a reload after ``FUNCTION FLUSH``).

The newer version is built here from the shipped sources: the next api, whose ``kvredis_score``
reads tier weights in thousandths (its clients send ``1000`` for a weight of 1). Read by the
other version's functions, a weight of ``1.0`` would score 4 keys ``0.004`` where ``4.0`` is
right: every score below must be ``4.0``, whichever client asks and whichever library the
server holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import kvredis.redis.index as index_module
from kvredis import PodEntry, RedisClusterIndex, RedisIndex, RedisIndexConfig
from kvredis.errors import BackendError, ProtocolVersionError
from kvredis.redis.functions import (
    API_FIELD,
    API_VERSION,
    LIBRARY,
    VERSION_FUNCTION,
    FunctionRegistry,
    UseFunctions,
    api_argument,
    build_library,
    shipped_library,
)
from kvredis.redis.layout import meta_key
from kvredis.redis.scripts import Script, expand, lua_sources
from tests.servers import LocalCluster, RedisServer

pytestmark = pytest.mark.redis

NEWER = API_VERSION + 1
A = PodEntry("pod-a", "gpu")
KEYS = [11, 12, 13, 14]
#: the right score of pod-a over KEYS, gpu weighing 1: what every client must get
RIGHT = {"pod-a": 4.0}

_WEIGHT = "num_arg(ARGV[at + 2 * i], 'weight of tier ' .. i)"
_DEFAULT = "num_arg(ARGV[at + 2 * nw + 1], 'weight of an unlisted tier')"


def newer_sources() -> dict[str, str]:
    """The shipped sources as the next api ships them: weights in thousandths."""
    sources = dict(lua_sources())
    score = sources["score"]
    assert _WEIGHT in score and _DEFAULT in score, "score.lua reads its weights otherwise now"
    sources["score"] = score.replace(_WEIGHT, f"{_WEIGHT} / 1000").replace(
        _DEFAULT, f"{_DEFAULT} / 1000"
    )
    return sources


def newer_registry(use: UseFunctions = "auto") -> FunctionRegistry:
    """The registry of a client of the newer version: its library and its own scripts."""
    sources = newer_sources()
    scripts = {}
    for name in sources:
        if "/" not in name:
            source = expand(name, sources).encode()
            scripts[name] = Script(name, source, hashlib.sha1(source).hexdigest())
    library = build_library(sources, api=NEWER, release="99.0.0")
    return FunctionRegistry(scripts, library, use)


@contextlib.contextmanager
def newer_client(config: RedisIndexConfig) -> Iterator[RedisIndex]:
    """A client of the newer version (it connects, and settles on a library, as built)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index_module, "FunctionRegistry", newer_registry)
        index = RedisIndex(config)
    try:
        yield index
    finally:
        index.close()


def score_old(index: RedisIndex) -> dict[str, float]:
    return index.score(KEYS, {"gpu": 1.0})


def score_new(index: RedisIndex) -> dict[str, float]:
    return index.score(KEYS, {"gpu": 1000.0})  # the newer api's meaning of 1


def server_api(raw: redis.Redis) -> int | None:
    try:
        return int(raw.fcall_ro(VERSION_FUNCTION, 0)[1])
    except redis.ResponseError:
        return None


def _calls(raw: redis.Redis) -> dict[str, int]:
    stats = raw.info("commandstats")
    return {
        name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
        for name in ("evalsha", "fcall", "fcall_ro", "function|load")
    }


@pytest.fixture
def raw(own_redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=own_redis_server.port)
    yield client
    client.close()


@pytest.fixture
def config(own_redis_server: RedisServer) -> RedisIndexConfig:
    return RedisIndexConfig(address=own_redis_server.url, namespace=f"kvt-{uuid.uuid4().hex[:8]}")


def test_the_newer_library_misreads_an_older_call_only_without_the_check(
    raw: redis.Redis, config: RedisIndexConfig
) -> None:
    """The premise: the two versions' functions read the same arguments differently."""
    with RedisIndex(config) as old:
        old.add(None, KEYS, [A])
        layout = old._session.state.layout
    args = [layout.gen, layout.rprefix, layout.bucket_bits, 0, 1, "gpu", "1.0", "0",
            b"".join(k.to_bytes(8, "big") for k in KEYS)]  # fmt: skip
    keys = [layout.meta, layout.pi, layout.pp, layout.sx]
    raw.function_load(newer_registry().library.code.decode(), replace=True)
    newer = raw.fcall_ro("kvredis_score", 4, *keys, *args, api_argument(NEWER))
    assert float(newer[4]) == 0.004  # what an older call would get, read by the newer library
    for marker in ([api_argument(API_VERSION)], [], ["kvredis-api:x"]):
        with pytest.raises(redis.ResponseError, match=r"^KVREDIS_VERSION the call speaks"):
            raw.fcall_ro("kvredis_score", 4, *keys, *args, *marker)
    with pytest.raises(redis.ResponseError, match="KVREDIS_VERSION"):
        raw.fcall_ro("kvredis_ping", 0)


def test_an_upgrade_older_clients_first_then_a_newer_one(
    raw: redis.Redis, config: RedisIndexConfig, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisIndex(config) as old:
        old.add(None, KEYS, [A])
        assert score_old(old) == RIGHT and old.registry.active
        assert server_api(raw) == API_VERSION
        with newer_client(config) as new:  # replaces the older library
            assert new.registry.active and server_api(raw) == NEWER
            assert raw.hget(meta_key(config.namespace), API_FIELD) == str(NEWER).encode()
            before = _calls(raw)
            assert score_new(new) == RIGHT
            assert _calls(raw)["fcall_ro"] > before["fcall_ro"]
            with caplog.at_level(logging.WARNING, logger="kvredis"):
                assert score_old(old) == RIGHT  # refused by the newer library, then EVALSHA
            assert not old.registry.active and server_api(raw) == NEWER
            assert any("newer api" in r.getMessage() for r in caplog.records)
            old.add(None, [15], [A])  # its writes go by EVALSHA too
            assert old.score([*KEYS, 15], {"gpu": 1.0}) == {"pod-a": 5.0}
            assert new.score([*KEYS, 15], {"gpu": 1000.0}) == {"pod-a": 5.0}
            raw.function_flush()  # the older client must not load its library then
            assert score_old(old) == RIGHT and server_api(raw) is None
            assert score_new(new) == RIGHT and server_api(raw) == NEWER  # the newer reloads


def test_an_older_client_finding_no_library_under_newer_clients_does_not_load_its_own(
    raw: redis.Redis, config: RedisIndexConfig
) -> None:
    with newer_client(config) as new:
        new.add(None, KEYS, [A])
        raw.function_flush()
        with RedisIndex(config) as old:  # connects to a server without a library
            assert not old.registry.active
            assert raw.function_list() == []
            assert score_old(old) == RIGHT
        assert score_new(new) == RIGHT and server_api(raw) == NEWER


def test_an_older_client_active_before_a_flush_does_not_reload_under_newer_clients(
    raw: redis.Redis, config: RedisIndexConfig
) -> None:
    """The other order: the older client settled on its library first; the newer client's
    connect replaced it; after a flush the older client's miss must not bring it back."""
    with RedisIndex(config) as old:
        old.add(None, KEYS, [A])
        with newer_client(config) as new:
            raw.function_flush()
            loads = _calls(raw)["function|load"]
            assert score_old(old) == RIGHT
            assert raw.function_list() == [] and _calls(raw)["function|load"] == loads
            assert not old.registry.active
            assert score_new(new) == RIGHT and server_api(raw) == NEWER


def test_a_rollback_newer_clients_first_then_an_older_one(
    raw: redis.Redis, config: RedisIndexConfig
) -> None:
    with newer_client(config) as new:
        new.add(None, KEYS, [A])
        assert score_new(new) == RIGHT
        loads = _calls(raw)["function|load"]
        with RedisIndex(config) as old:  # finds a newer library: leaves it, uses EVALSHA
            assert not old.registry.active
            assert score_old(old) == RIGHT
            old.add(None, [15], [A])
        assert server_api(raw) == NEWER and _calls(raw)["function|load"] == loads
        assert score_new(new) == RIGHT and new.registry.active


def test_a_newer_client_upgrades_an_older_library_loaded_under_it(
    raw: redis.Redis, config: RedisIndexConfig
) -> None:
    """An operator (or an older client on a fresh server) loads the older library while newer
    clients run: their next call is refused, and they load theirs again."""
    with newer_client(config) as new:
        new.add(None, KEYS, [A])
        raw.function_load(shipped_library().code.decode(), replace=True)
        assert server_api(raw) == API_VERSION
        assert score_new(new) == RIGHT
        assert server_api(raw) == NEWER and new.registry.active


def test_a_client_that_must_use_the_library_fails_with_a_clear_error(
    raw: redis.Redis, config: RedisIndexConfig
) -> None:
    with RedisIndex(config) as old:
        old.add(None, KEYS, [A])
    raw.function_load(newer_registry().library.code.decode(), replace=True)
    strict = RedisIndexConfig(address=config.address, namespace=config.namespace,
                              use_functions=True)  # fmt: skip
    with pytest.raises(BackendError, match="newer api"):
        RedisIndex(strict)


def test_a_version_refusal_is_a_typed_error() -> None:
    from kvredis.errors import translate

    error = translate("KVREDIS_VERSION the call speaks kvredis-api:1, ... script: kvredis_ping")
    assert isinstance(error, ProtocolVersionError) and isinstance(error, BackendError)


def test_every_function_but_the_version_refuses_another_version(raw: redis.Redis) -> None:
    library = shipped_library()
    raw.function_load(library.code.decode())
    for name, read in library.reads.items():
        call = raw.fcall_ro if read else raw.fcall
        for marker in (api_argument(API_VERSION + 1), api_argument(API_VERSION - 1)):
            with pytest.raises(redis.ResponseError, match=f"KVREDIS_VERSION .*{marker}"):
                call(f"{LIBRARY}_{name}", 0, marker)
    assert raw.fcall_ro("kvredis_ping", 0, api_argument()) == 1
    info: Any = raw.fcall_ro(VERSION_FUNCTION, 0)
    assert int(info[1]) == API_VERSION


def _primaries(cluster: LocalCluster) -> list[int]:
    return [port for port, (role, _, _) in cluster.topology().items() if role == "master"]


def test_a_cluster_client_under_a_newer_library_scores_right_and_leaves_it(
    redis_cluster: LocalCluster,
) -> None:
    """Both sides on a cluster: an older client settled on its library, then a newer one loads
    its own on every primary; the older client's fast path (one call per node) and per-shard
    path are refused, never misread, and it keeps to EVALSHA; an older client connecting then
    leaves the newer library in place."""
    config = RedisIndexConfig(
        address=redis_cluster.url, namespace=f"kvt-{uuid.uuid4().hex[:8]}", cluster_shards=4
    )
    newer = newer_registry().library.code.decode()
    keys = list(range(100, 140))  # over every shard
    try:
        with RedisClusterIndex(config) as old:
            old.add(None, keys, [A])
            assert old.core.registry.active
            for port in _primaries(redis_cluster):
                redis_cluster.client(port).function_load(newer, replace=True)
            assert old.score(keys, {"gpu": 1.0}) == {"pod-a": 40.0}
            assert old.lookup(keys)[keys[-1]] == [A]
            assert not old.core.registry.active
            with RedisClusterIndex(config) as late:
                assert not late.core.registry.active
                assert late.score(keys, {"gpu": 1.0}) == {"pod-a": 40.0}
            for port in _primaries(redis_cluster):
                assert server_api(redis_cluster.client(port)) == NEWER
            old.drop_namespace()
    finally:
        for port in _primaries(redis_cluster):
            redis_cluster.client(port).function_load(shipped_library().code.decode(), replace=True)

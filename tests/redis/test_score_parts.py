"""``score`` does bounded work per call: a long chain is scored in parts of at most
:data:`~kvredis.redis.ops.SCORE_KEYS_PER_CALL` keys (on a cluster: the keys one node's call
walks), each part going on from the scores the earlier ones reached, and the floats are the
embedded index's and the LongestPrefixScorer's exactly. Single server and cluster, sync and
async, Redis and Valkey."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvredis import (
    InMemoryIndex,
    InvalidInputError,
    KeyType,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
)
from kvredis.redis.codec import hash_blob
from kvredis.redis.ops import SCORE_KEYS_PER_CALL
from kvredis.redis.requests import Command, ScriptCall
from kvredis.redis.session import op_send
from kvredis.scoring import LongestPrefixScorer
from tests.conftest import (
    CLUSTER_BACKENDS,
    REDIS_BACKENDS,
    TEST_PREFIX,
    close_backend,
    make_backend,
)

pytestmark = pytest.mark.redis

A, B, C = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu"), PodEntry("pod-c", "disk")
D = PodEntry("pod-d", "gpu")
SPEC = PodEntry("pod-s", "cpu", speculative=True)
#: Weights whose sums depend on the order they are added in (0.1 is no binary fraction).
WEIGHTS = {"gpu": 0.1, "cpu": 0.7}
LENGTH = 3 * SCORE_KEYS_PER_CALL + 123


class Recorder:
    """Records the keys each script call of a walk (``score``, ``lookup``, ``lookup_shards``,
    ``score_shards``) carries, by wrapping the client's script registry."""

    def __init__(self, index: Any) -> None:
        target = getattr(index, "inner", index)
        core = getattr(target, "core", None)
        self.registry = core.registry if core is not None else target.registry
        self.walked: list[int] = []
        self._call_command = self.registry.call_command
        self.registry.call_command = self._record

    def _record(self, call: ScriptCall) -> Command:
        if call.script in ("score", "lookup"):
            blob = max((a for a in call.args if isinstance(a, bytes)), key=len)  # the chain
            self.walked.append(len(blob) // 8)
        elif call.script == "lookup_shards":
            self.walked.append(sum(len(blob) // 8 for blob in shard_chains(call.args)))
        elif call.script == "score_shards":  # the shards' part of the chain: the last argument
            self.walked.append(len(call.args[-1]) // 8)
        return self._call_command(call)

    def close(self) -> None:
        self.registry.call_command = self._call_command


def shard_chains(args: Any) -> list[bytes]:
    """The chain (hash blob) of each shard of a ``lookup_shards`` call's arguments: after the
    pod filter, per shard 11 arguments (the chain the 9th) and 2 per stamp carried."""
    at = 1 + int(args[0])
    chains = []
    while at < len(args):
        chains.append(bytes(args[at + 8]))
        at += 11 + 2 * int(args[at + 10])
    return chains


Fleet = tuple[Any, InMemoryIndex, list[int]]


@pytest.fixture(params=[*REDIS_BACKENDS, *CLUSTER_BACKENDS])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    yield from _fleet(request)


@pytest.fixture(params=REDIS_BACKENDS)
def single_fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    yield from _fleet(request)


def _fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """A backend and the model, holding the same long chain: pod-a all of it, pod-b the first
    part of a call exactly, pod-c up to the middle of the third part, pod-d all but one key in
    the second part."""
    index, model = make_backend(request.param, request), InMemoryIndex()
    keys = list(range(10**6, 10**6 + LENGTH))
    try:
        for store in (index, model):
            store.add(None, keys, [A, D])
            store.add(None, keys[:SCORE_KEYS_PER_CALL], [B])
            store.add(None, keys[: 2 * SCORE_KEYS_PER_CALL + 500], [C])
            store.evict(keys[SCORE_KEYS_PER_CALL + 77], KeyType.REQUEST, [D])
        yield index, model, keys
    finally:
        close_backend(index)


def _expected(model: InMemoryIndex, keys: list[int], pods: Any = None) -> dict[str, float]:
    return LongestPrefixScorer(WEIGHTS).score(keys, model.lookup(keys, pods))


def test_a_long_chain_is_scored_in_bounded_calls_with_the_models_floats(
    fleet: Fleet,
) -> None:
    index, model, keys = fleet
    recorder = Recorder(index)
    try:
        got = index.score(keys, WEIGHTS)
    finally:
        recorder.close()
    assert got == _expected(model, keys)
    assert got["pod-a"] == _expected(model, keys)["pod-a"] != 0.1 * LENGTH  # summed in order
    assert recorder.walked and max(recorder.walked) <= SCORE_KEYS_PER_CALL
    assert sum(recorder.walked) >= LENGTH  # the whole chain, in parts
    for pods in ({"pod-b", "pod-c"}, {"pod-d"}, {"pod-x"}):
        assert index.score(keys, WEIGHTS, pods) == _expected(model, keys, pods)
    for n in (1, SCORE_KEYS_PER_CALL, SCORE_KEYS_PER_CALL + 1, 2 * SCORE_KEYS_PER_CALL + 500):
        assert index.score(keys[:n], WEIGHTS) == _expected(model, keys[:n])


def test_no_more_parts_are_sent_once_no_pod_is_left(single_fleet: Fleet) -> None:
    """The server-side scorer knows when no pod is left (a cluster scores a lookup on the
    client, which goes on while any pod holds the keys)."""
    index, model, keys = single_fleet
    index.evict(keys[100], KeyType.REQUEST, [A, B, C])  # pod-d alone from key 100, to key 4173
    model.evict(keys[100], KeyType.REQUEST, [A, B, C])
    recorder = Recorder(index)
    try:
        got = index.score(keys, WEIGHTS)
    finally:
        recorder.close()
    assert got == _expected(model, keys)
    assert sum(recorder.walked) <= 3 * SCORE_KEYS_PER_CALL  # not the chain's last part


def test_live_expiring_entries_score_as_the_model_says(
    fleet: Fleet,
) -> None:
    """With an expiring entry live, every key costs a read of its expiring bucket: the parts
    stay bounded, and a pod held only by expiring entries scores as in the model."""
    index, model, keys = fleet
    for store in (index, model):
        store.add(None, keys[: SCORE_KEYS_PER_CALL + 9], [SPEC], ttl=600)
    recorder = Recorder(index)
    try:
        got = index.score(keys, WEIGHTS)
    finally:
        recorder.close()
    assert got == _expected(model, keys) and got["pod-s"] > 0
    assert max(recorder.walked) <= SCORE_KEYS_PER_CALL


def test_malformed_carried_scores_are_refused(redis_server_url: str) -> None:
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=f"{TEST_PREFIX}sc"))
    try:
        layout = index._session.state.layout
        head = (layout.gen, layout.rprefix, layout.bucket_bits, 0, 0, "1.0", hash_blob([1]))
        keys = (layout.meta, layout.pi, layout.pp, layout.sx)
        for tail in (
            [0, 1, b"pod-a", 0, "nope", b""],  # a score that is no number
            [0, 2, b"pod-a", 0, "1.5", b""],  # fewer slots than c says
            [0, -1],
            [0, "x"],
            [2],  # the more-keys flag is 0 or 1
            [0, 1, b"pod-a", "r", "1.5", b""],  # a rank that is no integer
            [0, 1, b"pod-a", -1, "1.5", b""],
            [0, 1, b"pod-a", 0, "1.5", b"no stamp"],
            [0, 1, b"pod-a", 0, "1.5", b"3@soon"],
        ):
            call = ScriptCall("score", keys, (*head, *tail), read=True)
            with pytest.raises(InvalidInputError):
                index._exec.run(op_send(index._session, call))
        # a stamp that never holds (""): the slot is out, with the score it came with
        call = ScriptCall("score", keys, (*head, 0, 1, b"pod-a", 3, "1.5", b""), read=True)
        assert index._exec.run(op_send(index._session, call)) == [0, 0, b"pod-a", 3, b"1.5", 0, b""]
    finally:
        index.drop_namespace()
        index.close()

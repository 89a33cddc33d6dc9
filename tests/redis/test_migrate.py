"""migrate_namespace / kvredis migrate: a namespace filled by the previous release (layout
kvredis-kvblock/1, its scripts in tests/redis/layout_v1) converted in place answers as before."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from kvredis import (
    AsyncRedisIndex,
    EngineKeyNotFoundError,
    NamespaceLayoutError,
    NamespaceMissingError,
    PodEntry,
    RedisIndex,
    RedisIndexConfig,
    StaleNamespaceError,
    Watermark,
    drop_namespace,
    migrate_namespace,
    migrate_namespace_async,
)
from kvredis.redis.inspect import Inspector, op_check
from kvredis.redis.layout import LAYOUT_VERSION
from kvredis.redis.ops import expiry_mode_of
from kvredis.scoring import LongestPrefixScorer
from kvredis.types import KeyType
from tests.redis.layout_v1 import RELEASES, SORTED_SET_RELEASE, V1, V1Namespace

pytestmark = pytest.mark.redis

TIERS = ("gpu", "cpu")
PODS = [PodEntry(f"pod-{i}", tier) for i in range(4) for tier in TIERS]
LONG_TTL_MS = 3_600_000
SHORT_TTL_MS = 300
SCORER = LongestPrefixScorer()


@dataclass
class Filled:
    """A /1 namespace and the answers the /1 scripts gave."""

    v1: V1Namespace
    chains: list[list[int]]
    engine_keys: list[int]
    speculative_keys: set[int] = field(default_factory=set)
    #: engine keys mapped to request keys that held no live entry before the migration
    dangling: set[int] = field(default_factory=set)
    lookups: dict[tuple[int, ...], dict[int, list[PodEntry]]] = field(default_factory=dict)
    request_keys: dict[int, int | None] = field(default_factory=dict)
    watermarks: dict[str, bytes | None] = field(default_factory=dict)

    def queries(self) -> list[tuple[int, ...]]:
        """Every chain from every start: every key is walked to."""
        return sorted({tuple(c[i:]) for c in self.chains for i in range(len(c))})

    def record(self) -> None:
        for q in self.queries():
            self.lookups[q] = self.v1.lookup(list(q))
        for e in self.engine_keys:
            r = self.request_keys[e] = self.v1.get_request_key(e)
            if r is not None and not self.v1.lookup([r]):
                self.dangling.add(e)
        for s in ("stream-a", "stream-b", "stream-c"):
            value = self.v1.raw.hget(self.v1.wm, s)
            self.watermarks[s] = None if value is None else bytes(value)


def _fill(
    raw: redis.Redis,
    namespace: str,
    seed: int = 7,
    chains: int = 40,
    release: str = SORTED_SET_RELEASE,
) -> Filled:
    """Adds with engine keys by several pods on both tiers (sharing prefixes), speculative
    entries with a live ttl, with a past ttl and added again without one, evicts by request
    and engine key, and fenced batches that set watermarks, all through the /1 scripts."""
    rng = random.Random(seed)
    v1 = V1Namespace(raw, namespace, release, expiry_mode_of(raw.info("server")))
    roots = [[rng.getrandbits(64) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    all_chains = []
    for _ in range(chains):
        root = rng.choice(roots)
        all_chains.append(root + [rng.getrandbits(64) for _ in range(rng.randint(0, 25))])
    engine_of: dict[int, int] = {}

    def add(chain: list[int], entries: list[PodEntry], ttl_ms: int = 0) -> None:
        eng = [engine_of.setdefault(k, rng.getrandbits(64)) for k in chain]
        v1.add(eng, chain, entries, ttl_ms)

    def evict(key: int, key_type: KeyType, entries: list[PodEntry]) -> None:
        v1.evict(key, key_type, entries)

    filled = Filled(v1, all_chains, [])
    for chain in all_chains:
        for pod in rng.sample(PODS, rng.randint(1, 4)):
            add(chain[: rng.randint(1, len(chain))], [pod])
    spec = [PodEntry(f"pod-{i}", "gpu", speculative=True) for i in range(4)]
    for chain in rng.sample(all_chains, 12):  # live speculative entries
        part = chain[rng.randint(0, len(chain) - 1) :]
        add(part, [rng.choice(spec)], LONG_TTL_MS)
        filled.speculative_keys.update(part)
    for chain in rng.sample(all_chains, 10):
        key = rng.choice(chain)
        evict(key, KeyType.REQUEST, rng.sample(PODS, 3))
    for chain in rng.sample(all_chains, 6):
        key = rng.choice([k for k in chain if k in engine_of] or [chain[0]])
        evict(engine_of.setdefault(key, rng.getrandbits(64)), KeyType.ENGINE, rng.sample(PODS, 4))
    for stream, (epoch, seq) in (("stream-a", (3, 41)), ("stream-b", (0, 7))):
        key = rng.choice(rng.choice(all_chains))
        v1.apply_evict_batch(stream, epoch, seq, key, [PODS[0]])
    again = rng.choice(all_chains)  # a speculative entry added again without a ttl
    add(again, [spec[2]], LONG_TTL_MS)
    add(again, [spec[2]])
    # past their deadline at the end (added last: a /1 add sweeps the pairs already due)
    for chain in rng.sample(all_chains, 6):
        part = chain[: rng.randint(1, len(chain))]
        add(part, [spec[0], spec[1]], SHORT_TTL_MS)
        filled.speculative_keys.update(part)
    time.sleep(2 * SHORT_TTL_MS / 1000)
    filled.engine_keys = [*sorted(engine_of.values()), rng.getrandbits(64)]
    filled.record()
    return filled


def _config(url: str, namespace: str) -> RedisIndexConfig:
    return RedisIndexConfig(address=url, namespace=namespace)


def _ordered(filled: Filled, found: dict[int, list[PodEntry]]) -> dict[int, list[PodEntry]]:
    """A lookup with the entries of the keys that held a speculative entry with a ttl sorted:
    this release lists a key's entries with a ttl after those without (a /1 key listed them in
    the order they were added); every other key keeps its order."""
    return {k: sorted(v, key=repr) if k in filled.speculative_keys else v for k, v in found.items()}


def _agrees(
    filled: Filled,
    index: Any,
    only: set[tuple[int, ...]] | None = None,
) -> None:
    """Every answer of ``index`` is the /1 scripts' answer."""
    for q, before in filled.lookups.items():
        if only is not None and q not in only:
            continue
        assert _ordered(filled, index.lookup(list(q))) == _ordered(filled, before), q
        assert index.score(list(q)) == pytest.approx(SCORER.score(list(q), before)), q
    for e, r in filled.request_keys.items():
        if r is None:
            with pytest.raises(EngineKeyNotFoundError):
                index.get_request_key(e)
        else:
            assert index.get_request_key(e) == r
    for s, w in filled.watermarks.items():
        got = index.get_watermark(s)
        if w is None:
            assert got is None
        else:
            epoch, seq = w.split(b":")[:2]
            assert got == Watermark(int(epoch), int(seq))


def _clean(url: str, filled: Filled) -> None:
    """``kvredis check`` finds nothing wrong, and notes only what the /1 release left and this
    release leaves as well: the mappings of request keys that held no live entry already before
    the migration (emptied by evicts by request key, or holding only expired speculative
    entries; ``get_request_key`` still answers them, and ``--repair`` keeps them), and past-due
    items of expiring buckets that have a later deadline (expiry mode "key": a write to the
    bucket drops them; ``--repair`` reclaims them)."""
    inspector = Inspector(_config(url, filled.v1.namespace))
    try:
        layout = inspector.layout()
        assert layout is not None
        report = inspector.run(op_check(layout))
        assert report.findings == [], report.counts()
        notes = report.note_counts()
        assert set(notes) <= {"dangling_mapping", "expired_speculative"}, notes
        if filled.v1.release == SORTED_SET_RELEASE:  # the migration wrote the expiring buckets
            assert "expired_speculative" not in notes
        dangling = {
            int.from_bytes(f.field or b"", "big")
            for f in report.notes
            if f.problem.value == "dangling_mapping"
        }
        assert dangling <= filled.dangling
        if filled.v1.release == SORTED_SET_RELEASE:
            inspector.run(op_check(layout, repair=True))
            assert inspector.run(op_check(layout)).ok
    finally:
        inspector.close()


@pytest.mark.parametrize("release", RELEASES)
def test_a_namespace_of_a_previous_release_migrates_and_answers_alike(
    redis_server_url: str, namespace: str, release: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    try:
        filled = _fill(raw, namespace, release=release)
        sorted_set = release == SORTED_SET_RELEASE
        assert raw.type(filled.v1.sx) == (b"zset" if sorted_set else b"string")
        expiring = list(raw.scan_iter(match=f"{namespace}:s:*"))
        assert bool(expiring) is not sorted_set
        expiry = raw.hget(f"{namespace}:meta", "expiry")
        assert filled.watermarks["stream-a"] is not None
        seen: list[tuple[int, int]] = []
        report = migrate_namespace(
            _config(redis_server_url, namespace),
            progress=lambda done, total: seen.append((done, total)),
            pairs_per_call=7,
        )
        assert report.migrated and report.source == V1 and report.target == LAYOUT_VERSION
        assert not report.resumed
        pairs = report.pairs
        if sorted_set:
            assert pairs > 7 and report.moved > 0 and report.dropped > 0
            assert report.moved + report.dropped == pairs
            assert seen[0] == (7, pairs) and seen[-1] == (pairs, pairs)  # 7 in the first call
            assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        else:
            assert (pairs, report.moved, report.dropped, seen) == (0, 0, 0, [(0, 0)])
        meta = raw.hgetall(f"{namespace}:meta")
        assert meta[b"layout"] == LAYOUT_VERSION.encode()
        assert b"migrating" not in meta and b"migrate_total" not in meta
        # the expiry mode a /1 namespace had is kept; one without gets the server's
        mode = expiry_mode_of(raw.info("server")).encode()
        assert meta[b"expiry"] == (expiry or mode) == raw.hget(f"{namespace}:pi", "expiry")
        assert not raw.exists(f"{namespace}:mx")
        with RedisIndex(_config(redis_server_url, namespace)) as index:
            _agrees(filled, index)
            _clean(redis_server_url, filled)
            _agrees(filled, index)  # --repair kept every mapping the reference answers for
        again = migrate_namespace(_config(redis_server_url, namespace))
        assert not again.migrated and again.source is None
    finally:
        raw.close()


class _Cut(Exception):
    pass


def test_a_migration_cut_short_goes_on_where_it_stopped_while_clients_work(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    try:
        filled = _fill(raw, namespace, seed=11)
        total = raw.zcard(filled.v1.sx)
        pages: list[int] = []

        def cut(done: int, of: int) -> None:
            pages.append(done)
            if len(pages) == 3:  # the crash: after the first call and two pages, 5 pairs each
                raise _Cut

        with pytest.raises(_Cut):
            migrate_namespace(_config(redis_server_url, namespace), cut, pairs_per_call=5)
        meta = raw.hgetall(f"{namespace}:meta")
        assert meta[b"migrating"] == V1.encode() and meta[b"migrate_total"] == str(total).encode()
        assert raw.zcard(f"{namespace}:mx") == total - 15
        inspector = Inspector(_config(redis_server_url, namespace))
        layout = inspector.layout()
        assert layout is not None
        midway = inspector.run(op_check(layout))
        inspector.close()
        assert midway.findings == [], midway.counts()
        # the previous release is fenced out: its next call fails the generation check
        with pytest.raises(redis.ResponseError, match="KVREDIS_STALE"):
            filled.v1.add(None, [123], [PODS[0]])
        with RedisIndex(_config(redis_server_url, namespace)) as index:
            # readers answer meanwhile (keys without a speculative entry exactly as before)
            plain = {q for q in filled.lookups if not filled.speculative_keys.intersection(q)}
            assert plain
            _agrees(filled, index, only=plain)
            # and writers write
            index.add([901], [900], [PODS[1]])
            assert index.lookup([900]) == {900: [PODS[1]]}
            raw.delete(f"{namespace}:meta")  # lost, and healed by the next client (from pi)
            assert index.lookup([900]) == {900: [PODS[1]]}
            assert raw.hget(f"{namespace}:meta", "migrating") is None
            report = migrate_namespace(_config(redis_server_url, namespace), pairs_per_call=4)
            assert report.resumed and report.migrated and report.pairs == total - 15
            assert report.moved + report.dropped == total - 15
            _agrees(filled, index)
            assert index.get_request_key(901) == 900
        _clean(redis_server_url, filled)
    finally:
        raw.close()


def test_migrate_refuses_what_it_cannot_convert(redis_server_url: str, namespace: str) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    cfg = _config(redis_server_url, namespace)
    try:
        with pytest.raises(NamespaceMissingError, match="does not exist"):
            migrate_namespace(cfg)
        raw.hset(f"{namespace}:meta", mapping={"layout": "kvredis-kvblock/7", "gen": "g"})
        with pytest.raises(NamespaceLayoutError, match="upgrade kvredis"):
            migrate_namespace(cfg)
        raw.hset(f"{namespace}:meta", mapping={"layout": "someone-else/9"})
        with pytest.raises(NamespaceLayoutError, match="no kvredis layout"):
            migrate_namespace(cfg)
        raw.hset(f"{namespace}:meta", mapping={"layout": V1, "gen": "dropping:abc"})
        with pytest.raises(NamespaceLayoutError, match="kvredis drop"):
            migrate_namespace(cfg)
        assert drop_namespace(cfg) == 1
        assert not raw.exists(f"{namespace}:meta")
    finally:
        raw.close()


def test_a_drop_during_a_migration_stops_it(redis_server_url: str, namespace: str) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    cfg = _config(redis_server_url, namespace)
    try:
        _fill(raw, namespace, seed=3, chains=12)

        def drop_midway(done: int, total: int) -> None:
            if done:
                drop_namespace(cfg)

        with pytest.raises(StaleNamespaceError, match="dropped or recreated"):
            migrate_namespace(cfg, drop_midway, pairs_per_call=2)
        assert list(raw.scan_iter(match=f"{namespace}:*")) == []
    finally:
        raw.close()


def test_readers_and_writers_of_this_release_run_during_the_migration(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    cfg = _config(redis_server_url, namespace)
    filled = _fill(raw, namespace, seed=5, chains=20)
    plain = [q for q in filled.lookups if not filled.speculative_keys.intersection(q)]
    stop = threading.Event()
    failures: list[BaseException] = []
    written: dict[int, list[PodEntry]] = {}
    reads = [0]

    def reader() -> None:
        with RedisIndex(cfg) as index:
            while not stop.is_set():
                for q in plain:
                    got = index.lookup(list(q))
                    if got != filled.lookups[q]:
                        raise AssertionError((q, got, filled.lookups[q]))
                    reads[0] += 1

    def writer() -> None:
        rng = random.Random(1)
        spec = PodEntry("pod-w", "cpu", speculative=True)
        with RedisIndex(cfg) as index:
            n = 0
            while not stop.is_set() or n < 20:
                chain = [rng.getrandbits(64) for _ in range(rng.randint(1, 12))]
                index.add([k ^ 1 for k in chain], chain, [PODS[n % len(PODS)]])
                index.add(None, chain[:1], [spec], ttl=3600)
                for k in chain:
                    written[k] = [PODS[n % len(PODS)]] + ([spec] if k == chain[0] else [])
                n += 1

    def guarded(f: Any) -> Any:
        def run() -> None:
            try:
                f()
            except BaseException as exc:
                failures.append(exc)
                stop.set()

        return run

    threads = [threading.Thread(target=guarded(f)) for f in (reader, writer)]

    def progress(_done: int, _total: int) -> None:
        if not threads[0].is_alive():  # after the first call: the namespace is in this layout
            for t in threads:
                t.start()
        time.sleep(0.002)

    try:
        report = migrate_namespace(cfg, progress, pairs_per_call=1)
    finally:
        stop.set()
    for t in threads:
        t.join()
    assert not failures, failures
    assert report.migrated and report.pairs > 0 and reads[0] > 0 and len(written) > 20
    with RedisIndex(cfg) as index:
        _agrees(filled, index)
        for k, entries in written.items():
            assert sorted(index.lookup([k])[k], key=repr) == sorted(entries, key=repr)
    _clean(redis_server_url, filled)
    raw.close()


async def test_the_asyncio_migration_is_the_same_operation(
    redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    filled = _fill(raw, namespace, seed=9, chains=14)
    seen: list[tuple[int, int]] = []
    report = await migrate_namespace_async(
        _config(redis_server_url, namespace), lambda d, t: seen.append((d, t)), pairs_per_call=2
    )
    assert report.migrated and report.pairs > 2 and seen[-1] == (report.pairs, report.pairs)
    index = AsyncRedisIndex(_config(redis_server_url, namespace))
    try:
        for q, before in filled.lookups.items():
            found = await index.lookup(list(q))
            assert _ordered(filled, found) == _ordered(filled, before)
    finally:
        await index.aclose()
    raw.close()

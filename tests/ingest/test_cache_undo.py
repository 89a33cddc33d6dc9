"""A batch applied with others is committed to its pod's cache before the call is known to
succeed; undoing it must put the cache back exactly as it was (``EngineKeyCache.save`` before
``commit``, ``restore`` after), whatever the batch forgot, learned or evicted."""

from __future__ import annotations

import random

from kvredis.ingest.chains import EngineKeyCache, ForgetLog, PageRecords, Tail


def _raw(cache: EngineKeyCache) -> tuple[dict[int, int], dict[int, Tail], dict[int, Tail]]:
    return cache._data, cache._tails.items, cache._cuts.items


def _tables(cache: EngineKeyCache) -> tuple[dict[int, int], dict[int, Tail], dict[int, Tail]]:
    data, tails, cuts = _raw(cache)
    return dict(data), dict(tails), dict(cuts)


def test_restore_undoes_a_commit_exactly() -> None:
    rng = random.Random(29)
    for _ in range(300):
        cache = EngineKeyCache(10_000, 10_000)
        known = rng.sample(range(1, 400), 120)
        cache.commit((), set(), {k: k + 1000 for k in known[:60]}, PageRecords({}, {}))
        cache.commit(
            (),
            set(),
            {},
            PageRecords(
                {k: Tail(k, "m", None, (k,)) for k in known[60:90]},
                {k: Tail(k, "m", None) for k in known[90:]},
            ),
        )
        before = _tables(cache)
        # a batch evicting known and unknown pages, making some records stale, and learning
        # mappings and records of pages known or not
        evicted = set(rng.sample(range(1, 400), rng.randrange(0, 200)))
        stale = set(rng.sample(range(1, 400), rng.randrange(0, 20)))
        batch_map = {k: k + 2000 for k in rng.sample(range(1, 400), rng.randrange(0, 30))}
        batch_tails = {k: Tail(k, "m", None, (k, k)) for k in rng.sample(range(1, 400), 20)}
        learned = {*batch_map, *batch_tails}
        saved = cache.save(learned)
        cuts = dict(list(batch_tails.items())[:10])
        ends = dict(list(batch_tails.items())[10:])
        forgotten: ForgetLog = []
        cache.commit(evicted, stale, batch_map, PageRecords(cuts, ends), forgotten)
        after = _tables(cache)
        cache.restore(saved, forgotten)
        assert _tables(cache) == before
        # the same commit without a log forgets and learns the same
        again = EngineKeyCache(10_000, 10_000)
        raw = _raw(again)
        raw[0].update(before[0])
        raw[1].update(before[1])
        raw[2].update(before[2])
        again.commit(evicted, stale, batch_map, PageRecords(cuts, ends))
        assert _tables(again) == after


def test_a_snapshot_lists_the_known_keys_and_the_unknown_ones() -> None:
    cache = EngineKeyCache(64)
    cache.commit((), set(), {5: 50}, PageRecords({6: Tail(1, "m", None, (1,))}, {}))
    saved = cache.save({5, 6, 7, 8})
    assert sorted(k for k, *_ in saved.known) == [5, 6]
    assert saved.absent == {7, 8}

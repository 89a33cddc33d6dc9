"""The merges of the operator's per-shard results (no server): statistics, checks, watermarks."""

from __future__ import annotations

from kvredis.redis.inspect import (
    CheckReport,
    Finding,
    NamespaceStats,
    Problem,
    merge_checks,
    merge_stats,
    merge_watermarks,
)


def test_stats_are_summed_with_pods_merged_and_each_shard_kept() -> None:
    one = NamespaceStats("ns:{ns/0.0}", 16, keys=5, pairs=7, pods={"a": {"gpu": 4, "": 1}})
    two = NamespaceStats(
        "ns:{ns/1.3}", 16, keys=2, pairs=3, pods={"a": {"gpu": 1}, "b": {"cpu": 2}}
    )
    merged = merge_stats("ns", [one, two])
    assert (merged.namespace, merged.bucket_bits, merged.keys, merged.pairs) == ("ns", 16, 7, 10)
    assert merged.pods == {"a": {"gpu": 5, "": 1}, "b": {"cpu": 2}}
    data = merged.as_json()
    assert [(s["shard"], s["namespace"], s["keys"]) for s in data["shards"]] == [
        (0, "ns:{ns/0.0}", 5),
        (1, "ns:{ns/1.3}", 2),
    ]
    assert "shards" not in one.as_json()  # a single server's statistics keep their shape


def test_findings_and_notes_name_their_shard() -> None:
    broken = Finding(Problem.UNKNOWN_ID, b"k", b"f", "1 undefined ids")
    note = Finding(Problem.EXPIRED_SPECULATIVE, b"s", b"f", "1 expired entries still held")
    reports = [
        CheckReport("a", 3),
        CheckReport("b", 4, findings=[broken], notes=[note]),
    ]
    merged = merge_checks("ns", reports)
    assert merged.keys_checked == 7 and not merged.ok
    assert [(f.problem, f.shard) for f in merged.findings] == [(Problem.UNKNOWN_ID, 1)]
    assert [(f.problem, f.shard) for f in merged.notes] == [(Problem.EXPIRED_SPECULATIVE, 1)]
    assert merged.findings[0].as_json()["shard"] == 1
    assert "shard" not in broken.as_json()
    assert merged.counts() == {"unknown_id": 1}
    assert merged.note_counts() == {"expired_speculative": 1}


def test_a_streams_watermark_is_its_lowest_over_the_shards() -> None:
    shards = [
        {"s": "2:10:tok", "t": "1:5"},
        {"s": "2:9:tok", "u": "junk"},
        {"s": "3:0:tok", "u": "0:1"},
    ]
    assert merge_watermarks(shards) == {"s": ("2:9:tok", 3), "t": ("1:5", 1), "u": ("junk", 2)}

"""The operator's commands against a real redis-server: click's runner and a subprocess."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from kvredis import RedisIndex, RedisIndexConfig
from kvredis.batch import AddOp, Watermark
from kvredis.cli import cli
from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.ingest.stream import stream_position
from kvredis.redis.layout import Layout
from kvredis.types import PodEntry
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[1]
TOKENS = list(range(1, 13))
A, B, C = PodEntry("pod-a", "gpu"), PodEntry("pod-b", "cpu"), PodEntry("pod-c", "gpu")


def block_keys(tokens: list[int] = TOKENS) -> list[int]:
    db = ChunkedTokenDatabase(TokenProcessorConfig(block_size_tokens=4))
    return db.tokens_to_kv_block_keys(0, tokens, "m")


@pytest.fixture
def populated(redis_server_url: str, namespace: str) -> Iterator[RedisIndex]:
    """A namespace with three pods on two tiers, engine mappings and a watermark."""
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    keys = block_keys()
    index.add([101, 102, 103], keys, [A])
    index.add(None, keys[:2], [B])
    index.apply_batch([AddOp(None, (keys[0],), (C,))], "pod-c", Watermark(3, stream_position(7)))
    try:
        yield index
    finally:
        index.drop_namespace()
        index.close()


def run(url: str, namespace: str, *args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [*args, "--redis", url, "--namespace", namespace], input=input)
    return result.exit_code, result.output


def run_json(url: str, namespace: str, *args: str) -> object:
    code, out = run(url, namespace, *args, "--json")
    assert code == 0, out
    return json.loads(out)


def test_stats_and_pods(populated: RedisIndex, redis_server_url: str, namespace: str) -> None:
    stats = run_json(redis_server_url, namespace, "stats")
    assert isinstance(stats, dict)
    assert stats["request_keys"] == 3 and stats["pairs"] == 6
    assert stats["engine_keys"] == 3 and stats["engine_mappings"] == 3
    assert stats["dictionary_entries"] == 3 and stats["watermarks"] == 1
    assert stats["pods"] == {"pod-a": {"gpu": 3}, "pod-b": {"cpu": 2}, "pod-c": {"gpu": 1}}
    assert stats["bytes_used"] > 0
    assert stats["server"]["kind"] == "redis" and stats["server"]["maxmemory_policy"]
    code, out = run(redis_server_url, namespace, "stats")
    assert code == 0 and "(key, entry) pairs" in out and "pod-b" in out
    assert run_json(redis_server_url, namespace, "pods") == stats["pods"]


def test_pods_lists_the_pods_holding_only_expiring_entries(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    populated.add(None, block_keys()[:2], [PodEntry("pod-s", speculative=True)], ttl=600)
    stats = run_json(redis_server_url, namespace, "stats")
    assert isinstance(stats, dict) and stats["expiring_entries"] == 2
    assert stats["pods"]["pod-s"] == {"": 2}
    assert run_json(redis_server_url, namespace, "pods") == stats["pods"]
    code, out = run(redis_server_url, namespace, "pods")
    assert code == 0 and "pod-s" in out and "(none)" in out
    code, out = run(redis_server_url, namespace, "stats")
    assert code == 0 and "expiring entries" in out and "pod-s" in out


def test_lookup_and_score(populated: RedisIndex, redis_server_url: str, namespace: str) -> None:
    common = ("--model", "m", "--block-size", "4")
    found = run_json(
        redis_server_url, namespace, "lookup", *common, "--tokens", "1 2 3 4 5 6 7 8 9 10 11 12"
    )
    assert found == {
        "blocks": 3,
        "keys_found": 3,
        "pods": {
            "pod-a": {"blocks": 3, "tokens": 12, "tiers": ["gpu"]},
            "pod-b": {"blocks": 2, "tokens": 8, "tiers": ["cpu"]},
            "pod-c": {"blocks": 1, "tokens": 4, "tiers": ["gpu"]},
        },
    }
    code, out = run(
        redis_server_url,
        namespace,
        "score",
        *common,
        "--tokens",
        "-",
        "--json",
        input=",".join(map(str, TOKENS)),
    )
    assert code == 0, out
    scores = json.loads(out)
    assert scores["blocks"] == 3 and next(iter(scores["scores"])) == "pod-a"
    assert scores["scores"] == populated.score(block_keys())
    weighted = run_json(
        redis_server_url,
        namespace,
        "score",
        *common,
        "--tokens",
        "1,2,3,4,5,6,7,8",
        "--weight",
        "cpu=0.5",
    )
    assert isinstance(weighted, dict)
    assert weighted["scores"] == populated.score(block_keys()[:2], {"cpu": 0.5})


def test_tokens_from_a_file(
    populated: RedisIndex, redis_server_url: str, namespace: str, tmp_path: Path
) -> None:
    path = tmp_path / "prompt.txt"
    path.write_text(json.dumps(TOKENS))
    found = run_json(
        redis_server_url,
        namespace,
        "lookup",
        "--model",
        "m",
        "--block-size",
        "4",
        "--tokens-file",
        str(path),
        "--pod",
        "pod-b",
    )
    assert isinstance(found, dict) and list(found["pods"]) == ["pod-b"]


def test_clear_asks_then_removes(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    code, out = run(redis_server_url, namespace, "clear", "--pod", "pod-a", input="n\n")
    assert code == 1 and "Aborted" in out
    assert populated.lookup(block_keys(), {"pod-a"})
    code, out = run(redis_server_url, namespace, "clear", "--pod", "pod-a", input="y\n")
    assert code == 0 and "removed 3 (key, entry) pairs of pod 'pod-a'" in out
    assert run_json(redis_server_url, namespace, "clear", "--pod", "pod-b", "--yes") == {
        "pod": "pod-b",
        "removed": 2,
    }
    assert not populated.lookup(block_keys(), {"pod-a", "pod-b"})


def test_clear_one_tier_of_one_rank(redis_server_url: str, namespace: str) -> None:
    index = RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=namespace))
    keys = block_keys()
    ranked = [PodEntry("pod-a", tier, dp_rank=r) for tier in ("gpu", "cpu") for r in (0, 1)]
    try:
        index.add([101, 102, 103], keys, ranked)
        out = run_json(redis_server_url, namespace, "clear", "--pod", "pod-a", "--tier", "gpu",
                       "--dp-rank", "1", "--yes")  # fmt: skip
        assert out == {"pod": "pod-a", "removed": 3}
        assert set(index.lookup(keys)[keys[0]]) == set(ranked) - {ranked[1]}
        code, text = run(redis_server_url, namespace, "clear", "--pod", "pod-a", "--dp-rank", "0",
                         input="y\n")  # fmt: skip
        assert code == 0 and "the entries of rank 0 of pod 'pod-a'" in text
        assert set(index.lookup(keys)[keys[0]]) == {ranked[3]}
    finally:
        index.drop_namespace()
        index.close()


def test_watermarks_decoded_and_reset(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    decoded = run_json(redis_server_url, namespace, "watermarks")
    assert list(decoded) == ["pod-c"]
    stored = decoded["pod-c"].pop("stored")
    assert decoded["pod-c"] == {"epoch": 3, "seq": 7, "phase": "done"}
    # "epoch:seq" then the token of the call that applied it
    assert stored.startswith(f"3:{stream_position(7)}:")
    code, out = run(redis_server_url, namespace, "watermarks", "--reset", "nope", "--yes")
    assert code == 2 and "no watermark for stream 'nope'" in out
    code, out = run(redis_server_url, namespace, "watermarks", "--reset", "pod-c", "--yes")
    assert code == 0 and "no watermarks stored" in out
    assert populated.get_watermark("pod-c") is None


def _plant(client: redis.Redis, layout: Layout) -> None:
    """Break one invariant of each kind."""
    rbuckets = sorted(client.scan_iter(match=layout.request_pattern()))
    ebuckets = sorted(client.scan_iter(match=layout.engine_pattern()))
    suffix = rbuckets[0][len(layout.rprefix) :]
    client.hset(rbuckets[0], b"\x01" * (8 - len(suffix)) + suffix, b"")  # empty field
    client.hset(rbuckets[0], b"\x02" * (8 - len(suffix)) + suffix, b"\x00\x00\x00\x63")  # unknown
    client.hset(rbuckets[1], b"\x44" * 8, b"\x00\x00\x00\x01")  # misplaced
    esuffix = ebuckets[0][len(layout.eprefix) :]
    client.hset(ebuckets[0], b"\x03" * (8 - len(esuffix)) + esuffix, b"\x05" * 8)  # dangling
    enc = next(iter(client.hgetall(layout.pe)))
    client.hdel(layout.pe, enc)  # pe lost an entry
    client.hset(layout.pi, b"\x00\x00\x00\x50", b"junk")  # undecodable
    client.hset(layout.pp, "pod-a", client.hget(layout.pp, "pod-a") + b"\x00\x00\x00\x51")


def test_check_finds_and_repairs_planted_corruption(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    clean = run_json(redis_server_url, namespace, "check")
    assert isinstance(clean, dict) and clean["ok"] and clean["findings"] == []
    before = populated.lookup(block_keys())
    _plant(populated.client, populated._session.state.layout)
    code, out = run(redis_server_url, namespace, "check")
    assert code == 1
    code, out = run(redis_server_url, namespace, "check", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["counts"] == {
        "empty_field": 1,
        "misplaced_field": 1,
        "missing_pe": 1,
        "pod_record_stray": 1,
        "undecodable_entry": 1,
        "unknown_id": 1,
    }
    assert report["note_counts"] == {"dangling_mapping": 1}  # legitimate: an evict leaves it
    assert not any(f["repaired"] for f in report["findings"])
    code, out = run(redis_server_url, namespace, "check", "--repair")
    assert code == 0, out
    assert "6 problems found, 6 repaired" in out
    assert "note: 1 dangling_mapping" in out
    again = run_json(redis_server_url, namespace, "check")
    assert again["findings"] == []  # type: ignore[index]
    assert again["note_counts"] == {"dangling_mapping": 1}  # type: ignore[index]  # kept
    assert populated.lookup(block_keys()) == before


@pytest.mark.parametrize("name", ["pe", "pi", "pp", "wm"])
def test_check_reports_a_dictionary_key_of_another_type(
    populated: RedisIndex, redis_server_url: str, namespace: str, name: str
) -> None:
    layout = populated._session.state.layout
    key = getattr(layout, name)
    populated.client.delete(key)
    populated.client.set(key, b"foreign")
    code, out = run(redis_server_url, namespace, "check", "--json")
    assert code == 1, out
    report = json.loads(out)
    assert report["counts"]["wrong_type"] == 1
    assert [f["key"] for f in report["findings"] if f["problem"] == "wrong_type"] == [
        bytes_key(key)
    ]
    code, out = run(redis_server_url, namespace, "check", "--repair", "--json")
    assert code == 1, out  # the foreign value is left for the operator to delete
    repaired = json.loads(out)["findings"]
    assert not any(f["repaired"] for f in repaired if f["key"] == bytes_key(key))
    assert populated.client.get(key) == b"foreign"


def bytes_key(key: bytes) -> str:
    return key.decode("utf-8", "backslashreplace")


def test_dump_restore_round_trips_exactly(
    populated: RedisIndex, redis_server_url: str, namespace: str, tmp_path: Path
) -> None:
    client = populated.client
    layout = populated._session.state.layout
    prefix = layout.meta[: -len(b"meta")]

    def snapshot(pre: bytes) -> dict[bytes, dict[bytes, bytes]]:
        keys = [k for k in client.scan_iter(match=pre + b"*")]
        return {k[len(pre) :]: client.hgetall(k) for k in keys}

    original = snapshot(prefix)
    path = tmp_path / "dump.jsonl.gz"
    code, out = run(redis_server_url, namespace, "dump", str(path))
    assert code == 0, out
    other = f"kvt-{uuid.uuid4().hex[:12]}"
    code, out = run(redis_server_url, other, "restore", str(path))
    assert code == 0, out
    try:
        assert snapshot(f"{other}:".encode()) == original
        with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=other)) as copy:
            keys = block_keys()
            assert copy.lookup(keys) == populated.lookup(keys)
            assert copy.get_watermark("pod-c") == populated.get_watermark("pod-c")
        code, out = run(redis_server_url, other, "restore", str(path))
        assert code == 1 and "--replace" in out
        populated.drop_namespace()
        dumped = CliRunner().invoke(
            cli, ["dump", "-", "--redis", redis_server_url, "--namespace", other]
        )
        assert dumped.exit_code == 0 and f"dumped {len(original)} keys" in dumped.stderr
        code, out = run(redis_server_url, namespace, "restore", "-", input=dumped.stdout)
        assert code == 0, out
        assert snapshot(prefix) == original
    finally:
        for key in client.scan_iter(match=f"{other}:*"):
            client.delete(key)


def test_truncated_dump_is_refused(
    populated: RedisIndex, redis_server_url: str, namespace: str, tmp_path: Path
) -> None:
    path = tmp_path / "dump.jsonl"
    assert run(redis_server_url, namespace, "dump", str(path))[0] == 0
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")
    code, out = run(redis_server_url, f"kvt-{uuid.uuid4().hex[:12]}", "restore", str(path))
    assert code == 2 and "truncated" in out


def test_missing_namespace_and_bad_namespace(redis_server_url: str) -> None:
    code, out = run(redis_server_url, "never-created", "stats")
    assert code == 1 and "namespace 'never-created' does not exist" in out
    client = redis.Redis.from_url(redis_server_url)
    assert not client.exists("never-created:meta")
    code, out = run(redis_server_url, "a:r:b", "pods")
    assert code == 2 and "Invalid value for '--namespace'" in out


@pytest.mark.parametrize(
    "command",
    [
        ["stats"],
        ["ingest", "--endpoint", "tcp://127.0.0.1:1", "--pod", "p", "--model", "m"],
        ["demo", "--pods", "1"],
    ],
    ids=["stats", "ingest", "demo"],
)
def test_not_redis_is_one_line_error(command: list[str]) -> None:
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"redis://127.0.0.1:{server.server_address[1]}"
        proc = subprocess.run(
            [sys.executable, "-m", "kvredis", *command, "--redis", url],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert f"127.0.0.1:{server.server_address[1]}" in lines[0]


def test_password_from_env_never_shown(redis_server_url: str) -> None:
    env = dict(
        os.environ, KVREDIS_REDIS_PASSWORD="hunter2@x", KVREDIS_REDIS_URL="redis://127.0.0.1:1"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvredis", "-v", "stats", "--log-level", "debug"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "hunter2" not in proc.stderr + proc.stdout
    assert "cannot reach redis at redis://127.0.0.1:1" in proc.stderr
    url = "redis://:s3cret@127.0.0.1:1"
    code, out = run(url, "kvblock", "pods")
    assert code == 1 and "s3cret" not in out and "***" in out


def test_subprocess_and_version(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    env = dict(os.environ, KVREDIS_REDIS_URL=redis_server_url, KVREDIS_NAMESPACE=namespace)
    proc = subprocess.run(
        [sys.executable, "-m", "kvredis", "pods", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pod-a"] == {"gpu": 3}
    from kvredis import __version__

    version = subprocess.run(
        [sys.executable, "-m", "kvredis", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert version.returncode == 0 and __version__ in version.stdout


def test_check_reports_and_repairs_expiring_entries(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    raw = redis.Redis.from_url(redis_server_url)
    keys = block_keys()
    before = populated.lookup(keys)
    spec = PodEntry("pod-s", speculative=True)
    populated.add(None, keys, [spec], ttl=600)
    layout = populated._session.state.layout
    spec_id = raw.hget(layout.pe, next(k for k in raw.hkeys(layout.pe) if b"pod-s" in k))
    assert spec_id is not None
    # Planted: a bucket the server would never delete, holding a past-due entry next to a live
    # one and an undefined id; and a gate that ends too early.
    field = (123456).to_bytes(8, "big")
    bucket = layout.expiring_bucket(123456)
    past, future = (1000).to_bytes(8, "big"), (2**42).to_bytes(8, "big")
    raw.hset(bucket, field, spec_id + past + spec_id + future)
    other = (123457 + 2**20).to_bytes(8, "big")
    other_bucket = layout.expiring_bucket(int.from_bytes(other, "big"))
    raw.hset(other_bucket, other, b"\xff\xff\xff\xf0" + future)
    raw.persist(bucket)
    raw.set(layout.sx, "1", px=600_000)
    code, out = run(redis_server_url, namespace, "check", "--json")
    assert code == 1
    report = json.loads(out)
    counts = report["counts"]
    assert "expired_speculative" not in counts  # a note: legitimate, reclaimed by --repair
    assert report["note_counts"] == {"expired_speculative": 1}
    assert counts["unknown_id"] == 1
    assert counts["no_expiry"] >= 1
    assert counts["expiry_gate"] == 1
    code, out = run(redis_server_url, namespace, "check", "--repair")
    assert code == 0, out
    assert "note: 1 expired_speculative (legitimate states, not problems, 1 reclaimed)" in out
    again = run_json(redis_server_url, namespace, "check")
    assert again["findings"] == [] and again["notes"] == []  # type: ignore[index]
    assert raw.hget(bucket, field) == spec_id + future
    assert int(raw.get(layout.sx) or 0) == 2**42
    assert populated.lookup(keys) == {k: [*before[k], spec] for k in keys}


def test_dump_restore_keeps_speculative_deadlines(
    redis_server_url: str, namespace: str, tmp_path: Path
) -> None:
    config = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    other = f"kvt-{uuid.uuid4().hex[:12]}"
    spec = PodEntry("pod-s", "", speculative=True)
    with RedisIndex(config) as index:
        keys = block_keys()
        index.add(None, keys[:2], [spec], ttl=600)
        index.add(None, keys[2:], [spec], ttl=0.2)
        layout = index._session.state.layout
        raw = index.client
        time.sleep(0.25)
        live = {
            k[len(layout.sprefix) :]: raw.hgetall(k)
            for k in raw.scan_iter(match=layout.expiring_pattern())
        }
        assert len(live) == 2
        path = tmp_path / "dump.jsonl"
        code, out = run(redis_server_url, namespace, "dump", str(path))
        assert code == 0, out
        code, out = run(redis_server_url, other, "restore", str(path))
        assert code == 0, out
        with RedisIndex(RedisIndexConfig(address=redis_server_url, namespace=other)) as copy:
            try:
                copied = copy._session.state.layout
                after = {
                    k[len(copied.sprefix) :]: raw.hgetall(k)
                    for k in raw.scan_iter(match=copied.expiring_pattern())
                }
                assert after == live
                assert raw.get(copied.sx) == raw.get(layout.sx)
                assert 0 < raw.pttl(copied.sx) <= 600_000
                for key in live:
                    pair = (copied.sprefix + key, layout.sprefix + key)
                    expiry = [raw.execute_command("PEXPIRETIME", k) for k in pair]
                    assert expiry[0] == expiry[1]
                assert copy.lookup(keys) == index.lookup(keys) == {k: [spec] for k in keys[:2]}
            finally:
                copy.drop_namespace()


@pytest.mark.parametrize("command", [["stats"], ["ingest", "--endpoint", "tcp://127.0.0.1:1"]])
def test_a_password_with_a_raw_slash_is_masked_in_usage_errors(command: list[str]) -> None:
    for url in ("redis://:S3cretPW/x@127.0.0.1:1", "redis://u:S3cretPW?x#y@127.0.0.1:1"):
        result = CliRunner().invoke(cli, [*command, "--redis", url])
        assert result.exit_code == 2, result.output
        assert "S3cretPW" not in result.output and "--redis" in result.output
        assert "percent-encode" in result.output


def test_stats_pairs_match_the_pod_table_with_expiring_entries(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    populated.add(None, block_keys(), [PodEntry("pod-s", speculative=True)], ttl=600)
    populated.add(None, block_keys()[:1], [PodEntry("pod-t", speculative=True)], ttl=600)
    stats = run_json(redis_server_url, namespace, "stats")
    assert isinstance(stats, dict)
    table_total = sum(sum(per.values()) for per in stats["pods"].values())
    assert stats["pairs"] == 6 and stats["expiring_live"] == 4
    assert stats["pairs_total"] == table_total == 10
    code, out = run(redis_server_url, namespace, "stats", "--no-memory")
    assert code == 0, out
    row = next(line for line in out.splitlines() if line.startswith("(key, entry) pairs"))
    assert row.split()[3:6] == ["10", "(6", "stored"] and "4 expiring" in row
    assert sum(int(line.split()[-1]) for line in out.split("total\n", 1)[1].splitlines()[1:]) == 10


@pytest.mark.parametrize("name", ["x.jsonl", "x.jsonl.gz"])
def test_dump_to_a_missing_directory_blames_the_file_not_the_server(
    populated: RedisIndex, redis_server_url: str, namespace: str, tmp_path: Path, name: str
) -> None:
    path = tmp_path / "no-such-dir" / name
    code, out = run(redis_server_url, namespace, "dump", str(path))
    assert code == 2, out
    assert "server" not in out and "Redis or Valkey" not in out
    assert f"cannot write {path}" in out and "does not exist" in out and "FILE" in out
    assert not path.parent.exists()


def test_dump_json_prints_a_summary(
    populated: RedisIndex, redis_server_url: str, namespace: str, tmp_path: Path
) -> None:
    path = tmp_path / "dump.jsonl.gz"
    code, out = run(redis_server_url, namespace, "dump", str(path), "--json")
    assert code == 0, out
    summary = json.loads(out)
    with gzip.open(path, "rt") as fh:
        lines = fh.read().splitlines()
    end = json.loads(lines[-1])
    assert summary["file"] == str(path) and summary["namespace"] == namespace
    assert summary["layout"] == {"format": "kvredis-dump/1", "bucket_bits": 16}
    assert summary["records"] == len(lines) and summary["keys"] == end["keys"] > 0
    assert summary["bytes"] == sum(len(line) + 1 for line in lines)
    assert summary["file_bytes"] == path.stat().st_size
    code, out = run(redis_server_url, namespace, "dump", "-", "--json")
    assert code == 2 and "--json" in out


#: Runs ``kvredis`` with a real SIGINT sent to itself at the clear's first progress report
#: (Ctrl-C's handler set first: a test run started in the background of a shell without job
#: control inherits SIGINT ignored).
_CLEAR_INTERRUPTED = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from kvredis.redis.index import RedisIndex

clear = RedisIndex.clear_entries

def interrupted(self, pod, *, progress=None, **selection):
    def report(done, removed):
        os.kill(os.getpid(), signal.SIGINT)
        if progress is not None:
            progress(done, removed)
    return clear(self, pod, progress=report, **selection)

RedisIndex.clear_entries = interrupted
from kvredis.cli import main
sys.argv[0] = "kvredis"
main()
"""


@pytest.mark.parametrize("scope", [[], ["--tier", "gpu"]], ids=["pod", "tier"])
def test_an_interrupted_clear_says_it_is_incomplete_and_check_says_what_to_do(
    redis_server_url: str, namespace: str, scope: list[str]
) -> None:
    config = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    with RedisIndex(config) as index:
        keys = list(range(1, 4001))
        ops = [  # small adds: every key inline, so the clear takes many pages
            AddOp(tuple(k + 10_000 for k in keys[i : i + 4]), tuple(keys[i : i + 4]), (A,))
            for i in range(0, len(keys), 4)
        ]
        for i in range(0, len(ops), 100):
            index.apply_batch(ops[i : i + 100])
        proc = subprocess.run(
            [sys.executable, "-c", _CLEAR_INTERRUPTED, "clear", "--pod", "pod-a", "--yes", *scope,
             "--redis", redis_server_url, "--namespace", namespace],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 130, proc.stderr
        assert "Aborted!" not in proc.stderr
        assert "the clear of pod 'pod-a' is incomplete" in proc.stderr
        assert f"kvredis clear --pod pod-a --namespace {namespace} --redis" in proc.stderr
        left = index.lookup(keys)
        assert 0 < len(left) < len(keys)  # stopped part of the way
        code, out = run(redis_server_url, namespace, "check", "--limit", "3")
        assert code == 0 and "clear_pending" in out  # a note: the API produces this state
        assert "unfinished clear" in out and "kvredis clear --pod pod-a" in out
        assert "--tier gpu" in out  # the retired entries' tiers: never a wider clear
        assert all(c.isprintable() for line in out.splitlines() for c in line), out
        code, out = run(redis_server_url, namespace, "clear", "--pod", "pod-a", "--yes")
        assert code == 0, out
        assert run_json(redis_server_url, namespace, "check")["ok"]  # type: ignore[index]
        assert index.lookup(keys) == {}


def test_check_prints_binary_bucket_names_escaped(
    populated: RedisIndex, redis_server_url: str, namespace: str
) -> None:
    layout = populated._session.state.layout
    bucket = layout.rprefix + b"\x00\x07"
    populated.client.hset(bucket, b"\x01" * 8, b"")  # an empty field in a binary-named bucket
    code, out = run(redis_server_url, namespace, "check")
    assert code == 1 and "empty_field" in out
    assert all(c.isprintable() for line in out.splitlines() for c in line), out
    assert "\\x00\\x07" in out
    assert "`kvredis check --repair` fixes what it can" in out


def test_a_missing_or_wrong_password_says_how_to_give_one(
    own_redis_server: RedisServer, tmp_path: Path
) -> None:
    port = own_redis_server.port
    redis.Redis(port=port).config_set("requirepass", "s3cret-pw")
    plain = f"redis://127.0.0.1:{port}"
    code, out = run(plain, "kvblock", "stats")
    assert code == 1, out
    line = out.strip()
    assert "requires a password and none was given" in line
    assert "KVREDIS_REDIS_PASSWORD" in line and "--password-file" in line
    assert "--redis redis://USER:PASSWORD@HOST:PORT" in line
    assert line.count(" at ") == 1 and "HELLO" not in line and "NOAUTH" not in line
    code, out = run(f"redis://:wrong-pw@127.0.0.1:{port}", "kvblock", "stats")
    assert code == 1 and "refused the user name and password" in out, out
    assert "wrong-pw" not in out and "KVREDIS_REDIS_PASSWORD" in out
    secret = tmp_path / "pw"
    secret.write_text("s3cret-pw\n")
    code, out = run(plain, "kvblock", "stats", "--password-file", str(secret))
    assert code == 1 and "does not exist" in out, out  # authenticated: no namespace there


def test_tls_against_a_plain_server_says_so_after_one_handshake(
    own_redis_server: RedisServer,
) -> None:
    client = redis.Redis(port=own_redis_server.port)

    def connections() -> int:
        return int(client.info("stats")["total_connections_received"])

    before = connections()
    code, out = run(f"rediss://127.0.0.1:{own_redis_server.port}", "kvblock", "stats")
    assert code == 1, out
    assert "the server did not answer TLS" in out and "use redis:// if it does not serve TLS" in out
    assert connections() - before == 1  # not retried: one handshake, bounded by connect_timeout


def test_a_dump_piped_into_a_reader_that_stops_says_so(
    redis_server_url: str, namespace: str
) -> None:
    config = RedisIndexConfig(address=redis_server_url, namespace=namespace)
    with RedisIndex(config) as index:
        for i in range(0, 3000, 4):
            index.add(None, list(range(i + 1, i + 5)), [A])
        dump = subprocess.Popen(
            [sys.executable, "-m", "kvredis", "dump", "-", "--no-progress",
             "--redis", redis_server_url, "--namespace", namespace],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert dump.stdout is not None
        dump.stdout.readline()  # the header, then the reader goes away
        dump.stdout.close()
        _, err = dump.communicate(timeout=60)
        assert dump.returncode == 1
        assert b"the reader stopped reading" in err and b"unexpected reply" not in err

"""Every metric the docs name is one kvredis exports: the names of the index wrapper
(``InstrumentedIndex``) and of the ingester (``IngestMetrics``), as ``kvredis ingest
--metrics-port`` serves them, against every metric-shaped name and every ``name{label=...}``
selector in README.md and docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvredis import ChunkedTokenDatabase, EventIngester, InMemoryIndex
from kvredis.ingest.config import EndpointConfig
from kvredis.ingest.metrics import IngestMetrics
from kvredis.metrics import InstrumentedIndex

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: Metric-shaped names: kvredis's own prefixes.
OWN = re.compile(r"\b(kvredis_(?:ingest|index)_[a-z0-9_]+|kvcache_[a-z0-9_]+)\b")
#: A PromQL-style selector: ``name{label=``.
SELECTOR = re.compile(r"\b([a-z_][a-z0-9_]*)\{[a-z_]+=")
#: Metrics of other exporters the docs name (Prometheus itself, redis_exporter).
FOREIGN = {"up", "redis_memory_used_bytes", "redis_memory_max_bytes"}


def _exported() -> set[str]:
    registry = CollectorRegistry()
    index = InstrumentedIndex(InMemoryIndex(), registry=registry)
    endpoint = EndpointConfig("tcp://127.0.0.1:1", pod_id="p", model_name="m")
    ingester = EventIngester(index, ChunkedTokenDatabase(), [endpoint])
    IngestMetrics(ingester, registry)
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


def _named(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    found = set(OWN.findall(text)) | set(SELECTOR.findall(text))
    return {n for n in found if n not in FOREIGN}


def test_the_docs_name_metrics() -> None:
    assert sum(len(_named(p)) for p in DOCS) > 15


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_a_doc_names_exists(path: Path) -> None:
    exported = _exported()
    missing = sorted(_named(path) - exported)
    assert missing == [], f"{path.name} names metrics kvredis does not export: {missing}"

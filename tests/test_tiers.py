"""Device tiers from (medium, locality, ownership): the default map and a configured one."""

from __future__ import annotations

import pytest

from kvredis.errors import ConfigError
from kvredis.groups import GroupCatalog
from kvredis.ingest.events import BlockStored, decode_batch, encode_batch
from kvredis.ingest.planner import BatchPlan, Planner, PodCaches
from kvredis.tiers import DEFAULT_TIERS, TierMap
from tests.ingest.harness import MODEL, POD, TP, block_tokens


@pytest.mark.parametrize(
    ("medium", "locality", "ownership", "tier"),
    [
        ("GPU", None, None, "gpu"),
        (None, None, None, "gpu"),
        ("CPU", "LOCAL", None, "cpu"),
        ("CPU_PINNED", None, None, "cpu"),
        ("cpu_pinned", None, None, "cpu"),
        ("DISK", None, None, "disk"),
        ("STORAGE", "REMOTE", None, "storage:remote"),
        ("GPU", "remote", None, "gpu:remote"),
        ("CPU", None, "kvcr", "cpu/kvcr"),
        ("NVMe", None, None, "nvme"),
    ],
)
def test_default_map(
    medium: str | None, locality: str | None, ownership: str | None, tier: str
) -> None:
    assert DEFAULT_TIERS.tier(medium, locality, ownership) == tier


def test_configured_map() -> None:
    tiers = TierMap.from_dict(
        {"mediums": {"CPU_PINNED": "pinned", "hbm": "gpu"}, "defaultTier": "hbm"}
    )
    assert tiers.tier("CPU_PINNED") == "pinned"
    assert tiers.tier("HBM") == "gpu"
    assert tiers.tier("CPU") == "cpu"  # the defaults stay unless overridden
    assert tiers.tier(None) == "hbm"
    for bad in (
        {"mediums": {"": "x"}},
        {"mediums": {"GPU": ""}},
        {"defaultTier": ""},
        {"mediums": ["GPU"]},
        {"other": 1},
    ):
        with pytest.raises(ConfigError):
            TierMap.from_dict(bad)


def test_the_planner_uses_its_tier_map() -> None:
    tiers = TierMap(mediums={"CPU_PINNED": "pinned"})
    planner = Planner(TP, GroupCatalog(), PodCaches(16), tiers=tiers)
    plan = BatchPlan(planner.caches.get(POD))
    event = BlockStored((1,), None, block_tokens(1), 16, medium="CPU_PINNED")
    steps = planner.plan(plan, decode_batch(encode_batch([event])), POD, MODEL)
    assert list(steps) == []
    (op,) = plan.take()
    assert [e.device_tier for e in op.entries] == ["pinned"]  # type: ignore[union-attr]

"""Device tiers: how an engine's storage medium, locality and ownership name an entry's tier.

Engines name where a block lives in their own words: vLLM publishes ``medium`` ``"GPU"``,
``"CPU"`` or ``"STORAGE"`` (its offloading tiers), SGLang ``"GPU"``, ``"CPU_PINNED"``, ``"DISK"``
or ``"EXTERNAL"``. vLLM 0.34 adds ``locality`` (``"LOCAL"``/``"REMOTE"``: whether the tier's
storage is on the publishing instance or reached over the network) and ``ownership`` (which
secondary tier, e.g. ``"kvcr"``, reported the block). An index entry carries one
``device_tier`` string, so :class:`TierMap` folds the three into it::

    tier = base(medium) [+ ":remote" when locality is REMOTE] [+ "/" + ownership when set]

with ``base`` from :attr:`TierMap.mediums` (the medium upper-cased; a medium not listed is
lower-cased as is; no medium at all is :attr:`TierMap.default_tier`). So a local GPU copy is
``"gpu"``, SGLang's pinned host copy ``"cpu"``, a vLLM fs tier on network storage
``"storage:remote"`` and a KVCR inventory copy ``"cpu/kvcr"``. Copies of one block that differ in
any of the three are distinct entries: a removal names exactly one of them.

:data:`kvredis.scoring.DEFAULT_MEDIUM_WEIGHTS` weighs every tier :data:`DEFAULT_TIERS` produces
for the names vLLM 0.34 and SGLang 0.5 send; configure weights for any other tier you map to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvredis.errors import ConfigError
from kvredis.jsonconfig import take_fields

__all__ = [
    "DEFAULT_MEDIUM_TIERS",
    "DEFAULT_TIERS",
    "OWNERSHIP_SEPARATOR",
    "REMOTE_SUFFIX",
    "TierMap",
]

#: Suffix of the tier of a copy whose storage is remote to the publishing pod.
REMOTE_SUFFIX = ":remote"
#: Separator before a secondary tier's ownership name.
OWNERSHIP_SEPARATOR = "/"

#: Engine medium (upper-cased) -> base tier, for the names vLLM 0.34 and SGLang 0.5.23 send.
DEFAULT_MEDIUM_TIERS: Mapping[str, str] = MappingProxyType(
    {
        "GPU": "gpu",  # vLLM and SGLang device memory
        "CPU": "cpu",  # vLLM CPU offloading
        "CPU_PINNED": "cpu",  # SGLang hierarchical cache, host pinned memory (L2)
        "DISK": "disk",  # SGLang L3 (local SSD / NVMe)
        "STORAGE": "storage",  # vLLM file-system / object-store offloading tiers
        "EXTERNAL": "external",  # SGLang L4 (shared pool such as Mooncake)
    }
)


def _frozen_mediums(mediums: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(mediums, Mapping):
        raise ConfigError(f"mediums must be a mapping of medium to tier, got {mediums!r}")
    out: dict[str, str] = {}
    for medium, tier in mediums.items():
        if not isinstance(medium, str) or not medium:
            raise ConfigError(f"mediums keys must be non-empty medium names, got {medium!r}")
        if not isinstance(tier, str) or not tier:
            raise ConfigError(f"the tier of medium {medium!r} must be a non-empty str")
        out[medium.upper()] = tier
    return MappingProxyType(out)


@dataclass(frozen=True, slots=True)
class TierMap:
    """Maps an event's ``(medium, locality, ownership)`` to an entry's device tier.

    ``mediums`` is keyed by medium name (matched case-insensitively) and replaces
    :data:`DEFAULT_MEDIUM_TIERS` (pass ``{**DEFAULT_MEDIUM_TIERS, ...}`` to extend it);
    ``default_tier`` is the tier of an event without a medium. ``from_dict`` takes
    ``{"mediums": {...}, "defaultTier": ...}``.
    """

    mediums: Mapping[str, str] = field(default_factory=lambda: DEFAULT_MEDIUM_TIERS)
    default_tier: str = "gpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "mediums", _frozen_mediums(self.mediums))
        if not isinstance(self.default_tier, str) or not self.default_tier:
            raise ConfigError(f"default_tier must be a non-empty str, got {self.default_tier!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TierMap:
        """Build from ``{"mediums": {"GPU": "gpu", ...}, "defaultTier": "gpu"}``.

        The given ``mediums`` extend (and override) :data:`DEFAULT_MEDIUM_TIERS`.
        """
        kwargs = take_fields(
            "tier map", data, {"mediums": "mediums", "defaultTier": "default_tier"}
        )
        if "mediums" in kwargs:
            kwargs["mediums"] = {**DEFAULT_MEDIUM_TIERS, **_frozen_mediums(kwargs["mediums"])}
        return cls(**kwargs)

    def tier(
        self, medium: str | None, locality: str | None = None, ownership: str | None = None
    ) -> str:
        """The device tier of a copy on ``medium`` with this ``locality`` and ``ownership``."""
        if medium:
            base = self.mediums.get(medium.upper())
            if base is None:
                base = medium.lower()
        else:
            base = self.default_tier
        if locality is not None and locality.upper() == "REMOTE":
            base += REMOTE_SUFFIX
        if ownership:
            base += OWNERSHIP_SEPARATOR + ownership
        return base


#: The mapping used when none is configured.
DEFAULT_TIERS = TierMap()

"""The GroupCatalog: what each pod reported about its KV-cache groups (hybrid allocators)."""

from __future__ import annotations

import threading

from kvredis.types import GroupMetadata


class GroupCatalog:
    """Thread-safe record of the KV-cache groups each pod has reported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, int], GroupMetadata] = {}

    def learn(self, pod_id: str, group_id: int, meta: GroupMetadata) -> None:
        """Record (or replace) the metadata of ``group_id`` on ``pod_id``."""
        with self._lock:
            self._groups[(pod_id, group_id)] = meta

    def get(self, pod_id: str, group_id: int) -> GroupMetadata | None:
        """The metadata last learned for ``group_id`` on ``pod_id``, or ``None``."""
        with self._lock:
            return self._groups.get((pod_id, group_id))

    def forget_pod(self, pod_id: str) -> None:
        """Drop everything learned about ``pod_id`` (used when the pod's cache is cleared)."""
        with self._lock:
            for key in [k for k in self._groups if k[0] == pod_id]:
                del self._groups[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

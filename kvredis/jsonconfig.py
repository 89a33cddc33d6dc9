"""The upstream JSON configuration shape: camelCase keys, also accepted in their snake_case form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvredis.errors import ConfigError


def take_fields(what: str, mapping: object, camel: Mapping[str, str]) -> dict[str, Any]:
    """Map a config mapping's keys to dataclass field names.

    ``camel`` maps each accepted upstream key to its field name; the field names themselves are
    accepted too. A ``null`` value means "not set" and is left out. Unknown keys, and a field
    given twice (once per spelling), raise :class:`ConfigError` naming them.
    """
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{what} must be a mapping, got {type(mapping).__name__}")
    accepted = {**{name: name for name in camel.values()}, **camel}
    out: dict[str, Any] = {}
    seen: set[str] = set()
    unknown = []
    for key, value in mapping.items():
        name = accepted.get(key) if isinstance(key, str) else None
        if name is None:
            unknown.append(key)
            continue
        if name in seen:
            raise ConfigError(f"{what} sets {name} twice (camelCase and snake_case)")
        seen.add(name)
        if value is not None:
            out[name] = value
    if unknown:
        raise ConfigError(
            f"unknown {what} keys: {', '.join(map(repr, unknown))}; expected {', '.join(camel)}"
        )
    return out

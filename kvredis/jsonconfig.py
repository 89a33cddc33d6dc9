"""The upstream JSON configuration shape, and the value checks every config shares.

Upstream (Go) configs use camelCase keys, also accepted here in their snake_case form
(:func:`take_fields`), human sizes (:func:`parse_size`), Go durations (:func:`parse_duration`) and
numbers that must be positive (:func:`check_number`). Every malformed value raises
:class:`~kvredis.errors.ConfigError` naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
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


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?\s*([A-Za-z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
_SIZE_UNITS.update(
    {
        prefix + suffix: (1024 if suffix.startswith("i") else 1000) ** power
        for power, prefix in enumerate(("k", "m", "g", "t", "p"), start=1)
        for suffix in ("", "b", "i", "ib")
    }
)
#: Largest budget accepted (bytes); anything bigger is certainly a typo.
MAX_SIZE = 2**63 - 1


def parse_size(value: int | str) -> int:
    """Bytes in a human size: ``"500MiB"``, ``"1GB"``, ``"1.5GiB"``, ``"100KB"``, ``2048``.

    Binary units (KiB, MiB, GiB, TiB, PiB; also Ki, Mi, ...) are powers of 1024, decimal units
    (KB, MB, GB, TB, PB; also K, M, ...) powers of 1000; case does not matter and a unit-less
    number is bytes. Fractions round down to whole bytes. Anything else, or a size that is not
    at least one byte, raises :class:`~kvredis.errors.ConfigError`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"size must be an int or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        amount = Decimal(value)
    else:
        match = _SIZE_RE.match(value)
        unit = match.group(3).lower() if match else ""
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"cannot parse size {value!r}: expected a number of bytes or a number with a "
                "unit such as 500MiB, 1GB, 2GiB"
            )
        try:
            number = Decimal(match.group(1) + (f"e{match.group(2)}" if match.group(2) else ""))
        except InvalidOperation as exc:  # pragma: no cover - the regex admits only numbers
            raise ConfigError(f"cannot parse size {value!r}") from exc
        amount = number * _SIZE_UNITS[unit]
    if amount < 1:
        raise ConfigError(f"size must be at least 1 byte, got {value!r}")
    if amount > MAX_SIZE:
        raise ConfigError(f"size must be at most 2**63 - 1 bytes, got {value!r}")
    return int(amount)


_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 MICRO SIGN
    "μs": 1e-6,  # U+03BC GREEK SMALL LETTER MU
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(value: float | str) -> float:
    """Seconds in a duration: a number of seconds, or a Go duration string.

    Go duration strings are a sequence of decimal numbers with units ``ns``, ``us`` (or ``µs``),
    ``ms``, ``s``, ``m``, ``h``, e.g. ``"30s"``, ``"1m30s"``, ``"500ms"``, ``"1.5h"``; ``"0"`` is
    zero. Negative, non-finite or malformed values raise :class:`~kvredis.errors.ConfigError`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"duration must be a number of seconds or a string, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if text == "0":
            return 0.0
        if text.startswith("+"):
            text = text[1:]
        pos, seconds = 0, 0.0
        while pos < len(text):
            match = _DURATION_PART.match(text, pos)
            if match is None:
                break
            seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if not text or pos != len(text):
            raise ConfigError(
                f"cannot parse duration {value!r}: expected seconds or a Go duration such as "
                "'30s', '1m30s', '500ms'"
            )
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"duration must be finite and not negative, got {value!r}")
    return seconds


def check_number(name: str, value: object, *, integer: bool = False, zero: bool = False) -> None:
    """Check a numeric option: an int (``integer``) or a real number, > 0 (>= 0 with ``zero``)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(f"{name} must be a{'n int' if integer else ' number'}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{name} must be {'>= 0' if zero else '> 0'}, got {value!r}")

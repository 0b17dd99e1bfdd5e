"""Sizes and durations with units, as operators write them in configs and flags.

``parse_size("16GiB") == 16 * 2**30``; decimal units (``KB``, ``MB``, ``GB``, ``TB``) are
powers of 1000, binary ones (``KiB``…``TiB``) powers of 1024, a bare number is bytes. The seed
guide's ``16GB`` therefore means 16·10⁹ bytes; write ``16GiB`` for 16·2³⁰.
"""

from __future__ import annotations

import re

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}
_DURATION_UNITS: dict[str, float] = {
    "": 1.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "m": 60.0,
    "h": 3600.0,
}
_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes from ``16GiB``, ``256 MB``, ``1.5g`` or a plain number. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"size must not be negative: {value!r}")
        return int(value)
    m = _NUMBER.match(value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"not a size: {value!r} (use a number with an optional unit: B, KiB, MiB, GiB, TiB, "
            "KB, MB, GB, TB)"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(value: str | int | float) -> float:
    """Seconds from ``500ms``, ``2s``, ``1.5`` (seconds), ``5m``. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must not be negative: {value!r}")
        return float(value)
    m = _NUMBER.match(value)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {value!r} (use a number with us, ms, s, m or h)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def format_size(n: int | float) -> str:
    """``1536`` → ``1.5 KiB``: for humans, in tables and logs."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")

"""Byte sizes as people write them ('2GiB', '512MB', '1.5G') and as tables show them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648. Bare K/M/G/T are binary (as memory is sized); KB/MB/GB decimal."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}: use e.g. 512MiB, 2GiB, 1.5G or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

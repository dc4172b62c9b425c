"""Byte sizes as people write them, and back.

    >>> parse_bytes("16GiB"), parse_bytes("512MB"), parse_bytes("1.5e9")
    (17179869184.0, 512000000.0, 1500000000.0)
    >>> format_bytes(3 * 2**20), format_bytes(100)
    ('3.00 MiB', '100 B')
    >>> parse_memory_limit(None), parse_memory_limit("1KiB"), parse_memory_limit(2048)
    (None, 1024.0, 2048.0)

Decimal units (``kb``, ``MB``, ``GB``, ``TB``) are powers of 1000, binary ones
(``KiB`` ... ``TiB``) powers of 1024; case does not matter.
"""

from __future__ import annotations

import re
from typing import Any

from shardsolve.errors import ShardsolveError

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> float:
    """``"16GiB"`` -> 17179869184.0; ``"1.5e9"`` -> 1.5e9."""
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ShardsolveError(f"cannot read memory size {text!r}; write it like '16GiB', '512MB' or '1e9'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ShardsolveError(f"memory size {text!r} must be positive")
    return value


def format_bytes(n: float) -> str:
    """``3145728`` -> ``"3.00 MiB"``: two decimals in the largest binary unit that fits, whole bytes below 1 KiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_memory_limit(limit: Any) -> float | None:
    """A memory limit as the planner takes it: ``None``, a positive number of bytes, or a size string."""
    if limit is None:
        return None
    if isinstance(limit, str):
        return parse_bytes(limit)
    if isinstance(limit, (int, float)) and limit > 0:
        return float(limit)
    raise ShardsolveError(f"memory_limit {limit!r} must be a positive number of bytes or a string like '16GiB'")

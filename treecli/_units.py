"""Sizes and counts as people write them: ``1.2 GiB``, ``7.0 B`` params, ``5GB``."""

from __future__ import annotations

import re

from treecli._errors import UsageError


def human_bytes(n: int) -> str:
    """``1.2 GiB``; exact below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError


def human_count(n: int) -> str:
    """``7.0 B`` (billions), ``139.6 K``; exact below 1000."""
    if n < 1000:
        return str(n)
    value = float(n)
    for unit in ("K", "M", "B", "T"):
        value /= 1000
        if value < 1000 or unit == "T":
            return f"{value:.1f} {unit}"
    raise AssertionError


def parse_size(text: str) -> int:
    """``5GB`` -> 5e9 bytes, ``500MiB`` -> 500 * 2**20, ``1000`` -> 1000 (as transformers reads them).

    Raises:
        UsageError: anything else.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"bad size {text!r}; write e.g. 5GB, 500MiB or a number of bytes")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return int(float(number) * base**power)

"""How much memory this machine has left, for the few steps that must hold a whole
array or checkpoint (Orbax's writer, a Fortran-order npz member, one Orbax chunk)."""

from __future__ import annotations


def available() -> int | None:
    """MemAvailable in bytes, or None where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

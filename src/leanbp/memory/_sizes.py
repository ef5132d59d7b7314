"""Memory sizes as people write them: "80GiB", "141GB", "512MiB", or a number of bytes."""

from __future__ import annotations

MiB = 2**20
GiB = 2**30

_UNITS = {"kib": 2**10, "mib": MiB, "gib": GiB, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "b": 1}


def parse_bytes(text: str) -> int:
    """"80GiB", "80GB", "512MiB", "1.5TiB", or a number of bytes."""
    t = str(text).strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            number = t[: -len(unit)].strip()
            break
    else:
        unit, number = "b", t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 80GiB, 80GB, 512MiB)") from None
    if value < 0:
        raise ValueError(f"memory size must not be negative: {text!r}")
    return int(value * _UNITS[unit])

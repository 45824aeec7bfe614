"""Memory sizes as people write them ('2GiB', '512MiB', '1.5GB', '1073741824') and as they read
them back (the agent's "does not fit" answers)."""

from __future__ import annotations

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1, "": 1}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; ValueError for anything else than a positive size."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"cannot parse memory size {text!r} (use e.g. 2GiB, 512MiB)") from None
    if not value > 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def format_size(num_bytes: int) -> str:
    """1536 MiB -> '1.50 GiB'; what an operator reads in an error."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"

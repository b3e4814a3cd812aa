"""Quantities written for people: byte counts in binary units."""

from __future__ import annotations

_LARGER_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit (1024-based, up to TiB) that keeps the number below
    1024: ``"512 B"``, ``"1.5 KiB"``, ``"3.0 GiB"``. Whole bytes have no decimals, larger units
    one."""
    value, unit = float(n), "B"
    for larger in _LARGER_UNITS:
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"

"""Quantities written for people: byte counts in binary units."""

from __future__ import annotations

import re

from zarrlake.errors import InvalidArgument

_LARGER_UNITS = ("KiB", "MiB", "GiB", "TiB")
#: Unit -> bytes, for :func:`parse_bytes` (lower case): binary ``KiB``…, decimal ``kB``…
_UNIT_BYTES = {
    "": 1,
    "b": 1,
    **{u.lower(): 1024 ** (i + 1) for i, u in enumerate(_LARGER_UNITS)},
    **{u: 1000 ** (i + 1) for i, u in enumerate(("kb", "mb", "gb", "tb"))},
}


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


def parse_bytes(text: str) -> int:
    """A byte count as people write it: ``262144``, ``256KiB``, ``1 MiB``, ``1.5GiB`` (binary
    units), ``10MB`` (decimal). Raises :class:`zarrlake.InvalidArgument` (a ``ValueError``) for
    anything else, a negative count included."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    factor = _UNIT_BYTES.get(found.group(2).lower()) if found else None
    if found is None or factor is None:
        raise InvalidArgument(f"bad size {text!r} (use e.g. 262144, 256KiB, 1MiB, 10MB)")
    count = float(found.group(1)) * factor
    if not count.is_integer():
        raise InvalidArgument(f"size {text!r} is not a whole number of bytes")
    return int(count)

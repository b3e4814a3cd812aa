"""Durations as people write them in flags and resources: ``7d``, ``12h``, ``1d12h``, ``90s``.

One parser for the CLI (``--grace``, ``--keep-journal``) and the operator (``spec.gc.grace``), so
both accept and refuse exactly the same texts.
"""

from __future__ import annotations

import datetime as dt
import re

from zarrlake.errors import InvalidArgument, InvalidDuration

_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
#: The longest duration taken (a thousand years): beyond it a ``timedelta`` soon overflows, and
#: a time plus it is past ``datetime.max``.
MAX_SECONDS = 1000 * 365 * 86400


def parse_duration(text: str) -> dt.timedelta:
    """``7d``, ``12h``, ``1d12h``, ``30m``, ``90s``, ``2w`` or plain seconds -> timedelta.

    Raises :class:`zarrlake.InvalidDuration` (a ``ValueError``) for anything else.
    """
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        seconds = float(t)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([wdhms])", t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise InvalidDuration(f"bad duration {text!r} (use e.g. 7d, 12h, 1d12h, 30m, 90s)")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds > MAX_SECONDS:
        raise InvalidDuration(f"duration {text!r} is longer than {MAX_SECONDS // 86400:,} days")
    return dt.timedelta(seconds=seconds)


def as_timedelta(value: object, name: str) -> dt.timedelta:
    """An argument ``name`` that is a duration: a ``timedelta``, or text :func:`parse_duration`
    reads (``"7d"``). Raises :class:`zarrlake.InvalidDuration` for bad text,
    :class:`zarrlake.InvalidArgument` for anything else."""
    if isinstance(value, dt.timedelta):
        return value
    if isinstance(value, str):
        return parse_duration(value)
    raise InvalidArgument(
        f"{name} must be a datetime.timedelta or a duration like '7d', not {type(value).__name__}"
    )

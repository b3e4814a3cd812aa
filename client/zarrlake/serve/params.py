"""The numbers a request carries in its query (``?limit=``, ``?n=``, a preview's ``?x=``,
``?i0=``, ``?w1=a:b``), read one way everywhere.

ASCII digits only, and at most :data:`MAX_DIGITS` of them: ``str.isdigit`` alone takes "¹" and
"²", which ``int`` then refuses, and ``int`` refuses a string of more than 4,300 digits too;
either would be a 500 instead of the 400 a mistyped number deserves.
"""

from __future__ import annotations

from collections.abc import Mapping

from zarrlake.serve.errors import BadRequest

__all__ = ["MAX_DIGITS", "query_number", "whole_number"]

#: The longest number read (larger than any size, index or count this server deals in).
MAX_DIGITS = 18


def whole_number(name: str, text: str, *, signed: bool = False) -> int:
    """``text`` (surrounding spaces dropped) as an int: ASCII digits, a leading ``-`` too when
    ``signed``. Raises :class:`BadRequest` naming parameter ``name`` for anything else."""
    digits = text.strip()
    unsigned = digits[1:] if signed and digits.startswith("-") else digits
    if not (0 < len(unsigned) <= MAX_DIGITS and unsigned.isascii() and unsigned.isdigit()):
        kind = "an integer" if signed else "a whole number"
        raise BadRequest(f"{name} must be {kind}, not {text[:40]!r}")
    return int(digits)


def query_number(params: Mapping[str, str], name: str, default: int) -> int:
    """Query parameter ``name`` of ``params`` as a whole number; ``default`` when it is absent
    or empty. Raises :class:`BadRequest` as :func:`whole_number` does."""
    text = params.get(name)
    return default if not text else whole_number(name, text)

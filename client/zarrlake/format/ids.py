"""Identifiers: time-ordered snapshot ids and content hashes."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable

import blake3

from zarrlake.errors import UnsupportedFormat

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DECODE = {c: i for i, c in enumerate(_CROCKFORD)}
SNAPSHOT_ID_LEN = 26

_last = [0, 0]  # (millis, random) of the previous id, to keep ids strictly increasing per process
_guard = threading.Lock()


def _encode(value: int, length: int) -> str:
    out = []
    for _ in range(length):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def new_snapshot_id(now_ms: int | None = None) -> str:
    """A 128-bit id, 48 bits of milliseconds then 80 random bits, Crockford base32 (26 chars).

    Ids sort by creation time; within one millisecond in one process they still increase.
    """
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    with _guard:
        if ms <= _last[0]:
            ms = _last[0]
            rand = _last[1] + 1
        else:
            rand = int.from_bytes(os.urandom(10), "big")
        _last[0], _last[1] = ms, rand
    return _encode((ms << 80) | (rand & ((1 << 80) - 1)), SNAPSHOT_ID_LEN)


def is_snapshot_id(text: str) -> bool:
    return (
        len(text) == SNAPSHOT_ID_LEN and all(c in _DECODE for c in text) and text[0] in "01234567"
    )


#: What Crockford base32 reads as what: any case, and the letters taken for digits.
_CANONICAL = str.maketrans("ilo", "110") | str.maketrans("ILO", "110")
#: The shortest snapshot id prefix a ref may be (git's too): shorter ones name too many.
MIN_ID_PREFIX = 4


def canonical_id(text: str) -> str:
    """``text`` as Crockford base32 reads it: upper case, with ``I``/``L`` as ``1`` and ``O`` as
    ``0`` (the decoder's rule, so an id copied by hand or lowered by a tool still names it)."""
    return text.translate(_CANONICAL).upper()


def is_snapshot_id_prefix(text: str) -> bool:
    """Whether ``text`` (canonical: :func:`canonical_id`) can be the start of a snapshot id,
    long enough to be a short one (:data:`MIN_ID_PREFIX` characters) and shorter than a whole."""
    return (
        MIN_ID_PREFIX <= len(text) < SNAPSHOT_ID_LEN
        and all(c in _DECODE for c in text)
        and text[0] in "01234567"
    )


def snapshot_id_millis(snapshot_id: str) -> int:
    value = 0
    for c in snapshot_id:
        value = (value << 5) | _DECODE[c]
    return value >> 80


Bytes = bytes | bytearray | memoryview
#: A content hash: bytes -> 64 lowercase hex digits (the object's name).
ContentHash = Callable[[Bytes], str]


def content_hash(data: Bytes) -> str:
    """Hex SHA-256: the name of manifest shards (and of chunks in repositories that use it)."""
    return hashlib.sha256(data).hexdigest()


def _blake3(data: Bytes) -> str:
    # 32-byte output (64 hex digits), the same shape as SHA-256's; the hashing releases the GIL.
    return blake3.blake3(data).hexdigest()


#: The hashes a repository may name its chunk and pack objects with, by their recorded name.
CONTENT_HASHES: dict[str, ContentHash] = {"blake3": _blake3, "sha256": content_hash}
#: What new repositories use: several times faster than SHA-256 on one core.
DEFAULT_CONTENT_HASH = "blake3"
#: What a repository marker without a recorded hash means (every repository made before hashes
#: were a setting).
LEGACY_CONTENT_HASH = "sha256"


#: The same hashes as raw 32-byte digests, as chunk refs hold them (what a verified read
#: compares: no hex on the hot path).
CONTENT_DIGESTS: dict[str, Callable[[Bytes], bytes]] = {
    "blake3": lambda data: blake3.blake3(data).digest(),
    "sha256": lambda data: hashlib.sha256(data).digest(),
}


def content_hasher(name: str) -> ContentHash:
    """The hash function recorded as ``name``. Raises :class:`UnsupportedFormat` for a name this
    version does not know (a repository made by a newer one)."""
    try:
        return CONTENT_HASHES[name]
    except KeyError:
        raise UnsupportedFormat(
            f"content hash {name!r} is not supported by this zarrlake "
            f"(it knows {', '.join(sorted(CONTENT_HASHES))})"
        ) from None

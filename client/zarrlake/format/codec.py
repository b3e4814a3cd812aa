"""The envelope of every metadata object: a short header, then zstd-compressed msgpack.

Header: 4-byte magic ``ZLAK``, one byte format version, one byte object type. A reader refuses a
wrong magic or a newer version with :class:`UnsupportedFormat`, and undecodable bodies with
:class:`CorruptObject`; it never crashes on bad bytes.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import msgpack
import zstandard

from zarrlake.errors import CorruptObject, UnsupportedFormat

MAGIC = b"ZLAK"
FORMAT_VERSION = 1
HEADER_LEN = 6


class ObjectType(enum.IntEnum):
    REPO = 1
    SNAPSHOT = 2
    MANIFEST = 3
    TXLOG = 4
    BRANCH_ENTRY = 5
    TAG = 6
    TAG_TOMBSTONE = 7
    EXPIRY = 8
    HISTORY_PAGE = 9


_local = threading.local()


def _zc() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_local, "zstd", None)
    if pair is None:
        pair = (zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor())
        _local.zstd = pair
    return pair


def encode(kind: ObjectType, payload: Any) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return MAGIC + bytes((FORMAT_VERSION, int(kind))) + _zc()[0].compress(body)


def decode(data: bytes, expected: ObjectType, key: str = "<object>") -> Any:
    """Parse an object written by :func:`encode`, checking its header."""
    if len(data) < HEADER_LEN:
        raise CorruptObject(key, f"truncated ({len(data)} bytes)")
    if data[:4] != MAGIC:
        raise UnsupportedFormat(f"{key} is not a zarrlake object (bad magic {data[:4]!r})")
    version, kind = data[4], data[5]
    if version > FORMAT_VERSION:
        raise UnsupportedFormat(
            f"{key} has format version {version}; this zarrlake reads up to {FORMAT_VERSION}"
        )
    if kind != int(expected):
        raise CorruptObject(key, f"expected a {expected.name.lower()} object, found type {kind}")
    try:
        body = _zc()[1].decompress(data[HEADER_LEN:], allow_extra_data=False)
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # zstd and msgpack raise many types on garbage
        raise CorruptObject(key, f"{type(e).__name__}: {e}") from None

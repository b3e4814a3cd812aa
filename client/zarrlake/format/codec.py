"""The envelope of every metadata object: a short header, then zstd-compressed msgpack.

Header: 4-byte magic ``ZLAK``, one byte format version, one byte object type. A reader refuses a
wrong magic or a newer version with :class:`UnsupportedFormat`, and undecodable bodies with
:class:`CorruptObject`; it never crashes on bad bytes.

Objects are written at the lowest version that describes them, so older readers keep reading
them. Only the repository marker has a version 2: a marker that records settings older clients
would silently ignore (see :class:`~zarrlake.format.model.RepoRecord`), which a client reading
up to version 1 must refuse instead.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import zstandard

from zarrlake.errors import CorruptObject, NotZarrlakeObject, UnsupportedFormat

MAGIC = b"ZLAK"
FORMAT_VERSION = 1  # every object's version unless it needs a newer one
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
    MIRROR_PRESENCE = 10
    MIRROR_LEASE = 11
    ROOT = 12


#: The newest version this code reads, per object type (FORMAT_VERSION for the others).
NEWEST_VERSION = {ObjectType.REPO: 2}


def newest_version(kind: ObjectType) -> int:
    return NEWEST_VERSION.get(kind, FORMAT_VERSION)


_local = threading.local()

#: zstd level 1 rather than the default 3: on this format's objects (msgpack of keys, digests and
#: records) it is 20-35% faster (a 1M-chunk snapshot 168 -> 113 us, a shard of 2,045 object refs
#: 272 -> 190 us, a history page 149 -> 120 us) at the same size within 1%; only shards of
#: small inline chunks grow, 2.8 -> 3.3 KB. Readers do not care which level wrote an object.
ZSTD_LEVEL = 1


def _zc() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    pair = getattr(_local, "zstd", None)
    if pair is None:
        pair = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
        _local.zstd = pair
    return pair


def encode(kind: ObjectType, payload: Any, version: int = FORMAT_VERSION) -> bytes:
    return encode_body(kind, msgpack.packb(payload, use_bin_type=True), version)


def encode_body(kind: ObjectType, body: bytes, version: int = FORMAT_VERSION) -> bytes:
    """:func:`encode` of a payload already packed into msgpack ``body``."""
    assert FORMAT_VERSION <= version <= newest_version(kind)
    return MAGIC + bytes((version, int(kind))) + _zc()[0].compress(body)


def encode_parts(kind: ObjectType, parts: list[bytes], version: int = FORMAT_VERSION) -> bytes:
    """:func:`encode_body` of ``b"".join(parts)``, compressed a part at a time so that the body
    is never joined (a commit of a million chunk keys: ~15 MB). Empties ``parts`` as it goes."""
    assert FORMAT_VERSION <= version <= newest_version(kind)
    # The body's size goes into the frame, as a one-shot compression puts it there: readers
    # decompress in one call, which needs it.
    compressor = _zc()[0].compressobj(size=sum(map(len, parts)))
    out = [MAGIC + bytes((version, int(kind)))]
    parts.reverse()
    while parts:
        out.append(compressor.compress(parts.pop()))
    out.append(compressor.flush())
    return b"".join(out)


def array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` elements (what ``packb`` writes before them)."""
    return _header(n, 0x90, b"\xdc", b"\xdd")


def map_header(n: int) -> bytes:
    """The msgpack header of a map of ``n`` pairs (what ``packb`` writes before them)."""
    return _header(n, 0x80, b"\xde", b"\xdf")


def _header(n: int, fixed: int, sixteen: bytes, thirty_two: bytes) -> bytes:
    if n < 16:
        return bytes((fixed | n,))
    if n < 1 << 16:
        return sixteen + n.to_bytes(2, "big")
    return thirty_two + n.to_bytes(4, "big")


def pack_elements(items: list[Any]) -> bytes:
    """The msgpack encodings of ``items``, one after the other: ``packb(items)`` without its
    array header. Runs of elements packed this way join into the packing of the whole list."""
    packed: bytes = msgpack.packb(items, use_bin_type=True)
    return packed[len(array_header(len(items))) :]


_pause = threading.Lock()
_holders = 0  # decoders inside gc_paused() while it holds the collector off


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while a decoder builds thousands of small objects
    (a history page's records, a manifest shard's refs). None of them can be cyclic garbage, yet
    every 700 allocations the collector would scan them again: with a client's heap, a page of
    1,000 records decodes in 1.7 ms instead of 2.9 (msgpack's documentation gives the same advice
    for large messages).

    Decoders in several threads share one pause: the collector comes back on when the last of
    them is done. A collector the application turned off is left off. A process forked during a
    pause gets its collector back (no thread of the child would ever end the pause)."""
    global _holders
    with _pause:
        held = _holders > 0 or gc.isenabled()
        if held:
            _holders += 1
            gc.disable()
    if not held:
        yield
        return
    try:
        yield
    finally:
        with _pause:
            _holders -= 1
            if _holders == 0:
                gc.enable()


def _end_pause_in_child() -> None:
    global _pause, _holders
    _pause = threading.Lock()  # another thread may have held it at the fork
    if _holders:
        _holders = 0
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_end_pause_in_child)


def decode(
    data: bytes, expected: ObjectType, key: str = "<object>", *, use_list: bool = True
) -> Any:
    """Parse an object written by :func:`encode`, checking its header. ``use_list=False``:
    arrays come back as tuples (msgpack builds them so, at no extra cost)."""
    body = decode_body(data, expected, key)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=use_list)
    except Exception as e:  # msgpack raises many types on garbage
        raise CorruptObject(key, f"{type(e).__name__}: {e}") from None


def decode_body(data: bytes, expected: ObjectType, key: str = "<object>") -> bytes:
    """The msgpack body of an object written by :func:`encode`, its header checked."""
    if len(data) < HEADER_LEN:
        raise CorruptObject(key, f"truncated ({len(data)} bytes)")
    if data[:4] != MAGIC:
        raise NotZarrlakeObject(key, f"not a zarrlake object (bad magic {data[:4]!r})")
    version, kind = data[4], data[5]
    newest = newest_version(expected)
    if version > newest:
        raise UnsupportedFormat(
            f"{key} has format version {version}; this zarrlake reads up to {newest}"
        )
    if kind != int(expected):
        raise CorruptObject(key, f"expected a {expected.name.lower()} object, found type {kind}")
    try:
        body: bytes = _zc()[1].decompress(data[HEADER_LEN:], allow_extra_data=False)
    except Exception as e:  # zstd raises many types on garbage
        raise CorruptObject(key, f"{type(e).__name__}: {e}") from None
    return body

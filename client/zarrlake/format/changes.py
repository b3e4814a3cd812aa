"""A session's chunk changes, kept compact: a million refs in ~60 MB instead of ~240.

:class:`ChunkChanges` is a mutable mapping of chunk key to :data:`ChunkRef` (or None: the chunk
is deleted). Recent writes sit in a plain dict; every :data:`ChunkChanges.FREEZE_AT` of them are
frozen into a *run*: numpy arrays sorted by key — the keys' UTF-8 bytes, one byte of kind, and
for the common ref (a 32-byte content-addressed object) its digest and size; rarer values (inline
bytes, packed ranges) stay Python objects on the side. Runs are merged like a binary counter, so
a session of ``n`` changes has at most ``log2(n / FREEZE_AT) + 1`` of them, and a key is looked up
in the dict, then in each run newest first (a binary search in C).

What a dict of the same changes costs, per ref: the key ``str`` (~64 bytes), the ref tuple (64),
its digest ``bytes`` (72), the dict's slot (~40). A run costs the key's bytes, 1 + 32 + 8 bytes
and a byte of liveness. A commit walks the changes in key order (:meth:`sorted_items`, a merge of
the runs that builds nothing whole) so that it need not hold them twice.

Sorting by UTF-8 bytes is sorting by code points, as Python sorts ``str``: the order of
:meth:`sorted_items` is ``sorted()``'s. Keys holding a NUL character (numpy's fixed-width bytes
would lose a trailing one) are never frozen.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import mmap
import threading
from collections.abc import (
    ItemsView,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
    ValuesView,
)
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from zarrlake.format.model import OBJECT, PACKED, VIRTUAL, ChunkRef

_NONE, _OBJECT, _OTHER, _PACKED, _VIRTUAL = 0, 1, 2, 3, 4
_DIGEST = 32
#: Where a packed chunk lies: its pack (a row of the run's table of pack ids, which are 32 bytes:
#: a hash, or the random id a session gives the packs it writes), offset and length. For packed
#: entries only, in a column of their own: 16 bytes an entry (a million chunks lie in a few
#: hundred packs).
_PLACE = np.dtype([("pack", np.uint32), ("offset", np.int64), ("length", np.uint32)])
_HEX = frozenset("0123456789abcdef")
_MISSING: Any = object()
# Keys are stored as UTF-8; a lone surrogate (legal in a Python str) round-trips, in code point
# order like every other character.
_UTF8, _SURROGATES = "utf-8", "surrogatepass"


def _packed_place(ref: ChunkRef) -> tuple[bytes, int, int] | None:
    """(pack id bytes, offset, length) of a packed ref a run can hold in columns, else None:
    a pack id of 64 lowercase hex digits, the chunk's 32-byte digest, offsets in range."""
    if not (len(ref) == 5 and ref[0] == PACKED):
        return None
    pack, offset, length, digest = ref[1], ref[2], ref[3], ref[4]
    if not (
        type(pack) is str
        and len(pack) == 64
        and _HEX.issuperset(pack)
        and type(digest) is bytes
        and len(digest) == _DIGEST
        and type(offset) is int
        and type(length) is int
        and 0 <= offset < 1 << 63
        and 0 <= length < 1 << 32
    ):
        return None
    return bytes.fromhex(pack), offset, length


#: A virtual ref's source as a run keeps it: (url, etag, last-modified µs), named in the pack
#: table by a hash of the three (so that merges, which unify the table, need not know them).
Source = tuple[str, "str | None", "int | None"]


def _virtual_place(ref: ChunkRef, ids: dict[Source, bytes]) -> tuple[bytes, int, int] | None:
    """(source id, offset, length) of a virtual ref a run can hold in columns, else None;
    ``ids`` caches the source ids (a million refs name a few thousand files)."""
    if not (len(ref) == 6 and ref[0] == VIRTUAL):
        return None
    url, offset, length, etag, modified = ref[1], ref[2], ref[3], ref[4], ref[5]
    if not (
        type(url) is str
        and (etag is None or type(etag) is str)
        and (modified is None or type(modified) is int)
        and type(offset) is int
        and type(length) is int
        and 0 <= offset < 1 << 63
        and 0 <= length < 1 << 32
    ):
        return None
    source = (url, etag, modified)
    sid = ids.get(source)
    if sid is None:
        sid = ids[source] = _source_id(source)
    return sid, offset, length


def _source_id(source: Source) -> bytes:
    """The id a run's pack table holds for a virtual source (URL, ETag, modification time)."""
    url, etag, modified = source
    h = hashlib.blake2b(digest_size=_DIGEST, person=b"zl-virtual")
    for part in (url, "" if etag is None else "e" + etag, "" if modified is None else "m"):
        h.update(part.encode(_UTF8, _SURROGATES) + b"\x00")
    h.update(b"" if modified is None else modified.to_bytes(9, "big", signed=True))
    return h.digest()


def _compact(ref: ChunkRef) -> bool:
    return (
        len(ref) == 3
        and ref[0] == OBJECT
        and type(ref[1]) is bytes
        and len(ref[1]) == _DIGEST
        and type(ref[2]) is int
        and 0 <= ref[2] < 1 << 63
    )


@dataclass(slots=True)
class _Run:
    """Changes sorted by key, each key once."""

    keys: npt.NDArray[np.bytes_]
    kinds: npt.NDArray[np.uint8]
    digests: npt.NDArray[np.uint8]  # (n, 32): an object's digest, a packed chunk's; else zeros
    # The size of an object; the index into ``others`` of _OTHER, into ``places`` of _PACKED.
    sizes: npt.NDArray[np.int64]
    others: list[ChunkRef]
    live: npt.NDArray[np.bool_]  # False: removed from the mapping (``del``), not a deletion
    # (_PLACE) where each _PACKED or _VIRTUAL entry's chunk lies: its pack or source, range.
    places: npt.NDArray[Any]
    packs: npt.NDArray[np.uint8]  # (m, 32): the pack and source ids ``places`` names, each once
    #: The source each _VIRTUAL id of ``packs`` stands for (it may hold ids no entry names).
    sources: dict[bytes, Source] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def of(cls, items: list[tuple[str, ChunkRef | None]]) -> _Run:
        items.sort(key=lambda kv: kv[0])
        n = len(items)
        kinds = np.zeros(n, np.uint8)
        digests = bytearray(n * _DIGEST)
        sizes = np.zeros(n, np.int64)
        others: list[ChunkRef] = []
        places: list[tuple[bytes, int, int]] = []
        ids: dict[Source, bytes] = {}
        for i, (_, v) in enumerate(items):
            if v is None:
                continue
            if _compact(v):
                kinds[i] = _OBJECT
                digests[i * _DIGEST : (i + 1) * _DIGEST] = v[1]
                sizes[i] = v[2]
            elif (place := _packed_place(v)) is not None:
                kinds[i] = _PACKED
                digests[i * _DIGEST : (i + 1) * _DIGEST] = v[4]
                sizes[i] = len(places)
                places.append(place)
            elif (place := _virtual_place(v, ids)) is not None:
                kinds[i] = _VIRTUAL
                sizes[i] = len(places)
                places.append(place)
            else:
                kinds[i] = _OTHER
                sizes[i] = len(others)
                others.append(v)
        keys = np.array([k.encode(_UTF8, _SURROGATES) for k, _ in items], dtype=np.bytes_)
        return cls(
            keys,
            kinds,
            np.frombuffer(digests, np.uint8).reshape(n, _DIGEST),
            sizes,
            others,
            np.ones(n, np.bool_),
            *_places(places),
            {sid: source for source, sid in ids.items()},
        )

    @classmethod
    def of_virtual(
        cls,
        keys: list[str],
        sources: list[Source],
        source_of: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
    ) -> _Run:
        """A run of virtual refs given in columns: key ``i`` is ``lengths[i]`` bytes at
        ``offsets[i]`` of ``sources[source_of[i]]``. A key given twice keeps its last ref (as
        a mapping's update would). Offsets below 2**63 and lengths below 2**32, keys without
        NUL: the caller checks."""
        encoded = np.array([k.encode(_UTF8, _SURROGATES) for k in keys], dtype=np.bytes_)
        # Stable: of a key's entries, the last given sorts last, and is the one kept.
        order = np.argsort(encoded, kind="stable")
        encoded = encoded[order]
        keep = np.ones(len(order), np.bool_)
        if len(order) > 1:
            keep[:-1] = encoded[1:] != encoded[:-1]
        order, encoded = order[keep], encoded[keep]
        n = len(order)
        used, rows = np.unique(source_of[order], return_inverse=True)
        ids = [_source_id(sources[int(i)]) for i in used]
        places = np.zeros(n, _PLACE)
        places["pack"] = rows
        places["offset"] = offsets[order]
        places["length"] = lengths[order]
        return cls(
            encoded,
            np.full(n, _VIRTUAL, np.uint8),
            np.zeros((n, _DIGEST), np.uint8),
            np.arange(n, dtype=np.int64),
            [],
            np.ones(n, np.bool_),
            places,
            np.frombuffer(b"".join(ids), np.uint8).reshape(len(ids), _DIGEST),
            {sid: sources[int(i)] for sid, i in zip(ids, used, strict=True)},
        )

    def find(self, key: bytes) -> int:
        """The index of ``key`` if this run holds it (live or not), else -1."""
        if len(key) > self.keys.dtype.itemsize:
            return -1  # (and numpy would compare it cut to the run's width)
        i = int(np.searchsorted(self.keys, key))
        if i < len(self.keys) and self.keys[i] == key:
            return i
        return -1

    def value(self, i: int) -> ChunkRef | None:
        kind = self.kinds[i]
        if kind == _OBJECT:
            return (OBJECT, self.digests[i].tobytes(), int(self.sizes[i]))
        if kind == _OTHER:
            return self.others[int(self.sizes[i])]
        if kind == _PACKED:
            place = self.places[int(self.sizes[i])]
            return (
                PACKED,
                self.packs[int(place["pack"])].tobytes().hex(),
                int(place["offset"]),
                int(place["length"]),
                self.digests[i].tobytes(),
            )
        if kind == _VIRTUAL:
            place = self.places[int(self.sizes[i])]
            url, etag, modified = self.sources[self.packs[int(place["pack"])].tobytes()]
            return (VIRTUAL, url, int(place["offset"]), int(place["length"]), etag, modified)
        return None

    def items(
        self, where: npt.NDArray[np.bool_] | None = None
    ) -> Iterator[tuple[str, ChunkRef | None]]:
        """The entries ``where`` selects (default: the live ones), in key order."""
        where = self.live if where is None else where
        block = 4096  # decoded a block at a time: nothing of the run's size is built
        # One str a pack, shared by its refs; one source tuple a file, shared by its refs.
        rows = [row.tobytes() for row in self.packs]
        packs = [row.hex() for row in rows]
        sources = [self.sources.get(row) for row in rows]
        for start in range(0, len(self.keys), block):
            live = where[start : start + block]
            keys = self.keys[start : start + block].tolist()
            values = self._values(start, start + len(keys), packs, sources)
            if live.all():
                for key, value in zip(keys, values, strict=True):
                    yield key.decode(_UTF8, _SURROGATES), value
            else:
                for j in np.flatnonzero(live).tolist():
                    yield keys[j].decode(_UTF8, _SURROGATES), values[j]

    def _values(
        self, start: int, stop: int, packs: list[str], sources: list[Source | None]
    ) -> list[ChunkRef | None]:
        """:meth:`value` of entries ``start`` .. ``stop``, the columns read once for them all
        (a numpy scalar a field costs microseconds; a million packed refs, seconds)."""
        kinds = self.kinds[start:stop]
        sizes = self.sizes[start:stop].tolist()
        digests = self.digests[start:stop].tobytes()
        places = self.places[self.sizes[start:stop][_placed(kinds)]]
        pack = iter(places["pack"].tolist())
        offset = iter(places["offset"].tolist())
        length = iter(places["length"].tolist())
        out: list[ChunkRef | None] = []
        for j, kind in enumerate(kinds.tolist()):
            if kind == _OBJECT:
                out.append((OBJECT, digests[j * _DIGEST : (j + 1) * _DIGEST], sizes[j]))
            elif kind == _PACKED:
                digest = digests[j * _DIGEST : (j + 1) * _DIGEST]
                out.append((PACKED, packs[next(pack)], next(offset), next(length), digest))
            elif kind == _VIRTUAL:
                source = sources[next(pack)]
                assert source is not None  # a virtual entry's id is a source's
                url, etag, modified = source
                out.append((VIRTUAL, url, next(offset), next(length), etag, modified))
            elif kind == _OTHER:
                out.append(self.others[sizes[j]])
            else:
                out.append(None)
        return out

    def keys_where(self, where: npt.NDArray[np.bool_]) -> Iterator[str]:
        """The keys ``where`` selects, decoded, in key order."""
        block = 4096
        for start in range(0, len(self.keys), block):
            keys = self.keys[start : start + block]
            live = where[start : start + block]
            for k in (keys if live.all() else keys[live]).tolist():
                yield k.decode(_UTF8, _SURROGATES)

    def copy(self) -> _Run:
        """Shares the arrays that never change; liveness is the copy's own."""
        return _Run(
            self.keys,
            self.kinds,
            self.digests,
            self.sizes,
            self.others,
            self.live.copy(),
            self.places,
            self.packs,
            self.sources,
        )

    def merged_under(self, newer: _Run) -> _Run:
        """This run's live entries with ``newer``'s on top (a key in both takes ``newer``'s).

        The result is allocated once (:func:`_empty`) and filled a block at a time: besides it,
        a merge holds a prefix count of each side and a block's worth of indices."""
        keep_old = self.live & ~_member(self.keys, newer.keys)
        keep_new = newer.live
        n = int(np.count_nonzero(keep_old)) + int(np.count_nonzero(keep_new))
        width = max(self.keys.dtype.itemsize, newer.keys.dtype.itemsize, 1)
        out = _Run(
            _empty((n,), np.dtype(f"S{width}")),
            _empty((n,), np.dtype(np.uint8)),
            _empty((n, _DIGEST), np.dtype(np.uint8)),
            _empty((n,), np.dtype(np.int64)),
            self.others + newer.others,
            _empty((n,), np.dtype(np.bool_)),
            *_joined_places(self, newer),
            {**self.sources, **newer.sources},
        )
        out.live[:] = True
        # No kept key is on both sides, so an entry's place in the result is its rank among its
        # side's kept entries plus the number of the other side's kept keys below it.
        out._fill(self, keep_old, newer, _prefix_counts(keep_new), (0, 0))
        shift = (len(self.others), len(self.places))
        out._fill(newer, keep_new, self, _prefix_counts(keep_old), shift)
        return out._with_used_others()

    def _fill(
        self,
        src: _Run,
        keep: npt.NDArray[np.bool_],
        other: _Run,
        other_below: npt.NDArray[np.int64],
        shift: tuple[int, int],
    ) -> None:
        """Copy ``src``'s entries that ``keep`` selects into their places in this run; the
        indices of its _OTHER and _PACKED/_VIRTUAL entries move up by ``shift`` (``others``,
        ``places``)."""
        others_at, places_at = shift
        rank = 0
        for a in range(0, len(src), _BLOCK):
            idx = np.flatnonzero(keep[a : a + _BLOCK]) + a
            if not len(idx):
                continue
            keys = src.keys[idx]
            slots = other_below[np.searchsorted(other.keys, keys)]
            slots += np.arange(rank, rank + len(idx))
            rank += len(idx)
            kinds = src.kinds[idx]
            sizes = src.sizes[idx]
            if others_at:
                sizes[kinds == _OTHER] += others_at
            if places_at:
                sizes[_placed(kinds)] += places_at
            self.keys[slots] = keys
            self.kinds[slots] = kinds
            self.digests[slots] = src.digests[idx]
            self.sizes[slots] = sizes

    def _with_used_others(self) -> _Run:
        """This run, with ``others`` and ``places`` reduced to what its entries name."""
        other = self.kinds == _OTHER
        packed = _placed(self.kinds)
        if int(other.sum()) == len(self.others) and int(packed.sum()) == len(self.places):
            return self
        sizes = self.sizes.copy()
        used = sizes[other].tolist()
        sizes[other] = np.arange(len(used))
        at = sizes[packed]
        sizes[packed] = np.arange(len(at))
        places = self.places[at]
        named, row = np.unique(places["pack"], return_inverse=True)
        places["pack"] = row.reshape(-1)
        return _Run(
            self.keys,
            self.kinds,
            self.digests,
            sizes,
            [self.others[j] for j in used],
            self.live,
            places,
            self.packs[named],
            self.sources,
        )


def _placed(kinds: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """Which entries have a place (a packed chunk's, a virtual one's)."""
    placed: npt.NDArray[np.bool_] = (kinds == _PACKED) | (kinds == _VIRTUAL)
    return placed


def _places(
    places: list[tuple[bytes, int, int]],
) -> tuple[npt.NDArray[Any], npt.NDArray[np.uint8]]:
    """The ``places`` column and pack table of ``(pack id bytes, offset, length)`` entries."""
    out = np.zeros(len(places), _PLACE)
    rows: dict[bytes, int] = {}
    if places:
        out["pack"] = [rows.setdefault(p, len(rows)) for p, _, _ in places]
        out["offset"] = [o for _, o, _ in places]
        out["length"] = [n for _, _, n in places]
    table = np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), _DIGEST)
    return out, table


def _joined_places(older: _Run, newer: _Run) -> tuple[npt.NDArray[Any], npt.NDArray[np.uint8]]:
    """The places of ``older`` then ``newer`` (as a merge indexes them) over one pack table that
    holds each id of the two once."""
    packs, row = np.unique(np.concatenate([older.packs, newer.packs]), axis=0, return_inverse=True)
    row = row.reshape(-1)
    places = np.concatenate([older.places, newer.places])
    places["pack"][: len(older.places)] = row[older.places["pack"]]
    places["pack"][len(older.places) :] = row[len(older.packs) + newer.places["pack"]]
    return places, packs


#: ``places`` as a zarrlake from before the pack table pickled it: each place held its pack's id.
_OLD_PLACE = np.dtype([("pack", np.uint8, (32,)), ("offset", np.int64), ("length", np.int64)])


def _upgraded(run: _Run) -> _Run:
    """A run as pickled by a zarrlake from before packed columns, or before the pack table."""
    if not hasattr(run, "sources"):  # from before virtual columns: none of its entries are
        run.sources = {}
    if not hasattr(run, "places"):
        run.places, run.packs = _places([])
    elif not hasattr(run, "packs"):  # each place held its pack's id
        old = run.places
        packs, row = np.unique(old["pack"].reshape(len(old), _DIGEST), axis=0, return_inverse=True)
        places = np.zeros(len(old), _PLACE)
        places["pack"] = row.reshape(-1)
        places["offset"] = old["offset"]
        places["length"] = old["length"]
        run.places, run.packs = places, packs
        for i in np.flatnonzero(run.kinds == _PACKED).tolist():
            j = int(run.sizes[i])
            if int(old["length"][j]) >= 1 << 32:  # no longer fits the column: kept whole
                pack = old["pack"][j].tobytes().hex()
                ref = (PACKED, pack, int(old["offset"][j]), int(old["length"][j]))
                run.others.append((*ref, run.digests[i].tobytes()))
                run.kinds[i], run.sizes[i] = _OTHER, len(run.others) - 1
    return run


#: Entries a merge or a walk handles at a time (its temporaries are a few hundred KB).
_BLOCK = 1 << 16
#: Arrays from this size on get an anonymous mapping of their own (where mappings can be private).
_OWN_MAPPING = 1 << 18
_PRIVATE: int | None = getattr(mmap, "MAP_PRIVATE", None)


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An uninitialized array; a large one in a memory mapping of its own, which goes back to
    the system when the array is freed. From the heap, the runs that merges free stay in the
    process: the allocator raises its threshold for mappings after the first such free, and
    keeps what later merges release (~30 MB at a million changes)."""
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < _OWN_MAPPING or _PRIVATE is None:
        return np.empty(shape, dtype)
    # Private: an anonymous mapping is shared by default, so a process forked from this one
    # would see this one's deletions (and the other way round).
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=_PRIVATE), dtype).reshape(shape)


def _prefix_counts(keep: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """``c[i]``: how many of ``keep[:i]`` are set."""
    counts = _empty((len(keep) + 1,), np.dtype(np.int64))
    counts[0] = 0
    np.cumsum(keep, out=counts[1:])
    return counts


class ChunkChanges(MutableMapping[str, "ChunkRef | None"]):
    """Chunk key -> ref (None: deleted), compact past :data:`FREEZE_AT` entries (see the
    module's docstring). Iteration order is not insertion order: use :meth:`sorted_items`, or
    sort."""

    #: Entries of the dict that are frozen into a run together.
    FREEZE_AT = 32_768

    def __init__(self, items: Mapping[str, ChunkRef | None] | None = None) -> None:
        self._recent: dict[str, ChunkRef | None] = {}
        self._runs: list[_Run] = []  # oldest first; replaced whole, never changed in place
        # Changes and reorganizations take it; lookups do not (a reader sees a frozen key in the
        # dict, or in the runs, which are published before the dict that no longer holds it).
        self._lock = threading.RLock()
        if items:
            self.update(items)

    # -- the mapping ------------------------------------------------------------------------------

    def __getitem__(self, key: str) -> ChunkRef | None:
        value = self._recent.get(key, _MISSING)
        if value is not _MISSING:
            return value  # type: ignore[no-any-return]
        if self._runs:
            b = key.encode(_UTF8, _SURROGATES)
            for run in reversed(self._runs):
                i = run.find(b)
                if i >= 0:
                    if run.live[i]:
                        return run.value(i)
                    break  # removed: removed from the runs below it too
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        value = self._recent.get(key, _MISSING)
        if value is not _MISSING or not self._runs:
            return default if value is _MISSING else value
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        if key in self._recent:
            return True
        if not self._runs or not isinstance(key, str):
            return False
        b = key.encode(_UTF8, _SURROGATES)
        for run in reversed(self._runs):
            i = run.find(b)
            if i >= 0:
                return bool(run.live[i])
        return False

    def __setitem__(self, key: str, value: ChunkRef | None) -> None:
        with self._lock:
            self._recent[key] = value
            if len(self._recent) >= self.FREEZE_AT:
                self._freeze()

    def __delitem__(self, key: str) -> None:
        with self._lock:
            found = self._recent.pop(key, _MISSING) is not _MISSING
            if self._runs:
                b = key.encode(_UTF8, _SURROGATES)
                for run in self._runs:
                    i = run.find(b)
                    if i >= 0 and run.live[i]:
                        run.live[i] = False
                        found = True
            if not found:
                raise KeyError(key)

    def __len__(self) -> int:
        with self._lock:
            if not self._runs:
                return len(self._recent)
            return self._walk().count()

    def __bool__(self) -> bool:
        return bool(self._recent) or any(run.live.any() for run in self._runs)

    def __iter__(self) -> Iterator[str]:
        # Keys alone: a listing walks them without building a ref for each.
        with self._lock:
            unfrozen = None if self._runs else list(self._recent)
        yield from self._walk().keys() if unfrozen is None else unfrozen

    def items(self) -> ItemsView[str, ChunkRef | None]:
        return _Items(self)

    def values(self) -> ValuesView[ChunkRef | None]:
        return _Values(self)

    def clear(self) -> None:
        with self._lock:
            self._recent, self._runs = {}, []

    def update(self, other: Any = (), /, **kwargs: ChunkRef | None) -> None:
        if isinstance(other, ChunkChanges):
            for key, value in other._iter_items():
                self[key] = value
        else:
            super().update(other, **kwargs)

    def absorb(self, other: ChunkChanges) -> None:
        """Take ``other``'s changes over, as ``update(other)`` would, but by moving its runs
        (a million staged refs are not frozen a second time); ``other`` is left empty."""
        if other is self:
            return
        with self._lock, other._lock:
            # The dict is newer than the runs: frozen first, so that the runs (theirs after
            # ours) stay oldest first. Keys that cannot be frozen are in no run of theirs.
            if self._recent:
                self._freeze()
            runs = [*self._runs, *other._runs]
            while len(runs) > 1 and len(runs[-2]) <= 2 * len(runs[-1]):
                newer = runs.pop()
                runs[-1] = runs[-1].merged_under(newer)
            self._runs = runs
            recent, other._recent, other._runs = other._recent, {}, []
        for key, value in recent.items():
            self[key] = value

    @classmethod
    def of_virtual(
        cls,
        keys: list[str],
        sources: list[Source],
        source_of: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
    ) -> ChunkChanges:
        """Changes that make ``keys`` virtual refs given in columns (:meth:`_Run.of_virtual`):
        built as one run at once, never as a million Python tuples."""
        out = cls()
        if keys:
            out._runs = [_Run.of_virtual(keys, sources, source_of, offsets, lengths)]
        return out

    def copy(self) -> ChunkChanges:
        out = ChunkChanges()
        with self._lock:
            out._recent = dict(self._recent)
            out._runs = [run.copy() for run in self._runs]
        return out

    def __copy__(self) -> ChunkChanges:
        # (Not __reduce__'s way: a copy must not share the runs' liveness with the original.)
        return self.copy()

    def __repr__(self) -> str:
        return f"ChunkChanges({len(self)} changes, {len(self._runs)} runs)"

    def __reduce__(self) -> tuple[Any, ...]:
        # Settled into one run first: a fork's changes travel as a few arrays, not a dict.
        with self._lock:
            self._settle()
            return (_restore, (dict(self._recent), list(self._runs)))

    def count_refs(self) -> int:
        """How many values are refs (not None: deletions)."""
        return self._walk().count(refs_only=True)

    # -- ordered walks ----------------------------------------------------------------------------
    # A walk merges the runs as it goes rather than merging them into one first: a million
    # changes are walked without a second copy of their arrays (only a byte a change, which of
    # each run's entries are the newest of their key).

    def sorted_items(self) -> Iterator[tuple[str, ChunkRef | None]]:
        """Every (key, value) in key order, as ``sorted(self.items())`` without building it."""
        return self._walk().items()

    def sorted_keys(self) -> Sequence[str]:
        """The keys in key order, as ``sorted(self)``; past a few tens of thousands, a view of the
        frozen keys rather than a list of strings."""
        walk = self._walk()
        if not walk.runs:
            return [k for k, _ in walk.recent]
        if len(walk.runs) == 1 and not walk.recent:
            run, keep = walk.runs[0]
            return _Keys(run.keys if keep.all() else run.keys[keep])
        return _WalkKeys(walk)

    def _iter_items(self) -> Iterator[tuple[str, ChunkRef | None]]:
        with self._lock:
            # Taken under the lock: a first freeze swaps the dict after publishing the run.
            unfrozen = None if self._runs else list(self._recent.items())
        yield from self._walk().items() if unfrozen is None else unfrozen

    def _walk(self) -> _Walk:
        with self._lock:
            return _Walk.of(self._runs, self._recent)

    # -- runs -------------------------------------------------------------------------------------

    def _freeze(self) -> None:
        """The dict's keys into a run; with the lock held."""
        frozen = [(k, v) for k, v in self._recent.items() if "\x00" not in k]
        if not frozen:
            return
        run = _Run.of(frozen)
        # A key frozen now shadows what older runs hold for it.
        runs = list(self._runs)
        while runs and len(runs[-1]) <= 2 * len(run):
            run = runs.pop().merged_under(run)
        self._runs = [*runs, run]  # published before the dict loses the keys
        self._recent = {k: v for k, v in self._recent.items() if "\x00" in k}

    def _settle(self) -> None:
        """Everything frozen into one run (but keys that cannot be frozen)."""
        with self._lock:
            if self._recent and any("\x00" not in k for k in self._recent):
                self._freeze()
            if len(self._runs) > 1:
                runs = list(self._runs)
                while len(runs) > 1:
                    newer = runs.pop()
                    runs[-1] = runs[-1].merged_under(newer)
                self._runs = runs


def _first(kv: tuple[str, ChunkRef | None]) -> str:
    return kv[0]


def _member(keys: npt.NDArray[np.bytes_], among: npt.NDArray[np.bytes_]) -> npt.NDArray[np.bool_]:
    """Which of the sorted ``keys`` are in the sorted ``among`` (a block at a time)."""
    found = np.zeros(len(keys), np.bool_)
    if len(keys) and len(among):
        for a in range(0, len(keys), _BLOCK):
            part = keys[a : a + _BLOCK]
            at = np.searchsorted(among, part)
            inside = at < len(among)
            found[a : a + _BLOCK][inside] = among[at[inside]] == part[inside]
    return found


@dataclass(frozen=True, slots=True)
class _Walk:
    """The changes at one moment, as the runs and, for each, which entries hold the newest value
    of their key (an entry a newer run or the dict also holds is shadowed), and the dict's items
    in key order. Every key is in exactly one place, so a walk is a plain merge."""

    runs: tuple[tuple[_Run, npt.NDArray[np.bool_]], ...]
    recent: list[tuple[str, ChunkRef | None]]

    @classmethod
    def of(cls, runs: list[_Run], recent: dict[str, ChunkRef | None]) -> _Walk:
        items = sorted(recent.items(), key=_first)
        if not runs:
            return cls((), items)
        # Keys with NUL are never frozen, so they shadow nothing.
        shadow = np.array(
            [k.encode(_UTF8, _SURROGATES) for k, _ in items if "\x00" not in k], dtype=np.bytes_
        )
        kept: list[tuple[_Run, npt.NDArray[np.bool_]]] = []
        for i, run in enumerate(runs):
            keep = run.live.copy()
            for newer in [*(r.keys for r in runs[i + 1 :]), shadow]:
                keep &= ~_member(run.keys, newer)
            kept.append((run, keep))
        return cls(tuple(kept), items)

    def count(self, *, refs_only: bool = False) -> int:
        n = 0
        for run, keep in self.runs:
            n += int(np.count_nonzero(keep & (run.kinds != _NONE) if refs_only else keep))
        return n + sum(1 for _, v in self.recent if v is not None or not refs_only)

    def items(self) -> Iterator[tuple[str, ChunkRef | None]]:
        walks = [run.items(keep) for run, keep in self.runs]
        return heapq.merge(*walks, iter(self.recent), key=_first)

    def keys(self) -> Iterator[str]:
        walks = [run.keys_where(keep) for run, keep in self.runs]
        return heapq.merge(*walks, (k for k, _ in self.recent))


class _WalkKeys(Sequence[str]):
    """The keys of a :class:`_Walk`, merged as they are read (in order; random access walks)."""

    def __init__(self, walk: _Walk) -> None:
        self._walk = walk
        self._len: int | None = None
        self._list: list[str] | None = None

    def __len__(self) -> int:
        if self._len is None:
            self._len = self._walk.count()
        return self._len

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        # Random access is not what a commit does (it iterates): the first one lists the keys.
        if self._list is None:
            self._list = list(self._walk.keys())
        return self._list[i]

    def __iter__(self) -> Iterator[str]:
        return self._walk.keys() if self._list is None else iter(self._list)


class _Keys(Sequence[str]):
    """Sorted keys, decoded as they are read."""

    def __init__(self, keys: npt.NDArray[np.bytes_]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [k.decode(_UTF8, _SURROGATES) for k in self._keys[i].tolist()]
        return bytes(self._keys[i]).decode(_UTF8, _SURROGATES)

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self._keys), 4096):
            for k in self._keys[start : start + 4096].tolist():
                yield k.decode(_UTF8, _SURROGATES)


def _restore(recent: dict[str, ChunkRef | None], runs: list[_Run]) -> ChunkChanges:
    out = ChunkChanges()
    out._recent, out._runs = recent, [_upgraded(run) for run in runs]
    return out


class _Items(ItemsView[str, "ChunkRef | None"]):
    _mapping: ChunkChanges

    def __iter__(self) -> Iterator[tuple[str, ChunkRef | None]]:
        return self._mapping._iter_items()


class _Values(ValuesView["ChunkRef | None"]):
    _mapping: ChunkChanges

    def __iter__(self) -> Iterator[ChunkRef | None]:
        for _, value in self._mapping._iter_items():
            yield value


def sorted_changes(
    changes: Mapping[str, ChunkRef | None],
) -> Iterable[tuple[str, ChunkRef | None]]:
    """``changes``' items in key order: walked, for :class:`ChunkChanges`; sorted, otherwise."""
    if isinstance(changes, ChunkChanges):
        return changes.sorted_items()
    return sorted(changes.items(), key=lambda kv: kv[0])


def sorted_keys(changes: Mapping[str, ChunkRef | None]) -> Sequence[str]:
    """``changes``' keys in key order: a view, for :class:`ChunkChanges`; sorted, otherwise."""
    if isinstance(changes, ChunkChanges):
        return changes.sorted_keys()
    return sorted(changes)


def count_refs(changes: Mapping[str, ChunkRef | None]) -> int:
    """How many of ``changes`` set a ref (are not deletions)."""
    if isinstance(changes, ChunkChanges):
        return changes.count_refs()
    return sum(v is not None for v in changes.values())

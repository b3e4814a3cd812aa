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

import heapq
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
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from zarrlake.format.model import OBJECT, ChunkRef

_NONE, _OBJECT, _OTHER = 0, 1, 2
_DIGEST = 32
_MISSING: Any = object()
# Keys are stored as UTF-8; a lone surrogate (legal in a Python str) round-trips, in code point
# order like every other character.
_UTF8, _SURROGATES = "utf-8", "surrogatepass"


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
    digests: npt.NDArray[np.uint8]  # (n, 32); zeros where the kind is not _OBJECT
    sizes: npt.NDArray[np.int64]  # the size of an object; the index into ``others`` of _OTHER
    others: list[ChunkRef]
    live: npt.NDArray[np.bool_]  # False: removed from the mapping (``del``), not a deletion

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
        for i, (_, v) in enumerate(items):
            if v is None:
                continue
            if _compact(v):
                kinds[i] = _OBJECT
                digests[i * _DIGEST : (i + 1) * _DIGEST] = v[1]
                sizes[i] = v[2]
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
        return None

    def items(self) -> Iterator[tuple[str, ChunkRef | None]]:
        block = 4096  # decoded a block at a time: nothing of the run's size is built
        for start in range(0, len(self.keys), block):
            live = self.live[start : start + block]
            keys = self.keys[start : start + block].tolist()
            if live.all():
                for j, key in enumerate(keys):
                    yield key.decode(_UTF8, _SURROGATES), self.value(start + j)
            else:
                for j in np.flatnonzero(live).tolist():
                    yield keys[j].decode(_UTF8, _SURROGATES), self.value(start + j)

    def copy(self) -> _Run:
        """Shares the arrays that never change; liveness is the copy's own."""
        return _Run(self.keys, self.kinds, self.digests, self.sizes, self.others, self.live.copy())

    def merged_under(self, newer: _Run) -> _Run:
        """This run's live entries with ``newer``'s on top (a key in both takes ``newer``'s)."""
        old = self._only(self.live)
        new = newer._only(newer.live)
        # Old entries the newer run replaces go; then the two sorted runs interleave.
        at = np.searchsorted(new.keys, old.keys)
        shadowed = np.zeros(len(old.keys), np.bool_)
        inside = at < len(new.keys)
        shadowed[inside] = new.keys[at[inside]] == old.keys[inside]
        old = old._only(~shadowed)
        n = len(old.keys) + len(new.keys)
        slot_new = np.searchsorted(old.keys, new.keys) + np.arange(len(new.keys))
        from_new = np.zeros(n, np.bool_)
        from_new[slot_new] = True
        width = max(old.keys.dtype.itemsize, new.keys.dtype.itemsize, 1)
        keys = np.empty(n, np.dtype(f"S{width}"))
        keys[from_new], keys[~from_new] = new.keys, old.keys
        kinds = np.empty(n, np.uint8)
        kinds[from_new], kinds[~from_new] = new.kinds, old.kinds
        digests = np.empty((n, _DIGEST), np.uint8)
        digests[from_new], digests[~from_new] = new.digests, old.digests
        sizes = np.empty(n, np.int64)
        new_sizes = new.sizes.copy()
        new_sizes[new.kinds == _OTHER] += len(old.others)
        sizes[from_new], sizes[~from_new] = new_sizes, old.sizes
        return _Run(
            keys, kinds, digests, sizes, old.others + new.others, np.ones(n, np.bool_)
        )._only(None)

    def _only(self, keep: npt.NDArray[np.bool_] | None) -> _Run:
        """The entries ``keep`` selects (None: all), with ``others`` reduced to theirs."""
        run = self
        if keep is not None and not keep.all():
            run = _Run(
                self.keys[keep],
                self.kinds[keep],
                self.digests[keep],
                self.sizes[keep],
                self.others,
                np.ones(int(keep.sum()), np.bool_),
            )
        other = run.kinds == _OTHER
        if int(other.sum()) == len(run.others):
            return run
        sizes = run.sizes.copy()
        used = sizes[other].tolist()
        sizes[other] = np.arange(len(used))
        return _Run(
            run.keys, run.kinds, run.digests, sizes, [run.others[j] for j in used], run.live
        )


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
        if not self._runs:
            return len(self._recent)
        self._settle()
        return int(self._runs[0].live.sum()) + len(self._recent)

    def __bool__(self) -> bool:
        return bool(self._recent) or any(run.live.any() for run in self._runs)

    def __iter__(self) -> Iterator[str]:
        for key, _ in self.items():
            yield key

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

    def copy(self) -> ChunkChanges:
        out = ChunkChanges()
        with self._lock:
            out._recent = dict(self._recent)
            out._runs = [run.copy() for run in self._runs]
        return out

    def __repr__(self) -> str:
        return f"ChunkChanges({len(self)} changes, {len(self._runs)} runs)"

    def __reduce__(self) -> tuple[Any, ...]:
        # Settled into one run first: a fork's changes travel as a few arrays, not a dict.
        with self._lock:
            self._settle()
            return (_restore, (dict(self._recent), list(self._runs)))

    def count_refs(self) -> int:
        """How many values are refs (not None: deletions)."""
        if not self._runs:
            return sum(v is not None for v in self._recent.values())
        self._settle()
        run = self._runs[0]
        frozen = int(np.count_nonzero(run.live & (run.kinds != _NONE)))
        return frozen + sum(v is not None for v in self._recent.values())

    # -- ordered walks ----------------------------------------------------------------------------

    def sorted_items(self) -> Iterator[tuple[str, ChunkRef | None]]:
        """Every (key, value) in key order, as ``sorted(self.items())`` without building it."""
        if not self._runs:
            yield from sorted(self._recent.items(), key=lambda kv: kv[0])
            return
        self._settle()
        yield from heapq.merge(
            self._runs[0].items(),
            sorted(self._recent.items(), key=lambda kv: kv[0]),
            key=lambda kv: kv[0],
        )

    def sorted_keys(self) -> Sequence[str]:
        """The keys in key order, as ``sorted(self)``; past a few tens of thousands, a view of the
        frozen keys rather than a list of strings."""
        if not self._runs:
            return sorted(self._recent)
        self._settle()
        if self._recent:
            return [k for k, _ in self.sorted_items()]
        run = self._runs[0]
        return _Keys(run.keys if run.live.all() else run.keys[run.live])

    def _iter_items(self) -> Iterator[tuple[str, ChunkRef | None]]:
        if not self._runs:
            yield from list(self._recent.items())
            return
        self._settle()
        yield from self._runs[0].items()
        yield from list(self._recent.items())

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
    out._recent, out._runs = recent, runs
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


def count_refs(changes: Mapping[str, ChunkRef | None]) -> int:
    """How many of ``changes`` set a ref (are not deletions)."""
    if isinstance(changes, ChunkChanges):
        return changes.count_refs()
    return sum(v is not None for v in changes.values())

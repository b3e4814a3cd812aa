"""A process-local backend: a dict behind a lock. Create-only is a compare-and-set.

Every write stamps its object with the next number of a per-storage counter: that is the
version :meth:`MemoryStorage.get_versioned` returns, and :meth:`MemoryStorage.put_if_version`
compares it under the same lock as every write, so swaps are atomic against plain writes and
deletes too. A number is never handed out twice by one storage, so a version never comes back
(no ABA, even when the same bytes are written again).

Not durable and not shared across processes: a pickled copy carries a snapshot of the contents
(handy for forks that run in the same process), and ``memory://`` always opens a fresh, empty store.
"""

from __future__ import annotations

import builtins
import datetime as dt
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar
from urllib.parse import SplitResult

from zarrlake.storage.base import (
    Buffer,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    Versioned,
    register_backend,
)


@register_backend("memory")
class MemoryStorage(Storage):
    durable: ClassVar[bool] = False
    shared_across_processes: ClassVar[bool] = False
    concurrency: ClassVar[int] = 4
    inline_read_bytes: ClassVar[int] = sys.maxsize  # a dict lookup and a slice
    inline_write_bytes: ClassVar[int] = sys.maxsize  # a dict assignment under a lock
    atomic_stale_delete: ClassVar[bool] = True
    supports_compare_and_set: ClassVar[bool] = True

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, dt.datetime]] = {}
        #: The number of the write that made each object: its version.
        self._versions: dict[str, int] = {}
        self._writes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> MemoryStorage:
        return cls()

    @property
    def url(self) -> str:
        return "memory://"

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        try:
            data, _ = self._objects[key]
        except KeyError:
            raise ObjectNotFound(key) from None
        if byte_range is None:
            return data
        return data[byte_range[0] : byte_range[1]]

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        now = dt.datetime.now(dt.UTC)
        with self._lock:
            if create_only and key in self._objects:
                raise PreconditionFailed(key)
            self._store(key, bytes(data), now)

    def _store(self, key: str, data: bytes, when: dt.datetime) -> int:
        """Write ``key`` under the lock (held by the caller); returns its new version."""
        self._writes += 1
        self._objects[key] = (data, when)
        self._versions[key] = self._writes
        return self._writes

    def get_versioned(self, key: str) -> Versioned:
        with self._lock:  # the bytes and the number of one write, not of two
            entry = self._objects.get(key)
            if entry is None:
                raise ObjectNotFound(key)
            return Versioned(entry[0], str(self._versions[key]))

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        copy, now = bytes(data), dt.datetime.now(dt.UTC)
        with self._lock:
            current = self._versions.get(key) if key in self._objects else None
            if (None if current is None else str(current)) != version:
                raise PreconditionFailed(key)
            return str(self._store(key, copy, now))

    def head(self, key: str) -> ObjectInfo | None:
        entry = self._objects.get(key)
        if entry is None:
            return None
        return ObjectInfo(key, len(entry[0]), entry[1])

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(prefix)]
        items.sort(key=lambda kv: kv[0])
        for key, (data, mtime) in items:
            yield ObjectInfo(key, len(data), mtime)

    def delete_stale(
        self, keys: Iterable[str], cutoff: dt.datetime
    ) -> tuple[builtins.list[ObjectInfo], builtins.list[ObjectInfo]]:
        deleted: builtins.list[ObjectInfo] = []
        kept: builtins.list[ObjectInfo] = []
        with self._lock:  # check and delete under the lock every write takes: atomic
            for key in keys:
                entry = self._objects.get(key)
                if entry is None:
                    continue
                info = ObjectInfo(key, len(entry[0]), entry[1])
                if info.modified <= cutoff:
                    del self._objects[key]
                    self._versions.pop(key, None)
                    deleted.append(info)
                else:
                    kept.append(info)
        return deleted, kept

    def delete_many(self, keys: Iterable[str]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)
                self._versions.pop(key, None)
                n += 1
        return n

    def set_modified(self, key: str, when: dt.datetime) -> None:
        """Backdate an object (tests of grace periods use this)."""
        with self._lock:
            data, _ = self._objects[key]
            self._objects[key] = (data, when)

    # A memory store is identified by its object; pickling copies the contents (useful for forks
    # that run in the same process, as Spark's local mode does for Python workers it reuses).
    # Versions travel with the copy: it goes on from the same state, and its own writes count on
    # from the same number.
    def __getstate__(self) -> dict[str, Any]:
        with self._lock:
            return {
                "_objects": dict(self._objects),
                "_versions": dict(self._versions),
                "_writes": self._writes,
            }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._objects = state["_objects"]
        self._versions = state["_versions"]
        self._writes = state["_writes"]
        self._lock = threading.Lock()

"""A storage wrapper that counts the requests zarrlake makes of its backend.

:class:`CountingStorage` wraps any :class:`zarrlake.storage.Storage` and forwards every call to it,
counting each protocol call as one request under a name (``get``, ``get_range``, ``put``,
``put_create_only``, ``head``, ``list``, ``list_dirs``, ``delete_many``, ``get_versioned``,
``put_if_version``). A ``list`` counts once
however many pages the backend fetches: these are storage operations as the engine issues them,
which on S3 are one HTTP request each except for long listings and large deletes.

The benchmarks wrap every storage they hand to zarrlake; the tests use it to pin how many requests
an operation makes, so the read and history paths cannot silently regress. Several wrappers can
share one :class:`Counts` (a process that opens a repository many times counts them all in one
place).
"""

from __future__ import annotations

import asyncio
import builtins
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import SplitResult

from zarrlake.storage.base import Buffer, ObjectInfo, Storage, StorageError, Versioned

__all__ = ["CountingStorage", "Counts", "DelayedStorage"]


class Counts:
    """Thread-safe request counters, by operation, with the keys each one touched (in order)."""

    def __init__(self, *, record_keys: bool = False) -> None:
        self._lock = threading.Lock()
        self._by_op: Counter[str] = Counter()
        self._record_keys = record_keys
        self._calls: list[tuple[str, str]] = []

    def add(self, op: str, key: str) -> None:
        with self._lock:
            self._by_op[op] += 1
            if self._record_keys:
                self._calls.append((op, key))

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._by_op.values())

    def by_op(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_op)

    def calls(self) -> list[tuple[str, str]]:
        """(operation, key or prefix) of every request since the last reset (``record_keys``)."""
        with self._lock:
            return list(self._calls)

    def reset(self) -> None:
        with self._lock:
            self._by_op.clear()
            self._calls.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class CountingStorage(Storage):
    """``inner`` with every protocol call counted in :attr:`counts` (see the module docstring).

    The capabilities (``durable``, ``concurrency``, ...) are the inner storage's; attributes the
    protocol does not define (an S3 storage's ``bucket``, say) are looked up on the inner storage.

    A subclass that changes what ``get`` or ``put`` does (to inject a fault, or to record what is
    asked) must change ``get_async`` and ``put_async`` too: the Zarr store awaits those for chunk
    objects and for chunks in packs, and they go straight to the inner storage.
    """

    def __init__(self, inner: Storage, counts: Counts | None = None) -> None:
        self.inner = inner
        self.counts = counts if counts is not None else Counts()
        for cap in (
            "durable",
            "shared_across_processes",
            "supports_conditional_writes",
            "conditional_writes_by_server",
            "supports_compare_and_set",
            "compare_and_set_by_server",
            "supports_byte_ranges",
            "supports_writes",
            "supports_listing",
            "concurrency",
            "inline_read_bytes",
            "inline_write_bytes",
        ):
            self.__dict__[cap] = getattr(inner, cap)

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> Storage:
        raise StorageError("a CountingStorage wraps a storage; it has no URL scheme of its own")

    @property
    def url(self) -> str:
        return self.inner.url

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        self.counts.add("get" if byte_range is None else "get_range", key)
        return self.inner.get(key, byte_range)

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        self.counts.add("put_create_only" if create_only else "put", key)
        self.inner.put(key, data, create_only=create_only)

    async def get_async(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        self.counts.add("get" if byte_range is None else "get_range", key)
        return await self.inner.get_async(key, byte_range)

    async def put_async(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        self.counts.add("put_create_only" if create_only else "put", key)
        await self.inner.put_async(key, data, create_only=create_only)

    def get_versioned(self, key: str) -> Versioned:
        self.counts.add("get_versioned", key)
        return self.inner.get_versioned(key)

    async def get_versioned_async(self, key: str) -> Versioned:
        self.counts.add("get_versioned", key)
        return await self.inner.get_versioned_async(key)

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        self.counts.add("put_if_version", key)
        return self.inner.put_if_version(key, data, version)

    def head(self, key: str) -> ObjectInfo | None:
        self.counts.add("head", key)
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.counts.add("list", prefix)
        return self.inner.list(prefix)

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> builtins.list[str]:
        self.counts.add("list", prefix)
        return self.inner.list_keys(prefix, limit=limit)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        self.counts.add("list_dirs", prefix)
        return self.inner.list_dirs(prefix)

    def exists(self, key: str) -> bool:
        self.counts.add("head", key)
        return self.inner.exists(key)

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = builtins.list(keys)
        self.counts.add("delete_many", keys[0] if keys else "")
        return self.inner.delete_many(keys)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally: backend-specific ones (bucket, prefix).
        if name == "inner":  # unpickling: __dict__ not filled yet
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"CountingStorage({self.inner!r})"


class DelayedStorage(CountingStorage):
    """A :class:`CountingStorage` whose every request takes ``latency`` seconds more, as over a
    network, and which records when each one ran: :meth:`rounds` then says in how many round
    trips the requests since the last :meth:`reset` were made — what a fresh client on a far
    away object store waits for, which counting requests alone does not show.

    A request's round is one more than the highest round of the requests that had ended
    before it started; with a latency well above the client's own time between requests,
    requests made together (concurrently) share a round and requests that wait for another's
    answer do not. Small reads and writes are not run in the caller's thread (they would be,
    on a local directory, which has no latency to hide)."""

    def __init__(self, inner: Storage, latency: float, counts: Counts | None = None) -> None:
        super().__init__(inner, counts)
        self.latency = latency
        self.__dict__["inline_read_bytes"] = 0
        self.__dict__["inline_write_bytes"] = 0
        self._spans_lock = threading.Lock()
        self._spans: builtins.list[tuple[float, float, str, str]] = []

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_spans_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._spans_lock = threading.Lock()

    def reset(self) -> None:
        """Forget the requests so far (their counts too)."""
        self.counts.reset()
        with self._spans_lock:
            self._spans.clear()

    def rounds(self) -> builtins.list[builtins.list[tuple[str, str]]]:
        """The requests since the last :meth:`reset`, (operation, key) by round, in order."""
        with self._spans_lock:
            spans = sorted(self._spans)
        level: builtins.list[int] = []
        for start, _, _, _ in spans:
            ended = [lv for (_, end, _, _), lv in zip(spans, level, strict=False) if end <= start]
            level.append(1 + max(ended, default=0))
        by_round: builtins.list[builtins.list[tuple[str, str]]] = [[] for _ in set(level)]
        for (_, _, op, key), lv in zip(spans, level, strict=True):
            by_round[lv - 1].append((op, key))
        return by_round

    def _timed(self, op: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        time.sleep(self.latency)
        try:
            return fn(*args, **kwargs)
        finally:
            self._span(start, op, key)

    async def _timed_async(self, op: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        await asyncio.sleep(self.latency)
        try:
            return await fn(*args, **kwargs)
        finally:
            self._span(start, op, key)

    def _span(self, start: float, op: str, key: str) -> None:
        with self._spans_lock:
            self._spans.append((start, time.monotonic(), op, key))

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        op = "get" if byte_range is None else "get_range"
        return self._timed(op, key, super().get, key, byte_range)  # type: ignore[no-any-return]

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        op = "put_create_only" if create_only else "put"
        self._timed(op, key, super().put, key, data, create_only=create_only)

    async def get_async(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        op = "get" if byte_range is None else "get_range"
        return await self._timed_async(op, key, super().get_async, key, byte_range)  # type: ignore[no-any-return]

    async def put_async(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        op = "put_create_only" if create_only else "put"
        await self._timed_async(op, key, super().put_async, key, data, create_only=create_only)

    def get_versioned(self, key: str) -> Versioned:
        return self._timed("get_versioned", key, super().get_versioned, key)  # type: ignore[no-any-return]

    async def get_versioned_async(self, key: str) -> Versioned:
        return await self._timed_async("get_versioned", key, super().get_versioned_async, key)  # type: ignore[no-any-return]

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        return self._timed("put_if_version", key, super().put_if_version, key, data, version)  # type: ignore[no-any-return]

    def head(self, key: str) -> ObjectInfo | None:
        return self._timed("head", key, super().head, key)  # type: ignore[no-any-return]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(
            self._timed(
                "list", prefix, lambda: builtins.list(super(DelayedStorage, self).list(prefix))
            )
        )

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> builtins.list[str]:
        return self._timed("list", prefix, super().list_keys, prefix, limit=limit)  # type: ignore[no-any-return]

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        return self._timed("list_dirs", prefix, super().list_dirs, prefix)  # type: ignore[no-any-return]

    def exists(self, key: str) -> bool:
        return self._timed("head", key, super().exists, key)  # type: ignore[no-any-return]

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = builtins.list(keys)
        first = keys[0] if keys else ""
        return self._timed("delete_many", first, super().delete_many, keys)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"DelayedStorage({self.inner!r}, {self.latency})"

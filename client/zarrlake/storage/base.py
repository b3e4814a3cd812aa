"""The object-store protocol every backend implements.

A backend is a flat key/value namespace of immutable-ish blobs. The engine needs only a handful of
operations, and one of them is special: ``put(..., create_only=True)`` must be atomic ("exactly one
of two racing writers wins"), because the branch journal is built on it. Nothing here knows about
the repository format.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from zarrlake.errors import ZarrlakeError

T = TypeVar("T")


class StorageError(ZarrlakeError):
    """The object store failed in a way retries did not fix."""


class ObjectNotFound(StorageError, KeyError):
    """The key does not exist."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"object not found: {self.key}"


class PreconditionFailed(StorageError):
    """A create-only write found the key already present. Never retried."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"object already exists: {self.key}"


class TransientStorageError(StorageError):
    """Throttling, a 5xx, a timeout: worth retrying with backoff."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: dt.datetime  # timezone-aware


def with_retries(fn: Callable[[], T], *, attempts: int = 6, base_delay: float = 0.05) -> T:
    """Call ``fn``, retrying transient failures with exponential backoff and full jitter.

    Precondition failures and missing objects are answers, not faults, and are never retried.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except TransientStorageError:
            if attempt == attempts - 1:
                raise
            time.sleep(random.uniform(0, base_delay * (2**attempt)))
    raise AssertionError("unreachable")


class Storage:
    """An object store holding one repository under a prefix.

    Use the constructors: :meth:`local`, :meth:`memory`, :meth:`s3`, :meth:`from_url`.
    Instances are picklable (S3 credentials only if they were given explicitly).
    """

    #: Whether the backend keeps data beyond the process (memory does not).
    durable: ClassVar[bool] = True
    #: How many requests the engine should keep in flight at once against this backend.
    concurrency: ClassVar[int] = 16

    # -- constructors -------------------------------------------------------------------------

    @staticmethod
    def local(path: str | Any) -> Storage:
        """A directory on the local file system (the embedded default)."""
        from zarrlake.storage.local import LocalStorage

        return LocalStorage(path)

    @staticmethod
    def memory() -> Storage:
        """A process-local store, for tests and scratch work."""
        from zarrlake.storage.memory import MemoryStorage

        return MemoryStorage()

    @staticmethod
    def s3(
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        allow_http: bool = False,
    ) -> Storage:
        """AWS S3 or an S3-compatible server. Credentials fall back to the AWS default chain."""
        from zarrlake.storage.s3 import S3Storage

        return S3Storage(
            bucket,
            prefix,
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            allow_http=allow_http,
        )

    @staticmethod
    def from_url(url: str) -> Storage:
        """``file:///path``, a bare path, ``memory://``, or ``s3://bucket/prefix?endpoint_url=…``."""
        from zarrlake.storage.urls import storage_from_url

        return storage_from_url(url)

    # -- the protocol -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """A URL that :meth:`from_url` turns back into an equivalent storage."""
        raise NotImplementedError

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """The object's bytes, or ``[start, end)`` of them. Raises :class:`ObjectNotFound`."""
        raise NotImplementedError

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        """Store ``data`` under ``key``.

        With ``create_only`` the write is atomic and fails with :class:`PreconditionFailed` when the
        key exists; of two racing create-only writers exactly one succeeds.
        """
        raise NotImplementedError

    def head(self, key: str) -> ObjectInfo | None:
        """Size and modification time, or ``None`` if absent."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in ascending key order."""
        raise NotImplementedError

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        """Keys starting with ``prefix`` in ascending order, at most ``limit`` of them."""
        out: list[str] = []
        if limit is not None and limit <= 0:
            return out
        for info in self.list(prefix):
            out.append(info.key)
            if limit is not None and len(out) >= limit:
                break
        return out

    def list_dirs(self, prefix: str) -> list[str]:
        """The distinct next path segments below ``prefix`` (which should end with '/')."""
        seen: dict[str, None] = {}
        for info in self.list(prefix):
            rest = info.key[len(prefix) :]
            head, sep, _ = rest.partition("/")
            if sep:
                seen.setdefault(head, None)
        return list(seen)

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete the keys (absent keys are fine). Returns how many were requested."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    # -- concurrency ----------------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        pool = getattr(self, "_pool", None)
        if pool is None:
            pool = ThreadPoolExecutor(
                max_workers=self.concurrency, thread_name_prefix="zarrlake-io"
            )
            self._pool = pool
        return pool

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """Apply an I/O function to many items concurrently, preserving order."""
        items = list(items)
        if len(items) <= 1:
            return [fn(x) for x in items]
        return list(self._executor().map(fn, items))

    async def run_async(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking storage call on this backend's I/O pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor(), fn, *args)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_pool", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

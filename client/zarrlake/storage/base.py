"""The object-store protocol every backend implements, and the one factory that picks a backend.

A backend is a flat key/value namespace of immutable-ish blobs. The engine needs only a handful of
operations, and one of them is special: ``put(..., create_only=True)`` must be atomic ("exactly one
of two racing writers wins"), because the branch journal is built on it. Nothing here knows about
the repository format, and nothing here knows about any particular backend:

- **Capabilities** are class attributes (as zarr-python 3's stores declare ``supports_writes``):
  code above ``storage`` asks ``storage.shared_across_processes`` rather than checking a backend's
  class. See :class:`Storage` for the list.
- **Backends register themselves.** Each backend module decorates its class with
  :func:`register_backend` and the URL schemes it serves; ``zarrlake.storage`` imports every
  backend module, so importing anything from the package makes all of them available. The
  factory :func:`from_url` and the keyword constructors (:meth:`Storage.local`,
  :meth:`Storage.memory`, :meth:`Storage.s3`) look the class up by scheme, so this module imports
  no backend and the import graph of the package has no cycle. A backend's ``__init__`` has the
  signature of the keyword constructor that names its scheme; URLs reach it through
  :meth:`Storage.from_parsed_url`.

The storage errors live in :mod:`zarrlake.errors` with the rest of the hierarchy and are
re-exported here.

The listing contract
--------------------
Listings promise only what S3-compatible servers keep. AWS sorts a whole listing by key, but
SeaweedFS, for one, walks a bucket folder by folder (``a/1`` before ``a-b/c``, though ``-``
sorts before ``/``) and keeps listing a folder after its last object is deleted. So the engine
needs exactly this, and every backend is tested for exactly this (``tests/test_storage.py``):

1. **Complete, by plain prefix.** :meth:`Storage.list` yields each object whose key starts with
   ``prefix`` (any string, not only a folder ending in ``/``) exactly once, with its size and
   modification time. An object written or deleted while the listing runs may or may not appear.
2. **No order** across folders, and none among keys of different lengths. Callers that need an
   order sort what they listed.
3. **Order inside one folder of fixed-width names**: the keys directly inside one folder (no
   ``/`` after the folder's own) whose names have the same length are listed in ascending order,
   so ``list_keys(folder, limit=n)`` of a folder holding only such keys returns its ``n``
   smallest. The branch journal relies on this, and only it: its entries are 16 hex digits,
   numbered so that the newest is the smallest, and one request of ``limit=1`` finds a branch's
   head however long its journal is.
4. **Folders**: :meth:`Storage.list_dirs` names every folder below ``prefix`` that holds an
   object, each once, in no order; it may also name a folder whose objects are all gone (listing
   that folder then yields nothing). Callers treat a folder as a hint to look, never as proof
   that something is in it.

A server that breaks (1) or (3) cannot hold a repository. A listing page may hold fewer keys
than were asked for (S3 returns "some or all" of them): backends follow continuation until
they have what was asked. The other property the engine cannot do without is atomic
create-only writes; see :attr:`Storage.supports_conditional_writes` and
:meth:`Storage.check_conditional_writes`.

Compare-and-set
---------------
One kind of object is replaced in place rather than written once: a repository's published
``root``. It is read with :meth:`Storage.get_versioned`, which returns its bytes and an opaque
*version* (S3's and Azure's ETag, GCS's generation, a token on a local file system or in
memory), and replaced with :meth:`Storage.put_if_version`, which writes only if the object is
still at that version: of two writers swapping from one version, exactly one succeeds. Where
the backend has it (:attr:`Storage.supports_compare_and_set`) but a server must keep it (any
S3-compatible server; :attr:`Storage.compare_and_set_by_server`), the engine asks
:meth:`Storage.check_compare_and_set` before it relies on it, and keeps the journal-only
protocol where the answer is no.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import datetime as dt
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar
from urllib.parse import SplitResult, parse_qs, urlsplit

from zarrlake.errors import (
    ConditionalWritesUnsupported,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    TransientStorageError,
)

#: What a put accepts: bytes, or a buffer over them (Zarr hands chunks over as memoryviews;
#: copying each to bytes first would cost a copy per chunk write).
Buffer = bytes | bytearray | memoryview

__all__ = [
    "Buffer",
    "ConditionalWritesUnsupported",
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "Storage",
    "StorageError",
    "TransientStorageError",
    "UrlOptions",
    "Versioned",
    "backend_for_scheme",
    "from_url",
    "on_io_pool",
    "register_backend",
    "with_retries",
]

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Set in the threads of the I/O pools (see :meth:`Storage.map`).
_POOL_THREAD = threading.local()


def on_io_pool() -> bool:
    """Whether this thread is one of a storage's I/O pool threads (which must never wait on a
    pool: every thread of it could be waiting)."""
    return bool(getattr(_POOL_THREAD, "marked", False))


def _mark_pool_thread() -> None:
    _POOL_THREAD.marked = True


S = TypeVar("S", bound="Storage")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: dt.datetime  # timezone-aware
    #: The object's ETag where the backend has one and its answer carried it (S3's HEAD).
    etag: str | None = None


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def micros(when: dt.datetime) -> int:
    """Microseconds since the epoch of an aware time, exactly (no float in between)."""
    return (when - _EPOCH) // dt.timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class Versioned:
    """An object's bytes and the version they are (see :meth:`Storage.get_versioned`).

    ``version`` is opaque and means something only to the storage that returned it, for the
    key it was read from: S3's and Azure's ETag, GCS's generation, a token on a local file
    system or in memory. Compare versions for equality, never order.
    """

    data: bytes
    version: str


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


async def with_retries_async(
    fn: Callable[[], Awaitable[T]], *, attempts: int = 6, base_delay: float = 0.05
) -> T:
    """:func:`with_retries` for a coroutine: the same attempts and backoff, slept on the loop."""
    for attempt in range(attempts):
        try:
            return await fn()
        except TransientStorageError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(random.uniform(0, base_delay * (2**attempt)))
    raise AssertionError("unreachable")


def _probe_bytes() -> bytes:
    """What :meth:`Storage.check_compare_and_set` writes: new bytes each time, so that every
    write of the check makes a new version on any backend (S3's ETag of a plain PUT is the MD5
    of its bytes)."""
    return b"compare-and-set check " + os.urandom(16).hex().encode()


# -- the backend registry -----------------------------------------------------------------------

_BACKENDS: dict[str, type[Storage]] = {}


def register_backend(*schemes: str) -> Callable[[type[S]], type[S]]:
    """Class decorator: serve the URL ``schemes`` (e.g. ``"s3"``; case-insensitive) with this class.

    A scheme already taken by another class is an error: two backends must not silently compete.
    (The same class defined again, as when its module is reloaded, replaces itself.)
    """

    def register(cls: type[S]) -> type[S]:
        name = (cls.__module__, cls.__qualname__)
        for scheme in map(str.lower, schemes):
            taken = _BACKENDS.get(scheme)
            if taken is not None and (taken.__module__, taken.__qualname__) != name:
                raise ValueError(f"storage scheme {scheme!r} is already served by {taken!r}")
            _BACKENDS[scheme] = cls
        return cls

    return register


def backend_for_scheme(scheme: str) -> type[Storage]:
    """The backend class registered for ``scheme``. Raises :class:`StorageError` if none is."""
    backend = _BACKENDS.get(scheme.lower())
    if backend is None:
        known = ", ".join(sorted(_BACKENDS))
        raise StorageError(f"unsupported storage URL scheme {scheme!r} (known: {known})")
    return backend


def from_url(url: str) -> Storage:
    """The storage a URL names: ``file:///path`` or a bare path, ``memory://``,
    ``s3://bucket/prefix?endpoint_url=…&region=…&allow_http=true`` (``s3a://`` too),
    ``gs://bucket/prefix``, ``az://container/prefix?account_name=…`` (``abfs[s]://`` and
    ``azure://`` too), or ``http(s)://host/path`` for a read-only published copy.

    A relative bare path is resolved against the current directory now (``.`` names it; an
    empty or blank URL is an error, so that an unset variable never names it). Raises
    :class:`StorageError` for a scheme no backend serves, or a URL its backend rejects.
    """
    if not url.strip():
        raise StorageError("empty storage URL (to mean the current directory, say '.')")
    if "://" not in url:
        return Storage.local(url)
    parsed = urlsplit(url)
    backend = _BACKENDS.get(parsed.scheme.lower())
    if backend is None:
        raise StorageError(f"unsupported storage URL scheme {parsed.scheme!r} in {url!r}")
    return backend.from_parsed_url(parsed)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}


class UrlOptions:
    """The query options of a storage URL, for a backend's :meth:`Storage.from_parsed_url`: only
    the names the backend knows (a misspelt option, e.g. ``alow_http``, is an error, not a
    silently ignored setting), and booleans that say yes or no."""

    def __init__(self, url: SplitResult, *names: str) -> None:
        self._url = url.geturl()
        self._values = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        unknown = sorted(set(self._values) - set(names))
        if unknown:
            raise StorageError(
                f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
                f"{self._url!r} (known: {', '.join(sorted(names))})"
            )

    def get(self, *names: str) -> str | None:
        """The value of the first of ``names`` (aliases) that is given and not empty."""
        return next((self._values[n] for n in names if self._values.get(n)), None)

    def flag(self, name: str) -> bool:
        value = self._values.get(name, "").lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise StorageError(f"option {name}={value!r} in {self._url!r} is not true or false")


# -- the protocol ---------------------------------------------------------------------------------


class Storage(abc.ABC):
    """An object store holding one repository under a prefix.

    Use the constructors: :meth:`local`, :meth:`memory`, :meth:`s3`, :meth:`gcs`, :meth:`azure`,
    :meth:`http`, :meth:`from_url`.
    Instances are picklable (S3 credentials only if they were given explicitly).

    What a backend can do is declared by class attributes, never discovered by trial: see
    :attr:`durable`, :attr:`shared_across_processes`, :attr:`supports_conditional_writes`,
    :attr:`supports_compare_and_set`, :attr:`supports_byte_ranges`, :attr:`supports_writes`,
    :attr:`supports_listing`, :attr:`concurrency`, :attr:`inline_read_bytes` and
    :attr:`inline_write_bytes`. The one exception is a promise a backend makes on a server's
    behalf (S3's conditional writes, compare-and-set on S3, GCS and Azure):
    :meth:`check_conditional_writes` and :meth:`check_compare_and_set` verify it before the
    first write that relies on it.

    Listings keep the listing contract of the module docstring, no more: the engine never
    assumes an order across folders, nor that a folder :meth:`list_dirs` names holds objects.
    """

    #: The objects outlive the process that wrote them (false for memory).
    durable: ClassVar[bool] = True
    #: A pickled copy, in this process or another (a Spark executor, a Dask worker), reads and
    #: writes the same objects as the original. False for memory, whose copy is a snapshot of its
    #: contents: such a storage cannot be written from other processes, and two copies must not
    #: share state keyed by the storage's identity.
    shared_across_processes: ClassVar[bool] = True
    #: ``put(..., create_only=True)`` is atomic: of two racing writers exactly one succeeds. The
    #: branch journal relies on it, so every backend that holds repositories must offer it.
    supports_conditional_writes: ClassVar[bool] = True
    #: The atomicity of create-only writes is a server's, not this backend's own (any
    #: S3-compatible server; some ignore ``If-None-Match``): :meth:`check_conditional_writes`
    #: verifies it. False where the backend itself makes them atomic (a directory, memory).
    conditional_writes_by_server: ClassVar[bool] = False
    #: :meth:`put_if_version` replaces an object atomically if it is still at the version the
    #: caller read (:meth:`get_versioned`): of two writers swapping from one version exactly one
    #: succeeds. The published ``root`` relies on it; a backend without it (plain HTTP) keeps
    #: the journal-only protocol.
    supports_compare_and_set: ClassVar[bool] = False
    #: Whether compare-and-set is a server's promise rather than this backend's own (an
    #: S3-compatible server may ignore ``If-Match``): :meth:`check_compare_and_set` asks it.
    #: False where the backend itself makes the swap atomic (a directory, memory).
    compare_and_set_by_server: ClassVar[bool] = False
    #: ``get(key, byte_range)`` fetches only the range (packed chunks are read this way).
    supports_byte_ranges: ClassVar[bool] = True
    #: ``put`` and ``delete_many`` work. False for plain HTTP, where they raise
    #: :class:`~zarrlake.errors.ReadOnlyStorage`; the engine then opens repositories read-only.
    supports_writes: ClassVar[bool] = True
    #: ``list``, ``list_keys`` and ``list_dirs`` work. False for plain HTTP (they raise
    #: :class:`~zarrlake.errors.ListingUnsupported`): the engine finds a branch head by probing
    #: its journal's keys instead (see :mod:`zarrlake.refs`).
    supports_listing: ClassVar[bool] = True
    #: How many requests the engine should keep in flight at once against this backend.
    concurrency: ClassVar[int] = 16
    #: Reads of at most this many bytes cost less made right on the calling thread (the event
    #: loop of Zarr's async machinery) than the hand-off to the I/O pool: a file in the page
    #: cache, a dict in memory. 0 where every read waits on a network (S3).
    inline_read_bytes: ClassVar[int] = 0
    #: A round of writes of at most this many bytes in all costs less made one after another on
    #: the calling thread than the hand-offs to the I/O pool and back (a file written to the page
    #: cache without fsync, a dict in memory). 0 where every write waits on a network or a disk.
    inline_write_bytes: ClassVar[int] = 0
    #: :meth:`delete_stale` decides and deletes in one atomic step, so an object rewritten
    #: concurrently is never lost. Where false (S3 has no delete conditional on a modification
    #: time), a rewrite landing between its check and its delete goes unseen: garbage collection
    #: closes that window with a lock service instead.
    atomic_stale_delete: ClassVar[bool] = False

    # -- constructors -----------------------------------------------------------------------------
    # Each looks its backend up in the registry (see the module docstring) and calls the class
    # with the same arguments.

    @staticmethod
    def local(path: str | os.PathLike[str]) -> Storage:
        """A directory on the local file system (the embedded default)."""
        make: Callable[..., Storage] = backend_for_scheme("file")
        return make(path)

    @staticmethod
    def memory() -> Storage:
        """A process-local store, for tests and scratch work."""
        make: Callable[..., Storage] = backend_for_scheme("memory")
        return make()

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
        anonymous: bool = False,
        addressing_style: str | None = None,
    ) -> Storage:
        """AWS S3 or an S3-compatible server. Credentials fall back to the AWS default chain.

        ``anonymous=True``: unsigned requests and no credentials, for public buckets.
        ``addressing_style``: ``"path"`` (``endpoint/bucket/key``) or ``"virtual"``
        (``bucket.endpoint/key``); None picks virtual hosts on AWS, path style elsewhere.
        """
        make: Callable[..., Storage] = backend_for_scheme("s3")
        return make(
            bucket,
            prefix,
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            allow_http=allow_http,
            anonymous=anonymous,
            addressing_style=addressing_style,
        )

    @staticmethod
    def azure(
        container: str,
        prefix: str = "",
        *,
        account_name: str | None = None,
        account_key: str | None = None,
        sas_token: str | None = None,
        endpoint_url: str | None = None,
        anonymous: bool = False,
        allow_http: bool = False,
    ) -> Storage:
        """Azure Blob Storage: ``container`` of storage account ``account_name`` (else
        ``AZURE_STORAGE_ACCOUNT_NAME``). Credentials: ``account_key`` or ``sas_token`` if
        given, else Azure's chain (the ``AZURE_*`` variables: account key, SAS, service
        principal, workload identity; then managed identity). ``endpoint_url`` for Azurite or
        another cloud; ``anonymous=True`` for public containers. Needs ``zarrlake[azure]``."""
        make: Callable[..., Storage] = backend_for_scheme("az")
        return make(
            container,
            prefix,
            account_name=account_name,
            account_key=account_key,
            sas_token=sas_token,
            endpoint_url=endpoint_url,
            anonymous=anonymous,
            allow_http=allow_http,
        )

    @staticmethod
    def gcs(
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        token: str | None = None,
        service_account_file: str | None = None,
        anonymous: bool = False,
        allow_http: bool = False,
        service_account_info: Mapping[str, Any] | None = None,
    ) -> Storage:
        """Google Cloud Storage. Credentials: an OAuth ``token``, a ``service_account_file``
        or its parsed contents ``service_account_info`` if given, else Application Default
        Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud, the metadata server).
        ``endpoint_url`` (or ``STORAGE_EMULATOR_HOST``) for an emulator; ``anonymous=True`` for
        public buckets. Needs ``zarrlake[gcs]``."""
        make: Callable[..., Storage] = backend_for_scheme("gs")
        return make(
            bucket,
            prefix,
            endpoint_url=endpoint_url,
            token=token,
            service_account_file=service_account_file,
            anonymous=anonymous,
            allow_http=allow_http,
            service_account_info=service_account_info,
        )

    @staticmethod
    def http(
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> Storage:
        """Read-only: a repository published on a static web server or CDN (``http://`` or
        ``https://``; a plain copy of a repository's objects under ``url``).

        Reads, byte ranges and existence checks work; writes raise
        :class:`~zarrlake.errors.ReadOnlyStorage` and listings
        :class:`~zarrlake.errors.ListingUnsupported` (HTTP has no listing): branches and tags
        are opened by name, and ``list_branches``/``list_tags`` are not available. ``headers``
        go with every request (e.g. ``{"Authorization": "Bearer ..."}``)."""
        make: Callable[..., Storage] = backend_for_scheme("https")
        return make(url, headers=headers, timeout=timeout)

    @staticmethod
    def from_url(url: str) -> Storage:
        """``file:///path``, a bare path, ``memory://``, ``s3://bucket/prefix?endpoint_url=…``,
        ``gs://bucket/prefix``, ``az://container/prefix?account_name=…`` (``abfs://`` too) or
        ``https://host/path`` (read-only).

        The same as :func:`zarrlake.storage.from_url`.
        """
        return from_url(url)

    @classmethod
    @abc.abstractmethod
    def from_parsed_url(cls, url: SplitResult) -> Storage:
        """The storage for a URL of one of this backend's schemes (called by :func:`from_url`).

        Raises :class:`StorageError` when the URL is incomplete or malformed.
        """

    # -- the protocol -----------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """A URL that :meth:`from_url` turns back into an equivalent storage."""

    @abc.abstractmethod
    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """The object's bytes, or ``[start, end)`` of them. Raises :class:`ObjectNotFound`."""

    @abc.abstractmethod
    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        """Store ``data`` under ``key``.

        With ``create_only`` the write is atomic and fails with :class:`PreconditionFailed` when the
        key exists; of two racing create-only writers exactly one succeeds.
        """

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size and modification time, or ``None`` if absent."""

    def get_if_unchanged(
        self,
        key: str,
        byte_range: tuple[int, int],
        *,
        etag: str | None = None,
        modified: dt.datetime | None = None,
    ) -> bytes:
        """Bytes ``[start, end)`` of ``key`` if the object is still the version with ``etag``
        and modification time ``modified`` (each checked when given), else raise
        :class:`PreconditionFailed`; :class:`ObjectNotFound` if it is absent. For files that
        zarrlake did not write (virtual chunk sources): a rewritten source must fail the read,
        never return another version's bytes.

        This default asks :meth:`head`, then reads: a rewrite between the two goes unseen.
        Backends that can condition the read itself (S3's ``If-Match``, a file's descriptor)
        override it."""
        info = self.head(key)
        if info is None:
            raise ObjectNotFound(key)
        if etag is not None and info.etag != etag:
            raise PreconditionFailed(key)
        if modified is not None and micros(info.modified) != micros(modified):
            raise PreconditionFailed(key)
        return self.get(key, byte_range)

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, each once; ordered only as the listing
        contract (module docstring) promises: within one folder, among names of one length."""

    @abc.abstractmethod
    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete the keys (absent keys are fine). Returns how many were requested."""

    def delete_stale(
        self, keys: Iterable[str], cutoff: dt.datetime
    ) -> tuple[builtins.list[ObjectInfo], builtins.list[ObjectInfo]]:
        """Delete each key whose object was last written at or before ``cutoff``; keep the rest.

        Returns (deleted, kept) as the objects were found; absent keys are in neither. Garbage
        collection's sweep: a session that deduplicated against an old object rewrites it, and
        a rewritten object must survive. This default checks, then deletes (see
        :attr:`atomic_stale_delete`); backends that can do both at once override it.
        """
        keys = builtins.list(keys)
        found = self.map(self.head, keys)
        deleted = [f for f in found if f is not None and f.modified <= cutoff]
        kept = [f for f in found if f is not None and f.modified > cutoff]
        self.delete_many(f.key for f in deleted)
        return deleted, kept

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> builtins.list[str]:
        """The keys of :meth:`list`, in its order: all of them, or the first ``limit``."""
        out: builtins.list[str] = []
        if limit is not None and limit <= 0:
            return out
        for info in self.list(prefix):
            out.append(info.key)
            if limit is not None and len(out) >= limit:
                break
        return out

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """The folders directly below ``prefix`` (``""`` or ending with '/'), each once, in no
        order: every one that holds an object, and perhaps some whose objects are all gone (see
        the listing contract in the module docstring). This default names only the former."""
        seen: dict[str, None] = {}
        for info in self.list(prefix):
            rest = info.key[len(prefix) :]
            head, sep, _ = rest.partition("/")
            if sep:
                seen.setdefault(head, None)
        return builtins.list(seen)

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def trust_conditional_writes(self) -> None:
        """Skip :meth:`check_conditional_writes` from now on: for a client whose create-only
        writes that matter are made by someone else (a commit service writes its refs), and
        whose credentials may not write the probe."""
        self.__dict__["_conditional_writes_kept"] = True

    def check_conditional_writes(self, key: str) -> None:
        """Make sure create-only writes are kept, before the first write that relies on them.

        Where :attr:`conditional_writes_by_server`, the server is asked, once per storage
        object (a pickled copy keeps the answer): a create-only write of ``key`` (an empty
        object the caller reserves for this check, left in place) must succeed if ``key`` is
        absent and be refused if it is present. Two requests: a refused write and a
        :meth:`head` that finds the object, or a write that creates it and a second one,
        refused. Elsewhere this does nothing: the backend makes them atomic itself.

        Raises :class:`ConditionalWritesUnsupported` when the server wrote over the object, or
        refused to create it; other :class:`StorageError` as the requests do.
        """
        if not self.conditional_writes_by_server or self.__dict__.get("_conditional_writes_kept"):
            return
        try:
            self.put(key, b"", create_only=True)
        except PreconditionFailed:
            if self.head(key) is None:
                raise ConditionalWritesUnsupported(
                    self.url, key, f"a create-only write of absent {key} was refused"
                ) from None
        else:
            try:
                self.put(key, b"", create_only=True)
            except PreconditionFailed:
                pass
            else:
                raise ConditionalWritesUnsupported(
                    self.url, key, f"a second create-only write of {key} succeeded"
                )
        self.__dict__["_conditional_writes_kept"] = True

    # -- compare-and-set --------------------------------------------------------------------------

    def get_versioned(self, key: str) -> Versioned:
        """The object's bytes and their version, read together (one state of the object, never
        the bytes of one write with the version of another).

        Raises :class:`ObjectNotFound`; :class:`StorageError` where the backend has no
        compare-and-set (:attr:`supports_compare_and_set` false), as this default does.
        """
        raise self._no_compare_and_set(key)

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        """Replace ``key`` with ``data`` only if it is still at ``version`` (as
        :meth:`get_versioned` or a previous swap returned it); with ``version=None``, only if it
        does not exist (create-only). Atomic: of two writers swapping from one version, exactly
        one succeeds. Returns the new version, the one :meth:`get_versioned` then reads.

        Raises :class:`PreconditionFailed` when the object is at another version (or absent),
        or, for ``None``, exists. That answer is never retried here, and it is not always
        another writer's doing: when a request is retried after its response was lost (a
        timeout, a dropped connection), the retry may find the version this very write made.
        A caller that must know re-reads the object (:meth:`get_versioned`) and compares its
        bytes with what it wrote; one whose swap raised a :class:`TransientStorageError` does
        the same, since the write may have landed. Raises :class:`StorageError` where the
        backend has no compare-and-set, as this default does.

        Only swaps are ordered against swaps: a plain :meth:`put` or a delete of the same key
        is not guaranteed to be (on S3, GCS and Azure it is; locally and in memory see the
        backend). Objects replaced by compare-and-set should be written by it alone.
        """
        raise self._no_compare_and_set(key)

    async def get_versioned_async(self, key: str) -> Versioned:
        """:meth:`get_versioned` for a caller on an event loop (on the I/O pool)."""
        return await self.run_async(self.get_versioned, key)

    def _no_compare_and_set(self, key: str) -> StorageError:
        return StorageError(f"{self.url} offers no compare-and-set (asked for {key})")

    def check_compare_and_set(self, key: str) -> bool:
        """Whether :meth:`put_if_version` is kept, asked before the first write that relies on
        it; ``key`` is an object the caller reserves for this check (left in place, holding a
        few random bytes).

        False without a request where the backend has no compare-and-set; True without one
        where the backend makes the swap atomic itself (a directory, memory). Where it is a
        server's promise (:attr:`compare_and_set_by_server`), the server is asked once per
        storage object (a pickled copy keeps the answer): a swap from the version just read
        must succeed, a swap from the version it replaced must be refused, and the object must
        then hold the first swap's bytes at the version that swap returned. Four requests (five
        the first time, which creates ``key``). A server that fails any of them, such as one
        that ignores ``If-Match``, gets False and one WARNING in the log: the repository keeps
        the journal-only protocol there.

        Never raises for a server that lacks the feature. Raises :class:`StorageError` as the
        requests do (not cached: the next call asks again), and
        :class:`TransientStorageError` if other clients kept creating or deleting ``key``
        under every attempt. Clients checking at the same moment do not make each other fail
        (see :meth:`_probe_compare_and_set`).
        """
        if not self.supports_compare_and_set:
            return False
        if not self.compare_and_set_by_server:
            return True
        known = self.__dict__.get("_compare_and_set_kept")
        if known is not None:
            return bool(known)
        found = self._probe_compare_and_set(key)
        if found is not None:
            log.warning(
                "%s does not keep compare-and-set writes (%s): the repository keeps the "
                "journal-only protocol",
                self.url,
                found,
            )
        self.__dict__["_compare_and_set_kept"] = found is None
        return found is None

    def _probe_compare_and_set(self, key: str, attempts: int = 4) -> str | None:
        """What the server did wrong in :meth:`check_compare_and_set`'s requests, or None if it
        did everything right.

        Other clients may be asking at the same moment (each worker of a job, at its first
        write), and a write of theirs between two of these requests starts the attempt over.
        When every attempt is disturbed so, the answer is what the attempts saw: a server that
        refused swaps from versions that had gone stale (every disturbed attempt sees one) keeps
        what safety needs. A returned version it never got to read back costs at worst a
        refused swap, which a caller answers by reading again.
        """
        stale_refused = False
        for _ in range(attempts):
            try:
                before = self.get_versioned(key).version
            except ObjectNotFound:
                try:
                    before = self.put_if_version(key, _probe_bytes(), None)
                except PreconditionFailed:
                    continue  # another client created it first: read it
            mine = _probe_bytes()
            try:
                after = self.put_if_version(key, mine, before)
            except PreconditionFailed:
                try:
                    now = self.get_versioned(key).version
                except ObjectNotFound:
                    continue  # deleted meanwhile: start over
                if now == before:  # nobody else wrote it: the server refused its own version
                    return f"a write of {key} at its current version was refused"
                stale_refused = True  # another client's write came first, and won
                continue
            if after == before:
                return f"a write of new bytes to {key} left its version {before!r} unchanged"
            try:
                self.put_if_version(key, _probe_bytes(), before)
            except PreconditionFailed:
                stale_refused = True
            else:
                return f"a write of {key} at a version it no longer had succeeded"
            try:
                got = self.get_versioned(key)
            except ObjectNotFound:
                continue  # deleted meanwhile: start over
            if got.data != mine:
                continue  # another client wrote it since: its bytes, not the refused write's
            if got.version != after:
                return f"a write of {key} returned version {after!r}, but it reads {got.version!r}"
            return None
        if stale_refused:
            return None
        raise TransientStorageError(
            f"{self.url}: {key} was created or deleted under every attempt of the "
            f"compare-and-set check ({attempts}): try again"
        )

    # -- concurrency ------------------------------------------------------------------------------

    def _executor(self) -> ThreadPoolExecutor:
        pool: ThreadPoolExecutor | None = self.__dict__.get("_pool")
        # A pool inherited through fork has no threads in the child: waiting on it hangs.
        if pool is None or self.__dict__.get("_pool_pid") != os.getpid():
            pool = ThreadPoolExecutor(
                max_workers=self.concurrency,
                thread_name_prefix="zarrlake-io",
                initializer=_mark_pool_thread,
            )
            self.__dict__["_pool"] = pool
            self.__dict__["_pool_pid"] = os.getpid()
        return pool

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> builtins.list[T]:
        """Apply an I/O function to many items concurrently, preserving order.

        Called from one of the pool's own threads (an I/O function that maps in turn), it runs
        the items in that thread: waiting on the pool from inside it could wait forever.
        """
        items = builtins.list(items)
        if len(items) <= 1 or getattr(_POOL_THREAD, "marked", False):
            return [fn(x) for x in items]
        return builtins.list(self._executor().map(fn, items))

    def map_reads(self, fn: Callable[[Any], T], items: Iterable[Any]) -> builtins.list[T]:
        """:meth:`map` for small reads: on a backend whose small reads cost less than a thread
        hand-off (:attr:`inline_read_bytes` > 0: local files, memory) they run one after another
        in this thread — for a fresh client, starting the pool's threads alone costs more than a
        few dozen such reads; elsewhere concurrently, as :meth:`map`."""
        if self.inline_read_bytes:
            return [fn(x) for x in items]
        return self.map(fn, items)

    def start_read(self, fn: Callable[[], T]) -> Callable[[], T]:
        """Start the read ``fn`` now, to overlap what the caller does next; returns the function
        that gives its result (or raises its error). Where small reads cost less than a thread
        hand-off (:meth:`map_reads` runs them in place) nothing starts: ``fn`` runs when its
        result is first asked for, in the asking thread."""
        if self.inline_read_bytes or getattr(_POOL_THREAD, "marked", False):
            return functools.cache(fn)
        return self._executor().submit(fn).result

    def map_writes(
        self, fn: Callable[[Any], T], items: Iterable[Any], nbytes: int
    ) -> builtins.list[T]:
        """:meth:`map` for a round of small writes (``nbytes`` in all, and perhaps small reads
        among them): on a backend where such a round costs less than the thread hand-offs
        (``nbytes`` <= :attr:`inline_write_bytes`: local files without fsync, memory) they run
        one after another in this thread; elsewhere concurrently, as :meth:`map`. Each write is
        the same request either way: only where it runs changes."""
        if nbytes <= self.inline_write_bytes:
            return [fn(x) for x in items]
        return self.map(fn, items)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Start blocking ``fn(*args)`` on the I/O pool and return its future. Called from one
        of the pool's own threads, it runs at once in that thread (as :meth:`map` does)."""
        if on_io_pool():
            done: Future[T] = Future()
            try:
                done.set_result(fn(*args))
            except Exception as e:
                done.set_exception(e)
            return done
        return self._executor().submit(fn, *args)

    async def run_async(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking storage call on this backend's I/O pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor(), fn, *args)

    async def get_async(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """:meth:`get` for a caller on an event loop, with the same contract: on the I/O pool,
        unless the backend has requests of its own that an event loop can await (S3 on
        obstore), which saves the hand-off to a thread and back for every request."""
        return await self.run_async(self.get, key, byte_range)

    async def put_async(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        """:meth:`put` for a caller on an event loop, with the same contract: on the I/O pool,
        unless the backend has requests of its own that an event loop can await (S3 on obstore),
        which saves the hand-off to a thread and back for every object."""
        await self.run_async(lambda: self.put(key, data, create_only=create_only))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_pool", None)
        state.pop("_pool_pid", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

"""Read-only: a repository published on a static web server or a CDN.

The objects of a local or S3 repository, copied as they are under a base URL, are a readable
repository: every key is a path below the URL. HTTP offers what reading needs — GET, a byte range
of a GET, HEAD — and nothing else: writes raise :class:`ReadOnlyStorage` and listings
:class:`ListingUnsupported`. The engine opens such a repository read-only and finds branch heads
without a listing (see :mod:`zarrlake.refs`).

Requests go through urllib3 (one keep-alive pool per process); transient failures (5xx, 429,
connection errors, truncated bodies) are retried by :func:`with_retries`. Redirects are followed,
except one that only appends ``/`` to the path: that is a server showing a folder, not an object.
"""

from __future__ import annotations

import builtins
import datetime as dt
import email.utils
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar
from urllib.parse import SplitResult, quote, urlsplit

from zarrlake.errors import ListingUnsupported, ReadOnlyStorage
from zarrlake.extras import require
from zarrlake.storage.base import (
    Buffer,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
    Versioned,
    register_backend,
    with_retries,
)

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

_pools: dict[tuple[int, float], Any] = {}
_pools_lock = threading.Lock()


def _require_urllib3() -> None:
    require("urllib3", extra="http", feature="the HTTP storage backend")


def _pool(timeout: float) -> Any:
    """One urllib3 pool manager per process and timeout (a forked child makes its own)."""
    import urllib3

    key = (os.getpid(), timeout)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = urllib3.PoolManager(
                maxsize=HTTPStorage.concurrency,
                block=False,
                timeout=urllib3.Timeout(connect=min(timeout, 10.0), read=timeout),
            )
        return pool


@register_backend("http", "https")
class HTTPStorage(Storage):
    """A base URL whose paths are the repository's keys. Durable and shared (it is a server),
    but read-only and without listings."""

    supports_writes: ClassVar[bool] = False
    supports_conditional_writes: ClassVar[bool] = False
    supports_compare_and_set: ClassVar[bool] = False
    supports_listing: ClassVar[bool] = False
    concurrency: ClassVar[int] = 32

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        _require_urllib3()  # missing, it is an error now, not at the first request
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
            raise StorageError(f"not an http(s) URL with a host: {url!r}")
        if parts.query or parts.fragment:
            raise StorageError(f"an HTTP repository URL takes no query or fragment: {url!r}")
        self.base_url = f"{parts.scheme.lower()}://{parts.netloc}{parts.path.rstrip('/')}"
        self.headers = dict(headers or {})
        self.timeout = timeout

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> HTTPStorage:
        """``https://host/path/to/repo`` (or ``http://``): the repository's objects below it."""
        return cls(url.geturl())

    @property
    def url(self) -> str:
        return self.base_url

    def _object_url(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StorageError(f"invalid object key: {key!r}")
        return f"{self.base_url}/{quote(key, safe='/~')}"

    def _request(
        self,
        method: str,
        key: str,
        headers: dict[str, str] | None = None,
        *,
        conditional: bool = False,
    ) -> Any:
        """The response to ``method`` on ``key``'s URL; None for 416 (a range past the end).
        Raises :class:`ObjectNotFound`, :class:`TransientStorageError`, :class:`StorageError`;
        with ``conditional``, :class:`PreconditionFailed` for 412."""
        import urllib3

        url = self._object_url(key)
        # identity: a byte range must count bytes of the object, not of a compressed response.
        sent = {"Accept-Encoding": "identity", **self.headers, **(headers or {})}
        pool = _pool(self.timeout)
        # We retry failures ourselves (with_retries); urllib3 only follows redirects.
        retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5)

        def once() -> Any:
            try:
                r = pool.request(method, url, headers=sent, retries=retries)
            except urllib3.exceptions.MaxRetryError as e:
                if isinstance(e.reason, urllib3.exceptions.ResponseError):  # too many redirects
                    raise StorageError(f"HTTP redirect loop for {url}") from None
                raise TransientStorageError(f"HTTP server unreachable for {url}: {e.reason}") from e
            except urllib3.exceptions.HTTPError as e:
                raise TransientStorageError(f"HTTP request for {url} failed: {e}") from e
            final = r.geturl() or url
            if r.status in (200, 206) and final.split("?", 1)[0].endswith("/"):
                raise ObjectNotFound(key)  # the server redirected to a folder's index page
            if r.status in (200, 206):
                return r
            if r.status in (404, 410):
                raise ObjectNotFound(key)
            if r.status == 416:
                return None
            if r.status == 412 and conditional:
                raise PreconditionFailed(key)
            if r.status >= 500 or r.status in (408, 429):
                raise TransientStorageError(f"HTTP {r.status} for {url}")
            raise StorageError(f"HTTP {r.status} {r.reason or ''} for {url}".rstrip())

        return with_retries(once)

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        if byte_range is None:
            return bytes(self._request("GET", key).data)
        start, end = byte_range
        if end <= start:
            self._request("HEAD", key)  # a missing object is still missing
            return b""
        r = self._request("GET", key, {"Range": f"bytes={start}-{end - 1}"})
        if r is None:  # 416: the range starts at or past the end
            return b""
        data = bytes(r.data)
        if r.status == 200:  # a server that ignores ranges sends the whole object
            return data[start:end]
        return data

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._request("HEAD", key)
        except ObjectNotFound:
            return None
        size = r.headers.get("Content-Length")
        if size is None:  # no length on HEAD (some servers): ask for the first byte's range
            ranged = self._request("GET", key, {"Range": "bytes=0-0"})
            total = ranged.headers.get("Content-Range", "").rpartition("/")[2] if ranged else "0"
            size = total if total.isdigit() else str(len(ranged.data) if ranged else 0)
        return ObjectInfo(key, int(size), _modified(r), _strong_etag(r))

    def get_if_unchanged(
        self,
        key: str,
        byte_range: tuple[int, int],
        *,
        etag: str | None = None,
        modified: dt.datetime | None = None,
    ) -> bytes:
        """As :meth:`Storage.get_if_unchanged`, in one GET: ``If-Match`` and
        ``If-Unmodified-Since`` ask the server to refuse another version (412), and the
        answer's own ``ETag`` and ``Last-Modified`` are checked too, for servers that ignore
        the conditions. HTTP dates count seconds: a time is compared to the second, and an
        answer without the header pinned is taken for another version (it cannot show it is
        the same)."""
        start, end = byte_range
        headers: dict[str, str] = {}
        if etag is not None:
            headers["If-Match"] = etag
        if modified is not None:
            headers["If-Unmodified-Since"] = email.utils.format_datetime(
                modified.astimezone(dt.UTC), usegmt=True
            )
        if end > start:
            headers["Range"] = f"bytes={start}-{end - 1}"
        r = self._request("GET" if end > start else "HEAD", key, headers, conditional=True)
        if r is None:  # 416: the range starts at or past the end
            return b""
        if etag is not None and _strong_etag(r) != etag:
            raise PreconditionFailed(key)
        if modified is not None:
            answered = r.headers.get("Last-Modified")
            if answered is None or int(_modified(r).timestamp()) != int(modified.timestamp()):
                raise PreconditionFailed(key)
        if end <= start:
            return b""
        data = bytes(r.data)
        return data[start:end] if r.status == 200 else data

    # -- what plain HTTP cannot do --------------------------------------------------------------

    def _read_only(self, what: str) -> ReadOnlyStorage:
        return ReadOnlyStorage(
            f"{self.base_url} is read-only (plain HTTP cannot {what}): write to the repository "
            "this one was published from"
        )

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        raise self._read_only(f"write {key}")

    def delete_many(self, keys: Iterable[str]) -> int:
        raise self._read_only("delete objects")

    # A version is only ever asked for to swap an object, which no reader of a published copy
    # does: both halves of compare-and-set are writes' business here.
    def get_versioned(self, key: str) -> Versioned:
        raise self._read_only(f"compare-and-set {key}")

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        raise self._read_only(f"compare-and-set {key}")

    def delete_stale(
        self, keys: Iterable[str], cutoff: dt.datetime
    ) -> tuple[builtins.list[ObjectInfo], builtins.list[ObjectInfo]]:
        raise self._read_only("delete objects")

    def _unlisted(self, prefix: str) -> ListingUnsupported:
        return ListingUnsupported(
            f"{self.base_url} cannot be listed (plain HTTP has no listing): name the branch or "
            f"tag to read, or open the repository it was published from (asked for {prefix!r})"
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        raise self._unlisted(prefix)

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> builtins.list[str]:
        raise self._unlisted(prefix)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        raise self._unlisted(prefix)

    def __setstate__(self, state: dict[str, Any]) -> None:
        _require_urllib3()  # a worker that unpickles this storage may lack the extra
        super().__setstate__(state)


def _modified(r: Any) -> dt.datetime:
    """The answer's ``Last-Modified`` (the epoch without one, or for one that does not parse)."""
    text = r.headers.get("Last-Modified")
    try:
        return email.utils.parsedate_to_datetime(text) if text else _EPOCH
    except (TypeError, ValueError):
        return _EPOCH


def _strong_etag(r: Any) -> str | None:
    """The answer's ``ETag`` if it is a strong one (a weak ``W/"…"`` names equivalent
    contents, not these bytes: it cannot pin a byte range)."""
    tag = r.headers.get("ETag")
    return tag if tag and not tag.startswith("W/") else None

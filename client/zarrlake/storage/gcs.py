"""Google Cloud Storage, through its JSON API over urllib3.

Requests go straight to the JSON API on one keep-alive pool per process (as the S3 backend's hot
path does); tokens come from google-auth: explicit ``token`` or ``service_account_file``, else
Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's user credentials,
the metadata server of GCE/GKE/Cloud Run), refreshed before they expire.

Create-only writes upload with ``ifGenerationMatch=0``: GCS creates the object only if no live
generation exists, so of two racing writers exactly one succeeds and the other gets 412
(:class:`PreconditionFailed`). Uploads are ``multipart`` (metadata and bytes in one request),
which every emulator we know honours preconditions on. GCS lists objects in key order.

Compare-and-set (:meth:`GCSStorage.put_if_version`) uploads with ``ifGenerationMatch=<generation>``
(``0`` to create): the version is the object's generation, which every write makes anew, even
of the same bytes. A download carries its generation (``x-goog-generation``), so
:meth:`GCSStorage.get_versioned` is one request.

``anonymous=True`` sends no credentials (public buckets, emulators); ``STORAGE_EMULATOR_HOST``
(the variable Google's own clients honour) points an unconfigured storage at an emulator.
"""

from __future__ import annotations

import builtins
import datetime as dt
import json
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import SplitResult, quote, unquote, urlencode

from zarrlake.extras import require
from zarrlake.storage.base import (
    Buffer,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
    UrlOptions,
    Versioned,
    register_backend,
    with_retries,
)

_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_DEFAULT_ENDPOINT = "https://storage.googleapis.com"
_LIST_FIELDS = "items(name,size,updated),prefixes,nextPageToken"

_pools: dict[int, Any] = {}
_tokens: dict[tuple[Any, ...], _TokenSource] = {}
_shared_lock = threading.Lock()

_FEATURE = "the GCS storage backend"


def _require(anonymous: bool) -> None:
    """What this backend needs: urllib3 for its requests, google-auth for its tokens (none are
    sent with ``anonymous``)."""
    require("urllib3", extra="gcs", feature=_FEATURE)
    if not anonymous:
        require("google.auth", extra="gcs", feature=_FEATURE)


def _pool(size: int) -> Any:
    import urllib3

    key = os.getpid()
    with _shared_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = urllib3.PoolManager(
                maxsize=size, block=False, timeout=urllib3.Timeout(connect=10, read=60)
            )
        return pool


class _TokenSource:
    """OAuth access tokens from google-auth credentials, refreshed under a lock when stale."""

    def __init__(self, credentials: Any) -> None:
        self.credentials = credentials
        self.lock = threading.Lock()

    def token(self) -> str:
        from google.auth.exceptions import GoogleAuthError
        from google.auth.transport.urllib3 import Request

        with self.lock:
            if not self.credentials.valid:
                try:
                    self.credentials.refresh(Request(_pool(4)))  # type: ignore[no-untyped-call]
                except GoogleAuthError as e:
                    raise StorageError(f"GCS credentials could not be refreshed: {e}") from None
            return str(self.credentials.token)


def _parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


@register_backend("gs", "gcs")
class GCSStorage(Storage):
    """A bucket (and a prefix in it) of Google Cloud Storage. Durable and shared."""

    concurrency: ClassVar[int] = 32
    supports_compare_and_set: ClassVar[bool] = True
    # GCS keeps generation preconditions; an emulator might not: checked before it is relied on.
    compare_and_set_by_server: ClassVar[bool] = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        token: str | None = None,
        service_account_file: str | None = None,
        anonymous: bool = False,
        allow_http: bool = False,
        service_account_info: Mapping[str, Any] | None = None,
    ) -> None:
        if not bucket:
            raise StorageError("GCS storage needs a bucket name")
        # The key file's contents, canonical: one token source per key, however it was passed.
        info = (
            json.dumps(dict(service_account_info), sort_keys=True) if service_account_info else None
        )
        explicit = bool(token or service_account_file or info)
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if endpoint_url is None and emulator:  # Google's clients' convention for emulators
            endpoint_url = emulator if "://" in emulator else f"http://{emulator}"
            allow_http, anonymous = True, not explicit
        if endpoint_url and endpoint_url.startswith("http://") and not allow_http:
            raise StorageError(f"plain-HTTP endpoint {endpoint_url} needs allow_http=True")
        if anonymous and explicit:
            raise StorageError("anonymous=True sends unsigned requests: it takes no credentials")
        _require(anonymous)  # missing, it is an error now, not at the first request
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self.anonymous = anonymous
        self.allow_http = allow_http
        self._credentials = (token, service_account_file, info)

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> GCSStorage:
        """``gs://bucket/prefix?endpoint_url=…&anonymous=true`` (``gcs://`` too). Credentials
        never come from a URL: Application Default Credentials supply them."""
        if not url.netloc:
            raise StorageError(f"GCS URL needs a bucket: {url.geturl()!r}")
        q = UrlOptions(url, "endpoint_url", "endpoint", "anonymous", "allow_http")
        endpoint = q.get("endpoint_url", "endpoint")
        return cls(
            url.netloc,
            unquote(url.path.lstrip("/")),
            endpoint_url=endpoint,
            anonymous=q.flag("anonymous"),
            allow_http=q.flag("allow_http") or bool(endpoint and endpoint.startswith("http://")),
        )

    @property
    def url(self) -> str:
        q = {}
        if self.endpoint_url:
            q["endpoint_url"] = self.endpoint_url
        if self.anonymous:
            q["anonymous"] = "true"
        if self.allow_http:
            q["allow_http"] = "true"
        query = ("?" + urlencode(q)) if q else ""
        return f"gs://{self.bucket}/{self.prefix.rstrip('/')}{query}"

    # -- requests ---------------------------------------------------------------------------------

    def _base(self) -> str:
        return (self.endpoint_url or _DEFAULT_ENDPOINT).rstrip("/")

    def _object_path(self, key: str) -> str:
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self.prefix + key, safe='')}"

    def _auth_headers(self) -> dict[str, str]:
        if self.anonymous:
            return {}
        source = self.__dict__.get("_tokens_from")
        if source is None:
            source = self.__dict__["_tokens_from"] = self._token_source()
        return {"Authorization": f"Bearer {source.token()}"}

    def _token_source(self) -> _TokenSource:
        token, service_account_file, info = self._credentials
        key = (os.getpid(), token, service_account_file, info)
        with _shared_lock:
            found = _tokens.get(key)
            if found is not None:
                return found
        if token:
            from google.oauth2.credentials import Credentials

            credentials: Any = Credentials(token)  # type: ignore[no-untyped-call]
        else:
            import google.auth
            import google.auth.exceptions
            from google.oauth2 import service_account

            try:
                if info:
                    parse = service_account.Credentials.from_service_account_info
                    credentials = parse(json.loads(info), scopes=[_SCOPE])  # type: ignore[no-untyped-call]
                elif service_account_file:
                    make = service_account.Credentials.from_service_account_file
                    credentials = make(service_account_file, scopes=[_SCOPE])  # type: ignore[no-untyped-call]
                else:
                    credentials, _ = google.auth.default(scopes=[_SCOPE])
            except (google.auth.exceptions.GoogleAuthError, OSError, ValueError) as e:
                raise StorageError(
                    f"no usable GCS credentials for gs://{self.bucket}: {e}"
                ) from None
        with _shared_lock:
            return _tokens.setdefault(key, _TokenSource(credentials))

    def _request(
        self,
        method: str,
        path: str,
        key: str,
        *,
        query: dict[str, str] | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One JSON API request, retried when transient. Returns the response; None for 416
        (a range past the end). Raises :class:`ObjectNotFound` (404),
        :class:`PreconditionFailed` (412), :class:`TransientStorageError`, :class:`StorageError`.
        """
        import urllib3

        url = self._base() + path + ("?" + urlencode(query) if query else "")
        pool = _pool(self.concurrency * 2)

        def once() -> Any:
            sent = {**(headers or {}), **self._auth_headers()}
            try:
                r = pool.request(
                    method, url, body=body, headers=sent, retries=False, redirect=False
                )
            except urllib3.exceptions.HTTPError as e:
                raise TransientStorageError(f"GCS unreachable for {key}: {e}") from e
            if r.status in (200, 204, 206):
                return r
            if r.status == 404:
                raise ObjectNotFound(key)
            if r.status == 412:
                raise PreconditionFailed(key)
            if r.status == 416:
                return None
            if r.status >= 500 or r.status in (408, 429):
                raise TransientStorageError(f"GCS {r.status} on {key}")
            if r.status == 401 and not self.anonymous:
                self.__dict__.pop("_tokens_from", None)  # a revoked token: fetch anew once
            raise StorageError(f"GCS {r.status} on {key}: {_message(r.data)}")

        return with_retries(once)

    # -- the protocol -----------------------------------------------------------------------------

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        headers = {"Accept-Encoding": "identity"}
        if byte_range is not None:
            start, end = byte_range
            if end <= start:
                if self.head(key) is None:
                    raise ObjectNotFound(key)
                return b""
            headers["Range"] = f"bytes={start}-{end - 1}"
        r = self._request(
            "GET", self._object_path(key), key, query={"alt": "media"}, headers=headers
        )
        if r is None:
            return b""
        data = bytes(r.data)
        if byte_range is not None and r.status == 200:  # sent whole: an empty object, say
            return data[byte_range[0] : byte_range[1]]
        return data

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        self._upload(key, data, "0" if create_only else None)

    def _upload(self, key: str, data: Buffer, generation: str | None) -> Any:
        """One multipart upload, only over ``generation`` if given (``"0"``: only if absent).
        Returns the response, whose JSON holds the new object's generation."""
        boundary = uuid.uuid4().hex
        meta = json.dumps({"name": self.prefix + key}).encode()
        body = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                meta,
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                bytes(data),
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        query = {"uploadType": "multipart", "fields": "generation"}
        if generation is not None:
            query["ifGenerationMatch"] = generation
        try:
            return self._request(
                "POST",
                f"/upload/storage/v1/b/{quote(self.bucket, safe='')}/o",
                key,
                query=query,
                body=body,
                headers={"Content-Type": f"multipart/related; boundary={boundary}"},
            )
        except ObjectNotFound:  # a put finds no object missing: the bucket is
            raise StorageError(f"GCS bucket {self.bucket!r} not found (writing {key})") from None

    # -- compare-and-set: the generation is the version ---------------------------------------

    def get_versioned(self, key: str) -> Versioned:
        r = self._request(
            "GET",
            self._object_path(key),
            key,
            query={"alt": "media"},
            headers={"Accept-Encoding": "identity"},
        )
        generation = r.headers.get("x-goog-generation")
        if not generation:
            raise StorageError(f"GCS get {key}: the download carries no generation to compare")
        return Versioned(bytes(r.data), generation)

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        # A version is a generation, never "0" (which would mean "only if absent"): GCS numbers
        # generations from the time of the write, in microseconds.
        r = self._upload(key, data, "0" if version is None else version)
        try:
            return str(json.loads(r.data)["generation"])
        except (ValueError, KeyError, TypeError):
            raise StorageError(
                f"GCS put {key}: the answer carries no generation to compare"
            ) from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._request(
                "GET", self._object_path(key), key, query={"fields": "size,updated,generation"}
            )
        except ObjectNotFound:
            return None
        meta = json.loads(r.data)
        # The generation stands for the ETag: it names the object's contents (a new one for
        # every write), where GCS's own ETag changes with its metadata too.
        generation = meta.get("generation")
        etag = None if generation is None else str(generation)
        return ObjectInfo(key, int(meta["size"]), _parse_time(meta["updated"]), etag)

    def get_if_unchanged(
        self,
        key: str,
        byte_range: tuple[int, int],
        *,
        etag: str | None = None,
        modified: dt.datetime | None = None,
    ) -> bytes:
        """As :meth:`Storage.get_if_unchanged`; ``etag`` is the generation (:meth:`head`'s),
        checked by the download itself (``ifGenerationMatch``, and the generation it answers
        with; the time, which only a new generation changes, is not asked again). A time alone
        is checked by a metadata read first (GCS has no time precondition on a download)."""
        start, end = byte_range
        if etag is None or end <= start:
            return super().get_if_unchanged(key, byte_range, etag=etag, modified=modified)
        if not etag.isdigit():  # not a generation: no object of this bucket has it
            if self.head(key) is None:
                raise ObjectNotFound(key)
            raise PreconditionFailed(key)
        # The generation decides alone: the time is the generation's (it changes only with it).
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={start}-{end - 1}"}
        r = self._request(
            "GET",
            self._object_path(key),
            key,
            query={"alt": "media", "ifGenerationMatch": etag},
            headers=headers,
        )
        if r is None:
            return b""
        answered = r.headers.get("x-goog-generation")
        if answered is not None and answered != etag:  # a server that ignores the condition
            raise PreconditionFailed(key)
        data = bytes(r.data)
        return data[start:end] if r.status == 200 else data

    def _pages(self, prefix: str, **extra: str) -> Iterator[dict[str, Any]]:
        path = f"/storage/v1/b/{quote(self.bucket, safe='')}/o"
        token: str | None = None
        while True:
            query = {"prefix": self.prefix + prefix, "fields": _LIST_FIELDS, **extra}
            if token:
                query["pageToken"] = token
            try:
                data = self._request("GET", path, prefix, query=query).data
            except ObjectNotFound:  # a listing's 404: the bucket (a missing prefix lists nothing)
                raise ObjectNotFound(
                    f"{self.bucket} (GCS bucket not found, listing {prefix!r})"
                ) from None
            page = json.loads(data)
            yield page
            token = page.get("nextPageToken")
            if not token:
                return

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        n = len(self.prefix)
        for page in self._pages(prefix, maxResults="1000"):
            for item in page.get("items", []):
                yield ObjectInfo(item["name"][n:], int(item["size"]), _parse_time(item["updated"]))

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> builtins.list[str]:
        if limit is None or limit > 1000:
            return super().list_keys(prefix, limit=limit)
        if limit <= 0:
            return []
        n = len(self.prefix)
        page = next(self._pages(prefix, maxResults=str(limit)))
        return [item["name"][n:] for item in page.get("items", [])][:limit]

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        full = len(self.prefix + prefix)
        out: builtins.list[str] = []
        for page in self._pages(prefix, delimiter="/", maxResults="1000"):
            out.extend(p[full:].rstrip("/") for p in page.get("prefixes", []))
        return out

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = builtins.list(keys)

        def delete(key: str) -> None:
            try:
                self._request("DELETE", self._object_path(key), key)
            except ObjectNotFound:
                pass  # absent keys are fine

        self.map(delete, keys)
        return len(keys)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_tokens_from", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        _require(state["anonymous"])  # a worker that unpickles this storage may lack the extra
        super().__setstate__(state)


def _message(body: bytes) -> str:
    """The message of a JSON API error body (or its first bytes)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")

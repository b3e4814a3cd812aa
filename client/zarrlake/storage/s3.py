"""AWS S3 and S3-compatible servers: botocore resolves credentials and lists; whole-object GETs,
PUTs and HEADs go through obstore (see "the hot path through obstore" below), with signed urllib3
requests where obstore cannot serve.

botocore is thread-safe per client, so one client with a large connection pool serves the engine's
I/O thread pool: many requests in flight from one Python process. Create-only writes use
``If-None-Match: *`` (S3 conditional writes); a 412 — or a 409 from a concurrent conditional write —
is a :class:`PreconditionFailed`, never retried. Compare-and-set (:meth:`S3Storage.put_if_version`)
sends ``If-Match: <ETag>`` (``If-None-Match: *`` to create): its version is the ETag, which for a
plain PUT is the MD5 of the bytes, so a swap that writes the bytes already there keeps the
version. Whether a server keeps ``If-Match`` is its affair (moto and SeaweedFS do, and AWS since
2024-11): :meth:`Storage.check_compare_and_set` asks before the engine relies on it.

``anonymous=True`` sends unsigned requests (botocore's ``UNSIGNED``): public buckets, read by
anyone without credentials. ``addressing_style`` chooses between ``path`` URLs
(``endpoint/bucket/key``) and ``virtual`` hosts (``bucket.endpoint/key``); by default AWS gets
virtual hosts (path style for dotted bucket names, whose certificates would not match) and a
custom endpoint path style, which every S3-compatible server understands.
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as dt
import email.utils
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Literal
from urllib.parse import SplitResult, quote, unquote, urlencode, urlsplit

import zarrlake.storage.objstore as objstore
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
    with_retries_async,
)

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}


@dataclass(frozen=True)
class _Connection:
    """A botocore client and the credentials it signs with (refreshed as botocore refreshes
    them), so that the hot path signs its own requests with the very same credentials."""

    client: Any  # botocore.client.S3
    credentials: Any  # botocore.credentials.Credentials | None: None when no chain has any


_ADDRESSING_STYLES = ("path", "virtual")


def _boto3() -> ModuleType:
    """boto3 (and with it botocore, which resolves credentials, signs and lists): what this
    backend cannot do without. obstore, its fast path, is optional (urllib3 serves instead)."""
    return require("boto3", extra="s3", feature="the S3 storage backend")


_connections: dict[tuple[Any, ...], _Connection] = {}
_clients_lock = threading.Lock()


def _shared_connection(
    endpoint_url: str | None,
    region: str | None,
    credentials: tuple[str | None, str | None, str | None],
    pool: int,
    anonymous: bool = False,
    addressing_style: str | None = None,
) -> _Connection:
    """One botocore client per configuration and process.

    Building a client costs ~0.1-0.2 s (endpoint and credential resolution); storages unpickled
    in every Spark task, or opened per request, would pay it each time. Clients are thread-safe;
    the process id in the key keeps a forked child from sharing its parent's connections.
    """
    key = (os.getpid(), endpoint_url, region, credentials, pool, anonymous, addressing_style)
    with _clients_lock:
        conn = _connections.get(key)
        if conn is None:
            boto3 = _boto3()
            from botocore import UNSIGNED
            from botocore.config import Config

            style = addressing_style or ("path" if endpoint_url else None)

            session = boto3.session.Session(
                aws_access_key_id=credentials[0],
                aws_secret_access_key=credentials[1],
                aws_session_token=credentials[2],
                region_name=region,
            )
            client = session.client(
                "s3",
                endpoint_url=endpoint_url,
                config=Config(
                    max_pool_connections=pool,
                    # One attempt: we retry ourselves ("max_attempts" would count retries, and
                    # botocore's backoff on top of ours multiplies requests and waits).
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=10,
                    read_timeout=60,
                    s3={"addressing_style": style} if style else None,
                    signature_version=UNSIGNED if anonymous else None,
                ),
            )
            # The session resolved (and cached) these credentials when it built the client: the
            # same object the client signs with, refreshable ones included.
            signer = None if anonymous else session.get_credentials()
            conn = _connections[key] = _Connection(client, signer)
        return conn


_pools: dict[tuple[int, int], Any] = {}
_obstores: dict[tuple[Any, ...], Any] = {}


class _BotocoreCredentials:
    """obstore's credential provider: the credentials botocore resolved (and refreshes). Static
    ones are handed over once; refreshable ones are asked for again every few minutes."""

    def __init__(self, credentials: Any) -> None:
        self.credentials = credentials

    def __call__(self) -> dict[str, Any]:
        frozen = self.credentials.get_frozen_credentials()
        refreshable = hasattr(self.credentials, "refresh_needed")
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)
            if refreshable
            else None,
        }


def _shared_pool(size: int) -> Any:
    """One urllib3 pool per process (keep-alive connections shared by every storage)."""
    import urllib3

    key = (os.getpid(), size)
    with _clients_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = urllib3.PoolManager(
                maxsize=size, block=False, timeout=urllib3.Timeout(connect=10, read=60)
            )
        return pool


def _xml_code(body: bytes) -> str | None:
    """The <Code> of an S3 XML error body, if any."""
    start = body.find(b"<Code>")
    end = body.find(b"</Code>", start)
    return body[start + 6 : end].decode(errors="replace") if start >= 0 and end > start else None


@register_backend("s3", "s3a")
class S3Storage(Storage):
    """Durable and shared by every process that can reach the bucket."""

    concurrency: ClassVar[int] = 32
    # Whether the server keeps If-None-Match is the server's affair: checked before writing.
    conditional_writes_by_server: ClassVar[bool] = True
    # Likewise If-Match (compare-and-set): checked before the engine relies on it.
    supports_compare_and_set: ClassVar[bool] = True
    compare_and_set_by_server: ClassVar[bool] = True

    def __init__(
        self,
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
    ) -> None:
        _boto3()  # missing, it is an error now, not at the first request
        endpoint_url = endpoint_url or None  # "" is no endpoint: AWS's own
        if endpoint_url is not None:
            try:
                parsed = urlsplit(endpoint_url)
                parsed.port  # noqa: B018 (a port out of range raises)
            except ValueError as e:
                raise StorageError(f"endpoint_url {endpoint_url!r} is not a URL: {e}") from None
            # As zarrlake.resources.endpoint_problem checks a resource's endpointURL (the two
            # layers cannot share a function): a scheme, a host, a port in range, no spaces.
            if (
                parsed.scheme not in ("http", "https")
                or not parsed.hostname
                or any(c.isspace() for c in endpoint_url)
            ):
                raise StorageError(
                    f"endpoint_url must be an http:// or https:// URL, not {endpoint_url!r}"
                )
            endpoint_url = parsed.scheme + endpoint_url[len(parsed.scheme) :]  # HTTP:// too
            if parsed.scheme == "http" and not allow_http:
                raise StorageError(
                    f"plain-HTTP endpoint {endpoint_url} needs allow_http=True (allow_http=true "
                    "in a URL's query)"
                )
        if not bucket:
            raise StorageError("an S3 storage needs a bucket name")
        if addressing_style not in (None, *_ADDRESSING_STYLES):
            raise StorageError(
                f"addressing_style must be 'path' or 'virtual' (or None), not {addressing_style!r}"
            )
        if anonymous and (access_key_id or secret_access_key or session_token):
            raise StorageError("anonymous=True sends unsigned requests: it takes no credentials")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.allow_http = allow_http
        self.anonymous = anonymous
        self.addressing_style = addressing_style
        self._credentials = (access_key_id, secret_access_key, session_token)

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> S3Storage:
        """``s3://bucket/prefix?endpoint_url=…&region=…&allow_http=true&anonymous=true&
        addressing_style=path|virtual`` (``endpoint`` is an alias of ``endpoint_url``). An
        explicit ``http://`` endpoint in a URL is consent enough for plain HTTP. Credentials
        never come from a URL: the AWS default chain supplies them (none with ``anonymous``)."""
        if not url.netloc:
            raise StorageError(f"s3 URL needs a bucket: {url.geturl()!r}")
        q = UrlOptions(
            url, "endpoint_url", "endpoint", "region", "allow_http", "anonymous", "addressing_style"
        )
        endpoint = q.get("endpoint_url", "endpoint")
        return cls(
            url.netloc,
            unquote(url.path.lstrip("/")),
            endpoint_url=endpoint,
            region=q.get("region"),
            allow_http=q.flag("allow_http") or bool(endpoint and endpoint.startswith("http://")),
            anonymous=q.flag("anonymous"),
            addressing_style=q.get("addressing_style"),
        )

    @property
    def url(self) -> str:
        q = {}
        if self.endpoint_url:
            q["endpoint_url"] = self.endpoint_url
        if self.region:
            q["region"] = self.region
        if self.allow_http:
            q["allow_http"] = "true"
        if self.anonymous:
            q["anonymous"] = "true"
        if self.addressing_style:
            q["addressing_style"] = self.addressing_style
        query = ("?" + urlencode(q)) if q else ""
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}{query}"

    @property
    def _connection(self) -> _Connection:
        conn: _Connection | None = self.__dict__.get("_conn")
        if conn is None:
            conn = _shared_connection(
                self.endpoint_url,
                self.region,
                self._credentials,
                self.concurrency * 2,
                self.anonymous,
                self.addressing_style,
            )
            self.__dict__["_conn"] = conn
        return conn

    @property
    def client(self) -> Any:
        """The shared botocore S3 client for this storage's endpoint, region and credentials."""
        return self._connection.client

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _call(self, key: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            EndpointConnectionError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        def once() -> Any:
            try:
                return fn(Bucket=self.bucket, **kwargs)
            except ClientError as e:
                err = e.response.get("Error", {})
                code = str(err.get("Code", ""))
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if code in ("NoSuchKey", "404", "NotFound"):
                    raise ObjectNotFound(key) from None
                if code in (
                    "PreconditionFailed",
                    "412",
                    "ConditionalRequestConflict",
                ) or status in (
                    412,
                    409,
                ):
                    raise PreconditionFailed(key) from None
                if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                    raise TransientStorageError(f"S3 {code or status} on {key}") from e
                raise StorageError(
                    f"S3 {code or status} on {key}: {err.get('Message', '')}{self._hint(status)}"
                ) from e
            except (EndpointConnectionError, ConnectionError) as e:
                raise TransientStorageError(f"S3 unreachable for {key}: {e}") from e
            except (HTTPClientError, IncompleteReadError) as e:
                # A connection dropped mid-request, a read timeout, a truncated body.
                raise TransientStorageError(f"S3 connection failed for {key}: {e}") from e
            except (NoCredentialsError, PartialCredentialsError) as e:
                raise StorageError(
                    f"no usable AWS credentials for s3://{self.bucket}: {e}"
                ) from None

        return with_retries(once)

    # -- the hot path: GET/PUT/HEAD as signed requests on a shared connection pool -----------------
    # A boto3 call spends ~1.7 ms of CPU per request building, hooking and parsing around the HTTP
    # exchange; chunk I/O is almost all GET/PUT/HEAD. These go straight to urllib3, signed with
    # botocore's own SigV4 signer (same credentials chain, refreshed as botocore refreshes them).
    # Listing and batch deletes, rarer and XML-heavy, stay on the boto3 client.

    def _object_url(self, key: str) -> str:
        base, virtual = self._endpoint()
        path = quote(self._k(key), safe="/~")
        return f"{base}/{path}" if virtual else f"{base}/{self.bucket}/{path}"

    def _endpoint(self) -> tuple[str, bool]:
        """(base URL, whether it is the bucket's virtual host) for object requests."""
        if self.endpoint_url:
            base = self.endpoint_url.rstrip("/")
            if self.addressing_style != "virtual":
                return base, False
            scheme, _, host = base.partition("://")
            return f"{scheme}://{self.bucket}.{host}", True
        region = self._signing_region()
        # dotted names break TLS on virtual hosts: path style, unless asked otherwise
        if self.addressing_style == "path" or (
            "." in self.bucket and self.addressing_style != "virtual"
        ):
            return f"https://s3.{region}.amazonaws.com", False
        return f"https://{self.bucket}.s3.{region}.amazonaws.com", True

    def _signing_region(self) -> str:
        return self.region or self.client.meta.region_name or "us-east-1"

    def _send(
        self,
        method: str,
        key: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        import urllib3
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        url = self._object_url(key)
        credentials = self._connection.credentials
        if credentials is None and not self.anonymous:
            raise StorageError(f"no usable AWS credentials for s3://{self.bucket}")
        region = self._signing_region()
        pool = _shared_pool(self.concurrency * 2)

        def once() -> Any:
            request = AWSRequest(method=method, url=url, data=body, headers=dict(headers or {}))
            if credentials is not None:  # anonymous requests go unsigned
                S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
            try:
                r = pool.request(
                    method,
                    url,
                    body=body,
                    headers=dict(request.headers.items()),
                    preload_content=True,
                    retries=False,
                    redirect=False,
                )
            except urllib3.exceptions.HTTPError as e:
                raise TransientStorageError(f"S3 unreachable for {key}: {e}") from e
            if r.status in (200, 204, 206):
                return r
            if r.status == 404:
                raise ObjectNotFound(key)
            if r.status in (409, 412):
                raise PreconditionFailed(key)
            if r.status == 416:
                return None
            if r.status >= 500 or r.status == 429:
                raise TransientStorageError(f"S3 {r.status} on {key}")
            code = _xml_code(r.data) or str(r.status)
            if code in _TRANSIENT_CODES:
                raise TransientStorageError(f"S3 {code} on {key}")
            raise StorageError(f"S3 {code} on {key}{self._hint(r.status)}")

        return with_retries(once)

    def _hint(self, status: int) -> str:
        """What a user can do about an HTTP status (for error messages)."""
        if status == 301:
            return " (set region= to the bucket's region)"
        if status == 403 and self.anonymous:
            # S3 also answers 403 for an absent key when the requester may not list the bucket.
            return (
                " (an anonymous request: the bucket must allow s3:GetObject and s3:ListBucket "
                "to everyone)"
            )
        return ""

    # -- the hot path through obstore --------------------------------------------------------------
    # Whole-object GETs, PUTs and HEADs go through obstore (Rust: its requests leave the GIL, at
    # a third of the client CPU per small object; bench/RESULTS.md, "S3 engines"), signed with
    # the credentials botocore resolved (profiles, SSO, web identity and their refreshes keep
    # working), to the very URLs the urllib3 path uses; ranged GETs too (a chunk in a pack). The
    # urllib3 path stays for anonymous requests, processes forked after obstore started here (its
    # runtime does not survive fork) and ZARRLAKE_S3_ENGINE=urllib3.

    def _obstore(self, *, build: bool = True) -> Any | None:
        """This storage's obstore ``S3Store``, or None where the urllib3 path serves. With
        ``build=False``, only one this process built already (building resolves credentials,
        which may block: not on an event loop)."""
        if self.anonymous or os.environ.get("ZARRLAKE_S3_ENGINE", "obstore") != "obstore":
            return None
        pid = os.getpid()
        mine = self.__dict__.get("_obs")
        if mine is not None and mine[0] == pid:
            return mine[1]
        if not build:
            return None
        started = objstore.runtime_pid()
        if started is not None and started != pid:
            return None  # forked from a process that used obstore: not safe here
        credentials = self._connection.credentials
        if credentials is None:
            return None  # the urllib3 path says why
        base, virtual = self._endpoint()
        if virtual and self.endpoint_url:
            # A bucket host under a custom endpoint: left to the urllib3 path, whose name
            # resolution is Python's (what such setups, and the tests, arrange).
            return None
        # The credentials object lives as long as its cached connection (the whole process):
        # its id names it.
        region = self._signing_region()
        key = (pid, self.bucket, base, virtual, region, self.allow_http, id(credentials))
        try:
            from obstore.store import S3Store
        except ImportError:  # zarrlake[s3] brings it; without it, the urllib3 path serves
            return None
        with _clients_lock:
            store = _obstores.get(key)
            if store is None:
                store = _obstores[key] = S3Store(
                    self.bucket,
                    endpoint=base,
                    region=self._signing_region(),
                    virtual_hosted_style_request=virtual,
                    credential_provider=_BotocoreCredentials(credentials),  # type: ignore[arg-type]
                    client_options={
                        "allow_http": self.allow_http or base.startswith("http://"),
                        "timeout": "60s",
                        "connect_timeout": "10s",
                        "pool_max_idle_per_host": str(self.concurrency * 2),
                    },
                    # One attempt: ``with_retries`` retries (as on the urllib3 path).
                    retry_config={"max_retries": 0, "retry_timeout": dt.timedelta(seconds=60)},
                )
                objstore.runtime_started()
        self.__dict__["_obs"] = (pid, store)
        return store

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        start, end = byte_range or (0, 0)
        if byte_range is not None and end <= start:
            return b""
        store = self._obstore()
        if store is not None:
            import obstore

            path = self._k(key)
            if byte_range is None:
                return with_retries(
                    lambda: bytes(
                        objstore.call("get", key, lambda: obstore.get(store, path).bytes())
                    )
                )
            # A chunk in a pack: ~0.8 ms less a request than the signed urllib3 path (moto and
            # SeaweedFS alike; bench/RESULTS.md).
            return with_retries(
                lambda: objstore.call(
                    "get",
                    key,
                    lambda: bytes(obstore.get_range(store, path, start=start, end=end)),
                    past_end=b"",
                )
            )
        headers = {}
        if byte_range is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        r = self._send("GET", key, headers=headers)
        return b"" if r is None else r.data

    def get_if_unchanged(
        self,
        key: str,
        byte_range: tuple[int, int],
        *,
        etag: str | None = None,
        modified: dt.datetime | None = None,
    ) -> bytes:
        """As :meth:`Storage.get_if_unchanged`, in one conditional GET: ``If-Match`` for the
        ETag, ``If-Unmodified-Since`` for the time (S3 keeps it to the second, so a rewrite
        within the second of the recorded time passes: pin sources by ETag on S3)."""
        start, end = byte_range
        headers = {"Range": f"bytes={start}-{max(start, end) - 1}"}
        if etag is not None:
            headers["If-Match"] = etag
        if modified is not None:
            headers["If-Unmodified-Since"] = email.utils.format_datetime(
                modified.astimezone(dt.UTC), usegmt=True
            )
        if end <= start:
            headers.pop("Range")
            self._send("HEAD", key, headers=headers)
            return b""
        store = self._obstore()
        if store is not None:  # as get() does: a request costs less CPU there
            import obstore

            path = self._k(key)
            options: dict[str, Any] = {"range": (start, end)}
            if etag is not None:
                options["if_match"] = etag
            if modified is not None:
                options["if_unmodified_since"] = modified
            return with_retries(
                lambda: objstore.call(
                    "get",
                    key,
                    lambda: bytes(obstore.get(store, path, options=options).bytes()),  # type: ignore[arg-type]
                    past_end=b"",
                )
            )
        r = self._send("GET", key, headers=headers)
        return b"" if r is None else bytes(r.data)

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        try:
            self._put(key, data, create_only)
        except ObjectNotFound:
            raise self._no_bucket(key) from None

    def _no_bucket(self, key: str) -> StorageError:
        """S3's 404 to a write: the bucket is not there (a key cannot be missing)."""
        where = self.endpoint_url or f"AWS ({self._signing_region()})"
        return StorageError(f"cannot write {key}: bucket {self.bucket!r} does not exist at {where}")

    def _put(self, key: str, data: Buffer, create_only: bool) -> None:
        store = self._obstore()
        if store is not None:
            import obstore

            path = self._k(key)
            mode: Literal["create", "overwrite"] = "create" if create_only else "overwrite"
            body = memoryview(data)

            def once() -> None:
                objstore.call(
                    "put",
                    key,
                    lambda: obstore.put(store, path, body, mode=mode, use_multipart=False),
                )

            with_retries(once)
            return
        self._send("PUT", key, bytes(data), {"If-None-Match": "*"} if create_only else None)

    # -- compare-and-set: the ETag is the version ------------------------------------------------

    def get_versioned(self, key: str) -> Versioned:
        store = self._obstore()
        if store is not None:
            import obstore

            path = self._k(key)

            def fetch() -> Versioned:
                got = obstore.get(store, path)  # one response: the bytes and their ETag
                data = bytes(got.bytes())
                return Versioned(data, objstore.version_of(got.meta["e_tag"], "get", key))

            return with_retries(lambda: objstore.call("get", key, fetch))
        r = self._send("GET", key)
        return Versioned(bytes(r.data), objstore.version_of(r.headers.get("ETag"), "get", key))

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        try:
            return self._put_if_version(key, data, version)
        except ObjectNotFound:
            if version is not None:
                # If-Match on an absent key: 404 NoSuchKey from AWS and moto (412 from SeaweedFS).
                # The object is not at that version: the same answer from every server.
                raise PreconditionFailed(key) from None
            raise self._no_bucket(key) from None

    def _put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        store = self._obstore()
        if store is not None:
            import obstore

            path, body, mode = self._k(key), memoryview(data), objstore.swap_mode(version)

            def once() -> str:
                put = objstore.call(
                    "put",
                    key,
                    lambda: obstore.put(store, path, body, mode=mode, use_multipart=False),
                )
                return objstore.version_of(put["e_tag"], "put", key)

            return with_retries(once)
        condition = {"If-None-Match": "*"} if version is None else {"If-Match": version}
        r = self._send("PUT", key, bytes(data), condition)
        return objstore.version_of(r.headers.get("ETag"), "put", key)

    def _slots(self) -> asyncio.Semaphore:
        """What bounds the requests this storage awaits on the running event loop: at most
        :attr:`concurrency` at once, as its blocking requests are bounded by its I/O threads."""
        loop = asyncio.get_running_loop()
        slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] | None
        slots = self.__dict__.get("_loop_slots")
        if slots is None:  # made once, not for every request
            slots = self.__dict__["_loop_slots"] = weakref.WeakKeyDictionary()
        found = slots.get(loop)
        if found is None:
            found = slots[loop] = asyncio.Semaphore(self.concurrency)
        return found

    async def get_async(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        if byte_range is not None and byte_range[1] <= byte_range[0]:
            return b""
        # As put_async: on the caller's loop once this process's store exists.
        store = self._obstore(build=False)
        if store is None:
            return await super().get_async(key, byte_range)
        import obstore

        path = self._k(key)
        past_end: bytes | None = None
        if byte_range is None:

            async def fetch() -> bytes:
                got = await obstore.get_async(store, path)
                return bytes(await got.bytes_async())

        else:
            start, end = byte_range
            past_end = b""

            async def fetch() -> bytes:
                return bytes(await obstore.get_range_async(store, path, start=start, end=end))

        async with self._slots():
            return await with_retries_async(
                lambda: objstore.call_async("get", key, fetch, past_end=past_end)
            )

    async def put_async(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        # Awaited on the caller's loop once this process's store exists; the first request goes
        # the pool's way, and builds it there.
        store = self._obstore(build=False)
        if store is None:
            await super().put_async(key, data, create_only=create_only)
            return
        import obstore

        path = self._k(key)
        mode: Literal["create", "overwrite"] = "create" if create_only else "overwrite"
        body = memoryview(data)
        async with self._slots():
            try:
                await with_retries_async(
                    lambda: objstore.call_async(
                        "put",
                        key,
                        lambda: obstore.put_async(
                            store, path, body, mode=mode, use_multipart=False
                        ),
                    )
                )
            except ObjectNotFound:
                raise self._no_bucket(key) from None

    def head(self, key: str) -> ObjectInfo | None:
        store = self._obstore()
        if store is not None:
            import obstore

            path = self._k(key)
            try:
                meta = with_retries(
                    lambda: objstore.call("head", key, lambda: obstore.head(store, path))
                )
            except ObjectNotFound:
                return None
            return ObjectInfo(
                key, int(meta["size"]), meta["last_modified"], meta.get("e_tag") or None
            )
        try:
            r = self._send("HEAD", key)
        except ObjectNotFound:
            return None
        return ObjectInfo(
            key,
            int(r.headers["Content-Length"]),
            email.utils.parsedate_to_datetime(r.headers["Last-Modified"]),
            r.headers.get("ETag") or None,
        )

    def _pages(self, prefix: str, **extra: Any) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": self._k(prefix), **extra}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(prefix, self.client.list_objects_v2, **kwargs)
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        n = len(self.prefix)
        for page in self._pages(prefix):
            for obj in page.get("Contents", []):
                yield ObjectInfo(obj["Key"][n:], int(obj["Size"]), obj["LastModified"])

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> builtins.list[str]:
        if limit is None or limit <= 0 or limit > 1000:
            return super().list_keys(prefix, limit=limit)
        # Pages of at most ``limit`` keys: the journal's head (limit=1) is one request. A server
        # may answer with fewer and a continuation ("some or all" of them): follow it.
        n = len(self.prefix)
        out: builtins.list[str] = []
        for page in self._pages(prefix, MaxKeys=limit):
            out.extend(obj["Key"][n:] for obj in page.get("Contents", []))
            if len(out) >= limit:
                break
        return out[:limit]

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        # CommonPrefixes: a server that keeps emptied folders (SeaweedFS) names them too, which
        # the listing contract allows.
        out: builtins.list[str] = []
        full = len(self._k(prefix))
        for page in self._pages(prefix, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                out.append(cp["Prefix"][full:].rstrip("/"))
        return out

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        batches = [keys[i : i + 1000] for i in range(0, len(keys), 1000)]

        def delete(batch: list[str]) -> None:
            r = self._call(
                batch[0],
                self.client.delete_objects,
                Delete={"Objects": [{"Key": self._k(k)} for k in batch], "Quiet": True},
            )
            errors = [e for e in r.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise StorageError(f"S3 delete failed for {len(errors)} keys: {errors[0]}")

        self.map(delete, batches)
        return len(keys)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_conn", None)
        # obstore's store holds the credentials the chain resolved: a pickle carries only
        # those given explicitly (API.md), and the receiving process builds its own store.
        state.pop("_obs", None)
        state.pop("_loop_slots", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        _boto3()  # a worker that unpickles this storage may lack the extra the sender had
        super().__setstate__(state)

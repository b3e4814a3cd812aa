"""AWS S3 and S3-compatible servers, through botocore.

botocore is thread-safe per client, so one client with a large connection pool serves the engine's
I/O thread pool: many requests in flight from one Python process. Create-only writes use
``If-None-Match: *`` (S3 conditional writes); a 412 — or a 409 from a concurrent conditional write —
is a :class:`PreconditionFailed`, never retried.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar
from urllib.parse import urlencode

from zarrlake.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
    with_retries,
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


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _shared_client(
    endpoint_url: str | None,
    region: str | None,
    credentials: tuple[str | None, str | None, str | None],
    pool: int,
) -> Any:
    """One botocore client per configuration and process.

    Building a client costs ~0.1-0.2 s (endpoint and credential resolution); storages unpickled
    in every Spark task, or opened per request, would pay it each time. Clients are thread-safe;
    the process id in the key keeps a forked child from sharing its parent's connections.
    """
    key = (os.getpid(), endpoint_url, region, credentials, pool)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            import boto3
            from botocore.config import Config

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
                    s3={"addressing_style": "path"} if endpoint_url else None,
                ),
            )
            _clients[key] = client
        return client


class S3Storage(Storage):
    concurrency: ClassVar[int] = 32

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
    ) -> None:
        if endpoint_url and endpoint_url.startswith("http://") and not allow_http:
            raise StorageError(f"plain-HTTP endpoint {endpoint_url} needs allow_http=True")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self.region = region
        self.allow_http = allow_http
        self._credentials = (access_key_id, secret_access_key, session_token)

    @property
    def url(self) -> str:
        q = {}
        if self.endpoint_url:
            q["endpoint_url"] = self.endpoint_url
        if self.region:
            q["region"] = self.region
        if self.allow_http:
            q["allow_http"] = "true"
        query = ("?" + urlencode(q)) if q else ""
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}{query}"

    @property
    def client(self) -> Any:
        client = self.__dict__.get("_client")
        if client is None:
            client = _shared_client(
                self.endpoint_url, self.region, self._credentials, self.concurrency * 2
            )
            self.__dict__["_client"] = client
        return client

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
                if code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status in (
                    412,
                    409,
                ):
                    raise PreconditionFailed(key) from None
                if code in _TRANSIENT_CODES or status >= 500 or status == 429:
                    raise TransientStorageError(f"S3 {code or status} on {key}") from e
                raise StorageError(f"S3 {code or status} on {key}: {err.get('Message', '')}") from e
            except (EndpointConnectionError, ConnectionError) as e:
                raise TransientStorageError(f"S3 unreachable for {key}: {e}") from e
            except (HTTPClientError, IncompleteReadError) as e:
                # A connection dropped mid-request, a read timeout, a truncated body.
                raise TransientStorageError(f"S3 connection failed for {key}: {e}") from e
            except (NoCredentialsError, PartialCredentialsError) as e:
                raise StorageError(f"no usable AWS credentials for s3://{self.bucket}: {e}") from None

        return with_retries(once)

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        kwargs: dict[str, Any] = {"Key": self._k(key)}
        if byte_range is not None:
            start, end = byte_range
            if end <= start:
                return b""
            kwargs["Range"] = f"bytes={start}-{end - 1}"

        def fetch(**kw: Any) -> bytes:
            return self.client.get_object(**kw)["Body"].read()

        try:
            return self._call(key, fetch, **kwargs)
        except StorageError as e:
            if byte_range is not None and "InvalidRange" in str(e):
                return b""
            raise

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        kwargs: dict[str, Any] = {"Key": self._k(key), "Body": bytes(data)}
        if create_only:
            kwargs["IfNoneMatch"] = "*"
        self._call(key, self.client.put_object, **kwargs)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._call(key, self.client.head_object, Key=self._k(key))
        except ObjectNotFound:
            return None
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"])

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

    def list_keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
        if limit is None or limit > 1000:
            return super().list_keys(prefix, limit=limit)
        n = len(self.prefix)
        page = self._call(
            prefix, self.client.list_objects_v2, Prefix=self._k(prefix), MaxKeys=limit
        )
        return [obj["Key"][n:] for obj in page.get("Contents", [])]

    def list_dirs(self, prefix: str) -> list[str]:
        out: list[str] = []
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
        state.pop("_client", None)
        return state

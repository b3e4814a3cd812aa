"""Azure Blob Storage, through obstore (the Rust ``object_store`` crate's Python bindings).

obstore signs and sends the requests (shared key, SAS, or Entra ID tokens: a service principal,
workload identity, managed identity, the Azure CLI — its credential chain reads the standard
``AZURE_*`` variables), pools connections and retries transient failures; its calls release the
GIL, so the engine's I/O threads run them concurrently. Create-only writes send
``If-None-Match: *``: of two racing writers Azure lets exactly one create the blob, and the
other gets 409 ``BlobAlreadyExists`` (:class:`PreconditionFailed`). Compare-and-set
(:meth:`AzureStorage.put_if_version`) sends ``If-Match: <ETag>``: Azure gives every write of a
blob a new ETag, even of the same bytes, and answers a stale one with 412.

Blob names are the repository's keys below ``prefix``. Azure lists blobs in key order, which
the protocol asks for.
"""

from __future__ import annotations

import builtins
import datetime as dt
import os
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import SplitResult, unquote, urlencode

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
)

T = TypeVar("T")


_stores: dict[tuple[Any, ...], Any] = {}
_stores_lock = threading.Lock()


def _require_obstore() -> None:
    require("obstore", extra="azure", feature="the Azure storage backend")


#: Container names Azure accepts: 3-63 lowercase letters, digits and single hyphens, starting and
#: ending with a letter or digit (and the special ``$root`` and ``$web``).
_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}|\$root|\$web")


@register_backend("az", "azure", "abfs", "abfss")
class AzureStorage(Storage):
    """A container (and a prefix in it) of an Azure storage account. Durable and shared."""

    concurrency: ClassVar[int] = 32
    supports_compare_and_set: ClassVar[bool] = True
    # Azure keeps If-Match; an emulator or a look-alike might not: checked before it is relied on.
    compare_and_set_by_server: ClassVar[bool] = True

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        account_name: str | None = None,
        account_key: str | None = None,
        sas_token: str | None = None,
        endpoint_url: str | None = None,
        anonymous: bool = False,
        allow_http: bool = False,
    ) -> None:
        _require_obstore()  # missing, it is an error now, not at the first request
        if not container:
            raise StorageError("Azure storage needs a container name")
        if not _CONTAINER.fullmatch(container):
            raise StorageError(
                f"{container!r} is not an Azure container name: 3-63 lowercase letters, digits "
                "and single hyphens, starting and ending with a letter or digit"
            )
        if endpoint_url and endpoint_url.startswith("http://") and not allow_http:
            raise StorageError(f"plain-HTTP endpoint {endpoint_url} needs allow_http=True")
        if anonymous and (account_key or sas_token):
            raise StorageError("anonymous=True sends unsigned requests: it takes no credentials")
        self.container = container
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.account_name = account_name or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
        self.endpoint_url = endpoint_url
        self.anonymous = anonymous
        self.allow_http = allow_http
        if not (anonymous or account_key or sas_token):
            # Spelled out rather than left to the client's own environment parsing: the operator
            # hands jobs a SAS token under this name.
            sas_token = os.environ.get("AZURE_STORAGE_SAS_TOKEN") or None
        self._credentials = (account_key, sas_token)
        if not self.account_name and not endpoint_url:
            raise StorageError(
                "Azure storage needs an account: account_name=, AZURE_STORAGE_ACCOUNT_NAME, "
                "or an endpoint_url"
            )

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> AzureStorage:
        """``az://container/prefix?account_name=…&endpoint_url=…&anonymous=true`` (``azure://``
        too), or ``abfs[s]://container@account.dfs.core.windows.net/prefix``. Credentials never
        come from a URL: the ``AZURE_*`` variables and Azure's credential chain supply them."""
        q = UrlOptions(url, "account_name", "endpoint_url", "endpoint", "anonymous", "allow_http")
        container, _, host = url.netloc.partition("@")
        account = q.get("account_name") or (host.split(".", 1)[0] if host else None)
        if not container:
            raise StorageError(f"Azure URL needs a container: {url.geturl()!r}")
        endpoint = q.get("endpoint_url", "endpoint")
        return cls(
            unquote(container),
            unquote(url.path.lstrip("/")),
            account_name=account,
            endpoint_url=endpoint,
            anonymous=q.flag("anonymous"),
            allow_http=q.flag("allow_http") or bool(endpoint and endpoint.startswith("http://")),
        )

    @property
    def url(self) -> str:
        q = {}
        if self.account_name:
            q["account_name"] = self.account_name
        if self.endpoint_url:
            q["endpoint_url"] = self.endpoint_url
        if self.anonymous:
            q["anonymous"] = "true"
        if self.allow_http:
            q["allow_http"] = "true"
        query = ("?" + urlencode(q)) if q else ""
        return f"az://{self.container}/{self.prefix.rstrip('/')}{query}"

    @property
    def store(self) -> Any:
        """The obstore ``AzureStore`` (one per configuration and process, built on first use).

        Never one inherited through ``fork``: its pooled connections are the parent's sockets,
        and two processes talking on one socket read each other's responses (or wait forever).
        """
        pid = os.getpid()
        mine = self.__dict__.get("_store")
        if mine is not None and mine[0] == pid:
            return mine[1]
        started = objstore.runtime_pid()
        if started is not None and started != pid:
            # obstore's I/O runtime does not survive fork: a child's requests would hang, and
            # its use of the inherited event queue would steal the parent's wake-ups.
            raise StorageError(
                f"{self.url} was used in process {started} before this one was forked from "
                "it, and its client cannot be used after fork: start worker processes with "
                "'spawn' or 'forkserver' (multiprocessing.get_context), or fork before first use"
            )
        objstore.runtime_started()
        key = (
            pid,
            self.container,
            self.prefix,
            self.account_name,
            self.endpoint_url,
            self.anonymous,
            self.allow_http,
            self._credentials,
        )
        with _stores_lock:
            store = _stores.get(key)
            if store is None:
                store = _stores[key] = self._build_store()
        self.__dict__["_store"] = (pid, store)
        return store

    def _build_store(self) -> Any:
        from obstore.store import AzureStore

        config: dict[str, Any] = {}
        if self.account_name:
            config["account_name"] = self.account_name
        if self.endpoint_url:
            config["endpoint"] = self.endpoint_url.rstrip("/")
        account_key, sas_token = self._credentials
        if account_key:
            config["account_key"] = account_key
        if sas_token:
            config["sas_key"] = sas_token.lstrip("?")
        if self.anonymous:
            config["skip_signature"] = True
        return AzureStore(
            self.container,
            prefix=self.prefix.rstrip("/") or None,
            config=config,  # type: ignore[arg-type]
            client_options={"allow_http": self.allow_http, "timeout": "60s"},
            # obstore retries 5xx, 429, timeouts and dropped connections itself (with backoff);
            # bounded, so that a dead endpoint fails in seconds, not minutes.
            retry_config={"max_retries": 4, "retry_timeout": dt.timedelta(seconds=30)},
        )

    # -- the protocol -----------------------------------------------------------------------------

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        import obstore

        if byte_range is None:
            return bytes(objstore.call("get", key, lambda: obstore.get(self.store, key).bytes()))
        start, end = byte_range
        if end <= start:
            if self.head(key) is None:
                raise ObjectNotFound(key)
            return b""
        try:
            data = objstore.call(
                "get", key, lambda: obstore.get_range(self.store, key, start=start, end=end)
            )
        except (ObjectNotFound, TransientStorageError):
            raise
        except StorageError:
            # Azure refuses a range that starts at or past the end (416): the protocol answers
            # with what there is, nothing.
            info = self.head(key)
            if info is None:
                raise ObjectNotFound(key) from None
            if start >= info.size:
                return b""
            raise
        return bytes(data)

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        import obstore

        mode: Literal["create", "overwrite"] = "create" if create_only else "overwrite"
        try:
            objstore.call(
                "put",
                key,
                lambda: obstore.put(
                    self.store, key, memoryview(data), mode=mode, use_multipart=False
                ),
            )
        except ObjectNotFound:  # a put finds no blob missing: the container is
            raise StorageError(
                f"Azure container {self.container!r} not found (writing {key})"
            ) from None

    def get_versioned(self, key: str) -> Versioned:
        import obstore

        def fetch() -> Versioned:
            got = obstore.get(self.store, key)  # one response: the bytes and their ETag
            data = bytes(got.bytes())
            return Versioned(data, objstore.version_of(got.meta["e_tag"], "get", key))

        return objstore.call("get", key, fetch)

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        import obstore

        mode = objstore.swap_mode(version)
        try:
            put = objstore.call(
                "put",
                key,
                lambda: obstore.put(
                    self.store, key, memoryview(data), mode=mode, use_multipart=False
                ),
            )
        except ObjectNotFound:
            if version is not None:  # If-Match on an absent blob: not at that version
                raise PreconditionFailed(key) from None
            raise StorageError(
                f"Azure container {self.container!r} not found (writing {key})"
            ) from None
        return objstore.version_of(put["e_tag"], "put", key)

    def head(self, key: str) -> ObjectInfo | None:
        import obstore

        try:
            meta = objstore.call("head", key, lambda: obstore.head(self.store, key))
        except ObjectNotFound:
            return None
        return ObjectInfo(key, int(meta["size"]), meta["last_modified"], meta.get("e_tag"))

    def get_if_unchanged(
        self,
        key: str,
        byte_range: tuple[int, int],
        *,
        etag: str | None = None,
        modified: dt.datetime | None = None,
    ) -> bytes:
        """As :meth:`Storage.get_if_unchanged`, in one conditional GET (``If-Match``,
        ``If-Unmodified-Since``: Azure keeps the time to the second, so pin by ETag)."""
        import obstore

        start, end = byte_range
        if end <= start:
            return super().get_if_unchanged(key, byte_range, etag=etag, modified=modified)
        options: dict[str, Any] = {"range": (start, end)}
        if etag is not None:
            options["if_match"] = etag
        if modified is not None:
            options["if_unmodified_since"] = modified
        return objstore.call(
            "get",
            key,
            lambda: bytes(obstore.get(self.store, key, options=options).bytes()),  # type: ignore[arg-type]
            past_end=b"",
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        import obstore

        # obstore lists by path segments; the protocol by string prefix: list the folder that
        # holds the prefix and keep what starts with it (Azure lists in key order).
        folder = prefix.rpartition("/")[0]
        stream = objstore.call(
            "list", prefix, lambda: obstore.list(self.store, prefix=folder or None, chunk_size=1000)
        )
        while True:
            try:
                batch = objstore.call("list", prefix, lambda: next(stream))
            except StopIteration:
                return
            except StorageError as e:
                # obstore reports a listing's 404 as a generic error: on a container listing it
                # can only mean the container is missing (a missing prefix lists nothing).
                if "status code: 404" in str(e):
                    raise ObjectNotFound(
                        f"{self.container} (Azure container not found, listing {prefix!r})"
                    ) from None
                raise
            for meta in batch:
                key = meta["path"]
                if key.startswith(prefix):
                    yield ObjectInfo(key, int(meta["size"]), meta["last_modified"])
                elif key > prefix:
                    return

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        import obstore

        folder = prefix.rstrip("/")
        found = objstore.call(
            "list", prefix, lambda: obstore.list_with_delimiter(self.store, prefix=folder or None)
        )
        start = len(folder) + 1 if folder else 0
        return [p[start:] for p in found["common_prefixes"]]

    def delete_many(self, keys: Iterable[str]) -> int:
        import obstore

        keys = builtins.list(keys)

        def delete(key: str) -> None:
            try:
                objstore.call("delete", key, lambda: obstore.delete(self.store, key))
            except ObjectNotFound:
                pass  # absent keys are fine

        self.map(delete, keys)
        return len(keys)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_store", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        _require_obstore()  # a worker that unpickles this storage may lack the extra
        super().__setstate__(state)

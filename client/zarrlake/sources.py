"""Virtual chunk sources: reading byte ranges of files that live outside the repository.

A virtual chunk ref (:data:`zarrlake.format.model.VIRTUAL`) names a URL, an offset and a length,
and what pins the version of the file it was made from (an ETag, a modification time). This
module decides whether a URL may be read at all (the repository's ``virtual_containers`` are an
allow-list: a repository must never make its reader fetch an arbitrary URL with the reader's
credentials), reaches it through zarrlake's own storage backends (one :class:`Storage` per
container, built on first use with the reader's credentials), and reads it so that a source that
changed or vanished raises :class:`VirtualSourceChanged` or :class:`VirtualSourceMissing`
instead of returning another version's bytes: one conditional request where the server has
them (``If-Match`` and ``If-Unmodified-Since`` on S3, Azure and HTTP servers that send a strong
``ETag``; the object generation on GCS), the descriptor's mtime on a local file. An HTTP server
that ignores the conditions is caught too: the answer's own ``ETag`` or ``Last-Modified`` must be
the pinned one.

Credentials come from the reader, never from the repository: ``virtual_credentials`` at open,
else ``$ZARRLAKE_VIRTUAL_CREDENTIALS`` (or the file ``$ZARRLAKE_VIRTUAL_CREDENTIALS_FILE`` names,
which is how a pod gets them from a Kubernetes Secret), else the provider's own chain.

Nothing here writes: sources are never created, rewritten or deleted by zarrlake.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from zarrlake.config import VirtualContainer
from zarrlake.errors import (
    InvalidArgument,
    ObjectNotFound,
    PreconditionFailed,
    VirtualContainerNotAllowed,
    VirtualSourceChanged,
    VirtualSourceMissing,
)
from zarrlake.format.model import VIRTUAL, ChunkRef, from_micros, to_micros, virtual_ref
from zarrlake.storage.base import Storage

__all__ = ["SourceInfo", "SourceRange", "VirtualRef", "VirtualSources"]

#: What ``virtual_credentials`` may give for an ``s3://`` container.
S3_CREDENTIALS = ("access_key_id", "secret_access_key", "session_token")
#: What ``virtual_credentials`` may give for a container, by its scheme. ``gs``: an OAuth
#: ``token``, or a service account's key as a file path or as the file's JSON text; ``az``: an
#: account key or a SAS token (and the account, if the container does not name it); ``http(s)``:
#: the ``Authorization`` header's value. ``file://`` takes none: the process's own access.
CREDENTIALS = {
    "s3": S3_CREDENTIALS,
    "gs": ("token", "service_account_file", "service_account_json"),
    "az": ("account_name", "account_key", "sas_token"),
    "http": ("authorization",),
    "https": ("authorization",),
    "file": (),
}
#: Where a reader's environment gives credentials, by container prefix, in this order (the first
#: that names a prefix wins; ``virtual_credentials`` given at open win over all): a JSON object
#: of the form of ``virtual_credentials``; the path of a file holding one; a JSON object of
#: directories by prefix, each holding one file per credential field, named as the field
#: (``access_key_id``, ...; other files are left alone): what a pod gets by mounting a
#: Kubernetes Secret, which is how the operator hands them over. Entries for prefixes a
#: repository does not have are left alone (one environment may serve several repositories).
CREDENTIALS_ENV = "ZARRLAKE_VIRTUAL_CREDENTIALS"
CREDENTIALS_FILE_ENV = "ZARRLAKE_VIRTUAL_CREDENTIALS_FILE"
CREDENTIALS_DIRS_ENV = "ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS"


@dataclass(frozen=True, slots=True)
class VirtualRef:
    """``length`` bytes at ``offset`` of the file at ``url``: one chunk's encoded bytes.

    ``etag`` and ``last_modified`` pin the file's version: when given, every read checks that
    the file still has them (:class:`VirtualSourceChanged` if not). A ref with neither reads
    whatever the file holds now. ``last_modified`` is a ``datetime`` (naive means UTC).
    Raises :class:`InvalidArgument` for a field of the wrong type or a negative range.
    """

    url: str
    offset: int
    length: int
    etag: str | None = field(default=None, kw_only=True)
    last_modified: dt.datetime | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise InvalidArgument(
                f"a VirtualRef's url must be a URL (s3://…, file://…): {self.url!r}"
            )
        for name in ("offset", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"a VirtualRef's {name} must be an int >= 0, not {value!r}")
        if self.etag is not None and (not isinstance(self.etag, str) or not self.etag):
            raise InvalidArgument(f"a VirtualRef's etag must be a non-empty str: {self.etag!r}")
        when = self.last_modified
        if when is not None:
            if not isinstance(when, dt.datetime):
                raise InvalidArgument(f"last_modified must be a datetime, not {when!r}")
            if when.tzinfo is None:
                object.__setattr__(self, "last_modified", when.replace(tzinfo=dt.UTC))

    def chunk_ref(self) -> ChunkRef:
        """The manifest's form of this ref."""
        when = self.last_modified
        return virtual_ref(
            self.url, self.offset, self.length, self.etag, None if when is None else to_micros(when)
        )

    @classmethod
    def from_chunk_ref(cls, ref: ChunkRef) -> VirtualRef:
        """The ref a manifest's virtual chunk ref stands for."""
        if ref[0] != VIRTUAL:
            raise InvalidArgument(f"not a virtual chunk ref: {ref!r}")
        modified = None if ref[5] is None else from_micros(ref[5])
        return cls(ref[1], ref[2], ref[3], etag=ref[4], last_modified=modified)


@dataclass(frozen=True, slots=True)
class SourceRange:
    """One ranged read of a source, ``[start, end)``, pinned as its refs are (all the refs one
    coalesced request serves pin the file alike)."""

    url: str
    start: int
    end: int
    etag: str | None
    modified_us: int | None


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """A source file as it is now: ``size`` in bytes, ``etag`` (None on a file system) and
    ``modified``, what pins a ref to this version."""

    size: int
    etag: str | None
    modified: dt.datetime


_ENCODED = ("file", "http", "https")


def check_credentials(container: VirtualContainer, given: object, where: str) -> None:
    """Raise :class:`InvalidArgument` unless ``given`` is credentials ``container`` takes (a
    mapping of its scheme's fields to strings)."""
    prefix, takes = container.url_prefix, CREDENTIALS[container.scheme]
    if not isinstance(given, Mapping):
        raise InvalidArgument(f"{where} for {prefix!r}: a mapping of fields, not {given!r}")
    if not takes:
        raise InvalidArgument(
            f"{where} for {prefix!r}: a {container.scheme}:// container takes no credentials"
        )
    unknown = sorted(str(k) for k in given if k not in takes)
    if unknown:
        raise InvalidArgument(
            f"{where} for {prefix!r}: unknown field(s) {', '.join(unknown)} "
            f"(a {container.scheme}:// container takes {', '.join(takes)})"
        )
    for name, value in given.items():
        if not isinstance(value, str):
            raise InvalidArgument(f"{where} for {prefix!r}: {name} must be a string")


def credentials_from_environment() -> dict[str, dict[str, str]]:
    """The credentials the environment gives (:data:`CREDENTIALS_ENV`,
    :data:`CREDENTIALS_FILE_ENV`, :data:`CREDENTIALS_DIRS_ENV`), by container prefix; empty
    when none is set. Raises :class:`InvalidArgument` for a value that is not what it should
    be, naming the variable (never the credentials)."""
    found: dict[str, dict[str, str]] = {}
    text = os.environ.get(CREDENTIALS_ENV)
    if text:
        _merge(found, _parse(text, f"${CREDENTIALS_ENV}"))
    path = os.environ.get(CREDENTIALS_FILE_ENV)
    if path:
        where = f"${CREDENTIALS_FILE_ENV} ({path})"
        _merge(found, _parse(_read(path, where), where))
    text = os.environ.get(CREDENTIALS_DIRS_ENV)
    if text:
        where = f"${CREDENTIALS_DIRS_ENV}"
        try:
            dirs = json.loads(text)
        except ValueError:
            dirs = None
        if not isinstance(dirs, dict) or not all(isinstance(d, str) for d in dirs.values()):
            raise InvalidArgument(f"{where} must be a JSON object of directories by prefix")
        for prefix, directory in dirs.items():
            if not os.path.isdir(directory):
                raise InvalidArgument(f"{where}: {directory} (for {prefix}) is not a directory")
            takes = CREDENTIALS.get(str(prefix).partition("://")[0], ())
            given = {}
            for name in takes:
                file = os.path.join(directory, name)
                if os.path.isfile(file):
                    # A Secret's value as kubectl writes it from a file may end with a newline;
                    # no credential ends or starts with white space.
                    given[name] = _read(file, f"{where} ({directory})").strip()
            found.setdefault(prefix, given)
    return found


def _read(path: str, where: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"{where}: cannot read it ({e.strerror})") from None


def _parse(text: str, where: str) -> dict[str, dict[str, str]]:
    try:
        found = json.loads(text)
    except ValueError:
        raise InvalidArgument(f"{where} is not JSON") from None
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise InvalidArgument(
            f"{where} must be a JSON object of credentials by container prefix "
            '({"s3://bucket/path/": {"access_key_id": ..., ...}, ...})'
        )
    return found


def _merge(into: dict[str, dict[str, str]], found: Mapping[str, dict[str, str]]) -> None:
    for prefix, given in found.items():
        into.setdefault(prefix, given)


def _json_object(text: str, prefix: str) -> dict[str, Any]:
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise InvalidArgument(
            f"virtual credentials for {prefix!r}: service_account_json is not a JSON object"
        )
    return found


def _bad_segments(path: str) -> bool:
    return any(seg in (".", "..") for seg in path.split("/")) or "\0" in path


class VirtualSources:
    """The virtual chunk containers of a repository, and this reader's way into each.

    ``credentials`` maps a container's ``url_prefix`` to what signs requests to it (the fields
    of :data:`CREDENTIALS` for its scheme); a container not named there or in
    ``$ZARRLAKE_VIRTUAL_CREDENTIALS`` (``_FILE``) reads with the provider's usual environment
    (the AWS chain, Google's application default credentials, the ``AZURE_*`` variables), or
    unsigned if it is ``anonymous``. A key that names no container raises
    :class:`InvalidArgument` (a typo must not silently read with other credentials), and so
    does a field the scheme does not take. Picklable: the credentials go along (those from the
    environment too: a worker's environment may lack them), as a :class:`Storage` carries
    those it was given.
    """

    def __init__(
        self,
        containers: Sequence[VirtualContainer],
        credentials: Mapping[str, Mapping[str, str]] | None = None,
        *,
        environment: bool = True,
    ) -> None:
        self.containers = tuple(containers)
        creds = dict(credentials or {})
        by_prefix = {c.url_prefix: c for c in self.containers}
        for prefix, given in creds.items():
            if prefix not in by_prefix:
                raise InvalidArgument(
                    f"virtual_credentials names {prefix!r}, which is none of the repository's "
                    f"virtual containers ({', '.join(sorted(by_prefix)) or 'it has none'})"
                )
            check_credentials(by_prefix[prefix], given, "virtual_credentials")
        self.credentials = {p: dict(c) for p, c in creds.items()}
        # Longest prefix first: a nested container wins over the one it lies in.
        self._ordered = sorted(self.containers, key=lambda c: len(c.url_prefix), reverse=True)
        self._storages: dict[str, Storage] = {}
        self._lock = threading.Lock()
        if environment and self.containers:
            self.supply(credentials_from_environment(), f"${CREDENTIALS_ENV}")

    def supply(
        self,
        credentials: Mapping[str, Mapping[str, str]] | None,
        where: str,
        *,
        override: bool = False,
    ) -> None:
        """Take ``credentials`` from a source that may name other repositories' containers too
        (the environment, a Kubernetes resource; ``where`` names it in errors): those of this
        repository's containers, each checked, unless it has some already (``override``: they
        replace them). The others are left alone."""
        by_prefix = {c.url_prefix: c for c in self.containers}
        for prefix, given in (credentials or {}).items():
            container = by_prefix.get(prefix)
            if container is None or (prefix in self.credentials and not override):
                continue
            check_credentials(container, given, where)
            with self._lock:
                self.credentials[prefix] = dict(given)
                self._storages.pop(prefix, None)  # built with the old ones

    def __getstate__(self) -> dict[str, Any]:
        return {"containers": self.containers, "credentials": self.credentials}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["containers"], state["credentials"], environment=False)  # type: ignore[misc]

    def __bool__(self) -> bool:
        return bool(self.containers)

    # -- the allow-list ------------------------------------------------------------------------

    def container_of(self, url: str) -> VirtualContainer:
        """The container ``url`` lies in. Raises :class:`VirtualContainerNotAllowed` for a URL
        in none of them, or one with ``.``/``..`` segments (which could leave a container on a
        server or file system that resolves them)."""
        if isinstance(url, str) and not _bad_segments(url.partition("://")[2]):
            decoded = unquote(url) if url.startswith("file://") else url
            if not _bad_segments(decoded.partition("://")[2]):
                for container in self._ordered:
                    prefix = container.url_prefix
                    if url.startswith(prefix) and len(url) > len(prefix):  # a file below it
                        return container
        allowed = (
            ", ".join(c.url_prefix for c in self.containers)
            or "none: the repository has no virtual_containers"
        )
        raise VirtualContainerNotAllowed(
            str(url), f"the URL is in none of the repository's virtual containers ({allowed})"
        )

    # -- reads ---------------------------------------------------------------------------------

    def _locate(self, url: str) -> tuple[Storage, str]:
        """The storage of ``url``'s container and the key of ``url`` in it."""
        container = self.container_of(url)
        prefix = container.url_prefix
        with self._lock:
            storage = self._storages.get(prefix)
            if storage is None:
                storage = self._storages[prefix] = self._storage(container)
        key = url[len(prefix) :]
        # A file's name and an HTTP path are percent-encoded in a URL; object keys are not.
        return storage, unquote(key) if container.scheme in _ENCODED else key

    def _storage(self, container: VirtualContainer) -> Storage:
        prefix, scheme = container.url_prefix, container.scheme
        creds = self.credentials.get(prefix, {})
        if scheme == "file":
            return Storage.local(unquote(prefix[len("file://") :]))
        if scheme in ("http", "https"):
            auth = creds.get("authorization")
            return Storage.http(prefix, headers=None if auth is None else {"Authorization": auth})
        bucket, _, path = prefix.partition("://")[2].partition("/")
        endpoint = container.endpoint_url
        allow_http = bool(endpoint and endpoint.startswith("http://"))
        if scheme == "gs":
            key_json = creds.get("service_account_json")
            return Storage.gcs(
                bucket,
                path,
                endpoint_url=endpoint,
                token=creds.get("token"),
                service_account_file=creds.get("service_account_file"),
                service_account_info=None if key_json is None else _json_object(key_json, prefix),
                anonymous=container.anonymous,
                allow_http=allow_http,
            )
        if scheme == "az":
            return Storage.azure(
                bucket,
                path,
                account_name=creds.get("account_name") or container.account_name,
                account_key=creds.get("account_key"),
                sas_token=creds.get("sas_token"),
                endpoint_url=endpoint,
                anonymous=container.anonymous,
                allow_http=allow_http,
            )
        return Storage.s3(
            bucket,
            path,
            endpoint_url=endpoint,
            region=container.region,
            access_key_id=creds.get("access_key_id"),
            secret_access_key=creds.get("secret_access_key"),
            session_token=creds.get("session_token"),
            allow_http=allow_http,
            anonymous=container.anonymous,
        )

    def read(self, ref: ChunkRef, byte_range: tuple[int, int] | None = None) -> bytes:
        """The bytes of virtual chunk ``ref`` (or ``[start, end)`` of them, relative to the
        chunk). Raises :class:`VirtualContainerNotAllowed`, :class:`VirtualSourceChanged`,
        :class:`VirtualSourceMissing`."""
        _, url, offset, length, etag, modified = ref
        start, end = (0, length) if byte_range is None else byte_range
        end = min(end, length)
        if end <= start:
            return b""
        return self.read_range(SourceRange(url, offset + start, offset + end, etag, modified))

    def read_range(self, what: SourceRange) -> bytes:
        """Bytes ``[start, end)`` of the source, checked against its pins; raises as
        :meth:`read`. A source that ends before ``end`` has changed (it was truncated or
        replaced): the refs name bytes it no longer has."""
        storage, key = self._locate(what.url)
        modified = None if what.modified_us is None else from_micros(what.modified_us)
        try:
            data = storage.get_if_unchanged(
                key, (what.start, what.end), etag=what.etag, modified=modified
            )
        except ObjectNotFound:
            raise VirtualSourceMissing(what.url, "the file does not exist") from None
        except PreconditionFailed:
            # Some servers refuse a condition on an object that is gone (412, as HTTP allows)
            # rather than answer 404: which it is costs a HEAD, on this error path only.
            if storage.head(key) is None:
                raise VirtualSourceMissing(what.url, "the file does not exist") from None
            pins = []
            if what.etag is not None:
                pins.append(f"ETag {what.etag}")
            if modified is not None:
                pins.append(f"last modified {modified.isoformat()}")
            raise VirtualSourceChanged(
                what.url,
                f"the file is not the version the ref was made from ({' and '.join(pins)}); "
                "make the refs again from the file as it is now",
            ) from None
        if len(data) != what.end - what.start:
            raise VirtualSourceChanged(
                what.url, f"the file ends before byte {what.end}, which a ref names"
            )
        return data

    def stat(self, url: str) -> SourceInfo:
        """What the source ``url`` is now: its size and what pins a ref made from it (ETag or
        None, modification time). Raises :class:`VirtualContainerNotAllowed`,
        :class:`VirtualSourceMissing`."""
        storage, key = self._locate(url)
        info = storage.head(key)
        if info is None:
            raise VirtualSourceMissing(url, "the file does not exist")
        return SourceInfo(info.size, info.etag, info.modified)

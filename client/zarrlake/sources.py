"""Virtual chunk sources: reading byte ranges of files that live outside the repository.

A virtual chunk ref (:data:`zarrlake.format.model.VIRTUAL`) names a URL, an offset and a length,
and what pins the version of the file it was made from (an ETag, a modification time). This
module decides whether a URL may be read at all (the repository's ``virtual_containers`` are an
allow-list: a repository must never make its reader fetch an arbitrary URL with the reader's
credentials), reaches it through zarrlake's own storage backends (one :class:`Storage` per
container, built on first use with the reader's credentials), and reads it so that a source that
changed or vanished raises :class:`VirtualSourceChanged` or :class:`VirtualSourceMissing`
instead of returning another version's bytes: one conditional request on S3 (``If-Match``,
``If-Unmodified-Since``), the descriptor's mtime on a local file.

Nothing here writes: sources are never created, rewritten or deleted by zarrlake.
"""

from __future__ import annotations

import datetime as dt
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


def _bad_segments(path: str) -> bool:
    return any(seg in (".", "..") for seg in path.split("/")) or "\0" in path


class VirtualSources:
    """The virtual chunk containers of a repository, and this reader's way into each.

    ``credentials`` maps a container's ``url_prefix`` to what signs requests to it (for
    ``s3://``: ``access_key_id``, ``secret_access_key``, ``session_token``); a container not
    named reads with the provider's usual environment (the AWS chain), or unsigned if it is
    ``anonymous``. A key that names no container raises :class:`InvalidArgument` (a typo must
    not silently read with other credentials). Picklable: the credentials go along, as a
    :class:`Storage` carries those it was given.
    """

    def __init__(
        self,
        containers: Sequence[VirtualContainer],
        credentials: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.containers = tuple(containers)
        creds = dict(credentials or {})
        prefixes = {c.url_prefix for c in self.containers}
        for prefix, given in creds.items():
            if prefix not in prefixes:
                raise InvalidArgument(
                    f"virtual_credentials names {prefix!r}, which is none of the repository's "
                    f"virtual containers ({', '.join(sorted(prefixes)) or 'it has none'})"
                )
            unknown = sorted(set(given) - set(S3_CREDENTIALS))
            if unknown or not prefix.startswith("s3://"):
                raise InvalidArgument(
                    f"virtual_credentials for {prefix!r}: "
                    + (
                        f"unknown field(s) {', '.join(unknown)} (takes {', '.join(S3_CREDENTIALS)})"
                        if unknown
                        else "only s3:// containers take credentials"
                    )
                )
        self.credentials = {p: dict(c) for p, c in creds.items()}
        # Longest prefix first: a nested container wins over the one it lies in.
        self._ordered = sorted(self.containers, key=lambda c: len(c.url_prefix), reverse=True)
        self._storages: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"containers": self.containers, "credentials": self.credentials}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["containers"], state["credentials"])  # type: ignore[misc]

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
        return storage, unquote(key) if prefix.startswith("file://") else key

    def _storage(self, container: VirtualContainer) -> Storage:
        prefix = container.url_prefix
        if prefix.startswith("file://"):
            return Storage.local(unquote(prefix[len("file://") :]))
        bucket, _, path = prefix[len("s3://") :].partition("/")
        creds = self.credentials.get(prefix, {})
        endpoint = container.endpoint_url
        return Storage.s3(
            bucket,
            path,
            endpoint_url=endpoint,
            region=container.region,
            access_key_id=creds.get("access_key_id"),
            secret_access_key=creds.get("secret_access_key"),
            session_token=creds.get("session_token"),
            allow_http=bool(endpoint and endpoint.startswith("http://")),
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

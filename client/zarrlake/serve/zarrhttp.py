"""``GET|HEAD /zarr/<ref>/<key>``: any version of the repository as a plain, read-only Zarr v3 store
over HTTP, for readers that have neither zarrlake nor the bucket's credentials (zarr-python's
``FsspecStore``, ``xarray.open_zarr("http://host/zarr/v1")``, a browser, ``curl``).

What a key holds is what the session's store (:attr:`zarrlake.Session.store`) gives for it, byte
for byte, with one addition: a group's ``zarr.json`` carries the Zarr v3
``consolidated_metadata`` of everything below it, built from the snapshot's tree (zarrlake holds
every node's document in the snapshot already). HTTP cannot list a directory, so a reader opens
the whole hierarchy from that one document, as ``zarr.open_group(..., use_consolidated=True)``
and ``xarray.open_zarr(..., consolidated=True)`` do; a stored ``consolidated_metadata`` (stale,
perhaps) is replaced by the current one. For readers that list all the same, a directory URL
(ending in ``/``) answers an HTML page of links that fsspec's ``HTTPFileSystem`` reads as a
listing, and a node's directory without the ``/`` redirects there.

Caching. A tag or snapshot id names one snapshot forever: its URLs carry a strong ``ETag`` (the
snapshot id and a digest of the key) and ``Cache-Control: public, max-age=31536000,
immutable`` (``private`` behind a token). A branch is resolved at every request
(``Cache-Control: no-cache``; its ``ETag`` is that of the head's snapshot URL, so a revalidation
is a 304 until the branch moves). ``If-None-Match`` is a 304 for a key that exists and matches
(``*`` matches any that exists; an absent key is a 404 whatever it says). A reader that must not
see a branch move halfway through its reads asks ``/zarr/<branch>@now/`` once and reads on from
the URL it redirects to, ``/zarr/<snapshot id>/`` (every ``@now`` request resolves the branch
afresh: a reader that kept the ``@now`` URL as its base would not be pinned).

``Range: bytes=a-b``, ``bytes=a-`` and ``bytes=-n`` are answered 206 (one range; a request for
several, or in a unit other than bytes, is answered whole, as HTTP allows and requires), a range
past the end 416, a malformed one 400. A
key larger than :attr:`Limits.max_response_bytes` is a 413 unless asked for by ranges within
the limit: a chunk that large is not read into the server's memory at once.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import default_buffer_prototype

from zarrlake.format.model import ChunkRef, ref_size
from zarrlake.nodes import is_meta_key
from zarrlake.serve.errors import BadRequest, HTTPError, NotFound, http_error, log_line
from zarrlake.serve.model import node_docs
from zarrlake.serve.security import PrefixRoute, path_below, split_path
from zarrlake.types import node_path

if TYPE_CHECKING:
    from zarrlake.serve.context import ServeContext
    from zarrlake.session import Session

__all__ = ["ZarrStore", "consolidated_group_document"]

#: The suffix of a ref that redirects to the snapshot it names now.
NOW = "@now"
_RANGE = re.compile(r"([0-9]*)-([0-9]*)")
#: Digits of a range position read at most: a longer one is past any key's end.
_RANGE_DIGITS = 18
_CONSOLIDATED_EMPTY = {"kind": "inline", "must_understand": False, "metadata": {}}


class ZarrStore:
    """The ``/zarr/`` routes of one server."""

    #: Group documents with consolidated metadata kept, by (snapshot id, key).
    DOCUMENTS = 128

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx
        self._documents: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._mutex = threading.Lock()

    def routes(self) -> list[BaseRoute]:
        return [PrefixRoute("/zarr/", self.serve)]

    async def serve(self, request: Request) -> Response:
        """One request: never raises (every failure is a one-line response)."""
        try:
            return await self._serve(request)
        except Exception as e:
            status, reason = http_error(e)
            if status >= 500:
                log_line(e, f"{request.method} {request.url.path}")
            headers = {"cache-control": "no-store", **getattr(e, "headers", {})}
            return Response(reason + "\n", status, headers=headers, media_type="text/plain")

    async def _serve(self, request: Request) -> Response:
        rest = path_below(request.scope, "/zarr/")
        path = split_path(rest, max_length=self.ctx.limits.max_key_length, slash_in_first=True)
        if not path.segments:
            raise NotFound("give a ref: /zarr/<branch, tag or snapshot id>/<key>")
        ref, segments = path.segments[0], path.segments[1:]
        key = "/".join(segments)
        if ref.endswith(NOW) and len(ref) > len(NOW):
            sid, _ = await self.ctx.run(self.ctx.resolve, ref[: -len(NOW)])
            tail = rest.partition("/")[2]
            location = request.scope.get("root_path", "") + f"/zarr/{sid}/{tail}"
            return Response(
                status_code=307, headers={"location": location, "cache-control": "no-store"}
            )
        version = await self._version(ref)
        if path.directory or not segments:
            if not path.directory:  # /zarr/<ref>: the root directory is /zarr/<ref>/
                return _redirect(request, rest + "/")
            return await self._listing(request, version, key)
        return await self._key(request, version, key, rest)

    async def _version(self, ref: str) -> Version:
        ctx = self.ctx
        cached = ctx.cached_resolution(ref)
        if cached is not None:
            sid, immutable = cached, True
        else:
            sid, immutable = await ctx.run(ctx.resolve, ref)
        session = ctx.cached_session(sid)
        if session is None:
            session = await ctx.run(ctx.session, sid)
        return Version(sid, session, ctx.immutable if immutable else "no-cache")

    async def _key(self, request: Request, version: Version, key: str, rest: str) -> Response:
        etag = version.etag(key)
        headers = {"etag": etag, "cache-control": version.cache_control, "accept-ranges": "bytes"}
        document = None
        if is_meta_key(key):
            document = await self._document(version, key)
            size = None if document is None else len(document)
        else:
            size = await self._chunk_size(version.session, key)
        if size is None:
            if await self._is_node(version.session, key):
                return _redirect(request, rest + "/")
            raise NotFound(f"no key {key!r} in this version")
        if _not_modified(request.headers.get("if-none-match"), etag):
            return Response(status_code=304, headers=headers)
        wanted = _byte_range(request, etag, size)
        start, end = (0, size) if wanted is None else wanted
        if end - start > self.ctx.limits.max_response_bytes:
            raise HTTPError(
                f"{key!r} is {size} bytes, over this server's response limit of "
                f"{self.ctx.limits.max_response_bytes}; ask for byte ranges",
                413,
            )
        media = "application/json" if document is not None else "application/octet-stream"
        headers["content-type"] = media
        headers["content-length"] = str(end - start)
        status = 200
        if wanted is not None:
            status = 206
            headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        if request.method == "HEAD":
            return Response(b"", status, headers=headers)
        if document is not None:
            body: bytes | memoryview = document[start:end]
        else:
            body = await self._read(version.session, key, wanted)
            if len(body) != end - start:  # the key changed size between lookup and read
                raise HTTPError("the key could not be read consistently, try again", 503)
        return Response(body, status, headers=headers)

    async def _resolve(self, session: Session, key: str) -> bytes | ChunkRef | None:
        """What ``key`` holds (a metadata document, or a chunk's ref): on the event loop when
        that needs no I/O (every lookup after the first few of a manifest shard)."""
        found, value = session.resolve_cached(key)
        if not found:
            value = await self.ctx.run(session.resolve, key)
        return value

    async def _chunk_size(self, session: Session, key: str) -> int | None:
        value = await self._resolve(session, key)
        if value is None:
            return None
        return len(value) if isinstance(value, bytes) else ref_size(value)

    async def _read(self, session: Session, key: str, wanted: tuple[int, int] | None) -> memoryview:
        byte_range = None if wanted is None else RangeByteRequest(*wanted)
        buf = await session.store.get(key, default_buffer_prototype(), byte_range)
        if buf is None:
            raise NotFound(f"no key {key!r} in this version")
        return memoryview(buf.as_buffer_like()).cast("B")

    async def _is_node(self, session: Session, key: str) -> bool:
        """Whether ``key`` is the directory of a group or array (it has a metadata document)."""
        for name in ("zarr.json", ".zgroup", ".zarray"):
            if await self._resolve(session, f"{key}/{name}") is not None:
                return True
        return False

    async def _document(self, version: Version, key: str) -> bytes | None:
        """The metadata document at ``key``: as stored, or for a Zarr v3 group with its
        consolidated metadata (built once per snapshot and key)."""
        session = version.session
        value = await self._resolve(session, key)
        if not isinstance(value, bytes):
            return None
        if key.rpartition("/")[2] != "zarr.json" or not _is_group(value):
            return value
        with self._mutex:
            cached = self._documents.get((version.snapshot, key))
        if cached is not None:
            return cached
        snapshot = await self.ctx.run(session.objects.snapshot, session.base)
        document = await self.ctx.run(consolidated_group_document, snapshot.nodes, key)
        if document is None:
            return value
        with self._mutex:
            self._documents[(version.snapshot, key)] = document
            while len(self._documents) > self.DOCUMENTS:
                self._documents.popitem(last=False)
        return document

    async def _listing(self, request: Request, version: Version, key: str) -> Response:
        names = await self.ctx.run(version.session.list_dir, key)
        if not names and key:
            raise NotFound(f"no directory {key!r} in this version")
        title = html.escape(f"/{key}")
        # No trailing "/" on directories: fsspec then hands zarr the bare names it lists.
        items = "".join(
            f'<li><a href="{html.escape(quote(name))}">{html.escape(name)}</a></li>\n'
            for name in names
        )
        page = f"<!doctype html>\n<title>{title}</title>\n<ul>\n{items}</ul>\n".encode()
        if len(page) > self.ctx.limits.max_response_bytes:
            raise HTTPError(f"the listing of {key!r} is over this server's response limit", 413)
        headers = {"cache-control": version.cache_control, "etag": version.etag(key + "/")}
        return Response(page, headers=headers, media_type="text/html")


@dataclass(frozen=True)
class Version:
    """The snapshot a request reads, and how its answers may be cached (``cache_control``)."""

    snapshot: str
    session: Session
    cache_control: str

    def etag(self, key: str) -> str:
        # Per snapshot and key: the same for a branch URL and the head's snapshot URL.
        digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        return f'"{self.snapshot}-{digest}"'


def consolidated_group_document(nodes: dict[str, bytes], key: str) -> bytes | None:
    """The Zarr v3 group document at ``key`` (``"zarr.json"``, ``"a/zarr.json"``) of a
    snapshot's metadata documents ``nodes``, with the ``consolidated_metadata`` zarr-python
    writes (``zarr.consolidate_metadata``): every node below, by its path relative to the
    group, each group among them with an empty one of its own. Nodes below a directory that has
    no group document (an implicit group) are left out: Zarr v3 cannot describe them there.
    None if ``key`` is no v3 group document."""
    docs = node_docs(nodes)
    group = node_path(key.rpartition("/")[0])
    doc = docs.get(group)
    if doc is None or doc.get("node_type") != "group":
        return None
    below = "" if group == "/" else group
    flat: dict[str, Any] = {}
    for path in sorted(docs, key=lambda p: (p.count("/"), p)):
        if not path.startswith(below + "/") or path == group:
            continue
        rel = path[len(below) + 1 :]
        parent = rel.rpartition("/")[0]
        if parent and flat.get(parent, {}).get("node_type") != "group":
            continue  # below an implicit group, or below an array
        child = dict(docs[path])
        if child.get("node_type") == "group":
            child["consolidated_metadata"] = dict(_CONSOLIDATED_EMPTY)
        flat[rel] = child
    out = dict(doc)
    out["consolidated_metadata"] = {**_CONSOLIDATED_EMPTY, "metadata": flat}
    return json.dumps(out, indent=2, allow_nan=True).encode()


def _is_group(document: bytes) -> bool:
    try:
        doc = json.loads(document)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("node_type") == "group"


def _redirect(request: Request, rest: str) -> Response:
    location = request.scope.get("root_path", "") + "/zarr/" + rest
    return Response(status_code=307, headers={"location": location, "cache-control": "no-store"})


def _not_modified(header: str | None, etag: str) -> bool:
    """Whether ``If-None-Match: header`` matches ``etag`` (weak comparison, as RFC 9110 says)."""
    if not header:
        return False
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def _byte_range(request: Request, etag: str, size: int) -> tuple[int, int] | None:
    """The ``(start, end)`` (end exclusive) the ``Range`` header asks for, or None for all.

    Raises :class:`BadRequest` for a malformed header, ``HTTPError(416)`` for a range that
    starts past the end (or an empty suffix)."""
    header = request.headers.get("range")
    if header is None:
        return None
    if_range = request.headers.get("if-range")
    if if_range is not None and if_range.strip() != etag:
        return None  # the client's copy is of another version: send it all
    unit, equals, spec = header.replace(" ", "").partition("=")
    if equals and unit.lower() != "bytes":
        return None  # a unit this server does not know: ignored, as HTTP requires
    if "," in spec:
        return None  # several ranges: answered whole
    m = _RANGE.fullmatch(spec) if equals else None
    if m is None or (not m[1] and not m[2]):
        raise BadRequest(f"bad Range header {header[:60]!r} (bytes=a-b, bytes=a- or bytes=-n)")
    if not m[1]:  # the last n bytes
        n = _position(m[2])
        if n == 0 or size == 0:
            raise _unsatisfiable(size)
        return max(0, size - n), size
    start = _position(m[1])
    end = size if not m[2] else _position(m[2]) + 1
    if m[2] and end <= start:
        raise BadRequest(f"bad Range header {header[:60]!r} (the end is before the start)")
    if start >= size:
        raise _unsatisfiable(size)
    return start, min(end, size)


def _position(digits: str) -> int:
    """A position of a ``Range`` header: one too long to be a key's is as good as infinite
    (``int`` would refuse 4,300 digits or more)."""
    return int(digits) if len(digits) <= _RANGE_DIGITS else 10**_RANGE_DIGITS


def _unsatisfiable(size: int) -> HTTPError:
    error = HTTPError(f"range not satisfiable: the key is {size} bytes", 416)
    error.headers = {"content-range": f"bytes */{size}"}
    return error

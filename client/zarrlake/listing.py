"""What a repository holds, as plain records for people and programs: its groups and arrays
(``zarrlake ls``) and its commits (``zarrlake log``).

Records are read from the Zarr metadata documents themselves (v3 ``zarr.json``, or v2
``.zarray``/``.zgroup``/``.zattrs``), so listing needs no array to be opened and works on arrays
whose codecs are not installed. Their ``to_json`` forms are the CLI's stable ``--json`` output.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zarrlake.errors import CorruptObject, ZarrlakeError
from zarrlake.types import CommitInfo, node_path

if TYPE_CHECKING:
    from zarr.abc.store import Store

    from zarrlake.repository import Repository

# Metadata documents: never nodes themselves, and what a node is read from.
_V3 = "zarr.json"
_V2 = (".zarray", ".zgroup", ".zattrs")
_METADATA = {_V3, *_V2, ".zmetadata"}


def tree_key(path: str) -> tuple[str, ...]:
    """Sort key for node paths in tree order: a node's descendants follow it directly
    (``/a``, ``/a/b``, ``/a-c``), which plain string order does not do (``-`` < ``/``)."""
    return tuple(path.strip("/").split("/")) if path != "/" else ()


# -- nodes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeListing:
    """A group or array as its Zarr metadata describes it.

    ``path`` starts with ``/`` (the root group is ``/``); ``type`` is ``"group"`` or ``"array"``.
    For arrays, ``shape``, ``dtype`` (the metadata's data type: a name, or a JSON object for
    extension types), ``chunks`` (the chunk shape: the inner chunks of a sharded array) and
    ``shards`` (the shard shape, None when not sharded); for groups they are None.
    """

    path: str
    type: str
    attributes: dict[str, Any]
    shape: list[int] | None = None
    dtype: Any = None
    chunks: list[int] | None = None
    shards: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        """``{"path", "type", ["shape", "dtype", "chunks", "shards",] "attributes"}`` in that
        order; the array keys only for arrays."""
        doc: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.type == "array":
            doc |= {"shape": self.shape, "dtype": self.dtype, "chunks": self.chunks}
            doc["shards"] = self.shards
        doc["attributes"] = self.attributes
        return doc


def list_nodes(repo: Repository, ref: str, path: str = "/") -> list[NodeListing]:
    """The groups and arrays at and below ``path`` in ``ref`` (a branch, tag or snapshot id), in
    tree order (:func:`tree_key`). Nothing below an array is listed (only chunks live there);
    directories without metadata (implicit groups) are searched but not listed.

    Raises :class:`~zarrlake.RefNotFound` for an unknown ref, :class:`~zarrlake.ZarrlakeError`
    when nothing exists at a ``path`` other than the root (an empty repository lists nothing),
    and :class:`~zarrlake.CorruptObject` for a metadata document that does not parse.
    """
    path = node_path(path)
    store = repo.readonly_session(ref).store
    found: list[NodeListing] = []
    asyncio.run(_walk(store, path, found))
    if not found and path != "/":
        raise ZarrlakeError(f"no group or array at {path!r} in {ref!r}")
    return sorted(found, key=lambda n: tree_key(n.path))


async def _walk(store: Store, path: str, found: list[NodeListing]) -> None:
    node = await _node_at(store, path)
    if node is not None:
        found.append(node)
        if node.type == "array":
            return
    prefix = path.strip("/")
    names = [n async for n in store.list_dir(prefix)]
    children = [node_path(f"{prefix}/{n}") for n in names if n not in _METADATA]
    await asyncio.gather(*(_walk(store, child, found) for child in children))


async def _node_at(store: Store, path: str) -> NodeListing | None:
    """The node whose metadata lives at ``path`` (Zarr v3, or v2), or None."""
    prefix = path.strip("/")
    keys = [f"{prefix}/{n}" if prefix else n for n in (_V3, *_V2)]
    v3, zarray, zgroup, zattrs = await asyncio.gather(*(_read_doc(store, k) for k in keys))
    if v3 is not None:
        return _v3_node(path, keys[0], v3)
    attrs = zattrs or {}
    if zarray is not None:
        return NodeListing(
            path,
            "array",
            attrs,
            shape=list(zarray.get("shape") or []),
            dtype=zarray.get("dtype"),
            chunks=list(zarray.get("chunks") or []),
        )
    if zgroup is not None:
        return NodeListing(path, "group", attrs)
    return None


def _v3_node(path: str, key: str, doc: dict[str, Any]) -> NodeListing:
    attrs = doc.get("attributes") or {}
    kind = doc.get("node_type")
    if kind == "group":
        return NodeListing(path, "group", attrs)
    if kind != "array":
        raise CorruptObject(key, f"unknown node_type {kind!r}")
    grid = doc.get("chunk_grid") or {}
    chunks = (
        (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid, dict) else None
    )
    shards = None
    for codec in doc.get("codecs") or []:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            # The grid's chunks are shards; the chunks proper are the sharding codec's.
            shards, chunks = chunks, (codec.get("configuration") or {}).get("chunk_shape")
            break
    return NodeListing(
        path,
        "array",
        attrs,
        shape=list(doc.get("shape") or []),
        dtype=doc.get("data_type"),
        chunks=None if chunks is None else list(chunks),
        shards=None if shards is None else list(shards),
    )


async def _read_doc(store: Store, key: str) -> dict[str, Any] | None:
    from zarr.core.buffer import default_buffer_prototype

    buf = await store.get(key, prototype=default_buffer_prototype())
    if buf is None:
        return None
    try:
        doc = json.loads(buf.to_bytes())
    except (ValueError, UnicodeDecodeError):
        raise CorruptObject(key, "not a JSON document") from None
    if not isinstance(doc, dict):
        raise CorruptObject(key, "not a JSON object")
    return doc


# -- commits -------------------------------------------------------------------------------------


def commit_to_json(info: CommitInfo) -> dict[str, Any]:
    """A commit as ``{"id", "parents", "message", "author", "time", "metadata"}`` (in that
    order): ``parents`` a list of snapshot ids, ``author`` None when unknown, ``time`` ISO 8601
    in UTC with microseconds (``2024-05-01T12:00:00.123456+00:00``), ``metadata`` as committed."""
    return {
        "id": info.id,
        "parents": list(info.parents),
        "message": info.message,
        "author": info.author,
        "time": info.time.astimezone(dt.UTC).isoformat(timespec="microseconds"),
        "metadata": info.metadata,
    }


def json_default(value: Any) -> Any:
    """What ``json.dumps(..., default=json_default)`` writes for a value JSON has no form of:
    times as ISO 8601, bytes as base64, sets and tuples as lists, anything else as its string.
    Commit metadata is user data: a document that holds it stays valid whatever it holds (the
    CLI's ``--json``, the server's JSON API)."""
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)

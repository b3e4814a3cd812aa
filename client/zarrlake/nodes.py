"""How Zarr lays keys out: which keys are node metadata, which are chunks, and of which array.

zarrlake stores Zarr metadata documents inside the snapshot and every other key in the chunk
manifest. These helpers read key names and metadata documents only; they do not import Zarr.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from zarrlake.types import node_path

META_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


def is_meta_key(key: str) -> bool:
    return key.rpartition("/")[2] in META_NAMES


def meta_key_node(key: str) -> str:
    """The node path a metadata key describes: 'a/b/zarr.json' -> '/a/b'."""
    return node_path(key.rpartition("/")[0])


def _doc(data: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def array_paths(nodes: Mapping[str, bytes]) -> set[str]:
    """Node paths of arrays among metadata documents."""
    out = set()
    for key, data in nodes.items():
        name = key.rpartition("/")[2]
        if name == ".zarray":
            out.add(meta_key_node(key))
        elif name == "zarr.json":
            doc = _doc(data)
            if doc is not None and doc.get("node_type") == "array":
                out.add(meta_key_node(key))
    return out


def node_paths(meta_keys: Iterable[str]) -> set[str]:
    return {
        meta_key_node(k)
        for k in meta_keys
        if k.rpartition("/")[2] in ("zarr.json", ".zarray", ".zgroup")
    }


def _coords(suffix: str) -> tuple[Any, ...]:
    if suffix == "c":
        return ()
    if suffix.startswith("c/"):
        parts = suffix[2:].split("/")
    elif suffix.startswith("c."):
        parts = suffix[2:].split(".")
    else:
        parts = suffix.replace("/", ".").split(".")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        return tuple(parts)


def split_chunk_key(key: str, arrays: set[str]) -> tuple[str, tuple[Any, ...]]:
    """('a/b/c/0/1', {'/a/b'}) -> ('/a/b', (0, 1)). Keys outside known arrays are split at '/c/'."""
    parent = key
    while parent:
        parent = parent.rpartition("/")[0]
        if node_path(parent) in arrays:
            suffix = key[len(parent) + 1 :] if parent else key
            return node_path(parent), _coords(suffix)
    head, sep, tail = key.rpartition("/c/")
    if sep:
        return node_path(head), _coords("c/" + tail)
    if key.startswith("c/") or key == "c":
        return "/", _coords(key)
    head, _, tail = key.rpartition("/")
    return node_path(head), _coords(tail)


def grid_signature(data: bytes | None) -> Any:
    """What must not change under concurrent chunk writes: shape, chunk grid, dtype, codecs."""
    if data is None:
        return None
    doc = _doc(data)
    if doc is None:
        return data
    keys = ("shape", "chunk_grid", "chunks", "data_type", "dtype", "codecs", "chunk_key_encoding")
    return json.dumps({k: doc.get(k) for k in keys}, sort_keys=True)

"""What the JSON API and the web pages show, as plain JSON-able dicts: refs, history, one commit,
a comparison of two versions, the tree of a version.

Pure reads of a :class:`~zarrlake.Repository`, blocking (routes call them through
:meth:`~zarrlake.serve.context.ServeContext.run`), shared by :mod:`zarrlake.serve.api` and the
pages so that a page and the API never disagree. They raise zarrlake's errors
(:class:`~zarrlake.RefNotFound`, :class:`~zarrlake.AmbiguousRef`) and this package's
:class:`~zarrlake.serve.errors.BadRequest` / :class:`~zarrlake.serve.errors.NotFound`;
:func:`zarrlake.serve.errors.http_error` turns each into a status.

Node paths are zarrlake's: they start with ``/`` and the root group is ``/`` (as in
:class:`zarrlake.Diff` and ``zarrlake ls --json``); arguments accept them with or without the
leading ``/``. Times are ISO 8601 in UTC with microseconds.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from zarrlake.format.ids import is_snapshot_id
from zarrlake.format.model import Snapshot
from zarrlake.history import commit_info
from zarrlake.listing import commit_to_json, tree_key
from zarrlake.nodes import array_paths, meta_key_node
from zarrlake.repository import Repository
from zarrlake.serve.errors import BadRequest, NotFound
from zarrlake.types import CommitInfo, node_path

__all__ = [
    "SHORT_ID",
    "commit",
    "commit_json",
    "compare",
    "compare_refs",
    "log_page",
    "node_docs",
    "overview",
    "tree",
]

#: Characters of a snapshot id shown as its short form. Ids start with their time in
#: milliseconds (10 characters); two more random ones tell apart commits of one millisecond.
SHORT_ID = 12

#: Default commits per log page.
LOG_PAGE = 50


def commit_json(info: CommitInfo) -> dict[str, Any]:
    """``{"id", "short", "parents", "message", "author", "time", "metadata"}`` of a commit."""
    doc = commit_to_json(info)
    return {"id": doc["id"], "short": info.id[:SHORT_ID], **{k: doc[k] for k in list(doc)[1:]}}


def _snapshot(repo: Repository, snapshot_id: str) -> Snapshot:
    return repo.core.objects.snapshot(snapshot_id)


def _info(repo: Repository, snapshot_id: str) -> CommitInfo:
    # The snapshot itself (cached once read), not log(): that reads the published root first.
    return commit_info(_snapshot(repo, snapshot_id))


def _time(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat(timespec="microseconds")


# -- refs and history ----------------------------------------------------------------------------


def overview(repo: Repository) -> dict[str, Any]:
    """The repository's id, its branches (each with its head commit's short id, time, author and
    first message line) and tags (with their snapshot's time), sorted by name."""
    refs = repo.refs()
    heads = {**refs.branches, **refs.tags}
    ids = sorted(set(heads.values()))
    # One read per head not cached yet, concurrently (S3: a round trip for all of them).
    infos = dict(zip(ids, repo.storage.map(lambda sid: _info(repo, sid), ids), strict=True))
    branches = []
    for name, head in refs.branches.items():
        info = infos[head]
        branches.append(
            {
                "name": name,
                "head": head,
                "short": head[:SHORT_ID],
                "time": _time(info.time),
                "author": info.author,
                "message": (info.message.splitlines() or [""])[0],
            }
        )
    tags = [
        {"name": name, "snapshot": sid, "short": sid[:SHORT_ID], "time": _time(infos[sid].time)}
        for name, sid in refs.tags.items()
    ]
    return {"id": repo.id, "branches": branches, "tags": tags}


#: Pages a walk started for one page can go on to (see :class:`Walks`).
WALK_AHEAD_PAGES = 8


@dataclass
class _Walk:
    commits: list[CommitInfo]  # the commits from the next page's first on, as the walk gave them
    final: bool  # the walk ended with the last of them (history ends there)
    expired: frozenset[str]  # what expiry had taken out of history when the walk ran


class Walks:
    """Where history walks stopped, by the cursor of the page they stopped after: the next
    page takes its commits from there instead of walking again from the head, which costs the
    depth of the page (page 200 of 50 commits: 10,000 commits walked to show 50). A walk from
    the head goes :data:`WALK_AHEAD_PAGES` pages further and keeps those commits only (not
    the history it decoded); a walk taken after an expiry changed history is dropped. At
    most ``size`` are kept, the oldest dropped first; a cursor not here walks again from its
    head, which gives the same commits. Thread-safe: a walk is taken out while a page uses it."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._walks: OrderedDict[str, _Walk] = OrderedDict()

    def take(self, cursor: str) -> _Walk | None:
        with self._lock:
            return self._walks.pop(cursor, None)

    def keep(self, cursor: str, walk: _Walk) -> None:
        with self._lock:
            self._walks[cursor] = walk
            while len(self._walks) > self._size:
                self._walks.popitem(last=False)


def _expired_now(repo: Repository) -> frozenset[str]:
    """What expiry has taken out of history now (the root's record of it: one read)."""
    return repo.core.expiry.expired(refresh=True, published=True)


def log_page(
    repo: Repository,
    ref: str,
    *,
    cursor: str | None = None,
    limit: int = LOG_PAGE,
    walks: Walks | None = None,
) -> dict[str, Any]:
    """One page of the commits reachable from ``ref``, newest first.

    ``{"ref", "head", "commits": [commit_json...], "next": cursor or None}``. The first page
    resolves ``ref``; its ``next`` cursor names that head and how far the walk got, so later
    pages continue the same history even when the branch has moved since (pass ``cursor`` and
    the same ``ref``). Raises :class:`BadRequest` for a cursor this function did not make or a
    limit below 1 (the caller caps it), :class:`~zarrlake.RefNotFound` for an unknown ref.
    """
    if limit < 1:
        raise BadRequest(f"limit must be at least 1, not {limit}")
    if cursor:
        head, offset = _parse_cursor(cursor)
    else:
        head, offset = repo.resolve(ref), 0
    # One commit more than the page: is there a next one?
    kept = walks.take(cursor) if walks is not None and cursor else None
    expired = _expired_now(repo) if walks is not None else frozenset()
    if kept is not None and kept.expired == expired and (kept.final or len(kept.commits) > limit):
        # Where the walk for the pages before stopped (it holds this whole page).
        found, ahead, final = kept.commits[: limit + 1], kept.commits[limit:], kept.final
    else:
        # From the head, skipping the pages before; deep enough for the pages that may follow.
        extra = limit * WALK_AHEAD_PAGES if walks is not None else 0
        walk = iter(repo.log(head, limit=offset + limit + 1 + extra))
        found = list(itertools.islice(walk, offset, offset + limit + 1))
        ahead = [*found[limit:], *walk]  # the next page's first on (walk: at most ``extra``)
        final = len(ahead) < 1 + extra
    commits, more = found[:limit], len(found) > limit
    following = f"{head}.{offset + limit}" if more else None
    if following is not None and walks is not None:
        walks.keep(following, _Walk(ahead, final, expired))
    return {
        "ref": ref,
        "head": head,
        "commits": [commit_json(c) for c in commits],
        "next": following,
    }


def _parse_cursor(cursor: str) -> tuple[str, int]:
    head, _, offset = cursor.partition(".")
    if not is_snapshot_id(head) or not (offset.isascii() and offset.isdigit()) or len(offset) > 9:
        raise BadRequest(f"bad cursor {cursor[:60]!r} (use the 'next' of the previous page)")
    return head, int(offset)


def commit(repo: Repository, snapshot_id: str) -> dict[str, Any]:
    """One commit (any ref naming it: a snapshot id, short or whole, a tag, a branch's head):
    :func:`commit_json` plus ``"parent_commits"``, each parent's ``{"id", "short", "message",
    "time"}`` (``"message"`` its first line; a parent expired is left out)."""
    info = _info(repo, repo.resolve(snapshot_id))
    parents = []
    for parent in info.parents:
        try:
            p = _info(repo, parent)
        except KeyError:  # RefNotFound: expired
            continue
        parents.append(
            {
                "id": p.id,
                "short": p.id[:SHORT_ID],
                "message": (p.message.splitlines() or [""])[0],
                "time": _time(p.time),
            }
        )
    return {**commit_json(info), "parent_commits": parents}


# -- versions compared ---------------------------------------------------------------------------


def compare_refs(spec: str, route: str) -> tuple[str, str]:
    """(base, head) of ``spec``, as the URLs of ``route`` (``"diff/"``, ``"/compare/"``) write
    two versions compared: ``<base>...<head>``. Raises :class:`BadRequest` when either is
    missing."""
    base, sep, head = spec.partition("...")
    if not sep or not base or not head:
        raise BadRequest(f"compare two refs as {route}<base>...<head>")
    return base, head


def compare(repo: Repository, base_ref: str, head_ref: str) -> dict[str, Any]:
    """What changed from ``base_ref`` to ``head_ref``: ``{"base", "head", "nodes", "totals"}``.

    ``nodes``, in tree order: ``{"path", "kind": "group" | "array", "change": "added" |
    "removed" | "changed", "chunks_changed": int, "metadata_changed": bool}`` for every node
    added, removed, whose metadata changed, or (arrays) whose chunks changed (added, rewritten
    or deleted). ``totals``: ``{"added", "removed", "changed", "chunks_changed"}``.
    """
    base, head = repo.resolve(base_ref), repo.resolve(head_ref)
    diff = repo.diff(base, head)
    old, new = _snapshot(repo, base).nodes, _snapshot(repo, head).nodes
    arrays = array_paths(old) | array_paths(new)
    changes: dict[str, str] = {}
    changes.update(dict.fromkeys(diff.added_nodes, "added"))
    changes.update(dict.fromkeys(diff.removed_nodes, "removed"))
    changes.update(dict.fromkeys(diff.changed_nodes, "changed"))
    for path in diff.changed_chunks:
        changes.setdefault(path, "changed")
    nodes: list[dict[str, Any]] = []
    for path in sorted(changes, key=tree_key):
        chunks = len(diff.changed_chunks.get(path, ()))
        nodes.append(
            {
                "path": path,
                "kind": "array" if path in arrays else "group",
                "change": changes[path],
                "chunks_changed": chunks,
                "metadata_changed": path in diff.changed_nodes,
            }
        )
    totals = {
        "added": len(diff.added_nodes),
        "removed": len(diff.removed_nodes),
        "changed": sum(1 for n in nodes if n["change"] == "changed"),
        "chunks_changed": sum(n["chunks_changed"] for n in nodes),
    }
    return {"base": base, "head": head, "nodes": nodes, "totals": totals}


# -- the tree of a version -----------------------------------------------------------------------


def node_docs(nodes: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """Node path -> its Zarr v3 ``zarr.json`` document, of a snapshot's metadata documents
    (documents that do not parse as a JSON object are left out; Zarr v2 nodes too)."""
    out = {}
    for key, data in nodes.items():
        if key.rpartition("/")[2] != "zarr.json":
            continue
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(doc, dict) and doc.get("node_type") in ("group", "array"):
            out[meta_key_node(key)] = doc
    return out


def tree(repo: Repository, ref: str, path: str = "") -> dict[str, Any]:
    """The node at ``path`` in ``ref``, and its children.

    ``{"ref", "snapshot", "path", "kind": "group" | "array", "attributes", "children": [{"name",
    "path", "kind", "shape", "dtype", "chunks"}]}`` (a child group's ``shape``, ``dtype`` and
    ``chunks`` are None); an array adds ``"shape", "dtype", "chunks", "shards", "codecs",
    "fill_value", "dimension_names"`` (``chunks``: the inner chunk shape of a sharded array,
    whose shard shape is ``shards``). A directory that holds nodes but has no ``zarr.json``
    of its own is shown as a group without attributes. Raises :class:`NotFound` when nothing
    is at ``path``, :class:`~zarrlake.RefNotFound` for an unknown ref.
    """
    snapshot_id = repo.resolve(ref)
    docs = node_docs(_snapshot(repo, snapshot_id).nodes)
    path = node_path(path)
    below = path.rstrip("/") + "/"
    doc = docs.get(path)
    descendants = [p for p in docs if p.startswith(below) and p != path]
    if doc is None and not descendants and path != "/":
        raise NotFound(f"no group or array at {path!r} in {ref!r}")
    node: dict[str, Any] = {"ref": ref, "snapshot": snapshot_id, "path": path}
    if doc is not None and doc["node_type"] == "array":
        return {**node, "kind": "array", **_array_fields(doc), "children": []}
    names = sorted({p[len(below) :].split("/", 1)[0] for p in descendants})
    children = []
    for name in names:
        child = below + name
        child_doc = docs.get(child)
        if child_doc is not None and child_doc["node_type"] == "array":
            fields = _array_fields(child_doc)
            shape, dtype, chunks = fields["shape"], fields["dtype"], fields["chunks"]
            children.append(_child(name, child, "array", shape, dtype, chunks))
        else:
            children.append(_child(name, child, "group", None, None, None))
    attributes = {} if doc is None else doc.get("attributes") or {}
    return {**node, "kind": "group", "attributes": attributes, "children": children}


def _child(name: str, path: str, kind: str, shape: Any, dtype: Any, chunks: Any) -> dict[str, Any]:
    return {
        "name": name,
        "path": path,
        "kind": kind,
        "shape": shape,
        "dtype": dtype,
        "chunks": chunks,
    }


def _array_fields(doc: dict[str, Any]) -> dict[str, Any]:
    grid = doc.get("chunk_grid")
    config = grid.get("configuration") if isinstance(grid, dict) else None
    chunks = config.get("chunk_shape") if isinstance(config, dict) else None
    shards = None
    codecs = doc.get("codecs") or []
    for codec in codecs:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            # The grid's chunks are shards; the chunks proper are the sharding codec's.
            inner = codec.get("configuration") or {}
            shards, chunks = chunks, inner.get("chunk_shape")
            break
    return {
        "attributes": doc.get("attributes") or {},
        "shape": list(doc.get("shape") or []),
        "dtype": doc.get("data_type"),
        "chunks": None if chunks is None else list(chunks),
        "shards": None if shards is None else list(shards),
        "codecs": codecs,
        "fill_value": doc.get("fill_value"),
        "dimension_names": doc.get("dimension_names"),
    }

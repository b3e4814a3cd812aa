"""Conflict detection for rebase and three-way merge — pure functions over values.

Rebase asks: can *our* changeset, made on ``base``, be re-applied on a head that moved? The other
side's work is summarized as a :class:`ChangeSummary` (from the txlogs in between, or from a diff
when the branch was reset). Merge asks the same question of two summaries against a merge base.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zarrlake.changeset import Changeset
from zarrlake.errors import Conflict, InvalidArgument
from zarrlake.format.manifest import prefix_matches
from zarrlake.format.model import ChunkRef, TxLog, ref_identity
from zarrlake.nodes import grid_signature, meta_key_node, split_chunk_key
from zarrlake.types import node_path


class UseOurs:
    """Solver: on a chunk written by both sides, keep this session's bytes."""

    def __repr__(self) -> str:
        return "UseOurs()"


class UseTheirs:
    """Solver: on a chunk written by both sides, keep the branch's bytes and drop ours."""

    def __repr__(self) -> str:
        return "UseTheirs()"


Solver = UseOurs | UseTheirs | None


@dataclass
class ChangeSummary:
    """What one line of work touched: keys only, not values."""

    nodes: set[str] = field(default_factory=set)  # metadata keys set or deleted
    chunks: set[str] = field(default_factory=set)  # chunk keys set or deleted
    deleted_prefixes: set[str] = field(default_factory=set)
    resized: set[str] = field(default_factory=set)  # array node paths

    def add_txlog(self, log: TxLog) -> None:
        self.nodes.update(log.nodes)
        self.chunks.update(log.chunks)
        self.deleted_prefixes.update(log.deleted_prefixes)
        self.resized.update(log.resized)

    def deleted(self, key: str) -> bool:
        return any(prefix_matches(key, p) for p in self.deleted_prefixes)


def resized_arrays(
    base_nodes: Mapping[str, bytes], changes: Mapping[str, bytes | None]
) -> set[str]:
    """Arrays whose shape/grid changed between ``base_nodes`` and ``changes`` (existing before)."""
    out = set()
    for key, doc in changes.items():
        if key.rpartition("/")[2] not in ("zarr.json", ".zarray"):
            continue
        old = base_nodes.get(key)
        if old is not None and doc is not None and grid_signature(old) != grid_signature(doc):
            out.add(meta_key_node(key))
    return out


def summarize_changeset(cs: Changeset, base_nodes: Mapping[str, bytes]) -> ChangeSummary:
    return ChangeSummary(
        set(cs.nodes),
        set(cs.chunks),
        set(cs.deleted_prefixes),
        resized_arrays(base_nodes, cs.nodes),
    )


def _array_of(key: str, arrays: set[str]) -> tuple[str, tuple[Any, ...]]:
    return split_chunk_key(key, arrays)


def rebase_conflicts(
    ours: Changeset,
    ours_base_nodes: Mapping[str, bytes],
    theirs: ChangeSummary,
    head_nodes: Mapping[str, bytes],
    arrays: set[str],
    solver: Solver,
) -> tuple[list[Conflict], set[str]]:
    """Conflicts of re-applying ``ours`` after ``theirs``; and chunk keys the solver drops.

    - both wrote the same chunk: ``chunk`` (a solver may pick a side);
    - both changed the same node's metadata to different documents: ``node``;
    - they deleted a subtree we wrote into: ``deleted-theirs``; we deleted one they wrote into:
      ``deleted-ours``;
    - one side changed an array's shape/grid while the other wrote its chunks: ``resized``.
    """
    conflicts: list[Conflict] = []
    drop: set[str] = set()
    our_resized = resized_arrays(ours_base_nodes, ours.nodes)

    for key in sorted(ours.chunks):
        path, coords = _array_of(key, arrays)
        if key in theirs.chunks:
            if isinstance(solver, UseTheirs):
                drop.add(key)
            elif not isinstance(solver, UseOurs):
                conflicts.append(Conflict("chunk", path, coords))
        elif theirs.deleted(key):
            conflicts.append(Conflict("deleted-theirs", path, coords))
        elif path in theirs.resized:
            conflicts.append(Conflict("resized", path, coords))

    for key in sorted(ours.nodes):
        path = meta_key_node(key)
        if key in theirs.nodes:
            if head_nodes.get(key) != ours.nodes[key]:
                conflicts.append(Conflict("node", path))
        elif theirs.deleted(key):
            conflicts.append(Conflict("deleted-theirs", path))

    for prefix in sorted(ours.deleted_prefixes):
        touched = [k for k in theirs.chunks | theirs.nodes if prefix_matches(k, prefix)]
        if touched:
            conflicts.append(Conflict("deleted-ours", node_path(prefix)))

    if our_resized:
        for key in sorted(theirs.chunks):
            path, coords = _array_of(key, arrays)
            if path in our_resized:
                conflicts.append(Conflict("resized", path, coords))
    return conflicts, drop


@dataclass
class MergePlan:
    """The outcome of a three-way merge: changes to apply on the destination, and conflicts."""

    chunks: dict[str, ChunkRef | None]
    nodes: dict[str, bytes | None]
    conflicts: list[Conflict]


def check_strategy(strategy: object) -> None:
    """Raise :class:`InvalidArgument` unless ``strategy`` is a merge strategy: None,
    ``"source-wins"`` or ``"dest-wins"``."""
    if strategy not in (None, "source-wins", "dest-wins"):
        raise InvalidArgument(
            f"unknown merge strategy {strategy!r}; use 'source-wins' or 'dest-wins'"
        )


def three_way(
    base_nodes: Mapping[str, bytes],
    source_nodes: Mapping[str, bytes],
    dest_nodes: Mapping[str, bytes],
    source_chunks: Mapping[str, tuple[ChunkRef | None, ChunkRef | None]],
    dest_chunks: Mapping[str, tuple[ChunkRef | None, ChunkRef | None]],
    arrays: set[str],
    strategy: str | None,
) -> MergePlan:
    """Merge source into dest against their merge base.

    ``*_chunks`` map each chunk key changed on that side to (value at base, value on that side).
    A change on one side only is taken; identical changes on both sides are fine; different
    changes, or a change on one side where the other deleted the node, conflict — unless
    ``strategy`` is ``"source-wins"`` or ``"dest-wins"``, which settles every conflict.
    """
    check_strategy(strategy)
    conflicts: list[Conflict] = []
    out_chunks: dict[str, ChunkRef | None] = {}
    out_nodes: dict[str, bytes | None] = {}

    def node_changes(side: Mapping[str, bytes]) -> dict[str, bytes | None]:
        keys = set(base_nodes) | set(side)
        return {k: side.get(k) for k in keys if base_nodes.get(k) != side.get(k)}

    src_nodes, dst_nodes = node_changes(source_nodes), node_changes(dest_nodes)
    src_removed = {meta_key_node(k) for k, v in src_nodes.items() if v is None}
    dst_removed = {meta_key_node(k) for k, v in dst_nodes.items() if v is None}
    src_resized = resized_arrays(base_nodes, src_nodes)
    dst_resized = resized_arrays(base_nodes, dst_nodes)

    def under(path: str, removed: set[str]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in removed)

    def settle(conflict: Conflict) -> bool:
        """True if the source's value should be applied."""
        if strategy == "source-wins":
            return True
        if strategy == "dest-wins":
            return False
        conflicts.append(conflict)
        return False

    for key, new in sorted(src_nodes.items()):
        path = meta_key_node(key)
        if key in dst_nodes:
            if dst_nodes[key] == new:
                continue
            if settle(Conflict("node", path)):
                out_nodes[key] = new
        elif new is not None and under(path, dst_removed):
            if settle(Conflict("deleted-theirs", path)):
                out_nodes[key] = new
        else:
            out_nodes[key] = new

    for key, (_, ref) in sorted(source_chunks.items()):
        path, coords = split_chunk_key(key, arrays)
        if key in dest_chunks:
            if ref_identity(dest_chunks[key][1]) == ref_identity(ref):  # the same bytes
                continue
            if settle(Conflict("chunk", path, coords)):
                out_chunks[key] = ref
        elif under(path, dst_removed) and ref is not None:
            if settle(Conflict("deleted-theirs", path, coords)):
                out_chunks[key] = ref
        elif path in dst_resized:
            if settle(Conflict("resized", path, coords)):
                out_chunks[key] = ref
        else:
            out_chunks[key] = ref

    # Dest-side changes inside what the source removed or resized also conflict.
    for key, (_, dest_ref) in sorted(dest_chunks.items()):
        if key in source_chunks:
            continue
        path, coords = split_chunk_key(key, arrays)
        if dest_ref is not None and under(path, src_removed):
            if settle(Conflict("deleted-ours", path, coords)):
                out_chunks[key] = None
        elif path in src_resized:
            settle(Conflict("resized", path, coords))
    for key, dest_doc in sorted(dst_nodes.items()):
        path = meta_key_node(key)
        if (
            key not in src_nodes
            and dest_doc is not None
            and under(path, src_removed)
            and settle(Conflict("deleted-ours", path))
        ):
            out_nodes[key] = None
    return MergePlan(out_chunks, out_nodes, conflicts)

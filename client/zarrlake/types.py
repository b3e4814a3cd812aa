"""Values the public API returns: commit records and diffs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def node_path(path: str) -> str:
    """Canonical node path: leading '/', no trailing '/', root is '/'."""
    return "/" + path.strip("/")


class PathSet(frozenset[str]):
    """A set of node paths; membership also accepts paths written without the leading '/'."""

    def __contains__(self, item: object) -> bool:
        return isinstance(item, str) and frozenset.__contains__(self, node_path(item))


class PathDict(dict[str, Any]):
    """A dict keyed by node path that also accepts keys written without the leading '/'."""

    def __getitem__(self, key: str) -> Any:
        return dict.__getitem__(self, node_path(key))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, node_path(key))

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, node_path(key), default)


@dataclass(frozen=True)
class CommitInfo:
    id: str
    parents: tuple[str, ...]
    message: str
    author: str | None
    time: dt.datetime
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Diff:
    """Differences between two versions. ``bool(diff)`` is False when there are none.

    Node paths start with '/' ('/' is the root group); lookups also accept 'group/array'.
    ``changed_chunks`` maps an array path to the set of chunk-coordinate tuples that were added,
    changed or removed.
    """

    added_nodes: PathSet = field(default_factory=PathSet)
    removed_nodes: PathSet = field(default_factory=PathSet)
    changed_nodes: PathSet = field(default_factory=PathSet)
    changed_chunks: PathDict = field(default_factory=PathDict)

    def __bool__(self) -> bool:
        return bool(
            self.added_nodes or self.removed_nodes or self.changed_nodes or self.changed_chunks
        )

    @classmethod
    def build(
        cls,
        added: Iterable[str],
        removed: Iterable[str],
        changed: Iterable[str],
        chunks: dict[str, set[tuple[Any, ...]]],
    ) -> Diff:
        return cls(
            PathSet(added),
            PathSet(removed),
            PathSet(changed),
            PathDict({k: v for k, v in sorted(chunks.items()) if v}),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "added_nodes": sorted(self.added_nodes),
            "removed_nodes": sorted(self.removed_nodes),
            "changed_nodes": sorted(self.changed_nodes),
            "changed_chunks": {
                k: sorted([list(c) for c in v]) for k, v in sorted(self.changed_chunks.items())
            },
        }

    def summary(self) -> str:
        if not self:
            return "no changes"
        parts = []
        for label, nodes in (
            ("added", self.added_nodes),
            ("removed", self.removed_nodes),
            ("changed", self.changed_nodes),
        ):
            if nodes:
                parts.append(f"{label} {', '.join(sorted(nodes))}")
        n = sum(len(v) for v in self.changed_chunks.values())
        if n:
            parts.append(f"{n} chunk(s) in {', '.join(sorted(self.changed_chunks))}")
        return "; ".join(parts)

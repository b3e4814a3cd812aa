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


#: Below this many microseconds after the epoch (the year 2242), ``us / 1e6`` is a float within
#: half a microsecond of the exact time, which ``fromtimestamp`` rounds away.
_FLOAT_EXACT_US = 2**33 * 10**6
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class CommitInfo:
    id: str
    parents: tuple[str, ...]
    message: str
    author: str | None
    time: dt.datetime
    metadata: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # A commit decoded from a history page holds its time as microseconds since the epoch
        # (``_us``) until the time is first asked for: ``log()`` makes a thousand of these per
        # page, and a caller that lists ids never pays for the datetimes. Only reached for an
        # attribute not in the instance's dict.
        if name == "time":
            state = self.__dict__
            if "_us" in state:
                us = state["_us"]
                if 0 <= us < _FLOAT_EXACT_US:
                    made = dt.datetime.fromtimestamp(us / 1e6, dt.UTC)
                else:
                    made = _EPOCH + dt.timedelta(microseconds=us)
                state["time"] = made
                del state["_us"]
                return made
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


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

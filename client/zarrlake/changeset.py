"""A session's uncommitted changes, as a plain picklable value."""

from __future__ import annotations

from dataclasses import dataclass, field

from zarrlake.format.changes import ChunkChanges
from zarrlake.format.manifest import prefix_matches


@dataclass
class Changeset:
    """Chunk and node changes made on top of ``base``.

    ``chunks``/``nodes`` map a key to its new value, or None for a deletion (``chunks`` compactly:
    a session may hold millions). ``deleted_prefixes``
    are subtrees removed wholesale (``delete_dir``); writes recorded after such a delete sit in
    ``chunks``/``nodes`` and win over it. ``dedup_chunks`` are digests of chunk objects that already
    existed when written: the commit checks they still exist before publishing a reference.
    """

    session_id: str
    base: str
    chunks: ChunkChanges = field(default_factory=ChunkChanges)
    nodes: dict[str, bytes | None] = field(default_factory=dict)
    deleted_prefixes: list[str] = field(default_factory=list)
    dedup_chunks: set[bytes] = field(default_factory=set)
    #: For a fork's changes: how many merges its session had made when the fork was made. The
    #: fork saw those, so overwriting what they brought is a write, not a conflict.
    forked_at: int = 0

    def is_empty(self) -> bool:
        return not (self.chunks or self.nodes or self.deleted_prefixes)

    def deleted_by_prefix(self, key: str) -> bool:
        return any(prefix_matches(key, p) for p in self.deleted_prefixes)

    def delete_prefix(self, prefix: str) -> None:
        p = prefix.rstrip("/")
        for d in (self.chunks, self.nodes):
            for k in [k for k in d if prefix_matches(k, p)]:
                del d[k]
        if not any(prefix_matches(p, q) for q in self.deleted_prefixes):
            self.deleted_prefixes = [q for q in self.deleted_prefixes if not prefix_matches(q, p)]
            self.deleted_prefixes.append(p)

    def fold(self, other: Changeset) -> None:
        """Apply ``other``'s changes after ours (a fork's work merged back)."""
        for p in other.deleted_prefixes:
            self.delete_prefix(p)
        self.chunks.update(other.chunks)
        self.nodes.update(other.nodes)
        self.dedup_chunks |= other.dedup_chunks

    def copy(self) -> Changeset:
        return Changeset(
            self.session_id,
            self.base,
            self.chunks.copy(),
            dict(self.nodes),
            list(self.deleted_prefixes),
            set(self.dedup_chunks),
            self.forked_at,
        )

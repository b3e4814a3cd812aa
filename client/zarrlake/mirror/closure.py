"""What a snapshot needs at a mirror before a ref may point at it.

For a head ``H``: its manifest shards and every chunk and pack object they reference; and its
history: the snapshot objects and txlogs of ``H`` and its ancestors back to commits the mirror
already has (or to where the source's history ends), and the history pages that index them, so
that ``log()`` on the mirror walks the same commits as on the source, as fast. Skipped commits'
manifests and chunks are not needed: no mirror ref points at them, and reading one at the mirror
raises :class:`~zarrlake.errors.NotMirrored`.

Everything is computed from the source, whose objects are immutable; only keys the destination
is not yet known to hold are returned (see :class:`~zarrlake.mirror.presence.Presence`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from zarrlake.core import RepositoryCore
from zarrlake.errors import CorruptObject, RefNotFound, UnsupportedFormat
from zarrlake.format.model import (
    OBJECT,
    PACKED,
    HistoryPage,
    ManifestShard,
    ShardInfo,
    chunk_key,
    history_page_key,
    manifest_key,
    pack_key,
    snapshot_key,
    txlog_key,
)
from zarrlake.mirror.presence import Presence
from zarrlake.types import CommitInfo


@dataclass
class Needs:
    """The objects snapshot ``head`` still needs at the destination.

    ``sizes``: the least size each key's object must have (a chunk object exactly its ref's
    size, a pack at least the end of its furthest range; 1 for metadata objects). ``shards``:
    digests of the shards that become complete once these are present. ``chain``: the commits
    whose history (snapshot object, txlog) ``head`` needs, newest first: ``head`` and its
    ancestors down to those the destination already has.
    """

    head: str
    sizes: dict[str, int] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    chain: list[CommitInfo] = field(default_factory=list)

    def need(self, key: str, size: int = 1) -> None:
        if self.sizes.get(key, -1) < size:
            self.sizes[key] = size


def history_chain(
    source: RepositoryCore, head: str, stop: set[str] | frozenset[str]
) -> list[CommitInfo]:
    """``head`` and its ancestors (merge parents too), newest first, down to commits in ``stop``
    (excluded; their own ancestors are taken as present) or to where the source's history ends
    (the first commit, or one the source expired). Read from the source's history index, not
    snapshot by snapshot."""
    if head in stop:
        return []
    chain: list[CommitInfo] = []
    pending = {head}
    for info in source.graph.log(head):
        if info.id not in pending:
            continue
        pending.discard(info.id)
        chain.append(info)
        pending.update(p for p in info.parents if p not in stop)
        if not pending:
            break
    return chain


def closure(source: RepositoryCore, head: str, presence: Presence) -> Needs:
    """What ``head`` needs at the destination that ``presence`` does not know to be there."""
    needs = Needs(head)
    needs.chain = history_chain(source, head, presence.snapshots)
    for commit in needs.chain:
        needs.need(snapshot_key(commit.id))
        needs.need(txlog_key(commit.id))
    snap = source.objects.snapshot(head)
    if snap.index is not None:
        _pages(source, snap.index.pages, {c.id for c in needs.chain}, presence, needs)
    todo = [info for info in snap.shards if info.digest not in presence.shards]

    def read(info: ShardInfo) -> ManifestShard:
        # Cached: a pass may weigh several heads of one branch, which share most shards.
        return source.objects.shard(info)

    for info, shard in zip(todo, source.storage.map(read, todo), strict=True):
        needs.shards.append(info.digest)
        needs.need(manifest_key(info.digest))
        for ref in shard.refs:
            if ref[0] == OBJECT:
                needs.need(chunk_key(ref[1].hex()), int(ref[2]))
            elif ref[0] == PACKED:
                needs.need(pack_key(ref[1]), int(ref[2]) + int(ref[3]))
    for key in [k for k in needs.sizes if k in presence.keys]:
        del needs.sizes[key]
    return needs


def _pages(
    source: RepositoryCore, roots: Iterable[str], keep: set[str], presence: Presence, needs: Needs
) -> None:
    """The history pages ``roots`` names and the older pages they name, as far as pages hold
    commits of ``keep`` (older ones hold history the destination has, or the source expired),
    and not past a page already present."""
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        batch = [d for d in dict.fromkeys(todo) if d not in seen]
        batch = [d for d in batch if history_page_key(d) not in presence.keys]
        seen.update(batch)

        def read(digest: str) -> HistoryPage | None:
            try:
                return source.objects.history_page(digest)
            except (RefNotFound, CorruptObject, UnsupportedFormat):
                return None  # not at the source either: log() reads snapshots there too

        todo = []
        for digest, page in zip(batch, source.storage.map(read, batch), strict=True):
            if page is None:
                continue
            needs.need(history_page_key(digest))
            if any(i in keep for i in page.ids):
                todo.extend(page.older)

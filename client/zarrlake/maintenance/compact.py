"""Compaction: fewer, larger objects; the same data.

- Small chunk objects are packed into pack objects; their refs become byte ranges (the chunk's
  digest stays in the ref, so diffs and rebases see no change of data).
- The branch head's manifest is re-cut into evenly filled shards (undersized shards merge).
- Old branch-journal entries are pruned: the newest stays, and every entry ``as_of`` may still
  need within ``keep_journal`` — and never one younger than :data:`zarrlake.refs.PRUNE_FLOOR`
  (8 days), which clients that know a recent head rely on.

Compaction commits like any writer, with ``UseTheirs`` semantics: a user commit that races it and
touches a packed chunk keeps its own data, and the relocation is simply dropped for that chunk.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zarrlake.changeset import Changeset
from zarrlake.conflicts import ChangeSummary
from zarrlake.core import RepositoryCore
from zarrlake.errors import Conflict, ConflictError
from zarrlake.format import manifest
from zarrlake.format.model import OBJECT, PACKED, ChunkRef, Snapshot, pack_key
from zarrlake.nodes import split_chunk_key
from zarrlake.refs import PRUNE_FLOOR

DEFAULT_PACK_BELOW = 256 * 1024
PACK_TARGET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CompactReport:
    """What a compaction run packed, re-cut and pruned (or would have, with ``dry_run``)."""

    branch: str
    dry_run: bool = False
    packed_chunks: int = 0
    packed_bytes: int = 0
    packs_written: int = 0
    shards_before: int = 0
    shards_after: int = 0
    journal_entries_pruned: int = 0
    snapshot: str | None = None
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The job-report form (``zarrlake compact --json``; the operator parses it)."""
        return {k: (round(v, 3) if k == "duration_s" else v) for k, v in vars(self).items()}

    def summary(self) -> str:
        """One line for people."""
        verb = "would pack" if self.dry_run else "packed"
        return (
            f"{verb} {self.packed_chunks} chunk(s) into {self.packs_written} pack(s), shards "
            f"{self.shards_before} -> {self.shards_after}, pruned {self.journal_entries_pruned} "
            f"journal entr{'y' if self.journal_entries_pruned == 1 else 'ies'} "
            f"in {self.duration_s:.2f}s"
        )


@dataclass(frozen=True)
class Relocation:
    """The rebase policy of a compaction commit (see :class:`zarrlake.commit.RebasePolicy`).

    The changeset moves bytes without changing them, so it never conflicts: any key the other
    side wrote, deleted, or whose array it resized is simply dropped from it (their data wins).
    """

    @property
    def relocates(self) -> bool:
        return True

    def settle(
        self,
        ours: Changeset,
        base: Snapshot,
        head: Snapshot,
        theirs: ChangeSummary,
        arrays: set[str],
    ) -> tuple[list[Conflict], set[str]]:
        drop = {
            k
            for k in ours.chunks
            if k in theirs.chunks
            or theirs.deleted(k)
            or split_chunk_key(k, arrays)[0] in theirs.resized
        }
        return [], drop


#: Chunks of one pack: ``(chunk key, its object ref)``.
PackGroup = list[tuple[str, ChunkRef]]
#: Writes every group's pack and yields, per group, the chunks' new ``PACKED`` refs.
Packer = Callable[[list[PackGroup]], Iterable[list[tuple[str, ChunkRef]]]]


def write_pack(core: RepositoryCore, group: PackGroup) -> list[tuple[str, ChunkRef]]:
    """Read the chunk objects of ``group``, write them as one pack (content-addressed, so a
    retry writes the same object) and return each chunk's ``PACKED`` ref into it."""
    objects = core.objects
    datas: list[bytes] = core.storage.map(lambda kv: objects.read_chunk(kv[1]), group)
    pack = b"".join(datas)
    pack_id = objects.hash_data(pack)
    core.storage.put(pack_key(pack_id), pack)
    out: list[tuple[str, ChunkRef]] = []
    offset = 0
    for (key, ref), data in zip(group, datas, strict=True):
        out.append((key, (PACKED, pack_id, offset, len(data), ref[1])))
        offset += len(data)
    return out


def _local_packer(core: RepositoryCore) -> Packer:
    def pack(groups: list[PackGroup]) -> Iterator[list[tuple[str, ChunkRef]]]:
        for group in groups:
            yield write_pack(core, group)

    return pack


@dataclass(frozen=True)
class _Packing:
    """The outcome of packing a branch head (before journal pruning)."""

    packed_chunks: int
    packed_bytes: int
    packs_written: int
    shards_before: int
    shards_after: int
    snapshot: str | None


def compact(
    core: RepositoryCore,
    *,
    branch: str = "main",
    pack_below_bytes: int = DEFAULT_PACK_BELOW,
    keep_journal: dt.timedelta = dt.timedelta(days=7),
    dry_run: bool = False,
    pack_target_bytes: int = PACK_TARGET_BYTES,
    progress: Callable[[str, int], None] | None = None,
    now: dt.datetime | None = None,
    packer: Packer | None = None,
) -> CompactReport:
    """Pack small chunks of ``branch``'s head, re-cut its manifest, prune its old journal.

    Chunk objects under ``pack_below_bytes`` go into packs of about ``pack_target_bytes``; journal
    entries older than ``keep_journal`` (at least :data:`~zarrlake.refs.PRUNE_FLOOR`) that
    ``as_of`` cannot need are deleted, their age measured back from ``now`` (default: the clock;
    tests move it forward). ``packer`` writes the packs (default: in this process; the Spark
    engine passes one that writes them in executor tasks). Raises
    :class:`ConflictError` if user commits kept reshaping what it packed three times over, and
    :class:`RefNotFound` for a missing branch.
    """
    started = time.monotonic()
    for attempt in range(3):
        try:
            packing = _pack_and_commit(
                core,
                branch,
                pack_below_bytes,
                pack_target_bytes,
                dry_run,
                progress,
                packer or _local_packer(core),
            )
            break
        except ConflictError:
            # A user commit reshaped what we packed (e.g. resized an array): start over on it.
            if attempt == 2:
                raise
    pruned = _prune_journal(core, branch, max(keep_journal, PRUNE_FLOOR), now, dry_run)
    return CompactReport(
        branch=branch,
        dry_run=dry_run,
        packed_chunks=packing.packed_chunks,
        packed_bytes=packing.packed_bytes,
        packs_written=packing.packs_written,
        shards_before=packing.shards_before,
        shards_after=packing.shards_after,
        journal_entries_pruned=pruned,
        snapshot=packing.snapshot,
        duration_s=time.monotonic() - started,
    )


def _pack_and_commit(
    core: RepositoryCore,
    branch: str,
    pack_below: int,
    target: int,
    dry_run: bool,
    progress: Callable[[str, int], None] | None,
    packer: Packer,
) -> _Packing:
    head_id = core.journal.current(branch).snapshot
    assert head_id is not None
    objects = core.objects
    max_refs = core.config.shard_max_refs
    snap = objects.snapshot(head_id)
    small = [
        (key, ref)
        for key, ref in manifest.iter_all(snap.shards, objects.shard)
        if ref[0] == OBJECT and ref[2] < pack_below
    ]
    undersized = sum(1 for s in snap.shards if s.count < max_refs // 2)

    groups: list[PackGroup] = []
    size = 0
    for item in small:
        if not groups or size + item[1][2] > target:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1][2]

    def outcome(shards_after: int, snapshot: str | None = None) -> _Packing:
        return _Packing(
            packed_chunks=len(small),
            packed_bytes=sum(int(ref[2]) for _, ref in small),
            packs_written=len(groups),
            shards_before=len(snap.shards),
            shards_after=shards_after,
            snapshot=snapshot,
        )

    if not small and undersized <= 1:
        return outcome(len(snap.shards))
    if dry_run:
        total = sum(s.count for s in snap.shards)
        return outcome(max(1, -(-total // max_refs)) if total else 0)

    changes: dict[str, ChunkRef | None] = {}
    for relocated in packer(groups):
        changes.update(relocated)
        if progress:
            progress("pack", len(relocated))

    changeset = Changeset(uuid.uuid4().hex, head_id, chunks=changes)
    new_id = core.commits.commit(
        branch,
        changeset,
        message=f"Compaction: packed {len(changes)} chunk(s) into {len(groups)} pack(s)",
        author="zarrlake compaction",
        metadata={"compaction": {"packed_chunks": len(changes), "packs": len(groups)}},
        rebase=True,
        policy=Relocation(),
        reshard=True,
    )
    return outcome(len(objects.snapshot(new_id).shards), new_id)


def _prune_journal(
    core: RepositoryCore,
    branch: str,
    keep: dt.timedelta,
    now: dt.datetime | None,
    dry_run: bool,
) -> int:
    """Delete journal entries nobody can need: all but the newest, those younger than ``keep``,
    and the newest one older than ``keep`` (the head at the start of the window)."""
    entries = core.journal.history(branch)  # newest first
    if len(entries) <= 1:
        return 0
    cutoff = (now or dt.datetime.now(dt.UTC)) - keep
    doomed: list[int] = []
    boundary_kept = False
    for i, entry in enumerate(entries):
        if i == 0 or entry.time >= cutoff:
            continue
        if not boundary_kept:
            boundary_kept = True
            continue
        doomed.append(entry.seq)
    if doomed and not dry_run:
        core.journal.prune(branch, doomed)
    return len(doomed)

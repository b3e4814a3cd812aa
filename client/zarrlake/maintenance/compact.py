"""Compaction: fewer, larger objects; the same data.

- Small chunk objects are packed into pack objects; their refs become byte ranges (the chunk's
  digest stays in the ref, so diffs and rebases see no change of data).
- The branch head's manifest is re-cut into evenly filled shards (undersized shards merge).
- Old branch-journal entries are pruned: the newest stays, and every entry ``as_of`` may still
  need within ``keep_journal``.

Compaction commits like any writer, with ``UseTheirs`` semantics: a user commit that races it and
touches a packed chunk keeps its own data, and the relocation is simply dropped for that chunk.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zarrlake.changeset import Changeset
from zarrlake.errors import ConflictError
from zarrlake.format import manifest
from zarrlake.format.ids import content_hash
from zarrlake.format.model import OBJECT, PACKED, branch_entry_key, branch_prefix, pack_key

if TYPE_CHECKING:
    from zarrlake.repository import Repository

DEFAULT_PACK_BELOW = 256 * 1024
PACK_TARGET_BYTES = 64 * 1024 * 1024


@dataclass
class CompactReport:
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
        return {k: (round(v, 3) if k == "duration_s" else v) for k, v in vars(self).items()}

    def summary(self) -> str:
        verb = "would pack" if self.dry_run else "packed"
        return (
            f"{verb} {self.packed_chunks} chunk(s) into {self.packs_written} pack(s), shards "
            f"{self.shards_before} -> {self.shards_after}, pruned {self.journal_entries_pruned} "
            f"journal entr{'y' if self.journal_entries_pruned == 1 else 'ies'} "
            f"in {self.duration_s:.2f}s"
        )


def compact(
    repo: Repository,
    *,
    branch: str = "main",
    pack_below_bytes: int = DEFAULT_PACK_BELOW,
    keep_journal: dt.timedelta = dt.timedelta(days=7),
    dry_run: bool = False,
    pack_target_bytes: int = PACK_TARGET_BYTES,
    progress: Callable[[str, int], None] | None = None,
) -> CompactReport:
    """Pack small chunks of ``branch``'s head, re-cut its manifest, prune its old journal."""
    started = time.monotonic()
    report = CompactReport(branch=branch, dry_run=dry_run)
    for attempt in range(3):
        try:
            _pack_and_commit(repo, branch, pack_below_bytes, pack_target_bytes, report, progress)
            break
        except ConflictError:
            # A user commit reshaped what we packed (e.g. resized an array): start over on it.
            if attempt == 2:
                raise
    report.journal_entries_pruned = _prune_journal(repo, branch, keep_journal, dry_run)
    report.duration_s = time.monotonic() - started
    return report


def _pack_and_commit(
    repo: Repository,
    branch: str,
    pack_below: int,
    target: int,
    report: CompactReport,
    progress: Callable[[str, int], None] | None,
) -> None:
    head_id = repo._journal.current(branch).snapshot
    assert head_id is not None
    snap = repo._objects.snapshot(head_id)
    load = repo._objects.shard
    small = [
        (key, ref)
        for key, ref in manifest.iter_all(snap.shards, load)
        if ref[0] == OBJECT and ref[2] < pack_below
    ]
    report.shards_before = len(snap.shards)
    undersized = sum(1 for s in snap.shards if s.count < repo.config.shard_max_refs // 2)
    report.packed_chunks = len(small)
    report.packed_bytes = sum(int(ref[2]) for _, ref in small)

    groups: list[list[tuple[str, Any]]] = []
    size = 0
    for item in small:
        if not groups or size + item[1][2] > target:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1][2]
    report.packs_written = len(groups)
    needs_reshard = undersized > 1
    if not small and not needs_reshard:
        report.shards_after = len(snap.shards)
        return
    if report.dry_run:
        total = sum(s.count for s in snap.shards)
        report.shards_after = max(1, -(-total // repo.config.shard_max_refs)) if total else 0
        return

    changes: dict[str, Any] = {}
    for group in groups:
        datas = repo.storage.map(lambda kv: repo._objects.read_chunk(kv[1]), group)
        pack = b"".join(datas)
        pack_id = content_hash(pack)
        repo.storage.put(pack_key(pack_id), pack)
        offset = 0
        for (key, ref), data in zip(group, datas, strict=True):
            changes[key] = (PACKED, pack_id, offset, len(data), ref[1])
            offset += len(data)
        if progress:
            progress("pack", len(group))

    changeset = Changeset(uuid.uuid4().hex, head_id, chunks=changes)
    new_id = repo._commit_changeset(
        branch,
        changeset,
        message=f"Compaction: packed {len(changes)} chunk(s) into {len(groups)} pack(s)",
        author="zarrlake compaction",
        metadata={"compaction": {"packed_chunks": len(changes), "packs": len(groups)}},
        rebase=True,
        solver="relocation",
        reshard=True,
    )
    report.snapshot = new_id
    report.shards_after = len(repo._objects.snapshot(new_id).shards)


def _prune_journal(repo: Repository, branch: str, keep: dt.timedelta, dry_run: bool) -> int:
    """Delete journal entries nobody can need: all but the newest, those younger than ``keep``,
    and the newest one older than ``keep`` (the head at the start of the window)."""
    keys = repo.storage.list_keys(branch_prefix(branch))  # newest first
    if len(keys) <= 1:
        return 0
    entries = repo.storage.map(repo._journal._read, keys)
    cutoff = dt.datetime.now(dt.UTC) - keep
    doomed: list[str] = []
    boundary_kept = False
    for i, entry in enumerate(entries):
        if i == 0 or entry.time >= cutoff:
            continue
        if not boundary_kept:
            boundary_kept = True
            continue
        doomed.append(branch_entry_key(branch, entry.seq))
    if doomed and not dry_run:
        repo.storage.delete_many(doomed)
    return len(doomed)

"""Compaction: fewer, larger objects; the same data.

- Small chunk objects are packed into pack objects; their refs become byte ranges (the chunk's
  digest stays in the ref, so diffs and rebases see no change of data).
- The branch head's manifest is re-cut into evenly filled shards (undersized shards merge).
- Old branch-journal entries are pruned: the newest stays, and every entry ``as_of`` may still
  need within ``keep_journal`` — and never one younger than :data:`zarrlake.refs.PRUNE_FLOOR`
  (8 days), which clients that know a recent head rely on.

Compaction commits like any writer, with the :class:`Relocation` rebase policy: a user commit
that races it and touches a packed chunk keeps its own data, and the relocation is simply dropped
for that chunk.

The work is done in runs (:func:`plan_runs`, :func:`compact_run`): slices of the head's manifest by
position, cut where the new shards will begin, each packed and re-cut on its own — one after
another here, as Spark tasks in :func:`zarrlake.maintenance.spark_jobs.compact_spark`. Cut so, the
runs together write the very shards a re-cut of the whole manifest in one process would.
Which packs are small is decided over the whole manifest before the runs start
(:func:`pack_usage`, :func:`small_packs`): a pack's chunks may fall into several runs, and each
run alone would see only a part of its bytes.
"""

from __future__ import annotations

import bisect
import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from zarrlake.changeset import Changeset
from zarrlake.conflicts import ChangeSummary
from zarrlake.core import RepositoryCore
from zarrlake.errors import Conflict, ConflictError, CorruptObject
from zarrlake.format import manifest
from zarrlake.format.changes import ChunkChanges
from zarrlake.format.manifest import ManifestUpdate
from zarrlake.format.model import (
    OBJECT,
    PACKED,
    ChunkRef,
    ShardInfo,
    Snapshot,
    chunk_key,
    manifest_key,
    pack_key,
    ref_identity,
    ref_size,
)
from zarrlake.nodes import split_chunk_key
from zarrlake.refs import PRUNE_FLOOR

DEFAULT_PACK_BELOW = 256 * 1024
PACK_TARGET_BYTES = 64 * 1024 * 1024
#: A pack whose chunks still in use (in the whole manifest) add up to less than this (or to less
#: than half the pack target, if that is smaller) is worth merging with others like it: sessions
#: leave a small pack behind at each commit (the tail of their writes).
SMALL_PACK_BYTES = 1024 * 1024


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
    #: With ``materialize``: virtual chunks copied into the repository (their sources read once,
    #: checked against their pins), and the commit that made them native.
    materialized_chunks: int = 0
    materialized_bytes: int = 0
    materialized_snapshot: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The job-report form (``zarrlake compact --json``; the operator parses it)."""
        return {k: (round(v, 3) if k == "duration_s" else v) for k, v in vars(self).items()}

    def summary(self) -> str:
        """One line for people."""
        verb = "would pack" if self.dry_run else "packed"
        copied = ""
        if self.materialized_chunks:
            copied = (
                f"{'would copy' if self.dry_run else 'copied'} {self.materialized_chunks} "
                f"virtual chunk(s) ({self.materialized_bytes} bytes) in, "
            )
        return copied + (
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


def write_pack(core: RepositoryCore, group: PackGroup) -> list[tuple[str, ChunkRef]]:
    """Read the chunks of ``group`` (objects, or ranges of small packs), write them as one pack
    (content-addressed, so a retry writes the same object) and return each chunk's ``PACKED``
    ref into it. A chunk keeps its digest: packing is not a change of data. Bytes that do not
    hash to their digest are :class:`CorruptObject` (session packs are not named by their
    content, so this is where a damaged one is caught); keys holding the same bytes share them."""
    objects = core.objects
    datas = objects.read_chunks([(ref, None) for _, ref in group])
    parts: list[bytes] = []
    placed: dict[bytes, tuple[int, int]] = {}
    offset = 0
    for (_, ref), data in zip(group, datas, strict=True):
        digest = _digest(ref)
        if digest in placed:
            continue
        if bytes.fromhex(objects.hash_data(data)) != digest:
            where = pack_key(ref[1]) if ref[0] == PACKED else chunk_key(digest.hex())
            raise CorruptObject(where, f"a chunk's bytes do not match its digest {digest.hex()}")
        placed[digest] = (offset, len(data))
        parts.append(data)
        offset += len(data)
    pack = b"".join(parts)
    pack_id = objects.hash_data(pack)
    core.storage.put(pack_key(pack_id), pack)
    out: list[tuple[str, ChunkRef]] = []
    for key, ref in group:
        digest = _digest(ref)
        out.append((key, (PACKED, pack_id, *placed[digest], digest)))
    return out


def _digest(ref: ChunkRef) -> bytes:
    """The digest of the chunk an object ref or a packed ref (with its digest) names. Packs a
    ref names without a digest (an older format) are never repacked (:func:`small_packs`)."""
    digest = ref_identity(ref)
    if not isinstance(digest, bytes):
        raise TypeError(f"a ref without a chunk digest cannot be packed: {ref!r}")
    return digest


@dataclass
class PackUsage:
    """What a manifest (or a slice of it) uses: the bytes of each pack, the packs some ref names
    without a chunk digest (an older format), and the bytes of the chunk objects compaction
    packs (under ``pack_below``). Slices add up (:meth:`add`)."""

    live: dict[str, int]
    undigested: set[str]
    objects: int = 0

    @classmethod
    def of(cls, refs: Iterable[ChunkRef], pack_below: int) -> PackUsage:
        usage = cls({}, set())
        live = usage.live
        for ref in refs:
            if ref[0] == PACKED:
                live[ref[1]] = live.get(ref[1], 0) + int(ref[3])
                if len(ref) <= 4:
                    usage.undigested.add(ref[1])
            elif ref[0] == OBJECT and ref[2] < pack_below:
                usage.objects += int(ref[2])
        return usage

    def add(self, other: PackUsage) -> PackUsage:
        for pack, size in other.live.items():
            self.live[pack] = self.live.get(pack, 0) + size
        self.undigested |= other.undigested
        self.objects += other.objects
        return self


def small_packs(usages: Sequence[PackUsage], target: int) -> frozenset[str]:
    """The packs to merge, given what each run of a compaction uses: those whose bytes in use
    in the whole manifest are under :data:`SMALL_PACK_BYTES` and half of ``target``, if merging
    them makes fewer packs. Each run packs its own chunks (its small chunk objects, and its
    chunks of the packs merged) into packs of its own, so the packs are counted run by run:
    merging must write fewer packs than the small packs it replaces plus those the chunk
    objects alone would make. Else it would only copy packs into packs like them, and the next
    compaction would do the same again. A pack some ref names without a digest (an older
    format) is left alone."""
    total = PackUsage({}, set())
    for usage in usages:
        total.add(usage)
    below = min(SMALL_PACK_BYTES, target // 2)
    small = {p for p, size in total.live.items() if size < below and p not in total.undigested}
    if not small:
        return frozenset()
    target = max(1, target)
    merged = objects_alone = 0
    for u in usages:
        in_small = sum(size for p, size in u.live.items() if p in small)
        merged += -(-(u.objects + in_small) // target)
        objects_alone += -(-u.objects // target)
    return frozenset(small) if merged < len(small) + objects_alone else frozenset()


@dataclass(frozen=True)
class ShardRun:
    """A slice of a branch head's manifest, by position, and the shards to cut it into.

    The slice is refs ``skip`` .. ``skip + sum(sizes)`` of ``shards`` read one after another.
    Runs are independent (a Spark task each): every chunk of the manifest falls in exactly one
    run, which packs it if small and puts it into one of the run's new shards.
    """

    shards: tuple[ShardInfo, ...]
    skip: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class RunResult:
    """What a run did (or would do, dry): its new shards, in order, and the chunks it moved."""

    index: list[ShardInfo]
    relocated: list[tuple[str, ChunkRef]]
    small_chunks: int
    small_bytes: int
    packs: int


#: Does the runs (in this process, or in Spark tasks) and returns their results in order:
#: ``runner(runs, dry_run, packs to merge)`` (see :func:`compact_run`).
Runner = Callable[[list[ShardRun], bool, frozenset[str] | None], Iterable[RunResult]]
#: The :func:`pack_usage` of each run (in this process, or in Spark tasks).
Tallier = Callable[[list[ShardRun]], Iterable[PackUsage]]


def plan_runs(index: list[ShardInfo], sizes: list[int], runs: int) -> list[ShardRun]:
    """Split a manifest whose new shards will have ``sizes`` into at most ``runs`` runs."""
    if not sizes:
        return []
    if sum(sizes) != sum(s.count for s in index):
        raise ValueError("the new shards must hold exactly the refs of the old ones")
    starts = [0]
    for info in index:
        starts.append(starts[-1] + info.count)
    per = -(-len(sizes) // max(1, runs))
    out: list[ShardRun] = []
    begin = 0
    for first in range(0, len(sizes), per):
        piece = tuple(sizes[first : first + per])
        end = begin + sum(piece)
        lo = bisect.bisect_right(starts, begin) - 1  # the shard holding ref `begin`
        hi = bisect.bisect_left(starts, end)  # shards from here on start at or after `end`
        out.append(ShardRun(tuple(index[lo:hi]), begin - starts[lo], piece))
        begin = end
    return out


def _run_refs(core: RepositoryCore, run: ShardRun) -> tuple[list[str], list[ChunkRef]]:
    """The keys and refs of ``run``'s slice of the manifest. Raises :class:`CorruptObject` if its
    shards do not hold the refs the snapshot's index gives them."""
    objects = core.objects
    keys: list[str] = []
    refs: list[ChunkRef] = []
    for info in run.shards:
        shard = objects.shard(info, cache=False)  # a pass over every shard: keep readers' cache
        if len(shard.keys) != info.count:  # the positions of every run rest on the counts
            raise CorruptObject(
                manifest_key(info.digest),
                f"holds {len(shard.keys)} refs, the snapshot's index says {info.count}",
            )
        keys.extend(shard.keys)
        refs.extend(shard.refs)
    wanted = sum(run.sizes)
    keys = keys[run.skip : run.skip + wanted]
    refs = refs[run.skip : run.skip + wanted]
    if len(keys) != wanted:
        raise CorruptObject(
            manifest_key(run.shards[0].digest) if run.shards else "manifest",
            f"the shards hold {len(keys)} of the {wanted} refs the snapshot's index gives them",
        )
    return keys, refs


def pack_usage(core: RepositoryCore, run: ShardRun, pack_below: int) -> PackUsage:
    """What ``run``'s slice of the manifest uses of each pack (see :func:`small_packs`)."""
    return PackUsage.of(_run_refs(core, run)[1], pack_below)


def compact_run(
    core: RepositoryCore,
    run: ShardRun,
    pack_below: int,
    target: int,
    dry_run: bool,
    merge: frozenset[str] | None,
) -> RunResult:
    """Pack the small chunk objects of ``run`` and its chunks in the packs of ``merge`` (see
    :func:`small_packs`; None: decided from this run's refs, for a run over the whole manifest)
    into packs of about ``target`` bytes, and cut its refs into its new shards, written unless
    ``dry_run`` (shards that come out unchanged are not rewritten). Nothing is published: the
    one compaction commit names the new shards."""
    objects = core.objects
    keys, refs = _run_refs(core, run)
    if merge is None:
        merge = small_packs([PackUsage.of(refs, pack_below)], target)
    small = [
        i
        for i, ref in enumerate(refs)
        if (ref[0] == OBJECT and ref[2] < pack_below) or (ref[0] == PACKED and ref[1] in merge)
    ]
    groups: list[list[int]] = []
    size = 0
    for i in small:
        if not groups or size + ref_size(refs[i]) > target:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += ref_size(refs[i])
    small_bytes = sum(ref_size(refs[i]) for i in small)
    relocated: list[tuple[str, ChunkRef]] = []
    packs = len(groups)
    if not dry_run:
        packs = 0
        for group in groups:
            moved = 0
            for i, (key, ref) in zip(
                group, write_pack(core, [(keys[i], refs[i]) for i in group]), strict=True
            ):
                if ref != refs[i]:  # a pack written again as it was moves nothing
                    refs[i] = ref
                    relocated.append((key, ref))
                    moved += 1
            packs += moved > 0
        small_bytes = sum(ref_size(ref) for _, ref in relocated)
    index, encoded = manifest.cut(keys, refs, run.sizes)
    if not dry_run:
        unchanged = {info.digest for info in run.shards}
        objects.put_shards({d: b for d, b in encoded.items() if d not in unchanged})
    return RunResult(
        index=index,
        relocated=relocated,
        small_chunks=len(relocated) if not dry_run else len(small),
        small_bytes=small_bytes,
        packs=packs,
    )


def _local_runner(
    core: RepositoryCore, pack_below: int, target: int, progress: Callable[[str, int], None] | None
) -> Runner:
    def run_all(
        runs: list[ShardRun], dry_run: bool, merge: frozenset[str] | None
    ) -> Iterator[RunResult]:
        for run in runs:
            result = compact_run(core, run, pack_below, target, dry_run, merge)
            if progress and result.relocated:
                progress("pack", len(result.relocated))
            yield result

    return run_all


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
    runner: Runner | None = None,
    runs: int = 1,
    tally: Tallier | None = None,
) -> CompactReport:
    """Pack small chunks of ``branch``'s head, re-cut its manifest, prune its old journal.

    Chunk objects under ``pack_below_bytes``, and the chunks of small packs sessions left
    behind (see :data:`SMALL_PACK_BYTES`), go into packs of about ``pack_target_bytes``; journal
    entries older than ``keep_journal`` (at least :data:`~zarrlake.refs.PRUNE_FLOOR`) that
    ``as_of`` cannot need are deleted, their age measured back from ``now`` (default: the clock;
    tests move it forward). The manifest is cut into ``runs`` slices, each packed and re-cut by
    ``runner`` (default: one after another in this process; the Spark engine runs them as
    executor tasks), and one commit publishes the result. With several slices, ``tally`` first
    reads what each uses of each pack (default: in this process), so that which packs are small
    is decided over the whole manifest. Raises
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
                runner or _local_runner(core, pack_below_bytes, pack_target_bytes, progress),
                runs,
                tally or (lambda planned: [pack_usage(core, r, pack_below_bytes) for r in planned]),
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
    runner: Runner,
    runs: int,
    tally: Tallier,
) -> _Packing:
    head_id = core.journal.current(branch).snapshot
    assert head_id is not None
    objects = core.objects
    max_refs = core.config.shard_max_refs
    snap = objects.snapshot(head_id)
    # Re-cut the manifest into evenly filled shards when more than one is under half full;
    # otherwise keep its shards as they are (only those holding packed chunks change).
    undersized = sum(1 for s in snap.shards if s.count < max_refs // 2)
    recut = undersized > 1
    total = sum(s.count for s in snap.shards)
    sizes = manifest.balanced_sizes(total, max_refs) if recut else [s.count for s in snap.shards]
    planned = plan_runs(snap.shards, sizes, runs)
    # One run reads the whole manifest and decides as it goes. Several runs each see a part of
    # a pack's chunks: what each uses of each pack is tallied first.
    merge = small_packs(list(tally(planned)), target) if len(planned) > 1 else None
    results = list(runner(planned, dry_run, merge))

    index = [info for r in results for info in r.index]
    small = sum(r.small_chunks for r in results)

    def outcome(shards_after: int, snapshot: str | None = None) -> _Packing:
        return _Packing(
            packed_chunks=small,
            packed_bytes=sum(r.small_bytes for r in results),
            packs_written=sum(r.packs for r in results),
            shards_before=len(snap.shards),
            shards_after=shards_after,
            snapshot=snapshot,
        )

    if not small and not recut:
        return outcome(len(snap.shards))
    if dry_run:
        return outcome(len(index))

    changes = ChunkChanges({k: ref for r in results for k, ref in r.relocated})
    changeset = Changeset(uuid.uuid4().hex, head_id, chunks=changes)
    packs = sum(r.packs for r in results)
    new_id = core.commits.commit(
        branch,
        changeset,
        message=f"Compaction: packed {len(changes)} chunk(s) into {packs} pack(s)",
        author="zarrlake compaction",
        metadata={"compaction": {"packed_chunks": len(changes), "packs": packs}},
        rebase=True,
        policy=Relocation(),
        reshard=recut,
        prebuilt=ManifestUpdate(index, {}),
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
    if entries and not dry_run:
        # Only the head's marker is ever trusted; older ones only fill the listings of refs.
        core.journal.prune_markers(branch, entries[0].seq)
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

"""Garbage collection: mark what retained history needs, sweep old objects nothing needs.

Mark: from every branch head and tag, every journal entry younger than the grace period, and each
branch's head as it was when the grace period began (a session opened then may still be running),
walk parents (stopping at expired snapshots) and mark snapshots, txlogs, manifest shards, chunk
objects and packs. Sweep: delete unmarked objects whose modification time is older than the grace
period, re-checking that time just before each delete (a session that deduplicated against an old
object rewrote it, so it looks young). With a lock service, the sweep's deletes and a commit's check
of its deduplicated chunks exclude each other, which closes the last window.

Memory stays bounded: chunk marks are exact (a sorted array of 32-byte digests) up to a limit and a
Bloom filter beyond it — a false positive only keeps a garbage object; it can never delete a live
one — shards are read once without filling the client's cache, and the listing is judged a page
at a time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import time
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from typing import Any

import numpy as np

from zarrlake.commit import GC_LOCK_BRANCH
from zarrlake.config import MAX_SESSION_TTL
from zarrlake.core import RepositoryCore
from zarrlake.errors import GraceTooShort, RefNotFound
from zarrlake.format.model import OBJECT, PACKED, ShardInfo, Snapshot
from zarrlake.history import index_pages
from zarrlake.storage.base import ObjectInfo
from zarrlake.units import format_bytes

__all__ = [
    "GC_LOCK_BRANCH",
    "KINDS",
    "BloomFilter",
    "ChunkMarks",
    "GCReport",
    "GraceTooShort",
    "KindCount",
    "MarkPlan",
    "Tally",
    "gc",
    "gc_roots",
    "object_id",
    "plan_mark",
    "report",
    "shard_marks",
    "sweep",
]

# Sweep order: roots first. ``history``: history pages (the index log() reads).
KINDS = ("snapshots", "txlogs", "history", "manifests", "chunks", "packs")


class BloomFilter:
    """Bits in a numpy array; k hash positions carved out of one SHA-256 of the item."""

    def __init__(self, capacity: int, error_rate: float = 1e-4) -> None:
        bits = int(-capacity * np.log(error_rate) / (np.log(2) ** 2)) + 64
        self.size = bits
        self.k = max(1, min(8, round(bits / capacity * np.log(2))))
        self.bits = np.zeros((bits + 7) // 8, dtype=np.uint8)

    def _positions(self, item: bytes) -> list[int]:
        digest = hashlib.sha256(item).digest()
        return [
            int.from_bytes(digest[4 * i : 4 * i + 4], "little") % self.size for i in range(self.k)
        ]

    def add(self, item: bytes) -> None:
        for p in self._positions(item):
            self.bits[p >> 3] |= 1 << (p & 7)

    def __contains__(self, item: bytes) -> bool:
        return all(self.bits[p >> 3] & (1 << (p & 7)) for p in self._positions(item))


class ChunkMarks:
    """Marked chunk digests: exact up to ``exact_limit``, then a Bloom filter (bounded memory).

    Exact marks are a sorted numpy array of 32-byte digests — 32 bytes a mark, where a Python set
    of ``bytes`` takes about 150 — plus the digests added since it was last sorted. Digests of
    another length (not 32 bytes: neither SHA-256 nor BLAKE3, nothing zarrlake writes) are kept
    in a plain set.
    """

    WIDTH = 32
    _MIN_FLUSH = 65_536

    def __init__(self, expected: int, exact_limit: int = 1_000_000) -> None:
        self._sorted: np.ndarray | None = np.empty(0, dtype=f"S{self.WIDTH}")
        self._pending = bytearray()
        self._odd: set[bytes] = set()
        self._bloom: BloomFilter | None = None
        self._limit = exact_limit
        self._expected = max(expected, exact_limit)

    def add(self, digest: bytes) -> None:
        if self._bloom is not None:
            self._bloom.add(digest)
        elif len(digest) != self.WIDTH:
            self._odd.add(digest)
        else:
            self._pending += digest
            assert self._sorted is not None
            if len(self._pending) >= self.WIDTH * max(self._MIN_FLUSH, len(self._sorted) // 2):
                self._flush()

    def _flush(self) -> None:
        """Merge the pending digests into the sorted array; past the limit, become a Bloom
        filter."""
        if self._sorted is None or not self._pending:
            return
        new = np.frombuffer(self._pending, dtype=self._sorted.dtype).copy()
        self._pending = bytearray()
        new.sort()
        if len(new) > 1:
            new = new[np.concatenate(([True], new[1:] != new[:-1]))]
        if len(self._sorted):
            pos = np.searchsorted(self._sorted, new)
            hit = pos < len(self._sorted)
            hit[hit] = self._sorted[pos[hit]] == new[hit]
            self._sorted = np.insert(self._sorted, pos[~hit], new[~hit])
        else:
            self._sorted = new
        if len(self._sorted) + len(self._odd) > self._limit:
            self._bloom = BloomFilter(self._expected * 2)
            for d in self._sorted.tolist():
                self._bloom.add(d.ljust(self.WIDTH, b"\0"))  # numpy drops trailing NULs
            for d in self._odd:
                self._bloom.add(d)
            self._sorted, self._odd = None, set()

    def __contains__(self, digest: bytes) -> bool:
        return bool(self.contains_many([digest])[0])

    def contains_many(self, digests: list[bytes]) -> list[bool]:
        """Whether each digest is marked (one vectorized lookup for a page of a listing)."""
        self._flush()
        if self._bloom is not None:
            return [d in self._bloom for d in digests]
        assert self._sorted is not None
        out = [d in self._odd for d in digests]
        even = [i for i, d in enumerate(digests) if len(d) == self.WIDTH]
        if even and len(self._sorted):
            q = np.array([digests[i] for i in even], dtype=self._sorted.dtype)
            pos = np.searchsorted(self._sorted, q)
            found = pos < len(self._sorted)
            found[found] = self._sorted[pos[found]] == q[found]
            for i, f in zip(even, found.tolist(), strict=True):
                out[i] = f
        return out

    @property
    def exact(self) -> bool:
        self._flush()
        return self._bloom is None


@dataclass(frozen=True)
class KindCount:
    """Objects of one kind (a prefix such as ``chunks``) deleted and kept by a GC run."""

    deleted: int = 0
    deleted_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0


@dataclass
class Tally:
    """A :class:`KindCount` while the sweep is still counting."""

    deleted: int = 0
    deleted_bytes: int = 0
    kept: int = 0
    kept_bytes: int = 0

    def count(self) -> KindCount:
        return KindCount(self.deleted, self.deleted_bytes, self.kept, self.kept_bytes)


@dataclass(frozen=True)
class GCReport:
    """What a GC run deleted (or would have, with ``dry_run``) and kept, in total and by kind."""

    deleted_objects: int = 0
    deleted_bytes: int = 0
    kept_objects: int = 0
    dry_run: bool = False
    kept_bytes: int = 0
    by_kind: dict[str, KindCount] = dataclasses.field(
        default_factory=lambda: {k: KindCount() for k in KINDS}
    )
    marked_snapshots: int = 0
    skipped_young: int = 0
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The job-report form (``zarrlake gc --json``; the operator parses it)."""
        return {
            "deleted_objects": self.deleted_objects,
            "deleted_bytes": self.deleted_bytes,
            "kept_objects": self.kept_objects,
            "kept_bytes": self.kept_bytes,
            "dry_run": self.dry_run,
            "marked_snapshots": self.marked_snapshots,
            "skipped_young": self.skipped_young,
            "by_kind": {k: dataclasses.asdict(v) for k, v in self.by_kind.items()},
            "duration_s": round(self.duration_s, 3),
        }

    def summary(self) -> str:
        """One line for people."""
        verb = "would delete" if self.dry_run else "deleted"
        return (
            f"{verb} {self.deleted_objects} object(s) ({format_bytes(self.deleted_bytes)}), kept "
            f"{self.kept_objects} ({format_bytes(self.kept_bytes)}) in {self.duration_s:.2f}s"
        )


def object_id(key: str) -> str:
    """The id (digest or snapshot id) an object's key ends in."""
    return key.rsplit("/", 1)[1]


def gc_roots(core: RepositoryCore, cutoff: dt.datetime, expired: Set[str]) -> set[str]:
    """Snapshots GC keeps whatever else happens: branch heads, tags, journal entries younger than
    ``cutoff`` plus each branch's head as of ``cutoff`` (sessions opened since may still be
    running), and older journal entries (for ``as_of``) unless their snapshot was expired."""
    # Each record read, not its marker: what GC keeps rests on the records themselves.
    roots = set(core.tags.all(records_only=True).values())
    for name in core.journal.names():
        entries = core.journal.history(name)  # newest first
        protected = True
        for i, entry in enumerate(entries):
            if entry.snapshot is not None and (
                i == 0 or protected or entry.snapshot not in expired
            ):
                roots.add(entry.snapshot)
            if entry.time < cutoff:
                protected = False  # this entry was the head at the cutoff; older ones are history
    return roots


@dataclass
class MarkPlan:
    """What the driver of a GC run decides before any chunk is marked: the time line, the
    retained snapshots, their history pages, and the manifest shards whose references are live
    (each once). Small: it grows with snapshots and shards, never with chunks."""

    now: dt.datetime
    cutoff: dt.datetime
    snapshots: set[str]
    pages: set[str]
    shards: list[ShardInfo]

    @property
    def shard_ids(self) -> set[str]:
        return {info.digest for info in self.shards}


def plan_mark(
    core: RepositoryCore,
    *,
    grace: dt.timedelta,
    force: bool = False,
    now: dt.datetime | None = None,
) -> MarkPlan:
    """The first phase of every GC engine. Raises :class:`GraceTooShort` for a ``grace`` under
    the longest session lifetime unless ``force``."""
    if grace < MAX_SESSION_TTL and not force:
        raise GraceTooShort(
            f"grace period {grace} is shorter than the longest session lifetime "
            f"({MAX_SESSION_TTL}); a running session could lose its uploads "
            "(force it with force=True or --force)"
        )
    now = now or dt.datetime.now(dt.UTC)
    cutoff = now - grace
    expired = core.expiry.expired(refresh=True)
    objects = core.objects
    snapshots: set[str] = set()
    retained = gc_roots(core, cutoff, expired)
    # A mirror holds the data of the snapshots its refs showed, and only the history of the
    # commits it skipped: their shards were never there to mark.
    data_roots = retained if core.is_mirror else None
    stack = list(retained)
    loaded: list[Snapshot] = []
    while stack:
        sid = stack.pop()
        if sid in snapshots:
            continue
        try:
            snap = objects.snapshot(sid)
        except RefNotFound:
            continue
        snapshots.add(sid)
        loaded.append(snap)
        stack.extend(p for p in snap.parents if p not in snapshots and p not in expired)
    # History pages the retained snapshots name, and the older pages those name while they still
    # hold retained commits. A missing or unreadable page is not GC's concern (log() reads the
    # snapshots instead; fsck reports it).
    roots = [d for snap in loaded if snap.index is not None for d in snap.index.pages]
    pages = {digest for digest, _, _ in index_pages(objects, roots, snapshots)}
    shards: dict[str, ShardInfo] = {}
    for snap in loaded:
        if data_roots is None or snap.id in data_roots:
            for info in snap.shards:
                shards.setdefault(info.digest, info)
    return MarkPlan(now, cutoff, snapshots, pages, list(shards.values()))


def shard_marks(core: RepositoryCore, info: ShardInfo) -> Iterator[tuple[int, bytes | str]]:
    """The live references one manifest shard holds: ``(OBJECT, digest)`` for a chunk object,
    ``(PACKED, pack id)`` for a pack. Read once, not cached: a GC pass would otherwise fill the
    client's shard cache."""
    for ref in core.objects.shard(info, cache=False).refs:
        if ref[0] == OBJECT or ref[0] == PACKED:
            yield ref[0], ref[1]


def gc(
    core: RepositoryCore,
    *,
    grace: dt.timedelta = dt.timedelta(days=7),
    dry_run: bool = False,
    force: bool = False,
    now: dt.datetime | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> GCReport:
    """Collect garbage (see the module docstring) and report what went and what stayed.

    ``now`` is the time the grace period is measured back from (default: the clock);
    ``progress(phase, count)`` is called as shards are marked and objects swept. Raises
    :class:`GraceTooShort` for a ``grace`` under the longest session lifetime unless ``force``.
    """
    started = time.monotonic()
    plan = plan_mark(core, grace=grace, force=force, now=now)
    cutoff, snapshots, pages = plan.cutoff, plan.snapshots, plan.pages
    shards = plan.shard_ids

    # -- mark ------------------------------------------------------------------------------------
    packs: set[str] = set()
    marks = ChunkMarks(sum(info.count for info in plan.shards))
    for info in plan.shards:
        for what, ref in shard_marks(core, info):
            if what == OBJECT:
                assert isinstance(ref, bytes)
                marks.add(ref)
            else:
                assert isinstance(ref, str)
                packs.add(ref)
        if progress:
            progress("mark", 1)

    def live(kind: str, page: list[ObjectInfo]) -> list[bool]:
        ids = [object_id(o.key) for o in page]
        if kind in ("snapshots", "txlogs"):
            return [oid in snapshots for oid in ids]
        if kind == "manifests":
            return [oid in shards for oid in ids]
        if kind == "history":
            return [oid in pages for oid in ids]
        if kind == "packs":
            return [oid in packs for oid in ids]
        digests: list[bytes] = []
        odd: set[int] = set()  # not a name we write: leave it alone
        for i, oid in enumerate(ids):
            try:
                digests.append(bytes.fromhex(oid))
            except ValueError:
                digests.append(b"")
                odd.add(i)
        return [m or i in odd for i, m in enumerate(marks.contains_many(digests))]

    # -- sweep -------------------------------------------------------------------------------------
    tallies = {k: Tally() for k in KINDS}
    skipped_young = 0
    for kind in KINDS:
        tally = tallies[kind]
        batch: list[ObjectInfo] = []
        # A page of the listing at a time: chunk marks are looked up for a page at once, and no
        # more of a listing of millions of objects is held than one page.
        for page in _pages(core.storage.list(kind + "/"), 10_000):
            for obj, is_live in zip(page, live(kind, page), strict=True):
                if is_live or obj.modified > cutoff:
                    if not is_live:
                        skipped_young += 1
                    tally.kept += 1
                    tally.kept_bytes += obj.size
                    continue
                batch.append(obj)
                if len(batch) >= SWEEP_BATCH:
                    sweep(core, batch, tally, cutoff, dry_run, progress)
                    batch = []
        if batch:
            sweep(core, batch, tally, cutoff, dry_run, progress)

    return report(tallies, dry_run, len(snapshots), skipped_young, time.monotonic() - started)


#: Objects deleted per sweep batch (one ``delete_stale`` call under the GC lease).
SWEEP_BATCH = 1000


def report(
    tallies: dict[str, Tally],
    dry_run: bool,
    marked_snapshots: int,
    skipped_young: int,
    duration_s: float,
) -> GCReport:
    """The :class:`GCReport` of a sweep's tallies (either engine)."""
    by_kind = {k: tallies.get(k, Tally()).count() for k in KINDS}
    return GCReport(
        deleted_objects=sum(c.deleted for c in by_kind.values()),
        deleted_bytes=sum(c.deleted_bytes for c in by_kind.values()),
        kept_objects=sum(c.kept for c in by_kind.values()),
        dry_run=dry_run,
        kept_bytes=sum(c.kept_bytes for c in by_kind.values()),
        by_kind=by_kind,
        marked_snapshots=marked_snapshots,
        skipped_young=skipped_young,
        duration_s=duration_s,
    )


def _pages(items: Iterator[ObjectInfo], size: int) -> Iterator[list[ObjectInfo]]:
    page: list[ObjectInfo] = []
    for item in items:
        page.append(item)
        if len(page) >= size:
            yield page
            page = []
    if page:
        yield page


def sweep(
    core: RepositoryCore,
    batch: list[ObjectInfo],
    tally: Tally,
    cutoff: dt.datetime,
    dry_run: bool,
    progress: Callable[[str, int], None] | None,
) -> None:
    """Delete the objects of ``batch`` that are still stale (older than ``cutoff``), counting
    into ``tally``; with ``dry_run``, only count."""
    if dry_run:
        tally.deleted += len(batch)
        tally.deleted_bytes += sum(i.size for i in batch)
        return
    storage = core.storage
    # Judge each object again as it is deleted: a session may have refreshed a deduplicated
    # object since it was listed. Storage that deletes "if still stale" atomically (local, memory)
    # never loses such a refresh. Elsewhere (S3) the check and the delete are two requests: with a
    # lock, commits that deduplicated wait while we hold it, so the whole batch goes at once;
    # without one, a few objects at a time keep the window in which a refresh goes unseen to one
    # round trip.
    unguarded = core.lock is None and not storage.atomic_stale_delete
    step = max(1, storage.concurrency) if unguarded else len(batch)
    for start in range(0, len(batch), step):
        part = batch[start : start + step]
        with core.commits.hold_gc():
            doomed, kept = storage.delete_stale((i.key for i in part), cutoff)
        for i in doomed:  # this client must not go on serving what it just deleted from cache
            if i.key.startswith(("snapshots/", "txlogs/")):
                core.objects.forget(object_id(i.key))
        tally.deleted += len(doomed)
        tally.deleted_bytes += sum(i.size for i in doomed)
        tally.kept += len(kept)
        tally.kept_bytes += sum(f.size for f in kept)
    if progress:
        progress("sweep", len(batch))

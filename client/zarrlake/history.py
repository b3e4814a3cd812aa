"""History: resolving refs, walking commits, ancestry, merge bases, time travel and diffs.

Reads only: nothing here writes a ref or a snapshot, except :meth:`ExpiryLog.record`, which
appends one immutable expiry record. History ends cleanly at snapshots taken out of it by expiry
(:class:`ExpiryLog`): a walk stops there and says so instead of reporting a missing object.
"""

from __future__ import annotations

import datetime as dt
import functools
import heapq
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from typing import Any

from zarrlake.errors import (
    AmbiguousRef,
    CorruptObject,
    InvalidName,
    ListingUnsupported,
    RefNotFound,
    UnsupportedFormat,
)
from zarrlake.format import manifest
from zarrlake.format.codec import gc_paused
from zarrlake.format.ids import (
    canonical_id,
    content_hash,
    is_snapshot_id,
    is_snapshot_id_prefix,
    new_snapshot_id,
)
from zarrlake.format.model import (
    AncestorRecord,
    ExpiryRecord,
    HistoryIndex,
    HistoryPage,
    Snapshot,
    expiry_key,
    history_page_key,
    snapshot_key,
    to_micros,
)
from zarrlake.nodes import array_paths, meta_key_node, node_paths, split_chunk_key
from zarrlake.objects import ObjectStore
from zarrlake.published import PublishedRoot
from zarrlake.refs import BranchJournal, Tags, validate_name
from zarrlake.storage.base import Storage
from zarrlake.types import CommitInfo, Diff

log = logging.getLogger("zarrlake")

#: The prefix expiry records live under (one immutable object per expiry run).
EXPIRY_PREFIX = "expired/"


_new = object.__new__


def _record_info(
    sid: str,
    parents: tuple[str, ...],
    message: str,
    author: str | None,
    time: dt.datetime,
    metadata: dict[str, Any],
) -> CommitInfo:
    """``CommitInfo(sid, parents, message, author, time, metadata)``, for the thousand records of
    a history page: a frozen dataclass's ``__init__`` sets its fields one by one through
    ``object.__setattr__``; this fills the new instance's ``__dict__`` in one step (twice as
    fast, and the same object: a test compares the two)."""
    info: CommitInfo = _new(CommitInfo)
    vars(info).update(
        id=sid, parents=parents, message=message, author=author, time=time, metadata=metadata
    )
    return info


def commit_info(snap: Snapshot) -> CommitInfo:
    """The public record of a snapshot."""
    return CommitInfo(
        snap.id, tuple(snap.parents), snap.message, snap.author, snap.time, dict(snap.metadata)
    )


class ExpiryLog:
    """Which snapshots expiry took out of history. Records are immutable, so they are cached;
    :meth:`expired` with ``refresh=True`` lists the records again to see new ones."""

    def __init__(self, storage: Storage, published: PublishedRoot | None = None) -> None:
        self.storage = storage
        # A repository's published root, which holds the expired ids while they are few.
        self.published = published
        self._records: dict[str, frozenset[str]] = {}
        self._expired: frozenset[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "published": self.published}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state.get("published"))  # type: ignore[misc]

    def expired(self, *, refresh: bool = False, published: bool = False) -> frozenset[str]:
        """Ids of every expired snapshot, from the expiry records (as of the last refresh; the
        first call refreshes): what fsck, GC, expiry and compaction rest on.

        ``published``: where the repository's published root holds them, from the root instead
        (no listing: ``log()``, in the same read as its ref; the newest root this client has
        seen, or one read of it with ``refresh``). A root behind the records (an expiry whose
        writer died before publishing) shows fewer: a log then walks on to the expired parent
        and ends there as it ends at a missing one."""
        if published and self.published is not None:
            root = self.published.read() if refresh else self.published.cached()
            if root is None and not refresh:
                root = self.published.read()
            if root is not None and root.expired is not None:
                return root.expired
        if not self.storage.supports_listing:
            # Records cannot be found without a listing (plain HTTP): a log then walks on
            # until a snapshot is missing, which garbage collection makes of expired ones.
            self._expired = frozenset()
            return self._expired
        if refresh or self._expired is None:
            keys = self.storage.list_keys(EXPIRY_PREFIX)
            missing = [k for k in keys if k not in self._records]
            datas: list[bytes] = self.storage.map(self.storage.get, missing)
            for key, data in zip(missing, datas, strict=True):
                self._records[key] = frozenset(ExpiryRecord.decode(data, key).snapshots)
            self._expired = frozenset().union(*(self._records[k] for k in keys))
        return self._expired

    def records(self) -> dict[str, frozenset[str]]:
        """Every expiry record: key -> the snapshot ids it expired (a listing, then a read of
        each record not read before)."""
        self.expired(refresh=True)
        return dict(self._records)

    def record(self, when: dt.datetime, snapshot_ids: tuple[str, ...]) -> None:
        """Write one expiry record taking ``snapshot_ids`` out of history (create-only)."""
        record = ExpiryRecord(when, snapshot_ids)
        key = expiry_key(new_snapshot_id())
        self.storage.put(key, record.encode(), create_only=True)
        self._records[key] = frozenset(snapshot_ids)
        if self.published is not None:
            self.published.publish(lambda r: r.with_expired({key: frozenset(snapshot_ids)}))
        self.expired(refresh=True)


class History(Iterator[CommitInfo]):
    """The iterator :meth:`Repository.log` returns: commits newest first, merge parents included.

    ``truncated`` lists ``(child, parent)`` pairs where history ends because ``parent`` was
    expired (or is missing); it fills as the iteration reaches them.
    """

    def __init__(
        self,
        objects: ObjectStore,
        expiry: ExpiryLog,
        first: Snapshot,
        limit: int | None,
        marks: Callable[[], frozenset[str]] | None = None,
        recent: HistoryPage | None = None,
        carried: Mapping[str, bytes] | None = None,
    ) -> None:
        """``marks`` gives the ids of expired snapshots when the walk first looks past ``first``
        (a read already started, say); by default, ``expiry`` lists them then. ``recent``:
        records of ``first``'s ancestors known already (the published root's recent history);
        ``carried``: history pages at hand (digest -> bytes, the root's), read instead."""
        self.truncated: list[tuple[str, str]] = []
        self._objects = objects
        self._carried = carried or {}
        if marks is None:
            marks = functools.partial(expiry.expired, refresh=True)
        self._it = self._walk(marks, first, limit, recent)

    def __iter__(self) -> History:
        return self

    def __next__(self) -> CommitInfo:
        return next(self._it)

    def _truncated_at(self, child: str, parent: str) -> None:
        self.truncated.append((child, parent))
        log.info("history ends at %s: its parent %s was expired", child, parent)

    def _walk(
        self,
        marks: Callable[[], frozenset[str]],
        first: Snapshot,
        limit: int | None,
        recent: HistoryPage | None,
    ) -> Iterator[CommitInfo]:
        records = CommitRecords(self._objects, self._carried)
        records.learn(first)
        if recent is not None:
            records.take(recent)
        # The expiry marks and, unless the head's own records cover the limit, the newest history
        # pages: one concurrent round, when the walk first looks past the head (the head's own
        # record is known: ``log(limit=1)``, taken alone, reads nothing more).
        prefetch = (limit is None or limit > len(records.known)) and not records.complete()
        # With a limit, only the pages it can reach (each holds up to PAGE records).
        wanted = None if limit is None else -(-(limit - len(records.known)) // HistoryIndex.PAGE)
        expired: frozenset[str] | None = None
        heap = [(-to_micros(first.time), first.id)]
        seen = {first.id}
        known = records.known  # grows as pages are read; every id on the heap is in it
        produced = 0
        while heap and (limit is None or produced < limit):
            _, sid = heapq.heappop(heap)
            commit = known[sid]
            if expired is not None and not heap:
                # A linear stretch through records at hand (most of any history): gathered in
                # a tight loop and handed out in one step; where it ends (a merge, an expired,
                # seen or unknown parent, the limit) the general step below takes over.
                run = [commit]
                while limit is None or produced + len(run) < limit:
                    parents = commit.parents
                    if len(parents) != 1:
                        break
                    parent = parents[0]
                    if parent in seen or parent in expired:
                        break
                    following = known.get(parent)
                    if following is None:
                        break
                    seen.add(parent)
                    run.append(following)
                    commit = following
                produced += len(run)
                sid = commit.id  # the run's last: whose parents the general step looks at
                yield from run
            else:
                yield commit
                produced += 1
            if expired is None:
                expired = records.fetch_pages(marks, expiry_only=not prefetch, at_most=wanted)
            for parent in commit.parents:
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in expired:
                    self._truncated_at(sid, parent)
                    continue
                info = known.get(parent)
                if info is None:
                    try:
                        info = records.info(parent)
                    except RefNotFound:
                        self._truncated_at(sid, parent)
                        continue
                if not heap and len(commit.parents) == 1:
                    # A linear stretch: the one candidate is taken next, whatever its time.
                    heap.append((0, parent))
                    continue
                heapq.heappush(heap, (-to_micros(info.time), parent))


class CommitRecords:
    """Commit records by snapshot id, learned from snapshots and history pages.

    A record is a copy of an immutable snapshot's header, so a record from anywhere is as good
    as the snapshot's own: the history index only decides how few reads find them. A commit the
    pages do not hold (history older than the index, a missing or corrupt page) is read from its
    snapshot, exactly as a walk without an index would, so the answer never depends on the index.
    """

    def __init__(self, objects: ObjectStore, carried: Mapping[str, bytes] | None = None) -> None:
        self.objects = objects
        self._carried = carried or {}
        self.known: dict[str, CommitInfo] = {}
        self._pending: list[str] = []  # page digests named but not read yet, newest first
        self._asked: set[str] = set()

    def learn(self, snap: Snapshot) -> None:
        """Take the records ``snap`` carries, and queue the pages its index names."""
        self.known[snap.id] = commit_info(snap)
        self._add(snap.ancestry, snap.history)
        if snap.index is not None:
            self._queue(snap.index.pages)

    def take(self, page: HistoryPage) -> None:
        """Take the records of ``page`` (without following the pages it names)."""
        self._add(page.ids, page.records)

    def complete(self) -> bool:
        """Whether every parent of every known record is known (a short history read whole)."""
        return all(p in self.known for c in self.known.values() for p in c.parents)

    def _add(self, ids: Iterable[str], records: Iterable[AncestorRecord]) -> None:
        known = self.known
        with gc_paused():
            for aid, (parents, time, author, message, metadata) in zip(ids, records, strict=False):
                if aid not in known:
                    # The metadata is copied: the record stays cached with its page.
                    known[aid] = _record_info(aid, parents, message, author, time, dict(metadata))

    def _queue(self, digests: Iterable[str]) -> None:
        for digest in digests:
            if digest not in self._asked:
                self._asked.add(digest)
                self._pending.append(digest)

    def _page(self, digest: str) -> tuple[str, ...] | None:
        """Take the records of page ``digest`` and return the digests of the pages before it
        (None if the page cannot be had: the walk then reads snapshots)."""
        page = self._carried.get(digest)
        if page is not None:
            # The root carried it: good if it is the page its digest names, as a read checks.
            try:
                if content_hash(page) == digest:
                    return HistoryPage.decode_into(
                        page, CommitInfo, self.known, history_page_key(digest)
                    )
            except (CorruptObject, UnsupportedFormat):
                pass
            log.warning("the root's copy of history page %s is damaged: reading it", digest)
        try:
            read = self.objects.history_page(digest)
        except RefNotFound:
            log.warning("history page %s is missing: reading snapshots instead", digest)
            return None
        except (CorruptObject, UnsupportedFormat) as e:
            log.warning("history page %s is unreadable (%s): reading snapshots instead", digest, e)
            return None
        self._add(read.ids, read.records)
        return read.older

    def fetch_pages(
        self,
        marks: Callable[[], frozenset[str]] | None = None,
        *,
        expiry_only: bool = False,
        at_most: int | None = None,
    ) -> frozenset[str]:
        """Read the queued pages (the newest ``at_most`` of them, default all) in one concurrent
        round — with ``marks``, the expiry marks it gives too, and return them (empty without).
        ``expiry_only``: read no pages."""
        take = 0 if expiry_only else len(self._pending) if at_most is None else max(at_most, 0)
        digests, self._pending = self._pending[:take], self._pending[take:]
        expired: frozenset[str] = frozenset()
        if all(d in self._carried for d in digests):
            # Nothing to read (the root carried every page; the marks are at hand or already
            # on their way): decoded here, without a hand-off to the pool's threads, which a
            # fresh client would start for it.
            olders = [self._page(d) for d in digests]
            if marks is not None:
                expired = marks()
        else:

            def step(i: int) -> tuple[str, ...] | None:
                nonlocal expired
                if i == len(digests):
                    assert marks is not None
                    expired = marks()
                    return None
                return self._page(digests[i])

            steps = range(len(digests) + (marks is not None))
            olders = self.objects.storage.map_reads(step, steps)
        for older in olders:
            if older is not None:
                self._queue(older)
        return expired

    def info(self, sid: str) -> CommitInfo:
        """The record of snapshot ``sid``: known already, else from the pages queued so far
        (one concurrent round), else from its snapshot. Raises :class:`RefNotFound`."""
        if sid not in self.known and self._pending:
            self.fetch_pages()
        if sid not in self.known:
            self.learn(self.objects.snapshot(sid))  # RefNotFound if it is gone
        return self.known[sid]


def index_pages(
    objects: ObjectStore, roots: Iterable[str], keep: Set[str]
) -> Iterator[tuple[str, HistoryPage | None, Exception | None]]:
    """Every history page reachable from the pages ``roots`` names, for GC and fsck: yields
    (digest, page or None, the error that made it None). A page's older pages are followed only
    when the page holds a commit in ``keep`` — past that, history was expired and its pages are
    garbage."""
    todo = list(dict.fromkeys(roots))
    seen = set(todo)
    while todo:
        batch, todo = todo, []

        def read(digest: str) -> tuple[str, HistoryPage | None, Exception | None]:
            try:
                return digest, objects.history_page(digest), None
            except (RefNotFound, CorruptObject, UnsupportedFormat) as e:
                return digest, None, e

        for digest, page, error in objects.storage.map(read, batch):
            yield digest, page, error
            if page is not None and any(i in keep for i in page.ids):
                for older in page.older:
                    if older not in seen:
                        seen.add(older)
                        todo.append(older)


def diff_nodes(
    old: Mapping[str, bytes], new: Mapping[str, bytes], chunks: dict[str, set[tuple[Any, ...]]]
) -> Diff:
    """A :class:`Diff` from two versions' node documents and the chunks that changed."""
    old_paths, new_paths = node_paths(old), node_paths(new)
    changed = {
        meta_key_node(k)
        for k in set(old) | set(new)
        if old.get(k) != new.get(k) and meta_key_node(k) in old_paths & new_paths
    }
    return Diff.build(new_paths - old_paths, old_paths - new_paths, changed, chunks)


class CommitGraph:
    """Refs and the commit graph, read-only: resolve, log, as-of, merge base, diff."""

    def __init__(
        self, objects: ObjectStore, journal: BranchJournal, tags: Tags, expiry: ExpiryLog
    ) -> None:
        self.objects = objects
        self.journal = journal
        self.tags = tags
        self.expiry = expiry

    def resolve(self, ref: str) -> str:
        """Branch, tag or snapshot id -> snapshot id. Raises :class:`RefNotFound`."""
        return self.locate(ref)[0]

    def locate(self, ref: str) -> tuple[str, bool]:
        """(snapshot id, whether ``ref`` names a live branch) of a branch, tag or snapshot id.

        One read of the ref: a branch's head entry carries its snapshot, which lands in the
        object cache. Raises :class:`RefNotFound`.
        """
        if not isinstance(ref, str) or not ref:
            raise RefNotFound(str(ref))
        canonical = canonical_id(ref)
        if is_snapshot_id(canonical):
            try:
                self.objects.snapshot(canonical)
                return canonical, False
            except RefNotFound:
                pass
        try:
            validate_name(ref)
            named = True
        except InvalidName:
            named = False
        if named:
            head = self.journal.published_head(ref)
            if head is not None and head.snapshot is not None:
                return head.snapshot, True
            try:
                return self.tags.get(ref), False
            except RefNotFound:
                pass
        if is_snapshot_id_prefix(canonical):
            found = self._by_prefix(ref, canonical)
            if found is not None:
                return found, False
        if not named:
            raise RefNotFound(ref)
        raise self.journal.missing(ref, "ref")

    def locate_ahead(self, ref: str) -> tuple[str, Callable[[], str]] | None:
        """For a reader on a far away store: the head of branch ``ref`` as the newest root this
        client has seen says, without a request, and the function that gives the head as it is
        now, read from a root whose read starts here. None where that cannot be: a ref that is
        not a branch there, a head whose snapshot is not at hand, a repository without a
        published root, a client that publishes through a commit service, or a storage whose
        reads cost less than the thread they would start on (:meth:`locate` then answers). A
        branch gone meanwhile: the function raises :class:`RefNotFound`."""
        journal = self.journal
        if journal.published is None or self.objects.storage.inline_read_bytes:
            return None
        if journal.remote is not None:
            # This client's commits are published by a commit service, not here: they could
            # not wait for this read, which might then show a commit made after the call.
            return None
        if not isinstance(ref, str) or is_snapshot_id(canonical_id(ref)):
            return None
        try:
            validate_name(ref)
        except InvalidName:
            return None
        entry = journal.cached_published_head(ref)
        if entry is None or entry.snapshot is None:
            return None
        if self.objects.cached_snapshot(entry.snapshot) is None:
            return None
        current = journal.published_current_ahead(ref)

        def now() -> str:
            sid = current().snapshot
            assert sid is not None  # a live head
            return sid

        return entry.snapshot, now

    #: How many of the snapshots a short id could name an :class:`AmbiguousRef` lists.
    CANDIDATES = 8

    def _by_prefix(self, ref: str, prefix: str) -> str | None:
        """The one snapshot whose id starts with ``prefix`` (a short id, as ``log`` prints), or
        None if none does. One listing; a storage that cannot list finds none. Raises
        :class:`AmbiguousRef` if several do."""
        folder = snapshot_key("")
        try:
            keys = self.objects.storage.list_keys(folder + prefix, limit=self.CANDIDATES + 1)
        except ListingUnsupported:
            return None
        ids = [sid for key in keys if is_snapshot_id(sid := key[len(folder) :])]
        if len(ids) > 1:
            raise AmbiguousRef(ref, ids[: self.CANDIDATES], more=len(ids) > self.CANDIDATES)
        return ids[0] if ids else None

    def log(
        self,
        snapshot_id: str,
        *,
        limit: int | None = None,
        marks: Callable[[], frozenset[str]] | None = None,
        recent: HistoryPage | None = None,
        carried: Mapping[str, bytes] | None = None,
    ) -> History:
        """Commits reachable from ``snapshot_id``, newest first; stops at expired snapshots
        (``marks``, ``recent``, ``carried``: see :class:`History`).

        Raises :class:`RefNotFound` if the snapshot itself is missing.
        """
        first = self.objects.snapshot(snapshot_id)
        return History(self.objects, self.expiry, first, limit, marks, recent, carried)

    def log_ref(self, ref: str, *, limit: int | None = None) -> History:
        """:meth:`log` of what ``ref`` resolves to. A walk that will go past the head needs the
        expiry marks: where reads are slow (S3), their listing starts now and runs while the
        head is found, instead of after it (the same requests, a round trip less of waiting)."""
        published = self.journal.published
        if published is not None:
            # One read of the root: the head, the snapshot it carries, the expired snapshots.
            with published.pinned() as root:
                if root is not None:
                    sid = self.resolve(ref)
                    expired = self.expiry.expired(published=True)
                    held = root.branches.get(ref)
                    recent = None
                    if held is not None and held.snapshot == sid:
                        recent = root.recent_history(ref)
                    return self.log(
                        sid, limit=limit, marks=lambda: expired, recent=recent, carried=root.pages
                    )
        marks = None
        if limit is None or limit > 1:
            marks = self.objects.storage.start_read(
                functools.partial(self.expiry.expired, refresh=True)
            )
        return self.log(self.resolve(ref), limit=limit, marks=marks)

    def as_of(self, ref: str, when: dt.datetime) -> str:
        """The snapshot ``ref`` pointed at, at time ``when`` (naive times are UTC).

        A branch answers from its journal (where it pointed then); a tag or snapshot id from its
        history (the newest commit not after ``when``). Raises :class:`RefNotFound`.
        """
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        if self.journal.is_branch(ref):
            for entry in self.journal.history(ref):
                if entry.time <= when:
                    if entry.snapshot is None:
                        break
                    return entry.snapshot
            raise RefNotFound(
                f"{ref}@{when.isoformat()}",
                "branch version",
                hint=f"branch {ref!r} did not exist yet then, or compaction pruned its journal "
                "entries from then",
            )
        for info in self.log(self.resolve(ref)):
            if info.time <= when:
                return info.id
        raise RefNotFound(f"{ref}@{when.isoformat()}", "version")

    def merge_base(self, a: str, b: str) -> str | None:
        """The newest common ancestor of snapshots ``a`` and ``b`` (None if they share none)."""
        flags = {a: 1, b: 2} if a != b else {a: 3}
        heap = [(-to_micros(self.objects.snapshot(x).time), x) for x in flags]
        heapq.heapify(heap)
        done: set[str] = set()
        while heap:
            _, sid = heapq.heappop(heap)
            if sid in done:
                continue
            done.add(sid)
            f = flags[sid]
            if f == 3:
                return sid
            try:
                snap = self.objects.snapshot(sid)
            except RefNotFound:
                continue
            for p in snap.parents:
                nf = flags.get(p, 0) | f
                if nf != flags.get(p):
                    flags[p] = nf
                    done.discard(p)
                    try:
                        heapq.heappush(heap, (-to_micros(self.objects.snapshot(p).time), p))
                    except RefNotFound:
                        continue
        return None

    def diff(self, a: Snapshot, b: Snapshot) -> Diff:
        """Nodes and chunks that differ from ``a`` to ``b``; O(difference) in manifest shards."""
        arrays = array_paths(a.nodes) | array_paths(b.nodes)
        chunks: dict[str, set[tuple[Any, ...]]] = {}
        for key, _, _ in manifest.diff_entries(a.shards, b.shards, self.objects.shard):
            path, coords = split_chunk_key(key, arrays)
            chunks.setdefault(path, set()).add(coords)
        return diff_nodes(a.nodes, b.nodes, chunks)

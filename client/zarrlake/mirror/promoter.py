"""The mirror: copy (or wait for) a source repository's objects, then promote its refs.

One :meth:`Mirror.step` does, for every mirrored branch and tag:

1. read the source's head ``H`` (a branch's newest journal entry, a tag's record);
2. if the destination's ref already points at ``H``, nothing; otherwise compute what ``H`` needs
   (:func:`~zarrlake.mirror.closure.closure`) that the destination is not known to hold;
3. ask the destination about those objects only (one ``head`` each, concurrently), and with
   ``copy=True`` copy the missing ones from the source;
4. when every one is there, move the destination's ref to ``H`` with the same create-only
   journal write a commit uses (a tag: its create-only record).

Only the newest head is ever validated: commits made in between are skipped, so the mirror's lag
does not grow with the source's commit rate. The destination's refs live under ``mirror/refs/``
and are written only here; a source's journal and tags that bucket replication copies beside
them are never read, so a replicated entry can never make an incomplete commit visible.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zarrlake.durations import as_timedelta
from zarrlake.errors import (
    InvalidArgument,
    LockTimeout,
    RepositoryExists,
    RepositoryNotFound,
    ZarrlakeError,
)
from zarrlake.format.model import (
    MIRROR_PREFIX,
    MIRROR_REPO_KEY,
    PUBLISHED_ROOT,
    REPO_KEY,
    WRITE_PROBE_KEY,
    JournalEntry,
    RepoRecord,
    expiry_key,
)
from zarrlake.format.root import CAS_PROBE_KEY
from zarrlake.maintenance.gc import GCReport, gc
from zarrlake.mirror.closure import Needs, closure
from zarrlake.mirror.lease import DestinationLease
from zarrlake.mirror.presence import Presence
from zarrlake.refs import branch_glob_problem, new_writer_id
from zarrlake.repository import Repository
from zarrlake.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    with_retries,
)

if TYPE_CHECKING:
    from zarrlake.locks import LocalLock, RedisLock

log = logging.getLogger("zarrlake.mirror")

#: ``progress(copied, to_copy)`` callbacks of the copier, called as objects land.
CopyProgress = Callable[[int, int], None]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class RefStatus:
    """Where one mirrored ref stands after a pass.

    ``kind`` is ``"branch"`` or ``"tag"``. ``source_head``: the source's snapshot (None: the
    ref was deleted there). ``mirrored_head``: what the destination's ref points at (None: not
    yet, or deleted). ``commits_behind``: first-parent commits of the source the mirror does not
    show yet; ``seconds_behind``: how long the oldest of them has been waiting (0 when up to
    date). ``missing_objects``: objects the source head needs that have not reached the
    destination. ``error``: why the last pass could not finish this ref, if it could not.
    """

    kind: str
    name: str
    source_head: str | None
    mirrored_head: str | None
    commits_behind: int
    seconds_behind: float
    missing_objects: int
    last_promotion: dt.datetime | None
    error: str | None = None

    @property
    def up_to_date(self) -> bool:
        return self.source_head == self.mirrored_head and self.error is None

    @property
    def gone(self) -> bool:
        """Deleted at the source and at the mirror, with nothing to report: not listed."""
        return self.source_head is None and self.mirrored_head is None and self.error is None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "source_head": self.source_head,
            "mirrored_head": self.mirrored_head,
            "commits_behind": self.commits_behind,
            "seconds_behind": round(self.seconds_behind, 3),
            "missing_objects": self.missing_objects,
            "last_promotion": None
            if self.last_promotion is None
            else self.last_promotion.isoformat(),
            "error": self.error,
        }


@dataclass(frozen=True)
class MirrorStatus:
    """One pass of a :class:`Mirror`: every mirrored ref's :class:`RefStatus`, and what the pass
    did (objects checked at the destination, copied, bytes copied, refs promoted)."""

    source: str
    destination: str
    time: dt.datetime
    refs: tuple[RefStatus, ...]
    checked_objects: int = 0
    copied_objects: int = 0
    copied_bytes: int = 0
    promoted: tuple[str, ...] = ()

    @property
    def up_to_date(self) -> bool:
        """Every mirrored ref shows its source's head."""
        return all(r.up_to_date for r in self.refs)

    @property
    def missing_objects(self) -> int:
        return sum(r.missing_objects for r in self.refs)

    def ref(self, name: str, kind: str = "branch") -> RefStatus:
        """The status of branch (or tag) ``name``. Raises :class:`KeyError`."""
        for r in self.refs:
            if (r.kind, r.name) == (kind, name):
                return r
        raise KeyError(f"{kind} {name!r} is not mirrored")

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "time": self.time.isoformat(),
            "up_to_date": self.up_to_date,
            "checked_objects": self.checked_objects,
            "copied_objects": self.copied_objects,
            "copied_bytes": self.copied_bytes,
            "promoted": list(self.promoted),
            "refs": [r.to_json() for r in self.refs],
        }


@dataclass
class _Pass:
    """Counters of one pass."""

    checked: int = 0
    copied: int = 0
    copied_bytes: int = 0
    promoted: list[str] = field(default_factory=list)


class Mirror:
    """A read-only replica of ``source_repo`` at ``destination`` that shows only complete commits.

    ``branches``: names or globs of the branches to mirror (default: all); ``tags``: mirror
    every tag too. ``copy=True``: copy missing objects from the source (any two backends: local
    directory, another S3 endpoint or cloud); ``copy=False`` ("external"): objects arrive by
    bucket replication, and the mirror only waits for them and promotes.

    The destination is initialized as a mirror on first use (its marker ``mirror/repo`` names the
    source) and opens with :meth:`Repository.open` like any repository, read-only: every write
    raises :class:`ReadOnlyError`. Raises :class:`RepositoryExists` if the destination holds
    another repository or mirrors another one (or is the source itself). With ``create=False``
    nothing is written there: a destination that is not yet a mirror of ``source_repo`` raises
    :class:`RepositoryNotFound` (what ``zarrlake mirror status`` wants).

    ``lock`` (a lock service or its URL, as for :class:`Repository`): :meth:`run` acts only while
    it holds the lock named after the destination, so of several promoters of one mirror (a
    replicator restarted while the old one still runs) one works and the others wait. Without
    one, :meth:`run` holds a lease at the destination instead (:mod:`zarrlake.mirror.lease`). Safety
    never rests on it: every promotion is a create-only journal write that refuses to show an
    older source entry than the destination already shows.
    """

    def __init__(
        self,
        source_repo: Repository,
        destination: Storage | str,
        *,
        branches: Sequence[str] | None = None,
        tags: bool = True,
        copy: bool = True,
        progress: CopyProgress | None = None,
        create: bool = True,
        lock: RedisLock | LocalLock | str | None = None,
    ) -> None:
        self.source = source_repo
        self.destination = (
            Storage.from_url(destination) if isinstance(destination, str) else destination
        )
        if isinstance(branches, str):
            branches = [branches]  # one glob, not its characters
        self.branches = tuple(branches) if branches is not None else ("*",)
        for glob in self.branches:
            problem = branch_glob_problem(glob)
            if problem is not None:
                raise InvalidArgument(f"branches: {problem}")
        self.tags = tags
        self.copy = copy
        self.progress = progress
        if isinstance(lock, str):
            from zarrlake.locks import lock_from_url

            lock = lock_from_url(lock)
        self.lock = lock
        self.mirror = self._open_destination(create)
        self.presence = Presence(self.destination)
        self.presence.load()
        self._writer = new_writer_id()
        self._last_promotion: dict[tuple[str, str], dt.datetime] = {}
        # Branch -> (snapshot, source entry seq) of heads earlier passes saw and did not
        # promote, oldest first.
        self._seen: dict[str, list[tuple[str, int]]] = {}
        # The digest each of those heads' entries vouched for its snapshot (too large to
        # carry), so that a mirror's entry for an older candidate vouches as the source's did.
        self._digests: dict[str, str] = {}
        # Keys found missing in the current pass: not asked about twice in one pass.
        self._absent: set[str] = set()
        self._status: MirrorStatus | None = None

    #: Earlier heads per branch a pass may fall back to when the newest is incomplete.
    CANDIDATES = 64
    #: The copier saves what it learned after this many objects (or a 16th of all it knows).
    SAVE_EVERY = 64
    #: Seconds a term of the destination lease lasts (:meth:`run` without a lock service).
    LEASE_TTL = 30.0

    def __repr__(self) -> str:
        return f"<zarrlake.mirror.Mirror {self.source.storage.url} -> {self.destination.url}>"

    # -- the destination ---------------------------------------------------------------------------

    def _open_destination(self, create: bool) -> Repository:
        dest, source = self.destination, self.source.record
        if dest.url == self.source.storage.url:
            raise RepositoryExists(f"{dest.url} is the source itself: a mirror needs another place")

        def marker(key: str) -> RepoRecord | None:
            try:
                return RepoRecord.decode(dest.get(key), key)
            except ObjectNotFound:
                return None

        # Read directly, not by opening: opening a repository may complete it (write refs).
        plain, mirror = dest.map(marker, (REPO_KEY, MIRROR_REPO_KEY))
        if mirror is None and plain is not None and plain.id != source.id:
            raise RepositoryExists(
                f"{dest.url} holds repository {plain.id}, not a mirror of {source.id}"
            )
        if mirror is None and not create:
            raise RepositoryNotFound(f"{dest.url} is not (yet) a mirror of {source.id}")
        if mirror is None:
            # No marker, or the source's own brought by replication: make the destination a
            # mirror. Its marker is the source's, plus where the source is.
            self._check_destination_keeps_create_only_writes()
            features = source.features
            if PUBLISHED_ROOT in features and not dest.check_compare_and_set(
                MIRROR_PREFIX + CAS_PROBE_KEY
            ):
                # Its promoter then publishes heads through the journal alone (as a mirror
                # made before the published root does); readers read the journals.
                features = tuple(f for f in features if f != PUBLISHED_ROOT)
            record = RepoRecord(
                source.id,
                _now(),
                dict(source.config),
                initialized=True,
                content_hash=source.content_hash,
                features=features,
                mirror_of=self.source.storage.url,
            )
            try:
                dest.put(MIRROR_REPO_KEY, record.encode(), create_only=True)
            except PreconditionFailed:
                pass  # another promoter made it first (or our own write's response was lost)
        opened = Repository.open(dest)
        if opened.id != source.id or opened.record.mirror_of is None:
            raise RepositoryExists(
                f"{dest.url} mirrors repository {opened.id} ({opened.record.mirror_of}), "
                f"not {source.id}"
            )
        return opened

    def _check_destination_keeps_create_only_writes(self) -> None:
        """Raise :class:`ConditionalWritesUnsupported` before the first write to a destination
        whose server does not keep create-only writes: promotions and the lease rest on them.
        Asked once per destination storage object."""
        self.destination.check_conditional_writes(MIRROR_PREFIX + WRITE_PROBE_KEY)

    # -- one pass ----------------------------------------------------------------------------------

    def step(self) -> MirrorStatus:
        """One pass: for every mirrored ref, copy (with ``copy=True``) what the source's newest
        head needs, and promote it once all of it is at the destination. Returns the status.

        A ref whose pass fails (a storage outage, a source object gone) keeps its mirrored head
        and reports the error in its :class:`RefStatus`; the other refs carry on. Raises
        :class:`ConditionalWritesUnsupported` (before writing) for a destination whose server
        does not keep create-only writes."""
        self._check_destination_keeps_create_only_writes()
        counters = _Pass()
        refs: list[RefStatus] = []
        self._absent = set()
        if self.copy:
            self._copy_expiry_records()
        for name, entry in self._source_branches():
            refs.append(self._step_branch(name, entry, counters))
        if self.tags:
            refs.extend(self._step_tags(counters))
        refs = [r for r in refs if not r.gone]
        try:
            self.presence.save()
        except StorageError as e:
            # Only a cost: what was learned stays pending in memory and is saved by a later
            # pass; a restarted promoter would ask about those objects again.
            log.warning("mirror: could not record what is present at the destination: %s", e)
        self._status = MirrorStatus(
            self.source.storage.url,
            self.destination.url,
            _now(),
            tuple(refs),
            counters.checked,
            counters.copied,
            counters.copied_bytes,
            tuple(counters.promoted),
        )
        return self._status

    def status(self) -> MirrorStatus:
        """Where every mirrored ref stands now: a pass that neither copies nor promotes (it
        asks the destination about objects not known to be there)."""
        counters = _Pass()
        self._absent = set()
        refs = [
            self._step_branch(n, e, counters, promote=False) for n, e in self._source_branches()
        ]
        if self.tags:
            refs.extend(self._step_tags(counters, promote=False))
        refs = [r for r in refs if not r.gone]
        return MirrorStatus(
            self.source.storage.url, self.destination.url, _now(), tuple(refs), counters.checked
        )

    @property
    def last_status(self) -> MirrorStatus | None:
        """The status the last :meth:`step` returned (None before the first)."""
        return self._status

    def run(
        self,
        interval: float = 10.0,
        *,
        stop: threading.Event | None = None,
        on_status: Callable[[MirrorStatus], None] | None = None,
        gc_every: float | None = None,
        gc_grace: dt.timedelta | str = dt.timedelta(days=7),
    ) -> None:
        """:meth:`step` every ``interval`` seconds until ``stop`` is set (forever without one);
        with ``gc_every`` (seconds), also :meth:`gc` that often, between passes (``gc_grace``: a
        ``timedelta`` or a duration like ``"7d"``).

        A pass that fails as a whole (the source unreachable) is logged and retried at the
        next interval; nothing a failed pass did is lost, since objects are immutable. A
        destination whose server does not keep create-only writes is refused at once
        (:class:`ConditionalWritesUnsupported`), not retried."""
        gc_grace = as_timedelta(gc_grace, "gc_grace")
        self._check_destination_keeps_create_only_writes()
        stop = stop or threading.Event()
        lock: RedisLock | LocalLock | DestinationLease = (
            self.lock
            if self.lock is not None
            else self.lease(ttl=self.LEASE_TTL, wait_s=min(interval, 1.0))
        )
        lost = getattr(lock, "lost", None)
        while not stop.is_set():
            try:
                with lock.hold(self.source.id, self.lock_name):
                    log.info("mirror: promoting (holding %s)", lock)
                    self._run(interval, stop, on_status, gc_every, gc_grace, lost)
            except LockTimeout:
                log.info("mirror: another promoter holds %s; standing by", lock)
                stop.wait(min(interval, 1.0))
            except ZarrlakeError as e:  # the lease's storage (or the lock service) failing
                log.warning("mirror: cannot take %s, retrying in %.1f s: %s", lock, interval, e)
                stop.wait(interval)

    def lease(self, *, ttl: float = 30.0, wait_s: float = 120.0) -> DestinationLease:
        """The lease at the destination :meth:`run` holds when no lock service is given."""
        return DestinationLease(self.destination, ttl=ttl, wait_s=wait_s)

    @property
    def lock_name(self) -> str:
        """The name of the lock :meth:`run` holds (per source repository and destination)."""
        return f"mirror:{self.destination.url}"

    def _run(
        self,
        interval: float,
        stop: threading.Event,
        on_status: Callable[[MirrorStatus], None] | None,
        gc_every: float | None,
        gc_grace: dt.timedelta,
        lost: threading.Event | None = None,
    ) -> None:
        next_gc = None if gc_every is None else time.monotonic() + gc_every
        while not stop.is_set() and not (lost is not None and lost.is_set()):
            try:
                status = self.step()
                if next_gc is not None and gc_every is not None and time.monotonic() >= next_gc:
                    report = self.gc(grace=gc_grace)
                    log.info("mirror gc: %s", report.summary())
                    next_gc = time.monotonic() + gc_every
            except ZarrlakeError as e:
                log.warning("mirror pass failed, retrying in %.1f s: %s", interval, e)
            else:
                if on_status is not None:
                    on_status(status)
            stop.wait(interval)

    def gc(
        self,
        *,
        grace: dt.timedelta | str = dt.timedelta(days=7),
        dry_run: bool = False,
        force: bool = False,
    ) -> GCReport:
        """Garbage-collect the destination: delete objects older than ``grace`` (a
        ``timedelta`` or a duration like ``"7d"``) that no
        destination ref reaches (what the source deleted, data of skipped commits that
        replication brought), exactly as :meth:`Repository.gc` on a repository; nothing a
        destination ref reaches is deleted. The mirror runs no retention of its own: history
        ends where the source's expiry ended it.

        Run it here, in the promoter's process (or with ``run(gc_every=...)``), never beside a
        promoter elsewhere: the promoter trusts what it found present, and GC is what makes
        that stale. This promoter forgets everything it knew afterwards and checks again.
        """
        grace = as_timedelta(grace, "grace")
        report = gc(self.mirror.core, grace=grace, dry_run=dry_run, force=force)
        if report.deleted_objects and not dry_run:
            self.presence.forget()
        return report

    # -- branches ----------------------------------------------------------------------------------

    def _mirrored(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in self.branches)

    def _source_branches(self) -> list[tuple[str, JournalEntry | None]]:
        """Every mirrored branch of the source, and of the destination (a branch deleted at the
        source whose journal is gone must still go): name -> source head entry (None if gone)."""
        names = sorted(
            {n for n in self.source.core.journal.names() if self._mirrored(n)}
            | {n for n in self.mirror.core.journal.names() if self._mirrored(n)}
        )
        entries = self.source.storage.map(self.source.core.journal.head, names)
        return list(zip(names, entries, strict=True))

    def _step_branch(
        self, name: str, entry: JournalEntry | None, counters: _Pass, *, promote: bool = True
    ) -> RefStatus:
        source_head = None if entry is None else entry.snapshot
        dest_journal = self.mirror.core.journal
        try:
            dest_entry = dest_journal.head(name)
            mirrored = None if dest_entry is None else dest_entry.snapshot
            if dest_entry is not None and mirrored is not None:
                # A restarted (or read-only) promoter knows the last promotion from the journal.
                self._last_promotion.setdefault(("branch", name), dest_entry.time)
            if source_head is None:  # deleted at the source: delete here too
                if mirrored is not None and promote and entry is not None:
                    assert dest_entry is not None
                    if self._append(name, dest_entry, None, entry.seq, None):
                        counters.promoted.append(f"branch {name} (deleted)")
                        mirrored = None
                elif mirrored is not None and promote:
                    # No source journal at all (its entries were pruned away): gone there.
                    assert dest_entry is not None
                    if self._append(name, dest_entry, None, None, None):
                        counters.promoted.append(f"branch {name} (deleted)")
                        mirrored = None
                return self._ref_status("branch", name, None, mirrored, None, 0)
            if source_head == mirrored:
                return self._ref_status("branch", name, source_head, mirrored, None, 0)
            assert entry is not None
            needs, missing = self._validate(source_head, counters, promote=promote)
            target = None if missing else (source_head, entry.seq)
            if target is None:
                target = self._newest_complete(name, needs, mirrored, counters, promote)
            if promote:
                seen = self._seen.setdefault(name, [])
                if not seen or seen[-1] != (source_head, entry.seq):
                    seen.append((source_head, entry.seq))
                    if entry.snapshot_sha256 is not None:
                        self._digests[source_head] = entry.snapshot_sha256
                del seen[: -self.CANDIDATES]
                kept = {sid for held in self._seen.values() for sid, _ in held}
                for sid in [s for s in self._digests if s not in kept]:
                    del self._digests[sid]
            if target is not None and promote:
                carried = entry if target[0] == source_head else None
                if self._append(name, dest_entry, target[0], target[1], carried):
                    counters.promoted.append(f"branch {name}")
                    mirrored = target[0]
                seen = self._seen[name]
                del seen[: seen.index(target) + 1 if target in seen else 0]
            return self._ref_status("branch", name, source_head, mirrored, needs, len(missing))
        except ZarrlakeError as e:
            log.warning("mirror: branch %s not promoted: %s", name, e)
            known = dest_journal.known(name)
            return self._ref_status(
                "branch",
                name,
                source_head,
                None if known is None else known.snapshot,
                None,
                0,
                error=f"{type(e).__name__}: {e}",
            )

    def _newest_complete(
        self, name: str, needs: Needs, mirrored: str | None, counters: _Pass, promote: bool
    ) -> tuple[str, int] | None:
        """The newest earlier head of ``name`` (seen by an earlier pass, an ancestor of the
        source's head and newer than the mirrored one) whose objects are all here, if any.

        When the source commits more often than replication delivers, the newest head is never
        complete when a pass looks: a head seen a replication delay ago is, and promoting it
        keeps the lag near that delay instead of stalling until the source pauses."""
        ancestors = {c.id for c in needs.chain}
        for candidate in reversed(self._seen.get(name, [])):
            if candidate[0] == mirrored:
                break
            if candidate[0] not in ancestors:
                continue
            _, missing = self._validate(candidate[0], counters, promote=promote)
            if not missing:
                return candidate
        return None

    def _append(
        self,
        name: str,
        dest_entry: JournalEntry | None,
        snapshot: str | None,
        source_seq: int | None,
        source_entry: JournalEntry | None,
    ) -> bool:
        """Move the destination's branch with the create-only journal write of a commit.

        A mirror's entry carries, as its token, the sequence number of the source's journal
        entry it shows; a move to an older source entry than the destination already shows is
        refused (False): a second promoter working from an older view of the source can never
        move a ref back. Raises :class:`_Raced` if the destination moved since it was read."""
        journal = self.mirror.core.journal
        shown = None if dest_entry is None else dest_entry.token
        if shown is not None and source_seq is not None and source_seq <= shown:
            log.info("mirror: branch %s already shows a newer source entry", name)
            return False
        seq = 0 if dest_entry is None else dest_entry.seq + 1
        previous = None if dest_entry is None else dest_entry.snapshot
        carried = digest = None
        if source_entry is not None and source_entry.snapshot == snapshot:
            carried, digest = source_entry.snapshot_data, source_entry.snapshot_sha256
        elif snapshot is not None:
            digest = self._digests.get(snapshot)  # an older candidate's, as its entry said
        new = JournalEntry(
            seq,
            snapshot,
            previous,
            _now(),
            self._writer,
            source_seq,
            carried,
            snapshot_sha256=digest,
        )
        if not journal.append(name, new):
            # Another promoter moved it since we read it: the next pass looks again.
            raise _Raced(f"branch {name} moved at the destination while promoting; retrying")
        self._last_promotion[("branch", name)] = _now()
        log.info("mirror: branch %s -> %s", name, snapshot)
        return True

    # -- tags ------------------------------------------------------------------------------------

    def _step_tags(self, counters: _Pass, *, promote: bool = True) -> list[RefStatus]:
        # The records themselves, not their markers: a mirror's tags are create-only, so a
        # wrong marker copied here would stay wrong there.
        source_tags = self.source.core.tags.all(records_only=True)
        dest_tags_store = self.mirror.core.tags
        dest_tags = dest_tags_store.all()
        out: list[RefStatus] = []
        for name in sorted(set(source_tags) | set(dest_tags)):
            want, have = source_tags.get(name), dest_tags.get(name)
            try:
                if want is None:  # deleted at the source
                    if have is not None and promote:
                        dest_tags_store.delete(name)
                        counters.promoted.append(f"tag {name} (deleted)")
                        have = None
                    out.append(self._ref_status("tag", name, None, have, None, 0))
                    continue
                if want == have:
                    out.append(self._ref_status("tag", name, want, have, None, 0))
                    continue
                needs, missing = self._validate(want, counters, promote=promote)
                if not missing and promote:
                    dest_tags_store.create(name, want)
                    self._last_promotion[("tag", name)] = _now()
                    counters.promoted.append(f"tag {name}")
                    have = want
                out.append(self._ref_status("tag", name, want, have, needs, len(missing)))
            except ZarrlakeError as e:
                log.warning("mirror: tag %s not promoted: %s", name, e)
                out.append(self._ref_status("tag", name, want, have, None, 0, error=f"{e}"))
        return out

    # -- validation and copying ----------------------------------------------------------------

    def _validate(self, head: str, counters: _Pass, *, promote: bool) -> tuple[Needs, list[str]]:
        """What ``head`` needs, checked at the destination (and copied there with ``copy``):
        the keys still missing. With none, ``head`` is recorded as complete."""
        needs = closure(self.source.core, head, self.presence)
        keys = sorted(k for k in needs.sizes if k not in self._absent)
        counters.checked += len(keys)
        if self.copy and promote:
            # The copier writes what it does not know to be there, without asking first: a
            # write of an immutable object that is already there changes nothing, and asking
            # would cost one more request per object of a first copy.
            self._copy(keys, counters)
        else:
            found = self.destination.map(self._head, keys)
            sizes = needs.sizes
            self.presence.add(
                k for k, info in zip(keys, found, strict=True) if _fits(info, sizes[k])
            )
        missing = [k for k in needs.sizes if k not in self.presence.keys]
        if not missing:
            self.presence.add(shards=needs.shards, snapshots=[c.id for c in needs.chain])
        self._absent.update(missing)
        return needs, missing

    def _head(self, key: str) -> ObjectInfo | None:
        return with_retries(lambda: self.destination.head(key))

    def _copy(self, keys: list[str], counters: _Pass) -> list[str]:
        """Copy ``keys`` from the source to the destination, concurrently, learning each as
        present as it lands (and saving what was learned every so often, so a copier killed
        midway copies again only its last few objects); the keys copied. An object the source
        no longer has (its GC took it: the head moved on) is skipped."""
        done = 0
        lock = threading.Lock()
        src, dst = self.source.storage, self.destination

        def copy_one(key: str) -> tuple[str, int] | None:
            nonlocal done
            try:
                data = with_retries(lambda: src.get(key))
            except ObjectNotFound:
                log.warning("mirror: %s is gone from the source", key)
                return None
            with_retries(lambda: dst.put(key, data))
            with lock:
                done += 1
                self.presence.add([key])
                if self.presence.unsaved >= max(self.SAVE_EVERY, len(self.presence.keys) // 16):
                    self.presence.save()
                if self.progress is not None:
                    self.progress(done, len(keys))
            return key, len(data)

        results = [r for r in dst.map(copy_one, keys) if r is not None]
        counters.copied += len(results)
        counters.copied_bytes += sum(n for _, n in results)
        return [k for k, _ in results]

    def _copy_expiry_records(self) -> None:
        """Copy the source's expiry records (small, immutable) so that history on the mirror ends
        where the source's does, and says so."""
        have = set(self.destination.list_keys(expiry_key("")))
        todo = [k for k in self.source.storage.list_keys(expiry_key("")) if k not in have]
        if todo:
            self._copy(todo, _Pass())

    # -- status ------------------------------------------------------------------------------------

    def _ref_status(
        self,
        kind: str,
        name: str,
        source_head: str | None,
        mirrored: str | None,
        needs: Needs | None,
        missing: int,
        *,
        error: str | None = None,
    ) -> RefStatus:
        behind, waiting = 0, 0.0
        if needs is not None and source_head != mirrored:
            chain = needs.chain
            ids = [c.id for c in chain]
            behind = ids.index(mirrored) if mirrored in ids else len(chain)
            if behind:
                waiting = max(0.0, (_now() - chain[behind - 1].time).total_seconds())
        elif source_head != mirrored and source_head is not None:
            behind = 1
        return RefStatus(
            kind,
            name,
            source_head,
            mirrored,
            behind,
            waiting,
            missing,
            self._last_promotion.get((kind, name)),
            error,
        )


class _Raced(ZarrlakeError):
    """Another promoter moved a destination ref while this one was promoting it."""


def _fits(info: ObjectInfo | None, size: int) -> bool:
    return info is not None and info.size >= size

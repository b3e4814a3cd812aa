"""The repository: refs, history, diff, merge, sessions, and the commit protocol.

Commit protocol (see DESIGN.md): read the branch head; if it moved since the session's base, rebase
the changeset on it (conflicts are detected from the txlogs in between); write shards, txlog and
snapshot; then append one create-only journal entry. Losing that race means another commit landed
first: re-read, rebase again, retry. Safety rests on the create-only write alone; a lock, when
configured, only keeps writers from stampeding.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import heapq
import logging
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

from zarrlake.changeset import Changeset
from zarrlake.config import MAX_SESSION_TTL, RepositoryConfig
from zarrlake.conflicts import (
    ChangeSummary,
    Solver,
    UseOurs,
    UseTheirs,
    rebase_conflicts,
    resized_arrays,
    three_way,
)
from zarrlake.errors import (
    BranchExists,
    Conflict,
    ConflictError,
    MergeConflictError,
    RefNotFound,
    RepositoryExists,
    RepositoryNotFound,
    ZarrlakeError,
)
from zarrlake.format import manifest
from zarrlake.format.ids import is_snapshot_id, new_snapshot_id
from zarrlake.format.manifest import prefix_matches
from zarrlake.format.model import (
    REPO_KEY,
    AncestorRecord,
    ExpiryRecord,
    JournalEntry,
    ManifestShard,
    RepoRecord,
    ShardInfo,
    Snapshot,
    TxLog,
    to_micros,
)
from zarrlake.nodes import array_paths, meta_key_node, split_chunk_key
from zarrlake.objects import ObjectStore
from zarrlake.refs import BranchJournal, Tags, new_writer_id, validate_name
from zarrlake.session import Session, diff_nodes
from zarrlake.storage.base import ObjectNotFound, PreconditionFailed, Storage
from zarrlake.types import CommitInfo, Diff

MAIN = "main"
log = logging.getLogger("zarrlake")
_MAX_COMMIT_ATTEMPTS = 200


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _history_for(parent: Snapshot) -> list[AncestorRecord]:
    """The commit records a child of ``parent`` carries: the parent's, then its own history."""
    records = [
        AncestorRecord(parent.parents, parent.time, parent.author, parent.message, parent.metadata),
        *parent.history[: Snapshot.ANCESTRY - 1],
    ]
    budget = Snapshot.HISTORY_BYTES
    for i, r in enumerate(records):
        budget -= 64 + len(r.message) + len(r.author or "") + len(repr(r.metadata))
        if budget < 0:
            return records[:i]
    return records


def _commit_info(s: Snapshot) -> CommitInfo:
    return CommitInfo(s.id, tuple(s.parents), s.message, s.author, s.time, dict(s.metadata))


class History(Iterator[CommitInfo]):
    """The iterator :meth:`Repository.log` returns. ``truncated`` lists ``(child, parent)`` pairs
    where history ends because ``parent`` was expired (or is missing)."""

    def __init__(self, repo: Repository, first: Snapshot, limit: int | None) -> None:
        self.truncated: list[tuple[str, str]] = []
        self._it = repo._walk(first, limit, self)

    def _truncated_at(self, child: str, parent: str) -> None:
        self.truncated.append((child, parent))
        log.info("history ends at %s: its parent %s was expired", child, parent)

    def __iter__(self) -> History:
        return self

    def __next__(self) -> CommitInfo:
        return next(self._it)


class Repository:
    """A versioned Zarr repository in one storage location (see :meth:`open`, :meth:`create`)."""

    def __init__(self, storage: Storage, record: RepoRecord, lock: Any = None) -> None:
        if isinstance(lock, str):
            from zarrlake.locks import lock_from_url

            lock = lock_from_url(lock)
        self.storage = storage
        self._record = record
        self._lock = lock
        self._config = RepositoryConfig.from_dict(record.config)
        self._objects = ObjectStore(storage)
        self._journal = BranchJournal(storage)
        self._tags = Tags(storage)
        #: Per-process counters of the commit protocol (for benchmarks and monitoring):
        #: ``rebases`` — the branch had moved and the changeset was rebased onto its head;
        #: ``append_retries`` — another commit won the create-only journal append (a retry).
        self.stats: dict[str, int] = {"rebases": 0, "append_retries": 0}

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage, "record": self._record, "lock": self._lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["storage"], state["record"], state["lock"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<zarrlake.Repository {self.id} at {self.storage.url}>"

    # -- lifecycle --------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        storage: Storage,
        *,
        config: RepositoryConfig | dict[str, Any] | None = None,
        lock: Any = None,
    ) -> Repository:
        """Initialize a repository with an empty ``main`` branch.

        Raises :class:`RepositoryExists`.
        """
        if isinstance(config, dict):
            config = RepositoryConfig.from_dict(config)
        config = config or RepositoryConfig()
        record = RepoRecord(str(uuid.uuid4()), _now(), config.to_dict())
        try:
            storage.put(REPO_KEY, record.encode(), create_only=True)
        except PreconditionFailed:
            try:  # our own marker, behind a lost response, is not someone else's repository
                mine = RepoRecord.decode(storage.get(REPO_KEY), REPO_KEY).id == record.id
            except (ObjectNotFound, ZarrlakeError):
                mine = False
            if not mine:
                raise RepositoryExists(f"a repository already exists at {storage.url}") from None
        repo = cls(storage, record, lock)
        repo._ensure_main()
        return repo

    @classmethod
    def open(cls, storage: Storage, *, lock: Any = None) -> Repository:
        """Open an existing repository. Raises :class:`RepositoryNotFound`."""
        try:
            data = storage.get(REPO_KEY)
        except ObjectNotFound:
            raise RepositoryNotFound(f"no zarrlake repository at {storage.url}") from None
        repo = cls(storage, RepoRecord.decode(data, REPO_KEY), lock)
        repo._ensure_main()
        return repo

    @classmethod
    def open_or_create(
        cls,
        storage: Storage,
        *,
        config: RepositoryConfig | dict[str, Any] | None = None,
        lock: Any = None,
    ) -> Repository:
        try:
            return cls.open(storage, lock=lock)
        except RepositoryNotFound:
            try:
                return cls.create(storage, config=config, lock=lock)
            except RepositoryExists:
                return cls.open(storage, lock=lock)

    @classmethod
    def from_kubernetes(
        cls, name: str, namespace: str | None = None, *, lock_url: str | None = None
    ) -> Repository:
        """Open the repository of the ``Repository`` resource ``name`` (``zarrlake.io``).

        Inside a pod it uses the service account; elsewhere the kubeconfig. ``namespace`` defaults
        to the pod's (or the kubeconfig context's). Storage location comes from the resource's
        spec, credentials and the lock password from the Secrets it names, the lock endpoint from
        its status. ``lock_url`` overrides the lock endpoint's address (e.g. a port-forward when
        running outside the cluster). Raises :class:`zarrlake.k8s.KubernetesError` when the
        resource is missing or not Ready, or a Secret is missing.
        """
        from zarrlake.k8s import locate

        conn = locate(name, namespace)
        return cls.open(conn.storage(), lock=conn.lock(lock_url))

    @staticmethod
    def exists(storage: Storage) -> bool:
        return storage.exists(REPO_KEY)

    def _ensure_main(self) -> None:
        # The marker is written first (it decides a creation race); a creator that died before
        # the first commit leaves a repository that the next open completes.
        if self._journal.head(MAIN) is not None:
            return
        snap = Snapshot(new_snapshot_id(), (), _now(), None, "Repository initialized", {}, {}, [])
        self._objects.put_snapshot(snap, TxLog([], [], [], []), {})
        self._journal.append(MAIN, JournalEntry(0, snap.id, None, _now(), new_writer_id()))

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def config(self) -> RepositoryConfig:
        return self._config

    @property
    def lock(self) -> Any:
        return self._lock

    # -- branches ----------------------------------------------------------------------------------

    def list_branches(self) -> dict[str, str]:
        names = self._journal.names()
        heads = self.storage.map(self._journal.head, names)
        return {
            n: e.snapshot for n, e in sorted(zip(names, heads, strict=True)) if e and e.snapshot
        }

    def lookup_branch(self, name: str) -> str:
        validate_name(name)
        return self._journal.current(name).snapshot  # type: ignore[return-value]

    def create_branch(self, name: str, from_ref: str = MAIN) -> str:
        """Create ``name`` at ``from_ref`` (branch, tag or snapshot id).

        Raises :class:`BranchExists`, :class:`InvalidName`, :class:`RefNotFound`.
        """
        validate_name(name)
        target = self.resolve(from_ref)
        head = self._journal.head(name)
        if head is not None and head.snapshot is not None:
            raise BranchExists(f"branch {name!r} already exists")
        seq = 0 if head is None else head.seq + 1
        entry = JournalEntry(seq, target, None, _now(), new_writer_id())
        if not self._journal.append(name, entry):
            raise BranchExists(f"branch {name!r} already exists")
        return target

    def reset_branch(self, name: str, to_ref: str, *, expected: str | None = None) -> str:
        """Point ``name`` at ``to_ref``. With ``expected``, only if the head is still that snapshot
        (else :class:`ConflictError`). Returns the new head."""
        validate_name(name)
        target = self.resolve(to_ref)
        with self._hold_lock(name) as token:
            while True:
                cur = self._journal.current(name)
                if expected is not None and cur.snapshot != expected:
                    raise ConflictError(
                        [Conflict("branch-moved", name)],
                        f"branch {name!r} is at {cur.snapshot}, not the expected {expected}",
                    )
                entry = JournalEntry(
                    cur.seq + 1, target, cur.snapshot, _now(), new_writer_id(), token
                )
                if self._journal.append(name, entry):
                    return target

    def delete_branch(self, name: str) -> None:
        validate_name(name)
        if name == MAIN:
            raise ZarrlakeError("the main branch cannot be deleted")
        with self._hold_lock(name) as token:
            while True:
                cur = self._journal.current(name)
                entry = JournalEntry(
                    cur.seq + 1, None, cur.snapshot, _now(), new_writer_id(), token
                )
                if self._journal.append(name, entry):
                    return

    # -- tags --------------------------------------------------------------------------------------

    def list_tags(self) -> dict[str, str]:
        return dict(sorted(self._tags.all().items()))

    def lookup_tag(self, name: str) -> str:
        validate_name(name, "tag")
        return self._tags.get(name)

    def create_tag(self, name: str, ref: str) -> str:
        """Tag ``ref``. Raises :class:`TagExists`, also for names of deleted tags."""
        validate_name(name, "tag")
        target = self.resolve(ref)
        self._tags.create(name, target)
        return target

    def delete_tag(self, name: str) -> None:
        validate_name(name, "tag")
        self._tags.delete(name)

    # -- refs --------------------------------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        """Branch, tag or snapshot id -> snapshot id. Raises :class:`RefNotFound`."""
        if not isinstance(ref, str) or not ref:
            raise RefNotFound(str(ref))
        if is_snapshot_id(ref):
            try:
                self._objects.snapshot(ref)
                return ref
            except RefNotFound:
                pass
        try:
            validate_name(ref)
        except ZarrlakeError:
            raise RefNotFound(ref) from None
        head = self._journal.head(ref)
        if head is not None and head.snapshot is not None:
            return head.snapshot
        try:
            return self._tags.get(ref)
        except RefNotFound:
            raise RefNotFound(ref) from None

    def _is_branch(self, ref: str) -> bool:
        try:
            validate_name(ref)
        except ZarrlakeError:
            return False
        head = self._journal.head(ref)
        return head is not None and head.snapshot is not None

    def _as_of(self, ref: str, when: dt.datetime) -> str:
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        if self._is_branch(ref):
            for entry in self._journal.history(ref):
                if entry.time <= when:
                    if entry.snapshot is None:
                        break
                    return entry.snapshot
            raise RefNotFound(f"{ref}@{when.isoformat()}", "branch version")
        for info in self.log(ref):
            if info.time <= when:
                return info.id
        raise RefNotFound(f"{ref}@{when.isoformat()}", "version")

    # -- history -----------------------------------------------------------------------------------

    def log(self, ref: str = MAIN, *, limit: int | None = None) -> History:
        """Commits reachable from ``ref``, newest first (merge parents included).

        History ends cleanly where snapshots were expired: the returned iterator's
        ``truncated`` lists the expired parents it stopped at (logged at INFO too).
        """
        start = self.resolve(ref)
        first = self._objects.snapshot(start)
        return History(self, first, limit)

    def _expired_snapshots(self, *, refresh: bool = False) -> frozenset[str]:
        """Ids of snapshots taken out of history by :meth:`expire` (records are immutable)."""
        cache: dict[str, frozenset[str]] = self.__dict__.setdefault("_expiry_records", {})
        if refresh or "_expired" not in self.__dict__:
            keys = self.storage.list_keys("expired/")
            missing = [k for k in keys if k not in cache]
            for key, data in zip(missing, self.storage.map(self.storage.get, missing), strict=True):
                cache[key] = frozenset(ExpiryRecord.decode(data, key).snapshots)
            self._expired = frozenset().union(*(cache[k] for k in keys)) if keys else frozenset()
        return self._expired

    def _walk(self, first: Snapshot, limit: int | None, history: History) -> Iterator[CommitInfo]:
        expired = self._expired_snapshots(refresh=True)
        # Each snapshot carries the commit records of its recent first-parent ancestors, so a
        # page of history costs one fetch, not one dependent round trip per commit.
        known: dict[str, CommitInfo] = {}

        def learn(snap: Snapshot) -> None:
            known[snap.id] = _commit_info(snap)
            for aid, rec in zip(snap.ancestry, snap.history, strict=False):
                if aid not in known:
                    known[aid] = CommitInfo(
                        aid, rec.parents, rec.message, rec.author, rec.time, dict(rec.metadata)
                    )

        def info(sid: str) -> CommitInfo:
            if sid not in known:
                learn(self._objects.snapshot(sid))  # RefNotFound if it is gone
            return known[sid]

        learn(first)
        heap = [(-to_micros(first.time), first.id)]
        seen = {first.id}
        produced = 0
        while heap and (limit is None or produced < limit):
            _, sid = heapq.heappop(heap)
            commit = info(sid)
            yield commit
            produced += 1
            for parent in commit.parents:
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in expired:
                    history._truncated_at(sid, parent)
                    continue
                try:
                    parent_time = info(parent).time
                except RefNotFound:
                    history._truncated_at(sid, parent)
                    continue
                heapq.heappush(heap, (-to_micros(parent_time), parent))

    def diff(self, from_ref: str, to_ref: str) -> Diff:
        """Nodes added/removed/changed and chunks changed going from ``from_ref`` to ``to_ref``."""
        a = self._objects.snapshot(self.resolve(from_ref))
        b = self._objects.snapshot(self.resolve(to_ref))
        return self._diff_snapshots(a, b)

    def _diff_snapshots(self, a: Snapshot, b: Snapshot) -> Diff:
        arrays = array_paths(a.nodes) | array_paths(b.nodes)
        chunks: dict[str, set[tuple[Any, ...]]] = {}
        for key, _, _ in manifest.diff_entries(a.shards, b.shards, self._objects.shard):
            path, coords = split_chunk_key(key, arrays)
            chunks.setdefault(path, set()).add(coords)
        return diff_nodes(a.nodes, b.nodes, chunks)

    def _merge_base(self, a: str, b: str) -> str | None:
        """The newest common ancestor of two snapshots."""
        flags = {a: 1, b: 2} if a != b else {a: 3}
        heap = [(-to_micros(self._objects.snapshot(x).time), x) for x in flags]
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
                snap = self._objects.snapshot(sid)
            except RefNotFound:
                continue
            for p in snap.parents:
                nf = flags.get(p, 0) | f
                if nf != flags.get(p):
                    flags[p] = nf
                    done.discard(p)
                    try:
                        heapq.heappush(heap, (-to_micros(self._objects.snapshot(p).time), p))
                    except RefNotFound:
                        continue
        return None

    def merge(
        self,
        source: str,
        into: str,
        *,
        message: str | None = None,
        strategy: str | None = None,
        author: str | None = None,
    ) -> str:
        """Three-way merge of ``source`` (any ref) into branch ``into``; returns the new head.

        A merge commit has two parents. ``strategy`` None fails on conflicts with
        :class:`MergeConflictError`; ``"source-wins"``/``"dest-wins"`` settle them all.
        """
        if strategy not in (None, "source-wins", "dest-wins"):
            raise ValueError(
                f"unknown merge strategy {strategy!r}; use 'source-wins' or 'dest-wins'"
            )
        validate_name(into)
        src_id = self.resolve(source)
        dest_id = self._journal.current(into).snapshot
        assert dest_id is not None
        base_id = self._merge_base(src_id, dest_id)
        if base_id == src_id:
            return dest_id  # already merged
        src = self._objects.snapshot(src_id)
        dest = self._objects.snapshot(dest_id)
        base = (
            self._objects.snapshot(base_id)
            if base_id is not None
            else Snapshot("", (), _now(), None, "", {}, {}, [])
        )
        load = self._objects.shard
        src_changes = {
            k: (x, y) for k, x, y in manifest.diff_entries(base.shards, src.shards, load)
        }
        dest_changes = {
            k: (x, y) for k, x, y in manifest.diff_entries(base.shards, dest.shards, load)
        }
        arrays = array_paths(base.nodes) | array_paths(src.nodes) | array_paths(dest.nodes)
        plan = three_way(
            base.nodes, src.nodes, dest.nodes, src_changes, dest_changes, arrays, strategy
        )
        if plan.conflicts:
            raise MergeConflictError(plan.conflicts)
        changeset = Changeset(uuid.uuid4().hex, dest_id, chunks=plan.chunks, nodes=plan.nodes)
        return self._commit_changeset(
            into,
            changeset,
            message=message or f"Merge {source} into {into}",
            author=author,
            metadata={"merge": {"source": source, "source_snapshot": src_id}},
            rebase=True,
            solver=None,
            extra_parents=(src_id,),
        )

    # -- maintenance -------------------------------------------------------------------------------

    def expire(self, rules: Any, *, dry_run: bool = False) -> Any:
        """Take snapshots outside ``rules`` (a :class:`RetentionRules`) out of history; returns an
        :class:`ExpireReport`. Branch heads and tags are always kept; :meth:`gc` deletes later."""
        from zarrlake.maintenance.expire import expire
        from zarrlake.maintenance.retention import RetentionRules

        if isinstance(rules, dict):
            rules = RetentionRules.from_dict(rules)
        if not isinstance(rules, RetentionRules):
            raise TypeError("rules must be a zarrlake.RetentionRules (or its dict form)")
        return expire(self, rules, dry_run=dry_run)

    def gc(
        self,
        *,
        grace: dt.timedelta = dt.timedelta(days=7),
        dry_run: bool = False,
        force: bool = False,
        progress: Any = None,
    ) -> Any:
        """Delete objects no retained snapshot needs and older than ``grace``; a :class:`GCReport`.

        A ``grace`` shorter than the longest session lifetime (7 days) is refused unless
        ``force``: a running session's uploads must outlive it.
        """
        from zarrlake.maintenance.gc import gc

        return gc(self, grace=grace, dry_run=dry_run, force=force, progress=progress)

    def compact(
        self,
        *,
        branch: str = MAIN,
        pack_below_bytes: int | None = None,
        keep_journal: dt.timedelta = dt.timedelta(days=7),
        dry_run: bool = False,
        progress: Any = None,
    ) -> Any:
        """Pack small chunks, merge undersized shards and prune old journal entries of ``branch``
        without changing what any snapshot reads; a :class:`CompactReport`."""
        from zarrlake.maintenance.compact import DEFAULT_PACK_BELOW, compact

        validate_name(branch)
        return compact(
            self,
            branch=branch,
            pack_below_bytes=DEFAULT_PACK_BELOW if pack_below_bytes is None else pack_below_bytes,
            keep_journal=keep_journal,
            dry_run=dry_run,
            progress=progress,
        )

    def fsck(self, *, check_chunks: bool = True) -> Any:
        """Check that everything reachable from the refs exists and parses; a ``FsckReport``."""
        from zarrlake.fsck import fsck

        return fsck(self, check_chunks=check_chunks)

    # -- sessions ----------------------------------------------------------------------------------

    def readonly_session(self, ref: str = MAIN, *, as_of: dt.datetime | None = None) -> Session:
        """A read-only view of ``ref`` (branch, tag, snapshot id), or of it as of ``as_of``."""
        sid = self._as_of(ref, as_of) if as_of is not None else self.resolve(ref)
        branch = ref if as_of is None and self._is_branch(ref) else None
        return Session(self, sid, branch=branch, read_only=True)

    def writable_session(self, branch: str = MAIN, *, ttl: dt.timedelta | None = None) -> Session:
        """A transaction on ``branch``, expiring after ``ttl`` (default: config; at most 7 days)."""
        validate_name(branch)
        if ttl is not None and not dt.timedelta(0) < ttl <= MAX_SESSION_TTL:
            raise ValueError("session ttl must be positive and at most 7 days")
        head = self._journal.current(branch).snapshot
        assert head is not None
        return Session(self, head, branch=branch, read_only=False, ttl=ttl)

    @contextlib.contextmanager
    def transaction(
        self, branch: str = MAIN, message: str | None = None, author: str | None = None
    ) -> Iterator[Any]:
        """``with repo.transaction("main", message="...") as store:`` — commits on success,
        discards on error. Nothing is committed if nothing was written."""
        if not isinstance(message, str):
            raise TypeError("transaction() needs a commit message: message='...'")
        session = self.writable_session(branch)
        try:
            yield session.store
        except BaseException:
            session.discard()
            raise
        if session.has_changes:
            session.commit(message, author=author)

    # -- the commit protocol -----------------------------------------------------------------------

    def _dedup_guard(self, changeset: Changeset) -> contextlib.AbstractContextManager[Any]:
        if self._lock is None or not changeset.dedup_chunks:
            return contextlib.nullcontext()
        from zarrlake.maintenance.gc import GC_LOCK_BRANCH

        return self._lock.hold(self.id, GC_LOCK_BRANCH)

    def _hold_lock(self, branch: str) -> contextlib.AbstractContextManager[int | None]:
        if self._lock is None:
            return contextlib.nullcontext(None)
        return self._lock.hold(self.id, branch)

    def _commit_changeset(
        self,
        branch: str,
        changeset: Changeset,
        *,
        message: str,
        author: str | None,
        metadata: dict[str, Any],
        rebase: bool,
        solver: Solver | str,
        extra_parents: tuple[str, ...] = (),
        reshard: bool = False,
    ) -> str:
        # solver "relocation" (internal, compaction): the changeset moves bytes without changing
        # them, so any key the other side touched is simply dropped from it.
        if (
            solver is not None
            and solver != "relocation"
            and not isinstance(solver, UseOurs | UseTheirs)
        ):
            raise TypeError("solver must be None, zarrlake.UseOurs() or zarrlake.UseTheirs()")
        with self._hold_lock(branch) as token:
            for attempt in range(_MAX_COMMIT_ATTEMPTS):
                head_entry = self._journal.current(branch)
                head = head_entry.snapshot
                assert head is not None
                if token is not None and head_entry.token is not None and token <= head_entry.token:
                    # The lock service handed out a token the journal already holds: it lost its
                    # counter (a Redis restart without persistence). Safety is the journal's; keep
                    # later tokens monotonic by raising the service's floor past the journal's.
                    raise_floor = getattr(self._lock, "raise_floor", None)
                    if raise_floor is not None:
                        raise_floor(self.id, head_entry.token)
                if head != changeset.base:
                    if not rebase:
                        raise ConflictError(
                            [Conflict("branch-moved", branch)],
                            f"branch {branch!r} moved from {changeset.base} to {head} "
                            "(commit with rebase=True to rebase)",
                        )
                    changeset = self._rebase(changeset, head, solver)
                    self.stats["rebases"] += 1
                parent = self._objects.snapshot(head)
                snap, txlog, shards = self._build_snapshot(
                    parent,
                    changeset,
                    message,
                    author,
                    metadata,
                    extra_parents,
                    relocation=solver == "relocation",
                    reshard=reshard,
                )
                self._objects.put_snapshot(snap, txlog, shards)
                entry = JournalEntry(
                    head_entry.seq + 1, snap.id, head, _now(), new_writer_id(), token
                )
                # Chunks we deduplicated against may be old garbage GC is about to sweep: check
                # they still exist, and (with a lock service) keep GC's deletes out until the
                # journal entry that makes them reachable is written.
                with self._dedup_guard(changeset):
                    if changeset.dedup_chunks:
                        self._objects.check_chunks_exist(changeset.dedup_chunks)
                    published = self._journal.append(branch, entry)
                if published:
                    return snap.id
                self.stats["append_retries"] += 1
                # Another commit took this sequence number: back off a little, then rebase on it.
                time.sleep(random.uniform(0, min(0.2, 0.002 * (2 ** min(attempt, 7)))))
        raise ZarrlakeError(f"could not commit to {branch!r} after {_MAX_COMMIT_ATTEMPTS} attempts")

    def _changes_since(self, base: Snapshot, head: Snapshot) -> ChangeSummary:
        """What happened between ``base`` and ``head``: from txlogs along the first-parent chain,
        or — if ``base`` is not on it (the branch was reset, or history expired) — from a diff."""
        logs: list[TxLog] = []
        chain = [head.id, *head.ancestry]
        if base.id in chain:
            # The head names its first-parent ancestors: fetch the txlogs in between concurrently
            # instead of one dependent round trip per commit (a session that waited for the
            # branch lock is often many commits behind).
            try:
                logs = self.storage.map(self._objects.txlog, chain[: chain.index(base.id)])
            except RefNotFound:
                return self._summary_from_diff(base, head)
            cur = base
        else:
            cur = head
        expired = self._expired_snapshots()
        while cur.id != base.id:
            if not cur.parents or len(logs) > 10_000 or cur.parents[0] in expired:
                return self._summary_from_diff(base, head)
            try:
                logs.append(self._objects.txlog(cur.id))
                cur = self._objects.snapshot(cur.parents[0])
            except RefNotFound:
                return self._summary_from_diff(base, head)
        summary = ChangeSummary()
        for log in logs:
            summary.add_txlog(log)
        return summary

    def _summary_from_diff(self, base: Snapshot, head: Snapshot) -> ChangeSummary:
        chunks = {
            k for k, _, _ in manifest.diff_entries(base.shards, head.shards, self._objects.shard)
        }
        node_keys = {
            k for k in set(base.nodes) | set(head.nodes) if base.nodes.get(k) != head.nodes.get(k)
        }
        removed = {meta_key_node(k).lstrip("/") for k in node_keys if k not in head.nodes}
        changed = {k: head.nodes.get(k) for k in node_keys}
        return ChangeSummary(node_keys, chunks, removed, resized_arrays(base.nodes, changed))

    def _rebase(self, changeset: Changeset, head_id: str, solver: Solver | str) -> Changeset:
        base = self._objects.snapshot(changeset.base)
        head = self._objects.snapshot(head_id)
        theirs = self._changes_since(base, head)
        ours_nodes = {k: v for k, v in changeset.nodes.items() if v is not None}
        arrays = array_paths(base.nodes) | array_paths(head.nodes) | array_paths(ours_nodes)
        if solver == "relocation":
            conflicts: list[Conflict] = []
            drop = {
                k
                for k in changeset.chunks
                if k in theirs.chunks
                or theirs.deleted(k)
                or split_chunk_key(k, arrays)[0] in theirs.resized
            }
        else:
            conflicts, drop = rebase_conflicts(
                changeset,
                base.nodes,
                theirs,
                head.nodes,
                arrays,
                solver,  # type: ignore[arg-type]
            )
        if conflicts:
            raise ConflictError(conflicts)
        rebased = changeset.copy()
        rebased.base = head_id
        for key in drop:
            rebased.chunks.pop(key, None)
        return rebased

    def _build_snapshot(
        self,
        parent: Snapshot,
        cs: Changeset,
        message: str,
        author: str | None,
        metadata: dict[str, Any],
        extra_parents: tuple[str, ...],
        *,
        relocation: bool = False,
        reshard: bool = False,
    ) -> tuple[Snapshot, TxLog, dict[str, bytes]]:
        nodes = dict(parent.nodes)
        removed_nodes = []
        for p in cs.deleted_prefixes:
            for k in [k for k in nodes if prefix_matches(k, p)]:
                removed_nodes.append(k)
                del nodes[k]
        for k, v in cs.nodes.items():
            if v is None:
                nodes.pop(k, None)
            else:
                nodes[k] = v
        max_refs = self._config.shard_max_refs
        update = manifest.apply_changes(
            parent.shards, cs.chunks, cs.deleted_prefixes, self._objects.shard, max_refs
        )
        if reshard:
            pending = dict(update.new_shards)

            def load(info: ShardInfo) -> ManifestShard:
                data = pending.get(info.digest)
                return ManifestShard.decode(data) if data is not None else self._objects.shard(info)

            rebuilt = manifest.rebuild(update.index, load, max_refs)
            kept = {s.digest for s in rebuilt.index}
            rebuilt.new_shards.update({d: b for d, b in pending.items() if d in kept})
            update = rebuilt
        txlog = TxLog(
            sorted(set(cs.nodes) | set(removed_nodes)),
            [] if relocation else sorted(cs.chunks),
            sorted(cs.deleted_prefixes),
            sorted(resized_arrays(parent.nodes, cs.nodes)),
            sorted(cs.chunks) if relocation else [],
        )
        snap = Snapshot(
            id=new_snapshot_id(),
            parents=(parent.id, *extra_parents),
            time=max(_now(), parent.time + dt.timedelta(microseconds=1)),
            author=author,
            message=message,
            metadata=metadata,
            nodes=nodes,
            shards=update.index,
            ancestry=[parent.id, *parent.ancestry[: Snapshot.ANCESTRY - 1]],
            history=_history_for(parent),
        )
        try:
            snap.encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"commit metadata is not serializable: {e}") from None
        return snap, txlog, update.new_shards


def async_twin(fn: Any) -> Any:
    """``<name>_async`` of a blocking method: the same call on a worker thread, for code running
    inside an event loop (Zarr's async machinery, notebooks with a running loop)."""

    async def twin(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    twin.__name__ = f"{fn.__name__}_async"
    twin.__qualname__ = f"{getattr(fn, '__qualname__', fn.__name__)}_async"
    twin.__doc__ = f"Async twin of ``{fn.__name__}``: runs it on a worker thread."
    return twin


for _name in ("create", "open", "open_or_create", "exists"):
    setattr(Repository, f"{_name}_async", staticmethod(async_twin(getattr(Repository, _name))))
for _name in (
    "list_branches",
    "lookup_branch",
    "create_branch",
    "reset_branch",
    "delete_branch",
    "list_tags",
    "lookup_tag",
    "create_tag",
    "delete_tag",
    "resolve",
    "diff",
    "merge",
    "readonly_session",
    "writable_session",
    "expire",
    "gc",
    "compact",
    "fsck",
):
    setattr(Repository, f"{_name}_async", async_twin(Repository.__dict__[_name]))


async def _log_async(
    self: Repository, ref: str = MAIN, *, limit: int | None = None
) -> list[CommitInfo]:
    """Async twin of ``log``: the commits as a list."""
    return await asyncio.to_thread(lambda: list(self.log(ref, limit=limit)))


Repository.log_async = _log_async  # type: ignore[attr-defined]

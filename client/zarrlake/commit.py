"""The commit engine: changeset -> snapshot, rebase, and the branch-moving protocol.

Commit protocol (see DESIGN.md): read the branch head; if it moved since the changeset's base,
rebase the changeset on it (conflicts are detected from the txlogs in between); write shards,
txlog and snapshot; then append one create-only journal entry. Losing that race means another
commit landed first: re-read the newest head, rebase onto it in one step, retry. Safety rests on
the create-only write alone; a lock, when configured, only keeps writers from stampeding.

Without a lock, writers of a contended branch go by age (:class:`WaitQueue`): each joins an
advisory queue and appends while it is the oldest live waiter, so the writer that has waited
longest goes next instead of whoever happens to know the head best.

How a changeset is re-applied on a moved head is a :class:`RebasePolicy`: user commits settle
conflicts with a solver (:class:`SolverPolicy`); maintenance brings its own (compaction's
relocation, which moves bytes without changing data).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from zarrlake.changeset import Changeset
from zarrlake.config import RepositoryConfig, fair_commits_default, narrow_rebase_default
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
    Conflict,
    ConflictError,
    CorruptObject,
    InvalidArgument,
    MergeConflictError,
    RefNotFound,
    StorageError,
    UnsupportedFormat,
    ZarrlakeError,
)
from zarrlake.format import manifest
from zarrlake.format.changes import ChunkChanges, sorted_keys
from zarrlake.format.ids import content_hash, new_snapshot_id
from zarrlake.format.manifest import ManifestUpdate, prefix_matches
from zarrlake.format.model import (
    AncestorRecord,
    ChunkRef,
    HistoryIndex,
    HistoryPage,
    JournalEntry,
    ManifestShard,
    ShardInfo,
    Snapshot,
    TxLog,
    ref_identity,
    wait_queue_prefix,
)
from zarrlake.history import CommitGraph
from zarrlake.nodes import array_paths, meta_key_node
from zarrlake.objects import CommitObjects, ObjectStore
from zarrlake.refs import BranchJournal, new_writer_id
from zarrlake.storage.base import Storage

log = logging.getLogger("zarrlake")

#: The lock name garbage collection's sweep and deduplicating commits share.
GC_LOCK_BRANCH = "__gc__"
MAX_COMMIT_ATTEMPTS = 200
#: A rebase over at least this many commits first asks the two manifests whether any of them
#: touched what it changes (:meth:`CommitEngine._untouched`), before reading their txlogs; for
#: changes of up to this many chunk keys.
NARROW_MIN_COMMITS = 4
NARROW_MAX_KEYS = 4096
#: Chunk changes above which a commit writes manifest shards while it cuts them.
SPILL_CHANGES = 65_536
#: Back-off after a lost journal append, before the writer has precedence: full jitter,
#: ``uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**losses))``.
BACKOFF_BASE_S = 0.005
BACKOFF_CAP_S = 0.25
#: How long after its last lost append an engine takes its branch to be contended: its commits
#: then queue by age before their first append (see :class:`WaitQueue`).
CONTENDED_S = 30.0
#: The longest a writer waits for older writers in one commit before it races anyway.
MAX_DEFER_S = 300.0
#: How much longer than the newest place in the queue a place must have stood unchanged, by the
#: server's clock, before a waiter that sees it (and finds it lapsed) deletes it: its writer is
#: dead (a live one replaces its place every third of a lease, 10 to 60 s).
LAPSED_US = 600 * 1_000_000


class _StaleFence(Exception):
    """The lock service handed out a token the branch journal already holds: it lost its counter
    (a Redis restart without persistence). Its floor is raised now; the lock is taken again."""


class BranchLock(Protocol):
    """What the engine needs of a lock service (:class:`zarrlake.RedisLock`, ``LocalLock``).

    ``hold`` is a lease on ``branch`` of repository ``repo_id`` for the duration of the ``with``
    block, yielding a fencing token (monotonic per repository) or None. A lock service may also
    offer ``raise_floor(repo_id, floor)`` to keep its tokens above ones the journal already holds,
    and ``record_head(repo_id, branch, seq)`` / ``last_head(repo_id, branch)``: where the last
    holder appended, so the next reads the head in one round (a hint the journal checks).
    """

    def hold(self, repo_id: str, branch: str) -> contextlib.AbstractContextManager[int | None]: ...


class CommitGuard(Protocol):
    """What a repository's governance (:mod:`zarrlake.governance`) asks before the engine
    moves a branch. Each raises to refuse (:class:`BranchProtected`, :class:`CheckFailed`), and
    then nothing is published.

    ``admit``: before a commit does any work (``merge``: a merge commit; ``maintenance``: a
    commit that only moves bytes, as compaction's). ``verify``: with the new snapshot written
    but not yet published (its objects unreachable until the journal append names them): the
    checks the branch requires, on exactly what would land, after any rebase (``encoded``,
    ``parent_encoded``: the two snapshots' bytes as their entries carry them). ``before_move``:
    before a reset (``action`` "reset") or a delete ("delete")."""

    def admit(self, branch: str, *, merge: bool, maintenance: bool) -> None: ...

    def verify(
        self,
        branch: str,
        parent: Snapshot,
        built: Snapshot,
        changeset: Changeset,
        *,
        merge: bool,
        encoded: bytes | None = None,
        parent_encoded: bytes | None = None,
    ) -> None: ...

    def before_move(self, branch: str, action: str) -> None: ...


class RebasePolicy(Protocol):
    """How a changeset made on ``base`` is re-applied on a branch head that moved.

    ``settle`` returns the conflicts (the commit fails with :class:`ConflictError` if there are
    any) and the chunk keys to drop from the changeset. ``relocates`` marks a changeset that only
    moves bytes (same data, new location): its txlog records the keys as relocated, not written,
    so later rebases and merges see no change of data.
    """

    @property
    def relocates(self) -> bool: ...

    def settle(
        self,
        ours: Changeset,
        base: Snapshot,
        head: Snapshot,
        theirs: ChangeSummary,
        arrays: set[str],
    ) -> tuple[list[Conflict], set[str]]: ...


@dataclass(frozen=True)
class SolverPolicy:
    """The policy of user commits: every overlap conflicts, except chunk conflicts ``solver``
    (:class:`UseOurs` / :class:`UseTheirs`) settles. Raises TypeError for another solver."""

    solver: Solver = None

    def __post_init__(self) -> None:
        if self.solver is not None and not isinstance(self.solver, UseOurs | UseTheirs):
            raise InvalidArgument("solver must be None, zarrlake.UseOurs() or zarrlake.UseTheirs()")

    @property
    def relocates(self) -> bool:
        return False

    def settle(
        self,
        ours: Changeset,
        base: Snapshot,
        head: Snapshot,
        theirs: ChangeSummary,
        arrays: set[str],
    ) -> tuple[list[Conflict], set[str]]:
        return rebase_conflicts(ours, base.nodes, theirs, head.nodes, arrays, self.solver)


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


def _open_records(snap: Snapshot) -> list[tuple[str, AncestorRecord]]:
    """``snap``'s own record and those of its ancestors no history page holds yet, newest first.

    A snapshot from before the index has no pages: all its inline records are open, so the first
    page sealed on top of old history covers as much of it as the snapshot knows.
    """
    own = AncestorRecord(snap.parents, snap.time, snap.author, snap.message, snap.metadata)
    unsealed = snap.index.unsealed if snap.index is not None else len(snap.history)
    return [(snap.id, own), *zip(snap.ancestry, snap.history[:unsealed], strict=False)]


def _index_for(
    parent: Snapshot,
    extra: list[Snapshot],
    inline: int,
    page_of: Callable[[str], HistoryPage | None],
) -> tuple[HistoryIndex, tuple[str, bytes] | None]:
    """The history index of a child of ``parent`` (and of ``extra`` merge parents) that carries
    ``inline`` history records, and the page it seals, if any (digest, encoded).

    The open records grow by one per commit; at :attr:`HistoryIndex.PAGE` of them (or when the
    child's inline records could no longer hold them all, or at a merge, whose other line must
    become reachable) they are sealed into one page naming the pages before it. Outside merges,
    the seal folds in the newest page (read with ``page_of``; None: unreadable, not folded) while
    the two hold at most ``PAGE * FOLD`` records, so a log reads one page per 1,008 commits, not
    one per 63. Bytes per commit stay bounded: at most ``PAGE * FOLD`` records every ``PAGE``
    commits, ``WINDOW`` digests in the snapshot.
    """
    pages = parent.index.pages if parent.index is not None else ()
    opened = (parent.index.unsealed if parent.index is not None else 0) + 1
    if not extra and parent.index is not None and opened < HistoryIndex.PAGE and opened <= inline:
        return HistoryIndex(opened, pages), None
    records = _open_records(parent)
    older = list(pages)
    if not extra and pages:
        newest = page_of(pages[0])
        if newest is not None and len(newest.ids) + len(records) <= (
            HistoryIndex.PAGE * HistoryIndex.FOLD
        ):
            # The folded page's records continue the open ones (it was sealed from the records
            # just before them); the pages before it stay where they were.
            records += zip(newest.ids, newest.records, strict=True)
            older, pages = list(newest.older), pages[1:]
    for snap in extra:
        records += _open_records(snap)
        older += snap.index.pages if snap.index is not None else ()
    # A merge soon after a fork: both lines carry the commits before it; each record once.
    unique = dict(records)
    page = HistoryPage(tuple(unique), tuple(unique.values()), tuple(dict.fromkeys(older))).encode()
    digest = content_hash(page)
    return HistoryIndex(0, (digest, *pages)[: HistoryIndex.WINDOW]), (digest, page)


@dataclass(frozen=True)
class Waiter:
    """One optimistic writer waiting to commit to a branch: trying since ``since``, alive until
    ``until`` (wall-clock microseconds; skew between machines only reorders who goes first, it
    never decides anything). Ordered as their keys sort in a listing (:meth:`name`): oldest
    first, then the one whose lease ends first, then by writer id, so that every writer agrees
    who is first."""

    since: int
    writer: str
    until: int

    def _order(self) -> tuple[int, int, str]:
        return (self.since, self.until, self.writer)

    def __lt__(self, other: Waiter) -> bool:
        return self._order() < other._order()

    def name(self) -> str:
        """The waiter's key below the branch's queue: sorts oldest first."""
        return f"{self.since:016x}.{self.until:016x}.{self.writer}"

    @classmethod
    def parse(cls, name: str) -> Waiter | None:
        """The waiter a key names; None for a key of another shape (ignored, as a hint is)."""
        since, _, rest = name.partition(".")
        until, _, writer = rest.partition(".")
        try:
            return cls(int(since, 16), writer, int(until, 16)) if writer else None
        except ValueError:
            return None


def _micros() -> int:
    return time.time_ns() // 1000


class WaitQueue:
    """Age-based precedence among optimistic writers of one branch: an advisory queue of
    create-and-delete objects, ``refs/wait.<branch>/<since>.<until>.<writer>``.

    Why: without it, the winner of the create-only race is whoever appends first, and a writer
    that has just committed knows the head and appends first again, while one that lost many
    races has the most catching up to do — the tail of the issue-45 profile (one writer's five
    commits in a row while others lost 60 races for one). On a contended branch a writer joins
    the queue and appends only while it is the oldest live waiter; the others wait (polling the
    queue about once per attempt's time) instead of racing. Each writer writes and deletes only
    its own objects, so no update of one is lost to another's — with one exception: a waiter
    that dies stops renewing its ``until`` and is passed over once that is past, and an object
    the server shows unchanged for :data:`LAPSED_US` longer than the newest in the queue (a
    live writer replaces its own every third of a lease) is deleted by whoever sees it. The
    queue is only a hint: no read of it decides anything, and the create-only journal append
    still decides every race.
    """

    def __init__(self, storage: Storage, root: str = "") -> None:
        self.storage = storage
        self.root = root

    def _prefix(self, branch: str) -> str:
        return self.root + wait_queue_prefix(branch)

    def waiters(self, branch: str) -> list[Waiter]:
        """The branch's waiters, live or not, oldest first."""
        prefix = self._prefix(branch)
        found = (Waiter.parse(k[len(prefix) :]) for k in self.storage.list_keys(prefix))
        return sorted(w for w in found if w is not None)

    def look(self, branch: str) -> tuple[list[Waiter], list[Waiter]]:
        """The branch's waiters, live or not, oldest first; and those whose objects the server
        shows unchanged for :data:`LAPSED_US` longer than the newest one's (by the server's
        clock alone: the writers' clocks may disagree by any amount): dead writers'."""
        prefix = self._prefix(branch)
        seen = [(Waiter.parse(o.key[len(prefix) :]), o.modified) for o in self.storage.list(prefix)]
        found = [(w, m) for w, m in seen if w is not None]
        newest = max((m for _, m in found), default=None)
        dead = [
            w
            for w, m in found
            if newest is not None and (newest - m).total_seconds() * 1e6 > LAPSED_US
        ]
        return sorted(w for w, _ in found), dead

    def first(self, branch: str, now: int) -> Waiter | None:
        """The oldest waiter alive at ``now`` (microseconds), if any."""
        return next((w for w in self.waiters(branch) if w.until >= now), None)

    def join(self, branch: str, waiter: Waiter) -> None:
        self.storage.put(self._prefix(branch) + waiter.name(), b"")

    def leave(self, branch: str, *waiters: Waiter) -> None:
        self.storage.delete_many([self._prefix(branch) + w.name() for w in waiters])


class _Contender:
    """One optimistic commit's place in the race for its branch (see :class:`WaitQueue`)."""

    def __init__(self, engine: CommitEngine, branch: str) -> None:
        self.engine = engine
        self.branch = branch
        self.writer = new_writer_id()
        self.since = _micros()
        self.losses = 0
        self.joined: Waiter | None = None

    @property
    def queued(self) -> bool:
        """Whether this commit took a place in the queue (the branch is contended)."""
        return self.joined is not None

    def _lease_us(self) -> int:
        """How long our place stays live without renewal: many attempts' worth, so a slow but
        live writer keeps it, and a dead one holds nobody up for long."""
        return int(min(60.0, max(10.0, 20 * self.engine.window_s)) * 1e6)

    def _renew(self, queue: WaitQueue, now: int) -> None:
        """Join the queue, or move our ``until`` on once a third of the lease is gone."""
        lease = self._lease_us()
        if self.joined is not None and self.joined.until - now > lease * 2 // 3:
            return
        old, self.joined = self.joined, Waiter(self.since, self.writer, now + lease)
        with contextlib.suppress(ZarrlakeError, OSError):
            queue.join(self.branch, self.joined)
            if old is not None:
                queue.leave(self.branch, old)

    def before_attempt(self) -> None:
        """Before an append on a contended branch: take our place in the queue and wait while
        an older live waiter is ahead of us (at most :data:`MAX_DEFER_S`)."""
        engine = self.engine
        queue = engine.waiting
        if queue is None:
            return
        if self.losses == 0 and time.monotonic() >= engine.contended_until:
            return  # uncontended: the single-writer path reads and writes nothing more
        deadline = time.monotonic() + MAX_DEFER_S
        deferred = False
        while True:
            now = _micros()
            self._renew(queue, now)
            try:
                waiters, dead = queue.look(self.branch)
            except (ZarrlakeError, OSError):
                return  # the queue is a hint: unreadable, race as before
            live = [w.writer for w in waiters if w.until >= now]
            gone = [w for w in dead if w.until < now]
            if gone:
                # Places of writers long dead (killed, or their machine gone): nobody else
                # would ever take them away, and every look lists them.
                with contextlib.suppress(ZarrlakeError, OSError):
                    queue.leave(self.branch, *gone)
            ahead = live.index(self.writer) if self.writer in live else len(live)
            if ahead == 0 or time.monotonic() >= deadline:
                return
            if not deferred:
                engine.stats["deferrals"] += 1
                deferred = True
            # Each waiter ahead needs about one attempt's time. Next in line, look again often
            # (the hand-over is what the branch waits for); further back, after about half of
            # those ahead are through — rarely enough to keep a long queue's listings from
            # loading the server and the writers' own CPU, never so late that our turn waits
            # for our next look. (A cap of 4 windows had 100 waiters listing the queue every
            # 2 s: the wall of 100 x 5 commits on SeaweedFS was 232 s; with 16, 103 s.)
            pace = 0.25 if ahead == 1 else min(ahead / 2, 16.0)
            window = min(0.5, max(0.01, engine.window_s))
            time.sleep(random.uniform(0.5, 1.5) * window * pace)

    def lost(self) -> None:
        """After a lost append: remember the branch is contended, and back off — with jitter,
        exponentially, capped; not at all for the oldest waiter, whom the others wait for."""
        self.losses += 1
        engine = self.engine
        engine.contended_until = time.monotonic() + CONTENDED_S
        if self.joined is not None:
            return  # we were first in the queue (or it was unreadable): try again at once
        cap = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(self.losses, 10))
        time.sleep(random.uniform(0, cap))

    def done(self) -> None:
        """The commit is over (landed or failed): leave the queue."""
        if self.joined is not None and self.engine.waiting is not None:
            with contextlib.suppress(ZarrlakeError, OSError):
                self.engine.waiting.leave(self.branch, self.joined)
            self.joined = None


class CommitEngine:
    """Publishes changesets as commits and moves branches, under the journal's create-only rule.

    ``stats`` are per-process counters of the protocol (for benchmarks and monitoring):
    ``rebases`` — the branch had moved and the changeset was rebased onto its head;
    ``append_retries`` — another commit won the create-only journal append (a retry);
    ``deferrals`` — optimistic commits that waited for an older writer (:class:`WaitQueue`)
    before appending; ``narrow_rebases`` — rebases that the two manifests settled without
    reading the txlogs in between (:meth:`_untouched`).
    """

    def __init__(
        self,
        repo_id: str,
        config: RepositoryConfig,
        objects: ObjectStore,
        journal: BranchJournal,
        graph: CommitGraph,
        lock: BranchLock | None,
    ) -> None:
        self.repo_id = repo_id
        self.config = config
        self.objects = objects
        self.journal = journal
        self.graph = graph
        self.lock = lock
        self.stats: dict[str, int] = {
            "rebases": 0,
            "append_retries": 0,
            "deferrals": 0,
            "narrow_rebases": 0,
        }
        # Optimistic writers' queue by age, unless $ZARRLAKE_FAIR_COMMITS turns it off
        # (bench/RESULTS.md, issue 45); None on a storage that cannot list (plain HTTP,
        # read-only: it never commits anyway).
        self.waiting: WaitQueue | None = (
            WaitQueue(journal.storage, journal.root)
            if fair_commits_default()
            and journal.storage.supports_writes
            and journal.storage.supports_listing
            else None
        )
        # Whether rebases may settle from the manifests (docs/design/narrow-rebase.md).
        self.narrow = narrow_rebase_default()
        # Until when (time.monotonic()) this engine takes branches to be contended; and a moving
        # average of one attempt's time (head read to append), which scales the waits.
        self.contended_until = 0.0
        self.window_s = 0.05
        #: Branch protection and checks (a :class:`CommitGuard`), installed by the repository.
        self.guard: CommitGuard | None = None

    # -- locks -------------------------------------------------------------------------------------

    def hold_branch(self, branch: str) -> contextlib.AbstractContextManager[int | None]:
        """The branch's lease with its fencing token, or a no-op yielding None without a lock."""
        if self.lock is None:
            return contextlib.nullcontext(None)
        return self.lock.hold(self.repo_id, branch)

    def hold_gc(self) -> contextlib.AbstractContextManager[int | None]:
        """The lease GC's sweep and a deduplicating commit's existence check share (no-op
        without a lock): while one holds it, the other waits."""
        return self.hold_branch(GC_LOCK_BRANCH)

    # -- branches ----------------------------------------------------------------------------------

    def initialize(self, branch: str, *, publish: bool = True) -> None:
        """Give ``branch`` an empty root commit if it has no journal yet (a new repository);
        ``publish``: as :meth:`BranchJournal.append`'s."""
        if self.journal.head(branch) is not None:
            return
        snap = Snapshot(
            new_snapshot_id(),
            (),
            _now(),
            None,
            "Repository initialized",
            {},
            {},
            [],
            index=HistoryIndex(0, ()),
        )
        commit = CommitObjects(snap, snap.encode(), TxLog([], [], [], []), ManifestUpdate([], {}))
        self.objects.put_commit(commit)
        self.journal.append(
            branch,
            JournalEntry(0, snap.id, None, _now(), new_writer_id(), snapshot_data=commit.encoded),
            publish=publish,
        )

    def reset_branch(self, name: str, target: str, *, expected: str | None = None) -> str:
        """Point branch ``name`` at snapshot ``target``; with ``expected``, only if the head is
        still that snapshot (else :class:`ConflictError`). Raises :class:`RefNotFound`."""
        if self.guard is not None:
            self.guard.before_move(name, "reset")
        # The entry carries the snapshot, as a commit's does: a fresh reader of the branch then
        # needs no read of the snapshot object. Its bytes as stored, not a re-encoding.
        encoded = self.objects.stored_snapshot_bytes(target)

        def reset(cur: JournalEntry, token: int | None, fence: int | None) -> JournalEntry:
            if expected is not None and cur.snapshot != expected:
                raise ConflictError(
                    [Conflict("branch-moved", name)],
                    f"branch {name!r} is at {cur.snapshot}, not the expected {expected}",
                )
            return JournalEntry(
                cur.seq + 1,
                target,
                cur.snapshot,
                _now(),
                new_writer_id(),
                token,
                encoded,
                fence=fence,
            )

        self._move_branch(name, reset)
        return target

    def delete_branch(self, name: str) -> None:
        """Append a deletion entry to branch ``name``. Raises :class:`RefNotFound`."""
        if self.guard is not None:
            self.guard.before_move(name, "delete")

        def delete(cur: JournalEntry, token: int | None, fence: int | None) -> JournalEntry:
            return JournalEntry(
                cur.seq + 1, None, cur.snapshot, _now(), new_writer_id(), token, fence=fence
            )

        self._move_branch(name, delete)

    def _move_branch(
        self,
        name: str,
        entry_for: Callable[[JournalEntry, int | None, int | None], JournalEntry],
    ) -> None:
        """Append ``entry_for(head entry, token, fence)`` to live branch ``name``, holding its lock,
        until the append lands. A token the journal already holds (the lock service lost its
        counter) is given back for a new one, as a commit does."""
        for attempt in range(3):
            try:
                with self.hold_branch(name) as token:
                    while True:
                        cur = self.journal.current(name)
                        fence = self._fence(name, cur, token, refence=attempt < 2)
                        if self.journal.append(name, entry_for(cur, token, fence)):
                            return
            except _StaleFence:
                continue
        raise AssertionError("unreachable: the last attempt keeps a stale token")

    def _fence(
        self, name: str, head: JournalEntry, token: int | None, *, refence: bool
    ) -> int | None:
        """The ``fence`` of an entry after ``head`` on branch ``name``: the highest token the
        journal holds up to ``head``. Without a ``token`` (no lock), as far as ``head`` says
        (no read). With one, looked up as far as needed — and :class:`_StaleFence` raised (the
        lock service's floor raised first) when ``token`` does not exceed it."""
        if token is None:
            return head.highest_token
        recorded = self.journal.last_token(name, head)
        if recorded is not None and token <= recorded:
            # The lock service handed out a token the journal already holds: it lost its
            # counter (a Redis restart without persistence). Safety is the journal's; keep
            # tokens monotonic by raising the service's floor past the journal's.
            raise_floor = getattr(self.lock, "raise_floor", None)
            if raise_floor is not None and refence:
                raise_floor(self.repo_id, recorded)
                raise _StaleFence  # let go of the lock and take it again, with a new token
        return recorded

    # -- commits -----------------------------------------------------------------------------------

    def commit(
        self,
        branch: str,
        changeset: Changeset,
        *,
        message: str,
        author: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        rebase: bool = True,
        policy: RebasePolicy | None = None,
        extra_parents: tuple[str, ...] = (),
        reshard: bool = False,
        prebuilt: ManifestUpdate | None = None,
        ready: Callable[[], None] | None = None,
    ) -> str:
        """Publish ``changeset`` on ``branch`` and return the new snapshot id.

        If the branch moved since ``changeset.base``, the changeset is rebased with ``policy``
        (default: :class:`SolverPolicy` without a solver) — or, with ``rebase=False``, the commit
        fails with :class:`ConflictError`. ``extra_parents`` make a merge commit; ``reshard``
        re-cuts the whole manifest into evenly filled shards. ``prebuilt`` is the manifest the
        changes make of their base, already written (compaction cuts it in parallel tasks): used
        as is while the branch has not moved, else the changes are applied as usual. ``ready``
        waits for what the changes name and is still being written (a session's last pack): it
        is called before each journal append (before taking the branch, with a lock service),
        and if it raises, nothing is published and the commit fails with its error. Raises
        :class:`ConflictError`,
        :class:`RefNotFound` (no such branch), :class:`RetryableError` (a deduplicated chunk was
        garbage-collected meanwhile), ``ValueError`` (metadata not serializable).
        """
        policy = policy if policy is not None else SolverPolicy()
        meta = dict(metadata or {})
        verify: Callable[..., None] | None = None
        guard = self.guard
        if guard is not None:
            merge, maintenance = bool(extra_parents), policy.relocates
            guard.admit(branch, merge=merge, maintenance=maintenance)
            if not maintenance:
                verify = functools.partial(guard.verify, branch, merge=merge)
        if ready is not None and self.lock is not None:
            # Other writers of the branch queue on the lock: they must not wait on this
            # session's uploads too.
            ready()
            ready = None
        for attempt in range(3):
            try:
                with self.hold_branch(branch) as token:
                    return self._commit_holding(
                        branch,
                        token,
                        changeset,
                        refence=attempt < 2,
                        message=message,
                        author=author,
                        metadata=meta,
                        rebase=rebase,
                        policy=policy,
                        extra_parents=extra_parents,
                        reshard=reshard,
                        prebuilt=prebuilt,
                        ready=ready,
                        verify=verify,
                    )
            except _StaleFence:
                continue
        raise AssertionError("unreachable: the last attempt keeps a stale token")

    def _commit_holding(
        self,
        branch: str,
        token: int | None,
        changeset: Changeset,
        *,
        refence: bool,
        message: str,
        author: str | None,
        metadata: dict[str, Any],
        rebase: bool,
        policy: RebasePolicy,
        extra_parents: tuple[str, ...],
        reshard: bool,
        prebuilt: ManifestUpdate | None,
        ready: Callable[[], None] | None = None,
        verify: Callable[..., None] | None = None,
    ) -> str:
        """:meth:`commit` while holding the branch (``token``: the lock's fencing token; with
        ``refence``, a stale one is given back for a new one, else it is used as it is)."""
        # Holding the lock, the lock's queue orders writers; without it, the age queue does.
        contender = _Contender(self, branch) if token is None else None
        try:
            return self._attempts(
                branch,
                token,
                changeset,
                contender,
                refence=refence,
                message=message,
                author=author,
                metadata=metadata,
                rebase=rebase,
                policy=policy,
                extra_parents=extra_parents,
                reshard=reshard,
                prebuilt=prebuilt,
                ready=ready,
                verify=verify,
            )
        finally:
            if contender is not None:
                contender.done()

    def _attempts(
        self,
        branch: str,
        token: int | None,
        changeset: Changeset,
        contender: _Contender | None,
        *,
        refence: bool,
        message: str,
        author: str | None,
        metadata: dict[str, Any],
        rebase: bool,
        policy: RebasePolicy,
        extra_parents: tuple[str, ...],
        reshard: bool,
        prebuilt: ManifestUpdate | None,
        ready: Callable[[], None] | None,
        verify: Callable[..., None] | None,
    ) -> str:
        """The attempts of :meth:`_commit_holding`: each reads the head (or trusts the one this
        client knows), rebases on it if it moved, writes the commit's objects and appends; a lost
        append backs off (``contender``: without a lock, by age) and tries again."""
        meta = metadata
        rebased = False
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            if contender is not None:
                contender.before_attempt()
            started = time.monotonic()
            # Without a lock, first try on the head this client last saw (the session's base,
            # usually), checking that its entry is still there alongside writing the commit's
            # objects: if the branch moved since, the create-only append below fails and the
            # next attempt reads the head. The append decides either way, so this saves a
            # listing and a round trip, never a check. Holding the lock, read the head: it
            # cannot move under us, so the first append always lands.
            # A writer that queued (a contended branch) has waited for others' commits: the
            # head it knows is stale, and an append on it would only lose.
            # Go straight to the newest head (a listing), not entry by entry from the known one.
            queued = contender is not None and contender.queued
            if queued:
                self.journal.forget(branch)
            known = self.journal.known(branch) if attempt == 0 and token is None else None
            if known is not None and known.snapshot is None:
                known = None
            head_entry = known if known is not None else self._read_head(branch, token, attempt)
            head = head_entry.snapshot
            assert head is not None
            fence = self._fence(branch, head_entry, token, refence=refence)
            self.journal.ready_to_publish(branch, head_entry)
            if head != changeset.base:
                if not rebase:
                    raise ConflictError(
                        [Conflict("branch-moved", branch)],
                        f"branch {branch!r} moved from {changeset.base} to {head} "
                        "(commit with rebase=True to rebase)",
                    )
                changeset = self.rebase(changeset, head, policy)
                rebased = True
                self.stats["rebases"] += 1
                if token is None:
                    # Others commit to this branch too: queue by age from the next commit on
                    # (a writer that never lost a race would otherwise keep winning it).
                    self.contended_until = time.monotonic() + CONTENDED_S
            parent = self.objects.snapshot(head)
            built = self._build_snapshot(
                parent,
                changeset,
                message,
                author,
                meta,
                extra_parents,
                relocation=policy.relocates,
                reshard=reshard,
                # The tasks' manifest is of the head the changes were planned on: only a
                # changeset never rebased may use it.
                prebuilt=prebuilt if not rebased else None,
            )
            snap = built.snapshot
            check = None if known is None else self.journal.entry_key(branch, head_entry.seq)
            found = self.objects.put_commit(built, read=check)
            if known is not None and not self.journal.confirms(branch, found, known):
                # Not the entry this client saw: a repository created anew at this location.
                self.journal.forget(branch)
                continue
            if ready is not None:
                ready()  # (an upload that fails here fails the commit: nothing named it yet)
            if verify is not None:
                # The checks read what would land, uploads done; a refusal publishes nothing.
                verify(
                    parent,
                    snap,
                    changeset,
                    encoded=built.encoded,
                    parent_encoded=head_entry.snapshot_data,
                )
            entry = JournalEntry(
                head_entry.seq + 1,
                snap.id,
                head,
                _now(),
                new_writer_id(),
                token,
                built.encoded,
                fence=fence,
            )
            # Chunks we deduplicated against may be old garbage GC is about to sweep: check
            # they still exist, and (with a lock service) keep GC's deletes out until the
            # journal entry that makes them reachable is written.
            guard = self.hold_gc() if changeset.dedup_chunks else contextlib.nullcontext()
            with guard:
                if changeset.dedup_chunks:
                    self.objects.check_chunks_exist(changeset.dedup_chunks)
                published = self.journal.append(branch, entry)
            # One attempt's time, smoothed: what a deferring writer waits per look.
            self.window_s = 0.8 * self.window_s + 0.2 * (time.monotonic() - started)
            if published:
                record = getattr(self.lock, "record_head", None) if token is not None else None
                if record is not None:
                    record(self.repo_id, branch, entry.seq)
                return snap.id
            self.stats["append_retries"] += 1
            # Another commit took this sequence number: back off, then rebase on the newest head.
            if contender is not None:
                contender.lost()
            else:
                # Holding the lock, a lost append means a lapsed lease (a paused process): the
                # next holder already appended. Retry soon, with jitter, bounded.
                time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)))
        raise ZarrlakeError(f"could not commit to {branch!r} after {MAX_COMMIT_ATTEMPTS} attempts")

    def _read_head(self, branch: str, token: int | None, attempt: int) -> JournalEntry:
        """The head entry of live ``branch``, read. Holding the lock, first where the lock
        service says its last holder appended (one round: that entry, and the next absent),
        rather than from the head this client knew, which a queue of writers left far behind.
        Raises :class:`RefNotFound`."""
        if token is not None and attempt == 0:
            said = getattr(self.lock, "last_head", None)
            seq = None if said is None else said(self.repo_id, branch)
            known = self.journal.known(branch)
            if seq is not None and (known is None or known.seq < seq):
                try:
                    entry = self.journal.head_at(branch, seq)
                except StorageError:
                    entry = None  # a hint: read the head as without one
                if entry is not None and entry.snapshot is not None:
                    return entry
        return self.journal.current(branch)

    def merge(
        self,
        source_id: str,
        into: str,
        *,
        message: str,
        author: str | None,
        metadata: Mapping[str, Any],
        strategy: str | None,
    ) -> str:
        """Three-way merge of snapshot ``source_id`` into branch ``into``; the new head (or the
        old one if ``source_id`` is already merged). Raises :class:`MergeConflictError`."""
        dest_id = self.journal.current(into).snapshot
        assert dest_id is not None
        base_id = self.graph.merge_base(source_id, dest_id)
        if base_id == source_id:
            return dest_id  # already merged
        src = self.objects.snapshot(source_id)
        dest = self.objects.snapshot(dest_id)
        base = (
            self.objects.snapshot(base_id)
            if base_id is not None
            else Snapshot("", (), _now(), None, "", {}, {}, [])
        )
        load = self.objects.shard
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
        changeset = Changeset(
            uuid.uuid4().hex, dest_id, chunks=ChunkChanges(plan.chunks), nodes=plan.nodes
        )
        return self.commit(
            into,
            changeset,
            message=message,
            author=author,
            metadata=metadata,
            rebase=True,
            extra_parents=(source_id,),
        )

    # -- rebase ------------------------------------------------------------------------------------

    def rebase(self, changeset: Changeset, head_id: str, policy: RebasePolicy) -> Changeset:
        """``changeset`` re-based on snapshot ``head_id``, with the keys ``policy`` drops removed.
        Raises :class:`ConflictError` with every conflict the policy reports."""
        base = self.objects.snapshot(changeset.base)
        head = self.objects.snapshot(head_id)
        # Only where settling by net change decides as the txlogs would, bar a warning: not
        # for a solver that keeps their side (it would keep ours for a chunk they wrote back).
        narrow = isinstance(policy, SolverPolicy) and not isinstance(policy.solver, UseTheirs)
        theirs = self.changes_since(base, head, ours=changeset if narrow else None)
        ours_nodes = {k: v for k, v in changeset.nodes.items() if v is not None}
        arrays = array_paths(base.nodes) | array_paths(head.nodes) | array_paths(ours_nodes)
        conflicts, drop = policy.settle(changeset, base, head, theirs, arrays)
        if conflicts:
            raise ConflictError(conflicts)
        rebased = changeset.copy()
        rebased.base = head_id
        for key in drop:
            rebased.chunks.pop(key, None)
        return rebased

    def changes_since(
        self, base: Snapshot, head: Snapshot, *, ours: Changeset | None = None
    ) -> ChangeSummary:
        """What happened between ``base`` and ``head``: from txlogs along the first-parent chain,
        or — if ``base`` is not on it (the branch was reset, or history expired) — from a diff.

        Given ``ours`` (the changes about to be rebased), an empty summary where the two
        manifests show that nothing in between touched what ``ours`` changes (see
        :meth:`_untouched`): what a rebase asks, without a txlog read per commit."""
        logs: list[TxLog] = []
        chain = self._chain_to(base, head)
        if base.id in chain:
            behind = chain.index(base.id)
            if (
                ours is not None
                and self.narrow
                and behind >= NARROW_MIN_COMMITS
                and self._untouched(ours, base, head, behind)
            ):
                self.stats["narrow_rebases"] += 1
                return ChangeSummary()
            # The head names its first-parent ancestors: fetch the txlogs in between concurrently
            # instead of one dependent round trip per commit (a session that waited for the
            # branch lock is often many commits behind).
            try:
                logs = self.objects.txlogs(chain[:behind])
            except RefNotFound:
                return self._summary_from_diff(base, head)
            cur = base
        else:
            cur = head
        expired = self.graph.expiry.expired()
        while cur.id != base.id:
            if not cur.parents or len(logs) > 10_000 or cur.parents[0] in expired:
                return self._summary_from_diff(base, head)
            try:
                logs.append(self.objects.txlog(cur.id))
                cur = self.objects.snapshot(cur.parents[0])
            except RefNotFound:
                return self._summary_from_diff(base, head)
        summary = ChangeSummary()
        for txlog in logs:
            summary.add_txlog(txlog)
        return summary

    def _untouched(self, ours: Changeset, base: Snapshot, head: Snapshot, commits: int) -> bool:
        """Whether the ``commits`` commits from ``base`` to ``head`` provably left alone every
        chunk key ``ours`` changes, read off the two manifests: each key's ref means the same
        bytes in both (:func:`ref_identity`: a compaction's move is no change), and no node
        changed at all (so nothing was deleted or resized). False is no verdict, only "read the
        txlogs": so for changes with deleted subtrees or resized arrays of their own (whose
        conflicts depend on others' keys), too many keys, or more shards to read than half the
        txlogs they replace (a commit's txlog is small, a shard need not be).

        It judges by net change, as a rebase onto a reset branch does: a chunk someone wrote
        and wrote back to the same bytes, or an array deleted and made again just as it was,
        is left alone here — the outcome of running the commits one after the other."""
        if (
            ours.deleted_prefixes
            or len(ours.chunks) > NARROW_MAX_KEYS
            or base.nodes != head.nodes
            or resized_arrays(base.nodes, ours.nodes)
        ):
            return False
        pairs: list[tuple[str, ShardInfo | None, ShardInfo | None]] = []
        wanted: dict[str, ShardInfo] = {}
        for key in ours.chunks:
            before = manifest.shard_of(base.shards, key)
            after = manifest.shard_of(head.shards, key)
            if before is not None and after is not None and before.digest == after.digest:
                continue  # the same shard object: the same ref
            if before is None and after is None:
                continue  # no shard on either side can hold it: absent from both
            for info in (before, after):
                if info is not None:
                    wanted[info.digest] = info
            if len(wanted) > max(2, commits // 2):
                return False
            pairs.append((key, before, after))
        if not pairs:
            return True
        loaded = dict(
            zip(
                wanted,
                self.objects.storage.map(self.objects.shard, list(wanted.values())),
                strict=True,
            )
        )

        def ref(info: ShardInfo | None, key: str) -> ChunkRef | None:
            return None if info is None else loaded[info.digest].get(key)

        return all(
            ref_identity(ref(before, key)) == ref_identity(ref(after, key))
            for key, before, after in pairs
        )

    def _chain_to(self, base: Snapshot, head: Snapshot) -> list[str]:
        """``head``'s first-parent chain, newest first, as far back as ``base`` if it is on it.

        Each snapshot names its newest :data:`Snapshot.ANCESTRY` ancestors; further back, hop
        to the oldest one named and read its list, so a writer more than that many commits
        behind (one that waited for many others) reads one snapshot per ``ANCESTRY`` commits
        and then every txlog in one concurrent round, not a txlog and a snapshot per commit.
        Stops (without ``base``) at a root, a missing or expired snapshot, or a newer base."""
        chain = [head.id, *head.ancestry]
        cur = head
        while base.id not in chain and len(cur.ancestry) >= Snapshot.ANCESTRY:
            if len(chain) > 10_000 or base.time > cur.time:
                break
            try:
                cur = self.objects.snapshot(chain[-1])
            except (RefNotFound, CorruptObject, UnsupportedFormat):
                break
            chain += cur.ancestry
        return chain

    def _summary_from_diff(self, base: Snapshot, head: Snapshot) -> ChangeSummary:
        chunks = {
            k for k, _, _ in manifest.diff_entries(base.shards, head.shards, self.objects.shard)
        }
        node_keys = {
            k for k in set(base.nodes) | set(head.nodes) if base.nodes.get(k) != head.nodes.get(k)
        }
        removed = {meta_key_node(k).lstrip("/") for k in node_keys if k not in head.nodes}
        changed = {k: head.nodes.get(k) for k in node_keys}
        return ChangeSummary(node_keys, chunks, removed, resized_arrays(base.nodes, changed))

    # -- snapshots ---------------------------------------------------------------------------------

    def _apply(
        self, parent: Snapshot, cs: Changeset, max_refs: int, *, spill: bool, reshard: bool
    ) -> ManifestUpdate:
        """The manifest ``cs`` makes of ``parent``'s (re-cut whole with ``reshard``)."""
        update = manifest.apply_changes(
            parent.shards,
            cs.chunks,
            cs.deleted_prefixes,
            self.objects.shard,
            max_refs,
            sink=self.objects.put_shards if spill else None,
            sink_batch=max(1, self.objects.storage.concurrency) * 2,
        )
        if reshard:
            pending = update

            def load(info: ShardInfo) -> ManifestShard:
                built = pending.built.get(info.digest)
                return built if built is not None else self.objects.shard(info)

            rebuilt = manifest.rebuild(update.index, load, max_refs)
            kept = {s.digest for s in rebuilt.index}
            for digest in kept & pending.new_shards.keys():
                rebuilt.new_shards[digest] = pending.new_shards[digest]
                rebuilt.built[digest] = pending.built[digest]
            update = rebuilt
        return update

    def _history_page(self, digest: str) -> HistoryPage | None:
        """A page to fold into the one a commit seals; None if it cannot be read (the commit
        then seals its records alone, as an index never decides what a commit holds)."""
        try:
            return self.objects.history_page(digest)
        except (RefNotFound, CorruptObject, UnsupportedFormat) as e:
            log.warning("history page %s is unreadable (%s): not folded", digest, e)
            return None

    def _build_snapshot(
        self,
        parent: Snapshot,
        cs: Changeset,
        message: str,
        author: str | None,
        metadata: dict[str, Any],
        extra_parents: tuple[str, ...],
        *,
        relocation: bool,
        reshard: bool,
        prebuilt: ManifestUpdate | None = None,
    ) -> CommitObjects:
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
        max_refs = self.config.shard_max_refs
        # A large change writes its shards as it cuts them rather than holding them all until
        # the commit's one round of writes (a million refs are ~70 MB of encoded shards). Like
        # every object of a commit, they are unreachable until the journal entry names them.
        spill = len(cs.chunks) > SPILL_CHANGES and not reshard
        if prebuilt is not None:
            update = prebuilt
        else:
            update = self._apply(parent, cs, max_refs, spill=spill, reshard=reshard)
        txlog = TxLog(
            sorted(set(cs.nodes) | set(removed_nodes)),
            [] if relocation else sorted_keys(cs.chunks),
            sorted(cs.deleted_prefixes),
            sorted(resized_arrays(parent.nodes, cs.nodes)),
            list(sorted_keys(cs.chunks)) if relocation else [],
        )
        history = _history_for(parent)
        index, sealed = _index_for(
            parent,
            [self.objects.snapshot(p) for p in extra_parents],
            len(history),
            self._history_page,
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
            history=history,
            index=index,
        )
        try:
            encoded = snap.encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"commit metadata is not serializable: {e}") from None
        return CommitObjects(snap, encoded, txlog, update, sealed)

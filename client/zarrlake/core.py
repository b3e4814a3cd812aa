"""The engine's core, assembled for one repository: what the layers above it are given.

:class:`RepositoryCore` bundles the asset store of immutable objects (:class:`ObjectStore`), the
branch journal and tags (:mod:`zarrlake.refs`), history (:class:`CommitGraph`,
:class:`ExpiryLog`) and the commit engine (:class:`CommitEngine`). ``Repository`` is a façade
over it; sessions, maintenance and fsck receive it instead of the façade, so nothing below the
façade depends on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from zarrlake.commit import BranchLock, CommitEngine
from zarrlake.config import RepositoryConfig
from zarrlake.errors import (
    CorruptObject,
    InvalidConfig,
    PreconditionFailed,
    ReadOnlyError,
    ReadOnlyStorage,
    UnsupportedFormat,
    ZarrlakeError,
)
from zarrlake.format.model import (
    MIRROR_PREFIX,
    MIRROR_REPO_KEY,
    REPO_KEY,
    WRITE_PROBE_KEY,
    RepoRecord,
)
from zarrlake.format.root import (
    CAS_PROBE_KEY,
    EXPIRED_MAX,
    MIRROR_ROOT_KEY,
    PUBLISHED_ROOT,
    ROOT_KEY,
    BranchHead,
    RootRecord,
)
from zarrlake.history import CommitGraph, ExpiryLog
from zarrlake.objects import ObjectStore
from zarrlake.published import PublishedRoot
from zarrlake.refs import BranchJournal, Refs, Tags
from zarrlake.sources import VirtualSources
from zarrlake.storage.base import Storage


def check_storage_writable(storage: Storage) -> None:
    """Raise :class:`ReadOnlyStorage` unless ``storage`` takes writes, and atomic create-only
    ones: the branch journal is built on them, and without them two writers could both move a
    branch, one silently losing its commit. Such a storage is for reading only."""
    if not storage.supports_writes:
        raise ReadOnlyStorage(f"{storage.url} is read-only: repositories there open for reading")
    if not storage.supports_conditional_writes:
        raise ReadOnlyStorage(
            f"{storage.url} cannot do atomic create-only writes, which moving a branch safely "
            "needs: repositories there open for reading only"
        )


@dataclass(frozen=True, eq=False)
class RepositoryCore:
    """One repository's core services, sharing one set of caches.

    Picklable: it travels as (storage, record, lock) and is rebuilt, caches empty, on arrival.
    """

    storage: Storage
    record: RepoRecord
    config: RepositoryConfig
    lock: BranchLock | None
    objects: ObjectStore
    journal: BranchJournal
    tags: Tags
    expiry: ExpiryLog
    graph: CommitGraph
    commits: CommitEngine

    @classmethod
    def build(
        cls,
        storage: Storage,
        record: RepoRecord,
        lock: BranchLock | None = None,
        *,
        verify_reads: bool = True,
        virtual_credentials: Mapping[str, Mapping[str, str]] | None = None,
    ) -> RepositoryCore:
        """The core of the repository whose marker object is ``record``, at ``storage``.

        A mirror's (``record.mirror_of``) refs are its own, under ``mirror/``: the source's
        journal and tags that replication copies beside them are never read."""
        try:
            config = RepositoryConfig.from_dict(record.config)
        except InvalidConfig as e:  # a stored record, not the caller's input
            key = REPO_KEY if record.mirror_of is None else MIRROR_REPO_KEY
            raise CorruptObject(key, f"its settings: {e}") from None
        # Credentials for virtual chunk sources are the reader's, given at open: never stored.
        sources = VirtualSources(config.virtual_containers, virtual_credentials)
        objects = ObjectStore(
            storage, record.content_hash, verify_reads=verify_reads, sources=sources
        )
        root = MIRROR_PREFIX if record.mirror_of is not None else ""
        # A mirror's refs carry no markers: the promoter starts its journals anew, under the
        # source's id, so a mirror made again in place could not tell its markers from a
        # deleted one's. Its readers read each head, as without markers.
        guard = None if root else record.id
        published = None
        if PUBLISHED_ROOT in record.features:
            # Nor do a published root's: its readers list nothing (markers are the listing's
            # shortcut), so a commit saves the marker's write and its predecessor's delete.
            guard = None
            published = PublishedRoot(storage, record, MIRROR_ROOT_KEY if root else ROOT_KEY)
        journal = BranchJournal(
            storage,
            adopt=objects.adopt_snapshot,
            root=root,
            guard=guard,
            published=published,
            pages=objects.written_page,
            vouch=objects.vouch_snapshot,
        )
        tags = Tags(storage, root=root, guard=guard, published=published)
        # A mirror's expiry records are its source's, replicated: not what its own root holds.
        expiry = ExpiryLog(storage, None if root else published)
        if published is not None:
            published.rebuild = functools.partial(rebuild_root, journal, tags, expiry, record)
        graph = CommitGraph(objects, journal, tags, expiry)
        commits = CommitEngine(record.id, config, objects, journal, graph, lock)
        return cls(storage, record, config, lock, objects, journal, tags, expiry, graph, commits)

    @property
    def id(self) -> str:
        """The repository id (a UUID, stable for the repository's life)."""
        return self.record.id

    @property
    def is_mirror(self) -> bool:
        """Whether this is a read-only mirror (its refs move only by the mirror's promoter)."""
        return self.record.mirror_of is not None

    def check_writable(self) -> None:
        """Raise :class:`ReadOnlyError` for a mirror, which only its promoter writes, or on a
        storage that cannot take the engine's writes (:func:`check_storage_writable`),
        :class:`UnsupportedFormat` if this version must not write to the repository (its marker
        records a feature or content hash only a newer version implements), and
        :class:`ConditionalWritesUnsupported` if the server does not keep the create-only writes
        the branch journal is built on (asked once per storage object; never on a read)."""
        check_storage_writable(self.storage)
        if self.record.mirror_of is not None:
            raise ReadOnlyError(
                f"the repository at {self.storage.url} is a read-only mirror of "
                f"{self.record.mirror_of}: write to the source, the mirror follows it"
            )
        blocker = self.record.write_blocker()
        if blocker is not None:
            raise UnsupportedFormat(
                f"the repository at {self.storage.url} is read-only for this zarrlake: {blocker}; "
                "upgrade zarrlake to write to it"
            )
        self.storage.check_conditional_writes(WRITE_PROBE_KEY)

    def last_refs(self) -> Refs | None:
        """Every live branch and tag as the root this core last read or wrote says them (no
        request; as of that read: :meth:`Repository.open`'s, for a core just opened), or None
        without one. For a poller that has just opened the repository anyway (the operator's
        resync): its refs cost nothing more."""
        root = None if self.journal.published is None else self.journal.published.cached()
        if root is None:
            return None
        return Refs(root.heads(), dict(sorted(root.tags.items())))

    def republish(self) -> RootRecord:
        """Bring the published root up to the journals, tag and expiry records (what
        ``upgrade`` ends with and ``fsck --repair`` does): the root as published. Only for a
        repository that publishes one."""
        published = self.journal.published
        if published is None:
            raise ValueError(f"the repository at {self.storage.url} publishes no root")
        truth = rebuild_root(self.journal, self.tags, self.expiry, self.record)
        return published.publish(lambda r: r.with_journals(truth))

    def change_marker(self, edit: Callable[[RepoRecord], RepoRecord], what: str) -> RepoRecord:
        """Replace the repository's marker with ``edit(marker)`` by compare-and-set (read
        again and edited again when another change wins the race), then carry the marker into
        the published root: the record written. ``what`` names the change in errors ("changing
        branch protection").

        For the settings a repository keeps in its marker after its creation (branch rules,
        virtual chunk containers): clients that open it from then on see them; clients already
        open see them when they read the marker again. Raises :class:`ReadOnlyError` for a
        mirror, :class:`ZarrlakeError` on a storage without compare-and-set (two changes at
        once would lose one), for a marker replaced by another repository's or of a newer
        zarrlake, or if the root could not carry it (the change stands: ``fsck --repair``
        carries it)."""
        if self.is_mirror:
            raise ReadOnlyError(f"a mirror follows its source: {what} is done there")
        self.check_writable()
        storage = self.storage
        if not storage.supports_compare_and_set or not storage.check_compare_and_set(CAS_PROBE_KEY):
            raise ZarrlakeError(
                f"{storage.url} does not keep compare-and-set writes, which {what} needs (two "
                "changes at once would lose one)"
            )
        for _ in range(16):
            got = storage.get_versioned(REPO_KEY)
            found = RepoRecord.decode(got.data, REPO_KEY)
            if found.id != self.record.id:
                raise ZarrlakeError(
                    f"the repository at {storage.url} was replaced (id {found.id}, not "
                    f"{self.record.id}): nothing was changed"
                )
            blocker = found.write_blocker()
            if blocker is not None:
                raise ZarrlakeError(f"the repository at {storage.url} is read-only here: {blocker}")
            record = edit(found)
            try:
                storage.put_if_version(REPO_KEY, record.encode(), got.version)
            except PreconditionFailed:
                continue
            self._publish_marker(what)
            return record
        raise ZarrlakeError(f"the marker of {storage.url} kept changing: nothing was changed")

    def _publish_marker(self, what: str) -> None:
        """Carry the marker as it is now into the root. Read inside the swap, so that of two
        changes published in either order, the root ends with the later marker, never the
        earlier one."""
        published = self.journal.published
        if published is None:
            return

        def update(root: RootRecord) -> RootRecord | None:
            marker = RepoRecord.decode(self.storage.get(REPO_KEY), REPO_KEY)
            return None if root.repo == marker else root.with_repo(marker)

        try:
            published.publish(update)
        except ZarrlakeError as e:
            # The marker decided, but clients that open through the root do not see it yet.
            raise ZarrlakeError(
                f"{what} is recorded in the marker, but the root could not carry it ({e}): "
                "run zarrlake fsck --repair before relying on it"
            ) from e

    def __reduce__(self) -> tuple[Any, ...]:
        verify, credentials = self.objects.verify_reads, self.objects.sources.credentials
        return (_rebuild, (self.storage, self.record, self.lock, verify, credentials))


def _rebuild(
    storage: Storage,
    record: RepoRecord,
    lock: BranchLock | None,
    verify_reads: bool,
    virtual_credentials: Mapping[str, Mapping[str, str]] | None = None,
) -> RepositoryCore:
    return RepositoryCore.build(
        storage, record, lock, verify_reads=verify_reads, virtual_credentials=virtual_credentials
    )


def rebuild_root(
    journal: BranchJournal, tags: Tags, expiry: ExpiryLog, record: RepoRecord
) -> RootRecord:
    """The published root as the journals, tag records and expiry records say it is now (the
    truth ``root`` publishes): what a repository's first publish writes, ``upgrade`` and
    ``fsck --repair`` publish, and fsck compares ``root`` with. Reads every branch's head entry
    (one listing and a read each), the tag records and the expiry records."""
    names = sorted(journal.names())
    heads = journal.storage.map(journal.head, names)
    found = [(name, entry) for name, entry in zip(names, heads, strict=True) if entry is not None]
    found.sort(key=lambda pair: pair[1].time, reverse=True)  # the root's order: newest move first
    branches = {n: BranchHead(entry.seq, entry.snapshot, entry.encode()) for n, entry in found}
    # A mirror's root holds no expiry: its expiry records are its source's, replicated, and
    # its readers list them (None: "read the records").
    records = {} if journal.root else expiry.records()
    expired: frozenset[str] | None = frozenset().union(*records.values())
    if journal.root or len(expired or ()) > EXPIRED_MAX:
        expired = None
    return RootRecord(
        record,
        0,
        branches,
        # A tag record that does not parse is fsck's to report: the root publishes the rest.
        tags.all(records_only=True, on_corrupt=lambda key, e: None),
        expired,
        frozenset(records),
    )

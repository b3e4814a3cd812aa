"""The repository: the public façade over the engine's core.

Refs and history are answered by :class:`~zarrlake.history.CommitGraph`, commits, merges and
branch moves by :class:`~zarrlake.commit.CommitEngine`, objects by
:class:`~zarrlake.objects.ObjectStore`; maintenance and fsck receive the same
:class:`~zarrlake.core.RepositoryCore`. This module validates arguments, names things for users,
and opens sessions.

Every method that does I/O has an ``<name>_async`` twin with the same signature that runs it on a
worker thread, for code running inside an event loop (Zarr's async machinery, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from zarrlake.commit import BranchLock
from zarrlake.config import (
    RepositoryConfig,
    VirtualContainer,
    check_session_ttl,
    verify_reads_default,
    with_virtual_containers,
)
from zarrlake.conflicts import UseTheirs, check_strategy
from zarrlake.core import RepositoryCore, check_storage_writable
from zarrlake.durations import as_timedelta
from zarrlake.errors import (
    BranchExists,
    CorruptObject,
    InvalidArgument,
    InvalidConfig,
    InvalidName,
    NotMirrored,
    ReadOnlyError,
    RefNotFound,
    RepositoryExists,
    RepositoryNotFound,
    UnknownContentHash,
    ZarrlakeError,
)
from zarrlake.format.ids import (
    CONTENT_HASHES,
    DEFAULT_CONTENT_HASH,
    LEGACY_CONTENT_HASH,
    is_snapshot_id,
)
from zarrlake.format.model import (
    MIRROR_REPO_KEY,
    PUBLISHED_ROOT,
    REPO_KEY,
    VIRTUAL,
    VIRTUAL_CHUNKS,
    WRITE_PROBE_KEY,
    ChunkRef,
    JournalEntry,
    RepoRecord,
)
from zarrlake.format.root import CAS_PROBE_KEY, ROOT_KEY, RootRecord
from zarrlake.fsck import SAMPLE as FSCK_SAMPLE
from zarrlake.fsck import FsckReport, fsck
from zarrlake.governance import Governance, rule_from_arguments
from zarrlake.history import History
from zarrlake.maintenance.compact import DEFAULT_PACK_BELOW, CompactReport, compact
from zarrlake.maintenance.expire import ExpireReport, expire
from zarrlake.maintenance.gc import GCReport, gc
from zarrlake.maintenance.retention import RetentionRules
from zarrlake.objects import ReadJob
from zarrlake.published import read_root
from zarrlake.refs import Refs, new_writer_id, read_refs, validate_name
from zarrlake.remote import ServiceClient
from zarrlake.rules import BranchRule
from zarrlake.session import Session
from zarrlake.storage.base import ObjectNotFound, PreconditionFailed, Storage, Versioned
from zarrlake.types import CommitInfo, Diff
from zarrlake.upgrade import UpgradeReport, upgrade

if TYPE_CHECKING:
    from zarrlake.store import ZarrlakeStore

__all__ = ["MAIN", "History", "Repository"]

MAIN = "main"

log = logging.getLogger(__name__)

#: Whether :meth:`Repository.create` publishes a root unless told (read at each call: the tests of
#: the journal-only protocol, which servers without compare-and-set and older repositories keep,
#: turn it off for their module).
PUBLISH_ROOT_BY_DEFAULT = True

#: A lock service, its URL (``redis://…``, ``file:///dir``), or None for optimistic commits.
LockSpec = BranchLock | str | None
#: Credentials for virtual chunk containers, by url_prefix (see :meth:`Repository.open`).
VirtualCredentials = Mapping[str, Mapping[str, str]] | None
#: ``progress(phase, count)`` callbacks of long maintenance operations.
Progress = Callable[[str, int], None]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _moment(as_of: object) -> dt.datetime:
    """``as_of`` as a datetime: one, or an ISO 8601 string (``"2026-11-28T12:00:00+00:00"``)."""
    if isinstance(as_of, dt.datetime):
        return as_of
    if isinstance(as_of, str):
        try:
            return dt.datetime.fromisoformat(as_of)
        except ValueError:
            raise InvalidArgument(f"as_of {as_of!r} is not an ISO 8601 time") from None
    raise InvalidArgument(
        f"as_of must be a datetime or an ISO 8601 string, not {type(as_of).__name__}"
    )


def _new_ref_name(name: object, kind: str) -> None:
    """Check the name of a branch or tag about to be made: the naming rules, and not a snapshot
    id's form (refs resolve snapshot ids first: such a ref could be shadowed)."""
    validate_name(name, kind)
    assert isinstance(name, str)
    if is_snapshot_id(name):
        raise InvalidName(
            f"invalid {kind} name {name!r}: it has a snapshot id's form, and would be read as one "
            f"(to make a {kind} at that snapshot, give the id as its ref)"
        )


def _check_flag(value: object, name: str) -> None:
    """Raise :class:`InvalidArgument` unless ``value`` is a bool: ``"false"`` would be true."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True, False or None, not {value!r}")


def _get_optional(storage: Storage) -> Callable[[str], bytes | None]:
    def get(key: str) -> bytes | None:
        try:
            return storage.get(key)
        except ObjectNotFound:
            return None

    return get


def _containers(given: object) -> tuple[VirtualContainer, ...]:
    """``given`` as virtual containers, checked (before any request: the caller's error)."""
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise InvalidConfig(f"virtual containers are a list, not {given!r}")
    parsed = tuple(VirtualContainer.from_value(c) for c in given)
    return RepositoryConfig(virtual_containers=parsed).virtual_containers


class Repository:
    """A versioned Zarr repository in one storage location (see :meth:`open`, :meth:`create`)."""

    def __init__(
        self,
        storage: Storage,
        record: RepoRecord,
        lock: LockSpec = None,
        *,
        verify_reads: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
        commit_service: str | None = None,
        commit_token: str | None = None,
    ) -> None:
        if isinstance(lock, str):
            from zarrlake.locks import lock_from_url

            lock = lock_from_url(lock)
        elif lock is not None and not callable(getattr(lock, "hold", None)):
            raise InvalidArgument(
                "lock must be a lock service (zarrlake.RedisLock, zarrlake.LocalLock), its URL "
                f"(redis://…, a directory), or None; not {type(lock).__name__}"
            )
        self.storage = storage
        verify = verify_reads_default() if verify_reads is None else verify_reads
        _check_flag(verify, "verify_reads")
        # A commit service: it alone writes refs; this client writes objects and asks it.
        self._given_service = (commit_service, commit_token)
        service = commit_service or os.environ.get("ZARRLAKE_COMMIT_SERVICE") or None
        self._service: ServiceClient | None = None
        if service is not None and record.mirror_of is None:
            token = commit_token or os.environ.get("ZARRLAKE_COMMIT_TOKEN") or None
            self._service = ServiceClient(service, token)
            # Its create-only writes are the service's: this client's credentials write none.
            storage.trust_conditional_writes()
        self._install(
            RepositoryCore.build(
                storage, record, lock, verify_reads=verify, virtual_credentials=virtual_credentials
            )
        )

    def _install(self, core: RepositoryCore) -> None:
        """Use ``core`` (a new one after an upgrade too), wired to this handle's branch
        protection and commit service: every path that moves a branch goes through its engine
        and journal, which ask them."""
        self._core = core
        self._governance = Governance(core, self._snapshot_store)
        core.commits.guard = self._governance
        if self._service is not None:
            core.journal.remote = self._service
            core.tags.remote = self._service

    def _snapshot_store(self, snapshot_id: str) -> Any:
        """A read-only Zarr store of snapshot ``snapshot_id`` (published or not: what a check
        of a commit about to land reads)."""
        return Session(self._core, snapshot_id, branch=None, read_only=True).store

    def __getstate__(self) -> dict[str, Any]:
        return {
            "storage": self.storage,
            "record": self.record,
            "lock": self.lock,
            "verify_reads": self.verify_reads,
            "virtual_credentials": self._core.objects.sources.credentials,
            # Given explicitly only, as a Storage's credentials (the environment travels alone).
            "commit_service": self._given_service,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["storage"],
            state["record"],
            state["lock"],
            verify_reads=state.get("verify_reads", True),
            virtual_credentials=state.get("virtual_credentials"),
            commit_service=state.get("commit_service", (None, None))[0],
            commit_token=state.get("commit_service", (None, None))[1],
        )

    def __repr__(self) -> str:
        return f"<zarrlake.Repository {self.id} at {self.storage.url}>"

    # -- lifecycle --------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        storage: Storage,
        *,
        config: RepositoryConfig | dict[str, Any] | None = None,
        lock: LockSpec = None,
        content_hash: str = DEFAULT_CONTENT_HASH,
        verify_reads: bool | None = None,
        published_root: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
    ) -> Repository:
        """Initialize a repository with an empty ``main`` branch.

        ``published_root``: publish every change of the refs to one ``root`` object by
        compare-and-set, so that opening, listing refs and recent history are one read each (a
        format feature: zarrlake versions before it read such a repository but refuse to write
        to it). None: on where the storage keeps compare-and-set writes (asked before anything
        is written; a server that does not keeps the journal-only protocol, with a warning),
        except for a SHA-256 repository, which is made for older zarrlake versions to write.

        ``content_hash``: the hash that names chunk objects, recorded for the repository's life:
        ``"blake3"`` (the default, fastest) or ``"sha256"`` (what every earlier version used; such a
        repository stays readable and writable by those older versions, a BLAKE3 one is refused
        by them). Raises :class:`UnknownContentHash` for another name, :class:`RepositoryExists`,
        :class:`ConditionalWritesUnsupported` (before writing anything) where the server does not
        keep create-only writes.
        :class:`ReadOnlyStorage` on a storage that cannot take the engine's writes (plain HTTP).
        """
        if content_hash not in CONTENT_HASHES:
            raise UnknownContentHash(content_hash, sorted(CONTENT_HASHES))
        if published_root is not None:
            _check_flag(published_root, "published_root")
        if verify_reads is not None:
            _check_flag(verify_reads, "verify_reads")
        check_storage_writable(storage)
        if isinstance(config, dict):
            config = RepositoryConfig.from_dict(config, strict=True)
        config = config or RepositoryConfig()
        if any(storage.map(storage.exists, (REPO_KEY, MIRROR_REPO_KEY))):
            raise RepositoryExists(f"a repository already exists at {storage.url}")
        storage.check_conditional_writes(WRITE_PROBE_KEY)
        if published_root is None:
            published_root = PUBLISH_ROOT_BY_DEFAULT and content_hash != LEGACY_CONTENT_HASH
        if published_root:
            published_root = storage.check_compare_and_set(CAS_PROBE_KEY)
        features = [] if content_hash == LEGACY_CONTENT_HASH else ["content-hash"]
        if published_root:
            features.append(PUBLISHED_ROOT)
        if config.virtual_containers:
            # Its manifests may hold virtual refs, which an older zarrlake must not write around.
            features.append(VIRTUAL_CHUNKS)
        record = RepoRecord(
            str(uuid.uuid4()),
            _now(),
            config.to_dict(),
            initialized=True,
            content_hash=content_hash,
            features=tuple(features),
        )
        repo = cls(
            storage,
            record,
            lock,
            verify_reads=verify_reads,
            virtual_credentials=virtual_credentials,
        )
        # ``main`` first, then the marker, then the root: a marker then always has a ``main``
        # beside it, and a root a marker, so opening a repository is one request. A creator that
        # dies in between leaves no marker, hence no repository (the next create adopts the
        # ``main`` it left), or a marker without a root (its readers read the journals until
        # the first publish writes it); two racing creators both find one ``main``, and the
        # create-only marker decides between them.
        published = repo._core.journal.published
        repo._core.commits.initialize(MAIN, publish=False)
        try:
            storage.put(REPO_KEY, record.encode(), create_only=True)
        except PreconditionFailed:
            try:  # our own marker, behind a lost response, is not someone else's repository
                mine = RepoRecord.decode(storage.get(REPO_KEY), REPO_KEY).id == record.id
            except (ObjectNotFound, ZarrlakeError):
                mine = False
            if not mine:
                raise RepositoryExists(f"a repository already exists at {storage.url}") from None
        if published is not None:
            published.publish(lambda r: r.with_repo(record))
        return repo

    @classmethod
    def open(
        cls,
        storage: Storage,
        *,
        lock: LockSpec = None,
        verify_reads: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
        commit_service: str | None = None,
        commit_token: str | None = None,
    ) -> Repository:
        """Open an existing repository, or a mirror (read-only: see :mod:`zarrlake.mirror`).
        Raises :class:`RepositoryNotFound`.

        ``verify_reads``: check every chunk read against the digest its ref records and raise
        :class:`CorruptChunk` rather than return other bytes (see :attr:`verify_reads`); None
        takes ``$ZARRLAKE_VERIFY_READS`` (``0``, ``false``, ``no`` or ``off`` turn it off), else on.

        ``commit_service``, ``commit_token``: the URL of the repository's commit service and
        this client's token for it (default ``$ZARRLAKE_COMMIT_SERVICE``,
        ``$ZARRLAKE_COMMIT_TOKEN``): this client then writes objects only and sends every ref
        change to the service, which applies the repository's rules (``zarrlake service``).

        ``virtual_credentials``: what signs this reader's requests to the repository's virtual
        chunk containers, by ``url_prefix`` (``{"s3://bucket/prefix/": {"access_key_id": …,
        "secret_access_key": …, "session_token": …}}``); a container not named uses the
        provider's usual environment. Never stored in the repository. Raises
        :class:`InvalidArgument` for a prefix that is none of its containers.

        The published root and a mirror's marker are read in one round: a mirror's is under
        ``mirror/``, since bucket replication may copy its source's ``repo`` and ``root``
        beside it, and wins. A root holds the repository's marker record and every head, so a
        repository that has one is open after that round, its refs read; one without (made
        before the published root, or by ``published_root=False``) is read from its marker
        ``repo`` in a second round."""

        def first(key: str) -> Versioned | bytes | None:
            if key == ROOT_KEY:
                return read_root(storage)
            return _get_optional(storage)(key)

        found, mirror = storage.map_reads(first, (ROOT_KEY, MIRROR_REPO_KEY))
        if mirror is not None:
            assert isinstance(mirror, bytes)
            record = RepoRecord.decode(mirror, MIRROR_REPO_KEY)
            return cls(
                storage,
                record,
                lock,
                verify_reads=verify_reads,
                virtual_credentials=virtual_credentials,
                commit_service=commit_service,
                commit_token=commit_token,
            )
        if isinstance(found, Versioned):
            try:
                root = RootRecord.decode(found.data, ROOT_KEY)
            except CorruptObject as e:  # damaged: the marker and the journals still say it all
                log.warning(
                    "%s: %s cannot be read (%s): opening from the marker", storage.url, ROOT_KEY, e
                )
            else:
                repo = cls(
                    storage,
                    root.repo,
                    lock,
                    verify_reads=verify_reads,
                    virtual_credentials=virtual_credentials,
                    commit_service=commit_service,
                    commit_token=commit_token,
                )
                if repo._core.journal.published is not None:
                    repo._core.journal.published.adopt(found)
                return repo
        data = _get_optional(storage)(REPO_KEY)
        if data is None:
            raise RepositoryNotFound(f"no zarrlake repository at {storage.url}")
        record = RepoRecord.decode(data, REPO_KEY)
        repo = cls(
            storage,
            record,
            lock,
            verify_reads=verify_reads,
            virtual_credentials=virtual_credentials,
            commit_service=commit_service,
            commit_token=commit_token,
        )
        if not record.initialized:
            repo._core.commits.initialize(MAIN)
        return repo

    @classmethod
    def open_or_create(
        cls,
        storage: Storage,
        *,
        config: RepositoryConfig | dict[str, Any] | None = None,
        lock: LockSpec = None,
        content_hash: str = DEFAULT_CONTENT_HASH,
        verify_reads: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
    ) -> Repository:
        """Open the repository at ``storage``, creating it (with ``config`` and ``content_hash``)
        if there is none. An existing repository keeps its own hash; a name zarrlake does not
        know raises :class:`UnknownContentHash` either way, so a typo is not noticed only on the
        day the repository is first created."""
        if content_hash not in CONTENT_HASHES:
            raise UnknownContentHash(content_hash, sorted(CONTENT_HASHES))
        if isinstance(config, dict):  # a misspelt setting, likewise
            config = RepositoryConfig.from_dict(config, strict=True)
        try:
            return cls.open(
                storage,
                lock=lock,
                verify_reads=verify_reads,
                virtual_credentials=virtual_credentials,
            )
        except RepositoryNotFound:
            try:
                return cls.create(
                    storage,
                    config=config,
                    lock=lock,
                    content_hash=content_hash,
                    verify_reads=verify_reads,
                    virtual_credentials=virtual_credentials,
                )
            except RepositoryExists:
                return cls.open(
                    storage,
                    lock=lock,
                    verify_reads=verify_reads,
                    virtual_credentials=virtual_credentials,
                )

    @classmethod
    def from_kubernetes(
        cls,
        name: str,
        namespace: str | None = None,
        *,
        lock_url: str | None = None,
        verify_reads: bool | None = None,
        commit_service: str | None = None,
        commit_token: str | None = None,
    ) -> Repository:
        """Open the repository of the ``Repository`` resource ``name`` (``zarrlake.io``).

        Inside a pod it uses the service account; elsewhere the kubeconfig. ``namespace`` defaults
        to the pod's (or the kubeconfig context's). Storage location comes from the resource's
        spec, credentials and the lock password from the Secrets it names, the lock endpoint from
        its status, the credentials of virtual chunk containers from the Secrets
        ``spec.virtualContainers`` names. ``lock_url`` overrides the lock endpoint's address
        (e.g. a port-forward when running outside the cluster). With ``spec.commitService``,
        the client sends its ref changes to the service its status names (``commit_service``
        overrides the address, ``commit_token`` or ``$ZARRLAKE_COMMIT_TOKEN`` is this client's
        token). Raises :class:`zarrlake.k8s.KubernetesError` when the resource is missing or
        not Ready, or a
        Secret is missing.
        """
        from zarrlake.k8s import locate

        conn = locate(name, namespace)
        repo = cls.open(
            conn.storage(),
            lock=conn.lock(lock_url),
            verify_reads=verify_reads,
            commit_service=commit_service or conn.commit_service,
            commit_token=commit_token,
        )
        # The resource may name containers the repository does not have yet (the operator
        # applies them at its next resync), or no longer: theirs are left alone.
        repo.core.objects.sources.supply(
            conn.virtual_credentials, f"Repository {name!r}", override=True
        )
        return repo

    @staticmethod
    def exists(storage: Storage) -> bool:
        """Whether a repository's (or a mirror's) marker object is at ``storage``."""
        return any(storage.map(storage.exists, (REPO_KEY, MIRROR_REPO_KEY)))

    @property
    def id(self) -> str:
        """The repository id (a UUID, stable for the repository's life)."""
        return self._core.id

    @property
    def record(self) -> RepoRecord:
        """The repository's marker object (id, creation time, config): with :attr:`storage`, all
        it takes to open the repository again (``Repository(storage, record)``)."""
        return self._core.record

    @property
    def config(self) -> RepositoryConfig:
        return self._core.config

    @property
    def verify_reads(self) -> bool:
        """Whether chunk reads are checked against their digests (see :meth:`open`)."""
        return self._core.objects.verify_reads

    @property
    def lock(self) -> BranchLock | None:
        """The lock service commits take, or None (optimistic commits)."""
        return self._core.lock

    @property
    def core(self) -> RepositoryCore:
        """The engine's core services for this repository (for maintenance and tools)."""
        return self._core

    @property
    def stats(self) -> dict[str, int]:
        """Per-process counters of the commit protocol: ``rebases``, ``append_retries``,
        ``deferrals`` and ``narrow_rebases`` (see :class:`zarrlake.commit.CommitEngine`)."""
        return self._core.commits.stats

    # -- branches ----------------------------------------------------------------------------------

    def list_branches(self) -> dict[str, str]:
        """Every branch: name -> head snapshot id."""
        return self._core.journal.heads()

    def lookup_branch(self, name: str) -> str:
        """The head snapshot id of branch ``name``. Raises :class:`RefNotFound`."""
        validate_name(name)
        head = self._core.journal.published_current(name).snapshot
        assert head is not None
        return head

    def create_branch(self, name: str, from_ref: str = MAIN) -> str:
        """Create ``name`` at ``from_ref`` (branch, tag or snapshot id).

        Raises :class:`BranchExists`, :class:`InvalidName`, :class:`RefNotFound`.
        """
        _new_ref_name(name, "branch")
        self._core.check_writable()
        self._governance.before_move(name, "create")
        target = self.resolve(from_ref)
        journal = self._core.journal
        head = journal.head(name)
        if head is not None and head.snapshot is not None:
            raise BranchExists(f"branch {name!r} already exists")
        seq = 0 if head is None else head.seq + 1
        # Carry the snapshot in the entry, as a commit does (a fresh reader then skips its read):
        # its bytes as stored, not a re-encoding (another client's encoder may differ, and the
        # entry of a large one vouches for them by digest).
        encoded = self._core.objects.stored_snapshot_bytes(target)
        fence = None if head is None else head.highest_token
        entry = JournalEntry(
            seq, target, None, _now(), new_writer_id(), snapshot_data=encoded, fence=fence
        )
        if not journal.append(name, entry):
            raise BranchExists(f"branch {name!r} already exists")
        return target

    def reset_branch(self, name: str, to_ref: str, *, expected: str | None = None) -> str:
        """Point ``name`` at ``to_ref``. With ``expected``, only if the head is still that snapshot
        (else :class:`ConflictError`). Returns the new head."""
        validate_name(name)
        self._core.check_writable()
        target = self.resolve(to_ref)
        return self._core.commits.reset_branch(name, target, expected=expected)

    def delete_branch(self, name: str) -> None:
        """Delete branch ``name`` (its history stays until expiry). ``main`` cannot be deleted."""
        validate_name(name)
        if name == MAIN:
            raise ZarrlakeError("the main branch cannot be deleted")
        self._core.check_writable()
        self._core.commits.delete_branch(name)

    # -- governance --------------------------------------------------------------------------------

    def protect_branch(
        self,
        name: str,
        *,
        require_merge: bool = True,
        allow_delete: bool = False,
        allow_reset: bool = False,
        required_checks: tuple[str, ...] | list[str] = (),
        check_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> BranchRule:
        """Protect branch ``name`` (it need not exist yet) with a rule, replacing any it had:
        ``require_merge`` refuses direct commits (merges only), ``allow_delete`` and
        ``allow_reset`` allow deleting and force-moving it, ``required_checks`` name the checks
        (entry points of ``zarrlake.checks``: ``required-attributes``, ``array-rules``,
        ``no-nan`` ship) every commit or merge into it must pass, with ``check_options`` per
        check. Refused operations raise :class:`BranchProtected`; a failing check
        :class:`CheckFailed`. Recorded in the repository (every client that opens it obeys,
        and so does every client of a repository that had rules when it opened; see
        ``docs/design/governance.md`` for what holds against a client that ignores them).
        Returns the rule. Raises :class:`InvalidArgument` (a check not installed here, options
        it refuses), :class:`InvalidName`."""
        rule = rule_from_arguments(
            require_merge=require_merge,
            allow_delete=allow_delete,
            allow_reset=allow_reset,
            required_checks=required_checks,
            check_options=check_options,
        )
        return self._governance.protect(name, rule)

    def unprotect_branch(self, name: str) -> None:
        """Remove branch ``name``'s protection (nothing to do if it has none)."""
        self._governance.unprotect(name)

    def branch_moves(self, name: str, *, limit: int | None = None) -> list[dict[str, Any]]:
        """The retained moves of branch ``name``, newest first: ``seq``, ``snapshot`` (None: a
        deletion), ``previous``, ``time`` and ``by`` (who, as a commit service recorded it from
        the token that asked: ``identity``, ``role``, ``service``, ``client``; None for a move
        a client wrote itself). Raises :class:`RefNotFound` for a branch that never existed."""
        validate_name(name)
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise InvalidArgument(f"limit must be a number >= 0 or None, not {limit!r}")
        entries = self._core.journal.history(name)
        if not entries:
            raise RefNotFound(name, "branch")
        return [
            {
                "seq": e.seq,
                "snapshot": e.snapshot,
                "previous": e.previous,
                "time": e.time,
                "by": None if e.by is None else dict(e.by),
            }
            for e in entries[:limit]
        ]

    @property
    def governance(self) -> Governance:
        """This client's view of the repository's rules (what a commit service applies)."""
        return self._governance

    @property
    def commit_service(self) -> ServiceClient | None:
        """The commit service this client sends its ref changes to, or None: it writes them."""
        return self._service

    def branch_protection(self) -> dict[str, BranchRule]:
        """The protected branches and their rules, as the repository records them now."""
        return dict(sorted(self._governance.protection().branches.items()))

    # -- virtual chunk containers ------------------------------------------------------------------

    def set_virtual_containers(
        self, containers: Sequence[VirtualContainer | dict[str, Any]]
    ) -> tuple[VirtualContainer, ...]:
        """Make the repository's virtual chunk containers exactly ``containers``
        (:class:`VirtualContainer` or their dicts): the URL prefixes its virtual refs may point
        into, and how to reach each. Other settings stay as they are. Recorded in the marker by
        compare-and-set and in the published root; this handle and clients that open the
        repository from then on use them, clients already open when they open it again. A
        container taken out makes the refs into it unreadable
        (:class:`VirtualContainerNotAllowed`) until it is put back: nothing is deleted.

        Returns the containers now recorded. Raises :class:`InvalidConfig` for a container that
        is not valid or a prefix given twice, :class:`ReadOnlyError` for a mirror (set them on
        its source), :class:`ZarrlakeError` on a storage without compare-and-set."""
        wanted = _containers(containers)
        return self._change_virtual_containers(lambda have: wanted)

    def allow_virtual_container(
        self, container: VirtualContainer | dict[str, Any]
    ) -> tuple[VirtualContainer, ...]:
        """Add ``container`` to the virtual chunk containers, or replace the one of its
        ``url_prefix``, keeping the others as the marker holds them at the change (so that two
        admins adding two containers at once both land). As :meth:`set_virtual_containers`
        otherwise."""
        added = VirtualContainer.from_value(container)

        def change(have: tuple[VirtualContainer, ...]) -> tuple[VirtualContainer, ...]:
            if any(c.url_prefix == added.url_prefix for c in have):
                return tuple(added if c.url_prefix == added.url_prefix else c for c in have)
            return (*have, added)

        return self._change_virtual_containers(change)

    def disallow_virtual_container(self, url_prefix: str) -> tuple[VirtualContainer, ...]:
        """Take the container of ``url_prefix`` out of the virtual chunk containers (nothing to
        do if there is none), keeping the others as the marker holds them at the change. As
        :meth:`set_virtual_containers` otherwise."""
        if not isinstance(url_prefix, str):
            raise InvalidArgument(f"url_prefix must be a string, not {url_prefix!r}")
        return self._change_virtual_containers(
            lambda have: tuple(c for c in have if c.url_prefix != url_prefix)
        )

    def _change_virtual_containers(
        self, edit: Callable[[tuple[VirtualContainer, ...]], tuple[VirtualContainer, ...]]
    ) -> tuple[VirtualContainer, ...]:
        core = self._core

        def change(found: RepoRecord) -> RepoRecord:
            have = RepositoryConfig.from_dict(found.config).virtual_containers
            wanted = edit(have)
            config = with_virtual_containers(found.config, wanted)
            features = found.features
            if wanted and VIRTUAL_CHUNKS not in features:
                # Refs may be written from now on: an older zarrlake must not write around them.
                features = (*features, VIRTUAL_CHUNKS)
            return replace(found, config=config, features=features)

        record = core.change_marker(change, "changing the virtual chunk containers")
        kept = RepositoryConfig.from_dict(record.config).virtual_containers
        prefixes = {c.url_prefix for c in kept}
        given = core.objects.sources.credentials  # those of containers taken out go
        self._reinstall(record, {p: c for p, c in given.items() if p in prefixes})
        return self.config.virtual_containers

    # -- tags --------------------------------------------------------------------------------------

    def list_tags(self) -> dict[str, str]:
        """Every live tag: name -> snapshot id, sorted by name."""
        return dict(sorted(self._core.tags.all().items()))

    def refs(self) -> Refs:
        """Every live branch's head and every live tag, from one listing of the refs and a read
        of each head entry or tag record not seen before: what a process that polls many
        repositories for moved refs calls (see :func:`zarrlake.refs.read_refs` for the costs).
        """
        return read_refs(self._core.journal, self._core.tags)

    def lookup_tag(self, name: str) -> str:
        """The snapshot id tag ``name`` points at. Raises :class:`RefNotFound`."""
        validate_name(name, "tag")
        return self._core.tags.get(name)

    def create_tag(self, name: str, ref: str) -> str:
        """Tag ``ref``. Raises :class:`TagExists`, also for names of deleted tags."""
        _new_ref_name(name, "tag")
        self._core.check_writable()
        target = self.resolve(ref)
        self._core.tags.create(name, target)
        return target

    def delete_tag(self, name: str) -> None:
        """Delete tag ``name``; the name is never reused. Raises :class:`RefNotFound`."""
        validate_name(name, "tag")
        self._core.check_writable()
        self._core.tags.delete(name)

    # -- refs and history --------------------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        """Branch, tag or snapshot id -> snapshot id. Raises :class:`RefNotFound`."""
        return self._core.graph.resolve(ref)

    def log(self, ref: str = MAIN, *, limit: int | None = None) -> History:
        """Commits reachable from ``ref``, newest first (merge parents included).

        History ends cleanly where snapshots were expired: the returned iterator's
        ``truncated`` lists the expired parents it stopped at (logged at INFO too).
        """
        return self._core.graph.log_ref(ref, limit=limit)

    def diff(self, from_ref: str, to_ref: str) -> Diff:
        """Nodes added/removed/changed and chunks changed going from ``from_ref`` to ``to_ref``.

        On a mirror both must be snapshots it holds the data of (:class:`NotMirrored`)."""
        objects = self._core.objects
        ids = self.resolve(from_ref), self.resolve(to_ref)
        mirror_of = self._core.record.mirror_of
        if mirror_of is not None:
            shown = self._shown_by_mirror()
            for sid in ids:
                if sid not in shown:
                    raise NotMirrored(sid, mirror_of)
        return self._core.graph.diff(objects.snapshot(ids[0]), objects.snapshot(ids[1]))

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
        check_strategy(strategy)  # before any read
        validate_name(into)
        self._core.check_writable()
        if self._service is not None:
            # The service merges, from both sides as stored: a branch that takes merges only
            # takes no merge commit a writer built.
            return self._service.merge(
                source, into, message=message, author=author, strategy=strategy
            )
        src_id = self.resolve(source)
        return self._core.commits.merge(
            src_id,
            into,
            message=message or f"Merge {source} into {into}",
            author=author,
            metadata={"merge": {"source": source, "source_snapshot": src_id}},
            strategy=strategy,
        )

    # -- maintenance -------------------------------------------------------------------------------

    def expire(
        self, rules: RetentionRules | Mapping[str, Any], *, dry_run: bool = False
    ) -> ExpireReport:
        """Take snapshots outside ``rules`` (a :class:`RetentionRules`) out of history; returns an
        :class:`ExpireReport`. Branch heads and tags are always kept; :meth:`gc` deletes later."""
        if isinstance(rules, Mapping):
            rules = RetentionRules.from_dict(rules)
        if not isinstance(rules, RetentionRules):
            raise InvalidArgument("rules must be a zarrlake.RetentionRules (or its dict form)")
        self._core.check_writable()
        return expire(self._core, rules, dry_run=dry_run)

    def gc(
        self,
        *,
        grace: dt.timedelta | str = dt.timedelta(days=7),
        dry_run: bool = False,
        force: bool = False,
        progress: Progress | None = None,
        engine: str = "local",
        spark: Any = None,
    ) -> GCReport:
        """Delete objects no retained snapshot needs and older than ``grace`` (a ``timedelta``,
        or a duration like ``"7d"``); a :class:`GCReport`.

        A ``grace`` shorter than the longest session lifetime (7 days) is refused unless
        ``force``: a running session's uploads must outlive it. ``engine="spark"`` marks and
        sweeps in Spark tasks (:mod:`zarrlake.maintenance.spark_jobs`) with the SparkSession
        ``spark`` (default: the active one, or a new one as ``spark-submit`` configured it):
        the same rules, the same deletions, the same report.
        """
        if self._core.is_mirror:
            raise ReadOnlyError(
                f"{self.storage.url} is a read-only mirror of {self._core.record.mirror_of}: "
                "garbage collection runs with its promoter (zarrlake.mirror.Mirror.gc, or "
                "Mirror.run(gc_every=...)), which must know what it deletes"
            )
        grace = as_timedelta(grace, "grace")
        spark = self._spark_for(engine, spark, "gc")
        self._core.check_writable()  # a newer format's objects may look unreachable here
        if spark is not None:
            from zarrlake.maintenance.spark_jobs import gc_spark

            return gc_spark(self._core, spark, grace=grace, dry_run=dry_run, force=force)
        return gc(self._core, grace=grace, dry_run=dry_run, force=force, progress=progress)

    def compact(
        self,
        *,
        branch: str = MAIN,
        pack_below_bytes: int | None = None,
        keep_journal: dt.timedelta = dt.timedelta(days=7),
        dry_run: bool = False,
        progress: Progress | None = None,
        engine: str = "local",
        spark: Any = None,
        materialize: bool = False,
    ) -> CompactReport:
        """Pack small chunks, merge undersized shards and prune old journal entries of ``branch``
        without changing what any snapshot reads; a :class:`CompactReport`.

        ``engine="spark"`` writes the packs in Spark tasks (see :meth:`gc` for ``spark``); the
        same rules and one commit, as locally. Virtual chunks are left as they are, unless
        ``materialize``: then, first, every virtual chunk of the branch's head is read from its
        source (checked against its pins: :class:`VirtualSourceChanged` or
        :class:`VirtualSourceMissing` if one is not as it was, and nothing is committed) and
        written into the repository, in one commit of its own (a chunk a user rewrote meanwhile
        keeps the user's data); older snapshots still name the sources. Sources are never
        changed or deleted."""
        validate_name(branch)
        spark = self._spark_for(engine, spark, "compaction")
        self._core.check_writable()
        below = DEFAULT_PACK_BELOW if pack_below_bytes is None else pack_below_bytes
        copied = (0, 0, None) if not materialize else self._materialize(branch, dry_run)
        if spark is not None:
            from zarrlake.maintenance.spark_jobs import compact_spark

            report = compact_spark(
                self._core,
                spark,
                branch=branch,
                pack_below_bytes=below,
                keep_journal=keep_journal,
                dry_run=dry_run,
            )
        else:
            report = compact(
                self._core,
                branch=branch,
                pack_below_bytes=below,
                keep_journal=keep_journal,
                dry_run=dry_run,
                progress=progress,
            )
        return replace(
            report,
            materialized_chunks=copied[0],
            materialized_bytes=copied[1],
            materialized_snapshot=copied[2],
        )

    def _materialize(self, branch: str, dry_run: bool) -> tuple[int, int, str | None]:
        """Copy every virtual chunk of ``branch``'s head into the repository, as one commit:
        (chunks, bytes, the commit or None). Each source is read once per coalesced range and
        checked against its pins (a changed or missing one raises, and nothing is committed);
        a chunk a user commit rewrote meanwhile keeps the user's data."""
        core = self._core
        head = core.journal.current(branch).snapshot
        if head is None:
            raise RefNotFound(branch, "branch")
        found: list[tuple[str, ChunkRef]] = []
        for info in core.objects.snapshot(head).shards:
            shard = core.objects.shard(info)
            found.extend(
                (k, r) for k, r in zip(shard.keys, shard.refs, strict=True) if r[0] == VIRTUAL
            )
        total = sum(int(r[3]) for _, r in found)
        if dry_run or not found:
            return len(found), total, None
        session = self.writable_session(branch)
        objects = core.objects
        # By source and offset, so that neighbours in a file are planned together: the ranges
        # of one source (pinned alike) that lie close share one request (plan_reads).
        found.sort(key=lambda kr: (kr[1][1], kr[1][2]))
        for part in _batches(found):
            jobs = objects.plan_reads([(ref, None) for _, ref in part])
            for job, got in zip(jobs, objects.storage.map(_fetched, jobs), strict=True):
                for i, data in zip(job.targets, got, strict=True):
                    session.write(part[i][0], data)
        snapshot = session.commit(
            f"Materialized {len(found)} virtual chunk(s) ({total} bytes)",
            author="zarrlake compaction",
            metadata={"materialized": {"chunks": len(found), "bytes": total}},
            solver=UseTheirs(),
        )
        return len(found), total, snapshot

    @staticmethod
    def _spark_for(engine: str, spark: Any, what: str) -> Any:
        """The SparkSession a maintenance call with ``engine`` runs on (None: the local engine):
        ``spark`` if given, else the active one or a new one as ``spark-submit`` configured it."""
        if engine not in ("local", "spark"):
            raise InvalidArgument(f"unknown {what} engine {engine!r} (use 'local' or 'spark')")
        if engine == "local":
            return None
        if spark is None:
            from zarrlake.maintenance.spark_jobs import spark_session

            spark = spark_session(f"zarrlake-{what}")
        return spark

    def upgrade(self) -> UpgradeReport:
        """Give the repository the published root (one object, ``root``, that every change of
        the refs is published to by compare-and-set, so that opening, listing refs and recent
        history are one read each): safe while writers are active, and idempotent. See
        :mod:`zarrlake.upgrade` for the steps, and for writers that opened the repository
        before it. This handle publishes from then on.

        Raises :class:`ReadOnlyError` for a mirror; :class:`UnsupportedFormat` for a
        repository of a newer zarrlake. On a storage without compare-and-set the report says
        so, and nothing changes."""
        report, record = upgrade(self._core)
        if record != self._core.record:
            self._reinstall(record, self._core.objects.sources.credentials)
        return report

    def _reinstall(
        self, record: RepoRecord, virtual_credentials: Mapping[str, Mapping[str, str]]
    ) -> None:
        """Go on with a new core for the marker ``record`` this handle just wrote (same
        storage, lock and reads' verification; caches start empty)."""
        self._install(
            RepositoryCore.build(
                self.storage,
                record,
                self._core.lock,
                verify_reads=self.verify_reads,
                virtual_credentials=virtual_credentials,
            )
        )

    def fsck(
        self,
        *,
        check_chunks: bool = True,
        verify_content: bool = False,
        sample: int = FSCK_SAMPLE,
        repair: bool = False,
        virtual: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> FsckReport:
        """Check that everything reachable from the refs exists and parses; a ``FsckReport``.

        ``sample``: how many chunks, picked at random, to read and check against their digests
        (0: none). ``verify_content``: read every chunk and check its bytes against its name
        (the repository's content hash) instead; slow, it reads all the data. In a repository
        that publishes a root, fsck also checks that the root agrees with the journals;
        ``repair`` republishes it from them where it does not (it changes nothing else).
        ``virtual``: check the source file of every virtual chunk ref too (it exists, is the
        version the ref pins, is long enough), reported as ``virtual-*`` problems by URL;
        ``progress(done, total)`` is called as sources are checked.
        """
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            raise InvalidArgument(f"sample must be a whole number of chunks, not {sample!r}")
        if repair:
            self._core.check_writable()
        return fsck(
            self._core,
            check_chunks=check_chunks,
            verify_content=verify_content,
            sample=sample,
            repair=repair,
            virtual=virtual,
            progress=progress,
        )

    # -- sessions ----------------------------------------------------------------------------------

    def readonly_session(
        self, ref: str = MAIN, *, as_of: dt.datetime | str | None = None
    ) -> Session:
        """A read-only view of ``ref`` (branch, tag, snapshot id), or of it as of ``as_of`` (a
        ``datetime`` or an ISO 8601 string; naive times are UTC). Raises :class:`RefNotFound`
        (also for a moment before the ref existed), :class:`InvalidArgument` for an ``as_of``
        that is not a time."""
        graph = self._core.graph
        mirror_of = self._core.record.mirror_of
        if as_of is None and mirror_of is None:
            # A branch the root this client saw last holds: the session starts on that head
            # while the root is read again, and takes the head that read finds (if it moved)
            # before its first read answers: the root's read and the first manifest shard's
            # share a round trip. A ref moved before this call is seen, as by :meth:`locate`.
            ahead = graph.locate_ahead(ref)
            if ahead is not None:
                sid, settle = ahead
                return Session(self._core, sid, branch=ref, read_only=True, settle=settle)
        if as_of is not None:
            sid, branch = graph.as_of(ref, _moment(as_of)), None
        else:
            sid, is_branch = graph.locate(ref)
            branch = ref if is_branch else None
        if mirror_of is not None and branch is None and sid not in self._shown_by_mirror():
            raise NotMirrored(sid, mirror_of)
        return Session(self._core, sid, branch=branch, read_only=True)

    def _shown_by_mirror(self) -> set[str]:
        """A mirror's snapshots whose data it holds: every one its refs have pointed at."""
        journal = self._core.journal
        shown = set(self._core.tags.all().values())
        for name in journal.names():
            shown.update(e.snapshot for e in journal.history(name) if e.snapshot is not None)
        return shown

    def writable_session(self, branch: str = MAIN, *, ttl: dt.timedelta | None = None) -> Session:
        """A transaction on ``branch``, expiring after ``ttl`` (default: config; at most 7 days)."""
        validate_name(branch)
        if ttl is not None:
            check_session_ttl(ttl, InvalidArgument, "ttl")
        self._core.check_writable()
        # The head readers see (the published root, where there is one): if the journal is a
        # commit ahead (its writer died before publishing), the commit rebases onto it.
        head = self._core.journal.published_current(branch).snapshot
        assert head is not None
        return Session(self._core, head, branch=branch, read_only=False, ttl=ttl)

    @contextlib.contextmanager
    def transaction(
        self, branch: str = MAIN, message: str | None = None, author: str | None = None
    ) -> Iterator[ZarrlakeStore]:
        """``with repo.transaction("main", message="...") as store:`` — commits on success,
        discards on error. Nothing is committed if nothing was written."""
        if not isinstance(message, str):
            raise InvalidArgument("transaction() needs a commit message: message='...'")
        session = self.writable_session(branch)
        try:
            yield session.store
        except BaseException:
            session.discard()
            raise
        if session.has_changes:
            session.commit(message, author=author)

    # -- async twins (same call on a worker thread) ------------------------------------------------

    @classmethod
    async def create_async(
        cls,
        storage: Storage,
        *,
        config: RepositoryConfig | dict[str, Any] | None = None,
        lock: LockSpec = None,
        content_hash: str = DEFAULT_CONTENT_HASH,
        verify_reads: bool | None = None,
        published_root: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
    ) -> Repository:
        """Async twin of :meth:`create`."""
        return await asyncio.to_thread(
            partial(
                cls.create,
                storage,
                config=config,
                lock=lock,
                content_hash=content_hash,
                verify_reads=verify_reads,
                published_root=published_root,
                virtual_credentials=virtual_credentials,
            )
        )

    @classmethod
    async def open_async(
        cls,
        storage: Storage,
        *,
        lock: LockSpec = None,
        verify_reads: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
        commit_service: str | None = None,
        commit_token: str | None = None,
    ) -> Repository:
        """Async twin of :meth:`open`."""
        return await asyncio.to_thread(
            partial(
                cls.open,
                storage,
                lock=lock,
                verify_reads=verify_reads,
                virtual_credentials=virtual_credentials,
                commit_service=commit_service,
                commit_token=commit_token,
            )
        )

    @classmethod
    async def open_or_create_async(
        cls,
        storage: Storage,
        *,
        config: RepositoryConfig | dict[str, Any] | None = None,
        lock: LockSpec = None,
        content_hash: str = DEFAULT_CONTENT_HASH,
        verify_reads: bool | None = None,
        virtual_credentials: VirtualCredentials = None,
    ) -> Repository:
        """Async twin of :meth:`open_or_create`."""
        return await asyncio.to_thread(
            partial(
                cls.open_or_create,
                storage,
                config=config,
                lock=lock,
                content_hash=content_hash,
                verify_reads=verify_reads,
                virtual_credentials=virtual_credentials,
            )
        )

    @staticmethod
    async def exists_async(storage: Storage) -> bool:
        """Async twin of :meth:`exists`."""
        return await asyncio.to_thread(Repository.exists, storage)

    async def list_branches_async(self) -> dict[str, str]:
        """Async twin of :meth:`list_branches`."""
        return await asyncio.to_thread(self.list_branches)

    async def lookup_branch_async(self, name: str) -> str:
        """Async twin of :meth:`lookup_branch`."""
        return await asyncio.to_thread(self.lookup_branch, name)

    async def create_branch_async(self, name: str, from_ref: str = MAIN) -> str:
        """Async twin of :meth:`create_branch`."""
        return await asyncio.to_thread(self.create_branch, name, from_ref)

    async def reset_branch_async(
        self, name: str, to_ref: str, *, expected: str | None = None
    ) -> str:
        """Async twin of :meth:`reset_branch`."""
        return await asyncio.to_thread(self.reset_branch, name, to_ref, expected=expected)

    async def delete_branch_async(self, name: str) -> None:
        """Async twin of :meth:`delete_branch`."""
        await asyncio.to_thread(self.delete_branch, name)

    async def list_tags_async(self) -> dict[str, str]:
        """Async twin of :meth:`list_tags`."""
        return await asyncio.to_thread(self.list_tags)

    async def refs_async(self) -> Refs:
        """Async twin of :meth:`refs`."""
        return await asyncio.to_thread(self.refs)

    async def lookup_tag_async(self, name: str) -> str:
        """Async twin of :meth:`lookup_tag`."""
        return await asyncio.to_thread(self.lookup_tag, name)

    async def create_tag_async(self, name: str, ref: str) -> str:
        """Async twin of :meth:`create_tag`."""
        return await asyncio.to_thread(self.create_tag, name, ref)

    async def delete_tag_async(self, name: str) -> None:
        """Async twin of :meth:`delete_tag`."""
        await asyncio.to_thread(self.delete_tag, name)

    async def resolve_async(self, ref: str) -> str:
        """Async twin of :meth:`resolve`."""
        return await asyncio.to_thread(self.resolve, ref)

    async def log_async(self, ref: str = MAIN, *, limit: int | None = None) -> list[CommitInfo]:
        """Async twin of :meth:`log`: the commits as a list."""
        return await asyncio.to_thread(lambda: list(self.log(ref, limit=limit)))

    async def diff_async(self, from_ref: str, to_ref: str) -> Diff:
        """Async twin of :meth:`diff`."""
        return await asyncio.to_thread(self.diff, from_ref, to_ref)

    async def merge_async(
        self,
        source: str,
        into: str,
        *,
        message: str | None = None,
        strategy: str | None = None,
        author: str | None = None,
    ) -> str:
        """Async twin of :meth:`merge`."""
        return await asyncio.to_thread(
            self.merge, source, into, message=message, strategy=strategy, author=author
        )

    async def readonly_session_async(
        self, ref: str = MAIN, *, as_of: dt.datetime | str | None = None
    ) -> Session:
        """Async twin of :meth:`readonly_session`."""
        return await asyncio.to_thread(self.readonly_session, ref, as_of=as_of)

    async def writable_session_async(
        self, branch: str = MAIN, *, ttl: dt.timedelta | None = None
    ) -> Session:
        """Async twin of :meth:`writable_session`."""
        return await asyncio.to_thread(self.writable_session, branch, ttl=ttl)

    async def expire_async(
        self, rules: RetentionRules | Mapping[str, Any], *, dry_run: bool = False
    ) -> ExpireReport:
        """Async twin of :meth:`expire`."""
        return await asyncio.to_thread(self.expire, rules, dry_run=dry_run)

    async def gc_async(
        self,
        *,
        grace: dt.timedelta | str = dt.timedelta(days=7),
        dry_run: bool = False,
        force: bool = False,
        progress: Progress | None = None,
        engine: str = "local",
        spark: Any = None,
    ) -> GCReport:
        """Async twin of :meth:`gc`."""
        return await asyncio.to_thread(
            self.gc,
            grace=grace,
            dry_run=dry_run,
            force=force,
            progress=progress,
            engine=engine,
            spark=spark,
        )

    async def compact_async(
        self,
        *,
        branch: str = MAIN,
        pack_below_bytes: int | None = None,
        keep_journal: dt.timedelta = dt.timedelta(days=7),
        dry_run: bool = False,
        progress: Progress | None = None,
        engine: str = "local",
        spark: Any = None,
        materialize: bool = False,
    ) -> CompactReport:
        """Async twin of :meth:`compact`."""
        return await asyncio.to_thread(
            self.compact,
            branch=branch,
            pack_below_bytes=pack_below_bytes,
            keep_journal=keep_journal,
            dry_run=dry_run,
            progress=progress,
            engine=engine,
            spark=spark,
            materialize=materialize,
        )

    async def upgrade_async(self) -> UpgradeReport:
        """Async twin of :meth:`upgrade`."""
        return await asyncio.to_thread(self.upgrade)

    async def fsck_async(
        self,
        *,
        check_chunks: bool = True,
        verify_content: bool = False,
        sample: int = FSCK_SAMPLE,
        repair: bool = False,
        virtual: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> FsckReport:
        """Async twin of :meth:`fsck`."""
        return await asyncio.to_thread(
            partial(
                self.fsck,
                check_chunks=check_chunks,
                verify_content=verify_content,
                sample=sample,
                repair=repair,
                virtual=virtual,
                progress=progress,
            )
        )


def _fetched(job: ReadJob) -> list[bytes]:
    """The bytes of a planned read's chunks (its one request)."""
    return job.fetch()


#: What one batch of ``compact --materialize`` holds in memory at most: chunks, bytes.
MATERIALIZE_BATCH = (4096, 64 * 1024 * 1024)


def _batches(found: list[tuple[str, ChunkRef]]) -> Iterator[list[tuple[str, ChunkRef]]]:
    """``found`` (virtual refs, in source order) cut into runs of at most
    :data:`MATERIALIZE_BATCH` chunks and bytes (one chunk larger than that: a batch alone)."""
    most, budget = MATERIALIZE_BATCH
    part: list[tuple[str, ChunkRef]] = []
    size = 0
    for item in found:
        length = int(item[1][3])
        if part and (len(part) == most or size + length > budget):
            yield part
            part, size = [], 0
        part.append(item)
        size += length
    if part:
        yield part

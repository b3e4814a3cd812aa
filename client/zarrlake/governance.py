"""Branch protection and checks, as a client applies them (``docs/design/governance.md``).

The rules live in the repository's marker (``repo``), replaced by compare-and-set, with the
format feature :data:`GOVERNANCE` so that a zarrlake that does not know them refuses to write
instead of committing past them; the published root carries a copy for the open. A
:class:`Governance` is the commit engine's :class:`~zarrlake.commit.CommitGuard`: before a
commit, merge, reset or delete of a protected branch it reads the marker again (one request, in
governed repositories only) and refuses what the branch's rule refuses; before a commit or
merge is published, it runs the checks the rule requires on the written, unpublished snapshot.

This holds every client that runs this code. A client that skips it, with credentials that
can write refs, can still move a branch: the design note says what enforces the rules against
such a client (a commit service holding the only credentials that write refs) and what of it
is built.
"""

from __future__ import annotations

import datetime as dt
import functools
import getpass
import hashlib
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from zarrlake.changeset import Changeset
from zarrlake.checks import Change, IsolatedChecks, JobRunner, Runner, build, run
from zarrlake.core import RepositoryCore
from zarrlake.errors import (
    BranchProtected,
    InvalidArgument,
    ReadOnlyError,
)
from zarrlake.format import manifest
from zarrlake.format.model import GOVERNANCE, REPO_KEY, RepoRecord, Snapshot, snapshot_key
from zarrlake.objects import ObjectStore
from zarrlake.refs import validate_name
from zarrlake.rules import BranchRule, Protection

log = logging.getLogger(__name__)


def _identity() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class Governance:
    """The rules of one repository, for one client; see the module docstring.

    ``open_store(snapshot_id)``: a read-only Zarr store of a snapshot (what a check reads)."""

    def __init__(self, core: RepositoryCore, open_store: Callable[[str], Any]) -> None:
        self._core = core
        self._open_store = open_store
        self._mutex = threading.Lock()
        self._protection = Protection.from_record(core.record.governance)
        # Reading the marker before each guarded operation costs a request: only where the
        # repository had rules when this client opened it, or has them since this client set
        # them (see the design note for what a client opened before the first rule misses).
        self._governed = GOVERNANCE in core.record.features
        self._runner: Runner | None = None  # checks run in threads of this process
        self._jobs: JobRunner | None = None  # and none as programs of their own

    # -- reading -----------------------------------------------------------------------------------

    def protection(self, *, refresh: bool = True) -> Protection:
        """The repository's rules; with ``refresh``, as the marker says now."""
        if refresh:
            self._refresh()
        return self._protection

    def _refresh(self) -> None:
        if self._core.is_mirror:
            return
        data = self._core.storage.get(REPO_KEY)
        record = RepoRecord.decode(data, REPO_KEY)
        self._take(record)

    def _take(self, record: RepoRecord) -> None:
        found = Protection.from_record(record.governance)
        with self._mutex:
            if found.generation >= self._protection.generation:
                self._protection = found
            if GOVERNANCE in record.features:
                self._governed = True

    def _rule(self, branch: str) -> BranchRule | None:
        if self._governed:
            self._refresh()
        return self._protection.rule(branch)

    def follow(self) -> None:
        """Read the marker before every guarded operation from now on, whether or not the
        repository has rules yet (a commit service: the rules it applies are the newest)."""
        self._governed = True

    def isolate_checks(self) -> IsolatedChecks | None:
        """Run the checks in worker processes from now on (:class:`IsolatedChecks`: one that
        hangs is stopped at its timeout, not left behind as a thread), as a commit service
        does; the runner, to close. None, and threads still, where a process of its own
        could not read this repository (memory storage)."""
        if not self._core.storage.shared_across_processes:
            log.warning(
                "checks of %s run in threads: another process cannot read its storage",
                self._core.storage.url,
            )
            return None
        runner = IsolatedChecks(self._open_store)
        self._runner = runner
        return runner

    def run_as_jobs(self, jobs: JobRunner) -> None:
        """From now on the checks ``jobs`` runs (by name) run there, as programs of their own
        (a commit service's Kubernetes Jobs), not as entry points in this process."""
        self._jobs = jobs

    # -- the engine's guard -----------------------------------------------------------------------

    def admit(self, branch: str, *, merge: bool, maintenance: bool) -> None:
        # An early word only: verify() reads the rules just before the append and decides. So
        # the marker is read here only when the rules this client holds would refuse (they may
        # have been lifted): a governed commit costs one read of the marker, not two.
        if merge or maintenance:
            return
        rule = self._protection.rule(branch)
        if rule is not None and rule.require_merge:
            self._refuse_direct(branch, self._rule(branch), merge=False)

    def _refuse_direct(self, branch: str, rule: BranchRule | None, *, merge: bool) -> None:
        if rule is None or merge or not rule.require_merge:
            return
        raise BranchProtected(
            branch,
            "require_merge",
            f"branch {branch!r} is protected: it takes merges only (require_merge); commit to "
            f"another branch and merge it into {branch!r}",
        )

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
    ) -> None:
        """:meth:`check` for a commit or merge this client builds; ``encoded`` and
        ``parent_encoded``: the two snapshots' bytes as their journal entries carry them, which
        checks run as Jobs read again and compare (a commit service's merges)."""
        digest = parent_digest = None
        if self._jobs is not None:
            digest = _sha256(encoded)
            parent_digest = _sha256(parent_encoded) or self._vouched_sha256(branch, parent.id)
        self.check(
            branch,
            parent,
            built,
            functools.partial(_written, changeset),
            merge=merge,
            digest=digest,
            parent_digest=parent_digest,
        )

    def _vouched_sha256(self, branch: str, snapshot_id: str) -> str:
        """The digest of a snapshot whose entry carries no bytes: the one the head entry vouches
        for, else (an entry from before digests) of its bytes as stored."""
        head = self._core.journal.published_head(branch)
        if head is not None and head.snapshot == snapshot_id and head.snapshot_sha256:
            return head.snapshot_sha256
        return hashlib.sha256(self._core.storage.get(snapshot_key(snapshot_id))).hexdigest()

    def check(
        self,
        branch: str,
        parent: Snapshot,
        built: Snapshot,
        written: Callable[[], Iterable[str]],
        *,
        merge: bool,
        digest: str | None = None,
        parent_digest: str | None = None,
    ) -> None:
        """Run the checks ``branch``'s rule requires on ``built``, about to land on ``parent``
        (``written()``: the chunk keys it writes). The rule is read again here, just before the
        append, not taken from when the commit started: a rule set while a commit waited for
        the lock, uploaded or rebased binds it (and may now refuse it outright)."""
        rule = self._rule(branch)
        self._refuse_direct(branch, rule, merge=merge)
        if rule is None or not rule.required_checks:
            return
        if self._core.journal.remote is not None:
            # Published by a commit service, which runs the checks on the snapshot as stored
            # (some of them perhaps as Jobs this client could not run): not twice.
            return
        kind = "merge" if merge else "commit"
        change = Change(
            branch, kind, parent, built, written, self._open_store, digest, parent_digest
        )
        run(rule, change, self._runner, self._jobs)

    def before_move(self, branch: str, action: str) -> None:
        rule = self._rule(branch)
        if rule is None:
            return
        if action == "create" and not rule.allow_reset:
            # A protected branch made at any snapshot would be a reset with extra steps (or a
            # commit past its checks): create branches before protecting them.
            raise BranchProtected(
                branch,
                "allow_reset",
                f"branch {branch!r} is protected: it cannot be created at a snapshot of one's "
                "choosing (allow_reset is off); create it, then protect it",
            )
        if action == "reset" and not rule.allow_reset:
            raise BranchProtected(
                branch,
                "allow_reset",
                f"branch {branch!r} is protected: it cannot be reset (allow_reset is off)",
            )
        if action == "delete" and not rule.allow_delete:
            raise BranchProtected(
                branch,
                "allow_delete",
                f"branch {branch!r} is protected: it cannot be deleted (allow_delete is off)",
            )

    # -- changing the rules ------------------------------------------------------------------------

    def protect(self, name: str, rule: BranchRule) -> BranchRule:
        validate_name(name)
        for check in rule.required_checks:
            if self._jobs is not None and self._jobs.runs(check):
                continue  # run as a Job, whose image says what it accepts
            build(check, rule.options(check))  # installed here, options accepted
        self._change(lambda branches: {**branches, name: rule})
        return rule

    def unprotect(self, name: str) -> None:
        validate_name(name)
        self._change(lambda branches: {n: r for n, r in branches.items() if n != name})

    def _change(self, edit: Callable[[dict[str, BranchRule]], dict[str, BranchRule]]) -> None:
        """Apply ``edit`` to the rules in the marker by compare-and-set, then carry the marker
        into the published root (:meth:`RepositoryCore.change_marker`)."""

        def change(found: RepoRecord) -> RepoRecord:
            current = Protection.from_record(found.governance)
            new = Protection(
                edit(dict(current.branches)),
                current.generation + 1,
                dt.datetime.now(dt.UTC),
                _identity(),
            )
            features = found.features
            if GOVERNANCE not in features:
                features = (*features, GOVERNANCE)
            return replace(found, features=features, governance=new.to_record())

        if self._core.is_mirror:
            raise ReadOnlyError("a mirror's branches follow its source: protect them there")
        self._take(self._core.change_marker(change, "changing branch protection"))


def _written(changeset: Changeset) -> Iterator[str]:
    return (key for key, ref in changeset.chunks.items() if ref is not None)


def written_between(objects: ObjectStore, parent: Snapshot, built: Snapshot) -> Iterator[str]:
    """The keys of the chunks ``built`` writes over ``parent``, from their manifests (not from
    what a writer says it wrote): what a commit service, or a check run as a Job, checks."""
    for key, _, new in manifest.diff_entries(parent.shards, built.shards, objects.shard):
        if new is not None:
            yield key


def rule_from_arguments(
    *,
    require_merge: bool,
    allow_delete: bool,
    allow_reset: bool,
    required_checks: Any,
    check_options: Any,
) -> BranchRule:
    """A :class:`BranchRule` from :meth:`Repository.protect_branch`'s arguments."""
    if check_options is None:
        check_options = {}
    if isinstance(required_checks, str):
        raise InvalidArgument(
            f"required_checks must be a list of check names, not the string {required_checks!r}"
        )
    return BranchRule(
        require_merge, allow_delete, allow_reset, tuple(required_checks), check_options
    )


def _sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()

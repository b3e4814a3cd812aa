"""``zarrlake upgrade``: give an existing repository the published root.

Safe while writers are active, and idempotent. In three steps, each of which leaves a
repository every client reads correctly:

1. **The root**, built from the journals, tag records and expiry records as they are now,
   written create-only (or over the root a half-done upgrade left). No reader reads it yet: the
   marker does not name the feature.
2. **The marker**, rewritten by compare-and-set with the feature added. From here on, a client
   that opens the repository reads and publishes ``root``; a zarrlake older than the feature
   reads it as before (the journals) and refuses to write, naming the version it needs.
3. **The journals again**: what writers that opened the repository before step 2 appended
   meanwhile (they publish nothing) is carried into the root.

A client that opened the repository before the upgrade keeps committing through the journals
alone until it opens the repository again. Nothing it commits is lost (the journal decides
every commit), but readers of the root see its commits only when the branch's next published
commit builds on them, or after ``zarrlake fsck --repair``. Upgrade when long-lived writers can
be restarted, or repair after they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zarrlake.core import RepositoryCore
from zarrlake.errors import PreconditionFailed, ReadOnlyError, ZarrlakeError
from zarrlake.format.model import PUBLISHED_ROOT, REPO_KEY, RepoRecord
from zarrlake.format.root import CAS_PROBE_KEY, RootRecord


@dataclass(frozen=True)
class UpgradeReport:
    """What :func:`upgrade` did. ``added``: the format features it added (empty if the
    repository had them, or could not take them: ``reason`` says why). ``branches`` and
    ``tags``: what the root publishes; ``generation``: the root's, after the upgrade."""

    added: tuple[str, ...]
    published_root: bool
    branches: int = 0
    tags: int = 0
    generation: int = 0
    reason: str = ""

    def summary(self) -> str:
        """One line for people."""
        if not self.published_root:
            return f"not upgraded: {self.reason}"
        what = f"{self.branches} branch(es) and {self.tags} tag(s) in root"
        if not self.added:
            return f"already up to date: {what} (generation {self.generation})"
        return f"added {', '.join(self.added)}: {what} (generation {self.generation})"

    def to_json(self) -> dict[str, Any]:
        return {
            "added": list(self.added),
            "published_root": self.published_root,
            "branches": self.branches,
            "tags": self.tags,
            "generation": self.generation,
            "reason": self.reason,
        }


def upgrade(core: RepositoryCore) -> tuple[UpgradeReport, RepoRecord]:
    """Add the published root to the repository of ``core`` (see the module docstring); the
    report and the repository's marker record after it.

    Raises :class:`ReadOnlyError` for a mirror (its promoter writes its refs) and as
    :meth:`RepositoryCore.check_writable` does (a newer zarrlake's repository, a server
    without create-only writes). A server without compare-and-set is no error: the report says
    the repository keeps the journal-only protocol."""
    if core.is_mirror:
        raise ReadOnlyError("a mirror is not upgraded itself: upgrade its source")
    core.check_writable()
    storage, record = core.storage, core.record
    if PUBLISHED_ROOT in record.features:
        root = core.republish()
        return _report((), root), record
    if not storage.supports_compare_and_set or not storage.check_compare_and_set(CAS_PROBE_KEY):
        reason = f"{storage.url} does not keep compare-and-set writes: it stays journal-only"
        return UpgradeReport((), False, reason=reason), record
    # The marker as it is now, not as this client opened it: branch rules set since are kept.
    current = RepoRecord.decode(storage.get(REPO_KEY), REPO_KEY)
    if current.id != record.id:
        raise ZarrlakeError(
            f"the repository at {storage.url} was replaced (id {current.id}, not {record.id}): "
            "nothing of it was changed"
        )
    if PUBLISHED_ROOT in current.features:
        record = current  # another upgrade got there first
    new = _with_root(current)
    upgraded = RepositoryCore.build(storage, new, core.lock)
    assert upgraded.journal.published is not None
    # 1. The root (a repository whose root is missing or damaged is written from the journals).
    upgraded.journal.published.publish(lambda r: r.with_repo(new))
    # 2. The marker.
    final = _swap_marker(core, record, new)
    if final != new:  # rules changed between the two: the root carries the marker's
        upgraded.journal.published.publish(lambda r: r.with_repo(final))
    # 3. The journals again.
    root = upgraded.republish()
    return _report(tuple(f for f in final.features if f not in record.features), root), final


def _with_root(record: RepoRecord) -> RepoRecord:
    if PUBLISHED_ROOT in record.features:
        return record
    return replace(record, features=(*record.features, PUBLISHED_ROOT))  # a version-2 marker


def _swap_marker(core: RepositoryCore, old: RepoRecord, new: RepoRecord) -> RepoRecord:
    """Add the feature to the marker as it is at each try (keeping what else changed in it,
    branch rules above all); the marker as written."""
    storage = core.storage
    for _ in range(8):
        got = storage.get_versioned(REPO_KEY)
        found = RepoRecord.decode(got.data, REPO_KEY)
        if found.id != old.id:
            raise ZarrlakeError(
                f"the repository at {storage.url} was replaced during the upgrade "
                f"(id {found.id}, not {old.id}): nothing of it was changed"
            )
        if PUBLISHED_ROOT in found.features:
            return found  # another upgrade got there first
        wanted = _with_root(found)
        try:
            storage.put_if_version(REPO_KEY, wanted.encode(), got.version)
            return wanted
        except PreconditionFailed:
            continue
    raise ZarrlakeError(f"the marker of {storage.url} kept changing during the upgrade")


def _report(added: tuple[str, ...], root: RootRecord) -> UpgradeReport:
    return UpgradeReport(added, True, len(root.heads()), len(root.tags), root.generation)

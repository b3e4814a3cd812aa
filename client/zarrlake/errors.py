"""Every error zarrlake raises on purpose derives from :class:`ZarrlakeError`.

Errors carry the facts (which ref, which object, which chunk) as attributes and read well in a log.
"""

from __future__ import annotations

from dataclasses import dataclass


class ZarrlakeError(Exception):
    """Base class of all zarrlake errors."""


class RepositoryExists(ZarrlakeError):
    """``Repository.create`` found a repository already there."""


class RepositoryNotFound(ZarrlakeError):
    """No repository at this storage location."""


class RefNotFound(ZarrlakeError, KeyError):
    """A branch, tag or snapshot id that does not exist."""

    def __init__(self, ref: str, kind: str = "ref") -> None:
        super().__init__(ref)
        self.ref = ref
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.kind} not found: {self.ref!r}"


class InvalidName(ZarrlakeError, ValueError):
    """A branch or tag name that breaks the naming rules."""


class BranchExists(ZarrlakeError):
    """``create_branch`` with a name already in use."""


class TagExists(ZarrlakeError):
    """``create_tag`` with a name in use, or one used by a deleted tag."""


@dataclass(frozen=True)
class Conflict:
    """One reason two lines of work cannot be combined automatically.

    ``kind`` is one of ``chunk``, ``node``, ``deleted-theirs``, ``deleted-ours``, ``resized``,
    ``branch-reset``; ``path`` is the array or group path; ``chunk`` the chunk coordinates, if any.
    """

    kind: str
    path: str
    chunk: tuple[int, ...] | None = None

    def __str__(self) -> str:
        where = self.path or "/"
        if self.chunk is not None:
            where += "[" + ",".join(map(str, self.chunk)) + "]"
        return f"{self.kind} conflict at {where}"


class ConflictError(ZarrlakeError):
    """A commit could not be rebased onto the branch head; ``conflicts`` lists why."""

    def __init__(self, conflicts: list[Conflict], message: str | None = None) -> None:
        self.conflicts = list(conflicts)
        if message is None:
            shown = "; ".join(str(c) for c in self.conflicts[:5])
            more = f" (+{len(self.conflicts) - 5} more)" if len(self.conflicts) > 5 else ""
            message = f"{len(self.conflicts)} conflict(s): {shown}{more}"
        super().__init__(message)


class MergeConflictError(ConflictError):
    """A three-way merge found changes it cannot combine; ``conflicts`` lists them."""


class SessionExpired(ZarrlakeError):
    """The session outlived its TTL; start a new one."""


class ReadOnlyError(ZarrlakeError, ValueError):
    """A write through a read-only session or store."""


class LockTimeout(ZarrlakeError):
    """The branch lock could not be acquired within ``wait_s``."""


class LockUnavailable(ZarrlakeError):
    """The lock service cannot be reached and the lock is configured to fail."""


class CorruptObject(ZarrlakeError):
    """A metadata object whose bytes do not parse."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"corrupt object {key}: {reason}")
        self.key = key
        self.reason = reason


class UnsupportedFormat(ZarrlakeError):
    """An object written by a newer zarrlake format version, or not a zarrlake object at all."""


class RetryableError(ZarrlakeError):
    """The operation can be retried as a whole (e.g. a deduplicated chunk vanished under GC)."""


class KubernetesError(ZarrlakeError):
    """A ``Repository`` resource, or a Secret it names, is missing, not ready or malformed."""


class InvalidDuration(ZarrlakeError, ValueError):
    """A duration text (``--grace 7d``, ``spec.gc.grace``) that does not parse."""


class NothingToCommit(ZarrlakeError):
    """``commit`` on a session without changes (pass ``allow_empty=True`` to commit anyway)."""


class GraceTooShort(ZarrlakeError, ValueError):
    """A grace period shorter than the longest session lifetime (pass force=True to insist)."""


class InvalidRetentionRules(ZarrlakeError, ValueError):
    """Retention rules that do not parse or make no sense; the message says where."""

"""Every error zarrlake raises on purpose derives from :class:`ZarrlakeError`; this module holds
the whole hierarchy (storage, Spark and engine errors alike) so that any layer can raise and catch
them without importing another layer. Older import paths (``zarrlake.storage``,
``zarrlake.storage.base``, ``zarrlake.spark``) re-export the same classes.

Errors carry the facts (which ref, which object, which chunk) as attributes and read well in a log.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from typing import Any


class ZarrlakeError(Exception):
    """Base class of all zarrlake errors."""


class RepositoryExists(ZarrlakeError):
    """``Repository.create`` found a repository already there."""


class RepositoryNotFound(ZarrlakeError):
    """No repository at this storage location."""


class RefNotFound(ZarrlakeError, KeyError):
    """A branch, tag or snapshot id that does not exist."""

    def __init__(self, ref: str, kind: str = "ref", hint: str = "") -> None:
        super().__init__(ref)
        self.ref = ref
        self.kind = kind
        #: Why it may exist all the same, and what to do (e.g. on a storage without listings).
        self.hint = hint

    def __str__(self) -> str:
        found = f"{self.kind} not found: {self.ref!r}"
        return f"{found} ({self.hint})" if self.hint else found


class NotMirrored(RefNotFound):
    """A snapshot a mirror knows as history but never showed: it skipped the commit (it only
    ever shows the newest complete head), so the commit's data is not there to read."""

    def __init__(self, snapshot_id: str, mirror_of: str) -> None:
        super().__init__(snapshot_id, "snapshot")
        self.mirror_of = mirror_of

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.ref, self.mirror_of))

    def __str__(self) -> str:
        return (
            f"snapshot {self.ref!r} is in this mirror's history but its data was not mirrored "
            f"(a mirror shows only the commits its refs moved to); read it at {self.mirror_of}"
        )


class AmbiguousRef(RefNotFound):
    """A short snapshot id that more than one snapshot's id starts with. ``candidates``: some of
    those ids (the first few in order); ``more``: whether there are others besides."""

    def __init__(self, ref: str, candidates: list[str], more: bool = False) -> None:
        super().__init__(ref, "snapshot id prefix")
        self.candidates = list(candidates)
        self.more = more

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.ref, self.candidates, self.more))

    def __str__(self) -> str:
        listed = ", ".join(self.candidates) + (", ..." if self.more else "")
        return (
            f"ambiguous snapshot id {self.ref!r}: it starts the ids of several snapshots "
            f"({listed}); give more of the id"
        )


class InvalidName(ZarrlakeError, ValueError):
    """A branch or tag name that breaks the naming rules."""


class BranchExists(ZarrlakeError):
    """``create_branch`` with a name already in use."""


class TagExists(ZarrlakeError):
    """``create_tag`` with a name in use, or one used by a deleted tag."""


class ConflictKind(enum.StrEnum):
    """Why two lines of work cannot be combined automatically (:attr:`Conflict.kind`).

    A ``str`` enum: members compare equal to their values (``kind == "chunk"``) and serialize to
    them in JSON, so code written against the plain strings keeps working.
    """

    #: Both sides wrote the same chunk (a solver or merge strategy may pick a side).
    CHUNK = "chunk"
    #: Both sides changed the same node's metadata to different documents.
    NODE = "node"
    #: The other side deleted a subtree this side wrote into.
    DELETED_THEIRS = "deleted-theirs"
    #: This side deleted a subtree the other side wrote into.
    DELETED_OURS = "deleted-ours"
    #: One side changed an array's shape or chunk grid while the other wrote its chunks.
    RESIZED = "resized"
    #: The branch head is not the one expected (``reset_branch(expected=...)``, or a commit with
    #: ``rebase=False`` after the branch moved).
    BRANCH_MOVED = "branch-moved"
    #: Named in the documentation of earlier releases; the engine reports a moved or reset branch
    #: as :attr:`BRANCH_MOVED`. Kept so that conflicts built with this kind stay valid.
    BRANCH_RESET = "branch-reset"


@dataclass(frozen=True, init=False)
class Conflict:
    """One reason two lines of work cannot be combined automatically.

    ``kind`` is a :class:`ConflictKind` (a plain string naming one, like ``"chunk"``, is accepted
    and converted; an unknown one raises :class:`ValueError`); ``path`` is the array or group
    path (the branch name for :attr:`ConflictKind.BRANCH_MOVED`); ``chunk`` the chunk
    coordinates, if any.
    """

    kind: ConflictKind
    path: str
    chunk: tuple[int, ...] | None = None

    def __init__(
        self, kind: ConflictKind | str, path: str, chunk: tuple[int, ...] | None = None
    ) -> None:
        try:
            kind = ConflictKind(kind)
        except ValueError:
            known = ", ".join(k.value for k in ConflictKind)
            raise ValueError(f"unknown conflict kind {kind!r}; one of: {known}") from None
        # Frozen: the generated __setattr__ refuses, so set the fields as dataclasses do.
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "chunk", chunk)

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
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.conflicts, self.message))


class MergeConflictError(ConflictError):
    """A three-way merge found changes it cannot combine; ``conflicts`` lists them."""


class SessionExpired(ZarrlakeError):
    """The session outlived its TTL; start a new one."""


class WritableSessionPickled(ZarrlakeError, pickle.PicklingError):
    """A writable session (or its store) was pickled. The copy's writes could never reach the
    session, whose commit would then silently lack them; fork the session instead (its forks
    pickle, and their changes come back with :meth:`Session.merge`)."""


class ReadOnlyError(ZarrlakeError, ValueError):
    """A write through a read-only session or store."""


class BranchProtected(ZarrlakeError):
    """An operation a branch's protection refuses (see :meth:`Repository.protect_branch`):
    ``branch``, and ``rule``, the rule that refuses it (``"require_merge"``, ``"allow_delete"``,
    ``"allow_reset"``). Nothing was changed."""

    def __init__(self, branch: str, rule: str, message: str) -> None:
        super().__init__(message)
        self.branch = branch
        self.rule = rule

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.branch, self.rule, str(self)))


class CheckFailed(ZarrlakeError):
    """A check a protected branch requires refused a commit or merge (or crashed, or ran out of
    time: a check that cannot say yes says no). ``check``: its name; ``branch``; ``problems``:
    what it found, one line each. The branch was not moved."""

    def __init__(self, check: str, branch: str, problems: list[str] | tuple[str, ...]) -> None:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        super().__init__(f"check {check!r} refused the change to branch {branch!r}: {shown}")
        self.check = check
        self.branch = branch
        self.problems = tuple(problems)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.check, self.branch, self.problems))


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

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its facts in another process (a dask or Spark worker's error), not from
        # the message alone.
        return (type(self), (self.key, self.reason))


class UnsupportedFormat(ZarrlakeError):
    """An object written by a newer zarrlake format version, or not a zarrlake object at all."""


class NotZarrlakeObject(CorruptObject, UnsupportedFormat):
    """Bytes where a zarrlake object should be that are not one at all (no zarrlake header):
    damaged, or written there by something else. A :class:`CorruptObject`, and an
    :class:`UnsupportedFormat` as this case always was."""


class CorruptChunk(CorruptObject):
    """Chunk bytes that do not hash to the digest their ref records: damaged in storage, or
    overwritten. Raised instead of returning them. ``key`` is the object read (a chunk object,
    or the pack holding the chunk), ``expected`` and ``actual`` the two digests (hex) under the
    repository's content hash ``hash_name``; ``chunk`` is the Zarr key read (``array/c/0/1``)
    and ``array`` its array's path, where the reader knows them."""

    def __init__(
        self,
        key: str,
        expected: str,
        actual: str,
        hash_name: str,
        *,
        chunk: str | None = None,
        array: str | None = None,
    ) -> None:
        where = "a chunk" if chunk is None else f"chunk {chunk!r} of array {array or '/'!r}"
        super().__init__(
            key,
            f"{where} does not match its digest ({hash_name}: expected {expected}, read "
            f"{actual}); its bytes were not returned",
        )
        self.expected = expected
        self.actual = actual
        self.hash_name = hash_name
        self.chunk = chunk
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_corrupt_chunk,
            (self.key, self.expected, self.actual, self.hash_name, self.chunk, self.array),
        )

    def at(self, chunk: str, array: str) -> CorruptChunk:
        """The same error, naming the Zarr key and array that read the chunk."""
        return CorruptChunk(
            self.key, self.expected, self.actual, self.hash_name, chunk=chunk, array=array
        )


def _rebuild_corrupt_chunk(
    key: str, expected: str, actual: str, hash_name: str, chunk: str | None, array: str | None
) -> CorruptChunk:
    return CorruptChunk(key, expected, actual, hash_name, chunk=chunk, array=array)


class StorageError(ZarrlakeError):
    """The object store failed in a way retries did not fix."""


class ObjectNotFound(StorageError, KeyError):
    """The key does not exist."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"object not found: {self.key}"


class PreconditionFailed(StorageError):
    """A create-only write found the key already present. Never retried."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"object already exists: {self.key}"


class RootUnpublished(StorageError):
    """A change the journal decided (a commit is in, a tag made) that could not be published to
    the repository's ``root`` yet. Nothing is lost: the journal holds it, readers see it once the
    next publish on the repository (a commit, a ref move) or ``zarrlake fsck --repair`` carries
    it into ``root``. Do not redo the change."""


class TransientStorageError(StorageError):
    """Throttling, a 5xx, a timeout: worth retrying with backoff."""


class ConditionalWritesUnsupported(StorageError):
    """The object store does not keep create-only writes (S3 ``If-None-Match: *``): two writers
    could then both "win" a branch's next journal entry, and one commit would be lost.

    Raised before the first write to a repository there (see
    :meth:`zarrlake.storage.Storage.check_conditional_writes`): nothing was written but the
    check's own object, ``key``.
    """

    def __init__(self, url: str, key: str, found: str) -> None:
        super().__init__(
            f"{url} does not keep create-only writes ({found}): zarrlake will not write there, "
            "concurrent commits could be lost"
        )
        self.url = url
        self.key = key
        self.found = found

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.key, self.found))


class ReadOnlyStorage(StorageError, ReadOnlyError):
    """A write to a storage that cannot take writes (a repository published over plain HTTP),
    or that cannot take them safely (no atomic create-only writes, which the branch journal
    needs). Also a :class:`ReadOnlyError`: code that handles a read-only repository handles it."""


class ListingUnsupported(StorageError):
    """The storage cannot list its objects (plain HTTP): what needs a listing — every branch,
    every tag, maintenance — is not available there. Branches and tags named explicitly are."""


class SparkWriteError(ZarrlakeError):
    """A :func:`zarrlake.spark.write_partitions` job failed; nothing was committed.

    ``partition`` is the index of the partition whose writer raised (None if the job failed some
    other way); ``reason`` is the writer's exception as ``"Type: message"``, or Spark's error.
    """

    def __init__(self, message: str, *, partition: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.partition = partition
        self.reason = reason


class RetryableError(ZarrlakeError):
    """The operation can be retried as a whole (e.g. a deduplicated chunk vanished under GC)."""


class KubernetesError(ZarrlakeError):
    """A ``Repository`` resource, or a Secret it names, is missing, not ready or malformed."""


class InvalidArgument(ZarrlakeError, ValueError, TypeError):
    """An argument of the wrong type or value (an unknown merge strategy, a lock that is not
    one, a solver that is not one). Both a ``ValueError`` and a ``TypeError``, so that code
    written against either keeps catching it."""


class InvalidConfig(InvalidArgument):
    """A repository setting zarrlake does not know, or a value out of its range or of the wrong
    type (``Repository.create(config=…)``)."""


class VirtualChunkError(ZarrlakeError):
    """A virtual chunk (a byte range of a file outside the repository) that cannot be read as
    its ref says. ``url`` is the source file; ``chunk`` the Zarr key read (``array/c/0/1``)
    and ``array`` its array's path, where the reader knows them. Raised instead of returning
    bytes: a virtual read never returns what may be another version's data."""

    def __init__(
        self, url: str, reason: str, *, chunk: str | None = None, array: str | None = None
    ) -> None:
        where = "" if chunk is None else f" (chunk {chunk!r} of array {array or '/'!r})"
        super().__init__(f"virtual chunk source {url}{where}: {reason}")
        self.url = url
        self.reason = reason
        self.chunk = chunk
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_virtual, (type(self), self.url, self.reason, self.chunk, self.array))

    def at(self, chunk: str, array: str) -> VirtualChunkError:
        """The same error, naming the Zarr key and array that read the chunk."""
        return type(self)(self.url, self.reason, chunk=chunk, array=array)


def _rebuild_virtual(
    cls: type[VirtualChunkError], url: str, reason: str, chunk: str | None, array: str | None
) -> VirtualChunkError:
    return cls(url, reason, chunk=chunk, array=array)


class VirtualSourceChanged(VirtualChunkError):
    """The source file of a virtual chunk is not the version its ref was made from: its ETag or
    modification time differ from the ref's. Rebuild the refs (import the file again)."""


class VirtualSourceMissing(VirtualChunkError):
    """The source file of a virtual chunk does not exist (or ends before the chunk does)."""


class VirtualContainerNotAllowed(VirtualChunkError, InvalidArgument):
    """A virtual ref whose URL lies in none of the repository's ``virtual_containers``: refused
    when written (an :class:`InvalidArgument`) and when read, so that a repository can never
    make its reader fetch an arbitrary URL with the reader's credentials."""


class InvalidDuration(ZarrlakeError, ValueError):
    """A duration text (``--grace 7d``, ``spec.gc.grace``) that does not parse."""


class NothingToCommit(ZarrlakeError):
    """``commit`` on a session without changes (pass ``allow_empty=True`` to commit anyway)."""


class GraceTooShort(ZarrlakeError, ValueError):
    """A grace period shorter than the longest session lifetime (pass force=True to insist)."""


class InvalidRetentionRules(ZarrlakeError, ValueError):
    """Retention rules that do not parse or make no sense; the message says where."""


class UnknownContentHash(ZarrlakeError, ValueError):
    """``Repository.create(content_hash=...)`` names a hash zarrlake does not implement."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown content hash {name!r}; choose one of {', '.join(known)}")
        self.name = name
        self.known = known

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.known))


class MissingDependency(ZarrlakeError, ImportError):
    """A feature whose optional dependency is not installed: ``feature`` (what needed it, e.g.
    "the S3 storage backend") needs the module ``module``, which the extra ``extra`` of
    ``pip install 'zarrlake[extra]'`` brings. Also an :class:`ImportError` (``name`` is
    ``module``), as the bare one raised before was."""

    def __init__(self, module: str, extra: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs {module}, which is not installed: pip install 'zarrlake[{extra}]'",
            name=module,
        )
        self.module = module
        self.extra = extra
        self.feature = feature

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.module, self.extra, self.feature))


class ExecutorPythonError(ZarrlakeError):
    """Spark's executors run a Python that cannot run zarrlake: it lacks zarrlake or one of its
    dependencies, has another zarrlake or another Python version than the driver, or does not
    start. Raised before the job, so nothing was written. ``python`` is the interpreter they ran
    (as they report it, else as Spark names it; "" if unknown), ``reason`` what went wrong."""

    def __init__(self, message: str, *, python: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.python = python
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self),), self.__dict__)

"""zarrlake: versioned, transactional Zarr repositories on object storage.

>>> import zarrlake, zarr
>>> repo = zarrlake.Repository.create(zarrlake.Storage.memory())
>>> session = repo.writable_session("main")
>>> root = zarr.open_group(session.store, mode="w")
>>> session.commit("create root group")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zarrlake.changeset import Changeset
from zarrlake.config import RepositoryConfig
from zarrlake.conflicts import UseOurs, UseTheirs
from zarrlake.errors import (
    BranchExists,
    ConditionalWritesUnsupported,
    Conflict,
    ConflictError,
    ConflictKind,
    CorruptObject,
    GraceTooShort,
    InvalidDuration,
    InvalidName,
    InvalidRetentionRules,
    KubernetesError,
    ListingUnsupported,
    LockTimeout,
    LockUnavailable,
    MergeConflictError,
    NothingToCommit,
    NotMirrored,
    ObjectNotFound,
    PreconditionFailed,
    ReadOnlyError,
    ReadOnlyStorage,
    RefNotFound,
    RepositoryExists,
    RepositoryNotFound,
    RetryableError,
    SessionExpired,
    SparkWriteError,
    TagExists,
    TransientStorageError,
    UnknownContentHash,
    UnsupportedFormat,
    WritableSessionPickled,
    ZarrlakeError,
)
from zarrlake.fsck import FsckReport
from zarrlake.history import History
from zarrlake.maintenance import CompactReport, ExpireReport, GCReport, Keep, RetentionRules
from zarrlake.repository import Repository
from zarrlake.session import ForkedSession, Session
from zarrlake.storage import Storage, StorageError
from zarrlake.types import CommitInfo, Diff

if TYPE_CHECKING:
    from zarrlake.locks import LocalLock, RedisLock
    from zarrlake.store import ZarrlakeStore

__version__ = "0.1.0"


def __getattr__(name: str) -> type[ZarrlakeStore] | type[RedisLock] | type[LocalLock]:
    # Loaded when first asked for: the Zarr store adapter imports zarr (slow), and a build may
    # leave the lock service out (the CLI then says so).
    if name == "ZarrlakeStore":
        from zarrlake.store import ZarrlakeStore

        return ZarrlakeStore
    if name == "RedisLock":
        from zarrlake.locks import RedisLock

        return RedisLock
    if name == "LocalLock":
        from zarrlake.locks import LocalLock

        return LocalLock
    raise AttributeError(f"module 'zarrlake' has no attribute {name!r}")


__all__ = [
    "BranchExists",
    "Changeset",
    "CommitInfo",
    "CompactReport",
    "ConditionalWritesUnsupported",
    "Conflict",
    "ConflictError",
    "ConflictKind",
    "CorruptObject",
    "Diff",
    "ExpireReport",
    "ForkedSession",
    "FsckReport",
    "GCReport",
    "GraceTooShort",
    "History",
    "InvalidDuration",
    "InvalidName",
    "InvalidRetentionRules",
    "Keep",
    "KubernetesError",
    "ListingUnsupported",
    "LocalLock",
    "LockTimeout",
    "LockUnavailable",
    "MergeConflictError",
    "NotMirrored",
    "NothingToCommit",
    "ObjectNotFound",
    "PreconditionFailed",
    "ReadOnlyError",
    "ReadOnlyStorage",
    "RedisLock",
    "RefNotFound",
    "Repository",
    "RepositoryConfig",
    "RepositoryExists",
    "RepositoryNotFound",
    "RetentionRules",
    "RetryableError",
    "Session",
    "SessionExpired",
    "SparkWriteError",
    "Storage",
    "StorageError",
    "TagExists",
    "TransientStorageError",
    "UnknownContentHash",
    "UnsupportedFormat",
    "UseOurs",
    "UseTheirs",
    "WritableSessionPickled",
    "ZarrlakeError",
    "ZarrlakeStore",
]

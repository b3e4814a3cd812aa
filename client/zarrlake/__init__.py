"""zarrlake: versioned, transactional Zarr repositories on object storage.

>>> import zarrlake, zarr
>>> repo = zarrlake.Repository.create(zarrlake.Storage.memory())
>>> session = repo.writable_session("main")
>>> root = zarr.open_group(session.store, mode="w")
>>> session.commit("create root group")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zarrlake.changeset import Changeset
from zarrlake.config import RepositoryConfig, VirtualContainer
from zarrlake.conflicts import UseOurs, UseTheirs
from zarrlake.errors import (
    AmbiguousRef,
    BranchExists,
    BranchProtected,
    CheckFailed,
    ConditionalWritesUnsupported,
    Conflict,
    ConflictError,
    ConflictKind,
    CorruptChunk,
    CorruptObject,
    ExecutorPythonError,
    GraceTooShort,
    InvalidArgument,
    InvalidConfig,
    InvalidDuration,
    InvalidName,
    InvalidRetentionRules,
    KubernetesError,
    ListingUnsupported,
    LockTimeout,
    LockUnavailable,
    MergeConflictError,
    MissingDependency,
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
    VirtualChunkError,
    VirtualContainerNotAllowed,
    VirtualSourceChanged,
    VirtualSourceMissing,
    WritableSessionPickled,
    ZarrlakeError,
)
from zarrlake.fsck import FsckReport
from zarrlake.history import History
from zarrlake.maintenance import CompactReport, ExpireReport, GCReport, Keep, RetentionRules
from zarrlake.repository import Repository
from zarrlake.rules import BranchRule
from zarrlake.session import ForkedSession, Session
from zarrlake.sources import VirtualRef
from zarrlake.storage import Storage, StorageError
from zarrlake.types import CommitInfo, Diff
from zarrlake.upgrade import UpgradeReport

if TYPE_CHECKING:
    from zarrlake.dask import to_zarrlake
    from zarrlake.locks import LocalLock, RedisLock
    from zarrlake.mirror import Mirror, MirrorStatus
    from zarrlake.spark import read_array, write_partitions
    from zarrlake.store import ZarrlakeStore

__version__ = "0.4.0"

# Loaded when first asked for (``zarrlake.Mirror``, ``from zarrlake import to_zarrlake``): the
# Zarr store adapter imports zarr (slow), a build may leave the lock service out (the CLI then
# says so), and the rest need not cost every ``import zarrlake``. Name -> its module.
_LAZY = {
    "ZarrlakeStore": "zarrlake.store",
    "RedisLock": "zarrlake.locks",
    "LocalLock": "zarrlake.locks",
    "Mirror": "zarrlake.mirror",
    "MirrorStatus": "zarrlake.mirror",
    "to_zarrlake": "zarrlake.dask",
    "read_array": "zarrlake.spark",
    "write_partitions": "zarrlake.spark",
}
#: Submodules that ``zarrlake.<name>`` reaches after a plain ``import zarrlake``.
_SUBMODULES = frozenset({"dask", "k8s", "locks", "maintenance", "mirror", "spark", "store"})


if not TYPE_CHECKING:  # type checkers take the names from the imports above: typos stay errors

    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            return getattr(importlib.import_module(_LAZY[name]), name)
        if name in _SUBMODULES:
            return importlib.import_module(f"zarrlake.{name}")
        raise AttributeError(f"module 'zarrlake' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "AmbiguousRef",
    "BranchExists",
    "BranchProtected",
    "BranchRule",
    "Changeset",
    "CheckFailed",
    "CommitInfo",
    "CompactReport",
    "ConditionalWritesUnsupported",
    "Conflict",
    "ConflictError",
    "ConflictKind",
    "CorruptChunk",
    "CorruptObject",
    "Diff",
    "ExecutorPythonError",
    "ExpireReport",
    "ForkedSession",
    "FsckReport",
    "GCReport",
    "GraceTooShort",
    "History",
    "InvalidArgument",
    "InvalidConfig",
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
    "Mirror",
    "MirrorStatus",
    "MissingDependency",
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
    "UpgradeReport",
    "UseOurs",
    "UseTheirs",
    "VirtualChunkError",
    "VirtualContainer",
    "VirtualContainerNotAllowed",
    "VirtualRef",
    "VirtualSourceChanged",
    "VirtualSourceMissing",
    "WritableSessionPickled",
    "ZarrlakeError",
    "ZarrlakeStore",
    "read_array",
    "to_zarrlake",
    "write_partitions",
]

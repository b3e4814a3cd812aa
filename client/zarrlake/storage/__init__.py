"""Object-store backends. One protocol (:class:`Storage`), one file per backend."""

from zarrlake.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
)

__all__ = [
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "Storage",
    "StorageError",
    "TransientStorageError",
]

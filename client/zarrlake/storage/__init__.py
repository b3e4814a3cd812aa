"""Object-store backends: one protocol (:class:`Storage`), one file per backend, one factory.

``from_url(url)`` turns a URL into a storage; ``Storage.local``, ``Storage.memory``,
``Storage.s3``, ``Storage.http`` and the others build one from arguments. Importing this package
registers every backend (see :mod:`zarrlake.storage.base` for how); nothing outside it needs to
know the backends' classes — ask a storage's capabilities (``durable``, ``supports_listing``, ...)
instead.
"""

from zarrlake.errors import ListingUnsupported, ReadOnlyStorage
from zarrlake.storage import azure, gcs, http, local, memory, s3  # noqa: F401  (each registers its backend)
from zarrlake.storage.base import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
    from_url,
)

__all__ = [
    "ListingUnsupported",
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "ReadOnlyStorage",
    "Storage",
    "StorageError",
    "TransientStorageError",
    "from_url",
]

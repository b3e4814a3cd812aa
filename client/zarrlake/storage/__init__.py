"""Object-store backends: one protocol (:class:`Storage`), one file per backend, one factory.

``from_url(url)`` turns a URL into a storage; ``Storage.local``, ``Storage.memory``,
``Storage.s3``, ``Storage.http`` and the others build one from arguments. Importing this package
registers every backend (see :mod:`zarrlake.storage.base` for how); nothing outside it needs to
know the backends' classes — ask a storage's capabilities (``durable``, ``supports_listing``, ...)
instead.

What the engine needs of a backend's listings is the listing contract in
:mod:`zarrlake.storage.base`: every object under a plain prefix exactly once; no order, except
that keys of one length directly in one folder come in ascending order (the branch journal finds
its newest entry so); folders named by ``list_dirs`` may be empty. Atomic create-only writes are
verified on S3 before the first write (:meth:`Storage.check_conditional_writes`), compare-and-set
(:meth:`Storage.get_versioned`, :meth:`Storage.put_if_version`) before the engine relies on it
(:meth:`Storage.check_compare_and_set`).
"""

from zarrlake.errors import ListingUnsupported, ReadOnlyStorage
from zarrlake.storage import azure, gcs, http, local, memory, s3  # noqa: F401  (each registers its backend)
from zarrlake.storage.base import (
    ConditionalWritesUnsupported,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
    Versioned,
    from_url,
)

__all__ = [
    "ConditionalWritesUnsupported",
    "ListingUnsupported",
    "ObjectInfo",
    "ObjectNotFound",
    "PreconditionFailed",
    "ReadOnlyStorage",
    "Storage",
    "StorageError",
    "TransientStorageError",
    "Versioned",
    "from_url",
]

"""Shipping a session's fork to worker processes (Spark executors, Dask workers) and back.

A fork travels as bytes and every task loads its own copy: a retried or speculative attempt of a
task never sees another attempt's writes, and the engine keeps the changeset of exactly the
attempt it reports. What comes back is :meth:`ForkedSession.changeset`, for
:meth:`Session.merge`.

A Python worker runs many tasks one after another. Loading a fork builds its storage client (for
S3 a botocore client, ~0.2 s) and starts with empty caches, so tasks in one process share one
:class:`ObjectStore` per storage location: its client, connection pool and caches of immutable
objects (snapshots, shards). Only the ObjectStore is shared; every task has its own fork and
changeset. The sharing happens in pickle itself: :func:`dump_fork` reduces each ObjectStore to a
call of :func:`shared_object_store` with its storage (pickled), which in a worker returns that
process's ObjectStore for the storage. A storage that is not shared across processes (memory)
pickles its contents: its copies are distinct stores and are never shared.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from zarrlake.errors import InvalidArgument
from zarrlake.format.ids import LEGACY_CONTENT_HASH
from zarrlake.objects import ObjectStore
from zarrlake.session import ForkedSession

__all__ = ["dump_fork", "load_fork", "shared_instance", "shared_object_store"]

_V = TypeVar("_V")

_SHARED_MAX = 8
_shared: OrderedDict[bytes, Any] = OrderedDict()
_shared_lock = threading.Lock()


def shared_instance(key: bytes, make: Callable[[], _V]) -> _V:
    """This process's value for ``key``, made by ``make()`` the first time (a small LRU)."""
    with _shared_lock:
        if key in _shared:
            _shared.move_to_end(key)
            return _shared[key]  # type: ignore[no-any-return]
        value = _shared[key] = make()
        while len(_shared) > _SHARED_MAX:
            _shared.popitem(last=False)
        return value


def shared_object_store(
    storage_bytes: bytes,
    content_hash: str = LEGACY_CONTENT_HASH,
    verify_reads: bool = True,
    sources_bytes: bytes = b"",
) -> ObjectStore:
    """This process's ObjectStore for the pickled storage, the repository's content hash, the
    reads' verification and its virtual chunk sources (containers and credentials, pickled;
    empty: none) — what a pickled fork's store becomes. Forks of repositories that differ in
    any of them get stores of their own."""
    key = b":".join(
        (b"objects", content_hash.encode(), b"%d" % verify_reads, storage_bytes, sources_bytes)
    )

    def make() -> ObjectStore:
        sources = pickle.loads(sources_bytes) if sources_bytes else None
        return ObjectStore(
            pickle.loads(storage_bytes), content_hash, verify_reads=verify_reads, sources=sources
        )

    return shared_instance(key, make)


class _ForkPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, ObjectStore) and obj.storage.shared_across_processes:
            storage_bytes = pickle.dumps(obj.storage, protocol=pickle.HIGHEST_PROTOCOL)
            # A repository's virtual containers travel with its store: a fork sets and reads
            # virtual refs as its session does.
            sources = b""
            if obj.sources:
                sources = pickle.dumps(obj.sources, protocol=pickle.HIGHEST_PROTOCOL)
            return shared_object_store, (
                storage_bytes,
                obj.content_hash,
                obj.verify_reads,
                sources,
            )
        return NotImplemented


def dump_fork(fork: ForkedSession) -> bytes:
    """``fork`` as bytes for the workers (load each task's copy with :func:`load_fork`)."""
    if not isinstance(fork, ForkedSession):
        raise InvalidArgument(f"expected a ForkedSession, got {type(fork).__name__}")
    buffer = io.BytesIO()
    _ForkPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(fork)
    return buffer.getvalue()


def load_fork(data: bytes) -> ForkedSession:
    """A fresh copy of the fork :func:`dump_fork` gave as ``data``."""
    fork = pickle.loads(data)
    if not isinstance(fork, ForkedSession):
        raise InvalidArgument(f"expected a pickled ForkedSession, got {type(fork).__name__}")
    return fork

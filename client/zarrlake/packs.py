"""Small chunks written into pack objects as a session writes them, instead of an object each.

A session that writes many small chunks would otherwise make one storage request (one file, one
S3 PUT) per chunk: the request, not the bytes, is the cost. A :class:`PackWriter` appends each
small chunk to an open buffer and hands back its final ``PACKED`` ref at once: the buffer's pack
id is chosen when it opens, 256 random bits in hex (unique, and shaped like the content hashes
that name compaction's packs, so every reader of the layout takes it for a pack), rather than a
hash of the whole pack, which is known only once it is full. A
buffer that reaches :data:`PACK_WRITE_TARGET` bytes is sealed and uploaded on the storage's I/O
pool while the session goes on writing; at most :data:`UPLOADS_IN_FLIGHT` uploads run at once,
after which a writer waits for the oldest (memory stays bounded).

Until its pack is uploaded, a chunk is read from this process's memory (the
:class:`~zarrlake.objects.ObjectStore` asks the writer first), so a session reads its own writes.
:meth:`PackWriter.flush` uploads what is left and waits for every upload; sessions call it before
anything leaves the process that names these packs: a fork, a fork's changeset, a commit's journal
entry (a commit :meth:`PackWriter.send`-s the last pack first and writes its snapshot meanwhile:
nothing reaches a snapshot until an entry names it). A pack
whose upload failed stays in memory and is tried again by the next flush; nothing publishes a ref
to it until it is written.

Each ref keeps its chunk's digest (the identity of its bytes, as for packs made by compaction), so
conflict checks and ``fsck`` see the chunk, not where it lies.
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import Future
from typing import Any

from zarrlake.format.model import PACKED, ChunkRef, pack_key
from zarrlake.objects import ObjectStore
from zarrlake.storage.base import on_io_pool

#: A pack being filled is sealed and uploaded once it holds this many bytes. 1 MiB: a PUT carries
#: a thousand 1 KiB chunks, and a ranged GET of one chunk costs what a GET of a small object does
#: (on SeaweedFS a range of a 4 MiB object took twice as long; bench/ranged_get.py).
PACK_WRITE_TARGET = 1024 * 1024
#: Sealed packs uploading at once; a writer past this waits for the oldest.
UPLOADS_IN_FLIGHT = 4


class PackWriter:
    """The small-chunk packs of one session (or fork). Thread-safe."""

    def __init__(
        self,
        objects: ObjectStore,
        *,
        target: int = PACK_WRITE_TARGET,
        in_flight: int = UPLOADS_IN_FLIGHT,
    ) -> None:
        self._objects = objects
        self._target = target
        self._in_flight = in_flight
        self._lock = threading.Lock()
        self._open_id: str | None = None
        self._open = bytearray()
        #: Packs sealed and not yet known to be written: id -> (bytes, their upload, None while
        #: it is being started).
        self._sealed: dict[str, tuple[bytes, Future[None] | None]] = {}

    # -- writes ----------------------------------------------------------------------------------

    def add(self, data: bytes | memoryview) -> tuple[ChunkRef, Future[None] | None]:
        """Append ``data`` to the open pack: its ref, and an upload to wait for before writing
        more. That is None unless :data:`UPLOADS_IN_FLIGHT` are running, or an upload failed:
        then it is that upload made again, and waiting on it raises if it fails again. A thread
        of the storage's I/O pool is never asked to wait (its uploads run in place)."""
        digest = bytes.fromhex(self._objects.hash_data(data))
        with self._lock:
            if self._open_id is None:
                self._open_id = secrets.token_hex(32)
                self._objects.stage_pack(self._open_id, self)
            offset = len(self._open)
            self._open += data
            ref = (PACKED, self._open_id, offset, len(data), digest)
            if len(self._open) < self._target:
                return ref, None
            sealed = self._seal()
        self._start(*sealed)
        return ref, self._backlog()

    def _seal(self) -> tuple[str, bytes]:
        """Close the open pack (with ``_lock`` held); :meth:`_start` its upload after."""
        assert self._open_id is not None
        pack_id, data = self._open_id, bytes(self._open)
        self._open_id, self._open = None, bytearray()
        self._sealed[pack_id] = (data, None)
        return pack_id, data

    def _start(self, pack_id: str, data: bytes) -> Future[None]:
        """Upload a sealed pack on the I/O pool (without ``_lock``: from a pool thread the upload
        runs right here, and takes the lock when it is done)."""
        upload = self._objects.storage.submit(self._upload, pack_id, data)
        with self._lock:
            if pack_id in self._sealed:  # (not written already)
                self._sealed[pack_id] = (data, upload)
        return upload

    def _upload(self, pack_id: str, data: bytes) -> None:
        self._objects.storage.put(pack_key(pack_id), data)
        with self._lock:
            self._sealed.pop(pack_id, None)
        self._objects.unstage_pack(pack_id, self)

    def _backlog(self) -> Future[None] | None:
        if on_io_pool():
            return None  # waiting on the pool from inside it could wait forever
        running: list[tuple[str, bytes, Future[None]]] = []
        with self._lock:
            for pack_id, (data, upload) in self._sealed.items():
                if upload is None:
                    continue
                if not upload.done():
                    running.append((pack_id, data, upload))
                elif upload.exception() is not None:
                    failed = (pack_id, data)
                    break
            else:
                failed = None
        if failed is not None:
            return self._start(*failed)  # once more: the storage may be back
        if len(running) <= self._in_flight:
            return None
        return self._retried(*running[0])

    def _retried(self, pack_id: str, data: bytes, upload: Future[None]) -> Future[None]:
        """``upload``, made once more if it fails: a future of the two attempts."""
        out: Future[None] = Future()

        def settle(attempt: Future[None]) -> None:
            error = attempt.exception()
            if error is None:
                out.set_result(None)
            else:
                out.set_exception(error)

        def first(attempt: Future[None]) -> None:
            if attempt.exception() is None:
                out.set_result(None)
            else:  # (in the failed upload's pool thread: the second attempt runs right here)
                self._start(pack_id, data).add_done_callback(settle)

        upload.add_done_callback(first)
        return out

    def send(self) -> None:
        """Seal the open pack and start its upload, without waiting: a commit sends the last
        pack, then builds and writes its snapshot while the pack travels, and :meth:`flush`-es
        before the journal entry that publishes it."""
        with self._lock:
            tail = self._seal() if self._open else None
        if tail is not None:
            self._start(*tail)

    def flush(self) -> None:
        """Upload the open pack, wait for every upload, and write again any that failed (in this
        thread). Raises the storage's error if one still fails: it stays in memory for the next
        flush, and no ref to it may leave the process."""
        self.send()
        with self._lock:
            sealed = list(self._sealed.items())
        for pack_id, (data, upload) in sealed:
            if upload is not None:
                try:
                    upload.result()
                    continue
                except Exception:
                    pass
            self._upload(pack_id, data)  # (unique name: writing it twice is harmless)

    @property
    def pending(self) -> bool:
        """Whether some chunk written here is not yet known to be in storage."""
        with self._lock:
            return bool(self._open or self._sealed)

    # -- reads -----------------------------------------------------------------------------------

    def read(self, pack_id: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of a pack of this writer still in memory; None once it is
        written (read it from storage then)."""
        with self._lock:
            if pack_id == self._open_id:
                return bytes(self._open[start:end])
            sealed = self._sealed.get(pack_id)
        return None if sealed is None else sealed[0][start:end]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a PackWriter holds unwritten chunks of this process: flush, not pickle")

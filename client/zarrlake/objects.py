"""Reading and writing the repository's objects through a storage backend, with caches.

Snapshots, shards and txlogs are immutable, so they are cached freely by id or digest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from zarrlake.errors import CorruptObject, RefNotFound, RetryableError
from zarrlake.format.ids import content_hash
from zarrlake.format.manifest import ManifestUpdate
from zarrlake.format.model import (
    INLINE,
    OBJECT,
    PACKED,
    ChunkRef,
    HistoryPage,
    ManifestShard,
    ShardInfo,
    Snapshot,
    TxLog,
    chunk_key,
    history_page_key,
    manifest_key,
    pack_key,
    snapshot_key,
    txlog_key,
)
from zarrlake.storage.base import ObjectNotFound, PreconditionFailed, Storage

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)

    def discard(self, key: K) -> None:
        with self._lock:
            self._data.pop(key, None)


@dataclass(frozen=True, slots=True)
class CommitObjects:
    """What one commit writes before its journal entry: the snapshot (and its encoding, which
    the entry carries too), the transaction log, and the manifest shards it cut."""

    snapshot: Snapshot
    encoded: bytes
    txlog: TxLog | None
    manifest: ManifestUpdate
    # A history page the commit sealed: (digest, encoded page).
    history_page: tuple[str, bytes] | None = None


class ObjectStore:
    """Typed access to a repository's objects. Picklable (caches are not carried along)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._init_caches()

    def _init_caches(self) -> None:
        self._snapshots: LRU[str, Snapshot] = LRU(512)
        self._shards: LRU[str, ManifestShard] = LRU(256)
        self._txlogs: LRU[str, TxLog] = LRU(512)
        self._pages: LRU[str, HistoryPage] = LRU(1024)

    def __getstate__(self) -> dict[str, Any]:
        return {"storage": self.storage}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage = state["storage"]
        self._init_caches()

    # -- immutable metadata ---------------------------------------------------------------------

    def _cached(
        self, cache: LRU[str, V], key: str, ident: str, parse: Callable[[bytes, str], V], kind: str
    ) -> V:
        value = cache.get(ident)
        if value is None:
            try:
                data = self.storage.get(key)
            except ObjectNotFound:
                raise RefNotFound(ident, kind) from None
            value = parse(data, key)
            cache.put(ident, value)
        return value

    def snapshot(self, snapshot_id: str) -> Snapshot:
        snap = self._cached(
            self._snapshots, snapshot_key(snapshot_id), snapshot_id, Snapshot.decode, "snapshot"
        )
        if snap.id != snapshot_id:
            raise CorruptObject(snapshot_key(snapshot_id), f"holds snapshot {snap.id}")
        return snap

    def adopt_snapshot(self, snapshot_id: str, data: bytes) -> None:
        """Cache snapshot ``snapshot_id`` from ``data``, its encoded object as a branch's journal
        entry carries it. Raises :class:`CorruptObject` if ``data`` holds another snapshot."""
        if self._snapshots.get(snapshot_id) is not None:
            return
        key = snapshot_key(snapshot_id)
        snap = Snapshot.decode(data, key)
        if snap.id != snapshot_id:
            raise CorruptObject(key, f"the journal entry carries snapshot {snap.id}")
        self._snapshots.put(snapshot_id, snap)

    def is_cached(self, snapshot_id: str) -> bool:
        return self._snapshots.get(snapshot_id) is not None

    def snapshots(self, ids: Iterable[str]) -> list[Snapshot]:
        """Fetch many snapshots concurrently (history walks)."""
        return self.storage.map(self.snapshot, list(ids))

    def shard(self, info: ShardInfo) -> ManifestShard:
        def parse(data: bytes, key: str) -> ManifestShard:
            if content_hash(data) != info.digest:
                raise CorruptObject(key, "content does not match its digest")
            return ManifestShard.decode(data, key)

        try:
            return self._cached(
                self._shards, manifest_key(info.digest), info.digest, parse, "manifest"
            )
        except RefNotFound:
            raise CorruptObject(manifest_key(info.digest), "missing manifest shard") from None

    def history_page(self, digest: str) -> HistoryPage:
        """The history page ``digest``, its content checked against its name. Raises
        :class:`RefNotFound` if it is absent, :class:`CorruptObject` if it does not match."""

        def parse(data: bytes, key: str) -> HistoryPage:
            if content_hash(data) != digest:
                raise CorruptObject(key, "content does not match its digest")
            return HistoryPage.decode(data, key)

        return self._cached(self._pages, history_page_key(digest), digest, parse, "history page")

    def forget(self, snapshot_id: str) -> None:
        """Drop a snapshot and its txlog from the caches (garbage collection deleted them)."""
        self._snapshots.discard(snapshot_id)
        self._txlogs.discard(snapshot_id)

    def txlog(self, snapshot_id: str) -> TxLog:
        return self._cached(
            self._txlogs, txlog_key(snapshot_id), snapshot_id, TxLog.decode, "txlog"
        )

    def txlogs(self, snapshot_ids: Iterable[str]) -> list[TxLog]:
        """Fetch many txlogs concurrently (a rebase over many commits). Raises
        :class:`RefNotFound` if one is missing."""
        return self.storage.map(self.txlog, list(snapshot_ids))

    def put_commit(self, commit: CommitObjects, *, read: str | None = None) -> bytes | None:
        """Write a commit's objects in one concurrent round, and keep them in the caches.

        The snapshot need not wait for its shards and txlog: nothing is reachable until a journal
        entry names it, and that entry is written only after this returns. A writer that dies
        midway leaves unreachable objects, which garbage collection removes. ``read``: a key to
        read in the same round (the committer's check of the head it builds on); returns its
        bytes, or None if absent (None too without ``read``).
        """
        snap, txlog = commit.snapshot, commit.txlog
        writes: list[tuple[str, bytes, bool]] = [
            (manifest_key(d), b, False) for d, b in commit.manifest.new_shards.items()
        ]
        if txlog is not None:
            writes.append((txlog_key(snap.id), txlog.encode(), False))
        if commit.history_page is not None:
            digest, page = commit.history_page
            writes.append((history_page_key(digest), page, False))
        writes.append((snapshot_key(snap.id), commit.encoded, True))

        def step(i: int) -> bytes | None:
            if i == len(writes):
                assert read is not None
                try:
                    return self.storage.get(read)
                except ObjectNotFound:
                    return None
            key, data, create_only = writes[i]
            self.storage.put(key, data, create_only=create_only)
            return None

        found = self.storage.map(step, range(len(writes) + (read is not None)))
        self._snapshots.put(snap.id, snap)
        if txlog is not None:
            self._txlogs.put(snap.id, txlog)
        # The next commit on the branch usually rewrites one of these shards: keep them decoded.
        for digest, shard in commit.manifest.built.items():
            self._shards.put(digest, shard)
        return found[-1] if read is not None else None

    # -- chunks ------------------------------------------------------------------------------------

    def write_chunk(self, data: bytes | memoryview, inline_threshold: int) -> tuple[ChunkRef, bool]:
        """Store chunk bytes; returns (ref, dedup_hit).

        Content-addressed: the create-only write tells whether the object already existed. If it
        did, it is rewritten anyway so its modification time is fresh — garbage collection spares
        young objects, and an old unreachable one may be about to go.
        """
        if len(data) <= inline_threshold:
            return (INLINE, bytes(data)), False
        digest = content_hash(data)
        key = chunk_key(digest)
        try:
            self.storage.put(key, data, create_only=True)
            hit = False
        except PreconditionFailed:
            self.storage.put(key, data)
            hit = True
        return (OBJECT, bytes.fromhex(digest), len(data)), hit

    def read_chunk(self, ref: ChunkRef, byte_range: tuple[int, int] | None = None) -> bytes:
        """The chunk's bytes (or ``[start, end)`` of them, offsets relative to the chunk)."""
        kind = ref[0]
        if kind == INLINE:
            data: bytes = ref[1]
            return data if byte_range is None else data[byte_range[0] : byte_range[1]]
        if kind == OBJECT:
            key = chunk_key(ref[1].hex())
            try:
                return self.storage.get(key, byte_range)
            except ObjectNotFound:
                raise CorruptObject(key, "chunk object is missing") from None
        if kind == PACKED:
            pack_id, offset, length = ref[1], ref[2], ref[3]
            start, end = (0, length) if byte_range is None else byte_range
            end = min(end, length)
            key = pack_key(pack_id)
            if end <= start:
                return b""
            try:
                return self.storage.get(key, (offset + start, offset + end))
            except ObjectNotFound:
                raise CorruptObject(key, "pack object is missing") from None
        raise CorruptObject("<chunk ref>", f"unknown chunk ref kind {kind!r}")

    def check_chunks_exist(self, digests: Iterable[bytes]) -> None:
        """Raise :class:`RetryableError` if a deduplicated chunk vanished (collected by GC)."""
        digests = list(digests)
        present: list[bool] = self.storage.map(
            lambda d: self.storage.exists(chunk_key(d.hex())), digests
        )
        missing = [d for d, ok in zip(digests, present, strict=True) if not ok]
        if missing:
            raise RetryableError(
                f"{len(missing)} deduplicated chunk(s) were garbage-collected during the session "
                f"(first: {chunk_key(missing[0].hex())}); rewrite them and commit again"
            )

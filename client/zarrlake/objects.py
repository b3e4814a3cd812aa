"""Reading and writing the repository's objects through a storage backend, with caches.

Snapshots, shards and txlogs are immutable, so they are cached freely by id or digest.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from zarrlake.errors import CorruptChunk, CorruptObject, RefNotFound, RetryableError
from zarrlake.format.ids import (
    CONTENT_DIGESTS,
    LEGACY_CONTENT_HASH,
    ContentHash,
    content_hash,
    content_hasher,
)
from zarrlake.format.manifest import ManifestUpdate
from zarrlake.format.model import (
    INLINE,
    OBJECT,
    PACKED,
    VIRTUAL,
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
    ref_size,
    snapshot_key,
    txlog_key,
)
from zarrlake.readahead import PackReadAhead, Window
from zarrlake.sources import SourceRange, VirtualSources
from zarrlake.storage.base import ObjectNotFound, PreconditionFailed, Storage

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")


class StagedPacks(Protocol):
    """Packs a session has written into memory and not yet into storage (see
    :class:`zarrlake.packs.PackWriter`)."""

    def read(self, pack_id: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the pack, or None once it is in storage."""
        ...


#: :attr:`ObjectStore._origin` of a snapshot adopted from a journal entry's copy, and of one
#: read from storage unchecked.
CARRIED, STORED = "carried", "stored"


class LRU(Generic[K, V]):
    """A bounded, thread-safe cache whose loads are single-flight: of threads missing the same
    key at once, one loads it and the others wait for its value (N readers of one manifest
    shard fetch it once)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[K, threading.Event] = {}

    def get_or_load(self, key: K, load: Callable[[], V]) -> V:
        """The cached value, or ``load()``'s (cached). Errors of a load reach its own caller;
        a thread that waited on a failed load tries it again itself."""
        while True:
            with self._lock:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                    return value
                loading = self._loading.get(key)
                if loading is None:
                    done = self._loading[key] = threading.Event()
            if loading is None:
                break
            loading.wait()
        try:
            value = load()
            self.put(key, value)
            return value
        finally:
            with self._lock:
                del self._loading[key]
            done.set()

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

    def items(self) -> list[tuple[K, V]]:
        with self._lock:
            return list(self._data.items())


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
    """Typed access to a repository's objects. Picklable (caches are not carried along).

    ``content_hash``: the name of the hash that names chunk and pack objects, as the repository's
    marker records it (required: a default would silently name chunks by the wrong hash). An
    unknown name (a newer version's) still reads; hashing raises :class:`UnsupportedFormat`.

    ``verify_reads``: every whole chunk read from an object or a pack is hashed and compared
    with the digest its ref records; a mismatch raises :class:`CorruptChunk` and the bytes are
    never returned. Inline chunks live in their manifest shard, whose own digest is checked
    when it is read. A read of part of a chunk (Zarr's sharding codec reads byte ranges) cannot
    be checked without the rest of it and is not.

    ``sources``: how virtual chunks are read (:mod:`zarrlake.sources`): the repository's
    containers and the reader's credentials for them. Without, every virtual chunk read raises
    :class:`VirtualContainerNotAllowed`. Virtual chunks carry no digest: what makes their reads
    safe is the check of the source's version their refs pin.
    """

    def __init__(
        self,
        storage: Storage,
        content_hash: str,
        *,
        verify_reads: bool = True,
        sources: VirtualSources | None = None,
    ) -> None:
        self.storage = storage
        self.content_hash = content_hash
        self.verify_reads = verify_reads
        self.sources = sources if sources is not None else VirtualSources(())
        self._init_caches()

    def _init_caches(self) -> None:
        #: What verified reads hash with (None: a hash this version does not know).
        self._digest = CONTENT_DIGESTS.get(self.content_hash)
        #: Pack writers of this process's sessions, by the id of a pack they hold unwritten.
        self._staged: weakref.WeakValueDictionary[str, StagedPacks] = weakref.WeakValueDictionary()
        self._snapshots: LRU[str, Snapshot] = LRU(512)
        #: Snapshot id -> the SHA-256 its branch's journal entry vouches for (snapshots too
        #: large for the entry to carry): a read of ``snapshots/<id>`` must match it.
        self._vouched: LRU[str, str] = LRU(4096)
        #: Where each cached snapshot came from: CARRIED (a journal entry's copy, trusted as
        #: the entry is), the SHA-256 it was checked against, or STORED (read from storage,
        #: unchecked), so that a vouch or a carried copy learned later replaces a copy read
        #: before it, unchecked.
        self._origin: LRU[str, str] = LRU(4096)
        self._shards: LRU[str, ManifestShard] = LRU(256)
        self._txlogs: LRU[str, TxLog] = LRU(512)
        self._pages: LRU[str, HistoryPage] = LRU(1024)
        #: The history pages this client sealed last, as written (what the published root
        #: carries for ``main``: :meth:`written_page`).
        self._written: LRU[str, bytes] = LRU(4)
        #: Windows read ahead in packs, where a request costs far more than its bytes (not on
        #: local files or memory, whose small reads run in place: see ``inline_read_bytes``).
        self._ahead = None if self.storage.inline_read_bytes else PackReadAhead()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "storage": self.storage,
            "content_hash": self.content_hash,
            "verify_reads": self.verify_reads,
            "sources": self.sources,
            # What the entries vouch for travels along (a dask worker's reads are checked
            # too); the cached snapshots themselves do not.
            "vouched": self._vouched.items(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.storage = state["storage"]
        self.sources = state.get("sources") or VirtualSources(())
        # Pickles from before the hash was a setting carry none: they were SHA-256.
        self.content_hash = state.get("content_hash", LEGACY_CONTENT_HASH)
        self.verify_reads = state.get("verify_reads", True)
        self._init_caches()
        for snapshot_id, sha256 in state.get("vouched") or ():
            self._vouched.put(snapshot_id, sha256)

    def stage_pack(self, pack_id: str, writer: StagedPacks) -> None:
        """Serve reads of pack ``pack_id`` from ``writer`` until :meth:`unstage_pack` (it is not
        written yet). Held weakly: a writer dropped with its session stops serving."""
        self._staged[pack_id] = writer

    def unstage_pack(self, pack_id: str, writer: StagedPacks) -> None:
        """Read pack ``pack_id`` from storage again (``writer`` has written it)."""
        if self._staged.get(pack_id) is writer:
            del self._staged[pack_id]

    def _staged_read(self, read: tuple[str, int, int], pack_id: str) -> bytes | None:
        writer = self._staged.get(pack_id)
        return None if writer is None else writer.read(pack_id, read[1], read[2])

    def hash_data(self, data: bytes | memoryview) -> str:
        """The name (hex digest) of chunk or pack bytes ``data`` in this repository.

        Raises :class:`UnsupportedFormat` if the repository's hash is unknown to this version.
        """
        hasher: ContentHash = content_hasher(self.content_hash)
        return hasher(data)

    # -- immutable metadata ---------------------------------------------------------------------

    def _cached(
        self,
        cache: LRU[str, V],
        key: str,
        ident: str,
        parse: Callable[[bytes, str], V],
        kind: str,
        keep: bool = True,
    ) -> V:
        value = cache.get(ident)
        if value is not None:
            return value

        def load() -> V:
            try:
                data = self.storage.get(key)
            except ObjectNotFound:
                raise RefNotFound(ident, kind) from None
            return parse(data, key)

        if not keep:
            return load()
        return cache.get_or_load(ident, load)

    def snapshot(self, snapshot_id: str) -> Snapshot:
        snap = self._cached(
            self._snapshots,
            snapshot_key(snapshot_id),
            snapshot_id,
            partial(self._decode_snapshot, snapshot_id),
            "snapshot",
        )
        if snap.id != snapshot_id:
            raise CorruptObject(snapshot_key(snapshot_id), f"holds snapshot {snap.id}")
        return snap

    def _decode_snapshot(self, snapshot_id: str, data: bytes, key: str) -> Snapshot:
        vouched = self._vouched.get(snapshot_id)
        origin = STORED
        if vouched is not None:
            # Hashed only where an entry vouches (a read of any other snapshot costs nothing
            # more than it did).
            origin = hashlib.sha256(data).hexdigest()
            if origin != vouched:
                raise CorruptObject(
                    key,
                    "holds other bytes than its branch's journal entry vouches for: it was "
                    "overwritten after it was published",
                )
        snap = Snapshot.decode(data, key)
        self._origin.put(snapshot_id, origin)
        return snap

    def vouch_snapshot(self, snapshot_id: str, sha256: str) -> None:
        """From now on a read of snapshot ``snapshot_id`` must give bytes of digest ``sha256``
        (its journal entry's ``snapshot_sha256``) or raise :class:`CorruptObject`; a copy read
        before unchecked, or against another digest, is dropped (the next read checks)."""
        self._vouched.put(snapshot_id, sha256)
        origin = self._origin.get(snapshot_id)
        if origin != sha256 and origin != CARRIED:
            self._snapshots.discard(snapshot_id)

    def adopt_snapshot(self, snapshot_id: str, data: bytes) -> None:
        """Cache snapshot ``snapshot_id`` from ``data``, its encoded object as a branch's journal
        entry carries it (in place of a copy read from storage before: the entry's is the one
        readers of the branch are shown). Raises :class:`CorruptObject` if ``data`` holds
        another snapshot."""
        if (
            self._snapshots.get(snapshot_id) is not None
            and self._origin.get(snapshot_id) == CARRIED
        ):
            return
        key = snapshot_key(snapshot_id)
        snap = Snapshot.decode(data, key)
        if snap.id != snapshot_id:
            raise CorruptObject(key, f"the journal entry carries snapshot {snap.id}")
        self._snapshots.put(snapshot_id, snap)
        self._origin.put(snapshot_id, CARRIED)

    def stored_snapshot_bytes(self, snapshot_id: str) -> bytes:
        """Snapshot ``snapshot_id``'s object as stored (checked against its entry's vouch, if
        any): what an entry that carries it must carry, not a re-encoding of it. Raises
        :class:`RefNotFound`, :class:`CorruptObject`."""
        key = snapshot_key(snapshot_id)
        try:
            data = self.storage.get(key)
        except ObjectNotFound:
            raise RefNotFound(snapshot_id, "snapshot") from None
        vouched = self._vouched.get(snapshot_id)
        if vouched is not None and hashlib.sha256(data).hexdigest() != vouched:
            raise CorruptObject(
                key, "holds other bytes than its branch's journal entry vouches for"
            )
        return data

    def cached_snapshot(self, snapshot_id: str) -> Snapshot | None:
        """The snapshot if it is in the cache (no I/O), else None."""
        return self._snapshots.get(snapshot_id)

    def is_cached(self, snapshot_id: str) -> bool:
        return self._snapshots.get(snapshot_id) is not None

    def snapshots(self, ids: Iterable[str]) -> list[Snapshot]:
        """Fetch many snapshots concurrently (history walks)."""
        return self.storage.map(self.snapshot, list(ids))

    def shard(self, info: ShardInfo, *, cache: bool = True) -> ManifestShard:
        """Manifest shard ``info`` (from the cache if there; kept there unless ``cache`` is
        false: a pass over every shard, such as GC's mark, would evict what readers use).
        Raises :class:`CorruptObject` if it is missing or does not match its digest."""

        def parse(data: bytes, key: str) -> ManifestShard:
            if content_hash(data) != info.digest:
                raise CorruptObject(key, "content does not match its digest")
            return ManifestShard.decode(data, key)

        try:
            return self._cached(
                self._shards, manifest_key(info.digest), info.digest, parse, "manifest", cache
            )
        except RefNotFound:
            raise CorruptObject(manifest_key(info.digest), "missing manifest shard") from None

    def cached_shard(self, info: ShardInfo) -> ManifestShard | None:
        """The shard if it is in the cache (no I/O), else None."""
        return self._shards.get(info.digest)

    def history_page(self, digest: str) -> HistoryPage:
        """The history page ``digest``, its content checked against its name. Raises
        :class:`RefNotFound` if it is absent, :class:`CorruptObject` if it does not match."""

        def parse(data: bytes, key: str) -> HistoryPage:
            if content_hash(data) != digest:
                raise CorruptObject(key, "content does not match its digest")
            return HistoryPage.decode(data, key)

        return self._cached(self._pages, history_page_key(digest), digest, parse, "history page")

    def written_page(self, digest: str) -> bytes | None:
        """The bytes of history page ``digest`` if this client sealed it lately (no I/O)."""
        return self._written.get(digest)

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

    def put_shards(self, shards: dict[str, bytes]) -> None:
        """Write encoded manifest shards (digest -> bytes) concurrently; not cached."""
        items = list(shards.items())
        self.storage.map(lambda item: self.storage.put(manifest_key(item[0]), item[1]), items)

    def put_commit(self, commit: CommitObjects, *, read: str | None = None) -> bytes | None:
        """Write a commit's objects in one concurrent round (one after another where a round of
        small writes costs less so: :meth:`Storage.map_writes`), and keep them in the caches.

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
            self._written.put(digest, page)
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

        nbytes = sum(len(data) for _, data, _ in writes)
        found = self.storage.map_writes(step, range(len(writes) + (read is not None)), nbytes)
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
        digest = self.hash_data(data)
        key = chunk_key(digest)
        try:
            self.storage.put(key, data, create_only=True)
            hit = False
        except PreconditionFailed:
            self.storage.put(key, data)
            hit = True
        return (OBJECT, bytes.fromhex(digest), len(data)), hit

    async def write_chunk_async(self, data: bytes | memoryview) -> tuple[ChunkRef, bool]:
        """:meth:`write_chunk` of an object chunk (above the inline threshold), from an event
        loop: the hash runs right here (callers keep this to small chunks, whose hash takes
        microseconds), the writes are the storage's :meth:`~Storage.put_async`."""
        digest = self.hash_data(data)
        key = chunk_key(digest)
        try:
            await self.storage.put_async(key, data, create_only=True)
            hit = False
        except PreconditionFailed:
            await self.storage.put_async(key, data)
            hit = True
        return (OBJECT, bytes.fromhex(digest), len(data)), hit

    def verified(self, ref: ChunkRef, byte_range: tuple[int, int] | None, data: bytes) -> bytes:
        """``data``, read for ``byte_range`` of the chunk of ``ref``, once it is known to be the
        chunk's bytes: a whole chunk of an object or a pack is hashed and checked against the
        digest in its ref (with :attr:`verify_reads` on). Raises :class:`CorruptChunk`."""
        if not self.verify_reads or ref[0] == INLINE:
            return data
        if byte_range is not None and (byte_range[0] > 0 or byte_range[1] < ref_size(ref)):
            return data  # part of a chunk: nothing to compare it with
        if ref[0] == OBJECT:
            expected: bytes = ref[1]
        elif ref[0] == PACKED and len(ref) > 4:
            expected = ref[4]
        else:
            return data
        digest = self._digest
        if digest is None:  # a newer zarrlake's hash: it still reads, as the marker promises
            _warn_unverified(self.content_hash)
            return data
        actual = digest(data)
        if actual != expected:
            key = chunk_key(expected.hex()) if ref[0] == OBJECT else pack_key(ref[1])
            raise CorruptChunk(key, expected.hex(), actual.hex(), self.content_hash)
        return data

    def read_chunk(self, ref: ChunkRef, byte_range: tuple[int, int] | None = None) -> bytes:
        """The chunk's bytes (or ``[start, end)`` of them, offsets relative to the chunk),
        checked as :meth:`verified` says.

        Raises :class:`CorruptObject` if the chunk's object is missing or a pack is shorter than
        its refs say, :class:`CorruptChunk` if its bytes are not the chunk's."""
        return self.verified(ref, byte_range, self._read_chunk(ref, byte_range))

    def _read_chunk(self, ref: ChunkRef, byte_range: tuple[int, int] | None) -> bytes:
        kind = ref[0]
        if kind == INLINE:
            data: bytes = ref[1]
            return data if byte_range is None else data[byte_range[0] : byte_range[1]]
        if kind == OBJECT:
            key = chunk_key(ref[1].hex())
            with _missing_is_corrupt(key, "chunk object"):
                got = self.storage.get(key, byte_range)
            return _whole(key, got, ref, byte_range)
        if kind == PACKED:
            read = _packed_read(ref, byte_range)
            if read is None:
                return b""
            if self._staged and (staged := self._staged_read(read, ref[1])) is not None:
                return staged
            # A window already fetching or fetched serves it; one it would have to fetch itself
            # does not (a single read fetches just its chunk).
            ahead = self._ahead
            if ahead is not None and (window := ahead.lookup(*read, started=True)) is not None:
                return _via_window(self.storage, window, [(0, read[1], read[2])])[0]
            return _fetch_range(self.storage, *read)
        if kind == VIRTUAL:
            return self.sources.read(ref, byte_range)
        raise CorruptObject("<chunk ref>", f"unknown chunk ref kind {kind!r}")

    async def read_object_async(self, ref: ChunkRef) -> bytes:
        """The whole chunk of an object ref, from an event loop (the storage's
        :meth:`~Storage.get_async`). Raises as :meth:`read_chunk`."""
        key = chunk_key(ref[1].hex())
        with _missing_is_corrupt(key, "chunk object"):
            got = await self.storage.get_async(key)
        return self.verified(ref, None, _whole(key, got, ref, None))

    def plan_reads(self, reads: Sequence[tuple[ChunkRef, tuple[int, int] | None]]) -> list[ReadJob]:
        """The requests that read many chunks (``(ref, byte range or None)`` each, as
        :meth:`read_chunk`): ranges of one pack that lie close together share one ranged
        request (see :func:`coalesce`), and reads inside a window read ahead in a pack (see
        :mod:`zarrlake.readahead`) take their bytes from it; every other read is a job of its
        own. Each read is served by exactly one job; duplicates, overlaps and any order are
        fine. A job marked ``ready`` makes no request. Every job's bytes are checked as
        :meth:`verified` says."""
        jobs: list[ReadJob] = []
        wanted: list[tuple[str, int, int]] = []
        where: list[int] = []
        joined: dict[Window, list[tuple[int, int, int]]] = {}
        ahead = self._ahead
        # Virtual chunks: ranges of one source (pinned alike) coalesce as a pack's do.
        sourced: list[tuple[str, int, int]] = []
        sourced_at: list[int] = []
        pins: dict[str, tuple[str, str | None, int | None]] = {}
        for i, (ref, byte_range) in enumerate(reads):
            if ref[0] == VIRTUAL:
                _, url, offset, length, etag, modified = ref
                start, end = (0, length) if byte_range is None else byte_range
                end = min(end, length)
                if end <= start:
                    jobs.append(ReadJob((i,), partial(_one, self, ref, byte_range), True))
                    continue
                name = f"{url}\0{etag}\0{modified}"
                pins[name] = (url, etag, modified)
                sourced.append((name, offset + start, offset + end))
                sourced_at.append(i)
                continue
            read = _packed_read(ref, byte_range) if ref[0] == PACKED else None
            if read is None or (self._staged and ref[1] in self._staged):
                jobs.append(ReadJob((i,), partial(_one, self, ref, byte_range)))
            elif ahead is not None and (window := ahead.lookup(*read)) is not None:
                joined.setdefault(window, []).append((i, read[1], read[2]))
            else:
                wanted.append(read)
                where.append(i)
        for window, parts in joined.items():
            targets = tuple(i for i, _, _ in parts)
            fetch = partial(_via_window, self.storage, window, parts)
            # Ready: its bytes are here, all of them (a pack may end inside a window).
            data, end = window.data, max(e for _, _, e in parts)
            ready = data is not None and end <= window.start + len(data)
            jobs.append(ReadJob(targets, fetch, ready))
        for group in coalesce(wanted):
            targets = tuple(where[part] for part, _, _ in group.parts)
            planned = None
            if ahead is not None:
                # A window may reach past the pack's end: it holds what there is.
                upto = partial(_fetch_range, self.storage, group.key, exact=False)
                planned = ahead.plan(group.key, group.start, group.end, upto)
            if planned is None:
                jobs.append(
                    ReadJob(
                        targets,
                        partial(_split, self.storage, group),
                        fetch_async=partial(_split_async, self.storage, group),
                    )
                )
            else:
                parts = list(group.parts)
                jobs.append(ReadJob(targets, partial(_via_window, self.storage, planned, parts)))
        for group in coalesce(sourced):
            url, etag, modified = pins[group.key]
            whole = SourceRange(url, group.start, group.end, etag, modified)
            targets = tuple(sourced_at[part] for part, _, _ in group.parts)
            jobs.append(ReadJob(targets, partial(_read_source, self.sources, whole, group.parts)))
        if self.verify_reads:
            jobs = [self._verifying(job, reads) for job in jobs]
        return jobs

    def _verifying(
        self, job: ReadJob, reads: Sequence[tuple[ChunkRef, tuple[int, int] | None]]
    ) -> ReadJob:
        """``job``, its bytes checked by :meth:`verified` before anyone gets them (a job of one
        read of its own, :meth:`read_chunk`, checks them already)."""
        if isinstance(job.fetch, partial) and job.fetch.func is _one:
            return job
        mine = [reads[i] for i in job.targets]
        fetch, fetch_async = job.fetch, job.fetch_async

        def check(found: list[bytes]) -> list[bytes]:
            return [self.verified(r, rng, d) for (r, rng), d in zip(mine, found, strict=True)]

        async def checked_async() -> list[bytes]:
            assert fetch_async is not None
            return check(await fetch_async())

        return ReadJob(
            job.targets,
            lambda: check(fetch()),
            job.ready,
            None if fetch_async is None else checked_async,
        )

    def read_chunks(self, reads: Sequence[tuple[ChunkRef, tuple[int, int] | None]]) -> list[bytes]:
        """The bytes of many chunks, in order, fetched concurrently with the requests of
        :meth:`plan_reads`. Raises as :meth:`read_chunk`."""
        out: list[bytes] = [b""] * len(reads)

        def run(job: ReadJob) -> None:
            for i, data in zip(job.targets, job.fetch(), strict=True):
                out[i] = data

        self.storage.map(run, self.plan_reads(reads))
        return out

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


@functools.cache
def _warn_unverified(name: str) -> None:
    log.warning(
        "this repository names chunks by content hash %r, which this zarrlake does not know: "
        "chunk reads are not verified (upgrade zarrlake)",
        name,
    )


#: Ranges of one pack at most this far apart are fetched in one request (the gap's bytes are
#: read and dropped: on S3 a request costs far more than 64 KiB of transfer).
COALESCE_GAP = 64 * 1024
#: A coalesced request spans at most this many bytes.
COALESCE_MAX = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RangeGroup:
    """One ranged request ``[start, end)`` of ``key`` serving several wanted ranges:
    ``parts`` are (index of the wanted range, start, end), offsets in the object."""

    key: str
    start: int
    end: int
    parts: tuple[tuple[int, int, int], ...]


def coalesce(
    wanted: Sequence[tuple[str, int, int]],
    *,
    max_gap: int = COALESCE_GAP,
    max_span: int = COALESCE_MAX,
) -> list[RangeGroup]:
    """Plan the requests for ``wanted`` ranges ``(key, start, end)``: ranges of one key are
    merged while the gap between them is at most ``max_gap`` and the request spans at most
    ``max_span`` bytes (a single range longer than that is its own request). Overlapping and
    duplicate ranges share a request (one inside a request always joins it). Every wanted
    range is in exactly one group."""
    by_key: dict[str, list[int]] = {}
    for i, (key, _, _) in enumerate(wanted):
        by_key.setdefault(key, []).append(i)
    groups: list[RangeGroup] = []
    for key, idx in by_key.items():
        idx.sort(key=lambda i: (wanted[i][1], wanted[i][2]))
        parts: list[tuple[int, int, int]] = []
        start = end = 0
        for i in idx:
            _, s, e = wanted[i]
            if parts and (e <= end or (s - end <= max_gap and e - start <= max_span)):
                end = max(end, e)
            else:
                if parts:
                    groups.append(RangeGroup(key, start, end, tuple(parts)))
                parts, start, end = [], s, e
            parts.append((i, s, e))
        groups.append(RangeGroup(key, start, end, tuple(parts)))
    return groups


@dataclass(frozen=True, slots=True)
class ReadJob:
    """One request of a planned batch of chunk reads: ``fetch()`` makes it and returns the
    bytes of the reads at ``targets`` (indices into the batch), in that order."""

    targets: tuple[int, ...]
    fetch: Callable[[], list[bytes]]
    #: ``fetch`` makes no request (its bytes were read ahead): it may run on the event loop.
    ready: bool = False
    #: The same request for a caller on an event loop (:meth:`Storage.get_async`), where there
    #: is one: it saves the hand-off to an I/O thread and back.
    fetch_async: Callable[[], Awaitable[list[bytes]]] | None = None


def _whole(key: str, got: bytes, ref: ChunkRef, byte_range: tuple[int, int] | None) -> bytes:
    """``got``, read from chunk object ``key`` of ``ref`` (``byte_range`` of it), if it holds
    every byte the ref says is there: a truncated object must not reach the codec as whole."""
    size = ref_size(ref)
    start, end = (0, size) if byte_range is None else byte_range
    if len(got) != max(0, min(end, size) - start):
        raise CorruptObject(key, f"holds {len(got)} bytes where its ref needs them")
    return got


def _one(objects: ObjectStore, ref: ChunkRef, byte_range: tuple[int, int] | None) -> list[bytes]:
    return [objects.read_chunk(ref, byte_range)]


def _read_source(
    sources: VirtualSources, whole: SourceRange, parts: Sequence[tuple[int, int, int]]
) -> list[bytes]:
    """The bytes of the virtual chunk reads ``parts`` (index, start, end in the source), in one
    checked request of ``whole``."""
    return _slice(sources.read_range(whole), whole.start, parts)


def _split(storage: Storage, group: RangeGroup) -> list[bytes]:
    return _slice(
        _fetch_range(storage, group.key, group.start, group.end), group.start, group.parts
    )


async def _split_async(storage: Storage, group: RangeGroup) -> list[bytes]:
    got = await _fetch_range_async(storage, group.key, group.start, group.end)
    return _slice(got, group.start, group.parts)


def _slice(data: bytes, base: int, parts: Iterable[tuple[int, int, int]]) -> list[bytes]:
    """Each part's bytes ``[start, end)`` of ``data``, the object's bytes from ``base`` on."""
    return [data[start - base : end - base] for _, start, end in parts]


def _via_window(
    storage: Storage, window: Window, parts: Sequence[tuple[int, int, int]]
) -> list[bytes]:
    """The bytes of reads ``parts`` (index, start, end), all inside ``window``, from its bytes.
    If its request failed or the pack ends inside it, they make their own requests, as they
    would have without it (ranges close together share one), and each gets its own error."""
    try:
        data = window.result()
    except Exception:
        data = b""
    if max(end for _, _, end in parts) - window.start <= len(data):
        return _slice(data, window.start, parts)
    wanted = [(window.key, start, end) for _, start, end in parts]
    out: list[bytes] = [b""] * len(parts)
    for group in coalesce(wanted):
        for (i, _, _), got in zip(group.parts, _split(storage, group), strict=True):
            out[i] = got
    return out


def _packed_read(ref: ChunkRef, byte_range: tuple[int, int] | None) -> tuple[str, int, int] | None:
    """(pack key, start, end) in the pack for ``byte_range`` of a packed chunk; None if empty."""
    pack_id, offset, length = ref[1], ref[2], ref[3]
    start, end = (0, length) if byte_range is None else byte_range
    end = min(end, length)
    if end <= start:
        return None
    return pack_key(pack_id), offset + start, offset + end


def _fetch_range(storage: Storage, key: str, start: int, end: int, *, exact: bool = True) -> bytes:
    """Bytes ``[start, end)`` of pack ``key``; with ``exact`` off, fewer if the pack ends sooner
    (a read-ahead window). A missing pack, or a short one read exactly, is corrupt."""
    with _missing_is_corrupt(key, "pack object"):
        data = storage.get(key, (start, end))
    return _exactly(key, data, start, end) if exact else data


async def _fetch_range_async(storage: Storage, key: str, start: int, end: int) -> bytes:
    """:func:`_fetch_range` (exact) from an event loop."""
    with _missing_is_corrupt(key, "pack object"):
        data = await storage.get_async(key, (start, end))
    return _exactly(key, data, start, end)


def _exactly(key: str, data: bytes, start: int, end: int) -> bytes:
    if len(data) != end - start:
        raise CorruptObject(key, f"pack ends before byte {end} that a chunk ref names")
    return data


@contextmanager
def _missing_is_corrupt(key: str, what: str) -> Iterator[None]:
    """A chunk or pack object that a ref names and the storage does not have is corruption."""
    try:
        yield
    except ObjectNotFound:
        raise CorruptObject(key, f"{what} is missing") from None

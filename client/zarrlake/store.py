"""The Zarr store adapter: ``zarr.abc.store.Store`` over a session.

Zarr's async machinery calls these methods concurrently; the blocking object-store calls run on the
backend's I/O thread pool, so many chunk reads or uploads are in flight at once. Exceptions on the
read path (see "reads" below): finding a chunk's ref needs no thread once its manifest shard is
cached; a small chunk of a local or memory storage is read right on the event loop, because the
hand-off to a thread and back costs more than the read itself; and a backend whose requests an
event loop can await (S3 on obstore) serves a chunk object, or a chunk's range of a pack, there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from zarrlake.errors import CorruptChunk, ReadOnlyError, VirtualChunkError
from zarrlake.format.model import INLINE, OBJECT, PACKED, VIRTUAL, ChunkRef, ref_size
from zarrlake.objects import ObjectStore, ReadJob

#: Chunks up to this size are written from the event loop (see :meth:`ZarrlakeStore.set`).
ASYNC_WRITE_BYTES = 64 * 1024

T = TypeVar("T")
#: An error a chunk read raises that the store names the Zarr key and array of.
E = TypeVar("E", CorruptChunk, VirtualChunkError)


class StoreSession(Protocol):
    """What the store needs of a session (:class:`zarrlake.Session`, ``ForkedSession``): keys
    resolved through its uncommitted layers over its base snapshot, and writes into them."""

    @property
    def read_only(self) -> bool: ...

    @property
    def session_id(self) -> str: ...

    @property
    def base(self) -> str: ...

    @property
    def objects(self) -> ObjectStore: ...

    def resolve(self, key: str) -> bytes | ChunkRef | None: ...

    def resolve_cached(self, key: str) -> tuple[bool, bytes | ChunkRef | None]: ...

    def exists(self, key: str) -> bool: ...

    def write(self, key: str, data: bytes | memoryview) -> None: ...

    def writes_in_memory(self, key: str, size: int) -> bool: ...

    async def write_chunk_async(self, key: str, data: bytes | memoryview) -> None: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def list_prefix(self, prefix: str) -> Iterator[str]: ...

    def list_dir(self, prefix: str) -> list[str]: ...


def _check_byte_range(byte_range: object) -> None:
    if byte_range is not None and not isinstance(
        byte_range, RangeByteRequest | OffsetByteRequest | SuffixByteRequest
    ):
        # Zarr's own stores word it this way, and Zarr's store test-suite matches on it.
        raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


def _range(byte_range: ByteRequest | None, size: int) -> tuple[int, int] | None:
    if byte_range is None:
        return None
    if isinstance(byte_range, RangeByteRequest):
        return max(0, byte_range.start), min(size, byte_range.end)
    if isinstance(byte_range, OffsetByteRequest):
        return min(size, byte_range.offset), size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


def _payload(value: Buffer) -> bytes | memoryview:
    """The bytes of ``value`` without copying them (``to_bytes`` always copies).

    Safe because the session hashes and stores them before ``set`` returns; whatever it keeps
    (inline chunks, metadata documents) it copies.
    """
    view = memoryview(value.as_buffer_like())
    return view.cast("B") if view.c_contiguous else value.to_bytes()


def _digest_hex(ref: ChunkRef) -> str | None:
    """The chunk digest ``ref`` records (hex), if any."""
    if ref[0] == OBJECT:
        return str(ref[1].hex())
    if ref[0] == PACKED and len(ref) > 4:
        return str(ref[4].hex())
    return None


class _PendingReads:
    """Chunk reads asked for during one turn of an event loop, planned together."""

    __slots__ = ("futures", "loop", "reads")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.reads: list[tuple[ChunkRef, tuple[int, int] | None]] = []
        self.futures: list[asyncio.Future[bytes]] = []


_SETTLING: set[asyncio.Task[None]] = set()


async def _settle(
    job: ReadJob,
    reads: list[tuple[ChunkRef, tuple[int, int] | None]],
    futures: list[asyncio.Future[bytes]],
    objects: ObjectStore,
) -> None:
    """Make one request and hand each of its reads its bytes, or its own error: when a request
    serving several reads fails, each is made again on its own (concurrently), so a ref pointing
    past the end of a pack fails only the reads of that ref. Cancelled, it cancels its reads."""
    run = objects.storage.run_async
    found: list[bytes | BaseException]
    try:
        try:
            if job.fetch_async is not None:
                found = list(await job.fetch_async())
            else:
                found = list(await run(job.fetch))
        except Exception as e:
            if len(reads) == 1:
                found = [e]
            else:
                found = list(
                    await asyncio.gather(
                        *(run(objects.read_chunk, *read) for read in reads), return_exceptions=True
                    )
                )
    except asyncio.CancelledError:
        for f in futures:
            f.cancel()
        raise
    for f, data in zip(futures, found, strict=True):
        if f.done():
            continue
        if isinstance(data, BaseException):
            f.set_exception(data)
        else:
            f.set_result(data)


class ZarrlakeStore(Store):
    """Zarr's view of a zarrlake session. Obtain it as ``session.store``."""

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True
    supports_partial_writes: bool = False  # type: ignore[assignment]
    # Consolidated metadata is a copy of the tree in the root group's zarr.json, made so that
    # opening a dataset is one read instead of a listing. A snapshot already holds every node
    # document, read in the one request that opens it, and lists in memory; a copy would only
    # be a second truth that goes stale, and a change of "/" in every diff. So Zarr and xarray
    # are told there is none (they then neither write nor look for it, and warn about neither).
    supports_consolidated_metadata: bool = False

    def __init__(self, session: StoreSession, *, read_only: bool | None = None) -> None:
        super().__init__(read_only=session.read_only if read_only is None else read_only)
        self._session = session
        self._pending: _PendingReads | None = None
        self._why_read_only: str | None = None

    @property
    def session(self) -> StoreSession:
        return self._session

    def make_read_only(self, why: str | None = None) -> None:
        """Refuse writes from now on (the session committed and became read-only), saying
        ``why`` when given."""
        self._read_only = True
        self._why_read_only = why

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(
                self._why_read_only
                or "store was opened in read-only mode and does not support writing"
            )

    def with_read_only(self, read_only: bool = False) -> ZarrlakeStore:
        return type(self)(self._session, read_only=read_only)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ZarrlakeStore)
            and other._session.session_id == self._session.session_id
            and other._session.base == self._session.base
            and other.read_only == self.read_only
        )

    def __hash__(self) -> int:
        return hash((self._session.session_id, self.read_only))

    def __repr__(self) -> str:
        return f"ZarrlakeStore({self._session!r})"

    def __str__(self) -> str:
        return f"zarrlake://{self._session.base}"

    def __getstate__(self) -> dict[str, Any]:
        return {"session": self._session, "read_only": self.read_only, "is_open": self._is_open}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._session = state["session"]
        self._read_only = state["read_only"]
        self._is_open = state["is_open"]
        self._pending = None

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn`` on the storage backend's I/O pool."""
        return await self._session.objects.storage.run_async(fn, *args)

    # -- reads ---------------------------------------------------------------------------------
    # A read resolves its key on the event loop when that needs no I/O (the snapshot and the
    # key's manifest shard are cached: every read after the first few), then reads small chunks
    # of a local or memory storage right there too: the hand-off to a thread and back costs more
    # than such a read. The reads of one turn of the event loop (Zarr starts a batch of chunk
    # reads together) are fetched together, ranges of one pack coalesced into one request, each
    # request awaited where the backend can (Storage.get_async), else on the I/O pool; read-ahead
    # windows are fetched on the I/O pool, whoever waits for them.

    def _get_blocking(self, key: str, byte_range: ByteRequest | None) -> bytes | None:
        _check_byte_range(byte_range)
        value = self._session.resolve(key)
        if value is None:
            return None
        if isinstance(value, bytes):
            rng = _range(byte_range, len(value))
            return value if rng is None else value[rng[0] : rng[1]]
        rng = _range(byte_range, ref_size(value))
        return self._session.objects.read_chunk(value, rng)

    async def _read_value(self, key: str, byte_range: ByteRequest | None) -> bytes | None:
        _check_byte_range(byte_range)
        found, value = self._session.resolve_cached(key)
        objects = self._session.objects
        if not found:
            if objects.storage.inline_read_bytes:
                return await self._io(self._get_blocking, key, byte_range)
            # Resolve on the pool (it reads a manifest shard), then join the batch of reads.
            value = await self._io(self._session.resolve, key)
        if value is None:
            return None
        if isinstance(value, bytes):
            rng = _range(byte_range, len(value))
            return value if rng is None else value[rng[0] : rng[1]]
        size = ref_size(value)
        rng = _range(byte_range, size)
        # Read in place when that is cheaper than a hand-off; a virtual chunk's source is
        # elsewhere (maybe a bucket), whatever the repository's storage is.
        if value[0] == INLINE or (
            size <= objects.storage.inline_read_bytes and value[0] != VIRTUAL
        ):
            return objects.read_chunk(value, rng)
        if value[0] == OBJECT and rng is None:  # a whole object: nothing to coalesce it with
            return await objects.read_object_async(value)
        return await self._batched_read(value, rng)

    async def _batched_read(self, ref: ChunkRef, rng: tuple[int, int] | None) -> bytes:
        loop = asyncio.get_running_loop()
        batch = self._pending
        if batch is None or batch.loop is not loop:
            batch = self._pending = _PendingReads(loop)
            loop.call_soon(self._flush, batch)
        future: asyncio.Future[bytes] = loop.create_future()
        batch.reads.append((ref, rng))
        batch.futures.append(future)
        return await future

    def _flush(self, batch: _PendingReads) -> None:
        if self._pending is batch:
            self._pending = None
        objects = self._session.objects
        try:
            jobs = objects.plan_reads(batch.reads)
        except Exception as e:  # a callback's error would reach no one: every read waits on it
            for f in batch.futures:
                if not f.done():
                    f.set_exception(e)
            return
        for job in jobs:
            futures = [batch.futures[i] for i in job.targets]
            if job.ready:  # read ahead: no request, no thread
                try:
                    found = job.fetch()
                except Exception:
                    pass  # settled as any other job below, each read on its own if need be
                else:
                    for f, data in zip(futures, found, strict=True):
                        if not f.done():
                            f.set_result(data)
                    continue
            # Each request settles its own reads as it completes: Zarr starts the next read as
            # soon as one is done, and a slow request must not hold up the others.
            reads = [batch.reads[i] for i in job.targets]
            task = batch.loop.create_task(_settle(job, reads, futures, objects))
            _SETTLING.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(_SETTLING.discard)

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        if prototype is None:
            prototype = default_buffer_prototype()
        if not self._is_open:
            await self._open()
        try:
            data = await self._read_value(key, byte_range)
        except CorruptChunk as e:
            raise self._named(e, key) from None
        except VirtualChunkError as e:
            raise self._named(e, key) from None
        return None if data is None else prototype.buffer.from_bytes(data)

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        if prototype is None:
            prototype = default_buffer_prototype()
        try:
            data = self._get_blocking(key, byte_range)
        except CorruptChunk as e:
            raise self._named(e, key) from None
        except VirtualChunkError as e:
            raise self._named(e, key) from None
        return None if data is None else prototype.buffer.from_bytes(data)

    def _get_many_blocking(
        self, key_ranges: list[tuple[str, ByteRequest | None]]
    ) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(key_ranges)
        reads: list[tuple[ChunkRef, tuple[int, int] | None]] = []
        where: list[int] = []
        for i, (key, byte_range) in enumerate(key_ranges):
            _check_byte_range(byte_range)
            value = self._session.resolve(key)
            if isinstance(value, bytes):
                rng = _range(byte_range, len(value))
                out[i] = value if rng is None else value[rng[0] : rng[1]]
            elif value is not None:
                reads.append((value, _range(byte_range, ref_size(value))))
                where.append(i)
        try:
            found = self._session.objects.read_chunks(reads)
        except CorruptChunk as e:
            named = next(
                (
                    key_ranges[i][0]
                    for i, (ref, _) in zip(where, reads, strict=True)
                    if _digest_hex(ref) == e.expected
                ),
                None,
            )
            raise e if named is None else self._named(e, named) from None
        except VirtualChunkError as e:
            at = next(
                (
                    key_ranges[i][0]
                    for i, (ref, _) in zip(where, reads, strict=True)
                    if ref[0] == VIRTUAL and ref[1] == e.url
                ),
                None,
            )
            raise e if at is None else self._named(e, at) from None
        for i, data in zip(where, found, strict=True):
            out[i] = data
        return out

    def _named(self, error: E, key: str) -> E:
        """``error``, naming Zarr key ``key`` and the array it belongs to: the nearest parent
        with an array's (or group's) ``zarr.json``."""
        parts = key.split("/")[:-1]
        while parts:
            prefix = "/".join(parts)
            try:
                if self._session.exists(f"{prefix}/zarr.json"):
                    break
            except Exception:  # naming the array is a courtesy: the error stands without it
                pass
            parts.pop()
        return error.at(key, "/".join(parts))

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        """Many reads at once: ranges inside one pack are fetched together (one request for
        ranges close to each other), every other chunk concurrently."""
        if not self._is_open:
            await self._open()
        # Off the I/O pool: read_chunks fans its requests out onto it.
        found = await asyncio.to_thread(self._get_many_blocking, list(key_ranges))
        return [None if d is None else prototype.buffer.from_bytes(d) for d in found]

    async def exists(self, key: str) -> bool:
        return await self._io(self._session.exists, key)

    async def getsize(self, key: str) -> int:
        value = await self._io(self._session.resolve, key)
        if value is None:
            raise FileNotFoundError(key)
        return len(value) if isinstance(value, bytes) else ref_size(value)

    # -- writes --------------------------------------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        await self._ensure_open()
        if not isinstance(value, Buffer):
            raise TypeError(f"ZarrlakeStore.set(): value must be a Buffer, not {type(value)}")
        payload = _payload(value)
        if self._session.writes_in_memory(key, len(payload)):
            # Metadata and inline chunks touch no storage: a hop to the I/O pool would cost more
            # than the write (a million one-element chunks are minutes of thread hops).
            self._session.write(key, payload)
        elif len(payload) <= ASYNC_WRITE_BYTES:
            # Small objects: hashed here (microseconds) and uploaded by the storage's own
            # coroutine where it has one (S3 on obstore), without a thread hop each way.
            await self._session.write_chunk_async(key, payload)
        else:
            # Large ones hash on the I/O pool, in parallel, off the event loop.
            await self._io(self._session.write, key, payload)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._check_writable()
        self._session.write(key, _payload(value))

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self._check_writable()
        if not await self.exists(key):
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        self._check_writable()
        await self._io(self._session.delete, key)

    def delete_sync(self, key: str) -> None:
        self._check_writable()
        self._session.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        await self._io(self._session.delete_prefix, prefix)

    async def clear(self) -> None:
        self._check_writable()
        self._session.delete_prefix("")

    # -- listing --------------------------------------------------------------------------------

    # Listing reads manifest shards (I/O on S3): it runs on the backend's pool, not the event loop.
    async def list(self) -> AsyncIterator[str]:
        for key in await self._io(lambda: list(self._session.list_prefix(""))):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await self._io(lambda: list(self._session.list_prefix(prefix))):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        for name in await self._io(self._session.list_dir, prefix):
            yield name

    async def is_empty(self, prefix: str) -> bool:
        # A prefix names a directory: "fo" is empty even when "foo/bar" exists.
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return await self._io(lambda: next(self._session.list_prefix(prefix), None) is None)

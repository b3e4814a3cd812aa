"""The read path: range coalescing inside packs, single-flight shard loads, the store's batched
and event-loop reads. Real backends only (memory, a local directory, moto S3)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

import zarrlake
from zarrlake.errors import CorruptObject, ObjectNotFound, StorageError
from zarrlake.format.ids import LEGACY_CONTENT_HASH
from zarrlake.format.model import INLINE, OBJECT, PACKED, chunk_key, pack_key
from zarrlake.objects import COALESCE_GAP, LRU, ObjectStore, RangeGroup, coalesce
from zarrlake_testkit.counting import CountingStorage, Counts

# -- the planner (pure) ----------------------------------------------------------------------------


def test_coalesce_merges_close_ranges_of_one_key_in_any_order() -> None:
    wanted = [("p", 300, 400), ("p", 0, 100), ("q", 0, 10), ("p", 100, 200), ("p", 0, 100)]
    assert coalesce(wanted, max_gap=100) == [
        RangeGroup("p", 0, 400, ((1, 0, 100), (4, 0, 100), (3, 100, 200), (0, 300, 400))),
        RangeGroup("q", 0, 10, ((2, 0, 10),)),
    ]


def test_coalesce_gap_bound_is_inclusive_and_span_bound_splits() -> None:
    assert coalesce([("p", 0, 10), ("p", 20, 30)], max_gap=10) == [
        RangeGroup("p", 0, 30, ((0, 0, 10), (1, 20, 30)))
    ]
    assert coalesce([("p", 0, 10), ("p", 21, 30)], max_gap=10) == [
        RangeGroup("p", 0, 10, ((0, 0, 10),)),
        RangeGroup("p", 21, 30, ((1, 21, 30),)),
    ]
    # The span bound: the third range would make the request longer than 25 bytes.
    assert coalesce([("p", 0, 10), ("p", 10, 20), ("p", 20, 30)], max_gap=0, max_span=25) == [
        RangeGroup("p", 0, 20, ((0, 0, 10), (1, 10, 20))),
        RangeGroup("p", 20, 30, ((2, 20, 30),)),
    ]
    # A range longer than the bound is a request of its own; one inside another shares it.
    assert coalesce([("p", 0, 100), ("p", 10, 20)], max_span=25) == [
        RangeGroup("p", 0, 100, ((0, 0, 100), (1, 10, 20)))
    ]


# -- read_chunks on every backend ------------------------------------------------------------------


def _pack(storage: zarrlake.Storage, sizes: list[int], gap: int) -> tuple[bytes, list[tuple]]:
    """A pack object of chunks of ``sizes`` with ``gap`` bytes between them; their refs."""
    rng = np.random.default_rng(5)
    parts: list[bytes] = []
    refs: list[tuple] = []
    offset = 0
    for size in sizes:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        refs.append((PACKED, "", offset, size, hashlib.sha256(data).digest()))
        parts.append(data + b"\xee" * gap)
        offset += size + gap
    pack = b"".join(parts)
    pack_id = hashlib.sha256(pack).hexdigest()
    storage.put(pack_key(pack_id), pack)
    return pack, [(r[0], pack_id, *r[2:]) for r in refs]


def test_read_chunks_returns_exact_bytes_with_gaps_duplicates_and_any_order(
    storage: zarrlake.Storage,
) -> None:
    counted = CountingStorage(storage, Counts(record_keys=True))
    objects = ObjectStore(counted, LEGACY_CONTENT_HASH)
    pack, refs = _pack(storage, [100, 37, 1000, 1, 64], gap=11)
    lone = b"a chunk object of its own"
    storage.put(chunk_key(hashlib.sha256(lone).hexdigest()), lone)
    lone_ref = (OBJECT, hashlib.sha256(lone).digest(), len(lone))

    def chunk(i: int) -> bytes:
        r = refs[i]
        return pack[r[2] : r[2] + r[3]]

    reads = [
        (refs[3], None),
        (refs[0], None),
        (lone_ref, (2, 7)),
        (refs[2], (10, 20)),
        (refs[0], None),  # a duplicate
        (refs[2], (990, 5000)),  # past the chunk's end: clipped to it
        (refs[4], (64, 80)),  # empty: no request
        ((INLINE, b"inline!"), (1, 3)),
        (refs[1], None),
    ]
    got = objects.read_chunks(reads)
    assert got == [
        chunk(3),
        chunk(0),
        lone[2:7],
        chunk(2)[10:20],
        chunk(0),
        chunk(2)[990:],
        b"",
        b"nl",
        chunk(1),
    ]
    # The pack's ranges are 11 bytes apart: one ranged request; the chunk object one more.
    ops = sorted(counted.counts.calls())
    assert ops == [("get_range", chunk_key(lone_ref[1].hex())), ("get_range", pack_key(refs[0][1]))]


def test_read_chunks_splits_ranges_further_apart_than_the_gap(storage: zarrlake.Storage) -> None:
    counted = CountingStorage(storage, Counts(record_keys=True))
    pack, refs = _pack(storage, [10, 10, 10], gap=COALESCE_GAP + 1)
    got = ObjectStore(counted, LEGACY_CONTENT_HASH).read_chunks([(r, None) for r in reversed(refs)])
    assert got == [pack[r[2] : r[2] + r[3]] for r in reversed(refs)]
    assert counted.counts.by_op() == {"get_range": 3}


def test_a_pack_shorter_than_its_refs_or_missing_is_corrupt(storage: zarrlake.Storage) -> None:
    objects = ObjectStore(storage, LEGACY_CONTENT_HASH)
    pack, refs = _pack(storage, [50, 50], gap=0)
    beyond = (PACKED, refs[1][1], 60, 50, b"")  # ends 10 bytes after the pack does
    with pytest.raises(CorruptObject, match="pack ends before"):
        objects.read_chunks([(refs[0], None), (beyond, None)])
    with pytest.raises(CorruptObject, match="pack ends before"):
        objects.read_chunk(beyond)
    assert objects.read_chunk(beyond, (0, 40)) == pack[60:100]  # what does exist reads fine
    missing = (PACKED, "0" * 64, 0, 10, b"")
    with pytest.raises(CorruptObject, match="pack object is missing"):
        objects.read_chunks([(refs[0], None), (missing, None)])
    # The same requests awaited from an event loop (what the Zarr store does with them).
    for read, error in [(beyond, "pack ends before"), (missing, "pack object is missing")]:
        [job] = objects.plan_reads([(read, None)])
        assert job.fetch_async is not None
        with pytest.raises(CorruptObject, match=error):
            asyncio.run(job.fetch_async())
    [job] = objects.plan_reads([(refs[0], None), (refs[1], None)])
    assert job.fetch_async is not None
    assert asyncio.run(job.fetch_async()) == [pack[:50], pack[50:100]]


def test_a_chunk_object_shorter_than_its_ref_is_corrupt(storage: zarrlake.Storage) -> None:
    # A truncated chunk object must not reach the codec as if it were whole.
    objects = ObjectStore(storage, LEGACY_CONTENT_HASH)
    data = bytes(range(100))
    digest = hashlib.sha256(data).digest()
    storage.put(chunk_key(digest.hex()), data[:60])
    ref = (OBJECT, digest, 100)
    with pytest.raises(CorruptObject, match="holds 60 bytes"):
        objects.read_chunk(ref)
    with pytest.raises(CorruptObject, match="holds 10 bytes"):  # of the 30 asked for
        objects.read_chunk(ref, (50, 80))
    with pytest.raises(CorruptObject, match="holds 60 bytes"):
        objects.read_chunks([(ref, None)])
    with pytest.raises(CorruptObject, match="holds 60 bytes"):  # the store's path from a loop
        asyncio.run(objects.read_object_async(ref))
    missing = (OBJECT, hashlib.sha256(b"never written").digest(), 13)
    with pytest.raises(CorruptObject, match="chunk object is missing"):
        asyncio.run(objects.read_object_async(missing))
    assert objects.read_chunk(ref, (10, 40)) == data[10:40]  # what does exist reads fine
    storage.put(chunk_key(digest.hex()), data)
    assert objects.read_chunk(ref) == data and objects.read_chunk(ref, (90, 200)) == data[90:]
    assert asyncio.run(objects.read_object_async(ref)) == data


# -- single-flight loads -------------------------------------------------------------------------


def test_lru_loads_a_key_once_for_concurrent_missers() -> None:
    cache: LRU[str, list[int]] = LRU(4)
    calls: list[int] = []
    started = threading.Event()
    release = threading.Event()

    def load() -> list[int]:
        calls.append(1)
        started.set()
        release.wait(10)
        return [42]

    results: list[list[int]] = []
    leader = threading.Thread(target=lambda: results.append(cache.get_or_load("k", load)))
    leader.start()
    assert started.wait(10)
    waiters = [
        threading.Thread(target=lambda: results.append(cache.get_or_load("k", load)))
        for _ in range(6)
    ]
    for t in waiters:
        t.start()
    release.set()
    for t in [leader, *waiters]:
        t.join(10)
    assert len(calls) == 1
    assert len(results) == 7 and all(r is results[0] for r in results)


def test_lru_a_failed_load_raises_to_its_caller_and_the_next_one_loads_again() -> None:
    cache: LRU[str, int] = LRU(4)

    def fail() -> int:
        raise CorruptObject("k", "bad")

    with pytest.raises(CorruptObject):
        cache.get_or_load("k", fail)
    assert cache.get_or_load("k", lambda: 7) == 7
    assert cache.get_or_load("k", fail) == 7  # cached now


def _written(storage: zarrlake.Storage, chunks: int = 16) -> np.ndarray:
    repo = zarrlake.Repository.create(storage)
    values = np.arange(128 * chunks, dtype="int64")
    with repo.transaction("main", message="write") as store:
        zarr.create_array(
            store, name="data", shape=values.shape, chunks=(128,), dtype="int64", compressors=None
        )[:] = values
    return values


def test_threads_reading_one_shard_at_once_fetch_it_once(storage: zarrlake.Storage) -> None:
    values = _written(storage)
    counts = Counts(record_keys=True)
    # A pickled copy of memory storage would be a different store: count the same one.
    repo = zarrlake.Repository.open(CountingStorage(storage, counts))
    session = repo.readonly_session("main")
    counts.reset()
    barrier = threading.Barrier(8)
    got: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            arr = zarr.open_array(session.store, path="data", mode="r")
            barrier.wait(120)  # all eight start their read together (generous: a loaded machine)
            got[i] = arr[i * 128 : (i + 1) * 128]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for i in range(8):
        np.testing.assert_array_equal(got[i], values[i * 128 : (i + 1) * 128])
    manifests = [k for op, k in counts.calls() if k.startswith("manifests/")]
    assert len(manifests) == 1


# -- the store -------------------------------------------------------------------------------------


def test_a_bad_chunk_fails_only_its_own_reads_in_a_batch(storage: zarrlake.Storage) -> None:
    values = _written(storage, chunks=8)
    repo = zarrlake.Repository.open(storage)
    repo.compact(branch="main")  # chunks 0..7 into one pack
    with repo.transaction("main", message="one more") as store:
        zarr.open_array(store, path="data")[0:128] = -1  # chunk 0: an object (or pack) of its own
    session = repo.readonly_session("main")
    ref = session.resolve("data/c/0")
    assert ref is not None and ref[0] in (OBJECT, PACKED)
    storage.delete_many([chunk_key(ref[1].hex()) if ref[0] == OBJECT else pack_key(ref[1])])
    store = session.store
    proto = default_buffer_prototype()
    zarr.core.sync.sync(store.get("zarr.json", proto))

    async def read_all() -> list[object]:
        keys = [f"data/c/{i}" for i in range(8)]
        return await asyncio.gather(*(store.get(k, proto) for k in keys), return_exceptions=True)

    got = zarr.core.sync.sync(read_all())
    assert isinstance(got[0], CorruptObject)
    raw = values.tobytes()
    for i in range(1, 8):
        assert got[i].to_bytes() == raw[i * 1024 : (i + 1) * 1024]  # type: ignore[union-attr]
    # Byte ranges of packed chunks, through the batched path too.
    suffix = zarr.core.sync.sync(store.get("data/c/3", proto, SuffixByteRequest(10)))
    assert suffix is not None and suffix.to_bytes() == raw[4 * 1024 - 10 : 4 * 1024]
    part = zarr.core.sync.sync(store.get("data/c/5", proto, RangeByteRequest(1000, 2000)))
    assert part is not None and part.to_bytes() == raw[5 * 1024 + 1000 : 6 * 1024]
    assert zarr.core.sync.sync(store.get("data/c/99", proto)) is None


def test_many_concurrent_reads_of_packed_chunks_are_exact(storage: zarrlake.Storage) -> None:
    values = _written(storage, chunks=40)
    repo = zarrlake.Repository.open(storage)
    repo.compact(branch="main")
    arr = zarr.open_array(repo.readonly_session("main").store, path="data", mode="r")
    np.testing.assert_array_equal(arr[:], values)
    picks = [37, 2, 2, 19, 0, 39, 11]
    for i in picks:
        np.testing.assert_array_equal(arr[i * 128 : (i + 1) * 128], values[i * 128 : (i + 1) * 128])
    np.testing.assert_array_equal(arr[100:4000], values[100:4000])


# -- the local backend's read ----------------------------------------------------------------------


def test_local_get_reads_whole_objects_and_ranges(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path)
    storage.put("a/b", b"0123456789")
    assert storage.get("a/b") == b"0123456789"
    assert storage.get("a/b", (2, 5)) == b"234"
    assert storage.get("a/b", (8, 50)) == b"89"
    assert storage.get("a/b", (5, 5)) == b""
    big = bytes(range(256)) * 5000
    storage.put("big", big)
    assert storage.get("big") == big
    for missing in ("a/c", "a", "a/b/c"):
        with pytest.raises(ObjectNotFound):
            storage.get(missing)
    for bad in ("", "/etc/passwd", "a/../../x"):
        with pytest.raises(StorageError):
            storage.get(bad)


def test_local_storage_unpickled_without_its_read_prefix_still_reads(tmp_path: Path) -> None:
    import pickle

    storage = zarrlake.Storage.local(tmp_path)
    storage.put("k", b"v")
    state = dict(storage.__dict__)
    del state["_root_slash"]  # as a client before this field pickled it
    old = object.__new__(type(storage))
    old.__setstate__(state)
    assert old.get("k") == b"v"
    assert pickle.loads(pickle.dumps(storage)).get("k", (0, 1)) == b"v"

"""The object-store protocol on every backend: memory, local directory, and S3 on two real servers
(moto, and SeaweedFS, which keeps only the promises S3 makes).

Failure modes moto cannot produce (a closed port, a dropped connection, a truncated body, a 503)
come from real sockets on the loopback interface: the storage code and botocore run unmodified.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import inspect
import multiprocessing as mp
import os
import pickle
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

import zarrlake
from backends import EVERY_STORAGE_KIND, make_storage
from zarrlake.errors import ZarrlakeError
from zarrlake.storage import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    TransientStorageError,
)
from zarrlake.storage.azure import AzureStorage
from zarrlake.storage.base import with_retries, with_retries_async
from zarrlake.storage.gcs import GCSStorage
from zarrlake.storage.http import HTTPStorage
from zarrlake.storage.local import LocalStorage
from zarrlake.storage.memory import MemoryStorage
from zarrlake.storage.s3 import S3Storage
from zarrlake_testkit.s3proxy import HeaderStrippingProxy

FORK = mp.get_context("fork")
DEFAULT_ATTEMPTS = inspect.signature(with_retries).parameters["attempts"].default


@pytest.fixture(params=EVERY_STORAGE_KIND)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh, empty storage of every kind, S3 on every test server."""
    return make_storage(request.param, tmp_path, request)


def keys_of(infos: Iterator[ObjectInfo]) -> list[str]:
    return [i.key for i in infos]


def assert_recent(when: dt.datetime) -> None:
    assert when.tzinfo is not None and when.utcoffset() is not None, "naive datetime"
    assert abs(dt.datetime.now(dt.UTC) - when) < dt.timedelta(minutes=10)


# -- put / get -------------------------------------------------------------------------------------


def test_put_get_overwrite(storage: Storage) -> None:
    storage.put("a/b/c", b"hello")
    assert storage.get("a/b/c") == b"hello"
    storage.put("a/b/c", b"world!")
    assert storage.get("a/b/c") == b"world!"
    every_byte = bytes(range(256)) * 3
    storage.put("bin", every_byte)
    assert storage.get("bin") == every_byte
    storage.put("empty", b"")
    assert storage.get("empty") == b""
    empty = storage.head("empty")
    assert empty is not None and (empty.key, empty.size) == ("empty", 0)
    assert storage.get("empty", (0, 10)) == b""
    # The characters real keys use: ref names are percent-quoted, journal entries hex, ...
    for key in ["refs/branch.a%2Fb/fffffffffffffffe", "refs/tag.v1.0", "chunks/ab/" + "ab" * 32]:
        storage.put(key, key.encode())
        assert storage.get(key) == key.encode()
        assert storage.exists(key)


RANGES = [
    ((0, 10), slice(0, 10)),
    ((10, 20), slice(10, 20)),
    ((1000, 1024), slice(1000, 1024)),
    ((1020, 2000), slice(1020, 1024)),  # runs past the end: what there is
    ((1024, 1030), slice(0, 0)),  # starts at the end
    ((2000, 3000), slice(0, 0)),  # starts past the end
    ((5, 5), slice(0, 0)),  # empty
    ((0, 1024), slice(0, 1024)),
    ((1023, 1024), slice(1023, 1024)),
]


def test_byte_range_get(storage: Storage) -> None:
    data = bytes(range(256)) * 4
    storage.put("obj", data)
    for byte_range, expect in RANGES:
        assert storage.get("obj", byte_range) == data[expect], byte_range


def test_missing_key(storage: Storage) -> None:
    with pytest.raises(ObjectNotFound) as info:
        storage.get("no/such/key")
    assert info.value.key == "no/such/key"
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, StorageError)
    assert isinstance(info.value, ZarrlakeError)
    with pytest.raises(ObjectNotFound):
        storage.get("no/such/key", (0, 10))
    assert storage.head("no/such/key") is None
    assert not storage.exists("no/such/key")
    assert list(storage.list("no/")) == []


def test_a_folder_is_not_an_object(storage: Storage) -> None:
    storage.put("dir/sub/obj", b"x")
    for key in ["dir", "dir/sub"]:
        assert storage.head(key) is None
        assert not storage.exists(key)
        with pytest.raises(ObjectNotFound):
            storage.get(key)


# -- create-only -----------------------------------------------------------------------------------


def test_create_only(storage: Storage) -> None:
    storage.put("k", b"first", create_only=True)
    with pytest.raises(PreconditionFailed) as info:
        storage.put("k", b"second", create_only=True)
    assert info.value.key == "k"
    assert not isinstance(info.value, TransientStorageError)
    assert storage.get("k") == b"first"
    storage.put("k", b"plain overwrite")  # a plain put still replaces
    assert storage.get("k") == b"plain overwrite"
    storage.delete_many(["k"])
    storage.put("k", b"again", create_only=True)  # free again once deleted
    assert storage.get("k") == b"again"
    storage.put("deep/new/dirs/k", b"x", create_only=True)
    assert storage.get("deep/new/dirs/k") == b"x"


def test_put_async_keeps_the_contract_of_put(storage: Storage) -> None:
    """What the Zarr store awaits for every small chunk: the same answers as :meth:`put`."""

    async def writes() -> None:
        await storage.put_async("a/k", b"first", create_only=True)
        with pytest.raises(PreconditionFailed) as info:
            await storage.put_async("a/k", b"second", create_only=True)
        assert info.value.key == "a/k"
        assert not isinstance(info.value, TransientStorageError)
        assert storage.get("a/k") == b"first"
        await storage.put_async("a/k", memoryview(b"plain overwrite"))
        await asyncio.gather(*(storage.put_async(f"a/{i}", bytes([i]) * 100) for i in range(20)))

    asyncio.run(writes())
    assert storage.get("a/k") == b"plain overwrite"
    assert all(storage.get(f"a/{i}") == bytes([i]) * 100 for i in range(20))


def _pool_calls(storage: Storage) -> list[object]:
    """The functions ``storage`` hands to its I/O pool from now on (appended as it does)."""
    pooled: list[object] = []
    run_async = storage.run_async

    async def counted(fn: Callable[..., object], *args: object) -> object:
        pooled.append(fn)
        return await run_async(fn, *args)

    storage.run_async = counted  # type: ignore[method-assign]
    return pooled


def test_s3_put_async_is_awaited_on_the_loop_once_its_store_exists(s3_server) -> None:  # type: ignore[no-untyped-def]
    """Once a sync request has built this process's obstore store, ``put_async`` needs no
    thread of the I/O pool (the hand-off per object is what it saves); before, it takes the
    pool's way, which builds the store there (resolving credentials may block)."""
    storage = s3_server.storage(f"put-async-{random.getrandbits(32):08x}")
    pooled = _pool_calls(storage)
    asyncio.run(storage.put_async("first", b"x"))
    assert len(pooled) == 1  # no store yet: the pool's way
    storage.put("sync", b"y")
    pooled.clear()

    async def many() -> None:
        await asyncio.gather(*(storage.put_async(f"k{i}", b"z" * i) for i in range(1, 30)))
        with pytest.raises(PreconditionFailed):
            await storage.put_async("k1", b"again", create_only=True)

    asyncio.run(many())
    assert pooled == []
    assert storage.get("k29") == b"z" * 29 and storage.get("first") == b"x"


def test_get_async_keeps_the_contract_of_get(storage: Storage) -> None:
    """What the Zarr store awaits for every chunk object: the same answers as :meth:`get`."""
    storage.put("g/k", b"whole object")
    blobs = {f"g/{i}": bytes([i]) * (i * 1000 + 1) for i in range(20)}
    for key, data in blobs.items():
        storage.put(key, data)

    async def reads() -> None:
        assert await storage.get_async("g/k") == b"whole object"
        with pytest.raises(ObjectNotFound) as info:
            await storage.get_async("g/absent")
        assert info.value.key == "g/absent"
        got = await asyncio.gather(*(storage.get_async(k) for k in blobs))
        assert got == list(blobs.values())
        with pytest.raises(ObjectNotFound):
            await storage.get_async("g/absent", (0, 10))

    asyncio.run(reads())


def test_ranged_get_async_keeps_the_contract_of_get(storage: Storage) -> None:
    """What the Zarr store awaits for a chunk in a pack: the bytes of the range that exist, and
    nothing for a range at or past the end, as :meth:`get` answers."""
    data = bytes(range(256)) * 4
    storage.put("obj", data)

    async def reads() -> list[bytes]:
        return list(await asyncio.gather(*(storage.get_async("obj", r) for r, _ in RANGES)))

    got = asyncio.run(reads())
    for (byte_range, expect), answer in zip(RANGES, got, strict=True):
        assert answer == data[expect] == storage.get("obj", byte_range), byte_range


def test_s3_get_async_is_awaited_on_the_loop_once_its_store_exists(s3_server) -> None:  # type: ignore[no-untyped-def]
    """As ``put_async``: no thread of the I/O pool once a sync request has built the store."""
    storage = s3_server.storage(f"get-async-{random.getrandbits(32):08x}")
    storage_fresh = s3_server.storage(storage.prefix)
    for i in range(1, 30):
        storage.put(f"k{i}", b"z" * i)
    pooled = _pool_calls(storage_fresh)
    assert asyncio.run(storage_fresh.get_async("k1")) == b"z"
    assert len(pooled) == 1  # no store yet: the pool's way
    pooled.clear()

    async def many() -> list[bytes]:
        return list(await asyncio.gather(*(storage_fresh.get_async(f"k{i}") for i in range(1, 30))))

    assert asyncio.run(many()) == [b"z" * i for i in range(1, 30)]

    async def ranges() -> list[bytes]:
        return list(
            await asyncio.gather(
                *(storage_fresh.get_async(f"k{i}", (1, i + 3)) for i in range(1, 30)),
                *(storage_fresh.get_async(f"k{i}", (i, i + 5)) for i in range(1, 30)),
            )
        )

    # Ranged reads (a chunk in a pack) too: running past the end (what there is), and starting
    # at it (the server's 416: nothing).
    assert asyncio.run(ranges()) == [b"z" * (i - 1) for i in range(1, 30)] + [b""] * 29
    assert pooled == []
    with pytest.raises(ObjectNotFound):
        asyncio.run(storage_fresh.get_async("absent"))
    with pytest.raises(ObjectNotFound):
        asyncio.run(storage_fresh.get_async("absent", (0, 5)))


def test_with_retries_async_retries_transient_errors_only() -> None:
    fn, calls = flaky(3, lambda: TransientStorageError("slow down"))

    async def afn() -> str:
        return fn()

    assert asyncio.run(with_retries_async(afn, base_delay=0)) == "ok"
    assert len(calls) == 4
    fn, calls = flaky(1, lambda: PreconditionFailed("k"))
    with pytest.raises(PreconditionFailed):
        asyncio.run(with_retries_async(afn, base_delay=0))
    assert len(calls) == 1
    fn, calls = flaky(100, lambda: TransientStorageError("down"))
    with pytest.raises(TransientStorageError):
        asyncio.run(with_retries_async(afn, attempts=3, base_delay=0))
    assert len(calls) == 3


def test_check_conditional_writes(storage: Storage) -> None:
    # A backend that makes create-only writes atomic itself has nothing to ask; on S3 the
    # server is asked (both test servers keep them), at a key the caller reserves, left in place.
    storage.check_conditional_writes("probe")
    storage.check_conditional_writes("probe")  # answered from memory
    if storage.conditional_writes_by_server:
        assert storage.list_keys() == ["probe"] and storage.get("probe") == b""
        # Another client finds the object there: its create-only write is refused, as it must.
        Storage.from_url(storage.url).check_conditional_writes("probe")
        assert storage.list_keys() == ["probe"]
    else:
        assert storage.list_keys() == []


def payload_for(writer: int, key: str, size: int = 2048) -> bytes:
    stamp = f"{writer}:{key}|".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


def test_racing_create_only_threads(storage: Storage, request: pytest.FixtureRequest) -> None:
    writers, rounds = 8, 6
    if request.node.callspec.params["storage"] == "s3-seaweedfs":
        # SeaweedFS answers the losers of a create-only race after waiting in whole seconds
        # (1 s, 2 s, 3 s: a lock it polls each second): fewer of them, to keep the suite fast.
        writers, rounds = 4, 3
    barrier = threading.Barrier(writers)
    wins: dict[str, list[int]] = {f"race/{r}": [] for r in range(rounds)}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(w: int) -> None:
        for key in wins:
            barrier.wait()
            try:
                storage.put(key, payload_for(w, key), create_only=True)
                with lock:
                    wins[key].append(w)
            except PreconditionFailed:
                pass
            except BaseException as e:  # anything else is a failure of the test
                errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for key, winners in wins.items():
        assert len(winners) == 1, f"{key}: winners {winners}"
        assert storage.get(key) == payload_for(winners[0], key)


def _race_worker(
    root: str,
    keys: list[str],
    writer: int,
    barrier: mp.synchronize.Barrier,
    out: mp.Queue[tuple[int, list[str], str | None]],
) -> None:
    store = Storage.local(root)
    won: list[str] = []
    try:
        for key in keys:
            barrier.wait(30)
            try:
                store.put(key, payload_for(writer, key, 64 * 1024), create_only=True)
                won.append(key)
            except PreconditionFailed:
                pass
        out.put((writer, won, None))
    except BaseException as e:
        out.put((writer, won, repr(e)))


def test_racing_create_only_processes_local(tmp_path: Path) -> None:
    root = str(tmp_path / "repo")
    writers = 4
    keys = [f"refs/branch.main/{i:016x}" for i in range(12)]
    barrier = FORK.Barrier(writers)
    out = FORK.Queue()
    procs = [
        FORK.Process(target=_race_worker, args=(root, keys, w, barrier, out))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert all(err is None for _, _, err in results), results
    store = Storage.local(root)
    for key in keys:
        winners = [w for w, won, _ in results if key in won]
        assert len(winners) == 1, f"{key}: winners {winners}"
        assert store.get(key) == payload_for(winners[0], key, 64 * 1024)
    assert keys_of(store.list()) == sorted(keys)  # no temporary files visible


# -- listing ---------------------------------------------------------------------------------------
# The listing contract (zarrlake.storage.base) and nothing more: complete by plain prefix, each key
# once; ascending only among keys of one length directly in one folder; list_dirs names every
# folder that holds an object, and may name emptied ones. SeaweedFS, for one, lists folder by
# folder ("a/1" before "a-b/c") and keeps emptied folders: these tests hold on it as on moto.

LIST_KEYS = [
    "a/1",
    "a/2",
    "a/10",
    "a-b/c",
    "ab",
    "b/x/y/z",
    "refs/branch.main/fffffffffffffffe",
    "refs/branch.main/ffffffffffffffff",
    "refs/branch.ma/ffffffffffffffff",
    "refs/tag.v1",
    "refs/tagdel.v0",
    "z",
]


def fill(storage: Storage, keys: list[str]) -> None:
    shuffled = list(keys)
    random.Random(3).shuffle(shuffled)
    for key in shuffled:
        storage.put(key, key.encode())


def assert_listing(listed: list[str], expected: Iterable[str], context: object = "") -> None:
    """``listed`` is a listing of exactly ``expected`` as the contract allows it to be: every key
    once, in an order that is ascending among keys of one length in one folder."""
    assert sorted(listed) == sorted(expected), context
    assert len(set(listed)) == len(listed), f"{context}: a key listed twice"
    runs: dict[tuple[str, int], list[str]] = {}
    for key in listed:
        folder, _, name = key.rpartition("/")
        runs.setdefault((folder, len(name)), []).append(key)
    for (folder, width), keys in runs.items():
        assert keys == sorted(keys), f"{context}: {folder}/ names of {width} out of order"


PREFIXES = [
    "",
    "a",
    "a/",
    "a/1",
    "a-",
    "ab",
    "b/x/",
    "refs/",
    "refs/branch.ma",
    "refs/branch.main/",
    "refs/tag.",
    "refs/tagdel.",
    "zz",
    "nothing/",
]


def test_list_is_complete_by_plain_prefix(storage: Storage) -> None:
    # Prefixes that end inside a name ("refs/tag.", "a-") select as plainly as folders do: the
    # engine lists tags and tombstones so.
    fill(storage, LIST_KEYS)
    for prefix in PREFIXES:
        infos = list(storage.list(prefix))
        expected = [k for k in LIST_KEYS if k.startswith(prefix)]
        assert_listing([i.key for i in infos], expected, prefix)
        for info in infos:
            assert info.size == len(info.key.encode())
            assert_recent(info.modified)
        assert_listing(storage.list_keys(prefix), expected, prefix)


def test_list_nested_folders_by_prefix(storage: Storage) -> None:
    # '-' and '.' sort before '/', '0' after it: a listing that walks folders (SeaweedFS) yields
    # another order than one sorted by whole keys (moto), and both keep the contract.
    keys = ["d/x-y", "d/x.z", "d/x/1", "d/x/2/3", "d/x/2-4", "d/x0", "d/y", "e"]
    fill(storage, keys)
    for prefix in ["", "d/", "d/x", "d/x/", "d/x/2", "d/x/2/", "d/y", "e"]:
        assert_listing(keys_of(storage.list(prefix)), [k for k in keys if k.startswith(prefix)])
        # The first few keys, as a listing of them alone finds them (a local one orders each
        # folder only as far as it is read).
        whole = storage.list_keys(prefix)
        for limit in (1, 2, 3, 20):
            assert storage.list_keys(prefix, limit=limit) == whole[:limit]


def test_list_orders_fixed_width_names_in_one_folder(storage: Storage) -> None:
    # The one order the engine relies on: a branch journal's entries, 16 hex digits numbered so
    # that the newest is the smallest; a listing of one key finds the head.
    folder = "refs/branch.main/"
    entries = [folder + f"{(1 << 64) - 1 - seq:016x}" for seq in range(40)]
    fill(storage, [*entries, "refs/branch.main-x/0000000000000000", "refs/tag.main"])
    assert storage.list_keys(folder) == sorted(entries)
    assert keys_of(storage.list(folder)) == sorted(entries)
    assert storage.list_keys(folder, limit=1) == [entries[-1]]  # the newest
    assert storage.list_keys(folder, limit=3) == sorted(entries)[:3]
    storage.delete_many(entries[-2:])  # the journal's newest entries pruned (compaction never
    assert storage.list_keys(folder, limit=1) == [entries[-3]]  # does this; a reset could)


def test_list_while_deleting(storage: Storage) -> None:
    # Garbage collection deletes what it has listed while the listing goes on: objects deleted
    # behind the cursor or ahead of it never make the listing fail or skip a living object (an
    # object deleted ahead may still be listed, depending on how much the backend read ahead).
    keys = [f"c/{i:02x}/{j:04d}" for i in range(4) for j in range(50)]
    fill(storage, keys)
    seen: list[str] = []
    for info in storage.list("c/"):
        seen.append(info.key)
        if len(seen) == 10:
            storage.delete_many(keys[100:150])  # ahead, or behind: a whole folder's objects
        storage.delete_many([info.key])
    assert_listing(seen, seen)
    assert set(keys) - set(keys[100:150]) <= set(seen) <= set(keys)
    assert list(storage.list("c/")) == []


def test_list_keys_limit(storage: Storage) -> None:
    fill(storage, LIST_KEYS)
    for limit in [0, 1, 2, 5, len(LIST_KEYS), len(LIST_KEYS) + 5, 5000]:
        some = storage.list_keys(limit=limit)  # ``limit`` of them, whichever the server lists
        assert len(some) == min(limit, len(LIST_KEYS)), limit
        assert_listing(some, set(some) & set(LIST_KEYS), limit)
    branch = sorted(k for k in LIST_KEYS if k.startswith("refs/branch.main/"))
    assert storage.list_keys("refs/branch.main/", limit=1) == branch[:1]  # the newest entry
    assert storage.list_keys("refs/branch.main/", limit=1) == ["refs/branch.main/fffffffffffffffe"]
    assert storage.list_keys("nothing/", limit=1) == []


def test_list_dirs(storage: Storage) -> None:
    fill(storage, ["d/a/1", "d/a/2", "d/b/x/y", "d/c", "d/a-b/1", "e/1", "top"])
    dirs = storage.list_dirs("d/")
    assert len(dirs) == len(set(dirs))
    assert sorted(dirs) == ["a", "a-b", "b"]  # "c" is an object, not a folder
    assert sorted(storage.list_dirs("")) == ["d", "e"]
    assert storage.list_dirs("d/b/") == ["x"]
    assert storage.list_dirs("nothing/") == []
    assert storage.list_dirs("d/a/") == []
    # A folder whose objects are all gone holds nothing, though it may still be named (SeaweedFS
    # keeps it): every folder that holds an object is named, once.
    storage.delete_many(["d/b/x/y", "e/1"])
    dirs = storage.list_dirs("d/")
    assert len(dirs) == len(set(dirs)) and {"a", "a-b"} <= set(dirs) <= {"a", "a-b", "b"}
    assert {"d"} <= set(storage.list_dirs("")) <= {"d", "e"}
    for gone in ["d/b/", "d/b/x/", "e/"]:
        assert storage.list_keys(gone) == []
        assert set(storage.list_dirs(gone)) <= ({"x"} if gone == "d/b/" else set())


def test_list_on_empty_storage(storage: Storage) -> None:
    assert list(storage.list()) == []
    assert storage.list_keys(limit=1) == []
    assert storage.list_dirs("") == []
    assert storage.list_dirs("refs/") == []


# -- delete ----------------------------------------------------------------------------------------


def test_delete_many(storage: Storage) -> None:
    fill(storage, ["x/1", "x/2", "x/3", "y/1"])
    assert storage.delete_many(["x/1", "x/3", "never/was", "x/1"]) == 4
    assert sorted(storage.list_keys()) == ["x/2", "y/1"]
    assert storage.delete_many(iter(["y/1"])) == 1  # any iterable
    assert storage.delete_many([]) == 0
    assert storage.list_keys() == ["x/2"]
    with pytest.raises(ObjectNotFound):
        storage.get("x/1")


def test_more_than_a_thousand_keys(storage: Storage) -> None:
    # S3 pages listings and batches deletes by 1000: cross both boundaries, with a thousand
    # folders and with a thousand fixed-width names in one folder (ordered across pages).
    n = 1005
    keys = [f"d/{i:04d}/x" for i in range(n)]
    journal = [f"j/{(1 << 64) - 1 - seq:016x}" for seq in range(n)]
    storage.map(lambda k: storage.put(k, b"."), keys + journal)
    storage.put("keep", b"k")
    assert_listing(storage.list_keys("d/"), keys)
    some = storage.list_keys("d/", limit=1002)
    assert len(some) == 1002 and set(some) <= set(keys)
    assert sorted(storage.list_dirs("d/")) == [f"{i:04d}" for i in range(n)]
    assert storage.list_keys("j/") == sorted(journal)
    assert storage.list_keys("j/", limit=1002) == sorted(journal)[:1002]
    absent = [f"absent/{i}" for i in range(1200)]
    # present keys at both ends of every batch, among many absent ones
    requested = absent[:999] + keys[:2] + absent[999:] + keys[2:] + journal
    assert storage.delete_many(requested) == len(requested)
    assert storage.list_keys() == ["keep"]


# -- head ------------------------------------------------------------------------------------------


def test_head(storage: Storage) -> None:
    storage.put("h/obj", b"x" * 1234)
    info = storage.head("h/obj")
    assert info is not None
    assert info.key == "h/obj"
    assert info.size == 1234
    assert isinstance(info.modified, dt.datetime)
    assert_recent(info.modified)
    listed = next(iter(storage.list("h/")))
    assert (listed.key, listed.size) == ("h/obj", 1234)
    assert abs(listed.modified - info.modified) < dt.timedelta(seconds=2)
    storage.put("h/obj", b"yy")
    assert storage.head("h/obj").size == 2  # type: ignore[union-attr]


# -- pickling and URLs -----------------------------------------------------------------------------


def test_pickled_storage_works(storage: Storage) -> None:
    storage.put("before", b"1")
    assert storage.map(storage.get, ["before", "before"]) == [b"1", b"1"]  # pool now exists
    if isinstance(storage, S3Storage):
        assert storage.client is not None  # and a client
    copy = pickle.loads(pickle.dumps(storage))
    assert type(copy) is type(storage)
    assert copy.url == storage.url
    assert copy.get("before") == b"1"
    copy.put("after", b"2", create_only=True)
    assert copy.get("after") == b"2"
    assert copy.map(copy.get, ["before", "after"]) == [b"1", b"2"]
    if storage.durable:  # the copy is the same store
        assert storage.get("after") == b"2"
        with pytest.raises(PreconditionFailed):
            copy.put("before", b"x", create_only=True)
    else:  # a memory store's copy is a snapshot of its contents
        assert storage.head("after") is None
    assert pickle.loads(pickle.dumps(copy)).get("before") == b"1"


def test_url_round_trip(storage: Storage) -> None:
    storage.put("u", b"v")
    again = Storage.from_url(storage.url)
    assert type(again) is type(storage)
    assert again.url == storage.url
    if storage.durable:
        assert again.get("u") == b"v"
        again.put("w", b"x")
        assert storage.get("w") == b"x"


def test_from_url_file_and_paths(tmp_path: Path) -> None:
    root = tmp_path / "with space" / "ünï"
    s1 = Storage.from_url(root.as_uri())
    s2 = Storage.from_url(str(root))
    s3 = Storage.from_url("file://" + str(root))
    for s in (s1, s2, s3):
        assert isinstance(s, LocalStorage)
        assert s.root == root
    s1.put("k", b"v")
    assert s2.get("k") == b"v"
    assert (root / "k").read_bytes() == b"v"
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        rel = Storage.from_url("relative/dir")
        assert isinstance(rel, LocalStorage)
        assert rel.root == tmp_path / "relative" / "dir"  # resolved when created
    finally:
        os.chdir(cwd)
    assert rel.root == tmp_path / "relative" / "dir"  # and stays put when the process moves on


def test_from_url_memory() -> None:
    a = Storage.from_url("memory://")
    b = Storage.from_url("memory://")
    assert isinstance(a, MemoryStorage) and isinstance(b, MemoryStorage)
    assert a.url == "memory://"
    a.put("k", b"v")
    assert b.head("k") is None  # each URL opens a fresh, private store
    assert not a.durable


def test_from_url_s3(s3_server) -> None:  # type: ignore[no-untyped-def]
    url = f"s3://{s3_server.bucket}/deep/prefix?endpoint_url={s3_server.endpoint}&region=us-east-1"
    s = Storage.from_url(url)
    assert isinstance(s, S3Storage)
    assert (s.bucket, s.prefix, s.endpoint_url, s.region) == (
        s3_server.bucket,
        "deep/prefix/",
        s3_server.endpoint,
        "us-east-1",
    )
    assert s.allow_http  # an explicit http:// endpoint in a URL is consent enough
    s.put("k", b"via url")
    assert s3_server.storage("deep/prefix").get("k") == b"via url"
    assert s3_server.storage("deep").list_keys() == ["prefix/k"]
    bare = Storage.from_url("s3a://bucket?region=eu-west-1")
    assert isinstance(bare, S3Storage)
    assert (bare.bucket, bare.prefix, bare.endpoint_url, bare.region) == (
        "bucket",
        "",
        None,
        "eu-west-1",
    )
    assert not bare.allow_http


@pytest.mark.parametrize(
    "url", ["nosuch://bucket/p", "ftp://h/p", "s3://", "s3:///p", "http:///p", "https://h/p?x=1"]
)
def test_from_url_rejects(url: str) -> None:
    with pytest.raises(StorageError):
        Storage.from_url(url)


def test_s3_plain_http_needs_allow_http() -> None:
    with pytest.raises(StorageError, match="allow_http"):
        Storage.s3("bucket", endpoint_url="http://127.0.0.1:9000")
    assert isinstance(Storage.s3("bucket", endpoint_url="https://s3.example.com"), S3Storage)
    assert isinstance(
        Storage.s3("bucket", endpoint_url="http://127.0.0.1:9000", allow_http=True), S3Storage
    )


def test_s3_credentials_travel_only_if_given(s3_server) -> None:  # type: ignore[no-untyped-def]
    explicit = s3_server.storage()
    implicit = Storage.s3(s3_server.bucket, "p", endpoint_url=s3_server.endpoint, allow_http=True)
    assert b"testing" in pickle.dumps(explicit)
    assert b"testing" not in pickle.dumps(implicit)
    assert "testing" not in explicit.url and "testing" not in repr(explicit)


def test_s3_prefixes_are_isolated(s3_server) -> None:  # type: ignore[no-untyped-def]
    tag = os.urandom(4).hex()
    p, p2 = s3_server.storage(f"iso-{tag}/p"), s3_server.storage(f"iso-{tag}/p-2")
    p.put("k", b"1")
    p2.put("k", b"2")
    assert p.list_keys() == ["k"] and p2.list_keys() == ["k"]
    assert p.get("k") == b"1" and p2.get("k") == b"2"
    assert sorted(s3_server.storage(f"iso-{tag}").list_dirs("")) == ["p", "p-2"]
    p.delete_many(["k"])
    assert p2.get("k") == b"2"


# -- retries -------------------------------------------------------------------------------------


def flaky(failures: int, error: Callable[[], Exception]) -> tuple[Callable[[], str], list[int]]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise error()
        return "ok"

    return fn, calls


def test_with_retries_retries_transient_errors() -> None:
    fn, calls = flaky(3, lambda: TransientStorageError("slow down"))
    assert with_retries(fn, base_delay=0) == "ok"
    assert len(calls) == 4


def test_with_retries_gives_up() -> None:
    fn, calls = flaky(100, lambda: TransientStorageError("down"))
    with pytest.raises(TransientStorageError):
        with_retries(fn, attempts=5, base_delay=0)
    assert len(calls) == 5


@pytest.mark.parametrize(
    "error",
    [
        lambda: PreconditionFailed("k"),
        lambda: ObjectNotFound("k"),
        lambda: StorageError("denied"),
        lambda: ValueError("bug"),
    ],
)
def test_with_retries_never_retries_answers_or_hard_errors(error: Callable[[], Exception]) -> None:
    fn, calls = flaky(1, error)
    with pytest.raises(type(error())):
        with_retries(fn, base_delay=0)
    assert len(calls) == 1


def test_with_retries_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each retry sleeps up to twice as long as the one before (full jitter): the sleeps asked
    for, not the clock (a loaded machine stretches those)."""
    import zarrlake.storage.base as base

    slept: list[float] = []

    class Clock:
        """The storage module's ``time``, sleeping only on paper (other threads of this process
        keep the real ``time.sleep``)."""

        sleep = staticmethod(slept.append)

        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

    monkeypatch.setattr(base, "time", Clock())
    fn, calls = flaky(3, lambda: TransientStorageError("x"))
    with_retries(fn, base_delay=0.001)
    assert len(calls) == 4
    assert len(slept) == 3 and all(0 <= d <= 0.001 * 2**i for i, d in enumerate(slept)), slept


# -- S3 failures -----------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def s3_at(port: int) -> Storage:
    return Storage.s3(
        "bucket",
        "prefix",
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        access_key_id="a",
        secret_access_key="b",
        allow_http=True,
    )


@pytest.mark.parametrize("op", ["get", "put", "head", "list"])
def test_s3_unreachable_is_a_transient_storage_error(op: str) -> None:
    s = s3_at(closed_port())
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: s.get("k"),
        "put": lambda: s.put("k", b"v", create_only=True),
        "head": lambda: s.head("k"),
        "list": lambda: s.list_keys(),
    }
    start = time.monotonic()
    with pytest.raises(TransientStorageError) as info:
        calls[op]()
    assert time.monotonic() - start < 8, "retrying a dead endpoint took too long"
    assert "127.0.0.1" in str(info.value)


def read_request(conn: socket.socket) -> bytes:
    """Read one whole HTTP request, so that closing the socket sends FIN, not RST."""
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(1 << 16)
        if not part:
            return data
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    headers = head.decode("latin-1").lower()
    if "expect: 100-continue" in headers:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "transfer-encoding: chunked" in headers:
        while not body.endswith(b"0\r\n\r\n"):
            part = conn.recv(1 << 16)
            if not part:
                break
            body += part
    else:
        length = 0
        for line in headers.split("\r\n"):
            if line.startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        while len(body) < length:
            part = conn.recv(1 << 16)
            if not part:
                break
            body += part
    return head + b"\r\n\r\n" + body


class FaultyServer:
    """A loopback HTTP server that answers every request the same (wrong) way and counts them."""

    def __init__(self, respond: Callable[[socket.socket], None]) -> None:
        self.respond = respond
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    read_request(conn)
                    self.requests += 1
                    self.respond(conn)

    def close(self) -> None:
        self.sock.close()


def xml_error(status: str, code: str) -> Callable[[socket.socket], None]:
    body = (
        "<?xml version='1.0' encoding='UTF-8'?>"
        f"<Error><Code>{code}</Code><Message>m</Message></Error>"
    )

    def respond(conn: socket.socket) -> None:
        conn.sendall(
            f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n{body}".encode()
        )

    return respond


def hang_up(conn: socket.socket) -> None:
    pass  # close without a response


def short_body(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n0123456789")


@pytest.mark.parametrize(
    ("respond", "op", "error", "requests"),
    [
        (xml_error("503 Slow Down", "SlowDown"), "get", TransientStorageError, DEFAULT_ATTEMPTS),
        (
            xml_error("500 Internal Server Error", "InternalError"),
            "put",
            TransientStorageError,
            DEFAULT_ATTEMPTS,
        ),
        (hang_up, "get", TransientStorageError, DEFAULT_ATTEMPTS),
        (hang_up, "put", TransientStorageError, DEFAULT_ATTEMPTS),
        (short_body, "get", TransientStorageError, DEFAULT_ATTEMPTS),
        (xml_error("412 Precondition Failed", "PreconditionFailed"), "put", PreconditionFailed, 1),
        (xml_error("404 Not Found", "NoSuchKey"), "get", ObjectNotFound, 1),
        (xml_error("403 Forbidden", "AccessDenied"), "get", StorageError, 1),
    ],
    ids=[
        "503-get",
        "500-put",
        "hangup-get",
        "hangup-put",
        "short-body",
        "412-put",
        "404-get",
        "403-get",
    ],
)
def test_s3_server_faults(
    respond: Callable[[socket.socket], None], op: str, error: type[Exception], requests: int
) -> None:
    server = FaultyServer(respond)
    try:
        s = s3_at(server.port)
        with pytest.raises(error) as info:
            if op == "get":
                s.get("k")
            else:
                s.put("k", b"v", create_only=True)
        if error is StorageError:
            assert not isinstance(
                info.value, (TransientStorageError, ObjectNotFound, PreconditionFailed)
            )
        # Transient faults are retried by with_retries alone (botocore must not multiply them);
        # answers and hard errors are not retried at all.
        assert server.requests == requests
    finally:
        server.close()


def short_partial_body(conn: socket.socket) -> None:
    conn.sendall(
        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-4/100\r\nContent-Length: 5\r\n"
        b"Connection: close\r\n\r\n01"
    )


@pytest.mark.parametrize(
    ("respond", "byte_range", "error", "requests"),
    [
        *[
            (xml_error("503 Slow Down", "SlowDown"), r, TransientStorageError, DEFAULT_ATTEMPTS)
            for r in (None, (0, 5))
        ],
        *[(hang_up, r, TransientStorageError, DEFAULT_ATTEMPTS) for r in (None, (0, 5))],
        (short_body, None, TransientStorageError, DEFAULT_ATTEMPTS),
        (short_partial_body, (0, 5), TransientStorageError, DEFAULT_ATTEMPTS),
        *[(xml_error("404 Not Found", "NoSuchKey"), r, ObjectNotFound, 1) for r in (None, (0, 5))],
        *[(xml_error("403 Forbidden", "AccessDenied"), r, StorageError, 1) for r in (None, (0, 5))],
    ],
    ids=[
        f"{fault}-{part}"
        for fault in ("503", "hangup", "short-body", "404", "403")
        for part in ("whole", "range")
    ],
)
def test_s3_server_faults_of_reads_awaited_on_the_loop(
    respond: Callable[[socket.socket], None],
    byte_range: tuple[int, int] | None,
    error: type[Exception],
    requests: int,
) -> None:
    """``get_async`` of a whole object and of a range, once this process's store exists (awaited
    on the event loop, no I/O thread): the retries and errors of ``get``."""
    server = FaultyServer(respond)
    try:
        s = s3_at(server.port)
        with pytest.raises(error):
            s.get("k", byte_range)  # builds the store, and answers as get_async must
        pooled = _pool_calls(s)
        server.requests = 0
        with pytest.raises(error) as info:
            asyncio.run(s.get_async("k", byte_range))
        if error is StorageError:
            assert not isinstance(info.value, (TransientStorageError, ObjectNotFound))
        assert server.requests == requests
        assert pooled == []
    finally:
        server.close()


def test_s3_requests_awaited_on_a_loop_keep_to_the_storage_concurrency(moto_s3: Any) -> None:
    """As many requests in flight as the I/O pool would have threads (``concurrency``), however
    many reads and writes Zarr awaits at once."""
    with HeaderStrippingProxy(moto_s3.endpoint, drop=()) as proxy:
        storage = Storage.s3(
            moto_s3.bucket,
            f"in-flight-{random.getrandbits(32):08x}",
            endpoint_url=proxy.endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
        )
        storage.concurrency = 3  # type: ignore[misc]
        storage.put("first", b"x")  # builds the store: the rest is awaited on the loop
        pooled = _pool_calls(storage)

        async def many() -> list[bytes]:
            await asyncio.gather(*(storage.put_async(f"k{i}", bytes([i]) * 100) for i in range(40)))
            return list(
                await asyncio.gather(
                    *(storage.get_async(f"k{i}") for i in range(40)),
                    *(storage.get_async(f"k{i}", (10, 20)) for i in range(40)),
                )
            )

        got = asyncio.run(many())
        assert got == [bytes([i]) * 100 for i in range(40)] + [bytes([i]) * 10 for i in range(40)]
        assert pooled == []
        assert len(proxy.requests()) == 121
        assert 1 <= proxy.most_in_flight <= 3, proxy.most_in_flight


# -- local: nothing torn is ever visible -----------------------------------------------------------


def _hammer(root: str, keys: list[str], value: int, size: int) -> None:
    store = Storage.local(root)
    data = bytes([value]) * (size + value)
    for key in keys:
        with contextlib.suppress(PreconditionFailed):
            store.put(key, data, create_only=True)
        store.put("plain", data)  # overwrites are atomic too


def test_local_readers_never_see_a_partial_object(tmp_path: Path) -> None:
    root = str(tmp_path / "repo")
    size = 1 << 20
    keys = [f"k/{i}" for i in range(16)]
    procs = [FORK.Process(target=_hammer, args=(root, keys, v, size)) for v in range(1, 5)]
    store = Storage.local(root)
    first_seen: dict[str, bytes] = {}
    reads = 0
    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs) or reads == 0:
            for key in [*keys, "plain"]:
                try:
                    data = store.get(key)
                except ObjectNotFound:
                    continue
                reads += 1
                assert data and data == bytes([data[0]]) * (size + data[0]), f"torn read of {key}"
                if key != "plain":
                    assert first_seen.setdefault(key, data) == data, f"{key} changed"
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert reads > 0
    for key in keys:
        data = store.get(key)
        assert data == bytes([data[0]]) * (size + data[0])
    assert sorted(keys_of(store.list())) == sorted([*keys, "plain"])


def _write_big(root: str, key: str, size: int, ready: mp.synchronize.Event) -> None:
    data = b"\xab" * size
    ready.set()
    Storage.local(root).put(key, data, create_only=True)


def test_local_killed_writer_leaves_nothing_or_everything(tmp_path: Path) -> None:
    root = str(tmp_path / "repo")
    size = 32 << 20
    rng = random.Random(5)
    for i in range(5):
        ready = FORK.Event()
        proc = FORK.Process(target=_write_big, args=(root, f"big/{i}", size, ready))
        proc.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0, 0.03))
        proc.kill()
        proc.join(30)
        store = Storage.local(root)
        info = store.head(f"big/{i}")
        if info is not None:  # the write finished before the kill: all of it
            assert info.size == size
            assert store.get(f"big/{i}") == b"\xab" * size
        assert [k for k in store.list_keys() if not k.startswith("big/")] == []  # no temp files
        assert ".tmp" not in store.list_dirs("")


def test_local_temp_files_are_invisible(tmp_path: Path) -> None:
    store = Storage.local(tmp_path)
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "leftover").write_bytes(b"partial")
    store.put("real", b"x")
    assert store.list_keys() == ["real"]
    assert store.list_dirs("") == []


def test_local_rejects_escaping_keys(tmp_path: Path) -> None:
    store = Storage.local(tmp_path / "repo")
    (tmp_path / "outside").write_bytes(b"secret")
    for key in ["../outside", "a/../../outside", "/abs", "", "a\0b"]:
        with pytest.raises(StorageError):
            store.put(key, b"x")
        with pytest.raises(StorageError):  # reads take another path to the file: checked alike
            store.get(key)
        with pytest.raises(StorageError):
            store.get(key, (0, 2))
    assert (tmp_path / "outside").read_bytes() == b"secret"


def test_zarrlake_exports_storage() -> None:
    assert zarrlake.Storage is Storage


# -- capabilities, the factory, the registry -------------------------------------------------------

CAPABILITIES = {
    # kind: (durable, shared_across_processes)
    MemoryStorage: (False, False),
    LocalStorage: (True, True),
    S3Storage: (True, True),
    AzureStorage: (True, True),
    GCSStorage: (True, True),
}


def test_capabilities_are_declared(storage: Storage) -> None:
    durable, shared = CAPABILITIES[type(storage)]
    assert (storage.durable, storage.shared_across_processes) == (durable, shared)
    # The branch journal needs atomic create-only writes and packs need ranged reads: every
    # backend that holds repositories offers both.
    assert storage.supports_conditional_writes and storage.supports_byte_ranges
    assert storage.concurrency >= 1
    # Declared on the class, not discovered per instance.
    for name in (
        "durable",
        "shared_across_processes",
        "supports_conditional_writes",
        "supports_byte_ranges",
        "concurrency",
    ):
        assert getattr(type(storage), name) == getattr(storage, name)


def test_map_inside_map_finishes(storage: Storage) -> None:
    # An I/O function that maps in turn (reading a branch's head while listing every branch) runs
    # on the pool it would wait on: with every thread busy, it must not wait forever.
    for i in range(2):
        storage.put(f"k{i}", bytes([i]))
    results: list[list[list[bytes]]] = []

    def outer(_: int) -> list[bytes]:
        return storage.map(storage.get, ["k0", "k1"])

    worker = threading.Thread(
        target=lambda: results.append(storage.map(outer, range(storage.concurrency * 2))),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "a nested map waited forever on its own pool"
    assert results == [[[b"\x00", b"\x01"]] * (storage.concurrency * 2)]


def test_map_reads_runs_in_place_where_reads_are_cheap_and_keeps_order(storage: Storage) -> None:
    # Small reads of a local or memory storage cost less than a thread hand-off: map_reads runs
    # them in the caller's thread; over a network it fans them out as map does. Same results.
    keys = [f"r{i}" for i in range(12)]
    for i, k in enumerate(keys):
        storage.put(k, bytes([i]))
    threads: set[int] = set()

    def read(key: str) -> bytes:
        threads.add(threading.get_ident())
        return storage.get(key)

    assert storage.map_reads(read, reversed(keys)) == [bytes([i]) for i in reversed(range(12))]
    if storage.inline_read_bytes:
        assert threads == {threading.get_ident()}
    else:
        assert threading.get_ident() not in threads


def test_start_read_starts_a_read_where_reads_are_slow_and_waits_where_they_are_cheap(
    storage: Storage,
) -> None:
    # log() lists the expiry marks while it finds a branch head: over a network the read starts
    # at once on the pool; where reads run in place it runs when its result is asked for.
    storage.put("k", b"v")
    started = threading.Event()
    threads: list[int] = []

    def read() -> bytes:
        threads.append(threading.get_ident())
        started.set()
        return storage.get("k")

    result = storage.start_read(read)
    if storage.inline_read_bytes:
        assert not started.is_set()
        assert result() == b"v" and threads == [threading.get_ident()]
    else:
        assert started.wait(10)  # before anyone asks
        assert result() == b"v" and threading.get_ident() not in threads
    assert result() == b"v" and len(threads) == 1  # read once

    def missing() -> bytes:
        return storage.get("nope")

    with pytest.raises(ObjectNotFound):
        storage.start_read(missing)()


def test_map_writes_runs_a_small_round_in_place_where_writes_are_cheap(storage: Storage) -> None:
    # A commit's round of small writes costs less made in the caller's thread on a local or
    # memory storage than the hand-offs to the pool; elsewhere, and for a round too large,
    # map_writes fans out as map does. The same objects and results either way, in order.
    threads: set[int] = set()

    def write(i: int) -> int:
        threads.add(threading.get_ident())
        storage.put(f"w{i}", bytes([i]), create_only=True)
        return i

    assert storage.map_writes(write, range(6), 6) == list(range(6))
    assert [storage.get(f"w{i}") for i in range(6)] == [bytes([i]) for i in range(6)]
    if storage.inline_write_bytes >= 6:
        assert threads == {threading.get_ident()}
    else:
        assert threading.get_ident() not in threads
    threads.clear()
    too_large = storage.inline_write_bytes + 1
    if too_large > 0:  # a round above the bound goes to the pool on every backend
        assert storage.map_writes(lambda i: write(i + 6), range(3), too_large) == [6, 7, 8]
        assert threading.get_ident() not in threads


def test_shared_across_processes_means_a_copy_sees_the_same_objects(storage: Storage) -> None:
    storage.put("seen", b"1")
    copy = pickle.loads(pickle.dumps(storage))
    copy.put("written-by-copy", b"2")
    assert (storage.head("written-by-copy") is not None) is storage.shared_across_processes


def test_one_factory(tmp_path: Path) -> None:
    from zarrlake.storage import from_url

    assert isinstance(from_url("memory://"), MemoryStorage)
    local = from_url(tmp_path.as_uri())
    assert isinstance(local, LocalStorage) and local.root == tmp_path
    assert Storage.from_url(tmp_path.as_uri()).url == local.url
    s3 = from_url("s3://b/p?region=eu-west-1")
    assert isinstance(s3, S3Storage) and (s3.bucket, s3.prefix, s3.region) == (
        "b",
        "p/",
        "eu-west-1",
    )
    with pytest.raises(StorageError, match="unsupported storage URL scheme 'nosuch'"):
        from_url("nosuch://bucket/p")


def test_every_backend_is_a_storage(tmp_path: Path) -> None:
    made = [
        Storage.memory(),
        Storage.local(tmp_path),
        Storage.s3("bucket", "p", region="us-east-1"),
        Storage.from_url("memory://"),
        Storage.from_url(str(tmp_path)),
        Storage.from_url("s3://bucket/p"),
    ]
    for s in made:
        assert isinstance(s, zarrlake.Storage)
    assert [type(s) for s in made] == [MemoryStorage, LocalStorage, S3Storage] * 2


def test_backends_are_registered_by_scheme() -> None:
    from zarrlake.storage.base import backend_for_scheme, register_backend

    assert backend_for_scheme("file") is LocalStorage
    assert backend_for_scheme("memory") is MemoryStorage
    assert backend_for_scheme("s3") is S3Storage and backend_for_scheme("S3A") is S3Storage
    assert backend_for_scheme("https") is HTTPStorage and backend_for_scheme("http") is HTTPStorage
    assert backend_for_scheme("gs") is GCSStorage and backend_for_scheme("abfss") is AzureStorage
    known = "abfs, abfss, az, azure, file, gcs, gs, http, https, memory, s3, s3a"
    with pytest.raises(StorageError, match=f"known: {known}"):
        backend_for_scheme("nosuch")

    class Impostor(MemoryStorage):
        pass

    with pytest.raises(ValueError, match="already served"):
        register_backend("memory")(Impostor)
    assert backend_for_scheme("memory") is MemoryStorage


def test_storage_is_an_abstract_protocol() -> None:
    with pytest.raises(TypeError):
        Storage()  # type: ignore[abstract]

    class Partial(Storage):
        def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
            return b""

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]


def test_delete_stale_deletes_only_what_was_written_before_the_cutoff(storage: Storage) -> None:
    storage.put("chunks/aa/old1", b"1")
    storage.put("chunks/aa/old2", b"22")
    before = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    after = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    deleted, kept = storage.delete_stale(["chunks/aa/old1", "chunks/aa/missing"], before)
    assert deleted == [] and [k.key for k in kept] == ["chunks/aa/old1"]  # too young to go
    assert storage.get("chunks/aa/old1") == b"1"
    deleted, kept = storage.delete_stale(["chunks/aa/old1", "chunks/aa/old2"], after)
    assert sorted((d.key, d.size) for d in deleted) == [
        ("chunks/aa/old1", 1),
        ("chunks/aa/old2", 2),
    ]
    assert kept == [] and storage.list_keys("chunks/") == []


def test_local_delete_stale_puts_back_what_was_rewritten_before_its_turn(tmp_path: Path) -> None:
    """The file is moved away, then judged: one refreshed since the listing goes back in place,
    and a key written again meanwhile keeps its newer content."""
    storage = Storage.local(tmp_path / "s")
    assert storage.atomic_stale_delete
    storage.put("chunks/bb/k", b"old")
    listed = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)  # GC's cutoff at listing time
    storage.set_modified("chunks/bb/k", listed + dt.timedelta(seconds=1))  # a session's refresh
    deleted, kept = storage.delete_stale(["chunks/bb/k"], listed)
    assert deleted == [] and [k.key for k in kept] == ["chunks/bb/k"]
    assert storage.get("chunks/bb/k") == b"old"
    assert not any((tmp_path / "s" / ".tmp").iterdir())  # nothing left aside


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://b/p?alow_http=true", "unknown option alow_http"),
        ("gs://b/p?anonymus=1", "unknown option anonymus"),
        ("az://c/p?account_name=a&bogus=1", "unknown option bogus"),
        ("s3://b/p?anonymous=maybe", "is not true or false"),
    ],
)
def test_a_misspelt_or_unreadable_url_option_is_an_error(url: str, message: str) -> None:
    """A typo must not silently turn a setting off (e.g. anonymous reads signed, or plain HTTP
    refused for a reason the user cannot see)."""
    with pytest.raises(zarrlake.StorageError, match=message):
        zarrlake.Storage.from_url(url)


def test_a_create_only_write_lost_to_an_object_gone_since_is_still_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object a create-only write lost to may be deleted (GC's sweep) before the writer
    looks: the write still lost, and must say so (PreconditionFailed: read back, retry), not
    fail as a storage error. A file where a folder goes is a storage error, and says so."""
    from zarrlake.storage import local

    storage = Storage.local(tmp_path / "s")
    storage.put("chunks/ab/x", b"theirs", create_only=True)
    publish = local._publish

    def swept_right_after(op: Any, tmp: str, path: str) -> None:
        try:
            publish(op, tmp, path)
        except FileExistsError:
            os.unlink(path)  # GC deletes the object the write lost to
            raise

    monkeypatch.setattr(local, "_publish", swept_right_after)
    with pytest.raises(PreconditionFailed):
        storage.put("chunks/ab/x", b"mine", create_only=True)
    monkeypatch.undo()
    (tmp_path / "s" / "file").write_bytes(b"not a folder")
    with pytest.raises(StorageError, match=r"Not a directory|File exists") as e:
        storage.put("file/below", b"x", create_only=True)
    assert not isinstance(e.value, PreconditionFailed)
    (tmp_path / "s" / "dir").mkdir()
    for create_only in (True, False):
        with pytest.raises(StorageError, match="is a directory"):
            storage.put("dir", b"x", create_only=create_only)

"""The Zarr store adapter, held to Zarr's own store contract and used through Zarr's API.

``zarr.testing.store.StoreTests`` is the suite Zarr runs against its own stores. It is run here
against :class:`zarrlake.ZarrlakeStore` over a writable session of a fresh repository on each real
backend (memory, a local directory, S3 via ``moto_server``). Its async tests are driven on Zarr's
own event loop (``zarr.core.sync.sync``), the same loop Zarr's synchronous API uses, so no asyncio
pytest plugin is needed.
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import zarr
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync
from zarr.testing.store import StoreTests

import zarrlake
from backends import make_storage
from zarrlake import Repository, RepositoryConfig, WritableSessionPickled, ZarrlakeStore

T = TypeVar("T")


def _on_zarr_loop(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """A synchronous test function that runs the coroutine test ``fn`` on Zarr's event loop.

    ``functools.wraps`` keeps the signature (pytest's fixture injection follows ``__wrapped__``)
    and the ``pytestmark`` list (``parametrize`` marks) of the original.
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        return sync(fn(*args, **kwargs))

    return run


class _ZarrlakeStoreTests(StoreTests[ZarrlakeStore, Buffer]):
    """Zarr's store contract for ``ZarrlakeStore``; subclasses choose the backend."""

    store_cls = ZarrlakeStore
    buffer_cls = Buffer
    storage_kind: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in dir(StoreTests):
            if name.startswith("test_"):
                fn = getattr(cls, name)
                if inspect.iscoroutinefunction(fn):
                    setattr(cls, name, _on_zarr_loop(fn))

    # -- the fixtures StoreTests asks for -------------------------------------------------------

    @pytest.fixture
    def store_kwargs(self, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
        repo = Repository.create(make_storage(self.storage_kind, tmp_path, request))
        return {"session": repo.writable_session("main")}

    @pytest.fixture
    def store(self, open_kwargs: dict[str, Any]) -> ZarrlakeStore:
        return sync(self.store_cls.open(**open_kwargs))

    @pytest.fixture
    def store_not_open(self, store_kwargs: dict[str, Any]) -> ZarrlakeStore:
        return self.store_cls(**store_kwargs)

    # -- direct access that bypasses the store API ------------------------------------------------

    async def set(self, store: ZarrlakeStore, key: str, value: Buffer) -> None:  # type: ignore[override]
        store.session.write(key, value.to_bytes())

    async def get(self, store: ZarrlakeStore, key: str) -> Buffer:  # type: ignore[override]
        data = store.session.read(key)
        assert data is not None, f"{key} is not in the session"
        return self.buffer_cls.from_bytes(data)

    # -- the abstract tests ------------------------------------------------------------------------

    def test_store_repr(self, store: ZarrlakeStore) -> None:
        assert repr(store) == f"ZarrlakeStore({store.session!r})"
        assert str(store) == f"zarrlake://{store.session.base}"

    def test_store_supports_writes(self, store: ZarrlakeStore) -> None:
        assert store.supports_writes
        assert store.supports_deletes

    def test_store_supports_listing(self, store: ZarrlakeStore) -> None:
        assert store.supports_listing

    def test_serializable_store(self, store: ZarrlakeStore) -> None:  # type: ignore[override]
        """Zarr's contract pickles the (writable) store under test. Ours refuses: writes through
        the copy would never reach the session's commit (a dask worker process would lose them
        silently). A read-only store pickles, and the copy reads what the original reads."""
        with pytest.raises(WritableSessionPickled, match="fork"):
            pickle.dumps(store)
        store.session.write("foo", b"\x01\x02\x03\x04")
        store.session.commit("for the read-only copy")
        repo = Repository.open(store.session.objects.storage)
        view = repo.readonly_session("main").store
        copy = pickle.loads(pickle.dumps(view))
        assert copy == view and copy.read_only
        got = copy.get_sync("foo")
        assert got is not None and got.to_bytes() == b"\x01\x02\x03\x04"


class TestZarrlakeStoreMemory(_ZarrlakeStoreTests):
    storage_kind = "memory"


class TestZarrlakeStoreLocal(_ZarrlakeStoreTests):
    storage_kind = "local"


@pytest.mark.s3
class TestZarrlakeStoreS3(_ZarrlakeStoreTests):
    storage_kind = "s3"


# -------------------------------------------------------------------------------------------------
# Beyond the contract: chunk refs, Zarr's API, commits.
# -------------------------------------------------------------------------------------------------

INLINE_LIMIT = 64


@pytest.fixture
def small_inline_repo(storage: zarrlake.Storage) -> Repository:
    """A repository on each backend whose chunks above 64 bytes become objects."""
    return Repository.create(storage, config=RepositoryConfig(inline_threshold_bytes=INLINE_LIMIT))


RANGES: list[tuple[ByteRequest | None, Callable[[bytes], bytes]]] = [
    (None, lambda d: d),
    (RangeByteRequest(0, 1), lambda d: d[0:1]),
    (RangeByteRequest(3, 17), lambda d: d[3:17]),
    (RangeByteRequest(5, 10_000), lambda d: d[5:]),
    (RangeByteRequest(7, 7), lambda d: b""),
    (OffsetByteRequest(0), lambda d: d),
    (OffsetByteRequest(11), lambda d: d[11:]),
    (OffsetByteRequest(10_000), lambda d: b""),
    (SuffixByteRequest(1), lambda d: d[-1:]),
    (SuffixByteRequest(9), lambda d: d[-9:]),
    (SuffixByteRequest(10_000), lambda d: d),
]


@pytest.mark.parametrize("size", [40, 1000], ids=["inline", "object"])
def test_partial_reads(small_inline_repo: Repository, size: int) -> None:
    data = bytes((i * 7 + 3) % 256 for i in range(size))
    session = small_inline_repo.writable_session()
    session.write("arr/c/0", data)
    ref = session.resolve("arr/c/0")
    # The two kinds of chunk ref really are the ones exercised.
    assert isinstance(ref, tuple)
    assert (ref[1] == data) == (size <= INLINE_LIMIT)
    store = session.store
    proto = default_buffer_prototype()

    def check(s: ZarrlakeStore) -> None:
        for byte_range, expect in RANGES:
            got = sync(s.get("arr/c/0", proto, byte_range))
            assert got is not None
            assert got.to_bytes() == expect(data), byte_range
            sync_got = s.get_sync("arr/c/0", byte_range=byte_range)
            assert sync_got is not None and sync_got.to_bytes() == expect(data), byte_range
        many = sync(s.get_partial_values(proto, [("arr/c/0", r) for r, _ in RANGES]))
        assert [None if b is None else b.to_bytes() for b in many] == [e(data) for _, e in RANGES]
        assert sync(s.getsize("arr/c/0")) == size
        assert sync(s.get("arr/c/1", proto, RangeByteRequest(0, 2))) is None

    check(store)  # uncommitted, read from the session's changeset
    snap = session.commit("one chunk")
    check(small_inline_repo.readonly_session(snap).store)  # committed, read through the manifest


def test_inline_writes_stay_in_memory_and_read_back(small_inline_repo: Repository) -> None:
    # The store writes metadata and inline chunks without the I/O pool; objects go through it.
    s = small_inline_repo.writable_session()
    assert s.writes_in_memory("a/zarr.json", 10_000)
    assert s.writes_in_memory("a/c/0", INLINE_LIMIT)
    assert not s.writes_in_memory("a/c/0", INLINE_LIMIT + 1)
    sizes = (1, INLINE_LIMIT, INLINE_LIMIT + 1, 1000)
    for i, n in enumerate(sizes):
        sync(s.store.set(f"a/c/{i}", Buffer.from_bytes(bytes([i + 1]) * n)))
    s.commit("mixed")
    got = small_inline_repo.readonly_session().store
    for i, n in enumerate(sizes):
        buf = sync(got.get(f"a/c/{i}", default_buffer_prototype()))
        assert buf is not None and buf.to_bytes() == bytes([i + 1]) * n


def test_get_rejects_bad_byte_range(repo: Repository) -> None:
    session = repo.writable_session()
    session.write("c/0", b"abcd")
    with pytest.raises((ValueError, TypeError), match="Unexpected byte_range"):
        sync(session.store.get("c/0", default_buffer_prototype(), (0, 2)))  # type: ignore[arg-type]
    # The check does not depend on the key existing.
    with pytest.raises((ValueError, TypeError), match="Unexpected byte_range"):
        sync(session.store.get("c/9", default_buffer_prototype(), (0, 2)))  # type: ignore[arg-type]


def test_zarr_groups_arrays_attributes(repo: Repository) -> None:
    session = repo.writable_session()
    root = zarr.open_group(session.store, mode="w", zarr_format=3)
    root.attrs["title"] = "zarrlake test"
    sub = root.create_group("sub")
    deep = sub.create_group("deeper")
    deep.attrs.update({"level": 2})
    a = root.create_array("a", shape=(10, 12), chunks=(4, 5), dtype="f8", fill_value=np.nan)
    values = np.arange(120, dtype="f8").reshape(10, 12)
    a[:] = values
    a.attrs["units"] = "m"
    b = sub.create_array("b", shape=(7,), chunks=(3,), dtype="i4")
    b[:] = np.arange(7, dtype="i4") * 3
    c = deep.create_array("c", shape=(), dtype="u1", fill_value=0)
    c[...] = 200

    # Read-your-writes before the commit, through a fresh group handle.
    reread = zarr.open_group(session.store, mode="r")
    np.testing.assert_array_equal(reread["a"][:], values)
    assert sorted(reread.group_keys()) == ["sub"]
    assert sorted(reread.array_keys()) == ["a"]

    snap = session.commit("groups and arrays")

    ro = repo.readonly_session("main")
    assert ro.base == snap
    g = zarr.open_group(ro.store, mode="r")
    assert g.attrs["title"] == "zarrlake test"
    np.testing.assert_array_equal(g["a"][:], values)
    np.testing.assert_array_equal(g["a"][2:7, 3:9], values[2:7, 3:9])
    assert g["a"].attrs["units"] == "m"
    np.testing.assert_array_equal(g["sub/b"][:], np.arange(7, dtype="i4") * 3)
    assert g["sub/deeper"].attrs["level"] == 2
    assert g["sub/deeper/c"][...] == 200
    assert dict(g["sub/deeper"].attrs) == {"level": 2}

    members = dict(g.members(max_depth=None))
    assert set(members) == {"a", "sub", "sub/b", "sub/deeper", "sub/deeper/c"}
    assert isinstance(members["sub/deeper"], zarr.Group)
    assert isinstance(members["sub/deeper/c"], zarr.Array)
    assert {k for k, _ in g.members()} == {"a", "sub"}

    store = ro.store
    listed = sync(_collect(store.list_dir("")))
    assert listed == ["a", "sub", "zarr.json"]
    assert sync(_collect(store.list_dir("a"))) == ["c", "zarr.json"]
    assert sync(_collect(store.list_dir("sub/"))) == ["b", "deeper", "zarr.json"]
    chunk_keys = sorted(sync(_collect(store.list_prefix("a/c/"))))
    assert chunk_keys == sorted(f"a/c/{i}/{j}" for i in range(3) for j in range(3))

    # The diff against the parent names exactly what was created.
    d = repo.diff(next(repo.log("main")).parents[0], "main")
    assert d.added_nodes == {"/", "/a", "/sub", "/sub/b", "/sub/deeper", "/sub/deeper/c"}
    assert d.changed_chunks["/a"] == {(i, j) for i in range(3) for j in range(3)}


async def _collect(it: AsyncIterator[str]) -> list[str]:
    return [x async for x in it]


def test_delete_array_commit_and_reopen(repo: Repository) -> None:
    session = repo.writable_session()
    root = zarr.open_group(session.store, mode="w", zarr_format=3)
    root.create_array("a", shape=(6,), chunks=(2,), dtype="i8")[:] = np.arange(6)
    root.create_array("keep", shape=(4,), chunks=(2,), dtype="i8")[:] = np.arange(4) + 10
    first = session.commit("two arrays")

    s2 = repo.writable_session()
    g = zarr.open_group(s2.store, mode="r+")
    del g["a"]
    assert "a" not in g
    assert s2.read("a/zarr.json") is None and s2.read("a/c/0") is None
    status = s2.status()
    assert status.removed_nodes == {"/a"}
    assert status.changed_chunks == {"/a": {(0,), (1,), (2,)}}
    second = s2.commit("delete a")

    g3 = zarr.open_group(repo.readonly_session("main").store, mode="r")
    assert sorted(g3.array_keys()) == ["keep"]
    with pytest.raises(KeyError):
        g3["a"]
    np.testing.assert_array_equal(g3["keep"][:], np.arange(4) + 10)
    ro = repo.readonly_session("main")
    assert list(ro.list_prefix("a/")) == []
    assert ro.list_dir("") == ["keep", "zarr.json"]
    # The old version still has it.
    old = zarr.open_group(repo.readonly_session(first).store, mode="r")
    np.testing.assert_array_equal(old["a"][:], np.arange(6))
    d = repo.diff(first, second)
    assert d.removed_nodes == {"/a"}
    assert d.changed_chunks == {"/a": {(0,), (1,), (2,)}}


def test_readonly_session_store_rejects_writes(repo: Repository) -> None:
    session = repo.writable_session()
    zarr.open_group(session.store, mode="w").create_array("x", shape=(2,), dtype="u1")[:] = 1
    session.commit("x")
    ro = repo.readonly_session("main")
    store = ro.store
    assert store.read_only and ro.read_only
    buf = Buffer.from_bytes(b"data")
    for op in (
        lambda: sync(store.set("x/c/0", buf)),
        lambda: store.set_sync("x/c/0", buf),
        lambda: sync(store.set_if_not_exists("y/c/0", buf)),
        lambda: sync(store.delete("x/c/0")),
        lambda: store.delete_sync("x/c/0"),
        lambda: sync(store.delete_dir("x")),
        lambda: sync(store.clear()),
        lambda: ro.write("x/c/0", b"data"),
    ):
        with pytest.raises(zarrlake.ReadOnlyError) as info:
            op()
        assert isinstance(info.value, ValueError)
    # A store that claims to be writable over a read-only session still cannot write.
    with pytest.raises(zarrlake.ReadOnlyError):
        sync(store.with_read_only(False).set("x/c/0", buf))
    # Zarr's API surfaces the same error.
    with pytest.raises(ValueError):
        zarr.open_group(store, mode="r+")["x"][:] = 2
    assert ro.read("x/c/0") == repo.readonly_session("main").read("x/c/0")
    np.testing.assert_array_equal(zarr.open_array(store, path="x", mode="r")[:], [1, 1])

    # A committed session turns read-only too.
    s = repo.writable_session()
    s.write("x/c/0", b"\x02")
    s.commit("two")
    with pytest.raises(zarrlake.ReadOnlyError):
        sync(s.store.set("x/c/0", buf))


def test_a_writable_store_refuses_to_pickle_and_a_read_only_one_pickles(repo: Repository) -> None:
    session = repo.writable_session()
    session.write("k/c/0", b"committed")
    for what in (session, session.store):
        with pytest.raises(WritableSessionPickled, match=r"session\.merge\(fork\.changeset"):
            pickle.dumps(what)
    session.commit("one")
    view = repo.readonly_session("main")
    store = pickle.loads(pickle.dumps(view.store))
    assert store == view.store
    got = store.get_sync("k/c/0")
    assert got is not None and got.to_bytes() == b"committed"


def test_overwrite_hierarchy_and_resize(repo: Repository) -> None:
    s1 = repo.writable_session()
    root = zarr.open_group(s1.store, mode="w")
    root.create_array("old", shape=(4,), chunks=(2,), dtype="i2")[:] = 5
    root.create_group("g").create_array("x", shape=(3,), chunks=(3,), dtype="i2")[:] = 1
    first = s1.commit("old layout")

    # mode="w" clears what is there (Zarr deletes the whole store through the adapter).
    s2 = repo.writable_session()
    root = zarr.open_group(s2.store, mode="w", attributes={"layout": 2})
    grow = root.create_array("grow", shape=(4,), chunks=(2,), dtype="i2", fill_value=-1)
    grow[:] = [1, 2, 3, 4]
    assert sorted(s2.list_prefix("")) == [
        "grow/c/0",
        "grow/c/1",
        "grow/zarr.json",
        "zarr.json",
    ]
    s2.commit("new layout")

    s3 = repo.writable_session()
    arr = zarr.open_array(s3.store, path="grow", mode="r+")
    arr.resize((7,))
    arr[4:] = [5, 6, 7]
    assert s3.status().changed_nodes == {"/grow"}
    third = s3.commit("grow")

    g = zarr.open_group(repo.readonly_session().store, mode="r")
    assert g.attrs["layout"] == 2
    assert {k for k, _ in g.members(max_depth=None)} == {"grow"}
    np.testing.assert_array_equal(g["grow"][:], [1, 2, 3, 4, 5, 6, 7])
    old = zarr.open_group(repo.readonly_session(first).store, mode="r")
    np.testing.assert_array_equal(old["old"][:], [5, 5, 5, 5])
    np.testing.assert_array_equal(old["g/x"][:], [1, 1, 1])
    d = repo.diff(first, third)
    assert d.removed_nodes == {"/old", "/g", "/g/x"}
    assert d.added_nodes == {"/grow"}
    assert d.changed_nodes == {"/"}

"""A read never returns bytes other than those committed (issue 44), and what a new user trips
over in naming versions and writing datasets.

- Verified reads: every whole chunk read from a chunk object or a pack is checked against the
  digest its ref records; a mismatch is a :class:`zarrlake.CorruptChunk` naming the array, the
  chunk, the object and both digests, and the bytes never reach Zarr. ``verify_reads=False`` (or
  ``ZARRLAKE_VERIFY_READS=0``) turns it off. A plain ``fsck`` reads a random sample of chunks.
- Short snapshot ids, as ``log`` prints them, name their snapshot when unique; an ambiguous one
  is refused naming the candidates; ids read case-insensitively (Crockford base32).
- Consolidated metadata: a repository's snapshot already holds its whole tree, so the store says
  it has none: ``to_zarrlake``/``to_zarr`` write no copy of the tree into "/" and warn of nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import zarr
from tests.cli_helpers import Result, assert_one_line_error
from zarr.core.buffer import default_buffer_prototype

import zarrlake
from zarrlake.format.model import chunk_key

SHAPE, CHUNKS = (64, 64), (32, 32)
#: What the issue saw come back from a damaged chunk: never again.
VALUE = 274.46


def _values() -> np.ndarray:
    # Every chunk different, so that no two share an object.
    return VALUE + np.arange(SHAPE[0] * SHAPE[1], dtype="f8").reshape(SHAPE) / 1000


def _chunk_bytes(i: int, j: int) -> bytes:
    """The encoded bytes of chunk (i, j): no compressor, so the array's bytes themselves."""
    a, b = CHUNKS
    return np.ascontiguousarray(_values()[i * a : (i + 1) * a, j * b : (j + 1) * b]).tobytes()


DIGEST: dict[str, Callable[[bytes], str]] = {
    "blake3": lambda d: blake3.blake3(d).hexdigest(),
    "sha256": lambda d: hashlib.sha256(d).hexdigest(),
}


def _make(storage: zarrlake.Storage, layout: str, content_hash: str = "blake3") -> str:
    """A repository with array ``temp`` (4 chunks of 8 KiB) at ``storage``, its chunks in
    objects of their own or in one pack; the commit's id."""
    config = {"pack_chunks_below_bytes": 0 if layout == "object" else 64 * 1024}
    repo = zarrlake.Repository.create(storage, config=config, content_hash=content_hash)
    s = repo.writable_session()
    a = zarr.create_array(
        s.store, name="temp", shape=SHAPE, chunks=CHUNKS, dtype="f8", compressors=None
    )
    a[:] = _values()
    return s.commit("temperature")


def _damage(storage: zarrlake.Storage, layout: str, content_hash: str = "blake3") -> str:
    """Flip 4 bytes inside chunk (0, 1), where the chunk lives; the key of the object damaged."""
    good = _chunk_bytes(0, 1)
    if layout == "object":
        key = chunk_key(DIGEST[content_hash](good))
        start = 100
    else:
        (key,) = [o.key for o in storage.list("packs/")]
        start = storage.get(key).find(good) + 100
        assert start >= 100
    data = bytearray(storage.get(key))
    data[start : start + 4] = b"\xff\xff\xff\xff"
    storage.put(key, bytes(data))
    return key


def _read(repo: zarrlake.Repository, selection: Any = ...) -> np.ndarray:
    return zarr.open_array(repo.readonly_session().store, path="temp", mode="r")[selection]


@pytest.mark.parametrize("layout", ["object", "pack"])
def test_a_damaged_chunk_is_an_error_naming_it_never_wrong_numbers(
    storage: zarrlake.Storage, layout: str
) -> None:
    _make(storage, layout)
    key = _damage(storage, layout)
    repo = zarrlake.Repository.open(storage)
    assert repo.verify_reads
    with pytest.raises(zarrlake.CorruptChunk) as caught:
        _read(repo)
    e = caught.value
    assert isinstance(e, zarrlake.CorruptObject)
    assert (e.key, e.chunk, e.array, e.hash_name) == (key, "temp/c/0/1", "temp", "blake3")
    assert e.expected == DIGEST["blake3"](_chunk_bytes(0, 1))
    assert e.actual != e.expected and len(e.actual) == 64
    for fact in (key, "temp/c/0/1", "'temp'", e.expected, e.actual):
        assert fact in str(e)
    # The chunks that are whole read as written, in the same repository.
    np.testing.assert_array_equal(_read(repo, (slice(0, 32), slice(0, 32))), _values()[:32, :32])
    np.testing.assert_array_equal(_read(repo, (slice(32, 64), ...)), _values()[32:])
    # Zarr's batched path (get_partial_values: what the sharding codec uses) refuses it too.
    store = repo.readonly_session().store
    with pytest.raises(zarrlake.CorruptChunk) as batched:
        asyncio.run(
            store.get_partial_values(
                default_buffer_prototype(), [("temp/c/0/0", None), ("temp/c/0/1", None)]
            )
        )
    assert (batched.value.chunk, batched.value.key) == ("temp/c/0/1", key)
    # A read of part of the chunk cannot be checked without the rest of it, and is not.
    part = store.get_sync("temp/c/0/1", byte_range=zarr.abc.store.RangeByteRequest(0, 8))
    assert part is not None and part.to_bytes() == _chunk_bytes(0, 1)[:8]


@pytest.mark.parametrize("layout", ["object", "pack"])
def test_verification_is_what_stops_it_and_can_be_turned_off(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    _make(storage, layout)
    _damage(storage, layout)
    unverified = zarrlake.Repository.open(storage, verify_reads=False)
    assert not unverified.verify_reads
    got = _read(unverified)
    assert not np.array_equal(got, _values())  # the damage, as it reads without the check
    np.testing.assert_array_equal(got[:, :32], _values()[:, :32])

    monkeypatch.setenv("ZARRLAKE_VERIFY_READS", "off")
    assert not zarrlake.Repository.open(storage).verify_reads
    assert zarrlake.Repository.open(storage, verify_reads=True).verify_reads  # the caller wins
    monkeypatch.setenv("ZARRLAKE_VERIFY_READS", "of")  # a typo is not silently either
    with pytest.raises(zarrlake.InvalidConfig, match="ZARRLAKE_VERIFY_READS"):
        zarrlake.Repository.open(storage)
    monkeypatch.delenv("ZARRLAKE_VERIFY_READS")

    # The setting travels with a pickled repository and its sessions (dask, Spark workers).
    verified = zarrlake.Repository.open(storage)
    for repo in (pickle.loads(pickle.dumps(verified)), verified):
        with pytest.raises(zarrlake.CorruptChunk):
            _read(repo)
    view = pickle.loads(pickle.dumps(verified.readonly_session()))
    with pytest.raises(zarrlake.CorruptChunk):
        zarr.open_array(view.store, path="temp", mode="r")[:]
    off = pickle.loads(pickle.dumps(unverified))
    assert not off.verify_reads
    assert not np.array_equal(_read(off), _values())


def test_a_sha256_repository_verifies_with_its_own_hash(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    _make(storage, "object", content_hash="sha256")
    _damage(storage, "object", content_hash="sha256")
    with pytest.raises(zarrlake.CorruptChunk) as caught:
        _read(zarrlake.Repository.open(storage))
    assert caught.value.hash_name == "sha256"
    assert caught.value.expected == DIGEST["sha256"](_chunk_bytes(0, 1))


def test_the_error_survives_a_worker_process() -> None:
    e = zarrlake.CorruptChunk("chunks/ab/x", "a" * 64, "b" * 64, "blake3").at("t/c/0", "t")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is zarrlake.CorruptChunk and str(back) == str(e)
    assert (back.key, back.expected, back.actual, back.chunk, back.array) == (
        "chunks/ab/x",
        "a" * 64,
        "b" * 64,
        "t/c/0",
        "t",
    )


@pytest.mark.parametrize("layout", ["object", "pack"])
def test_plain_fsck_reads_a_sample_of_chunks(
    tmp_path: Path, layout: str, cli: Callable[..., Result]
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    _make(storage, layout)
    repo = zarrlake.Repository.open(storage)
    report = repo.fsck()
    assert report.ok and report.verified == 4  # fewer chunks than the sample: all of them
    assert report.to_json()["checked"]["verified"] == 4
    key = _damage(storage, layout)
    report = repo.fsck()
    assert [(p.kind, p.key) for p in report.problems] == [("corrupt", key)]
    assert "does not match its digest" in report.problems[0].detail
    assert repo.fsck(sample=0).ok  # presence and sizes alone cannot tell
    assert not repo.fsck(verify_content=True).ok
    url = storage.url
    r = cli("fsck", url)
    assert r.code == 1 and key in r.out and "the content of 4 chunks" in r.out
    assert cli("fsck", url, "--sample", "0").code == 0
    assert_one_line_error(cli("fsck", url, "--sample", "-1"), 2)
    with pytest.raises(zarrlake.InvalidArgument):
        repo.fsck(sample=-1)


def test_the_sample_is_bounded_and_random(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage, config={"pack_chunks_below_bytes": 0})
    s = repo.writable_session()
    a = zarr.create_array(
        s.store, name="a", shape=(300, 128), chunks=(1, 128), dtype="f8", compressors=None
    )
    a[:] = np.arange(300 * 128, dtype="f8").reshape(300, 128)  # 1 KiB chunks: objects
    s.commit("300 chunks")
    reports = [repo.fsck(sample=10) for _ in range(2)]
    assert all(r.ok and r.verified == 10 and r.chunks == 300 for r in reports)
    assert repo.fsck().verified == zarrlake.fsck.SAMPLE == 100
    # Damage one chunk in three: a sample of 10 misses them all with odds of (2/3)**10 < 2%;
    # twenty samples in a row all missing is (2/3)**200, never.
    keys = sorted(o.key for o in storage.list("chunks/"))
    for key in keys[::3]:
        storage.put(key, b"\0" * len(storage.get(key)))
    found = {p.key for _ in range(20) for p in repo.fsck(sample=10).problems}
    assert found and found <= set(keys[::3])
    assert len(repo.fsck(verify_content=True).problems) == len(keys[::3])


# -- short snapshot ids ----------------------------------------------------------------------------


def _commits(repo: zarrlake.Repository, n: int) -> list[str]:
    s = repo.writable_session()
    zarr.create_array(s.store, name="a", shape=(n,), chunks=(1,), dtype="i4")
    s.commit("create")
    for i in range(n - 1):
        s = repo.writable_session()
        zarr.open_array(s.store, path="a", mode="r+")[i] = i + 1
        s.commit(f"write {i}")
    return [c.id for c in repo.log()]


def _crockford_variant(sid: str) -> str:
    """``sid`` as a person may copy it: lower case, ``1`` as ``l``, ``0`` as ``o``."""
    return sid.lower().replace("1", "l").replace("0", "o")


def test_short_and_lowercase_snapshot_ids_name_their_snapshot(
    repo: zarrlake.Repository, cli: Callable[..., Result]
) -> None:
    ids = _commits(repo, 3)
    for sid in ids:
        # Ten characters, as log prints, unless commits came within the same millisecond.
        short = next(sid[:n] for n in range(10, 27) if sum(o.startswith(sid[:n]) for o in ids) == 1)
        for form in (short, short.lower(), sid.lower(), _crockford_variant(sid)):
            assert repo.resolve(form) == sid, form
        assert [c.id for c in repo.log(short, limit=1)] == [sid]
        assert repo.readonly_session(short.lower()).base == sid
    oldest = ids[-1]
    short = next(
        oldest[:n] for n in range(10, 27) if sum(o.startswith(oldest[:n]) for o in ids) == 1
    )
    assert repo.resolve(repo.create_branch("from-short", short)) == oldest
    if repo.storage.url.startswith("memory:"):
        return  # the CLI opens its own: a memory storage is this process's alone
    url = repo.storage.url
    r = cli("log", url, "--ref", short.lower(), "--json")
    assert r.code == 0, r.err
    assert [c["id"] for c in r.json()] == [oldest]
    r = cli("ls", url, "--ref", short)
    assert r.code == 0, r.err


def test_an_ambiguous_short_id_is_refused_naming_the_candidates(
    repo: zarrlake.Repository, cli: Callable[..., Result]
) -> None:
    ids = _commits(repo, 4)
    common = ids[0]
    while not all(i.startswith(common) for i in ids):
        common = common[:-1]
    assert len(common) >= 4  # commits a few ms apart share their time's first digits
    with pytest.raises(zarrlake.AmbiguousRef) as caught:
        repo.resolve(common)
    assert isinstance(caught.value, zarrlake.RefNotFound)
    assert caught.value.candidates == sorted(ids)
    assert all(i in str(caught.value) for i in ids)
    back = pickle.loads(pickle.dumps(caught.value))
    assert (type(back), back.candidates, str(back)) == (
        zarrlake.AmbiguousRef,
        sorted(ids),
        str(caught.value),
    )
    if not repo.storage.url.startswith("memory:"):  # the CLI opens its own storage
        message = assert_one_line_error(cli("log", repo.storage.url, "--ref", common.lower()), 1)
        assert "ambiguous" in message and ids[0] in message
    # Shorter than 4 characters is no short id; a branch of that name is the branch.
    with pytest.raises(zarrlake.RefNotFound) as short:
        repo.resolve(common[:3])
    assert not isinstance(short.value, zarrlake.AmbiguousRef)
    repo.create_branch(common, ids[-1])
    assert repo.resolve(common) == ids[-1]


# -- consolidated metadata -------------------------------------------------------------------------


def test_datasets_are_written_without_warnings_or_a_copy_of_the_tree(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    da = pytest.importorskip("dask.array")
    from zarrlake.dask import to_zarrlake

    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "repo"))
    ds = xr.Dataset({"t": (("y", "x"), da.ones((8, 8), chunks=4))})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        s = repo.writable_session()
        to_zarrlake(ds, s, mode="w")  # as the README writes it
        first = s.commit("first")
        s = repo.writable_session()
        to_zarrlake(ds * 2, s, mode="w")
        second = s.commit("second")
        with xr.open_zarr(repo.readonly_session().store) as back:  # xarray's defaults
            np.testing.assert_array_equal(back.t.values, np.full((8, 8), 2.0))
        s = repo.writable_session()
        ds.to_zarr(s.store, mode="w", consolidated=True)  # asked for: nothing to make
        third = s.commit("third")
    diff = repo.diff(first, second)
    assert not diff.changed_nodes and not diff.added_nodes and set(diff.changed_chunks) == {"/t"}
    assert not repo.diff(first, third).changed_nodes
    root = repo.readonly_session().store.get_sync("zarr.json")
    assert root is not None
    assert json.loads(root.to_bytes()).get("consolidated_metadata") is None
    with pytest.raises(TypeError, match="consolidated metadata"):
        zarr.consolidate_metadata(repo.writable_session().store)

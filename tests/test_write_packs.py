"""Small chunks go into packs as a session writes them (zarrlake.packs, issue 11).

Many small chunks were one storage request each (a file, an S3 PUT): the request was the cost.
These tests pin what packing at write time must keep: every byte reads back (in the session before
the commit, and from storage after it), few requests, bounded memory (packs upload while the
session writes), nothing published that is not written (an outage fails the commit and loses
nothing), forks and their pickles see the chunks, and GC, fsck and conflict checks see chunks,
not packs.
"""

from __future__ import annotations

import datetime as dt
import gc
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.errors import StorageError
from zarrlake.format.model import INLINE, PACKED
from zarrlake.maintenance.compact import compact
from zarrlake.mirror import Mirror
from zarrlake.packs import PACK_WRITE_TARGET, PackWriter
from zarrlake.storage.base import Buffer
from zarrlake_testkit.counting import CountingStorage, Counts

CHUNK = 128  # uint64 elements: 1 KiB chunks, above the 512-byte inline threshold


def _array(session: zarrlake.Session, n_chunks: int, name: str = "x") -> zarr.Array:
    return zarr.create_array(
        session.store,
        name=name,
        shape=(n_chunks * CHUNK,),
        chunks=(CHUNK,),
        dtype="u8",
        compressors=None,
        fill_value=0,
    )


def _data(n_chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, n_chunks * CHUNK, dtype="u8")


def _keys(storage: zarrlake.Storage, prefix: str) -> list[str]:
    return [k for k in storage.list_keys(prefix) if not k.endswith("/")]


def test_small_chunks_land_in_packs_and_read_back(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    data = _data(3_000)
    s = repo.writable_session("main")
    arr = _array(s, 3_000)
    arr[:] = data
    # Read-your-writes before the commit: some packs are still in this process's memory.
    assert np.array_equal(arr[:], data)
    assert np.array_equal(arr[5 * CHUNK + 3 : 9 * CHUNK - 1], data[5 * CHUNK + 3 : 9 * CHUNK - 1])
    s.commit("3,000 small chunks")

    assert _keys(storage, "chunks/") == []
    packs = _keys(storage, "packs/")
    assert 1 <= len(packs) <= 3_000 * 1024 // PACK_WRITE_TARGET + 1
    fresh = zarrlake.Repository.open(storage)
    got = zarr.open_array(fresh.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, data)
    assert fresh.fsck(verify_content=True).ok


def test_writing_small_chunks_costs_a_request_per_pack_not_per_chunk(tmp_path: Path) -> None:
    counts = Counts(record_keys=True)
    storage = CountingStorage(zarrlake.Storage.local(tmp_path / "r"), counts)
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    arr = _array(s, 10_000)
    counts.reset()
    arr[:] = _data(10_000)
    s.commit("10,000 small chunks")
    puts = [key for op, key in counts.calls() if op.startswith("put")]
    pack_puts = [k for k in puts if k.startswith("packs/")]
    assert [k for k in puts if k.startswith("chunks/")] == []
    # 10,000 KiB in packs of 1 MiB: 10 packs; the commit's own objects besides.
    assert len(pack_puts) == -(-10_000 * 1024 // PACK_WRITE_TARGET)
    assert len(puts) < len(pack_puts) + 12


def test_packs_upload_while_the_session_writes(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    n = 3 * PACK_WRITE_TARGET // 1024 + 10  # three full packs and a bit
    _array(s, n)[:] = _data(n)
    # Full packs upload on the I/O pool with no commit or flush; the open one waits for one.
    deadline = time.monotonic() + 60
    while len(_keys(storage, "packs/")) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_keys(storage, "packs/")) == 3
    s.flush()
    assert len(_keys(storage, "packs/")) == 4
    assert len(list(repo.log())) == 1  # uploading packs published nothing


def test_large_chunks_stay_objects_and_packing_can_be_off(tmp_path: Path) -> None:
    big = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "big"))
    s = big.writable_session("main")
    zarr.create_array(
        s.store, name="y", shape=(4 * 65_536,), chunks=(65_536,), dtype="u8", compressors=None
    )[:] = np.arange(4 * 65_536, dtype="u8") + 1
    s.commit("512 KiB chunks")
    assert len(_keys(big.storage, "chunks/")) == 4
    assert _keys(big.storage, "packs/") == []

    off = zarrlake.Repository.create(
        zarrlake.Storage.local(tmp_path / "off"), config={"pack_chunks_below_bytes": 0}
    )
    assert off.config.pack_chunks_below_bytes == 0
    assert zarrlake.Repository.open(off.storage).config.pack_chunks_below_bytes == 0
    s = off.writable_session("main")
    _array(s, 20)[:] = _data(20)
    s.commit("objects")
    assert len(_keys(off.storage, "chunks/")) == 20
    assert _keys(off.storage, "packs/") == []


@pytest.mark.parametrize("value", [-1, 16 * 1024 * 1024 + 1, 1 << 40])
def test_a_pack_threshold_out_of_range_is_refused(tmp_path: Path, value: int) -> None:
    with pytest.raises(ValueError, match="pack_chunks_below_bytes"):
        zarrlake.Repository.create(
            zarrlake.Storage.local(tmp_path / "r"), config={"pack_chunks_below_bytes": value}
        )
    assert not (tmp_path / "r" / "repo").exists()


class RejectingPacks(CountingStorage):
    """Real local storage that refuses pack writes while :attr:`rejecting` is set (an outage or a
    revoked permission on a prefix); everything else works."""

    def __init__(self, inner: zarrlake.Storage) -> None:
        super().__init__(inner)
        self.rejecting = threading.Event()

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        if self.rejecting.is_set() and key.startswith("packs/"):
            raise StorageError(f"AccessDenied on {key}")
        super().put(key, data, create_only=create_only)


def test_a_pack_that_cannot_be_written_fails_the_commit_and_loses_nothing(tmp_path: Path) -> None:
    storage = RejectingPacks(zarrlake.Storage.local(tmp_path / "r"))
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    arr = _array(s, 100)
    s.commit("empty array")
    head = repo.lookup_branch("main")

    s = repo.writable_session("main")
    arr = zarr.open_array(s.store, path="x")
    data = _data(100, seed=1)
    storage.rejecting.set()
    arr[:] = data  # in memory: nothing to fail yet
    with pytest.raises(StorageError, match="AccessDenied"):
        s.commit("must not publish refs to an unwritten pack")
    assert repo.lookup_branch("main") == head
    assert _keys(storage, "packs/") == []
    # The session keeps its changes and reads them; once writes work again, the commit lands.
    assert np.array_equal(arr[:], data)
    storage.rejecting.clear()
    s.commit("after the outage")
    fresh = zarrlake.Repository.open(storage.inner)
    got = zarr.open_array(fresh.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, data)
    assert fresh.fsck(verify_content=True).ok


class HeldPacks(CountingStorage):
    """Real local storage whose pack writes wait until a snapshot object has been written (at
    most ``patience`` seconds) and then for a journal entry to begin (at most half a second),
    and which records the order writes end in."""

    def __init__(self, inner: zarrlake.Storage, patience: float = 10.0) -> None:
        super().__init__(inner)
        self.patience = patience
        self.snapshot_written = threading.Event()
        self.ended: list[str] = []
        self.entry_found: list[str] = []
        self.entry_begun = threading.Event()

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        if key.startswith("packs/"):
            self.snapshot_written.wait(self.patience)
            # Then a moment more, for a journal entry that would not wait for the pack.
            self.entry_begun.wait(0.5)
        if key.startswith("refs/"):
            self.entry_found = list(self.ended)  # what had been written when the entry began
            self.entry_begun.set()
        super().put(key, data, create_only=create_only)
        if key.startswith("snapshots/"):
            self.snapshot_written.set()
        self.ended.append(key.split("/", 1)[0])


def test_a_commit_writes_its_snapshot_while_the_last_pack_uploads_and_publishes_after_it(
    tmp_path: Path,
) -> None:
    # The last pack of a session travels while the commit builds and writes its snapshot (a
    # round trip saved on S3), yet the journal entry that publishes the commit is written only
    # once the pack is. If the commit waited for the pack first, the pack (which waits for a
    # snapshot) would end only after ``patience`` and after no snapshot.
    storage = HeldPacks(zarrlake.Storage.local(tmp_path / "r"))
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    _array(s, 10)
    s.commit("empty array")  # (no chunk: no pack)
    storage.snapshot_written.clear()
    storage.entry_begun.clear()
    storage.ended.clear()

    s = repo.writable_session("main")
    data = _data(10, seed=3)
    zarr.open_array(s.store, path="x")[:] = data
    s.commit("ten small chunks in one pack")
    assert storage.ended.index("snapshots") < storage.ended.index("packs")
    assert "packs" in storage.entry_found  # the entry was begun once the pack was written
    got = zarr.open_array(
        zarrlake.Repository.open(storage.inner).readonly_session("main").store, path="x", mode="r"
    )[:]
    assert np.array_equal(got, data)


class FailingOnce(CountingStorage):
    """Real local storage whose next ``failures`` pack writes fail (a blip), then work."""

    def __init__(self, inner: zarrlake.Storage, failures: int) -> None:
        super().__init__(inner)
        self.failures = failures
        self._lock = threading.Lock()

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        with self._lock:
            fail = key.startswith("packs/") and self.failures > 0
            self.failures -= fail
        if fail:
            raise StorageError(f"SlowDown on {key}")
        super().put(key, data, create_only=create_only)


def test_a_failed_upload_is_made_again_by_the_next_write_that_waits(tmp_path: Path) -> None:
    storage = FailingOnce(zarrlake.Storage.local(tmp_path / "r"), failures=1)
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    writer = PackWriter(s.objects, target=4096, in_flight=1)
    refs = []
    for i in range(64):  # 16 packs; the first upload fails once, and nothing else does
        ref, backlog = writer.add(bytes([i]) * 1024)
        if backlog is not None:
            backlog.result()  # never raises: a failed upload is made again before it is waited on
        refs.append(ref)
    writer.flush()
    assert storage.failures == 0 and not writer.pending
    fresh = zarrlake.Repository.open(storage.inner)
    for i, ref in enumerate(refs):
        assert fresh.readonly_session("main").objects.read_chunk(ref) == bytes([i]) * 1024


def test_chunks_written_from_the_io_pool_fill_packs_without_waiting_on_it(tmp_path: Path) -> None:
    # Chunks over 64 KiB are written from the storage's I/O pool; a pack they fill uploads in
    # that thread. (It once waited there for a lock it held: every such write hung.)
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    s = repo.writable_session("main")
    n, chunk = 100, 16_384  # 128 KiB chunks: 12.5 MiB, several packs and a bit
    data = np.random.default_rng(7).integers(1, 2**63, n * chunk, dtype="u8")
    arr = zarr.create_array(
        s.store, name="y", shape=(n * chunk,), chunks=(chunk,), dtype="u8", compressors=None
    )
    done = threading.Event()

    def write() -> None:
        arr[:] = data
        done.set()

    threading.Thread(target=write, daemon=True).start()
    assert done.wait(120), "writing 128 KiB chunks hung"
    s.commit("128 KiB chunks, packed")
    assert _keys(repo.storage, "chunks/") == []
    assert len(_keys(repo.storage, "packs/")) == -(-n * chunk * 8 // PACK_WRITE_TARGET)
    got = zarr.open_array(repo.readonly_session("main").store, path="y", mode="r")[:]
    assert np.array_equal(got, data)


def test_an_upload_failing_mid_session_surfaces_at_a_later_write(tmp_path: Path) -> None:
    storage = RejectingPacks(zarrlake.Storage.local(tmp_path / "r"))
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    storage.rejecting.set()
    writer = PackWriter(s.objects, target=4096, in_flight=1)
    refs = []
    with pytest.raises(StorageError, match="AccessDenied"):
        for i in range(64):
            ref, backlog = writer.add(bytes([i]) * 1024)
            refs.append(ref)
            if backlog is not None:
                backlog.result()
    # Every byte added is still readable from memory, and a flush writes it once storage works.
    for i, ref in enumerate(refs):
        assert s.objects.read_chunk(ref) == bytes([i]) * 1024
    storage.rejecting.clear()
    writer.flush()
    assert not writer.pending
    del writer
    gc.collect()
    for i, ref in enumerate(refs):
        assert s.objects.read_chunk(ref) == bytes([i]) * 1024


def test_forks_write_packs_and_pickled_forks_read_the_parents_chunks(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    data = _data(400)
    _array(s, 400)[: 200 * CHUNK] = data[: 200 * CHUNK]
    # The fork goes to another process: a pickle carries no memory of this one's packs.
    fork = pickle.loads(pickle.dumps(s.fork()))
    farr = zarr.open_array(fork.store, path="x")
    assert np.array_equal(farr[: 200 * CHUNK], data[: 200 * CHUNK])
    farr[200 * CHUNK :] = data[200 * CHUNK :]
    changes = pickle.loads(pickle.dumps(fork.changeset()))
    s.merge(changes)
    s.commit("half here, half in a fork")
    got = zarr.open_array(repo.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, data)
    assert repo.fsck(verify_content=True).ok


def test_forks_writing_the_same_bytes_agree_and_different_bytes_conflict(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    s = repo.writable_session("main")
    _array(s, 10)
    s.commit("array")
    s = repo.writable_session("main")
    same = _data(10, seed=3)
    forks = [s.fork() for _ in range(3)]
    for f in forks[:2]:
        zarr.open_array(f.store, path="x")[:] = same
    zarr.open_array(forks[2].store, path="x")[:CHUNK] = same[:CHUNK] + 1
    s.merge(forks[0].changeset(), forks[1].changeset())  # same bytes, two packs: no conflict
    with pytest.raises(zarrlake.ConflictError):
        s.merge(forks[2].changeset())
    s.commit("same bytes from two forks")
    got = zarr.open_array(repo.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, same)


def test_rewriting_the_same_bytes_is_no_change(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    s = repo.writable_session("main")
    data = _data(8)
    _array(s, 8)[:] = data
    s.commit("array")
    s = repo.writable_session("main")
    arr = zarr.open_array(s.store, path="x")
    arr[:] = data  # the same bytes land in a new pack
    arr[:CHUNK] = data[:CHUNK] + 1
    status = s.status()
    assert {p: set(c) for p, c in status.changed_chunks.items()} == {"/x": {(0,)}}
    assert not status.changed_nodes


def test_gc_keeps_committed_packs_and_takes_those_of_a_dropped_session(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session("main")
    data = _data(50)
    _array(s, 50)[:] = data
    s.commit("kept")
    kept = set(_keys(storage, "packs/"))
    dropped = repo.writable_session("main")
    zarr.open_array(dropped.store, path="x")[:] = data + 1
    dropped.flush()  # its packs reach storage, and no commit ever names them
    garbage = set(_keys(storage, "packs/")) - kept
    assert garbage
    dropped.discard()
    report = repo.gc(grace=dt.timedelta(0), force=True)
    assert report.by_kind["packs"].deleted == len(garbage)
    assert set(_keys(storage, "packs/")) == kept
    got = zarr.open_array(repo.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, data)


def test_a_dropped_session_leaves_no_memory_behind(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    s = repo.writable_session("main")
    _array(s, 100)[:] = _data(100)
    ref: Any = s.resolve("x/c/7")
    assert repo.storage.exists(f"packs/{ref[1]}") is False  # held in memory only
    assert s.objects.read_chunk(ref) is not None
    objects = s.objects
    del s
    gc.collect()
    # The pack was never written and its writer is gone: the ref now names a missing pack.
    with pytest.raises(zarrlake.CorruptObject):
        objects.read_chunk(ref)


def test_chunks_at_most_the_inline_threshold_stay_inline(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    s = repo.writable_session("main")
    tiny = zarr.create_array(
        s.store, name="t", shape=(64,), chunks=(8,), dtype="u8", compressors=None
    )  # 64-byte chunks: in the manifest, never in a pack
    tiny[:] = np.arange(1, 65, dtype="u8")
    assert {s.resolve(f"t/c/{i}")[0] for i in range(8)} == {INLINE}  # type: ignore[index]
    _array(s, 4)[:] = _data(4)
    assert {s.resolve(f"x/c/{i}")[0] for i in range(4)} == {PACKED}  # type: ignore[index]
    s.commit("inline and packed")
    assert len(_keys(repo.storage, "packs/")) == 1
    got = zarr.open_array(repo.readonly_session("main").store, path="t", mode="r")[:]
    assert np.array_equal(got, np.arange(1, 65, dtype="u8"))


def test_a_mirror_copies_the_packs_sessions_wrote(tmp_path: Path) -> None:
    source = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "source"))
    data = _data(200)
    s = source.writable_session("main")
    _array(s, 200)[:] = data
    s.commit("packed chunks")
    dest = zarrlake.Storage.local(tmp_path / "dest")
    status = Mirror(source, dest).step()
    assert status.up_to_date
    assert _keys(dest, "packs/") == _keys(source.storage, "packs/")
    mirror = zarrlake.Repository.open(dest)
    got = zarr.open_array(mirror.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, data)
    assert mirror.fsck(verify_content=True).ok


def _four_small_packs(tmp_path: Path, each: int = 10) -> tuple[zarrlake.Repository, np.ndarray]:
    """Four commits of ``each`` 1 KiB chunks: four small tail packs."""
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    data = _data(4 * each)
    s = repo.writable_session("main")
    _array(s, 4 * each)
    s.commit("empty array")
    for part in range(4):
        s = repo.writable_session("main")
        window = slice(part * each * CHUNK, (part + 1) * each * CHUNK)
        zarr.open_array(s.store, path="x")[window] = data[window]
        s.commit(f"part {part}")
    return repo, data


def test_compaction_merges_the_small_packs_commits_leave_behind(tmp_path: Path) -> None:
    repo, data = _four_small_packs(tmp_path)  # four commits of 10 chunks: four tail packs
    storage = repo.storage
    before = set(_keys(storage, "packs/"))
    assert len(before) == 4
    s = repo.readonly_session("main")
    digests = {i: s.resolve(f"x/c/{i}")[4] for i in range(40)}  # type: ignore[index]

    report = repo.compact(keep_journal=dt.timedelta(days=30))
    assert (report.packed_chunks, report.packs_written) == (40, 1)
    head = repo.readonly_session("main")
    refs = [head.resolve(f"x/c/{i}") for i in range(40)]
    new = {f"packs/{r[1]}" for r in refs}  # type: ignore[index]
    assert len(new) == 1 and new == set(_keys(storage, "packs/")) - before
    assert {i: r[4] for i, r in enumerate(refs)} == digests  # type: ignore[index]
    got = zarr.open_array(head.store, path="x", mode="r")[:]
    assert np.array_equal(got, data)
    assert repo.fsck(verify_content=True).ok

    again = repo.compact(keep_journal=dt.timedelta(days=30))  # one small pack: nothing to merge
    assert (again.packed_chunks, again.snapshot) == (0, None)


def test_compaction_at_a_small_target_settles(tmp_path: Path) -> None:
    """At an 8 KiB target every pack is under 1 MiB: packs count as small below half the
    target, so the two packs the first compaction writes are not merged (into the same two) by
    every later one."""
    repo, data = _four_small_packs(tmp_path, each=3)  # four packs of 3 KiB
    first = compact(repo.core, pack_target_bytes=8 * 1024)
    assert (first.packed_chunks, first.packs_written) == (12, 2)  # of 8 KiB and 4 KiB
    head = repo.core.journal.current("main").snapshot
    second = compact(repo.core, pack_target_bytes=8 * 1024)
    assert (second.packed_chunks, second.snapshot) == (0, None)
    assert repo.core.journal.current("main").snapshot == head
    got = zarr.open_array(repo.readonly_session("main").store, path="x", mode="r")[:]
    assert np.array_equal(got, data)


def test_compaction_refuses_a_damaged_session_pack_and_changes_nothing(tmp_path: Path) -> None:
    repo, _ = _four_small_packs(tmp_path)
    head = repo.core.journal.current("main").snapshot
    ref: Any = repo.readonly_session("main").resolve("x/c/12")
    path = tmp_path / "r" / "packs" / ref[1]
    damaged = bytearray(path.read_bytes())
    damaged[ref[2]] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(zarrlake.CorruptObject, match=ref[1]):
        repo.compact()
    assert repo.core.journal.current("main").snapshot == head


def test_compaction_moves_only_the_refs_a_merge_changes(tmp_path: Path) -> None:
    """A merge can write again a pack compaction wrote before (content-addressed: the same
    bytes make the same pack): refs already in it stay, are not counted, and only the new key
    moves into it."""
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    data = _data(6)
    data[4 * CHUNK : 5 * CHUNK] = data[:CHUNK]  # chunk 4: the bytes of chunk 0
    data[5 * CHUNK :] = data[CHUNK : 2 * CHUNK]  # chunk 5: those of chunk 1
    s = repo.writable_session("main")
    arr = _array(s, 6)
    arr[: 4 * CHUNK] = data[: 4 * CHUNK]
    s.commit("chunks 0-3: a pack of 4 KiB")
    s = repo.writable_session("main")
    zarr.open_array(s.store, path="x")[4 * CHUNK : 5 * CHUNK] = data[4 * CHUNK : 5 * CHUNK]
    s.commit("chunk 4: a pack of 1 KiB")
    first = compact(repo.core, pack_target_bytes=16 * 1024)
    assert (first.packed_chunks, first.packs_written) == (5, 1)  # 4 KiB: chunk 4 shares 0's
    merged: Any = repo.readonly_session("main").resolve("x/c/0")
    s = repo.writable_session("main")
    zarr.open_array(s.store, path="x")[5 * CHUNK :] = data[5 * CHUNK :]
    s.commit("chunk 5: a pack of 1 KiB")

    again = compact(repo.core, pack_target_bytes=16 * 1024)  # the 4 KiB pack and the new one
    assert (again.packed_chunks, again.packs_written) == (1, 1)
    head = repo.readonly_session("main")
    refs: list[Any] = [head.resolve(f"x/c/{i}") for i in range(6)]
    assert {r[1] for r in refs} == {merged[1]}  # the same pack as before, written again
    assert refs[5][2:4] == refs[1][2:4]  # chunk 5 reads chunk 1's bytes
    got = zarr.open_array(head.store, path="x", mode="r")[:]
    assert np.array_equal(got, data)
    assert repo.fsck(verify_content=True).ok

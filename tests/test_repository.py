"""The Repository and Session API of API.md, on memory, local-directory and S3 storage."""

from __future__ import annotations

import datetime as dt
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from zarrlake.format.model import JournalEntry, branch_entry_key, snapshot_key


def write_array(session: zarrlake.Session, path: str = "a", shape=(8, 8), chunks=(4, 4), fill=1.0):
    arr = zarr.create_array(session.store, name=path, shape=shape, chunks=chunks, dtype="f8")
    arr[:] = fill
    return arr


def read(repo: zarrlake.Repository, ref: str, path: str = "a") -> np.ndarray:
    return zarr.open_array(repo.readonly_session(ref).store, path=path, mode="r")[:]


# -- lifecycle ------------------------------------------------------------------------------------


def test_create_open_exists(storage: zarrlake.Storage) -> None:
    assert not zarrlake.Repository.exists(storage)
    with pytest.raises(zarrlake.RepositoryNotFound):
        zarrlake.Repository.open(storage)
    repo = zarrlake.Repository.create(storage)
    assert zarrlake.Repository.exists(storage)
    with pytest.raises(zarrlake.RepositoryExists):
        zarrlake.Repository.create(storage)
    again = zarrlake.Repository.open(storage)
    assert again.id == repo.id
    assert zarrlake.Repository.open_or_create(storage).id == repo.id
    assert list(repo.list_branches()) == ["main"]
    assert [c.message for c in repo.log()] == ["Repository initialized"]


def test_config_is_stored(storage: zarrlake.Storage) -> None:
    cfg = zarrlake.RepositoryConfig(inline_threshold_bytes=0, shard_max_refs=64)
    zarrlake.Repository.create(storage, config=cfg)
    assert zarrlake.Repository.open(storage).config == cfg
    with pytest.raises(ValueError):
        zarrlake.RepositoryConfig(shard_max_refs=1)


# -- branches and tags --------------------------------------------------------------------------


def test_branches(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s)
    c1 = s.commit("one")
    assert repo.create_branch("dev") == c1
    assert repo.create_branch("feature/x", from_ref=c1) == c1
    with pytest.raises(zarrlake.BranchExists):
        repo.create_branch("dev")
    assert repo.list_branches() == {"dev": c1, "feature/x": c1, "main": c1}
    first = list(repo.log())[-1].id
    assert repo.reset_branch("dev", first) == first
    assert repo.lookup_branch("dev") == first
    with pytest.raises(zarrlake.ConflictError):
        repo.reset_branch("dev", c1, expected=c1)  # dev is at `first`, not c1
    assert repo.reset_branch("dev", c1, expected=first) == c1
    repo.delete_branch("dev")
    with pytest.raises(zarrlake.RefNotFound):
        repo.lookup_branch("dev")
    assert "dev" not in repo.list_branches()
    assert repo.create_branch("dev", from_ref=first) == first  # a deleted name can be reused
    with pytest.raises(zarrlake.ZarrlakeError):
        repo.delete_branch("main")
    with pytest.raises(zarrlake.RefNotFound):
        repo.delete_branch("nope")
    with pytest.raises(zarrlake.RefNotFound):
        repo.create_branch("x", from_ref="no-such-ref")


@pytest.mark.parametrize(
    "name", ["", " ", "a b", "a..b", "-x", "tab\there", "nul\x00", "x" * 256, "a/", "/a", "a//b"]
)
def test_invalid_names(repo: zarrlake.Repository, name: str) -> None:
    with pytest.raises(zarrlake.InvalidName):
        repo.create_branch(name)
    with pytest.raises(zarrlake.InvalidName):
        repo.create_tag(name, "main")
    assert list(repo.list_branches()) == ["main"]
    assert repo.list_tags() == {}


def test_tags(repo: zarrlake.Repository) -> None:
    head = repo.lookup_branch("main")
    assert repo.create_tag("v1", "main") == head
    assert repo.lookup_tag("v1") == head
    assert repo.resolve("v1") == head
    with pytest.raises(zarrlake.TagExists):
        repo.create_tag("v1", "main")
    repo.delete_tag("v1")
    with pytest.raises(zarrlake.RefNotFound):
        repo.lookup_tag("v1")
    with pytest.raises(zarrlake.TagExists):
        repo.create_tag("v1", "main")  # deleted names are never reused
    with pytest.raises(zarrlake.RefNotFound):
        repo.delete_tag("v1")
    repo.create_tag("release/2026-11", head)
    assert repo.list_tags() == {"release/2026-11": head}


def test_resolve(repo: zarrlake.Repository) -> None:
    head = repo.lookup_branch("main")
    assert repo.resolve("main") == head
    assert repo.resolve(head) == head
    for bad in ["nope", "01ARZ3NDEKTSV4RRFFQ69G5FAV", "", "a..b"]:
        with pytest.raises(zarrlake.RefNotFound):
            repo.resolve(bad)


# -- sessions -------------------------------------------------------------------------------------


def test_read_your_writes_and_isolation(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, fill=3.0)
    assert s.has_changes
    np.testing.assert_array_equal(zarr.open_array(s.store, path="a")[:], np.full((8, 8), 3.0))
    other = repo.readonly_session("main")
    with pytest.raises(FileNotFoundError):
        zarr.open_array(other.store, path="a", mode="r")
    status = s.status()
    assert "/a" in status.added_nodes and "a" in status.added_nodes
    assert status.changed_chunks["a"] == {(0, 0), (0, 1), (1, 0), (1, 1)}
    c = s.commit("write a", author="me", metadata={"k": [1, 2]})
    assert s.read_only
    with pytest.raises(zarrlake.ReadOnlyError):
        zarr.open_array(s.store, path="a")[0, 0] = 1
    info = next(repo.log())
    assert (info.id, info.message, info.author, info.metadata) == (
        c,
        "write a",
        "me",
        {"k": [1, 2]},
    )
    assert info.time.tzinfo is not None
    np.testing.assert_array_equal(read(repo, "main"), np.full((8, 8), 3.0))


def test_nothing_to_commit(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    with pytest.raises(zarrlake.NothingToCommit):
        s.commit("empty")
    c = s.commit("empty", allow_empty=True)
    assert repo.lookup_branch("main") == c


def test_readonly_session_refuses_writes(repo: zarrlake.Repository) -> None:
    import asyncio

    from zarr.core.buffer import cpu

    s = repo.readonly_session()
    with pytest.raises(ValueError):  # Zarr's own check
        zarr.open_group(s.store, mode="w")
    with pytest.raises(zarrlake.ReadOnlyError):
        asyncio.run(s.store.set("zarr.json", cpu.Buffer.from_bytes(b"{}")))
    with pytest.raises(ValueError):  # ReadOnlyError is also a ValueError, as Zarr expects
        s.store.set_sync("x/c/0", cpu.Buffer.from_bytes(b"1"))
    with pytest.raises(zarrlake.ReadOnlyError):  # the session itself, below the store
        s.write("x/c/0", b"1")
    with pytest.raises(zarrlake.ReadOnlyError):
        s.commit("x")


def test_session_expiry(repo: zarrlake.Repository) -> None:
    # The writes must fit in the TTL on a loaded machine; then wait for the expiry itself.
    s = repo.writable_session(ttl=dt.timedelta(seconds=3))
    write_array(s)
    assert s.expires_at is not None
    while dt.datetime.now(dt.UTC) < s.expires_at:
        time.sleep(0.05)
    with pytest.raises(zarrlake.SessionExpired):
        s.commit("too late")
    with pytest.raises(zarrlake.SessionExpired):
        zarr.open_array(s.store, path="a")[0, 0] = 5
    assert [c.message for c in repo.log()] == ["Repository initialized"]
    with pytest.raises(ValueError):
        repo.writable_session(ttl=dt.timedelta(days=8))


def test_discard(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s)
    s.discard()
    assert not s.has_changes
    assert not s.status()


def test_transaction(repo: zarrlake.Repository) -> None:
    with repo.transaction("main", message="tx") as store:
        zarr.create_array(store, name="t", shape=(4,), chunks=(2,), dtype="i4")[:] = 7
    assert next(repo.log()).message == "tx"
    head = repo.lookup_branch("main")
    with pytest.raises(RuntimeError), repo.transaction("main", message="fails") as store:
        zarr.open_array(store, path="t")[:] = 9
        raise RuntimeError("boom")
    assert repo.lookup_branch("main") == head
    np.testing.assert_array_equal(
        zarr.open_array(repo.readonly_session().store, path="t", mode="r")[:], 7
    )


# -- concurrency: rebase and conflicts -------------------------------------------------------------


def test_disjoint_concurrent_commits_rebase(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, fill=0.0)
    s.commit("base")
    a, b = repo.writable_session(), repo.writable_session()
    zarr.open_array(a.store, path="a")[0:4, 0:4] = 1
    zarr.open_array(b.store, path="a")[4:8, 4:8] = 2
    ca = a.commit("a")
    cb = b.commit("b")
    assert repo.lookup_branch("main") == cb
    assert next(repo.log()).parents == (ca,)
    data = read(repo, "main")
    assert (data[0:4, 0:4] == 1).all() and (data[4:8, 4:8] == 2).all() and data[0, 7] == 0


def test_conflicting_chunk_and_solvers(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, fill=0.0)
    s.commit("base")

    def race(ours: float, theirs: float) -> zarrlake.Session:
        a, b = repo.writable_session(), repo.writable_session()
        zarr.open_array(a.store, path="a")[0, 0] = theirs
        zarr.open_array(b.store, path="a")[0, 0] = ours
        a.commit("theirs")
        return b

    b = race(2, 1)
    with pytest.raises(zarrlake.ConflictError) as info:
        b.commit("ours")
    assert info.value.conflicts == [zarrlake.Conflict("chunk", "/a", (0, 0))]
    assert read(repo, "main")[0, 0] == 1
    with pytest.raises(zarrlake.ConflictError):
        b.commit("ours", rebase=False)
    # A failed commit leaves the session its changes, and it takes more.
    assert b.has_changes and zarr.open_array(b.store, path="a")[0, 0] == 2
    zarr.open_array(b.store, path="a")[1, 1] = 7
    b.commit("ours", solver=zarrlake.UseOurs())
    assert read(repo, "main")[0, 0] == 2
    assert read(repo, "main")[1, 1] == 7

    b = race(4, 3)
    b.commit("ours", solver=zarrlake.UseTheirs())
    assert read(repo, "main")[0, 0] == 3


def test_metadata_and_delete_conflicts(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s)
    write_array(s, "b")
    s.commit("base")
    a, b = repo.writable_session(), repo.writable_session()
    zarr.open_array(a.store, path="a").attrs["x"] = 1
    zarr.open_array(b.store, path="a").attrs["x"] = 2
    a.commit("attrs a")
    with pytest.raises(zarrlake.ConflictError) as info:
        b.commit("attrs b")
    assert [c.kind for c in info.value.conflicts] == ["node"]

    a, b = repo.writable_session(), repo.writable_session()
    del zarr.open_group(a.store)["b"]
    zarr.open_array(b.store, path="b")[0, 0] = 9
    a.commit("delete b")
    with pytest.raises(zarrlake.ConflictError) as info:
        b.commit("write b")
    assert {c.kind for c in info.value.conflicts} == {"deleted-theirs"}
    assert "/b" not in [p for p in repo.diff(repo.resolve("main"), "main").added_nodes]


def test_resize_conflicts_with_chunk_write(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s)
    s.commit("base")
    a, b = repo.writable_session(), repo.writable_session()
    zarr.open_array(a.store, path="a").resize((4, 4))
    zarr.open_array(b.store, path="a")[0, 0] = 5
    a.commit("shrink")
    with pytest.raises(zarrlake.ConflictError) as info:
        b.commit("write")
    assert {c.kind for c in info.value.conflicts} == {"resized"}


def test_many_threads_commit_disjoint_chunks(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, shape=(8,), chunks=(1,), fill=0.0)
    s.commit("base")
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            w = repo.writable_session()
            zarr.open_array(w.store, path="a")[i] = i + 1
            w.commit(f"writer {i}")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    np.testing.assert_array_equal(read(repo, "main"), np.arange(1, 9))
    history = list(repo.log())
    assert len(history) == 10 and all(len(c.parents) <= 1 for c in history)


def test_lost_journal_response_is_not_a_conflict(repo: zarrlake.Repository) -> None:
    journal = repo.core.journal
    head = journal.current("main")
    entry = JournalEntry(head.seq + 1, head.snapshot, head.snapshot, head.time, "writer-1")
    assert journal.append("main", entry)
    # The same writer retries after a lost response: it recognizes its own entry.
    assert journal.append("main", entry)
    # Someone else racing for the same sequence number loses.
    assert not journal.append(
        "main", JournalEntry(head.seq + 1, head.snapshot, None, head.time, "w2")
    )
    assert repo.storage.exists(branch_entry_key("main", head.seq + 1))


def test_a_known_head_is_confirmed_only_by_its_own_entry(repo: zarrlake.Repository) -> None:
    # The check that a known head entry is still in place compares the bytes read with the
    # entry's own (no second decode); anything else at that key is parsed and judged.
    journal = repo.core.journal
    head = journal.current("main")  # read: this client now knows the entry and its bytes
    assert journal.known("main") is head
    key = branch_entry_key("main", head.seq)
    stored = repo.storage.get(key)
    assert journal.confirms("main", stored, head)
    assert not journal.confirms("main", None, head)
    # Another writer's entry at the same sequence number (a repository created anew here).
    other = JournalEntry(head.seq, head.snapshot, head.previous, head.time, "someone-else")
    assert not journal.confirms("main", other.encode(), head)
    assert not journal.confirms("main", b"not an entry", head)
    # The same entry written with other bytes (it no longer carries its snapshot) still is it.
    bare = JournalEntry(head.seq, head.snapshot, head.previous, head.time, head.writer)
    assert bare.encode() != stored and journal.confirms("main", bare.encode(), head)
    # An entry this client appended is known with the bytes it wrote.
    nxt = JournalEntry(head.seq + 1, head.snapshot, head.snapshot, head.time, "writer-1")
    assert journal.append("main", nxt) and journal.known("main") is nxt
    assert journal.confirms("main", repo.storage.get(branch_entry_key("main", nxt.seq)), nxt)
    assert not journal.confirms("main", stored, nxt)


# -- fork / merge of changesets --------------------------------------------------------------------


def test_fork_and_merge(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, shape=(8,), chunks=(2,), fill=0.0)  # metadata not committed yet: forks see it
    forks = [pickle.loads(pickle.dumps(s.fork())) for _ in range(4)]
    changesets = []
    for i, f in enumerate(forks):
        zarr.open_array(f.store, path="a")[2 * i : 2 * i + 2] = i + 1
        changesets.append(pickle.loads(pickle.dumps(f.changeset())))
    s.merge(*changesets)
    s.commit("forked work")
    np.testing.assert_array_equal(read(repo, "main"), [1, 1, 2, 2, 3, 3, 4, 4])

    other = repo.writable_session()
    with pytest.raises(zarrlake.ZarrlakeError):
        other.merge(changesets[0])


def test_forks_disagreeing_conflict(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, shape=(4,), chunks=(4,), fill=0.0)
    f1, f2 = s.fork(), s.fork()
    zarr.open_array(f1.store, path="a")[:] = 1
    zarr.open_array(f2.store, path="a")[:] = 2
    with pytest.raises(zarrlake.ConflictError):
        s.merge(f1.changeset(), f2.changeset())


# -- history, diff, merge, time travel -------------------------------------------------------------


def test_log_limit_and_diff(repo: zarrlake.Repository) -> None:
    ids = []
    for i in range(5):
        s = repo.writable_session()
        if i == 0:
            write_array(s, shape=(10,), chunks=(1,), fill=0.0)
        else:
            zarr.open_array(s.store, path="a")[i] = i
        ids.append(s.commit(f"c{i}"))
    assert [c.id for c in repo.log(limit=3)] == ids[::-1][:3]
    d = repo.diff(ids[1], ids[4])
    assert d.changed_chunks["/a"] == {(2,), (3,), (4,)}
    assert not d.added_nodes and not d.removed_nodes
    assert not repo.diff("main", "main")
    d0 = repo.diff(list(repo.log())[-1].id, "main")
    assert d0.added_nodes == {"/", "/a"} or d0.added_nodes == {"/a"}


def test_merge_three_way(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, shape=(4,), chunks=(1,), fill=0.0)
    s.commit("base")
    repo.create_branch("dev")
    for branch, idx, val in [("dev", 0, 1), ("main", 3, 2), ("dev", 1, 5), ("main", 1, 5)]:
        w = repo.writable_session(branch)
        zarr.open_array(w.store, path="a")[idx] = val
        w.commit(f"{branch} {idx}")
    dest_head = repo.lookup_branch("main")
    m = repo.merge("dev", "main")
    info = next(repo.log())
    assert info.id == m and info.parents == (dest_head, repo.lookup_branch("dev"))
    np.testing.assert_array_equal(read(repo, "main"), [1, 5, 0, 2])
    assert repo.merge("dev", "main") == m  # nothing new to merge

    for branch, val in [("dev", 7), ("main", 8)]:
        w = repo.writable_session(branch)
        zarr.open_array(w.store, path="a")[2] = val
        w.commit(f"{branch} conflict")
    with pytest.raises(zarrlake.MergeConflictError) as info:
        repo.merge("dev", "main")
    assert info.value.conflicts == [zarrlake.Conflict("chunk", "/a", (2,))]
    with pytest.raises(ValueError):
        repo.merge("dev", "main", strategy="theirs")
    head = repo.lookup_branch("main")
    repo.merge("dev", "main", strategy="dest-wins")
    assert read(repo, "main")[2] == 8
    repo.reset_branch("main", head)
    repo.merge("dev", "main", strategy="source-wins")
    assert read(repo, "main")[2] == 7


def test_time_travel(repo: zarrlake.Repository) -> None:
    s = repo.writable_session()
    write_array(s, shape=(2,), chunks=(2,), fill=1.0)
    c1 = s.commit("one")
    time.sleep(0.05)
    between = dt.datetime.now(dt.UTC)
    time.sleep(0.05)
    s = repo.writable_session()
    zarr.open_array(s.store, path="a")[:] = 2
    c2 = s.commit("two")
    assert read(repo, c1)[0] == 1 and read(repo, c2)[0] == 2
    ro = repo.readonly_session("main", as_of=between)
    assert ro.base == c1
    assert zarr.open_array(ro.store, path="a", mode="r")[0] == 1
    with pytest.raises(zarrlake.RefNotFound):
        repo.readonly_session("main", as_of=dt.datetime(2000, 1, 1, tzinfo=dt.UTC))


# -- O(change) -------------------------------------------------------------------------------------


def test_one_chunk_commit_rewrites_one_shard(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(
        storage, config=zarrlake.RepositoryConfig(inline_threshold_bytes=64, shard_max_refs=100)
    )
    s = repo.writable_session()
    arr = zarr.create_array(s.store, name="big", shape=(5000,), chunks=(1,), dtype="i4")
    arr[:] = np.arange(5000)
    s.commit("5000 chunks")
    snap = repo.core.objects.snapshot(repo.lookup_branch("main"))
    assert len(snap.shards) >= 50
    before = set(storage.list_keys("manifests/"))
    s = repo.writable_session()
    zarr.open_array(s.store, path="big")[2500] = -1
    s.commit("one chunk")
    written = set(storage.list_keys("manifests/")) - before
    assert 1 <= len(written) <= 2
    assert read(repo, "main", "big")[2500] == -1 and read(repo, "main", "big")[2499] == 2499


# -- corruption ------------------------------------------------------------------------------------


def test_corrupt_and_foreign_objects(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    write_array(s)
    c = s.commit("one")
    good = storage.get(snapshot_key(c))
    storage.put(snapshot_key(c), good[: len(good) // 2])
    fresh = zarrlake.Repository.open(storage)
    with pytest.raises(zarrlake.CorruptObject):
        fresh.readonly_session(c)
    # The branch's head entry carries its own copy of the snapshot, so the branch still reads;
    # fsck, which reads every snapshot object, reports the damage.
    assert read(zarrlake.Repository.open(storage), "main")[0, 0] == 1
    assert [p.key for p in zarrlake.Repository.open(storage).fsck().problems] == [snapshot_key(c)]
    storage.put(snapshot_key(c), b"PK\x03\x04 not ours")
    with pytest.raises(zarrlake.UnsupportedFormat):
        zarrlake.Repository.open(storage).readonly_session(c)
    storage.put(snapshot_key(c), good)
    assert read(zarrlake.Repository.open(storage), "main")[0, 0] == 1

    # A newer format's marker, or root (which holds the marker's record), is refused.
    storage.put("root", b"ZLAK\x09\x0cgarbage")
    with pytest.raises(zarrlake.UnsupportedFormat):
        zarrlake.Repository.open(storage)
    storage.delete_many(["root"])
    storage.put("repo", b"ZLAK\x09\x01garbage")
    with pytest.raises(zarrlake.UnsupportedFormat):
        zarrlake.Repository.open(storage)


def test_head_entry_carries_its_snapshot_and_a_wrong_copy_is_corrupt(
    storage: zarrlake.Storage, journal_only: None
) -> None:
    # The journal's entries (a published root carries copies of its heads' entries, checked
    # alike: tests/test_published_root.py).
    repo = zarrlake.Repository.create(storage)
    s = repo.writable_session()
    write_array(s)
    first = s.commit("one")
    s = repo.writable_session()
    zarr.open_array(s.store, path="a")[:] = 2.0
    second = s.commit("two")
    key = branch_entry_key("main", 2)
    entry = JournalEntry.decode(storage.get(key), key)
    assert entry.snapshot == second
    assert entry.snapshot_data == storage.get(snapshot_key(second))
    # A copy of another snapshot than the one the entry names is corruption, not a silent
    # switch to other data.
    wrong = JournalEntry(
        entry.seq,
        entry.snapshot,
        entry.previous,
        entry.time,
        entry.writer,
        entry.token,
        storage.get(snapshot_key(first)),
    )
    storage.put(key, wrong.encode())
    with pytest.raises(zarrlake.CorruptObject):
        zarrlake.Repository.open(storage).readonly_session("main")
    # Without a copy the entry is as valid as before: the snapshot object is read instead.
    bare = JournalEntry(
        entry.seq, entry.snapshot, entry.previous, entry.time, entry.writer, entry.token
    )
    storage.put(key, bare.encode())
    assert read(zarrlake.Repository.open(storage), "main")[0, 0] == 2.0


def test_async_twins(storage: zarrlake.Storage) -> None:
    import asyncio

    async def story() -> None:
        repo = await zarrlake.Repository.create_async(storage)
        assert await zarrlake.Repository.exists_async(storage)
        s = await repo.writable_session_async("main")
        write_array(s, fill=4.0)
        assert "/a" in (await s.status_async()).added_nodes
        c = await s.commit_async("async")
        assert await repo.lookup_branch_async("main") == c
        assert await repo.create_branch_async("dev") == c
        assert [i.message for i in await repo.log_async(limit=1)] == ["async"]
        assert not await repo.diff_async("main", "dev")
        with pytest.raises(zarrlake.RefNotFound):
            await repo.resolve_async("nope")

    asyncio.run(story())
    np.testing.assert_array_equal(
        read(zarrlake.Repository.open(storage), "dev"), np.full((8, 8), 4.0)
    )


REPOSITORY_TWINS = [
    "create",
    "open",
    "open_or_create",
    "exists",
    "list_branches",
    "lookup_branch",
    "create_branch",
    "reset_branch",
    "delete_branch",
    "list_tags",
    "refs",
    "lookup_tag",
    "create_tag",
    "delete_tag",
    "resolve",
    "log",
    "diff",
    "merge",
    "readonly_session",
    "writable_session",
    "expire",
    "gc",
    "compact",
    "fsck",
]
SESSION_TWINS = ("commit", "discard", "merge", "status")


@pytest.mark.parametrize(
    ("cls", "name"),
    [(zarrlake.Repository, n) for n in REPOSITORY_TWINS]
    + [(zarrlake.Session, n) for n in SESSION_TWINS],
)
def test_async_twins_are_declared_with_the_sync_signature(cls: type, name: str) -> None:
    """Every twin is an ``async def`` in a class body (visible to type checkers), taking exactly
    the parameters of the blocking method it runs."""
    import inspect

    declared = next(vars(c)[f"{name}_async"] for c in cls.__mro__ if f"{name}_async" in vars(c))
    fn = declared.__func__ if isinstance(declared, classmethod | staticmethod) else declared
    assert inspect.iscoroutinefunction(fn), f"{cls.__name__}.{name}_async is not an async def"
    sync = inspect.signature(getattr(cls, name))
    twin = inspect.signature(getattr(cls, f"{name}_async"))
    assert list(twin.parameters.values()) == list(sync.parameters.values())


def test_large_commit_writes_its_shards_as_it_cuts_them(repo: zarrlake.Repository) -> None:
    # Past SPILL_CHANGES chunk changes a commit hands shards to storage while cutting them; the
    # result is the same manifest: every ref reads back, every shard exists, fsck is clean.
    from zarrlake.commit import SPILL_CHANGES

    n = SPILL_CHANGES + 5_000
    s = repo.writable_session()
    zarr.create_array(
        s.store, name="x", shape=(n,), chunks=(1,), dtype="<i8", fill_value=0, compressors=None
    )
    for i in range(n):
        s.write(f"x/c/{i}", (i + 7).to_bytes(8, "little"))
    s.commit("many chunks")
    fresh = zarrlake.Repository.open(repo.storage)
    arr = zarr.open_array(fresh.readonly_session().store, path="x", mode="r")
    picks = [*range(0, n, 997), n - 1]
    assert np.array_equal(arr.get_orthogonal_selection(picks), np.array(picks) + 7)
    assert fresh.fsck().problems == []
    # A one-chunk commit on top rewrites one shard and keeps the rest.
    s = fresh.writable_session()
    zarr.open_array(s.store, path="x")[5] = -1
    s.commit("one")
    assert zarr.open_array(fresh.readonly_session().store, path="x", mode="r")[5] == -1


def test_a_write_during_a_commit_is_refused_not_lost(tmp_path: Path) -> None:
    """The commit reads the session's changes in place: a write (or delete, discard, second
    commit) arriving while it runs is refused with ReadOnlyError, instead of landing where neither
    the new snapshot nor the (then read-only) session keeps it."""
    from zarrlake.storage.local import LocalStorage

    at_snapshot, release = threading.Event(), threading.Event()

    class SnapshotWaits(LocalStorage):
        # A real local directory whose snapshot write waits: the commit is held mid-flight.
        def put(self, key: str, data: Any, *, create_only: bool = False) -> None:
            if key.startswith("snapshots/") and not release.is_set():
                at_snapshot.set()
                release.wait(30)
            super().put(key, data, create_only=create_only)

    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    repo = zarrlake.Repository.open(SnapshotWaits(tmp_path / "r"))
    session = repo.writable_session("main")
    arr = zarr.create_array(session.store, name="a", shape=(4,), chunks=(1,), dtype="i8")
    arr[0] = 1
    out: list[str] = []
    committer = threading.Thread(target=lambda: out.append(session.commit("first")))
    committer.start()
    try:
        assert at_snapshot.wait(30), "the commit never reached its snapshot write"
        with pytest.raises(zarrlake.ReadOnlyError, match="committing"):
            session.write("a/c/1", b"\x02" + bytes(7))
        with pytest.raises(zarrlake.ReadOnlyError, match="committing"):
            session.delete_prefix("a")
        with pytest.raises(zarrlake.ReadOnlyError, match="committing"):
            session.discard()
        with pytest.raises(zarrlake.ReadOnlyError, match="committing"):
            session.commit("second")
    finally:
        release.set()
        committer.join(30)
    assert out and not committer.is_alive()
    got = zarr.open_array(repo.readonly_session("main").store, path="a")[:]
    np.testing.assert_array_equal(got, [1, 0, 0, 0])
    with pytest.raises(zarrlake.ReadOnlyError):  # read-only once committed, as before
        session.write("a/c/1", b"\x02" + bytes(7))


def test_a_failed_commit_keeps_the_changes_and_the_session_writable(tmp_path: Path) -> None:
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    one = repo.writable_session("main")
    two = repo.writable_session("main")
    for s, v in ((one, 1), (two, 2)):
        zarr.create_array(s.store, name="a", shape=(2,), chunks=(1,), dtype="i8", overwrite=True)[
            0
        ] = v
    one.commit("one")
    with pytest.raises(zarrlake.ConflictError):
        two.commit("two", rebase=True)
    assert two.has_changes
    zarr.open_array(two.store, path="a")[1] = 5  # still writable after the failure
    np.testing.assert_array_equal(zarr.open_array(two.store, path="a")[:], [2, 5])

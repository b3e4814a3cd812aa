"""How many storage requests zarrlake makes for the operations issue 11 cares about.

The counts are today's, pinned exactly as regression guards: a change that adds a request to the
read or history path fails here. They are not the issue's targets (opening a repository and reading
one chunk in at most 3 requests; ``log()`` in at most 2) — an optimization that lowers a count
lowers the number here with it. No timing is asserted anywhere in this module.

Also here: the counting wrapper itself, and the two other counters the benchmark relies on (the
S3 server's request log, and the worker round trip that reports counts and peak RSS).
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import zarr

import zarrlake
import zarrlake.refs
from zarrlake.format.model import (
    WRITE_PROBE_KEY,
    branch_entry_key,
    head_marker_key,
    parse_marker_key,
    seq_from_entry_key,
)
from zarrlake.history import EXPIRY_PREFIX
from zarrlake.refs import BRANCH_KEYS, BranchJournal, newest_entries
from zarrlake_testkit.counting import CountingStorage, Counts
from zarrlake_testkit.servers import start_moto, stop

# The journal-only protocol's requests (repositories without a published root: made before it,
# SHA-256 ones, or on servers without compare-and-set). tests/test_published_root.py counts a
# published root's.
pytestmark = pytest.mark.usefixtures("journal_only")


ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _ops(counts: Counts) -> list[str]:
    return [op for op, _ in counts.calls()]


#: What opening a journal-only repository reads: the root it does not have and the mirror
#: marker in one round, then its marker.
JOURNAL_ONLY_OPEN = ["get_versioned", "get", "get"]

#: What ``list_branches()`` lists, in one concurrent round: every journal, every head marker.
BRANCH_LISTINGS = [("list", "refs/branch."), ("list", "refs/head.")]


def _settled(*repos: zarrlake.Repository) -> None:
    """Wait for the head markers that the repositories' commits write off the committer's path
    (on S3), so that a count begins after them."""
    for repo in repos:
        repo.core.journal.settle()


def _without_markers(storage: zarrlake.Storage) -> None:
    """Delete every marker: the refs as a client older than markers leaves them, or one killed
    between its entry (or tag record) and its marker."""
    storage.delete_many([i.key for i in storage.list("refs/") if parse_marker_key(i.key)])


# -- the wrapper ---------------------------------------------------------------------------------


def test_counting_storage_counts_one_request_per_protocol_call() -> None:
    counts = Counts(record_keys=True)
    storage = CountingStorage(zarrlake.Storage.memory(), counts)
    storage.put("a/1", b"one")
    storage.put("a/2", b"two", create_only=True)
    assert storage.get("a/1") == b"one"
    assert storage.get("a/2", (1, 3)) == b"wo"
    assert storage.head("a/1") is not None
    assert storage.exists("nope") is False
    assert [i.key for i in storage.list("a/")] == ["a/1", "a/2"]
    assert storage.list_keys("a/") == ["a/1", "a/2"]
    assert storage.list_dirs("") == ["a"]
    assert storage.delete_many(["a/1", "a/2"]) == 2
    assert counts.calls() == [
        ("put", "a/1"),
        ("put_create_only", "a/2"),
        ("get", "a/1"),
        ("get_range", "a/2"),
        ("head", "a/1"),
        ("head", "nope"),
        ("list", "a/"),
        ("list", "a/"),
        ("list_dirs", ""),
        ("delete_many", "a/1"),
    ]
    assert counts.total == 10
    assert counts.by_op()["list"] == 2
    counts.reset()
    assert counts.total == 0 and counts.calls() == []


def test_counting_storage_keeps_the_backends_capabilities_and_attributes(tmp_path: Path) -> None:
    inner = zarrlake.Storage.local(tmp_path)
    storage = CountingStorage(inner)
    assert storage.url == inner.url
    assert storage.concurrency == inner.concurrency
    assert storage.durable and storage.shared_across_processes
    # A storage the engine may ship to other processes stays picklable, counters included.
    import pickle

    storage.put("k", b"v")
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.get("k") == b"v"
    assert copy.counts.by_op() == {"put": 1, "get": 1}


# -- zarrlake's requests -------------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def counted(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], CountingStorage]:
    """A factory of fresh clients' storages on one repository location, all counted together."""
    counts = Counts(record_keys=True)
    if request.param == "local":
        return lambda: CountingStorage(zarrlake.Storage.local(tmp_path), counts)
    moto_s3 = request.getfixturevalue("moto_s3")
    prefix = f"counts-{tmp_path.name}"
    return lambda: CountingStorage(moto_s3.storage(prefix), counts)


# int64 elements per chunk: 1 KiB, above the inline threshold: each commit writes its chunk into
# a pack (of one chunk), read back with a ranged GET.
C = 128


def _repo_with_commits(make: Callable[[], CountingStorage], commits: int) -> list[str]:
    """A repository whose ``data`` array (1 KiB chunks) got ``commits`` one-chunk commits after
    the commit creating it; returns the commit ids, newest first."""
    repo = zarrlake.Repository.create(make())
    session = repo.writable_session("main")
    zarr.create_array(
        session.store,
        name="data",
        shape=(C * commits,),
        chunks=(C,),
        dtype="int64",
        compressors=None,
        fill_value=0,
    )
    session.commit("create")
    for k in range(commits):
        session = repo.writable_session("main")
        zarr.open_array(session.store, path="data")[C * k : C * (k + 1)] = k + 1
        session.commit(f"commit {k}")
    _settled(repo)
    return [c.id for c in repo.log("main")]


def test_open_and_read_one_chunk_of_the_branch_head(counted: Callable[[], CountingStorage]) -> None:
    _repo_with_commits(counted, 3)
    counts = counted().counts
    counts.reset()

    repo = zarrlake.Repository.open(counted())
    # The published root (absent: a journal-only repository) and, in the same round, the mirror
    # marker a mirror would have (see zarrlake.mirror: replication may copy a source's record
    # into a mirror); then the repository record. (A repository that publishes a root is open
    # after the first round: tests/test_published_root.py. An older one pays for the look at
    # its root with a round until `zarrlake upgrade`.)
    assert _ops(counts) == JOURNAL_ONLY_OPEN
    counts.reset()
    store = repo.readonly_session("main").store
    # The branch head (list + get): its journal entry carries the snapshot.
    assert _ops(counts) == ["list", "get"]
    counts.reset()
    arr = zarr.open_array(store, path="data", mode="r")
    assert _ops(counts) == []  # array metadata lives in the snapshot
    np.testing.assert_array_equal(arr[C : 2 * C], 2)
    assert _ops(counts) == ["get", "get_range"]  # the manifest, the chunk (in its pack)
    counts.reset()
    np.testing.assert_array_equal(arr[2 * C : 3 * C], 3)
    assert _ops(counts) == ["get_range"]  # the manifest is cached: the chunk alone


@pytest.mark.parametrize("how", ["create", "reset"])
def test_a_new_or_reset_branch_reads_like_a_committed_one(
    counted: Callable[[], CountingStorage], how: str
) -> None:
    ids = _repo_with_commits(counted, 2)
    repo = zarrlake.Repository.open(counted())
    repo.create_tag("v1", ids[1])  # a tag: resolving it does not read the snapshot
    if how == "create":
        repo.create_branch("dev", "v1")
    else:
        repo.create_branch("dev", "main")
        repo.reset_branch("dev", "v1")
    _settled(repo)
    counts = counted().counts
    counts.reset()

    store = zarrlake.Repository.open(counted()).readonly_session("dev").store
    # Open (JOURNAL_ONLY_OPEN); the head (list + get), whose entry carries the tagged snapshot.
    assert _ops(counts) == [*JOURNAL_ONLY_OPEN, "list", "get"]
    counts.reset()
    arr = zarr.open_array(store, path="data", mode="r")
    np.testing.assert_array_equal(arr[0:C], 1)
    np.testing.assert_array_equal(arr[C : 2 * C], 0)  # the tag is one commit behind main
    assert _ops(counts) == ["get", "get_range"]  # the manifest, the chunk (in its pack)


def test_reading_a_tag_costs_one_round_for_the_tag(counted: Callable[[], CountingStorage]) -> None:
    ids = _repo_with_commits(counted, 2)
    zarrlake.Repository.open(counted()).create_tag("v1", ids[1])
    repo = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    repo.readonly_session("v1")
    ops = _ops(counts)
    # No branch of that name (list); the record and its tombstone in one round; the snapshot.
    assert ops[0] == "list" and ops[-1] == "get"
    assert sorted(ops[1:-1]) == ["get", "head"]


@pytest.mark.parametrize(
    ("commits", "pages"),
    [
        (2, 0),
        pytest.param(63, 0, marks=pytest.mark.slow),
        pytest.param(64, 1, marks=pytest.mark.slow),
        pytest.param(300, 1, marks=pytest.mark.slow),
        pytest.param(1_100, 2, marks=pytest.mark.slow),
    ],
)
def test_log_reads_the_head_then_one_round_of_history_pages(
    counted: Callable[[], CountingStorage], commits: int, pages: int, request: pytest.FixtureRequest
) -> None:
    if commits > 1_000 and "s3" in request.node.callspec.id:
        pytest.skip("the same reads as on local storage; 1,100 commits on moto take ~30 s")
    ids = _repo_with_commits(counted, commits)
    repo = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    assert [c.id for c in repo.log("main")] == ids
    assert len(ids) == commits + 2  # the repository's initial commit, "create", the commits
    # The branch head (list + get; the entry carries the head snapshot, which carries the
    # records of up to 64 ancestors); the expiry marks (list); and, when the head's records do
    # not reach the root, the history pages its index names, in one concurrent round (sealed
    # every 63 commits, each folding in the one before it up to 1,008 records: one page holds
    # the history of 1,000 commits). On local storage the marks are listed with the pages; on
    # S3 while the head is found (test_log_lists_the_expiry_marks_while_it_finds_the_head).
    calls = counts.calls()
    head = [c for c in calls if c[1].startswith("refs/")]
    assert [op for op, _ in head] == ["list", "get"]
    rest = [c for c in calls if not c[1].startswith("refs/")]
    assert sorted(op for op, _ in rest) == ["get"] * pages + ["list"]
    assert all(key.startswith("history/") for op, key in rest if op == "get")
    assert [key for op, key in rest if op == "list"] == [EXPIRY_PREFIX]
    if "local" in request.node.callspec.id:
        assert calls[:2] == head  # in place, one after another
    # The pages are read once the head's snapshot has named them.
    assert all(calls.index(c) > calls.index(head[1]) for c in rest if c[0] == "get")


def test_log_lists_the_expiry_marks_while_it_finds_the_head(
    counted: Callable[[], CountingStorage], request: pytest.FixtureRequest
) -> None:
    """On S3 the listing of the expiry marks overlaps finding the head: the head's entry is
    held back until that listing has begun. Were the two one after the other, the entry's read
    would wait out its timeout and the log would fail."""
    if "local" in request.node.callspec.id:
        pytest.skip("local reads run in place, one after another (the test above)")
    ids = _repo_with_commits(counted, 3)
    listing_began = threading.Event()

    class Held(CountingStorage):
        def list_keys(self, prefix: str = "", *, limit: int | None = None) -> list[str]:
            if prefix.endswith(EXPIRY_PREFIX):
                listing_began.set()
            return super().list_keys(prefix, limit=limit)

        def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
            if key.startswith("refs/branch.main/") and not listing_began.wait(10):
                raise AssertionError("the head was read before the expiry marks were listed")
            return super().get(key, byte_range)

    inner = counted().inner
    repo = zarrlake.Repository.open(Held(inner))
    assert [c.id for c in repo.log("main")] == ids
    assert listing_began.is_set()


def test_the_newest_commit_alone_is_the_read_of_the_head(
    counted: Callable[[], CountingStorage],
) -> None:
    """``next(iter(log(ref, limit=1)))`` (what the operator reports of a branch head): the
    head's entry carries its snapshot, which is its record; the expiry marks and history pages
    are read only if the walk goes on past it."""
    ids = _repo_with_commits(counted, 3)
    repo = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    history = repo.log("main", limit=1)
    assert next(iter(history)).id == ids[0]
    assert _ops(counts) == ["list", "get"]
    assert list(history) == [] and history.truncated == []
    assert _ops(counts)[2:] == ["list"]  # exhausted: the expiry marks, to say where it ends


def test_list_branches_and_one_chunk_commit(counted: Callable[[], CountingStorage]) -> None:
    ids = _repo_with_commits(counted, 2)
    repo = zarrlake.Repository.open(counted())
    # Without main's marker, the listing reads its head entry, and this client learns it.
    _without_markers(repo.storage)
    counts = counted().counts
    counts.reset()
    assert list(repo.list_branches()) == ["main"]
    # Every journal and every head marker in one round of two listings, then the head.
    assert sorted(counts.calls()[:2]) == BRANCH_LISTINGS and _ops(counts)[2:] == ["get"]
    counts.reset()

    session = repo.writable_session("main")
    # This client's first write on S3 checks that the server keeps create-only writes: a
    # create-only write of the probe object (which exists: refused) and a read that finds it.
    probe = [("put_create_only", WRITE_PROBE_KEY), ("head", WRITE_PROBE_KEY)]
    if not repo.storage.conditional_writes_by_server:
        probe = []  # a directory makes them atomic itself: nothing to ask
    assert counts.calls()[: len(probe)] == probe
    # Listing the branches showed this client main's head: one concurrent round of two reads,
    # the head's own entry (still the one seen) and the key after it (absent), proves the head
    # has not moved. Two requests, as the listing and the read were, but one round trip.
    assert _ops(counts)[len(probe) :] == ["get", "get"]
    assert {key for _, key in counts.calls()[len(probe) :]} == {
        branch_entry_key("main", 3),
        branch_entry_key("main", 4),
    }
    counts.reset()
    assert repo.writable_session("main") is not None
    assert WRITE_PROBE_KEY not in {key for _, key in counts.calls()}  # asked once per storage
    counts.reset()
    zarr.open_array(session.store, path="data")[0:C] = 7
    assert counts.calls() == []  # the chunk waits in the session's pack, in memory
    new = session.commit("one chunk")
    _settled(repo)
    calls = counts.calls()
    # The pack holding the chunk, uploading while the rest goes on. No listing of the head: the
    # append of the entry after the session's base decides. The manifest to rewrite; then one
    # concurrent round: the new manifest, the transaction log, the snapshot, and a read of the
    # base's entry (still there: the repository was not replaced); then, once the pack is
    # written, the new head entry.
    packs = [call for call in calls if call[1].startswith("packs/")]
    assert [op for op, _ in packs] == ["put"]
    # (That the pack is written before the entry begins is pinned where it can fail:
    # test_write_packs.py, test_a_commit_writes_its_snapshot_while_the_last_pack_uploads...)
    marks = [call for call in calls if call[1].startswith("refs/head.")]
    commit = [call for call in calls if call not in packs and call not in marks]
    ops = [op for op, _ in commit]
    assert ops[0] == "get" and ops[-1] == "put_create_only"
    assert sorted(ops[1:-1]) == ["get", "put", "put", "put_create_only"]
    assert ("get", branch_entry_key("main", 3)) in calls
    assert commit[-1][1] == branch_entry_key("main", 4)  # the key just found absent
    # Once the entry is in (off the committer's path on S3): the new head's marker, then the
    # old head's marker deleted.
    guard = repo.core.id
    assert marks == [
        ("put", head_marker_key("main", 4, new, guard)),
        ("delete_many", head_marker_key("main", 3, ids[0], guard)),
    ]
    assert calls.index(marks[0]) > calls.index(commit[-1])


def test_a_known_head_is_checked_with_one_read_and_a_moved_one_found(
    counted: Callable[[], CountingStorage],
) -> None:
    _repo_with_commits(counted, 2)
    mine = zarrlake.Repository.open(counted())
    other = zarrlake.Repository.open(counted())
    counts = counted().counts
    base = mine.writable_session("main")  # learns the head (entry 3)
    counts.reset()
    assert mine.readonly_session("main").base == base.base
    assert _ops(counts) == ["get", "get"]  # entry 3: still there; entry 4: absent

    # Another client commits twice; this client's knowledge is now stale.
    for value in (8, 9):
        s = other.writable_session("main")
        zarr.open_array(s.store, path="data")[0:C] = value
        s.commit(f"other {value}")
    head = other.lookup_branch("main")
    _settled(other)
    counts.reset()
    assert mine.readonly_session("main").base == head
    remote = not counted().inline_read_bytes
    if remote:
        # Entry 3 still there and 4 found; then the listing names 5 (read: it carries its
        # snapshot), however far the branch moved.
        assert _ops(counts) == ["get", "get", "list", "get"]
    else:
        # Entry 3 still there and 4 found, then 5 found (each carrying its snapshot) and 6
        # absent: local reads cost less than a listing.
        assert _ops(counts) == ["get", "get", "get", "get"]
    for value in (10, 11, 12, 13):
        s = other.writable_session("main")
        zarr.open_array(s.store, path="data")[0:C] = value
        s.commit(f"other {value}")
    head = other.lookup_branch("main")
    _settled(other)
    counts.reset()
    assert mine.readonly_session("main").base == head
    # Moved further than the probes cover: listed (remote: listed at once, one round a
    # commit fewer).
    if remote:
        assert _ops(counts) == ["get", "get", "list", "get"]
    else:
        assert _ops(counts) == ["get", "get", "get", "get", "list", "get"]

    # The stale session commits: its first append (entry 4) fails, then it reads the head and
    # rebases onto it; nothing is lost.
    zarr.open_array(base.store, path="data")[C : 2 * C] = 5
    base.commit("mine, rebased")
    data = zarr.open_array(mine.readonly_session("main").store, path="data", mode="r")[:]
    assert list(data[:C]) == [13] * C and list(data[C : 2 * C]) == [5] * C


def _commit_first_chunk(repo: zarrlake.Repository, branch: str, value: int) -> str:
    """Commit ``value`` into the first chunk of ``data`` on ``branch``; returns the commit."""
    session = repo.writable_session(branch)
    zarr.open_array(session.store, path="data")[0:C] = value
    return session.commit(f"{value} on {branch}")


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "no-markers"])
def test_refs_are_one_listing_and_a_read_of_what_moved(
    counted: Callable[[], CountingStorage], markers: bool
) -> None:
    """``Repository.refs()`` (what the operator polls): one listing, then reads of only the
    head entries and tag records the listing shows without their markers and not seen as they
    are now; the same answer as ``list_branches()`` and ``list_tags()``, deleted branches and
    tags left out. Without markers (written by an older client), a read of each."""
    _repo_with_commits(counted, 2)
    writer = zarrlake.Repository.open(counted())

    def written() -> None:
        _settled(writer)
        if not markers:
            _without_markers(writer.storage)

    for name in ("dev", "gone"):
        writer.create_branch(name)
    writer.create_tag("v1", "main")
    writer.create_tag("v0", "main")
    writer.delete_tag("v0")
    writer.delete_branch("gone")
    written()
    watcher = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    refs = watcher.refs()
    if markers:
        assert counts.calls() == [("list", "refs/")]  # every head and tag from its marker
    else:
        assert _ops(counts) == ["list", "get", "get", "get", "get"]  # dev, gone, main; v1
    assert refs.branches == writer.list_branches() and list(refs.branches) == ["dev", "main"]
    assert refs.tags == writer.list_tags() == {"v1": writer.lookup_branch("main")}
    counts.reset()
    assert watcher.refs() == refs
    assert _ops(counts) == ["list"]  # nothing moved: nothing read

    moved = _commit_first_chunk(writer, "dev", 3)
    writer.create_tag("v2", "dev")
    written()
    main = writer.lookup_branch("main")
    counts.reset()  # the writer's requests counted too: from here on, only the watcher's
    refs = watcher.refs()
    assert refs.branches == {"dev": moved, "main": main}
    assert refs.tags["v2"] == moved
    if markers:
        assert _ops(counts) == ["list"]
        # A marker says a head's snapshot, not its entry: the next read of the head finds it
        # as a fresh client does.
        counts.reset()
        assert watcher.lookup_branch("dev") == moved
        assert _ops(counts) == ["list", "get"]
        return
    # The listing, then the new head of dev and the new tag's record, in one round.
    assert _ops(counts) == ["list", "get", "get"]
    assert {k for _, k in counts.calls()[1:]} == {branch_entry_key("dev", 1), "refs/tag.v2"}
    _head_is_known_from_the_listing(watcher, counts, "dev", moved)


def _head_is_known_from_the_listing(
    repo: zarrlake.Repository, counts: Counts, branch: str, head: str
) -> None:
    """What a listing taught ``repo``'s journal serves the next read of the head: no listing,
    one concurrent round of its entry and the key after it."""
    counts.reset()
    assert repo.lookup_branch(branch) == head
    assert _ops(counts) == ["get", "get"]


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "no-markers"])
def test_list_branches_is_one_round_of_listings_and_a_read_of_each_head_that_moved(
    counted: Callable[[], CountingStorage], markers: bool
) -> None:
    """One round of two listings (the journals, the head markers) for N branches whose heads
    have their markers; without markers, 2 + N requests in two rounds (before: a listing of the
    branch folders, then a listing and a read for each branch, 1 + 2N in three rounds); the two
    listings when no head moved. Deleted branches are left out: their newest entry, a
    tombstone, is read as a head (or marked as deleted)."""
    _repo_with_commits(counted, 2)
    writer = zarrlake.Repository.open(counted())

    def written() -> None:
        _settled(writer)
        if not markers:
            _without_markers(writer.storage)

    for name in ("dev", "gone", "x"):
        writer.create_branch(name)
    writer.delete_branch("gone")
    written()
    expected = {n: writer.lookup_branch(n) for n in ("dev", "main", "x")}
    reader = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    heads = reader.list_branches()
    assert heads == expected and list(heads) == ["dev", "main", "x"]
    assert sorted(counts.calls()[:2]) == BRANCH_LISTINGS
    assert _ops(counts)[2:] == ([] if markers else ["get", "get", "get", "get"])
    counts.reset()
    assert reader.list_branches() == heads
    assert _ops(counts) == ["list", "list"]  # nothing moved: nothing read

    moved = _commit_first_chunk(writer, "dev", 7)
    written()
    counts.reset()
    assert reader.list_branches() == {**heads, "dev": moved}
    assert sorted(counts.calls()[:2]) == BRANCH_LISTINGS
    if markers:
        assert counts.calls()[2:] == []
    else:
        assert counts.calls()[2:] == [("get", branch_entry_key("dev", 1))]
        _head_is_known_from_the_listing(reader, counts, "dev", moved)
    # A deleted branch made again: its new first entry is newer than its tombstone.
    again = writer.create_branch("gone", "x")
    written()
    counts.reset()
    assert reader.list_branches() == {**heads, "dev": moved, "gone": again}
    assert _ops(counts) == (["list", "list"] if markers else ["list", "list", "get"])


def test_a_listing_overtaken_by_a_commit_gives_way_to_what_is_newer(
    counted: Callable[[], CountingStorage],
) -> None:
    """Two races of one listing of the journals: the branch moved and compaction pruned the
    listed entry before it was read (that branch's head is then found on its own), and this
    client committed a newer head meanwhile (the listing does not make it forget that head)."""
    _repo_with_commits(counted, 1)
    storage = counted()
    writer = zarrlake.Repository.open(storage)
    asked = time.monotonic()
    listing = newest_entries("", storage.list(BRANCH_KEYS))
    [(_, info)] = listing.items()
    moved = _commit_first_chunk(writer, "main", 5)
    journal = BranchJournal(storage)
    seq = seq_from_entry_key(info.key)
    journal.prune("main", [seq])  # as compaction would, once the head has moved on
    assert journal.heads_listed(listing, asked) == {"main": moved}
    assert journal.known("main") is not None and journal.known("main").snapshot == moved
    # The other race: this journal learned a newer head than a listing made before shows.
    listing = newest_entries("", storage.list(BRANCH_KEYS))
    again = _commit_first_chunk(writer, "main", 6)
    assert journal.head("main").snapshot == again
    assert journal.heads_listed(listing, asked)["main"] == moved  # what the listing showed
    known = journal.known("main")
    assert known is not None and known.snapshot == again  # still the newer one


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "no-markers"])
def test_list_tags_is_one_listing_and_a_read_of_each_new_record(
    counted: Callable[[], CountingStorage], markers: bool
) -> None:
    """Tag records, tombstones and markers in one listing: one request for tags whose records
    have their markers; without markers, 1 + N requests for N tags (before: one listing of each,
    then a read of every record, each time), one when no tag changed; deleted tags left out, and
    a name's tombstone wins over its record."""
    ids = _repo_with_commits(counted, 2)
    writer = zarrlake.Repository.open(counted())
    for name, ref in (("v1", ids[1]), ("v2", ids[0]), ("old", ids[2])):
        writer.create_tag(name, ref)
    writer.delete_tag("old")
    if not markers:
        _without_markers(writer.storage)
    reader = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    assert reader.list_tags() == {"v1": ids[1], "v2": ids[0]}
    assert _ops(counts) == (["list"] if markers else ["list", "get", "get"])
    assert counts.calls()[0] == ("list", "refs/tag")
    counts.reset()
    assert reader.list_tags() == {"v1": ids[1], "v2": ids[0]}
    assert _ops(counts) == ["list"]  # nothing changed: nothing read
    writer.create_tag("v3", "main")
    writer.delete_tag("v1")
    if not markers:
        _without_markers(writer.storage)
    counts.reset()
    assert reader.list_tags() == {"v2": ids[0], "v3": ids[0]}
    expected = [("list", "refs/tag")] + ([] if markers else [("get", "refs/tag.v3")])
    assert counts.calls() == expected


def test_list_branches_reads_long_journals_a_branch_at_a_time(
    counted: Callable[[], CountingStorage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Journals holding more entries together than a few listing pages (compaction prunes them
    past the 8-day floor) cost more pages listed whole than a listing per branch does: past the
    bound, the listing stops and each branch's head is found on its own, with the same answer."""
    _repo_with_commits(counted, 2)  # main's journal: 3 entries
    writer = zarrlake.Repository.open(counted())
    writer.create_branch("dev")
    _settled(writer)
    expected = zarrlake.Repository.open(counted()).list_branches()
    monkeypatch.setattr(zarrlake.refs, "HEADS_FROM_ONE_LISTING", 3)
    reader = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    assert reader.list_branches() == expected
    # The listing given up past 3 entries; then the folders, and each head on its own.
    assert sorted(counts.calls()[:2]) == BRANCH_LISTINGS
    assert counts.calls()[2] == ("list_dirs", "refs/")
    assert counts.by_op()["list_dirs"] == 1


@pytest.mark.slow  # 1,000 appends: ~9 s on moto
def test_list_branches_lists_a_journal_past_one_page_whole(
    counted: Callable[[], CountingStorage],
) -> None:
    """The 8-day prune floor keeps every young entry, so a busy branch's journal is past one
    listing page (1,000 keys; on S3 the listing pages there): list_branches still lists the
    journals whole, up to HEADS_FROM_ONE_LISTING entries, not a branch at a time."""
    ids = _repo_with_commits(counted, 1)
    writer = zarrlake.Repository.open(counted())
    writer.create_branch("dev")
    for k in range(1_000):  # main's journal: 1,003 entries
        writer.reset_branch("main", ids[k % 2])
    _settled(writer)
    assert writer.lookup_branch("main") == ids[1]  # the last reset, k = 999
    reader = zarrlake.Repository.open(counted())
    counts = counted().counts
    counts.reset()
    assert reader.list_branches() == {"dev": ids[0], "main": ids[1]}
    assert sorted(counts.calls()[:2]) == BRANCH_LISTINGS
    assert "list_dirs" not in counts.by_op()


def test_refs_without_a_listing_read_each_ref(counted: Callable[[], CountingStorage]) -> None:
    _repo_with_commits(counted, 1)
    writer = zarrlake.Repository.open(counted())
    writer.create_tag("v1", "main")
    unlisted = counted()
    unlisted.supports_listing = False  # as a read-only HTTP storage: heads found by probing
    repo = zarrlake.Repository.open(unlisted)
    unlisted.counts.reset()
    refs = repo.refs()
    # What list_branches and list_tags do there, not the one listing of every ref.
    assert ("list", "refs/") not in unlisted.counts.calls()
    assert (refs.branches, refs.tags) == (writer.list_branches(), writer.list_tags())


def _packed_array(make: Callable[[], CountingStorage], chunks: int) -> np.ndarray:
    """``data``: ``chunks`` 1 KiB chunks written in one commit, then compacted into one pack
    (in key order, so chunks 0..9 lie side by side). Returns the array's values."""
    # Written as chunk objects (no packing at write time): compaction makes the pack.
    repo = zarrlake.Repository.create(make(), config={"pack_chunks_below_bytes": 0})
    values = np.arange(C * chunks, dtype="int64")
    with repo.transaction("main", message="write") as store:
        zarr.create_array(
            store, name="data", shape=values.shape, chunks=(C,), dtype="int64", compressors=None
        )[:] = values
    report = repo.compact(branch="main")
    assert report.packed_chunks == chunks and report.packs_written == 1
    return values


def test_a_batch_of_adjacent_packed_chunks_is_one_ranged_get(
    counted: Callable[[], CountingStorage],
) -> None:
    values = _packed_array(counted, 8)
    repo = zarrlake.Repository.open(counted())
    store = repo.readonly_session("main").store
    arr = zarr.open_array(store, path="data", mode="r")
    counts = counted().counts
    counts.reset()
    np.testing.assert_array_equal(arr[:C], values[:C])
    assert _ops(counts) == ["get", "get_range"]  # the manifest, the first chunk
    counts.reset()

    # Zarr reads the other seven chunks of this call together (its concurrency is 10).
    np.testing.assert_array_equal(arr[C:], values[C:])
    if counted().inner.inline_read_bytes:
        # A local pack is read on the event loop, chunk by chunk: a read of 1 KiB of a file
        # costs less than batching it would.
        assert _ops(counts) == ["get_range"] * 7
    else:
        # On S3, the seven ranges of one pack are fetched in one request.
        assert _ops(counts) == ["get_range"]
        assert counts.calls()[0][1].startswith("packs/")
    counts.reset()

    # A batch the store sees as one (get_partial_values) is one request on every backend,
    # in any order, with duplicates, partial ranges and a gap.
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype

    nbytes = C * 8
    keys = [("data/c/5", None), ("data/c/1", None), ("data/c/5", RangeByteRequest(8, 24))]
    keys.append(("data/c/3", RangeByteRequest(0, 16)))
    got = zarr.core.sync.sync(store.get_partial_values(default_buffer_prototype(), keys))
    raw = values.tobytes()
    assert [b.to_bytes() if b is not None else None for b in got] == [
        raw[5 * nbytes : 6 * nbytes],
        raw[1 * nbytes : 2 * nbytes],
        raw[5 * nbytes + 8 : 5 * nbytes + 24],
        raw[3 * nbytes : 3 * nbytes + 16],
    ]
    assert _ops(counts) == ["get_range"]


def test_a_repository_created_anew_under_a_client_is_never_written_through_old_knowledge(
    tmp_path: Path,
) -> None:
    """The known head of a deleted repository must not be trusted at a new one in its place:
    not to read (it would show the old data) and never to append (the new repository's branch
    would name a parent it does not have)."""
    storage = zarrlake.Storage.local(tmp_path / "r")
    old = zarrlake.Repository.create(storage)
    s = old.writable_session("main")
    zarr.create_array(s.store, name="data", shape=(4,), chunks=(2,), dtype="int64", fill_value=0)
    s.commit("old 1")
    s = old.writable_session("main")
    zarr.open_array(s.store, path="data")[:] = 1
    s.commit("old 2")
    stale = old.writable_session("main")  # based on entry 2, which this client knows
    zarr.open_array(stale.store, path="data")[:] = 7

    shutil.rmtree(tmp_path / "r")  # the repository is deleted, and created anew
    new = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path / "r"))
    s = new.writable_session("main")
    zarr.create_array(s.store, name="data", shape=(4,), chunks=(2,), dtype="int64", fill_value=0)
    s.commit("new 1")  # entry 1 of the new main; entry 2 is free
    new_head = new.lookup_branch("main")

    assert old.readonly_session("main").base == new_head  # not the old head from memory
    with pytest.raises(zarrlake.ZarrlakeError):
        stale.commit("through old knowledge")  # the base is not in this repository's history
    assert new.lookup_branch("main") == new_head
    assert new.fsck().ok


# -- the benchmark's other counters --------------------------------------------------------------


@pytest.fixture
def bench_modules() -> Iterator[dict[str, ModuleType]]:
    sys.path.insert(0, str(BENCH))
    try:
        yield {m: importlib.import_module(m) for m in ("harness", "tables", "workloads")}
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.slow
def test_moto_request_log_counts_every_http_request(
    tmp_path: Path, bench_modules: dict[str, ModuleType]
) -> None:
    import boto3

    log = bench_modules["harness"].RequestLog(str(tmp_path / "moto.log"))
    proc, endpoint = start_moto(log=log.path)
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        s3.create_bucket(Bucket="counted-bucket")
        mark = log.mark()
        s3.put_object(Bucket="counted-bucket", Key="p/x", Body=b"12345")
        s3.get_object(Bucket="counted-bucket", Key="p/x", Range="bytes=0-1")  # 206: coloured
        s3.head_object(Bucket="counted-bucket", Key="p/x")
        s3.list_objects_v2(Bucket="counted-bucket", Prefix="p/")
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket="counted-bucket", Key="p/missing")
        assert log.since(mark) == {"PUT": 1, "GET": 3, "HEAD": 1}
    finally:
        stop(proc)


def test_ratio_columns_are_zarrlakes_speed_over_the_peers(
    bench_modules: dict[str, ModuleType],
) -> None:
    tables, workloads = bench_modules["tables"], bench_modules["workloads"]
    res = {
        "random": {
            "zarr-local": {"read_ms": 1.0, "open_first_ms": 2.0},
            "zarrlake-local": {"read_ms": 2.0, "open_first_ms": 4.0, "read_requests": 1.0},
            "icechunk-local": {"read_ms": 3.0, "open_first_ms": 2.0},
        }
    }
    rows = tables.build_rows(res, workloads.Sizes.quick())
    header, body = tables._cells(rows)
    read = dict(zip(header, body[0], strict=True))
    assert read["zl÷zarr local"] == "0.50"  # zarrlake takes twice raw Zarr's time: half its speed
    assert read["zl÷ic local"] == "1.50"
    targets = {t.name: t for t in tables.build_targets(res, workloads.Sizes.quick())}
    speed = targets["random single-chunk read: speed ≥ 1.2x Icechunk's (local)"]
    assert (speed.measured, speed.result) == (1.5, "PASS")


@pytest.mark.slow
def test_bench_worker_reports_requests_and_peak_rss(tmp_path: Path) -> None:
    """One small benchmark through the real orchestrator and a real worker process."""
    out = tmp_path / "run.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--quick",
            "--only",
            "random",
            "--systems",
            "zarrlake-local",
            "--no-s3",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )
    m = json.loads(out.read_text())["results"]["random"]["zarrlake-local"]
    # The worker's repositories publish a root (it runs in a process of its own): the open's
    # round (the root, the mirror marker), the root again for the head, the manifest, the chunk.
    assert m["open_first_requests"] == 5
    assert m["read_requests"] == 1.0  # one chunk per read once the manifest is cached
    assert m["peak_rss_mib"] > 0
    assert m["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))

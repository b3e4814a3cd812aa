"""The published root (issue 39; DESIGN.md "The published root"): one object, replaced only by
compare-and-set, that opening a repository, listing its refs and ``log()`` read instead of the
journals; the journals still decide every race.

Request counts of a fresh client (counted at the storage wrapper: one per protocol call, the
same as at the wire), and the faults the design names: a crash between the append and the swap,
a lost swap response, racing swaps for different branches, a stale root read by a writer that
then appends, an old client against an upgraded repository, an upgrade racing commits. In every
case: no acknowledged commit lost, no reader shown a head older than one it was shown.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from tests.cli_helpers import Result

import zarrlake
from zarrlake.errors import PreconditionFailed, RootUnpublished, StorageError
from zarrlake.format.model import PUBLISHED_ROOT, REPO_KEY, RepoRecord
from zarrlake.format.root import ROOT_KEY, RootRecord
from zarrlake.storage.base import Versioned
from zarrlake_testkit.counting import CountingStorage, Counts, DelayedStorage

C = 128  # int64 elements per chunk: 1 KiB, above the inline threshold


def _ops(counts: Counts) -> list[str]:
    return [op for op, _ in counts.calls()]


def _root(storage: zarrlake.Storage) -> RootRecord:
    return RootRecord.decode(storage.get(ROOT_KEY))


def _commit(repo: zarrlake.Repository, branch: str, i: int) -> str:
    s = repo.writable_session(branch)
    try:
        a = zarr.open_array(s.store, path="data", mode="r+")
    except FileNotFoundError:
        a = zarr.create_array(
            s.store, name="data", shape=(64 * C,), chunks=(C,), dtype="i8", compressors=None
        )
    a[(i % 64) * C : (i % 64 + 1) * C] = i
    return s.commit(f"{branch} {i}")


@pytest.fixture(params=["local", "s3"])
def counted(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], CountingStorage]:
    """Fresh clients' storages on one repository location, counted together."""
    counts = Counts(record_keys=True)
    if request.param == "local":
        return lambda: CountingStorage(zarrlake.Storage.local(tmp_path / "r"), counts)
    moto_s3 = request.getfixturevalue("moto_s3")
    prefix = f"root-{tmp_path.name}"
    return lambda: CountingStorage(moto_s3.storage(prefix), counts)


# -- what a fresh reader pays --------------------------------------------------------------------


def test_a_new_repository_publishes_its_root(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    assert PUBLISHED_ROOT in repo.record.features
    root = _root(storage)
    assert root.repo == repo.record
    assert root.heads() == {"main": repo.lookup_branch("main")}
    # A SHA-256 repository is made for older zarrlake versions to write: journal-only.
    other = zarrlake.Storage.memory()
    old_style = zarrlake.Repository.create(other, content_hash="sha256")
    assert PUBLISHED_ROOT not in old_style.record.features and not other.exists(ROOT_KEY)


def test_open_and_read_one_chunk_is_five_requests(
    counted: Callable[[], CountingStorage],
) -> None:
    writer = zarrlake.Repository.create(counted())
    for i in range(3):
        _commit(writer, "main", i)
    counts = counted().counts
    counts.reset()
    repo = zarrlake.Repository.open(counted())
    # One round: the root (which holds the marker's record and every head) and the marker a
    # mirror would have.
    assert sorted(_ops(counts)) == ["get", "get_versioned"]
    counts.reset()
    arr = zarr.open_array(repo.readonly_session("main").store, path="data", mode="r")
    np.testing.assert_array_equal(arr[2 * C : 3 * C], 2)
    # The root again (so that a ref moved since the open is seen), the manifest, the chunk (in
    # its pack). Rounds: below.
    assert sorted(_ops(counts)) == ["get", "get_range", "get_versioned"]


#: A far away store's round trip, for the tests that count rounds (well above the client's own
#: time between two requests, on a loaded machine too).
LATENCY = 0.2


@pytest.fixture(params=["local", "s3"])
def far(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], zarrlake.Storage]:
    """Storages on one repository location without latency (for writers setting the scene);
    :func:`_far` makes a client's storage that has it."""
    if request.param == "local":
        return lambda: zarrlake.Storage.local(tmp_path / "r")
    moto_s3 = request.getfixturevalue("moto_s3")
    prefix = f"far-{tmp_path.name}"
    return lambda: moto_s3.storage(prefix)


def _far(storage: zarrlake.Storage, latency: float = LATENCY) -> DelayedStorage:
    return DelayedStorage(storage, latency, Counts(record_keys=True))


def _kinds(rounds: list[list[tuple[str, str]]]) -> list[list[str]]:
    """Each round's requests as "op key-kind" (a manifest's or pack's digest left out)."""
    return [sorted(f"{op} {key.split('/')[0]}" for op, key in r) for r in rounds]


def _opened_far_away(
    far: Callable[[], zarrlake.Storage],
) -> tuple[zarrlake.Repository, DelayedStorage, zarrlake.Repository]:
    """A writer's repository of 3 commits, and a fresh client's, opened far away."""
    writer = zarrlake.Repository.create(far())
    for i in range(3):
        _commit(writer, "main", i)
    storage = _far(far())
    return writer, storage, zarrlake.Repository.open(storage)


def test_open_and_read_one_chunk_takes_three_round_trips(
    far: Callable[[], zarrlake.Storage],
) -> None:
    _, storage, repo = _opened_far_away(far)
    arr = zarr.open_array(repo.readonly_session("main").store, path="data", mode="r")
    np.testing.assert_array_equal(arr[2 * C : 3 * C], 2)
    assert _kinds(storage.rounds()) == [
        ["get mirror", "get_versioned root"],  # the open
        # The root read again (a ref moved since the open is seen), and the manifest shard of
        # the head the open saw, together: the session's base is provisional until the root
        # answers, and the head had not moved.
        ["get manifests", "get_versioned root"],
        ["get_range packs"],  # the chunk
    ]


def test_a_head_moved_after_the_open_is_the_head_a_session_shows(
    far: Callable[[], zarrlake.Storage],
) -> None:
    writer, storage, repo = _opened_far_away(far)
    moved = _commit(writer, "main", 5)  # another client, after this one opened
    session = repo.readonly_session("main")
    arr = zarr.open_array(session.store, path="data", mode="r")
    np.testing.assert_array_equal(arr[5 * C : 6 * C], 5)
    assert session.base == moved
    # The shard read with the open's head was of no use: one round more, never a stale read.
    assert len(storage.rounds()) == 4


class _RootOnce(DelayedStorage):
    """Its next read of the root takes ``slow`` seconds more, or fails (``fail``: as a storage
    error that outlived its retries); once."""

    slow = 0.0
    fail = False

    def get_versioned(self, key: str) -> Versioned:
        if key == ROOT_KEY and (self.slow or self.fail):
            delay, failing, self.slow, self.fail = self.slow, self.fail, 0.0, False
            if failing:
                raise StorageError(f"{key}: 503 Slow Down (injected)")
            time.sleep(delay)
        return super().get_versioned(key)


def test_a_session_taken_before_this_client_commits_does_not_show_the_commit(
    far: Callable[[], zarrlake.Storage],
) -> None:
    writer = zarrlake.Repository.create(far())
    before = _commit(writer, "main", 0)
    storage = _RootOnce(far(), 0.02, Counts())
    repo = zarrlake.Repository.open(storage)
    storage.slow = 2.0  # the session's root read is still out when the commit below publishes
    old = repo.readonly_session("main")
    after = _commit(repo, "main", 7)
    # The commit waited for that read: the session shows the head it was taken on.
    assert old.base == before
    arr = zarr.open_array(old.store, path="data", mode="r")
    np.testing.assert_array_equal(arr[7 * C : 8 * C], 0)  # not written yet, there
    assert repo.readonly_session("main").base == after == repo.lookup_branch("main")


def test_a_root_read_ahead_that_fails_is_read_again_not_kept_as_the_answer(
    far: Callable[[], zarrlake.Storage],
) -> None:
    writer = zarrlake.Repository.create(far())
    head = _commit(writer, "main", 4)
    storage = _RootOnce(far(), 0.02, Counts())
    repo = zarrlake.Repository.open(storage)
    storage.fail = True
    session = repo.readonly_session("main")
    arr = zarr.open_array(session.store, path="data", mode="r")
    np.testing.assert_array_equal(arr[4 * C : 5 * C], 4)
    assert session.base == head and not storage.fail


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_process_forked_while_the_root_read_is_out_reads_it_itself(
    far: Callable[[], zarrlake.Storage],
) -> None:
    writer = zarrlake.Repository.create(far())
    head = _commit(writer, "main", 6)
    storage = _RootOnce(far(), 0.02, Counts())
    repo = zarrlake.Repository.open(storage)
    storage.slow = 1.0
    session = repo.readonly_session("main")  # its root read is out for a second
    pid = os.fork()
    if pid == 0:  # the child: the thread reading the root is not here
        code = 1
        try:
            signal.alarm(30)
            arr = zarr.open_array(session.store, path="data", mode="r")
            ok = bool((arr[6 * C : 7 * C] == 6).all()) and session.base == head
            after = _commit(repo, "main", 7)  # and its commits wait for no read of the parent
            code = 0 if ok and after else 1
        finally:
            os._exit(code)
    started = time.monotonic()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert time.monotonic() - started < 20
    # The parent's read came back after the child's commit landed, which, to this process,
    # is another client's: concurrent with the call, so either head may be the answer.
    assert session.base in (head, repo.lookup_branch("main"))


def test_a_branch_deleted_after_the_open_is_not_found_at_the_first_read(
    far: Callable[[], zarrlake.Storage],
) -> None:
    writer = zarrlake.Repository.create(far())
    head = _commit(writer, "main", 0)
    writer.create_branch("gone", head)
    repo = zarrlake.Repository.open(_far(far()))
    writer.delete_branch("gone")
    session = repo.readonly_session("gone")
    with pytest.raises(zarrlake.RefNotFound, match="gone"):
        zarr.open_array(session.store, path="data", mode="r")
    with pytest.raises(zarrlake.RefNotFound, match="gone"):
        session.base  # noqa: B018 - the property is the read
    with pytest.raises(zarrlake.RefNotFound, match="gone"):
        repo.readonly_session("gone")  # the root read now says so


def test_a_provisional_session_pickles_as_the_head_it_settles_on(
    far: Callable[[], zarrlake.Storage],
) -> None:
    writer = zarrlake.Repository.create(far())
    _commit(writer, "main", 0)
    repo = zarrlake.Repository.open(_far(far(), 0.02))
    moved = _commit(writer, "main", 3)
    copy = pickle.loads(pickle.dumps(repo.readonly_session("main")))
    assert copy.base == moved
    arr = zarr.open_array(copy.store, path="data", mode="r")
    np.testing.assert_array_equal(arr[3 * C : 4 * C], 3)


def test_listing_refs_is_one_read_whatever_their_number(
    counted: Callable[[], CountingStorage],
) -> None:
    writer = zarrlake.Repository.create(counted())
    head = _commit(writer, "main", 0)
    for i in range(30):
        writer.create_branch(f"b{i}", head)
        writer.create_tag(f"t{i}", head)
    counts = counted().counts
    repo = zarrlake.Repository.open(counted())
    for call in (repo.list_branches, repo.list_tags, repo.refs):
        counts.reset()
        got = call()
        assert _ops(counts) == ["get_versioned"], call
    assert len(repo.list_branches()) == 31 and len(repo.list_tags()) == 30
    refs = repo.refs()
    assert refs.branches == repo.list_branches() and refs.tags == repo.list_tags()
    assert got == refs  # the last call: refs()


def test_log_of_main_is_the_root_alone(counted: Callable[[], CountingStorage]) -> None:
    writer = zarrlake.Repository.create(counted())
    ids = [_commit(writer, "main", i) for i in range(150)]
    counts = counted().counts
    repo = zarrlake.Repository.open(counted())
    counts.reset()
    # The newest 64 commits are in the head snapshot, which the root carries: one read.
    assert [c.id for c in repo.log(limit=60)] == ids[::-1][:60]
    assert _ops(counts) == ["get_versioned"]
    counts.reset()
    # All 151 commits: the root alone, which carries main's newest history pages.
    everything = [c.id for c in zarrlake.Repository.open(counted()).log()]
    assert everything[:150] == ids[::-1] and len(everything) == 151
    ops = _ops(counts)
    assert ops[:2] in (["get_versioned", "get"], ["get", "get_versioned"])  # the open's round
    assert ops[2:] == ["get_versioned"], ops


def test_log_of_100_is_the_root_alone(counted: Callable[[], CountingStorage]) -> None:
    writer = zarrlake.Repository.create(counted())
    ids = [_commit(writer, "main", i) for i in range(150)]
    writer.create_branch("side", "main")  # a new branch starts from the recent history it forks
    side = [_commit(writer, "side", i) for i in range(3)]
    counts = counted().counts
    repo = zarrlake.Repository.open(counted())
    for branch, expected in (("main", ids[::-1][:100]), ("side", (ids + side)[::-1][:100])):
        counts.reset()
        # The head snapshot carries its newest 64 ancestors, the root the rest of the 100.
        assert [c.id for c in repo.log(branch, limit=100)] == expected, branch
        assert _ops(counts) == ["get_versioned"], branch
    # Past the recent history: main's newest history pages are in the root too...
    counts.reset()
    assert [c.id for c in repo.log(limit=140)] == ids[::-1][:140]
    assert _ops(counts) == ["get_versioned"]
    # ...and serve a branch whose history shares them (side has sealed no page of its own).
    counts.reset()
    assert [c.id for c in repo.log("side", limit=140)] == (ids + side)[::-1][:140]
    assert _ops(counts) == ["get_versioned"]
    root = _root(counted())
    assert set(root.recent) == {"main", "side"} and root.pages


def test_the_most_recently_moved_heads_carry_their_snapshots(storage: zarrlake.Storage) -> None:
    from zarrlake.format.model import JournalEntry
    from zarrlake.format.root import CARRY_HEADS

    repo = zarrlake.Repository.create(storage)
    head = _commit(repo, "main", 0)
    names = [f"b{i:02d}" for i in range(CARRY_HEADS + 4)]
    for name in names:  # b00 first: the oldest move when they are all made
        repo.create_branch(name, head)
    _commit(repo, "b00", 1)  # ...until it moves again: now the newest

    def carried(root: RootRecord) -> set[str]:
        return {
            n
            for n, h in root.branches.items()
            if JournalEntry.decode(h.entry).snapshot_data is not None
        }

    root = _root(storage)
    # main always (the branch most read), then the most recently moved others.
    expected = {"main", "b00", *names[-(CARRY_HEADS - 2) :]}
    assert carried(root) == expected and next(iter(root.branches)) == "b00"
    assert "b01" not in carried(root)
    # A reader of a head that carries none reads the snapshot object: the same answer.
    fresh = zarrlake.Repository.open(storage)
    assert fresh.lookup_branch("b01") == head
    assert zarr.open_array(fresh.readonly_session("b01").store, path="data")[0] == 0


def test_recent_history_is_an_index_a_damaged_one_costs_reads_not_answers(
    storage: zarrlake.Storage,
) -> None:
    repo = zarrlake.Repository.create(storage)
    ids = [_commit(repo, "main", i) for i in range(120)]
    found = storage.get_versioned(ROOT_KEY)
    root = RootRecord.decode(found.data)
    damaged = replace(root, recent={"main": b"ZLAK\x01\x09 not a page"})
    storage.put_if_version(ROOT_KEY, damaged.encode(), found.version)
    fresh = zarrlake.Repository.open(storage)
    assert [c.id for c in fresh.log(limit=100)] == ids[::-1][:100]
    # A commit replaces it from what the root carries (its head's records only, here).
    _commit(repo, "main", 120)
    assert [c.id for c in zarrlake.Repository.open(storage).log(limit=100)][1:] == ids[::-1][:99]


def test_a_damaged_copy_of_a_history_page_in_the_root_is_read_past(
    storage: zarrlake.Storage, caplog: pytest.LogCaptureFixture
) -> None:
    repo = zarrlake.Repository.create(storage)
    ids = [_commit(repo, "main", i) for i in range(140)]
    found = storage.get_versioned(ROOT_KEY)
    root = RootRecord.decode(found.data)
    assert root.pages
    bad = {digest: page[:-9] + b"123456789" for digest, page in root.pages.items()}
    storage.put_if_version(ROOT_KEY, replace(root, pages=bad).encode(), found.version)
    assert [c.id for c in zarrlake.Repository.open(storage).log()][:140] == ids[::-1]
    assert "damaged" in caplog.text


def test_a_commit_costs_one_request_more_at_most(counted: Callable[[], CountingStorage]) -> None:
    repo = zarrlake.Repository.create(counted())
    _commit(repo, "main", 0)
    counts = counted().counts
    counts.reset()
    _commit(repo, "main", 1)
    ops = _ops(counts)
    assert ops.count("put_if_version") == 1 and ops.count("get_versioned") <= 1, ops


# -- the journal decides, the root publishes ------------------------------------------------------


def test_every_ref_change_is_published(storage: zarrlake.Storage) -> None:
    repo = zarrlake.Repository.create(storage)
    first = _commit(repo, "main", 0)
    repo.create_branch("dev", first)
    second = _commit(repo, "dev", 1)
    repo.create_tag("v1", second)
    merged = repo.merge("dev", "main")
    repo.reset_branch("dev", first)
    repo.create_branch("gone", first)
    repo.delete_branch("gone")
    repo.create_tag("old", first)
    repo.delete_tag("old")
    root = _root(storage)
    assert root.heads() == {"main": merged, "dev": first}
    assert root.tags == {"v1": second}
    assert root.branches["gone"].snapshot is None
    assert zarrlake.Repository.open(storage).fsck().ok
    # Expiry and compaction: published, and the root still agrees with the journals.
    report = repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    assert report.expired and _root(storage).expired >= set(report.expired)
    fresh = zarrlake.Repository.open(storage)
    assert next(c.id for c in fresh.log("main")) == merged
    repo.compact(branch="main")
    assert zarrlake.Repository.open(storage).fsck().ok


def test_a_writer_killed_between_append_and_swap_loses_nothing(
    tmp_path: Path,
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    acknowledged = _commit(repo, "main", 0)
    # A child process appends its commit to the journal and dies (SIGKILL) before the swap.
    code = f"""
import os, signal, zarr, zarrlake
import zarrlake.published
def die(self, update):
    os.kill(os.getpid(), signal.SIGKILL)
zarrlake.published.PublishedRoot.publish = die
repo = zarrlake.Repository.open(zarrlake.Storage.local({str(tmp_path / "r")!r}))
s = repo.writable_session("main")
zarr.open_array(s.store, path="data", mode="r+")[{C}:{2 * C}] = 77
s.commit("killed before its swap")
"""
    done = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True)
    assert done.returncode == -9, done.stderr.decode()
    assert _root(storage).heads()["main"] == acknowledged  # never acknowledged: not shown
    fresh = zarrlake.Repository.open(storage)
    assert fresh.lookup_branch("main") == acknowledged
    # Not a problem (nothing is lost or wrong), but fsck says so, and --repair would publish it.
    report = fresh.fsck()
    assert report.ok and [n.kind for n in report.notes] == ["unpublished"]
    assert "entry 2" in report.notes[0].detail
    # The next commit (from a client that read the stale root) builds on the orphan entry.
    after = _commit(fresh, "main", 2)
    log = [c.message for c in zarrlake.Repository.open(storage).log()]
    assert log[:3] == ["main 2", "killed before its swap", "main 0"]
    assert _root(storage).heads()["main"] == after
    got = zarr.open_array(
        zarrlake.Repository.open(storage).readonly_session().store, path="data", mode="r"
    )[C : 2 * C]
    np.testing.assert_array_equal(got, 77)
    assert zarrlake.Repository.open(storage).fsck().ok


def _losing_responses(storage: zarrlake.Storage, lose: int) -> Callable[[], None]:
    """Make ``storage``'s next ``lose`` swaps land but fail as a reset connection would (their
    answers lost); returns what undoes it."""
    swap = storage.put_if_version
    left = [lose]

    def put_if_version(key: str, data: Any, version: str | None) -> str:
        written = swap(key, data, version)
        if left[0] > 0:
            left[0] -= 1
            raise StorageError(f"connection reset after the swap of {key} landed")
        return written

    storage.__dict__["put_if_version"] = put_if_version
    return lambda: storage.__dict__.pop("put_if_version")


def test_a_lost_swap_response_is_found_landed(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    first = _commit(repo, "main", 0)
    published = repo.core.journal.published
    assert published is not None
    undo = _losing_responses(storage, lose=1)
    # The commit is in the journal and its swap landed: the error says nothing is lost.
    with pytest.raises(RootUnpublished, match="could not be written"):
        _commit(repo, "main", 1)
    undo()
    head = zarrlake.Repository.open(storage).lookup_branch("main")
    assert head != first
    assert [c.message for c in zarrlake.Repository.open(storage).log()][:2] == ["main 1", "main 0"]
    # A swap that is retried finds its change already in and writes nothing more.
    before = _root(storage).generation
    assert published.publish(lambda r: r.with_head("main", *_head(storage))) is not None
    assert _root(storage).generation == before


def _head(storage: zarrlake.Storage) -> tuple[Any, bytes]:
    from zarrlake.format.model import JournalEntry

    held = _root(storage).branches["main"]
    return JournalEntry.decode(held.entry), held.entry


def _racing(storage_url: str, branch: str, n: int, seen_file: str) -> None:
    """A writer process: ``n`` commits to ``branch``; after each, the heads it reads."""
    repo = zarrlake.Repository.open(zarrlake.Storage.from_url(storage_url))
    with open(seen_file, "w") as out:
        for i in range(n):
            sid = _commit(repo, branch, 100 + i)
            heads = zarrlake.Repository.open(zarrlake.Storage.from_url(storage_url)).refs()
            out.write(f"{sid} {heads.branches[branch]} {_root(repo.storage).generation}\n")


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_racing_swaps_for_different_branches_never_regress_a_head(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "local":
        storage = zarrlake.Storage.local(tmp_path / "r")
    else:
        storage = request.getfixturevalue("moto_s3").storage(f"race-{tmp_path.name}")
    repo = zarrlake.Repository.create(storage)
    head = _commit(repo, "main", 0)
    writers, n = 4, 12
    for w in range(writers):
        repo.create_branch(f"w{w}", head)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_racing, args=(storage.url, f"w{w}", n, str(tmp_path / f"seen{w}.txt")))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    final = zarrlake.Repository.open(storage)
    for w in range(writers):
        lines = (tmp_path / f"seen{w}.txt").read_text().split()
        committed = lines[0::3]
        # Each commit, once acknowledged, is what a fresh reader sees (no one else writes
        # the branch), and the root's generation only grows.
        assert committed == lines[1::3]
        generations = [int(g) for g in lines[2::3]]
        assert generations == sorted(generations)
        log = [c.id for c in final.log(f"w{w}")]
        assert log[:n] == committed[::-1]  # every commit in its branch's log, in order
        assert final.lookup_branch(f"w{w}") == committed[-1]
    assert final.fsck().ok


def test_a_client_never_sees_the_root_go_back(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    _commit(repo, "main", 0)
    newer = _commit(repo, "main", 1)
    reader = zarrlake.Repository.open(storage)
    assert reader.lookup_branch("main") == newer
    # An older root put back in place (a restored backup, say): this client keeps the newer.
    older = _root(storage)
    storage.put(ROOT_KEY, RootRecord(older.repo, 0, {}, {}).encode())
    assert reader.lookup_branch("main") == newer


def test_a_damaged_or_missing_root_is_read_past_and_repaired(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    head = _commit(repo, "main", 0)
    repo.create_tag("v1", head)
    for damage in (b"not an object at all", None):
        if damage is None:
            storage.delete_many([ROOT_KEY])
        else:
            storage.put(ROOT_KEY, damage)
        fresh = zarrlake.Repository.open(storage)  # from the marker
        assert fresh.list_branches() == {"main": head} and fresh.list_tags() == {"v1": head}
        assert next(c.id for c in fresh.log()) == head
        report = fresh.fsck()
        assert [p.key for p in report.problems] == [ROOT_KEY]
        assert cli("fsck", str(tmp_path / "r")).code == 1
        r = cli("fsck", str(tmp_path / "r"), "--repair")
        assert "repaired root" in r.out
        assert _root(storage).heads() == {"main": head} and _root(storage).tags == {"v1": head}
        assert zarrlake.Repository.open(storage).fsck().ok
    # A writer whose root is gone writes it again from the journals, whole, with its change.
    storage.delete_many([ROOT_KEY])
    repo.create_branch("dev", head)
    after = _commit(zarrlake.Repository.open(storage), "main", 1)
    assert _root(storage).heads() == {"main": after, "dev": head}
    assert _root(storage).tags == {"v1": head}


def test_a_root_whose_head_carries_another_snapshot_is_corrupt(tmp_path: Path) -> None:
    from zarrlake.format.model import JournalEntry, snapshot_key
    from zarrlake.format.root import BranchHead

    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)
    first = _commit(repo, "main", 0)
    _commit(repo, "main", 1)
    root = _root(storage)
    held = root.branches["main"]
    entry = JournalEntry.decode(held.entry)
    wrong = replace(entry, snapshot_data=storage.get(snapshot_key(first))).encode()
    branches = {**root.branches, "main": BranchHead(held.seq, held.snapshot, wrong)}
    storage.put(ROOT_KEY, replace(root, branches=branches).encode())
    # A copy of another snapshot than the one the head names is corruption, never a silent
    # switch to other data.
    with pytest.raises(zarrlake.CorruptObject):
        zarrlake.Repository.open(storage).readonly_session("main")


@pytest.mark.parametrize("kw", [{"published_root": "no"}, {"verify_reads": "false"}])
def test_a_flag_that_is_no_bool_is_refused_before_anything_is_written(
    tmp_path: Path, kw: dict[str, Any]
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    with pytest.raises(zarrlake.InvalidArgument, match=next(iter(kw))):
        zarrlake.Repository.create(storage, **kw)  # "no" would have been true
    assert not (tmp_path / "r").exists() or not list(storage.list(""))
    zarrlake.Repository.create(storage)
    with pytest.raises(zarrlake.InvalidArgument, match="verify_reads"):
        zarrlake.Repository.open(storage, verify_reads="false")  # type: ignore[arg-type]


def test_a_pickled_copy_publishes_too(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = pickle.loads(pickle.dumps(zarrlake.Repository.create(storage)))
    head = _commit(repo, "main", 0)
    assert _root(storage).heads()["main"] == head


# -- upgrade -------------------------------------------------------------------------------------


def test_upgrade_an_existing_repository(
    storage: zarrlake.Storage, journal_only: None, cli: Callable[..., Result]
) -> None:
    repo = zarrlake.Repository.create(storage)
    head = _commit(repo, "main", 0)
    repo.create_branch("dev", head)
    repo.create_tag("v1", head)
    repo.expire(zarrlake.RetentionRules(default=zarrlake.Keep(last=1)))
    assert not storage.exists(ROOT_KEY)
    report = repo.upgrade()
    assert report.published_root and report.added == (PUBLISHED_ROOT,)
    assert (report.branches, report.tags) == (2, 1)
    assert "added published-root" in report.summary()
    assert PUBLISHED_ROOT in RepoRecord.decode(storage.get(REPO_KEY)).features
    root = _root(storage)
    assert root.heads() == {"main": head, "dev": head} and root.tags == {"v1": head}
    # This handle publishes from now on; a second upgrade changes nothing.
    after = _commit(repo, "dev", 1)
    assert _root(storage).heads()["dev"] == after
    again = zarrlake.Repository.open(storage).upgrade()
    assert again.published_root and again.added == ()
    assert zarrlake.Repository.open(storage).fsck().ok
    if not storage.url.startswith("memory:"):
        r = cli("upgrade", storage.url)
        assert r.code == 0 and "already up to date" in r.out


#: The last commit before the published root: its client is a zarrlake that predates it.
BEFORE_ROOT = "091a2cb"
ROOT = Path(__file__).resolve().parent.parent


def _older_client(tmp_path: Path) -> Path:
    """The client of :data:`BEFORE_ROOT`, from this checkout's history (skips where the
    history is not there: a shallow clone)."""
    out = tmp_path / "older"
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", BEFORE_ROOT, "client"],
        capture_output=True,
        timeout=120,
    )
    if archive.returncode != 0:
        pytest.skip(f"no {BEFORE_ROOT} in this checkout's history: {archive.stderr.decode()}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out / "client"


def test_an_older_zarrlake_reads_an_upgraded_repository_but_refuses_to_write(
    tmp_path: Path, journal_only: None
) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    _commit(zarrlake.Repository.create(storage), "main", 0)
    zarrlake.Repository.open(storage).upgrade()
    head = _commit(zarrlake.Repository.open(storage), "main", 1)
    before = sorted(o.key for o in storage.list(""))
    code = f"""
import zarrlake
repo = zarrlake.Repository.open(zarrlake.Storage.local({str(tmp_path / "r")!r}))
print(repo.lookup_branch("main"))
try:
    repo.writable_session("main")
except zarrlake.UnsupportedFormat as e:
    print("refused:", e)
"""
    env = {**os.environ, "PYTHONPATH": str(_older_client(tmp_path))}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # It reads the journals, which stay the truth, and refuses to write, naming the version.
    assert lines[0] == head
    assert lines[1].startswith("refused:") and "zarrlake >= 0.2" in lines[1], lines
    assert sorted(o.key for o in storage.list("")) == before


def test_upgrade_racing_commits_loses_no_commit(tmp_path: Path, journal_only: None) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    _commit(zarrlake.Repository.create(storage), "main", 0)
    stop, started = threading.Event(), threading.Event()
    committed: list[str] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            i = 1
            while not stop.is_set() or i < 6:
                # Each commit opens the repository anew, as a job would: before the upgrade it
                # commits through the journal alone, after it publishes.
                committed.append(_commit(zarrlake.Repository.open(storage), "main", i))
                if i == 2:
                    started.set()
                i += 1
        except BaseException as e:
            errors.append(e)
            started.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert started.wait(timeout=300)
    report = zarrlake.Repository.open(storage).upgrade()
    stop.set()
    thread.join(timeout=300)
    assert not errors, errors
    assert report.published_root
    # Every acknowledged commit is in the log, and the root names the last one: writers that
    # opened before the marker changed published nothing, and the next published commit (or
    # the upgrade's last step) carried them.
    log = [c.id for c in zarrlake.Repository.open(storage).log()]
    assert log[0] == committed[-1] == _root(storage).heads()["main"]
    assert set(committed) <= set(log)
    assert zarrlake.Repository.open(storage).fsck().ok


def test_a_mirror_promoted_while_its_source_upgrades_shows_every_commit_in_order(
    tmp_path: Path, journal_only: None
) -> None:
    from zarrlake.mirror import Mirror

    source_storage = zarrlake.Storage.local(tmp_path / "source")
    destination = zarrlake.Storage.local(tmp_path / "mirror")
    committed = [_commit(zarrlake.Repository.create(source_storage), "main", 0)]
    mirror = Mirror(zarrlake.Repository.open(source_storage), destination, tags=False)
    mirror.step()
    reader = zarrlake.Repository.open(destination)
    stop = threading.Event()
    errors: list[BaseException] = []
    shown: list[str] = []

    def writer() -> None:
        try:
            i = 1
            while not stop.is_set() or i < 8:
                committed.append(_commit(zarrlake.Repository.open(source_storage), "main", i))
                i += 1
        except BaseException as e:
            errors.append(e)

    def promoter() -> None:
        try:
            while not stop.is_set():
                mirror.step()
                shown.append(reader.lookup_branch("main"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=promoter)]
    for t in threads:
        t.start()
    while len(committed) < 4 and not errors:
        threading.Event().wait(0.01)
    report = zarrlake.Repository.open(source_storage).upgrade()
    while len(committed) < 8 and not errors:
        threading.Event().wait(0.01)
    stop.set()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert report.published_root
    mirror.step()
    source = zarrlake.Repository.open(source_storage)
    head = source.lookup_branch("main")
    assert head == committed[-1]
    # The mirror ends where the source is, with every acknowledged commit, in order...
    assert reader.lookup_branch("main") == head
    assert [c.id for c in reader.log()] == [c.id for c in source.log()]
    assert set(committed) <= {c.id for c in reader.log()}
    # ...and its one reader never saw main go back, before, during or after the upgrade.
    order = {sid: i for i, sid in enumerate(committed)}
    seen = [order[sid] for sid in shown]
    assert seen == sorted(seen), seen
    assert zarrlake.Repository.open(source_storage).fsck().ok


def test_upgrade_on_a_server_without_compare_and_set_changes_nothing(
    request: pytest.FixtureRequest, tmp_path: Path, journal_only: None
) -> None:
    from zarrlake_testkit.s3proxy import HeaderStrippingProxy

    moto = request.getfixturevalue("moto_s3")
    # A server that keeps create-only writes but ignores If-Match.
    with HeaderStrippingProxy(moto.endpoint, drop=("If-Match",)) as proxy:
        storage = zarrlake.Storage.s3(
            moto.bucket,
            f"nocas-{tmp_path.name}",
            endpoint_url=proxy.endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
        )
        repo = zarrlake.Repository.create(storage)
        report = repo.upgrade()
        assert not report.published_root and "compare-and-set" in report.reason
        assert not storage.exists(ROOT_KEY)
        assert PUBLISHED_ROOT not in RepoRecord.decode(storage.get(REPO_KEY)).features
        assert "not upgraded" in report.summary()
        # New repositories there keep the journal-only protocol too, with a warning.
        other = zarrlake.Storage.s3(
            moto.bucket,
            f"nocas2-{tmp_path.name}",
            endpoint_url=proxy.endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            allow_http=True,
        )
        made = zarrlake.Repository.create(other, published_root=None)
        assert PUBLISHED_ROOT not in made.record.features


def test_a_swap_that_keeps_losing_says_the_commit_is_in(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path / "r")
    repo = zarrlake.Repository.create(storage)

    def always_loses(key: str, data: Any, version: str | None) -> str:
        raise PreconditionFailed(key)

    storage.__dict__["put_if_version"] = always_loses
    with pytest.raises(RootUnpublished, match="swaps in a row"):
        _commit(repo, "main", 0)
    storage.__dict__.pop("put_if_version")
    assert zarrlake.Repository.open(storage).fsck(repair=True).repaired == (ROOT_KEY,)
    assert next(c.message for c in zarrlake.Repository.open(storage).log()) == "main 0"
    assert os.path.exists(tmp_path / "r" / ROOT_KEY)


def test_a_client_of_a_deleted_repository_does_not_leave_a_root_behind(tmp_path: Path) -> None:
    """A reclaim removes the root, then the marker, then the rest. A client that still holds the
    repository open and then moves a ref must not publish a root into the emptied location (it
    would name a repository that is not there): it is told the repository is gone."""
    storage = zarrlake.Storage.local(tmp_path / "repo")
    repo = zarrlake.Repository.create(storage)
    repo.create_branch("dev", repo.lookup_branch("main"))
    stale = zarrlake.Repository.open(zarrlake.Storage.local(tmp_path / "repo"))
    # The operator's reclaim has begun (root, then marker) when the stale client moves a ref
    # whose head it can still read (a Branch resource's deletion, racing its Repository's).
    storage.delete_many(["root", "repo"])
    with pytest.raises(zarrlake.RepositoryNotFound, match="deleted"):
        stale.delete_branch("dev")
    assert "root" not in storage.list_keys("")

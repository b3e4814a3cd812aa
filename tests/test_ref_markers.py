"""Head and tag markers: the empty objects whose keys let one listing of the refs say every
branch head and every tag (see ``zarrlake.format.model``). What a reader may trust in them, what
it must not, and that a marker missing or unwritable costs a read, never a wrong answer."""

from __future__ import annotations

import dataclasses
import datetime as dt
import pickle
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import zarr

import zarrlake
import zarrlake.refs
from zarrlake.core import RepositoryCore
from zarrlake.format.ids import new_snapshot_id
from zarrlake.format.model import (
    LAYOUT_KEY,
    Marker,
    branch_entry_key,
    head_marker_key,
    parse_marker_key,
    tag_key,
    tag_marker_key,
    tag_tombstone_key,
)
from zarrlake.maintenance.gc import gc_roots
from zarrlake.refs import (
    MARKER_LISTED_WINDOW,
    MARKER_WRITE_WINDOW_S,
    listed_markers,
    live_tag_records,
    new_writer_id,
    newest_entries,
    write_marker,
)
from zarrlake.storage.base import Buffer
from zarrlake_testkit.counting import CountingStorage, Counts

# Markers are the journal-only protocol's listing aid: repositories without a published root.
pytestmark = pytest.mark.usefixtures("journal_only")


def _markers(storage: zarrlake.Storage) -> list[Marker]:
    found = (parse_marker_key(i.key) for i in storage.list("refs/"))
    return [m for m in found if m is not None]


def _settled(repo: zarrlake.Repository) -> zarrlake.Repository:
    repo.core.journal.settle()  # head marker writes run off the committer's path
    return repo


def _commit(repo: zarrlake.Repository, branch: str, value: int) -> str:
    with repo.transaction(branch, message=f"{value}") as store:
        zarr.open_array(store, path="a")[:] = value
    _settled(repo)
    return repo.lookup_branch(branch)


def _with_array(repo: zarrlake.Repository) -> zarrlake.Repository:
    with repo.transaction("main", message="create") as store:
        zarr.create_array(store, name="a", shape=(4,), chunks=(4,), dtype="int64")[:] = 1
    return _settled(repo)


def _strip(storage: zarrlake.Storage, kind: str, name: str) -> None:
    """Delete the markers of one ref, as a writer killed between its record and its marker
    (or an older client) leaves it."""
    doomed = []
    for info in storage.list("refs/"):
        marker = parse_marker_key(info.key)
        if marker is not None and (marker.kind, marker.name) == (kind, name):
            doomed.append(info.key)
    storage.delete_many(doomed)


def test_each_ref_has_one_marker_naming_its_head(repo: zarrlake.Repository) -> None:
    _with_array(repo)
    repo.create_branch("dev")
    dev = _commit(repo, "dev", 2)
    repo.create_branch("gone")
    repo.delete_branch("gone")
    repo.create_tag("v1", "main")
    repo.create_tag("v0", "dev")
    repo.delete_tag("v0")
    _settled(repo)
    guard = repo.core.id
    markers = _markers(repo.storage)
    assert {m.guard for m in markers} == {guard}
    heads = sorted((m.name, m.seq, m.snapshot) for m in markers if m.kind == "head")
    journal = repo.core.journal
    assert heads == [
        ("dev", 1, dev),
        ("gone", 1, None),  # the tombstone's marker: a deleted branch costs no read either
        ("main", journal.current("main").seq, repo.lookup_branch("main")),
    ]
    # The tag's marker; the deleted tag's marker deleted with it.
    assert [(m.name, m.snapshot) for m in markers if m.kind == "tag"] == [
        ("v1", repo.lookup_branch("main"))
    ]
    # Every key is one the layout knows: deleting the repository deletes the markers too.
    assert all(LAYOUT_KEY.match(i.key) for i in repo.storage.list(""))


def test_a_fresh_listing_trusts_only_a_marker_of_this_repository_for_the_newest_entry(
    repo: zarrlake.Repository,
) -> None:
    """What a forged marker can and cannot do shows what a reader checks: a marker naming the
    newest entry with this repository's id is believed (the positive control); one with
    another repository's id, or two for one entry, are read through."""
    _with_array(repo)
    head = repo.core.journal.current("main")
    storage, guard = repo.storage, repo.core.id
    _settled(repo)
    _strip(storage, "head", "main")
    forged = "0" * 26  # a snapshot id that sorts before any other: listed first

    def fresh_head() -> str:
        return zarrlake.Repository.open(storage).list_branches()["main"]

    assert fresh_head() == head.snapshot  # no marker: the entry is read
    storage.put(head_marker_key("main", head.seq, forged, str(uuid.uuid4())), b"")
    assert fresh_head() == head.snapshot  # another repository's (deleted, made anew here)
    storage.put(head_marker_key("main", head.seq - 1, forged, guard), b"")
    assert fresh_head() == head.snapshot  # not the newest entry's
    storage.put(head_marker_key("main", head.seq, forged, guard), b"")
    assert fresh_head() == forged  # the positive control: such a marker is believed
    storage.put(head_marker_key("main", head.seq, head.snapshot, guard), b"")
    assert fresh_head() == head.snapshot  # two markers of one entry: read it


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_marker_older_than_its_entry_is_not_about_it(kind: str, tmp_path: Path) -> None:
    """A marker is written after its entry: one listed as older names an entry of the same
    number that was replaced (a repository restored over this location under the same id)."""
    storage = zarrlake.Storage.local(tmp_path) if kind == "local" else zarrlake.Storage.memory()
    repo = _with_array(zarrlake.Repository.create(storage))
    head = repo.core.journal.current("main")
    _strip(storage, "head", "main")
    forged = head_marker_key("main", head.seq, new_snapshot_id(), repo.core.id)
    storage.put(forged, b"")
    entry = repo.core.journal.entry_key("main", head.seq)
    entry_time = storage.head(entry).modified  # type: ignore[union-attr]
    storage.set_modified(forged, entry_time - dt.timedelta(seconds=5))  # type: ignore[attr-defined]
    assert zarrlake.Repository.open(storage).list_branches()["main"] == head.snapshot
    storage.set_modified(forged, entry_time)  # type: ignore[attr-defined]
    assert zarrlake.Repository.open(storage).list_branches()["main"] != head.snapshot
    # Nor is one listed long after its entry: a marker a client queued for a repository
    # deleted and made anew meanwhile (whose entry of that number is another).
    late = entry_time + MARKER_LISTED_WINDOW + dt.timedelta(seconds=1)
    storage.set_modified(forged, late)  # type: ignore[attr-defined]
    assert zarrlake.Repository.open(storage).list_branches()["main"] == head.snapshot


def test_a_marker_write_that_waited_too_long_is_dropped(tmp_path: Path) -> None:
    storage = zarrlake.Storage.local(tmp_path)
    key = head_marker_key("main", 3, new_snapshot_id(), str(uuid.uuid4()))
    write_marker(storage, key, None, time.monotonic() - MARKER_WRITE_WINDOW_S - 1)
    assert not storage.exists(key)
    write_marker(storage, key, None, time.monotonic())
    assert storage.exists(key)


def test_only_the_winner_of_an_entry_marks_it(repo: zarrlake.Repository) -> None:
    """Two writers race for entry N: the loser writes no marker (it knows it lost), and a
    writer whose create-only response was lost, finding its own entry, marks it."""
    _with_array(repo)
    mine = repo.core.journal
    theirs = zarrlake.Repository.open(repo.storage).core.journal
    head = mine.current("main")
    won = dataclasses.replace(
        head,
        seq=head.seq + 1,
        snapshot=new_snapshot_id(),
        writer=new_writer_id(),
        snapshot_data=None,
    )
    lost = dataclasses.replace(won, snapshot=new_snapshot_id(), writer=new_writer_id())
    assert mine.append("main", won) is True
    assert theirs.append("main", lost) is False
    assert theirs.append("main", won) is True  # the same entry: a retry after a lost response
    mine.settle()
    theirs.settle()
    marks = [(m.seq, m.snapshot) for m in _markers(repo.storage) if m.kind == "head"]
    assert (won.seq, lost.snapshot) not in marks
    assert (won.seq, won.snapshot) in marks


def test_a_head_this_client_committed_after_the_listing_stays_the_one_it_knows(
    repo: zarrlake.Repository,
) -> None:
    _with_array(repo)
    reader = zarrlake.Repository.open(repo.storage)
    listed = list(repo.storage.list("refs/"))
    marks = listed_markers("", listed)
    assert ("head", "main") in marks
    moved = _commit(reader, "main", 7)
    journal = reader.core.journal
    heads = journal.heads_listed(newest_entries("", listed), time.monotonic(), marks)
    assert heads["main"] == moved  # not the marked head the older listing shows


def test_fsck_reports_a_marker_that_disagrees_with_its_entry_or_record(
    repo: zarrlake.Repository,
) -> None:
    _with_array(repo)
    repo.create_tag("v1", "main")
    assert repo.fsck().ok
    head = repo.core.journal.current("main")
    guard = repo.core.id
    _strip(repo.storage, "head", "main")
    _strip(repo.storage, "tag", "v1")
    wrong_head = head_marker_key("main", head.seq, new_snapshot_id(), guard)
    wrong_tag = tag_marker_key("v1", new_snapshot_id(), guard)
    repo.storage.put(wrong_head, b"")
    repo.storage.put(wrong_tag, b"")
    report = zarrlake.Repository.open(repo.storage).fsck(check_chunks=False)
    assert {(p.kind, p.key) for p in report.problems} == {
        ("corrupt", wrong_head),
        ("corrupt", wrong_tag),
    }


def test_a_mirror_writes_and_trusts_no_markers(repo: zarrlake.Repository) -> None:
    """Its journals start anew under its source's id: a mirror made again in place could not
    tell its markers from a deleted one's. Its readers read each head."""
    record = dataclasses.replace(repo.core.record, mirror_of="s3://source/repository")
    core = RepositoryCore.build(repo.storage, record)
    assert core.journal.guard is None and core.tags.guard is None
    assert core.journal.root == "mirror/"


def test_a_writer_killed_between_its_entry_and_its_marker(storage: zarrlake.Storage) -> None:
    """Without the marker the reader reads that head alone (and the refs stay right); the next
    commit on the branch marks it again."""
    repo = _settled(_with_array(zarrlake.Repository.create(storage)))
    repo.create_branch("dev")
    repo.create_tag("v1", "main")
    _settled(repo)
    _strip(storage, "head", "main")
    _strip(storage, "tag", "v1")
    counts = Counts(record_keys=True)
    reader = zarrlake.Repository.open(CountingStorage(storage, counts))
    counts.reset()
    refs = reader.refs()
    main = repo.lookup_branch("main")
    assert refs.branches == {"dev": main, "main": main} and refs.tags == {"v1": main}
    gets = sorted(key for op, key in counts.calls() if op == "get")
    assert gets == [repo.core.journal.entry_key("main", 1), "refs/tag.v1"]
    again = _settled(zarrlake.Repository.open(storage))
    moved = _commit(again, "main", 3)
    _settled(again)
    counts.reset()
    fresh = zarrlake.Repository.open(CountingStorage(storage, counts))
    counts.reset()
    assert fresh.list_branches() == {"dev": main, "main": moved}
    assert [op for op, _ in counts.calls()] == ["list", "list"]  # the journals, the markers


class NoMarkers(CountingStorage):
    """A storage that fails every marker write, as an outage between a commit's entry and its
    marker would (or a key too long for the backend)."""

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        if parse_marker_key(key) is not None:
            raise ConnectionError(f"refused: {key}")
        super().put(key, data, create_only=create_only)


def test_markers_that_cannot_be_written_lose_nothing(storage: zarrlake.Storage) -> None:
    flaky = NoMarkers(storage, Counts())
    repo = _with_array(zarrlake.Repository.create(flaky))
    repo.create_branch("dev")
    dev = _commit(repo, "dev", 5)
    repo.create_tag("v1", "dev")
    repo.delete_branch("dev")
    _settled(repo)
    assert _markers(storage) == []
    fresh = zarrlake.Repository.open(storage)
    assert fresh.refs() == zarrlake.refs.Refs({"main": repo.lookup_branch("main")}, {"v1": dev})
    tagged = zarr.open_array(fresh.readonly_session("v1").store, path="a", mode="r")
    np.testing.assert_array_equal(tagged[:], 5)


def test_a_tag_name_too_long_for_a_marker_file(tmp_path: Path) -> None:
    """On a local directory a key's last part is a file name, at most 255 bytes: a tag name
    that fits its record's file but not its marker's gets no marker, and reads as any other."""
    repo = zarrlake.Repository.create(zarrlake.Storage.local(tmp_path))
    name = "t" * 240
    repo.create_tag(name, "main")
    assert [m for m in _markers(repo.storage) if m.kind == "tag"] == []
    fresh = zarrlake.Repository.open(zarrlake.Storage.local(tmp_path))
    assert fresh.list_tags() == {name: repo.lookup_branch("main")}


def test_tag_markers_are_parsed_from_the_right(storage: zarrlake.Storage) -> None:
    """Tags ``a``, ``a.b`` and one named like a marker's tail: each its own marker, in one
    listing."""
    repo = _with_array(zarrlake.Repository.create(storage))
    first = repo.lookup_branch("main")
    second = _commit(repo, "main", 2)
    tricky = f"a.{first}.{uuid.uuid4()}"
    for name, ref in (("a", first), ("a.b", second), (tricky, second)):
        repo.create_tag(name, ref)
    counts = Counts(record_keys=True)
    fresh = zarrlake.Repository.open(CountingStorage(storage, counts))
    counts.reset()
    assert fresh.list_tags() == {"a": first, "a.b": second, tricky: second}
    assert [op for op, _ in counts.calls()] == ["list"]


def test_compaction_deletes_the_markers_below_each_head(repo: zarrlake.Repository) -> None:
    """A marker whose delete failed (or that an older client's compaction left) is a key in
    every listing of the refs until compaction deletes it; the head's stays."""
    _with_array(repo)
    _settled(repo)
    head = repo.core.journal.current("main")
    stale = head_marker_key("main", 0, new_snapshot_id(), repo.core.id)
    repo.storage.put(stale, b"")
    repo.compact(branch="main")
    _settled(repo)
    marks = [m for m in _markers(repo.storage) if m.kind == "head"]
    assert [(m.seq, m.snapshot) for m in marks] == [
        (repo.core.journal.current("main").seq, repo.lookup_branch("main"))
    ]
    assert head.seq <= marks[0].seq


def test_gc_roots_read_the_tag_records_not_their_markers(repo: zarrlake.Repository) -> None:
    """What GC keeps rests on the records themselves: a wrong marker (forged, or rotten)
    can make a listing wrong, never a tagged snapshot deleted."""
    _with_array(repo)
    tagged = repo.lookup_branch("main")
    repo.create_tag("keep", tagged)
    _commit(repo, "main", 9)
    _strip(repo.storage, "tag", "keep")
    repo.storage.put(tag_marker_key("keep", new_snapshot_id(), repo.core.id), b"")
    fresh = zarrlake.Repository.open(repo.storage)
    assert fresh.list_tags()["keep"] != tagged  # the listing believes the marker
    # Its journal entry expired and older than the cutoff: only the tag keeps it.
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    roots = gc_roots(fresh.core, later, frozenset({tagged}))
    assert tagged in roots


def test_the_guard_travels_with_a_pickled_repository(repo: zarrlake.Repository) -> None:
    copy = pickle.loads(pickle.dumps(repo.core))
    assert copy.journal.guard == copy.tags.guard == repo.core.id
    journal = pickle.loads(pickle.dumps(repo.core.journal))
    assert journal.guard == repo.core.id


def test_a_short_lived_writer_leaves_no_marker_of_an_earlier_head(tmp_path: Path) -> None:
    """Markers of earlier heads are deleted in batches; a process that exits before its batch
    fills deletes the rest as it exits (one CLI command moving a branch, here)."""
    repo = _with_array(zarrlake.Repository.create(zarrlake.Storage.local(tmp_path)))
    repo.create_branch("dev")
    first = repo.lookup_branch("main")
    script = (
        "import sys, zarrlake\n"
        "repo = zarrlake.Repository.open(zarrlake.Storage.local(sys.argv[1]))\n"
        "repo.reset_branch('dev', sys.argv[2])\n"
    )
    second = _commit(repo, "main", 2)
    subprocess.run([sys.executable, "-c", script, str(tmp_path), second], check=True, timeout=120)
    dev = [(m.seq, m.snapshot) for m in _markers(repo.storage) if m.name == "dev"]
    assert dev == [(1, second)]  # not (0, first) beside it
    assert first != second


# -- reading a listing of the refs, in any order ---------------------------------------------------


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    journals=st.dictionaries(
        st.sampled_from(["a", "a.b", "main", "m/x", "50%", "z"]),
        st.sets(st.integers(0, 40), min_size=1, max_size=12),
        max_size=4,
    ),
    tags=st.dictionaries(st.sampled_from(["t", "t.1", "v/2"]), st.booleans(), max_size=3),
    stray=st.lists(st.sampled_from(["refs/branch.a/zz", "refs/branch.a/0", "refs/.probe"])),
    root=st.sampled_from(["", "mirror/"]),
    order=st.randoms(use_true_random=False),
)
def test_a_listing_is_read_the_same_in_any_order(
    journals: dict[str, set[int]],
    tags: dict[str, bool],
    stray: list[str],
    root: str,
    order: random.Random,
) -> None:
    """The newest entry of each journal, the live tags and the markers, from a listing's objects
    in the listing's order (the skips that make a long journal cheap rely on it) or in any
    other, and with keys no ref has."""
    when = dt.datetime(2026, 11, 29, tzinfo=dt.UTC)
    guard = str(uuid.UUID(int=7))
    snap = new_snapshot_id()
    keys = [branch_entry_key(name, seq) for name, seqs in journals.items() for seq in seqs]
    keys += [head_marker_key(name, max(seqs), snap, guard) for name, seqs in journals.items()]
    for name, deleted in tags.items():
        keys += [tag_key(name), tag_marker_key(name, snap, guard)]
        keys += [tag_tombstone_key(name)] if deleted else []
    infos = [zarrlake.storage.base.ObjectInfo(root + k, 0, when) for k in keys + stray]
    listing = sorted(infos, key=lambda i: i.key)
    shuffled = list(listing)
    order.shuffle(shuffled)
    want_heads = {name: root + branch_entry_key(name, max(seqs)) for name, seqs in journals.items()}
    want_tags = {name for name, deleted in tags.items() if not deleted}
    for listed in (listing, shuffled):
        assert {n: i.key for n, i in newest_entries(root, listed).items()} == want_heads
        assert set(live_tag_records(root, listed)) == want_tags
        marks = listed_markers(root, listed)
        assert {n for kind, n in marks if kind == "head"} == set(want_heads)
        assert {n for kind, n in marks if kind == "tag"} == set(tags)
